"""The GPU contention model (pipesched.gpu_calibration) on the committed H100 sessions, and its CPU rehearsal.

The raw data (bench/results/raw/raw*_{mps,ts}.json) is what bench/gpu_session.sh measured on one H100: the
calibration (profile, concurrency slowdown, waiting/pending NCCL, p2p per size, and in session 2 the probe
pipeline) and every pipelined run with its per-action trace. The tests re-derive the predictions from it.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from pipesched.devices import Device, LinkModel
from pipesched.gpu_calibration import GpuCalibration, predict_contended, rank_loads, trace_overheads
from pipesched.plan import uniform_plan
from pipesched.profile import profile_from_dict
from pipesched.simulate import simulate

REPO = Path(__file__).resolve().parents[1]
RAW = REPO / "bench" / "results" / "raw"
BENCH = REPO / "bench" / "bench_pipesched_gpu.py"
SESSIONS = ["raw_mps.json", "raw_ts.json", "raw2_mps.json", "raw2_ts.json"]


def load(name: str) -> dict:
    return json.loads((RAW / name).read_text())


@pytest.mark.parametrize("name", SESSIONS)
def test_calibration_constants(name):
    raw = load(name)
    time_sliced = raw["sharing"] == "time-slice"
    for entry in raw["calibration"]["entries"]:
        cal = GpuCalibration.from_raw(raw["calibration"], entry["name"])
        for kind in "FB":
            curve = cal.slowdown[kind]
            assert curve[0] == 1.0 and len(curve) == raw["stages"]
            if time_sliced:   # time-slicing divides the whole GPU: k busy contexts run about k times slower
                assert 3.0 < curve[-1] < 5.0, (entry["name"], curve)
            else:             # MPS gives each its own SMs: only memory bandwidth and L2 are shared
                assert 1.0 <= curve[-1] < 1.3, (entry["name"], curve)
            assert 0.6 < cal.action_ratio[kind] < 1.4
        assert cal.bandwidth_bps > 1e8 and cal.latency_s >= 0
        # the factor interpolates the measured curve: no load is the action alone, a full load the last point
        assert cal.factor("F", 0.0) == 1.0 and cal.factor("B", raw["stages"] - 1) == cal.slowdown["B"][-1]


def test_probe_sessions_predicted_within_10_percent(tmp_path):
    """Session 2: each run predicted from the calibration the same session measured before it (not fitted)."""
    res = subprocess.run([sys.executable, str(BENCH), "--evaluate", str(RAW / "raw2_mps.json"), str(RAW / "raw2_ts.json"), "--out-dir",
                          str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    runs = json.loads((tmp_path / "pipesched_gpu_validation.json").read_text())["runs"]
    assert len(runs) == 8 and all(r["probe"] for r in runs)
    assert {(r["sharing"], r["entry"].split("-")[0], r["arm"]) for r in runs} == {
        (s, m, a) for s in ("mps", "time-slice") for m in ("mlp", "transformer") for a in ("ours", "uniform_torch_1f1b")}
    for r in runs:
        assert abs(r["error"]) <= 0.10, (r["sharing"], r["entry"], r["arm"], r["error"])
        # the earlier model (profile only) was biased low on every run: the calibration removes most of it
        assert r["profile_only_s"] < r["measured_s"] and abs(r["error"]) < abs(r["profile_only_s"] / r["measured_s"] - 1)


def test_trace_overheads_of_the_probe():
    """The probe's hop at its message size is at least the ping-pong's one-way time at that size (it adds posting
    and the consumer's wake-up), and its gap is a fraction of a hop."""
    for name in ("raw2_mps.json", "raw2_ts.json"):
        cal = load(name)["calibration"]
        probe = cal["probe"]
        over = trace_overheads(probe["result"])
        ping = next(p["one_way_s"] for p in cal["p2p"] if p["bytes"] == probe["message_bytes"])
        assert over["hops"] > 0 and over["gaps"] > 0
        assert over["hop_s"] >= 0.9 * ping, (name, over, ping)
        assert 0 < over["gap_s"] < over["hop_s"]


def flat(cal: GpuCalibration) -> GpuCalibration:
    return replace(cal, action_ratio={"F": 1.0, "B": 1.0}, slowdown={"F": [1.0] * 4, "B": [1.0] * 4}, wait_weight=0.0,
                   pending={"F": 1.0, "B": 1.0}, latency_s=0.0, bandwidth_bps=float("inf"), gap_s=0.0, hop_s=None)


def test_no_contention_is_the_plain_simulation():
    """Differential: with a flat slowdown curve, unit ratios, no gap and a free link, the contention model's
    prediction is the plain simulation of the plan."""
    raw = load("raw2_mps.json")
    entry = raw["calibration"]["entries"][0]
    prof = profile_from_dict(entry["profile"])
    devices = [Device(f"r{r}") for r in range(4)]
    for family in ("1f1b", "gpipe"):
        p = uniform_plan(prof, devices, LinkModel.uniform(4, float("inf"), 0.0), microbatches=4, family=family)
        pred, info = predict_contended(p, flat(GpuCalibration.from_raw(raw["calibration"], entry["name"])))
        assert pred.sim.makespan == pytest.approx(p.sim.makespan, rel=1e-12)
        assert set(info["factors"].values()) == {1.0}


def test_uniform_slowdown_scales_the_makespan():
    """A curve that is 2 at every load (and a free link) doubles every action, so the makespan doubles."""
    raw = load("raw2_mps.json")
    entry = raw["calibration"]["entries"][0]
    p = uniform_plan(profile_from_dict(entry["profile"]), [Device(f"r{r}") for r in range(4)], None, microbatches=4, family="1f1b")
    cal = flat(GpuCalibration.from_raw(raw["calibration"], entry["name"]))
    pred, _ = predict_contended(p, replace(cal, slowdown={"F": [2.0] * 4, "B": [2.0] * 4}))
    assert pred.sim.makespan == pytest.approx(2 * p.sim.makespan, rel=1e-9)


def test_rank_loads_brute_force():
    """The load of every action equals a fine time-grid count of the other ranks' states during it."""
    raw = load("raw2_mps.json")
    entry = raw["calibration"]["entries"][0]
    p = uniform_plan(profile_from_dict(entry["profile"]), [Device(f"r{r}") for r in range(4)], None, microbatches=4, family="1f1b")
    sim = simulate(p.schedule, p.costs)
    w = 0.4
    loads = rank_loads(sim, w)
    ends = {r: max(s.end for s in sim.timeline if s.rank == r) for r in range(4)}
    for s in sim.timeline[::3]:
        grid = [s.start + (k + 0.5) * (s.end - s.start) / 400 for k in range(400)]
        total = 0.0
        for t in grid:
            for q in range(4):
                if q == s.rank:
                    continue
                busy = any(o.rank == q and o.start <= t < o.end for o in sim.timeline)
                total += 1.0 if busy else (w if t < ends[q] else 0.0)
        assert loads[(s.rank, s.action.stage, s.action.kind, s.action.mb)] == pytest.approx(total / len(grid), abs=0.02)


@pytest.mark.slow
def test_cpu_rehearsal_of_the_collect_and_evaluate(tmp_path):
    """The device session's code path on the CPU (gloo, tiny models, 2 ranks): calibration, probe, runs, evaluation."""
    raw = tmp_path / "raw.json"
    res = subprocess.run([sys.executable, str(BENCH), "--collect", str(raw), "--device", "cpu", "--sharing", "mps", "--models", "mlp",
                          "--microbatches", "2", "--stages", "2", "--iterations", "1", "--warmup", "1", "--reps", "1", "--profile-repeats", "1",
                          "--timeout", "500"], capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads(raw.read_text())
    assert "probe" in data["calibration"] and not data.get("run_errors")
    assert {r["arm"] for r in data["runs"]} == {"ours", "uniform_torch_1f1b"}
    for run in data["runs"]:
        traces = run["result"]["traces"]
        assert len(traces) == 2 and all(len(rank) == 1 for rank in traces)
        assert statistics.median(run["result"]["iteration_s"]) > 0
    res = subprocess.run([sys.executable, str(BENCH), "--evaluate", str(raw), "--out-dir", str(tmp_path)], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "pipesched_gpu_validation.md").read_text().startswith("# Pipeline planner on a GPU")
