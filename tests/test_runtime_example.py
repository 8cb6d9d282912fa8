"""The user's path: examples/train_transformer.py under torchrun with a job plan, as a bundle's launch script runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
from runtime_helpers import EXAMPLE, REPO, free_port, one_host_plan

from netweave.runtime import plan as jp


def torchrun(plan: jp.JobPlan, tmp_path, *args: str, nproc: int = 2, timeout: float = 240) -> subprocess.CompletedProcess:
    path = tmp_path / "plan.json"
    path.write_text(jp.dumps(plan))
    env = {**os.environ, "NETWEAVE_JOB_PLAN": str(path), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={plan.rendezvous.port}", str(EXAMPLE), "--out", str(tmp_path / "r{rank}.json"), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)


def results(tmp_path, world: int = 2) -> list[dict]:
    return [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(world)]


def test_data_parallel_job_waits_its_offset_and_keeps_its_phase(tmp_path):
    offset, period = 0.5, 0.3
    plan = one_host_plan(2, port=free_port(), policy="prophet", partition_bytes=4096, offset=offset, period=period)
    res = torchrun(plan, tmp_path, "--steps", "6")
    assert res.returncode == 0, res.stderr[-3000:]
    for r, out in enumerate(results(tmp_path)):
        assert out["rank"] == r and out["mode"] == "data_parallel" and out["comm_plan"] == "prophet"
        t = out["timing"]
        # the first iteration starts at t0 + offset (not before; a little after: the sleep's wake-up)
        assert offset <= t["first_start_s"] <= offset + 0.05, t
        for start, slot in zip(t["starts_s"], t["slots"], strict=True):
            assert offset + slot * period - 1e-3 <= start <= offset + slot * period + t["tolerance"] * period + 0.05, t
        assert len(out["losses"]) == 6 and all(x > 0 for x in out["iteration_s"])
    a, b = results(tmp_path)
    assert a["timing"]["t0"] == b["timing"]["t0"]            # one reference time, rank 0's,
    cycles = a["timing"]["t0"] / period                       # on the period's grid since the epoch (shared by all jobs)
    assert abs(cycles - round(cycles)) < 1e-3


def _pipeline_plan(kind: str) -> jp.JobPlan:
    from pipesched.export import schedule_csv
    from pipesched.schedules import one_f_one_b

    plan = one_host_plan(2, port=free_port(), pp=2, recompute=("full", "selective"))
    if kind == "csv":            # our schedule as torch's runtime CSV (_PipelineScheduleRuntime)
        return replace(plan, pipeline=replace(plan.pipeline, torch_class=None, actions_csv=schedule_csv(one_f_one_b(2, 4))))
    if kind == "interleaved":    # two stages per rank, one block each, under torch's ScheduleInterleaved1F1B
        stages = tuple(jp.Stage(i, i % 2, (i, i + 1), (), "full" if i == 0 else "none") for i in range(4))
        return replace(plan, pipeline=jp.Pipeline("interleaved", 4, stages, chunks=2, torch_class="ScheduleInterleaved1F1B"))
    return plan


@pytest.mark.parametrize("kind", ["Schedule1F1B", "csv", "interleaved"])
def test_two_stage_pipeline_with_recomputation_learns(tmp_path, kind):
    res = torchrun(_pipeline_plan(kind), tmp_path, "--steps", "12", "--lr", "0.2")
    assert res.returncode == 0, res.stderr[-3000:]
    first, last = results(tmp_path)
    assert first["mode"] == last["mode"] == "pipeline"
    assert first["losses"] == [None] * 12                    # the first stage has no loss
    losses = last["losses"]
    assert sum(losses[-3:]) / 3 < 0.9 * sum(losses[:3]) / 3, losses


def test_two_replicas_of_a_pipeline_reduce_each_stage_through_the_hook(tmp_path):
    plan = one_host_plan(4, port=free_port(), pp=2, recompute=("none", "full"))
    plan = replace(plan, data_parallel=jp.DataParallel("bytescheduler", 2048, 8192))
    res = torchrun(plan, tmp_path, "--steps", "6", "--lr", "0.2", nproc=4)
    assert res.returncode == 0, res.stderr[-3000:]
    out = results(tmp_path, 4)
    # ranks 0, 1 hold stage 0 of replicas 0, 1; ranks 2, 3 stage 1: each stage's replicas trained identical parameters
    assert out[0]["params_sha256"] == out[1]["params_sha256"] != out[2]["params_sha256"] == out[3]["params_sha256"]
    assert all(o["comm_plan"] == "bytescheduler" for o in out)
    for last in out[2:]:                                        # each replica's last stage: its own data, its loss falls
        assert last["losses"][-1] < last["losses"][0]
    assert out[2]["losses"] != out[3]["losses"]


def test_model_that_does_not_fit_the_plan_is_one_line_exit_2(tmp_path):
    # one rank, one stage of 5 layers; the example's model has depth + 2 = 4 blocks
    plan = one_host_plan(1, port=free_port(), pp=1)
    stage = jp.Stage(0, 0, (0, 5), (), "full")
    plan = replace(plan, data_parallel=None, pipeline=jp.Pipeline("1F1B", 4, (stage,), torch_class="ScheduleGPipe"))
    path = tmp_path / "plan.json"
    path.write_text(jp.dumps(plan))
    env = {**os.environ, "NETWEAVE_JOB_PLAN": str(path), "PYTHONPATH": str(REPO)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    res = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "1", "--out", str(tmp_path / "r{rank}.json")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip().splitlines() == [f"train_transformer: {path}: pipeline.stages: the plan splits 5 layers, "
                                               "the model passed has 4 blocks"]
