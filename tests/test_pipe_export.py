"""Export to torch.distributed.pipelining: CSV round trips and torch's own loader."""

from __future__ import annotations

import json

import pytest

from pipesched.devices import Device, LinkModel
from pipesched.export import ExportError, export_plan, read_torch_csv, schedule_csv, schedule_from_torch_csv, write_torch_csv
from pipesched.partition import partition
from pipesched.profile import GPTConfig, analytic_profile
from pipesched.schedules import chimera, gpipe, interleaved_1f1b, one_f_one_b, validate, zb_h1


@pytest.mark.parametrize("sched", [gpipe(3, 4), one_f_one_b(4, 6), zb_h1(4, 6), interleaved_1f1b(2, 4, 2)], ids=lambda s: s.name)
def test_csv_round_trip(sched, tmp_path):
    path = write_torch_csv(sched, tmp_path / "s.csv")
    back = schedule_from_torch_csv(path, sched.microbatches)
    assert back.rows() == sched.rows() and back.stage_rank == sched.stage_rank
    assert validate(back) == []
    comms = write_torch_csv(sched, tmp_path / "c.csv", format="compute_comms")
    rows = read_torch_csv(comms)
    assert rows == sched.with_comms()


def test_torch_runtime_loads_our_csv(tmp_path):
    """torch's _PipelineScheduleRuntime._load_csv parses, validates and lowers our file (stage objects are not needed for that)."""
    ts = pytest.importorskip("torch.distributed.pipelining.schedules")
    sched = zb_h1(4, 8)
    path = write_torch_csv(sched, tmp_path / "zb.csv")
    runtime = object.__new__(ts._PipelineScheduleRuntime)
    runtime.pipeline_order = {}
    runtime.pp_group_size, runtime._num_stages, runtime._n_microbatches, runtime._stages = 4, 4, 8, []
    runtime._defer_pp_recv = False
    runtime._load_csv(str(path), format="compute_only")
    assert runtime.stage_index_to_group_rank == {0: 0, 1: 1, 2: 2, 3: 3}
    lowered = {r: [str(a) for a in acts] for r, acts in runtime.pipeline_order_with_comms.items()}
    assert "1RECV_F0" in lowered[1] and "0SEND_F0" in lowered[0] and "3REDUCE_GRAD" in lowered[3]
    dumped = tmp_path / "dump.csv"
    runtime._dump_csv(str(dumped), format="compute_only")
    assert read_torch_csv(dumped) == sched.actions


def test_chimera_is_not_exportable():
    with pytest.raises(ExportError, match="two ranks"):
        schedule_csv(chimera(4, 4))


def test_export_plan_files(tmp_path):
    prof = analytic_profile(GPTConfig(layers=6, hidden=256, heads=4, seq_len=128, vocab=1000))
    part = partition(prof, [Device(f"g{i}") for i in range(4)], LinkModel.uniform(4, 1e10, 1e-6), microbatches=8)
    info = export_plan(one_f_one_b(4, 8), part, tmp_path, layer_names=[lay.name for lay in prof.layers])
    meta = json.loads((tmp_path / "stages.json").read_text())
    assert [s["layers"] for s in meta["stages"]] == [list(s.layers) for s in part.stages]
    assert meta["stages"][0]["modules"][0] == "embedding" and meta["stages"][-1]["modules"][-1] == "lm_head"
    assert (tmp_path / "schedule.csv").read_text().splitlines()[0].startswith("0F0,0F1,0F2")
    assert info["format"] == "compute_only"
