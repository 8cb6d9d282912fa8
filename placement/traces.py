"""Job traces for replay: netweave's CSV/JSON format, Philly and Alibaba PAI importers, a seeded generator.

netweave trace format (CSV with a header, or JSON: a list of objects, or ``{"jobs": [...]}``):

============  ========================================================================
column        meaning
============  ========================================================================
name          job id (unique)
arrival_s     submission time, seconds from the start of the trace
gpus          GPU count (integer >= 1)
duration_s    compute time of the whole job when run alone (iterations x compute)
compute_ms    compute time of one iteration (ms); iterations = duration / compute
grad_bytes    gradient bytes all-reduced per iteration (0: no communication)
tp            tensor-parallel degree (optional, default 1)
vc            virtual cluster (optional; empty: opportunistic when VCs are used)
priority      guaranteed priority 0..1000 (optional, default 0)
============  ========================================================================

Communication time is not part of ``duration_s``: it comes from the placement
(routed collectives) and from contention with other jobs during the replay.

Sizes and times may carry a unit, as in a jobs file (``grad_bytes: 2GB``,
``compute_ms: 0.1s``; :mod:`topology.units`); a plain number is in the column's unit.

Importers (the public traces carry no model information, so ``compute_ms`` and
``grad_bytes`` are drawn, seeded, from :data:`MODEL_MIX`, a mix of common
models' per-iteration compute and gradient sizes):

* :func:`read_philly` -- Microsoft Philly ``cluster_job_log`` (JSON list of jobs
  with ``jobid``, ``vc``, ``submitted_time``, ``attempts[{start_time,
  end_time, detail[{ip, gpus[]}]}]``; times ``"YYYY-MM-DD HH:MM:SS"``). GPUs
  are those of the last attempt; duration is its end minus start.
* :func:`read_pai` -- Alibaba PAI ``cluster-trace-gpu-v2020`` ``pai_task_table``
  (CSV, columns ``job_name, task_name, inst_num, status, start_time,
  end_time, plan_cpu, plan_mem, plan_gpu, gpu_type``, header optional; times
  in seconds; ``plan_gpu`` in percent of one GPU per instance). GPUs are
  ``ceil(inst_num * plan_gpu / 100)``; tasks without a GPU or an end are skipped.

>>> jobs = synthetic_trace(5, seed=1)
>>> [j.name for j in jobs], all(j.gpus >= 1 for j in jobs)
(['job0000', 'job0001', 'job0002', 'job0003', 'job0004'], True)
"""

from __future__ import annotations

import csv
import io
import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from topology.errors import InputError
from topology.inputs import check_name, check_node_id, loads_json, read_text
from topology.limits import MAX_JOB_GPUS, MAX_JOBS, MAX_SECONDS
from topology.units import parse_duration, parse_size

from .profiles import JobSpec

COLUMNS = ("name", "arrival_s", "gpus", "duration_s", "compute_ms", "grad_bytes", "tp", "vc", "priority")

# (model, compute ms per iteration, gradient bytes): per-GPU compute of one iteration and fp16/fp32 gradient size
MODEL_MIX: tuple[tuple[str, float, float], ...] = (
    ("resnet50", 90.0, 102e6),
    ("vgg16", 120.0, 553e6),
    ("bert-large", 180.0, 1.34e9),
    ("gpt2-xl", 260.0, 3.1e9),
    ("dlrm", 60.0, 800e6),
    ("transformer-xl", 150.0, 1.1e9),
)


@dataclass(frozen=True)
class TraceJob:
    """One trace entry; :meth:`spec` turns it into a :class:`JobSpec` with its iteration count."""

    name: str
    arrival_s: float
    gpus: int
    duration_s: float
    compute_ms: float
    grad_bytes: float
    tp: int = 1
    vc: str | None = None
    priority: int = 0

    @property
    def iterations(self) -> int:
        return max(1, round(self.duration_s / (self.compute_ms / 1e3)))

    def spec(self) -> JobSpec:
        return JobSpec(self.name, self.gpus, compute_s=self.compute_ms / 1e3, grad_bytes=self.grad_bytes, iterations=self.iterations,
                       tp=self.tp, vc=self.vc, priority=self.priority, arrival=self.arrival_s)

    def to_row(self) -> dict[str, Any]:
        return {"name": self.name, "arrival_s": self.arrival_s, "gpus": self.gpus, "duration_s": self.duration_s,
                "compute_ms": self.compute_ms, "grad_bytes": self.grad_bytes, "tp": self.tp, "vc": self.vc or "", "priority": self.priority}


def _num(row: Mapping[str, Any], key: str, where: str, source: str | None, *, integer: bool = False, default: Any = None,
         minimum: float = 0.0, maximum: float = MAX_SECONDS) -> Any:
    value = row.get(key)
    if value in (None, ""):
        if default is not None:
            return default
        raise InputError(f"missing {key!r}", source=source, where=where)
    try:
        out = int(value) if integer and not isinstance(value, float) else float(value)
        if integer and (isinstance(value, float) and not value.is_integer()):
            raise ValueError
        out = int(out) if integer else out
    except (TypeError, ValueError):
        raise InputError(f"expected {'an integer' if integer else 'a number'}, got {value!r}", source=source, where=f"{where}.{key}") from None
    if not math.isfinite(out) or out < minimum:
        raise InputError(f"expected a value >= {minimum:g}, got {value!r}", source=source, where=f"{where}.{key}")
    if out > maximum:
        raise InputError(f"expected a value <= {maximum:g} (the limit), got {value!r}", source=source, where=f"{where}.{key}")
    return out


def _quantity(row: Mapping[str, Any], key: str, where: str, source: str | None, parse: Any, default: float | None = None, **unit: Any) -> float:
    """A size or duration column through :mod:`topology.units` (``2GB``, ``120ms``; a plain number in the column's unit)."""
    value = row.get(key)
    if value in (None, ""):
        if default is not None:
            return default
        raise InputError(f"missing {key!r}", source=source, where=where)
    return parse(value, where=f"{where}.{key}", source=source, **unit)


def _job_from_row(row: Mapping[str, Any], where: str, source: str | None) -> TraceJob:
    name = check_node_id(row.get("name"), what="job name", source=source, where=f"{where}.name")
    vc = row.get("vc") or None
    if vc is not None:
        check_name(vc, what="virtual-cluster name", source=source, where=f"{where}.vc")
    job = TraceJob(
        name=name,
        arrival_s=_quantity(row, "arrival_s", where, source, parse_duration),
        gpus=_num(row, "gpus", where, source, integer=True, minimum=1, maximum=MAX_JOB_GPUS),
        duration_s=_quantity(row, "duration_s", where, source, parse_duration),
        compute_ms=_quantity(row, "compute_ms", where, source, parse_duration, 100.0, unit="ms", positive=True),
        grad_bytes=_quantity(row, "grad_bytes", where, source, parse_size, 0.0),
        tp=_num(row, "tp", where, source, integer=True, default=1, minimum=1, maximum=MAX_JOB_GPUS),
        vc=vc,
        priority=_num(row, "priority", where, source, integer=True, default=0, maximum=1000),
    )
    if job.gpus % job.tp:
        raise InputError(f"tp={job.tp} must divide gpus={job.gpus}", source=source, where=f"{where}.tp")
    return job


def loads_trace(text: str, *, source: str | None = None) -> list[TraceJob]:
    """Parse a netweave trace (CSV or JSON, told apart by the first character)."""
    head = text.lstrip()[:1]
    if head in ("[", "{"):
        data = loads_json(text, source=source)
        rows = data.get("jobs") if isinstance(data, dict) else data
        if not isinstance(rows, list):
            raise InputError("expected a list of jobs", source=source, where="jobs")
        if len(rows) > MAX_JOBS:
            raise InputError(f"{len(rows)} jobs, more than {MAX_JOBS} (the limit)", source=source, where="jobs")
        jobs = [_job_from_row(r if isinstance(r, Mapping) else {}, f"jobs[{i}]", source) for i, r in enumerate(rows)]
    else:
        reader = csv.DictReader(io.StringIO(text))
        jobs = []
        try:
            missing = {"name", "arrival_s", "gpus", "duration_s"} - set(reader.fieldnames or [])
            if missing:
                raise InputError(f"CSV header lacks {', '.join(sorted(missing))}; expected columns {', '.join(COLUMNS)}", source=source, where=1)
            for i, r in enumerate(reader):
                if i >= MAX_JOBS:
                    raise InputError(f"more than {MAX_JOBS} jobs (the limit)", source=source, where=reader.line_num)
                if None in r or None in r.values():
                    raise InputError(f"expected {len(reader.fieldnames or [])} columns as in the header", source=source, where=reader.line_num)
                jobs.append(_job_from_row(r, f"line {reader.line_num}", source))
        except csv.Error as exc:
            raise InputError(f"invalid CSV ({exc})", source=source, where=reader.line_num) from None
    seen: set[str] = set()
    for j in jobs:
        if j.name in seen:
            raise InputError(f"job name {j.name!r} is used twice", source=source)
        seen.add(j.name)
    return sorted(jobs, key=lambda j: (j.arrival_s, j.name))


def read_trace(path: str | Path) -> list[TraceJob]:
    return loads_trace(read_text(path), source=str(path))


def dumps_trace(jobs: Sequence[TraceJob], format: str = "csv") -> str:
    """Write a trace as CSV (default) or JSON; :func:`loads_trace` reads it back equal."""
    if format == "json":
        return json.dumps({"jobs": [j.to_row() for j in jobs]}, indent=1) + "\n"
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(COLUMNS), lineterminator="\n")
    w.writeheader()
    for j in jobs:
        w.writerow({k: (repr(v) if isinstance(v, float) else v) for k, v in j.to_row().items()})
    return buf.getvalue()


def _model(rng: random.Random) -> tuple[str, float, float]:
    return rng.choice(MODEL_MIX)


def _parse_time(value: Any, where: str, source: str | None) -> float:
    if value in (None, "", "None"):
        raise InputError("missing time", source=source, where=where)
    try:
        return datetime.strptime(str(value), "%Y-%m-%d %H:%M:%S").timestamp()
    except ValueError:
        raise InputError(f"expected a time 'YYYY-MM-DD HH:MM:SS', got {value!r}", source=source, where=where) from None


def read_philly(path: str | Path, *, seed: int = 0, limit: int | None = None) -> list[TraceJob]:
    """Import a Philly ``cluster_job_log`` (see the module docstring); model fields are drawn with ``seed``."""
    source = str(path)
    data = loads_json(read_text(path), source=source)
    if not isinstance(data, list):
        raise InputError("expected a JSON list of jobs (Philly cluster_job_log)", source=source)
    rng = random.Random(seed)
    rows = []
    for i, job in enumerate(data):
        where = f"[{i}]"
        if not isinstance(job, Mapping) or "jobid" not in job:
            raise InputError("expected an object with 'jobid'", source=source, where=where)
        raw_attempts = job.get("attempts") or []
        if not isinstance(raw_attempts, list) or not all(isinstance(a, Mapping) for a in raw_attempts):
            raise InputError("expected a list of attempt objects", source=source, where=f"{where}.attempts")
        attempts = [a for a in raw_attempts if a.get("start_time") and a.get("end_time")]
        if not attempts:
            continue  # never ran (killed in the queue): nothing to replay
        last = attempts[-1]
        detail = last.get("detail") or []
        if not isinstance(detail, list) or not all(isinstance(d, Mapping) and isinstance(d.get("gpus") or [], list) for d in detail):
            raise InputError("expected a list of {ip, gpus: [...]} objects", source=source, where=f"{where}.attempts[-1].detail")
        gpus = sum(len(d.get("gpus") or []) for d in detail)
        if gpus < 1:
            continue
        if gpus > MAX_JOB_GPUS:
            raise InputError(f"{gpus} GPUs, more than {MAX_JOB_GPUS} (the limit)", source=source, where=f"{where}.attempts[-1].detail")
        submitted = _parse_time(job.get("submitted_time"), f"{where}.submitted_time", source)
        duration = _parse_time(last["end_time"], f"{where}.attempts[-1].end_time", source) - _parse_time(
            last["start_time"], f"{where}.attempts[-1].start_time", source)
        if duration < 0:
            raise InputError(f"the attempt ends {-duration:g} s before it starts", source=source, where=f"{where}.attempts[-1].end_time")
        if duration == 0:
            continue  # failed at once: nothing to replay
        jobid = check_node_id(str(job["jobid"]), what="job id", source=source, where=f"{where}.jobid")
        vc = job.get("vc") or None
        if vc is not None:
            check_name(vc, what="virtual-cluster name", source=source, where=f"{where}.vc")
        _, compute_ms, grad = _model(rng)
        rows.append((submitted, jobid, gpus, duration, compute_ms, grad, vc))
    return _normalise(rows, limit)


def read_pai(path: str | Path, *, seed: int = 0, limit: int | None = None) -> list[TraceJob]:
    """Import an Alibaba PAI v2020 ``pai_task_table`` CSV (see the module docstring)."""
    source = str(path)
    cols = ["job_name", "task_name", "inst_num", "status", "start_time", "end_time", "plan_cpu", "plan_mem", "plan_gpu", "gpu_type"]
    try:
        lines = list(csv.reader(io.StringIO(read_text(path))))
    except csv.Error as exc:
        raise InputError(f"invalid CSV ({exc})", source=source) from None
    if lines and lines[0] and lines[0][0] == "job_name":
        lines = lines[1:]
    rng = random.Random(seed)
    rows = []
    for n, fields in enumerate(lines, start=1):
        if not fields:
            continue
        if len(fields) != len(cols):
            raise InputError(f"expected {len(cols)} columns ({', '.join(cols)}), got {len(fields)}", source=source, where=n)
        r = dict(zip(cols, fields, strict=True))
        if not r["plan_gpu"] or not r["end_time"] or not r["start_time"]:
            continue
        try:
            inst, plan_gpu = float(r["inst_num"] or 1), float(r["plan_gpu"])
            start, end = float(r["start_time"]), float(r["end_time"])
        except ValueError:
            raise InputError("expected numbers in inst_num, plan_gpu, start_time, end_time", source=source, where=n) from None
        if not all(math.isfinite(x) and 0 <= x <= MAX_SECONDS * 10 for x in (inst, plan_gpu, start, end)):
            raise InputError("expected finite, non-negative numbers in inst_num, plan_gpu, start_time, end_time", source=source, where=n)
        if end < start:
            raise InputError(f"end_time {r['end_time']} precedes start_time {r['start_time']}", source=source, where=n)
        gpus = math.ceil(inst * plan_gpu / 100 - 1e-9)
        if gpus > MAX_JOB_GPUS:
            raise InputError(f"{gpus} GPUs, more than {MAX_JOB_GPUS} (the limit)", source=source, where=n)
        if gpus < 1 or end == start:
            continue  # no GPU, or failed at once: nothing to replay
        name = check_node_id(f"{r['job_name']}/{r['task_name']}", what="job/task name", source=source, where=n)
        _, compute_ms, grad = _model(rng)
        rows.append((start, name, gpus, end - start, compute_ms, grad, None))
    return _normalise(rows, limit)


def _normalise(rows: list[tuple], limit: int | None) -> list[TraceJob]:
    rows.sort(key=lambda r: (r[0], r[1]))
    if limit is not None:
        rows = rows[:limit]
    t0 = rows[0][0] if rows else 0.0
    return [TraceJob(name, round(t - t0, 6), gpus, float(dur), compute_ms, grad, 1, vc) for t, name, gpus, dur, compute_ms, grad, vc in rows]


# Philly-like GPU-count distribution (most jobs are small; Jeon et al., ATC'19, Fig. 2 shape)
SIZE_MIX = ((1, 0.55), (2, 0.12), (4, 0.12), (8, 0.12), (16, 0.05), (32, 0.03), (64, 0.01))


def synthetic_trace(n: int, *, seed: int = 0, arrival_rate: float = 1 / 60, mean_duration_s: float = 1800.0,
                    sizes: Sequence[tuple[int, float]] = SIZE_MIX, network_heavy: float = 0.0, max_gpus: int | None = None) -> list[TraceJob]:
    """``n`` jobs with Poisson arrivals, sizes from ``sizes``, log-normal durations and models from :data:`MODEL_MIX`.

    ``network_heavy`` (0..1) is the share of jobs whose gradient volume is
    scaled up 4x (large-model data parallelism that is network-bound).
    """
    rng = random.Random(seed)
    t = 0.0
    total = sum(w for _, w in sizes)
    out = []
    sigma = 1.0
    mu = math.log(mean_duration_s) - sigma**2 / 2
    for i in range(n):
        t += rng.expovariate(arrival_rate)
        x, acc = rng.uniform(0, total), 0.0
        gpus = sizes[-1][0]
        for g, w in sizes:
            acc += w
            if x <= acc:
                gpus = g
                break
        if max_gpus:
            gpus = min(gpus, max_gpus)
        _, compute_ms, grad = _model(rng)
        if rng.random() < network_heavy:
            grad *= 4
        out.append(TraceJob(f"job{i:04d}", round(t, 3), gpus, round(rng.lognormvariate(mu, sigma), 3), compute_ms, grad))
    return out


def with_vcs(jobs: Sequence[TraceJob], vcs: Sequence[str], *, seed: int = 0) -> list[TraceJob]:
    """Assign jobs to virtual clusters round-robin by a seeded draw (for multi-tenant replays)."""
    rng = random.Random(seed)
    return [replace(j, vc=rng.choice(list(vcs))) for j in jobs]
