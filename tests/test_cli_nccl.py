"""``netweave flow nccl``: the NCCL hook from the command line (build, env, check-plan, ring, loopback)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from flowsched import ncclhook
from netweave.cli import main


@pytest.fixture(scope="module")
def build_dir():
    return ncclhook.build()


def run_json(capsys, *argv: str):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_loopback_and_env_follow_the_plan(build_dir, tmp_path, capsys):
    plan = ncclhook.write_plan(ncclhook.FlowPlan(classes={3: ncclhook.ClassMark(dscp=46, rate=50_000_000)}), tmp_path / "p.plan")
    t = run_json(capsys, "flow", "nccl", "loopback", "--class", "3", "--plan", str(plan))
    assert t["bytes"] == t["expected_bytes"] > 0 and t["version"] == 12
    socks = t["marks"]["sender"] + t["marks"]["receiver"]
    assert {m["tos"] for m in socks} == {46 << 2} and {m["prio"] for m in socks} == {3}
    assert any(m["pacing"] < 2**63 for m in socks)  # the class's rate paces the data sockets
    env = run_json(capsys, "flow", "nccl", "env", "--transport", "tcp", "--plan", str(plan), "--ring", "/dev/shm/r.%p")
    assert env["NCCL_NET"] == "netweave" and os.path.exists(env["NCCL_NET_PLUGIN"])
    assert env["NETWEAVE_PLAN"] == str(plan.resolve()) and env["NETWEAVE_PROF_RING"] == "/dev/shm/r.%p"
    assert env["NCCL_PROFILER_PLUGIN"] == env["NCCL_NET_PLUGIN"] and "NCCL_TUNER_PLUGIN" not in env  # only the plugins asked for
    assert main(["flow", "nccl", "env", "--transport", "tcp", "--plan", str(plan)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("# tcp fabric") and out[1].startswith("export NCCL_NET_PLUGIN=")
    assert run_json(capsys, "flow", "nccl", "check-plan", str(plan))["classes"]["3"]["dscp"] == 46


def test_env_keeps_nccls_ib_transport_on_infiniband_and_roce(tmp_path, capsys):
    """The default cluster is InfiniBand: NCCL keeps its IB transport; the class rides on NCCL_IB_TC (DSCP << 2) and NCCL_IB_SL."""
    env = run_json(capsys, "flow", "nccl", "env", "--class", "5")
    assert env == {"NCCL_IB_TC": str(40 << 2), "NCCL_IB_SL": "5"}
    plan = ncclhook.write_plan(ncclhook.FlowPlan(classes={5: ncclhook.ClassMark(dscp=46)}), tmp_path / "p.plan")
    env = run_json(capsys, "flow", "nccl", "env", "--transport", "roce", "--class", "5", "--plan", str(plan), "--tuner")
    assert env["NCCL_IB_TC"] == str(46 << 2) and "NCCL_NET" not in env and "NCCL_NET_PLUGIN" not in env
    assert env["NCCL_TUNER_PLUGIN"].endswith(ncclhook.PLUGIN_LIB) and env["NETWEAVE_PLAN"] == str(plan.resolve())
    topo = tmp_path / "star.json"
    from topology.fabrics import star
    from topology.io import write_topology

    write_topology(star(2), topo)
    assert run_json(capsys, "flow", "nccl", "env", "--topology", str(topo))["NCCL_NET"] == "netweave"


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.plan"
    bad.write_text("netweave-plan 1\nclass 9 dscp=1\n")
    assert main(["flow", "nccl", "check-plan", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bad.plan: line 2: class must be" in err
    assert main(["flow", "nccl", "loopback", "--plan", str(bad)]) == 2
    assert main(["flow", "nccl", "loopback", "--class", "8"]) == 2
    assert "--class must be 0..7" in capsys.readouterr().err


def test_ring_lists_the_profilers_events(build_dir, tmp_path, capsys):
    env = {**os.environ, "NETWEAVE_PROF_RING": str(tmp_path / "ring"), "NETWEAVE_PROF_CAPACITY": "1024"}
    subprocess.run([str(build_dir / "ring_harness"), str(build_dir / ncclhook.PLUGIN_LIB), "3", "1", "2", "1000"], env=env,
                   check=True, capture_output=True, timeout=60)
    out = run_json(capsys, "flow", "nccl", "ring", str(tmp_path / "ring"))
    kinds = [e["kind"] for e in out["events"]]
    assert out["dropped"] == 0 and kinds.count("coll_start") == kinds.count("coll_stop") == 3
