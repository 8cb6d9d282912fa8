"""The ns-3 backend: closed-form ring all-reduce, strict priority ordered as the flow simulator orders it, the CLI and its errors.

ns-3 is imported once for the module (parsing its headers takes tens of seconds); the runs themselves are small
(10 Gbit/s links, megabytes) so the module stays within about a minute.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from emu.ns3_backend import PACKET_OVERHEAD, Ns3Error, Ns3Options, band_of_priority, check_options
from emu.sim import simulate
from emu.workload import CollectivePhase, ComputePhase, Job, P2PPhase, Transfer, Workload, write_workload
from topology.fabrics import star
from topology.io import write_topology

HAS_NS3 = importlib.util.find_spec("ns") is not None
needs_ns3 = pytest.mark.skipif(not HAS_NS3, reason="needs the ns3 package (pip install 'netweave[ns3]')")
GBPS10 = 1.25  # GB/s


@pytest.fixture(scope="module")
def ns3():
    from emu.ns3_backend import import_ns3

    return import_ns3()


def ring(n: int, nbytes: float, iterations: int = 2) -> Workload:
    gpus = tuple(f"n{i}/gpu0" for i in range(n))
    return Workload("ring", (Job("a", gpus, (CollectivePhase("ar", "all_reduce", nbytes, algorithm="ring"),), iterations=iterations),))


@needs_ns3
def test_ring_all_reduce_matches_the_closed_form_on_an_idle_fabric(ns3):
    from emu.ns3_backend import run_ns3

    n, size = 4, 8e6
    result = run_ns3(star(n, nic_bw=GBPS10), ring(n, size))
    closed = 2 * (n - 1) / n * size / (GBPS10 * 1e9)
    times = result.jobs["a"].iteration_times()
    assert len(times) == 2 and result.backend == "ns3"
    for t in times:
        assert t == pytest.approx(closed, rel=0.05)
        assert t > closed * PACKET_OVERHEAD * 0.999  # headers cost what they cost: packets cannot beat bytes / goodput
    # the flow simulator is exact for the fluid model: ns-3 is slower by its headers and TCP's start, not by more
    sim = simulate(star(n, nic_bw=GBPS10), ring(n, size)).jobs["a"].iteration_times()
    assert sim[0] == pytest.approx(closed, rel=1e-9)


def two_jobs_one_bottleneck(prio_a: int, prio_b: int) -> Workload:
    def job(name: str, src: int, prio: int) -> Job:
        send = P2PPhase("send", (Transfer(f"n{src}/gpu0", "n2/gpu0", 4e6),), priority=prio)
        return Job(name, (f"n{src}/gpu0", "n2/gpu0"), (send, ComputePhase("compute", 1e-3, after=("send",))), iterations=2)

    return Workload("prio", (job("hi", 0, prio_a), job("lo", 1, prio_b)))


@needs_ns3
def test_strict_priority_orders_the_jobs_as_the_flow_simulator_does(ns3):
    from emu.ns3_backend import run_ns3

    topo = star(3, nic_bw=GBPS10)
    for prio_hi, prio_lo in ((0, 4), (6, 2)):
        w = two_jobs_one_bottleneck(prio_hi, prio_lo)
        sim = simulate(topo, w, sharing="strict")
        packets = run_ns3(topo, w)
        s_hi, s_lo = (sim.jobs[j].mean_iteration_time() for j in ("hi", "lo"))
        p_hi, p_lo = (packets.jobs[j].mean_iteration_time() for j in ("hi", "lo"))
        order_sim, order_ns3 = sorted(("hi", "lo"), key=lambda j: sim.jobs[j].mean_iteration_time()), sorted(
            ("hi", "lo"), key=lambda j: packets.jobs[j].mean_iteration_time())
        assert order_ns3 == order_sim, (s_hi, s_lo, p_hi, p_lo)
        # the favoured job runs at line rate while the other waits: its first send takes bytes / rate, not twice that
        first = min(packets.jobs[order_sim[0]].iteration_times())
        assert first < 1.5 * (4e6 / (GBPS10 * 1e9) + 1e-3)


def test_bands_and_bad_options():
    assert [band_of_priority(p) for p in range(8)] == list(range(1, 9))
    check_options(Ns3Options())
    for bad, where in [(Ns3Options(tcp="Reno"), "--ns3-tcp"), (Ns3Options(queue_packets=1), "--ns3-queue"),
                       (Ns3Options(min_rto_ms=0), "--ns3-min-rto-ms"), (Ns3Options(routing="random"), "--routing")]:
        with pytest.raises(Ns3Error, match=where):
            check_options(bad)


def _cli_inputs(tmp_path, workload: Workload):
    write_topology(star(3, nic_bw=GBPS10), tmp_path / "t.json")
    write_workload(workload, tmp_path / "w.yaml")
    return ["emu", "run", str(tmp_path / "w.yaml"), "--topology", str(tmp_path / "t.json"), "--backend", "ns3", "--out", str(tmp_path / "out")]


def test_cli_bad_options_and_a_missing_package_are_one_line(tmp_path, capsys, monkeypatch):
    from netweave.cli import main

    args = _cli_inputs(tmp_path, two_jobs_one_bottleneck(0, 4))
    for extra, expected in [(["--ns3-tcp", "Reno"], "--ns3-tcp: expected one of"), (["--ns3-queue", "0"], "--ns3-queue: expected an integer"),
                            (["--ns3-min-rto-ms", "-1"], "--ns3-min-rto-ms: expected a positive number")]:
        assert main(args + extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected in err[0], err
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ns" else real(name, *a))
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs the 'ns3' package" in err[0], err


@needs_ns3
def test_cli_run_with_the_ns3_backend(ns3, tmp_path, capsys):
    from netweave.cli import main

    assert main([*_cli_inputs(tmp_path, two_jobs_one_bottleneck(0, 4)), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["backend"] == "ns3" and {j["job"] for j in out["jobs"]} == {"hi", "lo"}
    assert (tmp_path / "out" / "result.json").exists() and (tmp_path / "out" / "timeline.png").exists()
