"""A real run: our exported schedule executed by torch's _PipelineScheduleRuntime in 4 gloo processes."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pipesched.devices import Device, LinkModel
from pipesched.export import schedule_csv, spans_for_schedule
from pipesched.plan import plan_partition
from pipesched.runner import measured_timeline, run_pipeline

torch = pytest.importorskip("torch")


def reference_losses(widths, dim, batch, microbatches, steps):
    """Single-process training with the same data, micro-batching, gradient scaling and SGD steps."""
    from pipesched.models import mlp_chain

    model = torch.nn.Sequential(*mlp_chain(widths, dim))
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, dim, generator=gen), torch.randn(batch, dim, generator=gen)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        mb_losses = [torch.nn.functional.mse_loss(model(xm), ym) for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches), strict=True)]
        (sum(mb_losses) / microbatches).backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(sum(float(v.detach()) for v in mb_losses) / microbatches))
    return losses


@pytest.mark.slow
def test_zero_bubble_plan_runs_in_real_processes_and_trains_like_one_process():
    from pipesched.calibrate import profile_mlp
    from pipesched.partition import partition

    widths, dim, batch, m, p = [32, 32, 32, 32, 256, 256], 16, 32, 4, 4
    prof = profile_mlp(widths, dim, batch // m, repeats=1)
    devices = [Device(f"cpu{r}") for r in range(p)]
    links = LinkModel.uniform(p, 1e9, 50e-6)
    part = partition(prof, devices, links, microbatches=m, family="zbh1")
    plan = plan_partition(prof, part, devices, links, family="zbh1", microbatches=m)
    run = run_pipeline(spans_for_schedule(plan.schedule, part), list(plan.schedule.stage_rank), microbatches=m, batch=batch, dim=dim,
                       model_kwargs={"widths": widths, "dim": dim}, csv_text=schedule_csv(plan.schedule), iterations=2, warmup=1,
                       pre_profile={"repeats": 2, "passes": 1}, interleave_profile={"repeats": 1}, interleave_replay=plan.schedule.actions)
    # Same numbers as one process doing the same steps: the exported schedule computes the right gradients (and the
    # ranks' profiling right before the run and between its steps, and their replays of their own actions, left their
    # parameters and gradients as they were).
    assert run.losses == pytest.approx(reference_losses(widths, dim, batch, m, 3)[1:], rel=1e-5)
    # Every rank profiled the whole chain: same sizes as the profile taken here, positive CPU times.
    from pipesched.profile import profile_from_dict

    assert len(run.pre_profiles) == p
    for d in run.pre_profiles:
        pre = profile_from_dict(d)
        assert [(q.param_bytes, q.output_bytes, q.saved_bytes) for q in pre.layers] == \
            [(q.param_bytes, q.output_bytes, q.saved_bytes) for q in prof.layers]
        assert pre.reference["clock"] == "cpu" and all(q.fwd_s > 0 and q.bwd_s > 0 for q in pre.layers)
    # ... and once more before each timed step: one median profile per rank, one F + B total per rank and step.
    assert len(run.interleaved_profiles) == p and [len(t) for t in run.interleaved_totals_s] == [2] * p
    for d in run.interleaved_profiles:
        between = profile_from_dict(d)
        assert [q.saved_bytes for q in between.layers] == [q.saved_bytes for q in prof.layers]
        assert between.reference["median_of"] == 2 and all(q.fwd_s > 0 and q.bwd_s > 0 for q in between.layers)
    # Every rank replayed each of its F, I and W kinds (ZB-H1 splits the backward), with positive CPU times.
    kinds = {f"{a.stage} {a.kind}" for acts in plan.schedule.actions.values() for a in acts}
    assert set(run.replay_cpu_medians) == kinds and {k.split()[1] for k in kinds} == {"F", "I", "W"}
    assert all(v > 0 for k, v in run.replay_cpu_medians.items() if k != "0 I")   # stage 0 has no input gradient
    # Each rank ran exactly our actions, in our order.
    for r in range(p):
        done = [(a["stage"], a["kind"], a["mb"]) for a in sorted(run.actions, key=lambda a: a["start"]) if a["rank"] == r]
        assert done == [(a.stage, a.kind, a.mb) for a in plan.schedule.actions[r]]
    # Activation memory: torch keeps a micro-batch's graph from F to W, as the simulator assumes for torch
    # (exact on the inner ranks; the last rank's loss tensors are counted slightly differently in the profile).
    predicted = [peak - plan.costs[r].state_bytes for r, peak in enumerate(plan.sim.peak_memory)]
    assert run.peak_saved_bytes[:-1] == pytest.approx(predicted[:-1], rel=1e-9)
    assert run.peak_saved_bytes[-1] == pytest.approx(predicted[-1], rel=0.05)
    assert len(run.iteration_s) == 2 and all(t > 0 for t in run.iteration_s)
    assert run.link_bandwidth_bps > 0 and run.link_latency_s > 0
    timeline = measured_timeline(run, p)
    assert timeline.makespan <= max(run.iteration_s) + 1e-9


def test_replay_must_give_each_rank_its_own_actions():
    from pipesched.schedules import Action, one_f_one_b

    sched = one_f_one_b(2, 2)
    kw = {"microbatches": 2, "batch": 4, "dim": 4, "model_kwargs": {"widths": [4, 4], "dim": 4}, "builtin": "1F1B"}
    wrong = {0: sched.actions[1], 1: sched.actions[0]}
    with pytest.raises(ValueError, match="rank 0 its own"):
        run_pipeline([(0, 1), (1, 2)], [0, 1], interleave_replay=wrong, **kw)
    with pytest.raises(ValueError, match="rank 1 its own"):
        run_pipeline([(0, 1), (1, 2)], [0, 1], interleave_replay={0: [Action(0, "F", 0)]}, **kw)
    with pytest.raises(ValueError, match="not available with device='cuda'"):
        run_pipeline([(0, 1), (1, 2)], [0, 1], interleave_replay=sched.actions, device="cuda", **kw)


def test_gpu_paths_refuse_clearly_without_a_gpu():
    import torch

    from pipesched.calibrate import gpu_validation
    from pipesched.profile import measure_profile

    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        run_pipeline([(0, 1)], [0], microbatches=1, batch=2, dim=4, builtin="1F1B", device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA GPU"):
            gpu_validation([8, 8], dim=4, batch=4, microbatches=2, stages=2)
        raw = Path(tempfile.mkdtemp(prefix="pipesched-gpu-")) / "raw.json"
        res = subprocess.run([sys.executable, str(Path(__file__).resolve().parent.parent / "bench" / "bench_pipesched_gpu.py"), "--collect",
                              str(raw)], capture_output=True, text=True, timeout=120)
        assert res.returncode == 2 and "no CUDA GPU" in res.stderr and not raw.exists()
        from netweave.cli import main

        assert main(["pipe", "run", "--device", "cuda"]) == 2
    else:   # on a GPU the CPU clock is refused for GPU work
        layer = torch.nn.Linear(4, 4).cuda()
        with pytest.raises(ValueError, match="clock='wall'"):
            measure_profile([layer], torch.randn(2, 4, device="cuda"), clock="cpu")


@pytest.mark.parametrize("is_last", [True, False], ids=["last stage (loss)", "inner stage"])
def test_replay_runs_real_backwards_and_leaves_no_gradients(is_last):
    """The replay's backwards do the work (about twice a forward's CPU on wide blocks; more than one forward's is asked,
    as sub-millisecond timings on the busy 2-core machine came out at 1.14x once; a skipped backward is ~0) and drop
    what they accumulate."""
    from types import SimpleNamespace

    from pipesched.models import mlp_chain
    from pipesched.runner import _replay

    torch.set_num_threads(1)
    module = torch.nn.Sequential(*mlp_chain([1024, 1024], 64))
    stage = SimpleNamespace(stage_index=0, submod=module, is_first=False, is_last=is_last)
    job = {"batch": 128, "microbatches": 4, "dim": 64}
    x, y = torch.randn(128, 64), torch.randn(128, 64)
    actions = [[0, "F", k] for k in range(4)] + [[0, "B", k] for k in range(4)]
    times = _replay(torch, [stage], actions, x, y, job)
    assert set(times) == {"0 F", "0 B"}
    assert times["0 B"] > times["0 F"] > 0
    assert all(p.grad is None for p in module.parameters())


@pytest.mark.slow
def test_message_waits_are_measured_per_rank():
    # A light first stage feeding a heavy last one under torch's Schedule1F1B: rank 0 spends most of each step
    # waiting for gradients, rank 1 hardly waits; neither waits longer than the step.
    run = run_pipeline([(0, 1), (1, 2)], [0, 1], microbatches=4, batch=64, dim=64, model_kwargs={"widths": [8, 8192], "dim": 64},
                       builtin="1F1B", iterations=3, warmup=1)
    light, heavy = run.rank_wait_s
    assert 0.0 <= heavy < light <= max(run.iteration_s)
    assert light > 0.5 * run.median_s
    assert run.to_dict()["rank_wait_s"] == run.rank_wait_s
