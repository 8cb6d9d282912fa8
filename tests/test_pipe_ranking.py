"""The pipeline planner's candidate list for the ranking benchmark (pipesched.ranking), without running it.

The runs themselves (gloo processes, calibrations) take minutes on this machine and are the benchmark's
(`bench/bench_emu_ranking.py`); here the planning and the bookkeeping are checked on a synthetic profile.
"""

from __future__ import annotations

import pytest

from pipesched.devices import Device, LinkModel
from pipesched.profile import LayerProfile, ModelProfile
from pipesched.ranking import plan_candidates, summarize_runs
from pipesched.simulate import SharedCpu


def tail_heavy_profile(blocks: int = 12, heavy: int = 4) -> ModelProfile:
    """A chain whose last ``heavy`` layers cost 8x the others (the benchmark's MLP shape)."""
    opts = ("none", "selective", "full")
    layers = tuple(LayerProfile(f"l{k}", f, f, f, 64 * 1024, 4 << 20, dict.fromkeys(opts, 64 * 1024), dict.fromkeys(opts, 0.0))
                   for k, f in enumerate([0.002] * (blocks - heavy) + [0.016] * heavy))
    return ModelProfile("tail-heavy", layers, source="measured")


def test_candidates_are_every_family_and_the_baseline_best_first():
    devices = [Device(f"r{i}") for i in range(4)]
    cands, skipped = plan_candidates(tail_heavy_profile(), devices, LinkModel.uniform(4, 1e9, 5e-5), microbatches=8,
                                     cores=SharedCpu(2.0, 2e-4, 1e-4), handshake_s=1e-3)
    assert skipped == []
    assert {c["name"] for c in cands} == {"1f1b", "zbh1", "gpipe", "interleaved", "uniform + torch 1F1B"}
    assert [c["predicted_s"] for c in cands] == sorted(c["predicted_s"] for c in cands)
    for c in cands:
        assert c["predicted_s"] == c["plan"].sim.makespan
        # ours run as CSV schedules through torch's runtime, the baseline as torch's own Schedule1F1B
        assert ("builtin" in c["how"]) == (c["name"] == "uniform + torch 1F1B")
        # a core per rank (the diagnostic) is no slower than 4 ranks sharing 2 cores
        assert c["predicted_own_core_s"] <= c["predicted_s"] * (1 + 1e-9)
    base = next(c for c in cands if c["name"] == "uniform + torch 1F1B")
    assert base["spans"] == [[0, 3], [3, 6], [6, 9], [9, 12]]
    # equal layer counts put all the heavy layers on the last stage: every partitioned 1F1B plan is predicted faster
    assert next(c for c in cands if c["name"] == "1f1b")["predicted_s"] < base["predicted_s"]


def test_summary_counts_noise_and_tau():
    cands = [{"name": n, "predicted_s": p} for n, p in (("a", 1.0), ("b", 1.01), ("c", 2.0))]
    runs = {"a": [{"median_s": 1.0, "foreign_cores": 0.0}, {"median_s": 1.2, "foreign_cores": 0.3}],
            "b": [{"median_s": 1.05, "foreign_cores": 0.0}], "c": [{"median_s": 2.1, "foreign_cores": 0.0}]}
    rows, agree, noise = summarize_runs(cands, runs)
    assert [r["measured_s"] for r in rows] == pytest.approx([1.1, 1.05, 2.1])
    assert rows[0]["spread"] == pytest.approx(0.2 / 1.1) and rows[0]["foreign_cores_max"] == 0.3
    # a and b predicted within 2 %: tied; both before c in both orders
    assert agree["predicted_classes"] == [0, 0, 1] and agree["tau"] == pytest.approx(2 / 6 ** 0.5)
    assert noise["pairs_within_spread"] == [("a", "b")]
