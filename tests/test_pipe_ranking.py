"""The pipeline planner's candidate list for the ranking benchmark (pipesched.ranking), without running it.

The runs themselves (gloo processes, calibrations) take minutes on this machine and are the benchmark's
(`bench/bench_emu_ranking.py`); here the planning and the bookkeeping are checked on a synthetic profile.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesched.devices import Device, LinkModel
from pipesched.profile import LayerProfile, ModelProfile
from pipesched.ranking import choose_candidates, distinct_candidates, plan_candidates, summarize_runs
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


# --------------------------------------------------------------------------------------------------------------
# Issue #23: the zbh1 reversal (the split backward's cost), the distinct-candidate rule, the interleaved runner
# --------------------------------------------------------------------------------------------------------------

def split_layer(name: str, f: float, i: float, w: float, full: float):
    opts = ("none", "selective", "full")
    return LayerProfile(name, f, i, w, 1024, 4096, dict.fromkeys(opts, 1024), dict.fromkeys(opts, 0.0), bwd_full_s=full)


def test_zbh1_first_stage_costs_as_torch_runs_it_and_the_critical_path_by_hand():
    """torch's runtime computes no input gradient on the stage holding layer 0: its I is empty, its W the fused backward.

    Two stages, three micro-batches, free links. Stage 0: F 1, I 0, W 2 (its fused backward; the profile's I + W
    would be 1 + 2 = 3). Stage 1: F 0.5, I 0.5, W 0.5. By hand, rank 0: F0 [0,1] F1 [1,2]; rank 1: F0 [1,1.5]
    I0 [1.5,2] F1 [2,2.5] I1 [2.5,3] W0 [3,3.5]; rank 0: I0 at 2 (empty) W0 [2,4] F2 [4,5] I1 W1 [5,7]; rank 1:
    F2 [5,5.5] I2 [5.5,6] W1 [6,6.5] W2 [6.5,7]; rank 0: I2 W2 [7,9]. Step 9 (with the profile's split: 12).
    """
    from pipesched.plan import uniform_plan

    prof = ModelProfile("two", (split_layer("l0", 1.0, 1.0, 2.0, 2.0), split_layer("l1", 0.5, 0.5, 0.5, 1.0)), source="measured")
    p = uniform_plan(prof, [Device("r0"), Device("r1")], None, microbatches=3, family="zbh1")
    assert (p.costs[0].i_s, p.costs[0].w_s, p.costs[1].i_s, p.costs[1].w_s) == (0.0, 2.0, 0.5, 0.5)
    assert p.sim.makespan == pytest.approx(9.0)
    rank0 = [(str(s.action), s.start, s.end) for s in p.sim.timeline if s.rank == 0 and s.action.kind == "W"]
    assert rank0 == [("0W0", 2.0, 4.0), ("0W1", 5.0, 7.0), ("0W2", 7.0, 9.0)]
    # a non-split family keeps the fused backward on every stage
    q = uniform_plan(prof, [Device("r0"), Device("r1")], None, microbatches=3, family="1f1b")
    assert (q.costs[0].b, q.costs[1].b) == (2.0, 1.0)


def test_profile_splits_the_backward_as_torchs_runtime_does():
    """The profile's I + W and its fused backward each do the backward's matmuls exactly once, as torch's runtime does.

    One block Linear(d, h) -> GELU -> Linear(h, d) on b rows: a forward is F = 2 b (d h + h d) matmul FLOPs (addmm),
    a backward 2 F (mm: two input-gradient and two weight-gradient products). measure_profile with one repetition
    runs: forward, I and W (torch's stage_backward_input / _weight), forward, fused backward, then forwards for the
    saved bytes and the next layer's input. Taking W as ``autograd.grad(out, params)`` on the retained graph, as
    the profile did, redid the second Linear's input gradient (I + W = 2.5 F); its fused backward skipped the layer
    input's gradient (1.5 F).
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from pipesched.models import mlp_chain
    from pipesched.profile import measure_profile

    ops: list[tuple[str, int]] = []

    class Matmuls(TorchDispatchMode):   # torch's FlopCounterMode hooks modules, which stage_backward_input refuses
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            where = {torch.ops.aten.mm.default: (0, 1), torch.ops.aten.addmm.default: (1, 2)}.get(func)
            if where is not None:
                a, c = args[where[0]], args[where[1]]
                ops.append(("mm" if func is torch.ops.aten.mm.default else "addmm", 2 * a.shape[0] * a.shape[1] * c.shape[1]))
            return func(*args, **(kwargs or {}))

    b, d, h = 4, 8, 32
    with Matmuls():
        measure_profile(mlp_chain([h], d), torch.randn(b, d), repeats=1, warmup=0)
    f = 2 * b * (d * h + h * d)
    phases: list[list[int]] = []     # FLOPs of each run of backward products between forwards
    for (kind, flops), prev in zip(ops, [None, *[k for k, _ in ops]], strict=False):
        if kind == "mm":
            if prev != "mm":
                phases.append([])
            phases[-1].append(flops)
    assert [sum(x) for x in phases] == [2 * f, 2 * f]          # I + W, then the fused backward
    assert sum(n for k, n in ops if k == "addmm") == 4 * f


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.1, 10.0), min_size=1, max_size=12), st.floats(0.0, 0.5), st.integers(1, 8))
def test_distinct_candidates_keeps_the_top_k_distinct_predictions(times, gap, k):
    cands = [{"name": f"c{n}", "predicted_s": t, "in_flight": n % 3} for n, t in enumerate(times)]
    kept = distinct_candidates(cands, gap=gap, k=k)
    values = [c["predicted_s"] for c in kept]
    assert values[0] == min(times) and 1 <= len(kept) <= k
    assert all(b >= a * (1 + gap) for a, b in zip(values, values[1:], strict=False))
    if len(kept) < k:   # every candidate left out is within the gap of the last kept one at or below it
        for t in times:
            below = [v for v in values if v <= t]
            assert t in values or t < below[-1] * (1 + gap)


def test_interleaved_runner_runs_every_candidate_in_turn_in_the_same_processes():
    """Two plans of one model, 2 gloo ranks: every timed step of each is recorded, and each step runs every action."""
    from pipesched.export import schedule_csv
    from pipesched.runner import interleaving_plan, run_interleaved
    from pipesched.schedules import make_schedule

    zb = make_schedule("zbh1", 2, 4)
    one = make_schedule("1f1b", 2, 4)
    cands = [{"spans": [(0, 2), (2, 4)], "stage_rank": [0, 1], "builtin": "1F1B", "replay": one.actions},
             {"spans": [(0, 3), (3, 4)], "stage_rank": [0, 1], "csv_text": schedule_csv(zb), "replay": zb.actions}]
    res = run_interleaved(cands, microbatches=4, batch=16, dim=8, model_kwargs={"widths": [16, 16, 32, 32], "dim": 8}, blocks=2, steps=2,
                          replays=2)
    # the replays time each rank's own actions, per stage and kind
    assert sorted(res["candidates"][0]["replay_cpu_s"]) == ["0 B", "0 F", "1 B", "1 F"]
    assert sorted(res["candidates"][1]["replay_cpu_s"]) == ["0 F", "0 I", "0 W", "1 F", "1 I", "1 W"]
    assert res["world"] == 2 and sum(len(p) for blk in interleaving_plan(2, 2, 2) for p in blk) == 8
    # the ranks ran with the intra-op threads asked for (the profile's), their allocator keeping freed buffers as the profile's
    assert res["threads"] == [1, 1] and res["retain_freed_memory"] == [True, True]
    for c in res["candidates"]:
        assert len(c["step_s"]) == 4 and len(c["block_median_s"]) == 2
        for r in range(2):
            assert 0 < c["compute_s"][r] <= c["median_s"] * 1.5 and c["compute_cpu_s"][r] > 0
    # one step of the ZB-H1 plan runs each of its actions once on its rank (F, I, W: 3 per micro-batch and stage)
    acts = res["candidates"][1]["actions"]
    assert sorted((a[0], a[1], a[2], a[3]) for a in acts) == sorted((r, x.stage, x.kind, x.mb) for r in range(2) for x in zb.actions[r])
    assert sorted((a[1], a[2]) for a in res["candidates"][0]["actions"]) == sorted((s, k) for s in range(2) for k in "FB" for _ in range(4))
    with pytest.raises(ValueError, match="replays need"):
        run_interleaved([cands[0], {k: v for k, v in cands[1].items() if k != "replay"}], microbatches=4, batch=16, dim=8, replays=1)
    with pytest.raises(ValueError, match="same ranks"):
        run_interleaved([cands[0], {"spans": [(0, 4)], "stage_rank": [0], "builtin": "1F1B"}], microbatches=4, batch=16, dim=8)


FAULTS_SCRIPT = """
import resource, sys
import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from pipesched.models import mlp_chain
from pipesched.profile import retain_freed_memory
torch.set_num_threads(1)
applied = retain_freed_memory() if sys.argv[1] == "retain" else None
mod = torch.nn.Sequential(*mlp_chain([3072, 3072], 384))
y = torch.randn(48, 384)
def faults():
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
w_faults = []
for step in range(5):   # as a split-backward stage runs a step: every micro-batch's F, then its I, then its W
    held = []
    for k in range(4):
        inp = torch.randn(48, 384).requires_grad_(True)
        out = torch.nn.functional.mse_loss(mod(inp), y)
        held.append(stage_backward_input([out], None, [inp], mod.parameters())[1])
    before = faults()
    for groups in held:
        stage_backward_weight(mod.parameters(), groups)
    w_faults.append(faults() - before)
    for p in mod.parameters():
        p.grad = None
print(applied, sum(w_faults[1:]))   # the steps after the first
"""


def test_split_backward_weight_gradients_page_fault_unless_freed_memory_is_retained():
    """torch's W allocates a fresh weight gradient per call; glibc hands such buffers back to the OS on free, so every W
    page-faults them in again (the cause of W costing ~1.6x its profile inside a step) unless the process keeps them."""
    import subprocess
    import sys

    def run(mode: str) -> tuple[str, int]:
        out = subprocess.run([sys.executable, "-c", FAULTS_SCRIPT, mode], capture_output=True, text=True, check=True, timeout=120)
        applied, faults = out.stdout.split()
        return applied, int(faults)

    applied, retained = run("retain")
    if applied != "True":
        pytest.skip("no glibc mallopt here")
    # a 3072-wide block's two weight gradients are 9.4 MB, 2300 pages of 4 KiB: by default most steps fault them in again
    # (about 7000 faults per step of 4 micro-batches), retained hardly ever (0 in most steps, a few hundred at most)
    _, default = run("default")
    assert default > 4000 and retained * 10 < default


def test_runner_ups_are_the_planners_own_search_and_never_beat_its_plan():
    """On 2 ranks the planner tries every cut of the chain (refine's exhaustive case): its plan is the best of them, the
    runner-ups are the other 10 cuts, each planned exactly as the planner's plan is (the plan's own cut reproduces it)."""
    from pipesched.partition import evaluate_partition
    from pipesched.plan import plan, plan_partition, with_runtime
    from pipesched.ranking import runner_ups

    prof = tail_heavy_profile()
    devices = [Device(f"r{i}") for i in range(2)]
    link = LinkModel.uniform(2, 1e9, 5e-5)
    cores = SharedCpu(2.0, 2e-4, 1e-4)
    for fam in ("1f1b", "zbh1", "gpipe"):
        best = with_runtime(plan(prof, devices, link, microbatches=8, schedule=fam, cores=cores), "torch-runtime", 1e-3)
        ups = runner_ups(prof, best, devices, link, cores=cores, handshake_s=1e-3)
        own = [tuple(st.layers) for st in best.partition.stages]
        assert len(ups) == 10 and own not in [[tuple(st.layers) for st in q.partition.stages] for q in ups]
        assert [q.sim.makespan for q in ups] == sorted(q.sim.makespan for q in ups)
        assert ups[0].sim.makespan >= best.sim.makespan * (1 - 1e-9)
        again = plan_partition(prof, evaluate_partition(prof, own, devices, link, microbatches=8, family=fam), devices, link, family=fam,
                               microbatches=8, cores=cores, runtime="torch-runtime", handshake_s=1e-3, schedule=best.schedule)
        assert again.sim.makespan == pytest.approx(best.sim.makespan, rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(1.0, 3.0), min_size=1, max_size=5), st.lists(st.lists(st.floats(1.0, 3.0), max_size=4), min_size=1, max_size=5),
       st.integers(1, 6))
def test_choose_candidates_grows_the_pool_only_as_far_as_needed(tops, ups, least):
    cands = [{"name": f"f{i}", "predicted_s": t, "runner_ups": [{"name": f"f{i} #{k + 2}", "predicted_s": u} for k, u in enumerate(sorted(r))]}
             for i, (t, r) in enumerate(zip(tops, ups, strict=False))]
    chosen, depth = choose_candidates(cands, gap=0.1, k=6, least=least)
    times = [c["predicted_s"] for c in chosen]
    assert all(b >= a * 1.1 for a, b in zip(times, times[1:], strict=False))
    pool = cands + [r for c in cands for r in c["runner_ups"][:depth]]
    assert chosen == distinct_candidates(pool, gap=0.1, k=6)
    if depth:   # grown because one level less kept too few
        less = cands + [r for c in cands for r in c["runner_ups"][:depth - 1]]
        assert len(distinct_candidates(less, gap=0.1, k=6)) < least
    assert len(chosen) >= least or depth == max(len(c["runner_ups"]) for c in cands)
