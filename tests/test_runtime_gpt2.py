"""A real model end to end: GPT-2 (mask, positions, tied head) profiled, planned for 2 stages, written as a job plan and
trained through the runtime's traced pipeline (examples/train_gpt2.py under torchrun, CPU and gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from runtime_helpers import REPO, free_port, one_host_plan

from netweave.runtime import plan as jp
from netweave.runtime.pipeline import SELECTIVE_SAVED_OPS, recompute_traced, traced_split_points

EXAMPLE = REPO / "examples" / "train_gpt2.py"
SHAPE = {"layers": 2, "hidden": 32, "heads": 2, "seq_len": 16, "vocab": 64}


def _planned_job(microbatches: int = 4) -> tuple[jp.JobPlan, object]:
    """The job plan ``netweave launch`` writes for a measured GPT-2 profile on two ranks (its pipeline section function)."""
    from netweave.launch import _pipeline_section
    from pipesched.devices import Device
    from pipesched.gpt2 import gpt2
    from pipesched.model_profile import profile_model
    from pipesched.plan import plan

    spec = gpt2(**SHAPE, microbatch=2, dropout=0.0)
    prof = profile_model(spec["model"], spec["args"], split=spec["split"], loss_fn=spec["loss_fn"], repeats=1, warmup=0)
    p = plan(prof, [Device("r0"), Device("r1")], None, microbatches=microbatches, schedule="1f1b")
    job = one_host_plan(2, port=free_port(), pp=2)
    return jp.loads(jp.dumps(replace(job, pipeline=_pipeline_section(None, p)))), prof


def _torchrun(plan: jp.JobPlan, tmp_path, *args: str) -> list[dict]:
    path = tmp_path / "plan.json"
    path.write_text(jp.dumps(plan))
    env = {**os.environ, "NETWEAVE_JOB_PLAN": str(path), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={plan.rendezvous.port}", str(EXAMPLE), "--out", str(tmp_path / "r{rank}.json"), *args]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    return [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(2)]


def test_gpt2_profiled_planned_and_trained_through_the_runtime(tmp_path):
    from pipesched.model_profile import stage_split_points

    plan, prof = _planned_job()
    pl = plan.pipeline
    assert pl.torch_class == "Schedule1F1B" and len(pl.stages) == 2
    # the planner's recomputation may be none everywhere (no memory limit): run both kinds the runtime has
    plan = replace(plan, pipeline=replace(pl, stages=(replace(pl.stages[0], recompute="full"), replace(pl.stages[1], recompute="selective"))))
    first, last = _torchrun(plan, tmp_path, "--steps", "8", "--batch", "8")
    spans = [s.layers for s in pl.stages]
    # the stages begin where the plan's partition does, as split points of the profiled model
    assert first["boundaries"] == last["boundaries"] == stage_split_points(prof, spans)
    # each stage holds exactly the parameters of the profile's layers the plan gives it (the tied embedding/head:
    # torch gives each stage its own copies of it, counted apart)
    tied = {n: g for g in prof.reference["tied"] for n in g["params"]}
    for out, (lo, hi) in zip((first, last), spans, strict=True):
        (params,) = out["stages"].values()
        params = {n.removeprefix("model."): k for n, k in params.items()}
        modules = [m for lay in prof.layers[lo:hi] for m in lay.name.split("+")]
        assert all(any(n.startswith(m + ".") for m in modules) for n in params if n not in tied), (params, modules)
        tied_bytes = sum(g["bytes"] for g in prof.reference["tied"] for k in g["layers"] if lo <= k < hi)
        assert 4 * sum(k for n, k in params.items() if n not in tied) == sum(lay.param_bytes for lay in prof.layers[lo:hi]) - tied_bytes
    assert first["recomputed"] == {"0": ["GraphModule"]} and last["recomputed"] == {"1": ["GraphModule"]}
    # the loss falls; the tied copies (embedding on stage 0, head on stage 1) stay equal: their gradients are summed
    losses = last["losses"]
    assert first["losses"] == [None] * 8 and sum(losses[-2:]) < 0.95 * sum(losses[:2]), losses
    copies = [*first["tied"].values(), *last["tied"].values()]
    assert len(copies) >= 2 and len(set(copies)) == 1, (first["tied"], last["tied"])


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_traced_stage_recomputation_gives_the_same_gradients(mode):
    from torch.distributed.pipelining import SplitPoint, pipeline

    from pipesched.gpt2 import gpt2

    grads = {}
    for m in ("none", mode):   # a fresh model each time: torch's split_spec patches the named submodule's forward
        spec = gpt2(**SHAPE, microbatch=2, dropout=0.0)
        ids, mask, positions = spec["args"]
        pipe = pipeline(spec["model"], (ids, mask, positions), split_spec={"blocks.1": SplitPoint.BEGINNING})
        stage = recompute_traced(pipe.get_stage_module(0), m)
        out = stage(ids, positions, mask)
        (out[0] if isinstance(out, tuple) else out).square().sum().backward()
        grads[m] = {n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}
    assert grads["none"].keys() == grads[mode].keys() and grads["none"]
    for n, g in grads["none"].items():
        assert torch.allclose(g, grads[mode][n], atol=1e-5), n


def test_selective_policy_is_the_profiles():
    from pipesched.model_profile import _saved_ops

    aten = torch.ops.aten
    assert _saved_ops() == frozenset(getattr(aten, n).default for n in SELECTIVE_SAVED_OPS if hasattr(aten, n))


def test_split_points_from_names_modules_or_markers():
    plan = one_host_plan(2, pp=2, layers=4)           # stages [0, 2), [2, 4)
    assert traced_split_points(plan, ["blocks.0", "blocks.1", "ln_f"], "p") == ["blocks.1"]
    assert traced_split_points(plan, None, "p") is None   # the model's pipe_split() markers
    named = replace(plan.pipeline, stages=tuple(replace(s, modules=("a", "b") if s.index == 0 else ("c", "d")) for s in plan.pipeline.stages))
    assert traced_split_points(replace(plan, pipeline=named), None, "p") == ["c"]
    with pytest.raises(jp.PlanFormatError, match=r"pipeline.stages: the plan splits 4 layers, `split` names where 3 layers begin"):
        traced_split_points(plan, ["blocks.0", "blocks.1"], "p")


def _saved_bytes(fn) -> int:
    seen: dict = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_traced_recomputation_saves_less():
    from torch.distributed.pipelining import SplitPoint, pipeline

    from pipesched.gpt2 import gpt2

    saved = {}
    for m in ("none", "selective", "full"):
        spec = gpt2(**SHAPE, microbatch=2, dropout=0.0)
        ids, mask, positions = spec["args"]
        stage = recompute_traced(pipeline(spec["model"], (ids, mask, positions), split_spec={"blocks.1": SplitPoint.BEGINNING})
                                 .get_stage_module(1), m)
        x = torch.randn(2, SHAPE["seq_len"], SHAPE["hidden"], requires_grad=True)
        saved[m] = _saved_bytes(lambda stage=stage, x=x, mask=mask: stage(x, mask))
    # what autograd keeps outside the checkpoint: the stage's inputs only (selective's kept matmul outputs live in the
    # checkpoint's own frame, invisible to these hooks; its policy is tested equal to the profile's above)
    assert saved["full"] == saved["selective"] < saved["none"] / 10, saved


@pytest.fixture
def world_of_one():
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


def test_pipe_split_markers_and_mismatches(world_of_one):
    from netweave.runtime.pipeline import build_traced_pipeline
    from pipesched.gpt2 import causal_mask, gpt2

    plan = one_host_plan(1, pp=1)
    stages = (jp.Stage(0, 0, (0, 3), (), "none"), jp.Stage(1, 0, (3, 4), (), "full"))   # both on rank 0
    plan = replace(plan, data_parallel=None, pipeline=jp.Pipeline("looped_bfs", 2, stages, torch_class="ScheduleLoopedBFS"))
    spec = gpt2(**SHAPE, microbatch=2, dropout=0.0, pipe_splits=True)   # markers before blocks.0, blocks.1, ln_f: 4 layers
    ids, mask, positions = spec["args"]
    kw = {"example_args": (ids,), "example_kwargs": {"positions": positions}, "constants": {"mask": mask}, "rank": 0, "device": torch.device("cpu")}
    run = build_traced_pipeline(plan, spec["model"], None, **kw)
    assert run.boundaries == ["pipe_split 3"]
    first, second = ({n.removeprefix("model.") for n, _ in s.submod.named_parameters()} for s in run.stages)
    assert {"blocks.1.ln_1.weight", "wte.weight"} <= first and "ln_f.weight" not in first
    assert "ln_f.weight" in second and not any(n.startswith("blocks.") for n in second)
    assert len(run.tied) == 1 and len(run.tied[0][1]) == 3 and run.tied[0][0] is None   # wte, and lm_head on both stages
    short = replace(plan, pipeline=replace(plan.pipeline, stages=(stages[0], replace(stages[1], layers=(3, 5)))))
    with pytest.raises(jp.PlanFormatError, match="the plan splits 5 layers, the model has 3 pipe_split"):
        build_traced_pipeline(short, gpt2(**SHAPE, microbatch=2, dropout=0.0, pipe_splits=True)["model"], None, **kw)
    with pytest.raises(jp.PlanFormatError, match=r"parallelism: a traced model runs as one pipeline here"):
        build_traced_pipeline(replace(plan, parallelism=jp.Parallelism(dp=2, pp=1)), spec["model"], None, **kw)
    plain = gpt2(**SHAPE, microbatch=2, dropout=0.0)["model"]
    with pytest.raises(jp.PlanFormatError, match=r"pipeline.stages\[1\]: the model has no submodule 'blocks.9'"):
        build_traced_pipeline(plan, plain, None, **{**kw, "split": ["blocks.0", "blocks.1", "blocks.9"]})
    with pytest.raises(jp.PlanFormatError, match="pipeline.stages: torch split the model into 4 stages, the plan has 2"):
        build_traced_pipeline(plan, spec["model"], None, **{**kw, "split": ["blocks.0", "blocks.1", "ln_f"]})   # names + its markers
    assert causal_mask(2).tolist() == [[0.0, float("-inf")], [0.0, 0.0]]
