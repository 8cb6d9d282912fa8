"""The job plan: the one document that carries a job's plan from ``netweave launch`` into its training script.

``netweave launch`` writes one ``plan.json`` per job into the job's bundle (:func:`dumps`,
then ``topology.io.atomic_write_text``); the runtime (:mod:`netweave.runtime`) reads it
inside the user's training script. This module is the format's only reader. It imports
the standard library only, so that a training script that adopts the runtime pays for
nothing but torch.

Format ``netweave-job-plan``, version 1 (JSON object)::

    format, version         "netweave-job-plan", 1
    job                     job name ([A-Za-z0-9][A-Za-z0-9._-]{0,63}: it names files and hosts' scripts)
    world_size              number of ranks
    parallelism             {dp, tp, pp}: dp * tp * pp == world_size
    ranks                   [{rank, host, local_rank, device}] in rank order (device: the topology's GPU id)
    hosts                   [{host, node_rank, nproc, cuda_visible_devices}] in node-rank order
    rendezvous              {addr, port}: torchrun's master address and port, unique among jobs that can run at once
    start_offset_s          CASSINI time shift: wait this long after the job's common start before the first iteration
    period_s                the planned iteration period (null: unknown); the runtime keeps its phase against it
    traffic                 {traffic_class, dscp, priority}: the job's class across jobs (any may be null)
    data_parallel           null, or {policy, partition_bytes, credit_bytes, barrier, params}: the in-job plan's policy
                            and knobs; the runtime makes the plan over the model's own parameters on rank 0 and
                            broadcasts it
    pipeline                null, or {schedule, microbatches, chunks, torch_class, stages: [{index, rank, layers: [lo, hi],
                            modules: [names], recompute}], actions_csv, predicted_iteration_s}
    prediction              free-form numbers the planners predicted (iteration_s, ...)
    provenance              free-form: what made the plan (netweave version, policies, inputs)

Bad input raises :class:`PlanFormatError` naming the file and field.

>>> p = JobPlan(job="demo", world_size=2, parallelism=Parallelism(dp=2),
...             ranks=[Rank(0, "node0", 0, "node0/gpu0"), Rank(1, "node0", 1, "node0/gpu1")],
...             hosts=[Host("node0", 0, 2, "0,1")], rendezvous=Rendezvous("node0", 29400))
>>> loads(dumps(p)) == p
True
>>> loads('{"format": "netweave-job-plan", "version": 9}', source="b/plan.json")
Traceback (most recent call last):
  ...
netweave.runtime.plan.PlanFormatError: b/plan.json: version: this runtime reads version 1, the file is version 9; re-run `netweave launch`
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "netweave-job-plan"
VERSION = 1
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
RECOMPUTE = ("none", "selective", "full")


class PlanFormatError(ValueError):
    """A job plan that this runtime cannot use; the message names the file and the field."""

    def __init__(self, message: str, *, source: str | None = None, where: str | None = None):
        self.message, self.source, self.where = message, source, where
        super().__init__(": ".join(x for x in (source, where, message) if x))


@dataclass(frozen=True)
class Parallelism:
    dp: int = 1
    tp: int = 1
    pp: int = 1


@dataclass(frozen=True)
class Rank:
    rank: int
    host: str
    local_rank: int
    device: str


@dataclass(frozen=True)
class Host:
    host: str
    node_rank: int
    nproc: int
    cuda_visible_devices: str


@dataclass(frozen=True)
class Rendezvous:
    addr: str
    port: int


@dataclass(frozen=True)
class Traffic:
    traffic_class: int | None = None
    dscp: int | None = None
    priority: int | None = None


@dataclass(frozen=True)
class DataParallel:
    policy: str = "ddp"               # ddp | bytescheduler | prophet
    partition_bytes: float | None = None
    credit_bytes: float | None = None
    barrier: bool = True
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Stage:
    index: int
    rank: int                         # the pipeline rank (position in the pipeline group) that runs this stage
    layers: tuple[int, int]           # [lo, hi) in the model's layer list
    modules: tuple[str, ...] = ()     # the submodule names of those layers, when the plan knows them
    recompute: str = "none"


@dataclass(frozen=True)
class Pipeline:
    schedule: str
    microbatches: int
    stages: tuple[Stage, ...]
    chunks: int = 1
    torch_class: str | None = None    # torch's public schedule class that runs this family, or None (runtime CSV)
    actions_csv: str | None = None    # the schedule in torch's CSV (compute_only), for _PipelineScheduleRuntime
    predicted_iteration_s: float | None = None


@dataclass(frozen=True)
class JobPlan:
    job: str
    world_size: int
    ranks: list[Rank]
    hosts: list[Host]
    rendezvous: Rendezvous
    parallelism: Parallelism = Parallelism()
    start_offset_s: float = 0.0
    period_s: float | None = None
    traffic: Traffic = Traffic()
    data_parallel: DataParallel | None = None
    pipeline: Pipeline | None = None
    prediction: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, **asdict(self)}


def dumps(plan: JobPlan) -> str:
    """The plan as JSON text (checked: what this writes, :func:`loads` reads back equal)."""
    check(plan)
    return json.dumps(plan.to_dict(), indent=1, allow_nan=False) + "\n"


def load(path: str | os.PathLike[str]) -> JobPlan:
    """Read a job plan file (a bundle's ``plan.json``)."""
    source = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise PlanFormatError(f"cannot read the job plan ({exc.strerror})", source=source) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PlanFormatError(f"not UTF-8 text (byte {exc.start})", source=source) from None
    return loads(text, source=source)


def loads(text: str, *, source: str = "<plan>") -> JobPlan:
    """Parse and check a job plan from JSON text."""
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except (json.JSONDecodeError, RecursionError, ValueError) as exc:
        where = f"line {exc.lineno}" if isinstance(exc, json.JSONDecodeError) else None
        raise PlanFormatError(f"invalid JSON ({exc.msg if isinstance(exc, json.JSONDecodeError) else exc})", source=source,
                              where=where) from None
    r = _Reader(source)
    obj = r.obj(data, "")
    fmt = obj.get("format")
    if fmt != FORMAT:
        raise PlanFormatError(f"expected {FORMAT!r}, got {fmt!r} (is this a netweave launch bundle's plan.json?)", source=source,
                              where="format")
    version = obj.get("version")
    if version != VERSION or isinstance(version, bool):
        raise PlanFormatError(f"this runtime reads version {VERSION}, the file is version {version}; re-run `netweave launch`",
                              source=source, where="version")
    r.known(obj, "", {"format", "version", "job", "world_size", "ranks", "hosts", "rendezvous", "parallelism", "start_offset_s",
                      "period_s", "traffic", "data_parallel", "pipeline", "prediction", "provenance"})
    par = r.obj(obj.get("parallelism", {}), "parallelism")
    r.known(par, "parallelism", {"dp", "tp", "pp"})
    plan = JobPlan(
        job=r.string(obj.get("job"), "job"),
        world_size=r.int(obj.get("world_size"), "world_size", 1),
        ranks=[_rank(r, x, f"ranks[{i}]") for i, x in enumerate(r.objs(obj.get("ranks"), "ranks"))],
        hosts=[_host(r, x, f"hosts[{i}]") for i, x in enumerate(r.objs(obj.get("hosts"), "hosts"))],
        rendezvous=_rendezvous(r, obj.get("rendezvous")),
        parallelism=Parallelism(*(r.int(par.get(k, 1), f"parallelism.{k}", 1) for k in ("dp", "tp", "pp"))),
        start_offset_s=r.num(obj.get("start_offset_s", 0.0), "start_offset_s", 0.0),
        period_s=None if obj.get("period_s") is None else r.num(obj["period_s"], "period_s", 0.0),
        traffic=_traffic(r, obj.get("traffic", {})),
        data_parallel=None if obj.get("data_parallel") is None else _data_parallel(r, obj["data_parallel"]),
        pipeline=None if obj.get("pipeline") is None else _pipeline(r, obj["pipeline"]),
        prediction=dict(r.obj(obj.get("prediction", {}), "prediction")),
        provenance=dict(r.obj(obj.get("provenance", {}), "provenance")),
    )
    _check(plan, source)
    return plan


def check(plan: JobPlan, source: str = "<plan>") -> None:
    """Raise :class:`PlanFormatError` unless ``plan`` is consistent (what :func:`dumps` requires)."""
    loads(json.dumps(plan.to_dict(), allow_nan=False), source=source)


def _check(p: JobPlan, source: str) -> None:
    def bad(msg: str, where: str) -> PlanFormatError:
        return PlanFormatError(msg, source=source, where=where)

    par = p.parallelism
    if par.dp * par.tp * par.pp != p.world_size:
        raise bad(f"dp*tp*pp = {par.dp}*{par.tp}*{par.pp} = {par.dp * par.tp * par.pp}, expected world_size {p.world_size}", "parallelism")
    if [x.rank for x in p.ranks] != list(range(p.world_size)):
        raise bad(f"expected ranks 0..{p.world_size - 1} in order, one each", "ranks")
    if [h.node_rank for h in p.hosts] != list(range(len(p.hosts))):
        raise bad(f"expected node ranks 0..{len(p.hosts) - 1} in order", "hosts")
    per_host = {h.host: h for h in p.hosts}
    if len(per_host) != len(p.hosts):
        raise bad("a host appears twice", "hosts")
    for x in p.ranks:
        if x.host not in per_host:
            raise bad(f"host {x.host!r} is not in hosts", f"ranks[{x.rank}].host")
    for h in p.hosts:
        local = sorted(x.local_rank for x in p.ranks if x.host == h.host)
        if local != list(range(h.nproc)):
            raise bad(f"host {h.host!r} runs {h.nproc} ranks, expected local ranks 0..{h.nproc - 1}, got {local}", "hosts")
        if len(h.cuda_visible_devices.split(",")) != h.nproc:
            raise bad(f"host {h.host!r}: {h.nproc} ranks but CUDA_VISIBLE_DEVICES={h.cuda_visible_devices}", "hosts")
    if p.pipeline is not None:
        pl = p.pipeline
        if pl.chunks * par.pp != len(pl.stages):
            raise bad(f"{len(pl.stages)} stages, expected pp*chunks = {par.pp}*{pl.chunks}", "pipeline.stages")
        if [s.index for s in pl.stages] != list(range(len(pl.stages))):
            raise bad("expected stage indices 0..n-1 in order", "pipeline.stages")
        for s in pl.stages:
            if not 0 <= s.rank < par.pp:
                raise bad(f"pipeline rank {s.rank} outside 0..{par.pp - 1}", f"pipeline.stages[{s.index}].rank")
        bounds = [s.layers for s in pl.stages]
        if bounds[0][0] != 0 or any(a[1] != b[0] for a, b in zip(bounds, bounds[1:], strict=False)) or any(lo >= hi for lo, hi in bounds):
            raise bad(f"stage layer ranges {bounds} are not contiguous and non-empty from layer 0", "pipeline.stages")
    elif par.pp != 1:
        raise bad(f"pp = {par.pp} but the plan has no pipeline", "pipeline")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _rank(r: _Reader, x: dict[str, Any], where: str) -> Rank:
    r.known(x, where, {"rank", "host", "local_rank", "device"})
    return Rank(r.int(x.get("rank"), f"{where}.rank", 0), r.string(x.get("host"), f"{where}.host"),
                r.int(x.get("local_rank"), f"{where}.local_rank", 0), r.string(x.get("device"), f"{where}.device", pattern=None))


def _host(r: _Reader, x: dict[str, Any], where: str) -> Host:
    r.known(x, where, {"host", "node_rank", "nproc", "cuda_visible_devices"})
    return Host(r.string(x.get("host"), f"{where}.host"), r.int(x.get("node_rank"), f"{where}.node_rank", 0),
                r.int(x.get("nproc"), f"{where}.nproc", 1),
                r.string(x.get("cuda_visible_devices"), f"{where}.cuda_visible_devices", pattern=re.compile(r"[0-9]+(,[0-9]+)*")))


def _rendezvous(r: _Reader, x: Any) -> Rendezvous:
    obj = r.obj(x, "rendezvous")
    r.known(obj, "rendezvous", {"addr", "port"})
    return Rendezvous(r.string(obj.get("addr"), "rendezvous.addr", pattern=re.compile(r"[A-Za-z0-9][A-Za-z0-9.:_-]{0,252}")),
                      r.int(obj.get("port"), "rendezvous.port", 1, 65535))


def _traffic(r: _Reader, x: Any) -> Traffic:
    obj = r.obj(x, "traffic")
    r.known(obj, "traffic", {"traffic_class", "dscp", "priority"})
    opt = {k: (None if obj.get(k) is None else r.int(obj[k], f"traffic.{k}", lo, hi))
           for k, lo, hi in (("traffic_class", 0, 255), ("dscp", 0, 63), ("priority", -(2**31), 2**31 - 1))}
    return Traffic(**opt)


def _data_parallel(r: _Reader, x: Any) -> DataParallel:
    obj = r.obj(x, "data_parallel")
    r.known(obj, "data_parallel", {"policy", "partition_bytes", "credit_bytes", "barrier", "params"})
    policy = obj.get("policy", "ddp")
    if policy not in ("ddp", "bytescheduler", "prophet"):
        raise PlanFormatError(f"expected ddp, bytescheduler or prophet, got {policy!r}", source=r.source, where="data_parallel.policy")
    opt = {k: (None if obj.get(k) is None else r.num(obj[k], f"data_parallel.{k}", 0.0)) for k in ("partition_bytes", "credit_bytes")}
    barrier = obj.get("barrier", True)
    if not isinstance(barrier, bool):
        raise PlanFormatError("expected true or false", source=r.source, where="data_parallel.barrier")
    return DataParallel(policy=policy, barrier=barrier, params=dict(r.obj(obj.get("params", {}), "data_parallel.params")), **opt)


def _pipeline(r: _Reader, x: Any) -> Pipeline:
    obj = r.obj(x, "pipeline")
    r.known(obj, "pipeline", {"schedule", "microbatches", "stages", "chunks", "torch_class", "actions_csv", "predicted_iteration_s"})
    stages = []
    for i, s in enumerate(r.objs(obj.get("stages"), "pipeline.stages")):
        w = f"pipeline.stages[{i}]"
        r.known(s, w, {"index", "rank", "layers", "modules", "recompute"})
        lay = s.get("layers")
        if not (isinstance(lay, list) and len(lay) == 2):
            raise PlanFormatError("expected [first layer, end layer)", source=r.source, where=f"{w}.layers")
        mods = s.get("modules", [])
        if not isinstance(mods, list):
            raise PlanFormatError("expected a list of submodule names", source=r.source, where=f"{w}.modules")
        rec = s.get("recompute", "none")
        if rec not in RECOMPUTE:
            raise PlanFormatError(f"expected one of {', '.join(RECOMPUTE)}, got {rec!r}", source=r.source, where=f"{w}.recompute")
        stages.append(Stage(r.int(s.get("index"), f"{w}.index", 0), r.int(s.get("rank"), f"{w}.rank", 0),
                            (r.int(lay[0], f"{w}.layers[0]", 0), r.int(lay[1], f"{w}.layers[1]", 1)),
                            tuple(r.string(m, f"{w}.modules[{j}]", pattern=re.compile(r"[A-Za-z0-9_.]{1,256}")) for j, m in enumerate(mods)),
                            rec))
    opt_str = {k: (None if obj.get(k) is None else r.string(obj[k], f"pipeline.{k}", pattern=None)) for k in ("torch_class", "actions_csv")}
    pred = obj.get("predicted_iteration_s")
    return Pipeline(schedule=r.string(obj.get("schedule"), "pipeline.schedule"),
                    microbatches=r.int(obj.get("microbatches"), "pipeline.microbatches", 1),
                    stages=tuple(stages), chunks=r.int(obj.get("chunks", 1), "pipeline.chunks", 1),
                    predicted_iteration_s=None if pred is None else r.num(pred, "pipeline.predicted_iteration_s", 0.0), **opt_str)


class _Reader:
    """Typed field access that names the field on failure."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, msg: str, where: str) -> PlanFormatError:
        return PlanFormatError(msg, source=self.source, where=where or None)

    def obj(self, x: Any, where: str) -> dict[str, Any]:
        if not isinstance(x, dict):
            raise self.fail(f"expected an object, got {type(x).__name__}", where)
        return x

    def objs(self, x: Any, where: str) -> list[dict[str, Any]]:
        if not isinstance(x, list) or not x:
            raise self.fail("expected a non-empty list", where)
        return [self.obj(v, f"{where}[{i}]") for i, v in enumerate(x)]

    def known(self, obj: dict[str, Any], where: str, fields: set[str]) -> None:
        extra = sorted(set(obj) - fields)
        if extra:
            raise self.fail(f"unknown field {extra[0]!r}; expected some of {', '.join(sorted(fields))}", f"{where}.{extra[0]}".lstrip("."))

    def int(self, x: Any, where: str, lo: int, hi: int = 2**31 - 1) -> int:
        if isinstance(x, bool) or not isinstance(x, int) or not lo <= x <= hi:
            raise self.fail(f"expected an integer in {lo}..{hi}, got {x!r}", where)
        return x

    def num(self, x: Any, where: str, lo: float) -> float:
        if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x) or x < lo:
            raise self.fail(f"expected a finite number >= {lo:g}, got {x!r}", where)
        return float(x)

    def string(self, x: Any, where: str, pattern: re.Pattern[str] | None = NAME_RE) -> str:
        if not isinstance(x, str) or not x:
            raise self.fail(f"expected a non-empty string, got {x!r}", where)
        if pattern is not None and not pattern.fullmatch(x):
            raise self.fail(f"{x!r} is not a valid name (expected {pattern.pattern})", where)
        return x
