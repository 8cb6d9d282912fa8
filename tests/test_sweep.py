"""Sweeps: axes, the local pool (serial == parallel), the Ray executor's selection and its error without Ray, the CLI."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import sys
import types

import pytest

from emu import sweep as sw
from emu.workload import ComputePhase, Job, P2PPhase, Transfer, Workload, write_workload
from topology import LinkKind, NodeKind, Topology
from topology.errors import InputError

GB = 1e9


def star3() -> Topology:
    t = Topology("star3")
    t.add_node("sw", NodeKind.SWITCH, tier="leaf")
    for i in range(3):
        t.add_node(f"h/gpu{i}", NodeKind.GPU, host="h", index=i)
        t.add_link(f"h/gpu{i}", "sw", LinkKind.NETWORK, 10.0)
    return t


def two_jobs() -> Workload:
    def job(name, src):
        send = P2PPhase("send", (Transfer(f"h/gpu{src}", "h/gpu2", 10 * GB),))
        return Job(name, (f"h/gpu{src}", "h/gpu2"), (send, ComputePhase("compute", 1.0, after=("send",))), iterations=3)

    return Workload("two", (job("a", 0), job("b", 1)))


def test_parse_axes_and_errors():
    assert sw.parse_axes(["jobs.*.priority=0,1", "config.latency=true,false", "jobs.a.rate_cap=none,2.5"]) == {
        "jobs.*.priority": [0, 1], "config.latency": [True, False], "jobs.a.rate_cap": [None, 2.5]}
    with pytest.raises(sw.SweepError, match="expected FIELD=V1"):
        sw.parse_axes(["jobs.a.priority"])
    w = two_jobs().to_dict()
    with pytest.raises(sw.SweepError, match="no job named 'zz'"):
        sw.apply_point(w, {}, {"jobs.zz.priority": 1})
    with pytest.raises(sw.SweepError, match="a job field is one of"):
        sw.apply_point(w, {}, {"jobs.a.colour": 1})
    with pytest.raises(sw.SweepError, match="has no phase 'nope'"):
        sw.apply_point(w, {}, {"jobs.a.phases.nope.bytes": 1})


def test_bad_values_are_caught_before_running():
    with pytest.raises(InputError, match=r"jobs\[1\]\.priority: expected a priority class"):
        sw.sweep(star3(), two_jobs(), {"jobs.b.priority": [0, 9]}, executor=sw.LocalExecutor(1))


def test_sweep_finds_the_cassini_shift():
    table = sw.sweep(star3(), two_jobs(), {"jobs.b.start_offset": [0.0, 0.5, 1.0]}, executor=sw.LocalExecutor(1))
    iters = [r["jobs"]["a"]["mean_iteration_s"] for r in table["rows"]]
    assert iters[0] == pytest.approx(3.0) and iters[2] == pytest.approx(2.0)
    assert table["best"]["point"] == {"jobs.b.start_offset": 1.0}
    assert "best:" in sw.format_sweep(table)


def test_process_pool_gives_the_serial_rows():
    axes = {"jobs.b.start_offset": [0.0, 1.0], "config.sharing": ["strict", "weighted"], "jobs.a.phases.send.priority": [0, 1]}
    serial = sw.sweep(star3(), two_jobs(), axes, executor=sw.LocalExecutor(1))
    pooled = sw.sweep(star3(), two_jobs(), axes, executor=sw.LocalExecutor(2))
    assert pooled["rows"] == serial["rows"]
    assert len({r["id"] for r in serial["rows"]}) == 8  # content addresses differ per point


def test_ray_executor_without_ray_is_a_clear_error(monkeypatch, tmp_path, capsys):
    from netweave.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert isinstance(sw.get_executor("auto"), sw.LocalExecutor)
    with pytest.raises(sw.SweepError, match=r"needs the 'ray' package"):
        sw.get_executor("ray")
    write_workload(two_jobs(), tmp_path / "w.yaml")
    from topology.io import write_topology

    write_topology(star3(), tmp_path / "t.json")
    assert main(["emu", "sweep", str(tmp_path / "w.yaml"), "--topology", str(tmp_path / "t.json"), "--set", "jobs.b.start_offset=0,1",
                 "--address", "127.0.0.1:6379"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs the 'ray' package" in err[0]


def test_auto_picks_ray_only_for_a_cluster_address(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert isinstance(sw.get_executor("auto"), sw.LocalExecutor)
    if importlib.util.find_spec("ray") is not None:
        executor = sw.get_executor("auto", address="10.1.2.3:6379")
        assert isinstance(executor, sw.RayExecutor) and executor.address == "10.1.2.3:6379" and executor.ship_code
        monkeypatch.setenv("RAY_ADDRESS", "10.1.2.3:6379")
        assert isinstance(sw.get_executor("auto"), sw.RayExecutor)
    with pytest.raises(sw.SweepError, match="use it with --executor ray"):
        sw.get_executor("local", address="10.1.2.3:6379")


def test_ray_executor_protocol_with_a_stand_in(monkeypatch):
    """What the executor asks of Ray (init once, resources per task, wait for progress, shut down what it started)."""
    calls = {"init": [], "remote": [], "wait": 0, "shutdown": 0}

    class _Ref:
        def __init__(self, value):
            self.value = value

    fake = types.ModuleType("ray")
    fake.is_initialized = lambda: bool(calls["init"]) and not calls["shutdown"]
    fake.init = lambda **kw: calls["init"].append(kw)
    fake.shutdown = lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1)

    def remote(**options):
        calls["remote"].append(options)

        def wrap(fn):
            return types.SimpleNamespace(remote=lambda x: _Ref(fn(x)))

        return wrap

    def wait(pending, num_returns=1):
        calls["wait"] += 1
        return pending[:num_returns], pending[num_returns:]

    fake.remote, fake.wait = remote, wait
    fake.get = lambda refs: [r.value for r in refs]
    fake.exceptions = types.SimpleNamespace(RayTaskError=type("RayTaskError", (Exception,), {}))
    fake.__spec__ = importlib.machinery.ModuleSpec("ray", None)
    monkeypatch.setitem(sys.modules, "ray", fake)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: fake.__spec__ if name == "ray" else real(name, *a))
    executor = sw.get_executor("ray", resources={"mininet": 1}, max_workers=2)
    ticks = []
    table = sw.sweep(star3(), two_jobs(), {"jobs.b.start_offset": [0.0, 1.0]}, executor=executor, progress=lambda d, t: ticks.append((d, t)))
    assert table["executor"] == "ray" and len(calls["init"]) == 1 and calls["init"][0]["num_cpus"] == 2 and calls["shutdown"] == 1
    assert "runtime_env" not in calls["init"][0]  # a local instance imports the code from this machine
    assert calls["remote"] == [{"num_cpus": 1, "resources": {"mininet": 1}}] and calls["wait"] == 2
    assert ticks == [(0, 2), (1, 2), (2, 2)]
    assert [r["jobs"]["a"]["mean_iteration_s"] for r in table["rows"]] == pytest.approx([3.0, 2.0])


def test_local_executor_reports_progress_in_any_order_and_keeps_the_order():
    for workers in (1, 2):
        ticks: list[tuple[int, int]] = []
        assert sw.LocalExecutor(workers).map(abs, [-3, 1, -2], lambda d, t, ticks=ticks: ticks.append((d, t))) == [3, 1, 2]
        assert ticks == [(0, 3), (1, 3), (2, 3), (3, 3)]


def test_bad_addresses_are_refused_at_once():
    if importlib.util.find_spec("ray") is None:
        pytest.skip("needs the ray package")
    for bad, why in [("nohost", "expected HOST:PORT"), ("h:99999", "expected HOST:PORT"), ("127.0.0.1:1", "no Ray head answers there")]:
        with pytest.raises(sw.SweepError, match=why):
            sw.RayExecutor(address=bad).map(abs, [1])


def test_cli_sweep_and_example(tmp_path, capsys):
    from netweave.cli import main

    topo_path = tmp_path / "t.json"
    from topology.io import write_topology

    write_topology(star3(), topo_path)
    write_workload(two_jobs(), tmp_path / "w.yaml")
    rc = main(["emu", "sweep", str(tmp_path / "w.yaml"), "--topology", str(topo_path), "--set", "jobs.b.start_offset=0,1",
               "--executor", "local", "--workers", "1", "--out", str(tmp_path), "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["best"]["point"] == {"jobs.b.start_offset": 1}
    assert (tmp_path / "sweep.json").exists()
    assert main(["emu", "sweep", str(tmp_path / "w.yaml"), "--topology", str(topo_path), "--set", "jobs.q.priority=1"]) == 2
    assert "no job named 'q'" in capsys.readouterr().err
