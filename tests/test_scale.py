"""The scale work (issue #24): the faster simulator and replay give the results of the code before it, and the benchmark runs.

``tests/data/scale_golden.json`` holds the results of the code at commit 99240d3 (before the incremental
component search of emu.sim and the lazy, incremental replay loop) on the cases below.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import topology
from bench.bench_scale import replay_trace, run_case, sim_workload
from bench.bench_sim import cluster_workload
from emu.fluid import PeriodicFluidModel, PeriodicJob
from emu.sim import simulate
from placement.contention import FluidSlowdown
from placement.replay import replay

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = json.loads((ROOT / "tests" / "data" / "scale_golden.json").read_text())
POLICIES = ("fifo", "las", "hived", "hived+cassini")


def _close(a: float | None, b: float | None, rel: float = 1e-9) -> bool:
    if a is None or b is None:
        return a is b
    return abs(a - b) <= rel * max(abs(a), abs(b), 1.0)


@pytest.mark.parametrize("case", ["small", "medium"])
def test_sim_matches_the_code_before(case):
    if case == "small":
        topo = topology.build_cluster(8)
        work = cluster_workload(topo, 12, 3, seed=1, sizes=[16, 8, 8, 4, 4, 4, 4, 2, 2, 2, 2, 2])
    else:
        topo = topology.build_cluster(64)
        work = sim_workload(topo, 31, 2)
    res = simulate(topo, work, record_flows=False)
    want = GOLDEN["sim"][case]
    assert set(res.jobs) == set(want)
    for name, ends in want.items():
        assert res.jobs[name].iteration_ends == pytest.approx(ends, rel=1e-12, abs=0)


@pytest.fixture(scope="module")
def replay_case():
    return topology.build_cluster(16), replay_trace(300, 128)


@pytest.mark.parametrize("policy", POLICIES)
def test_replay_matches_the_code_before(replay_case, policy):
    topo, trace = replay_case
    res = replay(topo, trace, policy, slowdown=FluidSlowdown(topo, radius=1))
    want = GOLDEN["replay"][policy]
    got = {x["name"]: (x["start_s"], x["finish_s"]) for x in res.jobs}
    assert set(got) == set(want["jobs"])
    for name, (start, finish) in want["jobs"].items():
        assert _close(got[name][0], start) and _close(got[name][1], finish), (name, got[name], (start, finish))
    for k, v in want["metrics"].items():
        assert _close(res.metrics[k], v), (k, res.metrics[k], v)


@pytest.mark.parametrize("policy", POLICIES)
def test_incremental_replay_equals_whole_set_calls(replay_case, policy):
    """The replay's incremental path (FluidSlowdown.update) against the whole running set passed at every event."""
    topo, trace = replay_case
    trace = trace[:150]
    inc = replay(topo, trace, policy, slowdown=FluidSlowdown(topo, radius=1))
    whole_model = FluidSlowdown(topo, radius=1)
    full = replay(topo, trace, policy, slowdown=lambda jobs: whole_model(jobs))  # no .update: the whole set at every event
    for a, b in zip(inc.jobs, full.jobs, strict=True):
        assert _close(a["start_s"], b["start_s"]) and _close(a["finish_s"], b["finish_s"]), (a, b)


def test_fluid_update_equals_call():
    """PeriodicFluidModel.update returns what changed; the rest keep the answers a whole-set call gives."""
    links = [f"l{k}" for k in range(6)]
    jobs = [PeriodicJob(f"j{i}", 0.02 + 0.01 * (i % 3), 0.03, {links[i % 6]: 40.0, links[(i + 1) % 6]: 30.0}, 0.005 * i) for i in range(12)]
    cap = dict.fromkeys(links, 50.0)
    for radius in (None, 1):
        inc, whole = PeriodicFluidModel(cap, radius=radius), PeriodicFluidModel(cap, radius=radius)
        answers: dict[str, float] = {}
        live: list[PeriodicJob] = []
        for step, j in enumerate(jobs):
            gone = [live.pop(0)] if step % 4 == 3 else []
            for g in gone:
                answers.pop(g.name)
            live.append(j)
            answers.update(inc.update([j], gone))
            assert answers == whole(live)


def test_bench_cases_run():
    """The benchmark's case runner on tiny cases (the real sizes are minutes each)."""
    sim = run_case({"section": "sim", "gpus": 128, "jobs": 4, "policy": "", "iterations": 1})
    assert sim["events"] > 0 and sim["peak_rss_mb"] > 0 and sim["cpu_s"] > 0 and sim["wall_s"] >= sim["run_wall_s"]
    rep = run_case({"section": "replay", "gpus": 64, "jobs": 40, "policy": "hived", "iterations": None})
    assert rep["finished"] == 40 and rep["events"] > 0


def test_netweave_bench_lists_scale():
    out = subprocess.run([sys.executable, "-m", "netweave", "bench", "--list"], capture_output=True, text=True, cwd=ROOT, check=True)
    assert "scale" in out.stdout


def test_bench_cli_case_and_table(tmp_path):
    """The script's own path: one case in a child (``--case``), then the table rewritten from kept rows (``--section none``)."""
    script = ROOT / "bench" / "bench_scale.py"
    spec = {"section": "replay", "gpus": 64, "jobs": 30, "policy": "fifo", "iterations": None}
    out = subprocess.run([sys.executable, str(script), "--case", json.dumps(spec)], capture_output=True, text=True, cwd=ROOT, check=True)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    small = {**row, "jobs": 15, "run_cpu_s": row["run_cpu_s"] / 2}
    (tmp_path / "scale.json").write_text(json.dumps({"rows": [small, row]}))
    subprocess.run([sys.executable, str(script), "--section", "none", "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, check=True)
    rows = json.loads((tmp_path / "scale.json").read_text())["rows"]
    assert [r["jobs"] for r in rows] == [15, 30]
    assert rows[1]["cpu_growth"] == pytest.approx(1.0)  # twice the CPU time for twice the jobs
    assert "| replay | 64 | 30 | fifo |" in (tmp_path / "scale.md").read_text()
