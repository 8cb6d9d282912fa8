"""Export a plan to ``torch.distributed.pipelining`` (the installed torch, 2.13).

torch's ``_PipelineScheduleRuntime`` runs any schedule given as a CSV with one row per pipeline rank, each
cell an action string ``[stage][F|I|W|B][microbatch]`` (``format="compute_only"``; torch then infers the
stage-to-rank mapping from the rows, validates it with ``_validate_schedule`` and inserts the SEND/RECV
actions itself), or with the communication spelled out (``format="compute_comms"``: also
``[stage]SEND_F[mb]`` etc.; torch takes the order as given). Our action names are torch's, so a row is
``",".join(str(a) for a in actions)``. The partition goes with it as the layer span of every stage id, which
a launcher uses to build one ``PipelineStage`` per stage id on the rank that holds it.

Each family's public torch class is in :data:`TORCH_CLASSES` (:func:`torch_schedule_class`).

Not exportable: Chimera (torch forbids one stage id on two ranks and requires every stage to run all
micro-batches; Chimera's replicas would need tied weights across two stage ids and a replica all-reduce,
which the runtime does not have). Rows for ``PipelineScheduleMulti._load_csv`` (lock-step, time-aligned) are
not produced; ``_PipelineScheduleRuntime`` has no such requirement.

>>> from pipesched.schedules import one_f_one_b
>>> print(schedule_csv(one_f_one_b(2, 2)), end="")
0F0,0F1,0B0,0B1
1F0,1B0,1F1,1B1
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from topology.errors import InputError
from topology.io import atomic_write_text

from .partition import Partition
from .schedules import Action, Schedule, ScheduleError

TORCH_FORMATS = ("compute_only", "compute_comms")

# torch.distributed.pipelining's public schedule class that runs each family in the same action order as ours
# (tests/test_pipe_schedules.py compares the orders), or None where torch has none (Chimera: not exportable at all).
# ZB-H1 is the one-chunk case of ScheduleInterleavedZeroBubble. Any exportable family also runs from its CSV through
# _PipelineScheduleRuntime.
TORCH_CLASSES: dict[str, str | None] = {
    "gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
    "zbh1": "ScheduleInterleavedZeroBubble", "interleaved_zb": "ScheduleInterleavedZeroBubble", "looped_bfs": "ScheduleLoopedBFS",
    "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV", "chimera": None,
}


def torch_schedule_class(family: str) -> str | None:
    """The name of torch's public schedule class for ``family`` (:data:`TORCH_CLASSES`), None if torch has none.

    >>> torch_schedule_class("zbv"), torch_schedule_class("chimera")
    ('ScheduleZBVZeroBubble', None)
    """
    if family not in TORCH_CLASSES:
        raise ExportError(f"unknown schedule family {family!r}, expected one of {sorted(TORCH_CLASSES)}", where="--schedule")
    return TORCH_CLASSES[family]


def exportable(schedule: Schedule) -> str | None:
    """Why torch's runtime cannot run ``schedule``, or None when it can."""
    try:
        check_exportable(schedule)
    except ExportError as exc:
        return str(exc)
    return None


class ExportError(InputError):
    """A plan that the target runtime cannot express."""


def check_exportable(schedule: Schedule) -> None:
    if len(schedule.chains) != 1 or len(set(schedule.stage_layers)) != schedule.num_stages:
        raise ExportError(f"schedule {schedule.name!r} places replicas of a stage on two ranks (two pipelines); torch's runtime "
                          "needs one rank per stage id and every stage to run all micro-batches", where="--schedule")
    if any(a.kind == "REDUCE_GRAD" for acts in schedule.actions.values() for a in acts):
        raise ExportError("REDUCE_GRAD actions are inserted by torch's lowering, not exported", where="--schedule")


def schedule_csv(schedule: Schedule, format: str = "compute_only") -> str:
    """The CSV text torch's ``_PipelineScheduleRuntime._load_csv(path, format)`` reads."""
    if format not in TORCH_FORMATS:
        raise ExportError(f"unknown format {format!r}, expected one of {list(TORCH_FORMATS)}", where="--format")
    check_exportable(schedule)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    rows = schedule.rows() if format == "compute_only" else [[str(a) for a in schedule.with_comms()[r]] for r in range(schedule.ranks)]
    for row in rows:
        writer.writerow(row)
    return buf.getvalue()


def write_torch_csv(schedule: Schedule, path: str | Path, format: str = "compute_only") -> Path:
    atomic_write_text(path, schedule_csv(schedule, format))
    return Path(path)


def read_torch_csv(path: str | Path) -> dict[int, list[Action]]:
    """Rows of a torch schedule CSV as our actions (empty cells, torch's idle steps, are dropped)."""
    from topology.inputs import read_text

    text = read_text(path, error=ExportError)
    out: dict[int, list[Action]] = {}
    try:
        for rank, row in enumerate(csv.reader(io.StringIO(text))):
            out[rank] = [Action.parse(cell, source=str(path), where=f"line {rank + 1}") for cell in row if cell.strip()]
    except csv.Error as exc:
        raise ExportError(f"invalid CSV ({exc})", source=str(path)) from None
    return out


def schedule_from_torch_csv(path: str | Path, microbatches: int) -> Schedule:
    """Rebuild a single-chain Schedule from a compute_only CSV (stage-to-rank inferred as torch does)."""
    rows = read_torch_csv(path)
    stage_rank: dict[int, int] = {}
    for rank, acts in rows.items():
        for a in acts:
            if a.kind not in ("F", "B", "I", "W"):
                raise ExportError(f"{a} is not a compute action; expected a compute_only CSV", source=str(path), where=f"line {rank + 1}")
            if stage_rank.setdefault(a.stage, rank) != rank:
                raise ExportError(f"stage {a.stage} appears on ranks {stage_rank[a.stage]} and {rank}", source=str(path))
    stages = len(stage_rank)
    if sorted(stage_rank) != list(range(stages)):
        raise ExportError(f"stage ids {sorted(stage_rank)} are not 0..{stages - 1}", source=str(path))
    return Schedule("csv", len(rows), microbatches, tuple(stage_rank[s] for s in range(stages)), (tuple(range(stages)),),
                    (tuple(range(microbatches)),), rows)


def export_plan(schedule: Schedule, part: Partition, out_dir: str | Path, *, format: str = "compute_only",
                layer_names: list[str] | None = None) -> dict[str, Any]:
    """Write ``schedule.csv`` (torch) and ``stages.json`` (layer span and rank of every stage id) into ``out_dir``."""
    out = Path(out_dir)
    csv_path = write_torch_csv(schedule, out / "schedule.csv", format)
    stages = []
    for sid in range(schedule.num_stages):
        i, j = part.stages[schedule.stage_layers[sid]].layers
        entry: dict[str, Any] = {"stage": sid, "rank": schedule.stage_rank[sid], "layers": [i, j],
                                 "recompute": part.stages[schedule.stage_layers[sid]].recompute}
        if layer_names:
            entry["modules"] = layer_names[i:j]
        stages.append(entry)
    meta = {"format": format, "csv": csv_path.name, "ranks": schedule.ranks, "num_stages": schedule.num_stages,
            "microbatches": schedule.microbatches, "schedule": schedule.name, "stages": stages,
            "torch_loader": f"_PipelineScheduleRuntime(stages, n_microbatches={schedule.microbatches}, loss_fn=...)"
                            f"._load_csv('{csv_path.name}', format='{format}')"}
    atomic_write_text(out / "stages.json", json.dumps(meta, indent=1) + "\n")
    return {"csv": str(csv_path), "stages": str(out / "stages.json"), **meta}


def spans_for_schedule(schedule: Schedule, part: Partition) -> list[tuple[int, int]]:
    """Layer span of every stage id (what the runner builds on each rank)."""
    try:
        return [part.stages[schedule.stage_layers[sid]].layers for sid in range(schedule.num_stages)]
    except IndexError:
        raise ScheduleError("the partition has fewer stages than the schedule needs") from None
