"""The job-plan format: round trips, one-line errors naming the field, and file modes."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from netweave.runtime import plan as jp
from topology.io import atomic_write_text


def _plan(pp: int = 1, dp: int = 2) -> jp.JobPlan:
    world = pp * dp
    ranks = [jp.Rank(r, f"node{r // 2}", r % 2, f"node{r // 2}/gpu{r % 2}") for r in range(world)]
    hosts = [jp.Host(f"node{h}", h, 2, "0,1") for h in range((world + 1) // 2)]
    pipeline = None
    if pp > 1:
        stages = tuple(jp.Stage(i, i, (2 * i, 2 * i + 2), (f"layers.{2 * i}", f"layers.{2 * i + 1}"), "full" if i == 0 else "none")
                       for i in range(pp))
        pipeline = jp.Pipeline("1F1B", 4, stages, torch_class="Schedule1F1B", predicted_iteration_s=0.5)
    return jp.JobPlan(job="llm-1", world_size=world, ranks=ranks, hosts=hosts, rendezvous=jp.Rendezvous("node0", 29517),
                      parallelism=jp.Parallelism(dp=dp, pp=pp), start_offset_s=0.25, period_s=0.5,
                      traffic=jp.Traffic(traffic_class=5, dscp=46, priority=1),
                      data_parallel=jp.DataParallel("prophet", 4 << 20, 16 << 20, False), pipeline=pipeline,
                      prediction={"iteration_s": 0.5}, provenance={"netweave": "0.1.0"})


@pytest.mark.parametrize("pp", [1, 2])
def test_round_trip(pp):
    p = _plan(pp)
    assert jp.loads(jp.dumps(p)) == p


@pytest.mark.parametrize(("path", "value", "field"), [
    (("version",), 2, "version"),
    (("parallelism", "dp"), 3, "parallelism"),
    (("job",), "../x", "job"),
    (("job",), "a\nb", "job"),
    (("rendezvous", "port"), 70000, "rendezvous.port"),
    (("rendezvous", "addr"), "node0;rm -rf /", "rendezvous.addr"),
    (("start_offset_s",), -1.0, "start_offset_s"),
    (("period_s",), "1s", "period_s"),
    (("hosts", 0, "cuda_visible_devices"), "0,1;x", "hosts[0].cuda_visible_devices"),
    (("pipeline", "stages", 1, "layers"), [3, 4], "pipeline.stages"),
    (("pipeline", "stages", 0, "recompute"), "some", "pipeline.stages[0].recompute"),
    (("data_parallel", "policy"), "horovod", "data_parallel.policy"),
    (("extra",), 1, "extra"),
])
def test_bad_field_is_named(path, value, field):
    d = _plan(2).to_dict()
    obj = d
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = value
    with pytest.raises(jp.PlanFormatError) as err:
        jp.loads(json.dumps(d), source="bundle/llm-1/plan.json")
    assert str(err.value).startswith(f"bundle/llm-1/plan.json: {field}")
    assert "\n" not in str(err.value).replace("a\nb", "")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_any_bytes_give_plan_format_error(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("p") / "plan.json"
    path.write_bytes(data)
    with pytest.raises(jp.PlanFormatError):
        jp.load(path)


def test_runtime_format_imports_no_planner():
    heavy = ("topology", "networkx", "numpy", "placement", "pipesched", "flowsched", "emu")
    code = f"import sys, netweave.runtime.plan; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
    # the whole runtime: torch only once a name is used, and never a planner or the emulator
    code = ("import sys, netweave.runtime as nw; bare = 'torch' in sys.modules; nw.init; "
            "import netweave.runtime.job, netweave.runtime.ddp, netweave.runtime.pipeline, netweave.runtime.phase; "
            f"print(bare, [m for m in {heavy!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False []"


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_atomic_write_uses_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        atomic_write_text(tmp_path / "hostfile", "node0\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "hostfile").stat().st_mode) == 0o666 & ~umask
    assert [p.name for p in tmp_path.iterdir()] == ["hostfile"]
