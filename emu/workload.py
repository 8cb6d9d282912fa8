"""The workload description: training jobs as per-iteration graphs of phases.

One format, read by the planners (placement, flowsched, pipesched) and run by
every backend (the flow-level simulator :mod:`emu.sim` and the Mininet
emulator). Files are YAML or JSON with the same structure; see
``docs/workload.md`` for the field reference and an example.

Model
    A *job* runs ``iterations`` times the same *iteration*: a DAG of named
    *phases*. A phase is

    - ``compute``: a delay of ``duration`` seconds (the GPUs are busy; no traffic);
    - ``collective``: a collective ``op`` on a GPU ``group`` (default: all of the
      job's GPUs) moving ``bytes`` with ``algorithm``; the backends decompose it
      into point-to-point flows with :func:`topology.collectives.collective_flows`;
    - ``p2p``: one or more point-to-point ``transfers`` (``src``, ``dst``, ``bytes``)
      that run concurrently (pipeline-parallel activations, for instance).

Dependencies
    ``after`` names phases of the *same* iteration that must finish first.
    ``after_previous`` names phases of the *previous* iteration (i-1) that must
    finish first. When ``after_previous`` is omitted it defaults to *every*
    phase of the previous iteration for the phases with no ``after`` (the roots
    of the iteration), and to nothing for the others, which then wait for the
    previous iteration through their roots: the default is a barrier between
    iterations. Write ``after_previous: [allreduce]`` on a root to let the next
    iteration's compute start as soon as the previous all-reduce is done, or
    ``after_previous: []`` to let iterations overlap freely. In addition a phase
    always waits for its own instance in the previous iteration (a phase never
    runs twice at once).

Time
    The job is submitted at ``arrival`` and its first iteration is released
    ``start_offset`` seconds later (CASSINI's time shift). JCT is measured from
    ``arrival``, so a shift is paid for.

Traffic classes
    ``priority`` is a class 0..7 where **0 is the most urgent** (as HTB's
    ``prio`` and 802.1p queues mapped so that class 0 is served first). Backends
    serve classes in strict priority by default. ``rate_cap`` (GB/s, 1e9 B/s)
    caps every point-to-point flow of a phase. Both can be set on the job (the
    default for its phases) and overridden per phase.

>>> w = Workload("demo", [Job.data_parallel("a", ["n0/gpu0", "n0/gpu1"], compute_s=0.01, nbytes=1e9, iterations=2)])
>>> w2 = loads_workload(dumps_workload(w, "yaml"), "yaml")
>>> w2 == w, [p.name for p in w2.jobs[0].phases]
(True, ['compute', 'allreduce'])
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import yaml

from topology.collectives import ALGORITHMS as OP_ALGORITHMS  # the algorithms of each op (direct: all-to-all at once)
from topology.errors import InputError
from topology.inputs import check_name, check_node_id, loads_json, loads_yaml, read_text
from topology.limits import MAX_BANDWIDTH_GBS, MAX_BYTES, MAX_ITERATIONS, MAX_JOB_GPUS, MAX_JOBS, MAX_PHASE_RUNS, MAX_SECONDS
from topology.schema import load_schema, validate
from topology.units import parse_duration, parse_rate, parse_size

FORMAT_NAME = "netweave-workload"
FORMAT_VERSION = 1
PRIORITY_CLASSES = 8  # 0 (most urgent) .. 7
DEFAULT_PRIORITY = 0
COLLECTIVE_OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send_recv")
ALGORITHMS = ("ring", "tree", "hierarchical", "direct")
ROUTING_POLICIES = ("shortest", "ecmp", "rail")


class WorkloadError(InputError):
    """A workload file or object that does not follow the format."""


# -- the data model ----------------------------------------------------------------


@dataclass(frozen=True)
class Transfer:
    """One point-to-point transfer of ``nbytes`` from GPU ``src`` to GPU ``dst``."""

    src: str
    dst: str
    nbytes: float


@dataclass(frozen=True)
class ComputePhase:
    """Computation for ``duration`` seconds (forward/backward, optimizer step)."""

    name: str
    duration: float
    after: tuple[str, ...] = ()
    after_previous: tuple[str, ...] | None = None
    kind: str = field(default="compute", init=False)


@dataclass(frozen=True)
class CollectivePhase:
    """A collective ``op`` over ``group`` (``None``: all the job's GPUs) of ``nbytes`` (buffer size, nccl-tests' S)."""

    name: str
    op: str
    nbytes: float
    algorithm: str = "ring"
    group: tuple[str, ...] | None = None
    after: tuple[str, ...] = ()
    after_previous: tuple[str, ...] | None = None
    priority: int | None = None
    rate_cap: float | None = None
    kind: str = field(default="collective", init=False)


@dataclass(frozen=True)
class P2PPhase:
    """Concurrent point-to-point ``transfers``."""

    name: str
    transfers: tuple[Transfer, ...]
    after: tuple[str, ...] = ()
    after_previous: tuple[str, ...] | None = None
    priority: int | None = None
    rate_cap: float | None = None
    kind: str = field(default="p2p", init=False)


Phase = ComputePhase | CollectivePhase | P2PPhase
CommPhase = CollectivePhase | P2PPhase


@dataclass(frozen=True)
class Job:
    """A training job: its GPUs and the phases of one iteration, repeated ``iterations`` times."""

    name: str
    gpus: tuple[str, ...]
    phases: tuple[Phase, ...]
    iterations: int = 1
    arrival: float = 0.0
    start_offset: float = 0.0
    priority: int = DEFAULT_PRIORITY
    rate_cap: float | None = None
    routing: str | None = None

    # -- resolved views used by the backends -------------------------------------------
    def phase_index(self) -> dict[str, int]:
        return {p.name: i for i, p in enumerate(self.phases)}

    def phase_priority(self, phase: Phase) -> int:
        """The traffic class of ``phase``: its own, else the job's."""
        own = getattr(phase, "priority", None)
        return self.priority if own is None else own

    def phase_rate_cap(self, phase: Phase) -> float | None:
        """The per-flow cap (GB/s) of ``phase``: its own, else the job's, else none."""
        own = getattr(phase, "rate_cap", None)
        return self.rate_cap if own is None else own

    def dependencies(self) -> tuple[list[list[int]], list[list[int]]]:
        """``(within, previous)``: for each phase, the indices it waits for in the same and in the previous iteration.

        ``previous`` already includes the default barrier and the phase's own
        previous instance (see the module docstring).

        >>> j = Job.data_parallel("a", ["h/gpu0", "h/gpu1"], compute_s=1, nbytes=8)
        >>> j.dependencies()
        ([[], [0]], [[0, 1], [1]])
        """
        index = self.phase_index()
        within = [[index[n] for n in p.after] for p in self.phases]
        previous = []
        for i, p in enumerate(self.phases):
            barrier = set() if p.after else set(range(len(self.phases)))
            deps = barrier if p.after_previous is None else {index[n] for n in p.after_previous}
            deps.add(i)
            previous.append(sorted(deps))
        return within, previous

    def all_gpus(self) -> list[str]:
        """The job's GPUs followed by any GPU its phases name that the list lacks (none in a valid job)."""
        seen = dict.fromkeys(self.gpus)
        for p in self.phases:
            if isinstance(p, CollectivePhase) and p.group:
                seen.update(dict.fromkeys(p.group))
            elif isinstance(p, P2PPhase):
                for t in p.transfers:
                    seen.update(dict.fromkeys((t.src, t.dst)))
        return list(seen)

    # -- common jobs ---------------------------------------------------------------------
    @staticmethod
    def data_parallel(
        name: str,
        gpus: list[str] | tuple[str, ...],
        *,
        compute_s: float,
        nbytes: float,
        iterations: int = 1,
        algorithm: str = "ring",
        priority: int = DEFAULT_PRIORITY,
        rate_cap: float | None = None,
        start_offset: float = 0.0,
        arrival: float = 0.0,
        routing: str | None = None,
    ) -> Job:
        """Data parallelism: each iteration computes for ``compute_s`` seconds, then all-reduces ``nbytes`` of gradients.

        >>> Job.data_parallel("a", ["h/gpu0", "h/gpu1"], compute_s=0.1, nbytes=1e9).phases[1].op
        'all_reduce'
        """
        phases = (
            ComputePhase("compute", float(compute_s)),
            CollectivePhase("allreduce", "all_reduce", float(nbytes), algorithm=algorithm, after=("compute",)),
        )
        job = Job(name, tuple(gpus), phases, iterations=iterations, arrival=arrival, start_offset=start_offset,
                  priority=priority, rate_cap=rate_cap, routing=routing)
        validate_job(job, f"job {name!r}")
        return job

    @staticmethod
    def mixture_of_experts(
        name: str,
        gpus: list[str] | tuple[str, ...],
        *,
        compute_s: float,
        expert_s: float,
        nbytes: float,
        iterations: int = 1,
        algorithm: str = "direct",
        priority: int = DEFAULT_PRIORITY,
        start_offset: float = 0.0,
        routing: str | None = None,
    ) -> Job:
        """Expert parallelism (a mixture-of-experts layer): compute, all-to-all dispatch, expert compute, all-to-all combine.

        Each all-to-all moves ``nbytes`` per GPU (``nbytes / n`` to every GPU of
        the group, its own share included), all at once with ``algorithm="direct"``
        (NCCL's all-to-all) or in ``n - 1`` shifted steps with ``"ring"``.

        >>> j = Job.mixture_of_experts("moe", ["h/gpu0", "h/gpu1"], compute_s=0.1, expert_s=0.1, nbytes=1e9)
        >>> [(p.name, p.kind) for p in j.phases]
        [('compute', 'compute'), ('dispatch', 'collective'), ('experts', 'compute'), ('combine', 'collective')]
        """
        phases = (
            ComputePhase("compute", float(compute_s)),
            CollectivePhase("dispatch", "all_to_all", float(nbytes), algorithm=algorithm, after=("compute",)),
            ComputePhase("experts", float(expert_s), after=("dispatch",)),
            CollectivePhase("combine", "all_to_all", float(nbytes), algorithm=algorithm, after=("experts",)),
        )
        job = Job(name, tuple(gpus), phases, iterations=iterations, start_offset=start_offset, priority=priority, routing=routing)
        validate_job(job, f"job {name!r}")
        return job

    @staticmethod
    def pipeline_parallel(
        name: str,
        stages: list[list[str]] | tuple[tuple[str, ...], ...],
        *,
        stage_compute_s: float,
        activation_bytes: float,
        iterations: int = 1,
        priority: int = DEFAULT_PRIORITY,
        rate_cap: float | None = None,
        start_offset: float = 0.0,
    ) -> Job:
        """A GPipe-like single-microbatch pipeline: each stage computes, then sends activations to the next stage.

        Stage *s*'s GPU *k* sends ``activation_bytes`` to stage *s+1*'s GPU *k*
        (tensor-parallel ranks pair up); the backward pass is folded into the
        compute durations. Planners with real schedules (1F1B ...) write their
        own phases; this helper is for tests and demos.

        >>> [p.name for p in Job.pipeline_parallel("p", [["h/gpu0"], ["h/gpu1"]], stage_compute_s=1, activation_bytes=8).phases]
        ['stage0', 'send0', 'stage1']
        """
        stages = [tuple(s) for s in stages]
        if len(stages) < 1 or any(len(s) != len(stages[0]) or not s for s in stages):
            raise WorkloadError("pipeline stages must be non-empty and of equal width", where=f"job {name!r}")
        phases: list[Phase] = []
        for s, gpus in enumerate(stages):
            after = (f"send{s - 1}",) if s else ()
            phases.append(ComputePhase(f"stage{s}", float(stage_compute_s), after=after))
            if s + 1 < len(stages):
                transfers = tuple(Transfer(a, b, float(activation_bytes)) for a, b in zip(gpus, stages[s + 1], strict=True))
                phases.append(P2PPhase(f"send{s}", transfers, after=(f"stage{s}",)))
        job = Job(name, tuple(g for s in stages for g in s), tuple(phases), iterations=iterations, start_offset=start_offset,
                  priority=priority, rate_cap=rate_cap)
        validate_job(job, f"job {name!r}")
        return job


@dataclass(frozen=True)
class Workload:
    """A set of jobs run together on one topology."""

    name: str = "workload"
    jobs: tuple[Job, ...] | list[Job] = ()
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "jobs", tuple(self.jobs))

    def job(self, name: str) -> Job:
        for j in self.jobs:
            if j.name == name:
                return j
        raise WorkloadError(f"no job named {name!r}; jobs: {', '.join(j.name for j in self.jobs)}")

    def with_job(self, job: Job) -> Workload:
        """A copy with ``job`` added (or replacing the job of the same name)."""
        jobs = [j for j in self.jobs if j.name != job.name]
        if len(jobs) == len(self.jobs):
            jobs.append(job)
        else:
            jobs = [job if j.name == job.name else j for j in self.jobs]
        return replace(self, jobs=tuple(jobs))

    def add_data_parallel(self, name: str, gpus: list[str] | tuple[str, ...], **kwargs: Any) -> Workload:
        """A copy with a data-parallel job added (see :meth:`Job.data_parallel`)."""
        return self.with_job(Job.data_parallel(name, gpus, **kwargs))

    def gpus(self) -> list[str]:
        return [g for j in self.jobs for g in j.all_gpus()]

    def validate(self, topo: Any = None, *, source: str | None = None) -> None:
        """Check names, dependencies and values; with a ``topo``, also that every GPU exists there."""
        validate_workload(self, source=source)
        if topo is not None:
            validate_against_topology(self, topo, source=source)

    def to_dict(self) -> dict[str, Any]:
        return workload_to_dict(self)

    @classmethod
    def from_dict(cls, data: Any, *, source: str | None = None) -> Workload:
        return workload_from_dict(data, source=source)


# -- validation ---------------------------------------------------------------------------


def _err(message: str, where: str, source: str | None) -> WorkloadError:
    return WorkloadError(message, source=source, where=where)


def _check_number(value: Any, where: str, source: str | None, *, positive: bool = False, minimum: float | None = 0.0,
                  maximum: float = MAX_SECONDS) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _err(f"expected a {'positive' if positive else 'non-negative'} number, got {value!r}", where, source)
    if value > maximum:
        raise _err(f"expected a number <= {maximum:g} (the limit), got {value!r}", where, source)
    if positive and not value > 0:
        raise _err(f"expected a positive number, got {value!r}", where, source)
    if minimum is not None and value < minimum:
        raise _err(f"expected a number >= {minimum:g}, got {value!r}", where, source)


def _check_priority(value: Any, where: str, source: str | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < PRIORITY_CLASSES:
        raise _err(f"expected a priority class 0..{PRIORITY_CLASSES - 1} (0 = most urgent), got {value!r}", where, source)


def validate_job(job: Job, where: str, source: str | None = None) -> None:
    """Raise :class:`WorkloadError` naming the field when ``job`` is inconsistent."""
    check_name(job.name, what="job name", source=source, where=f"{where}.name", error=WorkloadError)
    if not job.gpus:
        raise _err("expected a non-empty list of GPU ids", f"{where}.gpus", source)
    if len(job.gpus) > MAX_JOB_GPUS:
        raise _err(f"{len(job.gpus)} GPUs, more than {MAX_JOB_GPUS} (the limit)", f"{where}.gpus", source)
    for k, g in enumerate(job.gpus):
        check_node_id(g, what="GPU id", source=source, where=f"{where}.gpus[{k}]", error=WorkloadError)
    if len(set(job.gpus)) != len(job.gpus):
        dup = next(g for g in job.gpus if job.gpus.count(g) > 1)
        raise _err(f"GPU {dup!r} is listed twice", f"{where}.gpus", source)
    if isinstance(job.iterations, bool) or not isinstance(job.iterations, int) or job.iterations < 1:
        raise _err(f"expected a positive integer, got {job.iterations!r}", f"{where}.iterations", source)
    if job.iterations > MAX_ITERATIONS:
        raise _err(f"expected at most {MAX_ITERATIONS} iterations (the limit), got {job.iterations}", f"{where}.iterations", source)
    if job.iterations * len(job.phases) > MAX_PHASE_RUNS:
        raise _err(f"{job.iterations} iterations of {len(job.phases)} phases are more than {MAX_PHASE_RUNS} phase runs (the limit)",
                   f"{where}.iterations", source)
    _check_number(job.arrival, f"{where}.arrival", source)
    _check_number(job.start_offset, f"{where}.start_offset", source)
    _check_priority(job.priority, f"{where}.priority", source)
    if job.rate_cap is not None:
        _check_number(job.rate_cap, f"{where}.rate_cap", source, positive=True, maximum=MAX_BANDWIDTH_GBS)
    if job.routing is not None and job.routing not in ROUTING_POLICIES:
        raise _err(f"expected one of {', '.join(ROUTING_POLICIES)}, got {job.routing!r}", f"{where}.routing", source)
    if not job.phases:
        raise _err("expected at least one phase", f"{where}.phases", source)
    members = set(job.gpus)
    names: dict[str, int] = {}
    for i, p in enumerate(job.phases):
        pw = f"{where}.phases[{i}]"
        check_name(p.name, what="phase name", source=source, where=f"{pw}.name", error=WorkloadError)
        if p.name in names:
            raise _err(f"phase name {p.name!r} is used twice (also phases[{names[p.name]}])", f"{pw}.name", source)
        names[p.name] = i
        if isinstance(p, ComputePhase):
            _check_number(p.duration, f"{pw}.duration", source)
        elif isinstance(p, CollectivePhase):
            if p.op not in COLLECTIVE_OPS:
                raise _err(f"expected one of {', '.join(COLLECTIVE_OPS)}, got {p.op!r}", f"{pw}.op", source)
            if p.algorithm not in OP_ALGORITHMS.get(p.op, ALGORITHMS):
                raise _err(f"{p.op} runs with {', '.join(OP_ALGORITHMS.get(p.op, ALGORITHMS))}, got {p.algorithm!r}", f"{pw}.algorithm", source)
            _check_number(p.nbytes, f"{pw}.bytes", source, positive=True, maximum=MAX_BYTES)
            if p.group is not None:
                if len(p.group) < 1:
                    raise _err("expected a non-empty list of GPU ids", f"{pw}.group", source)
                if len(set(p.group)) != len(p.group):
                    raise _err("a GPU is listed twice", f"{pw}.group", source)
                for k, g in enumerate(p.group):
                    if g not in members:
                        raise _err(f"GPU {g!r} is not one of the job's gpus", f"{pw}.group[{k}]", source)
        elif isinstance(p, P2PPhase):
            if not p.transfers:
                raise _err("expected at least one transfer", f"{pw}.transfers", source)
            for k, t in enumerate(p.transfers):
                tw = f"{pw}.transfers[{k}]"
                for end in ("src", "dst"):
                    if getattr(t, end) not in members:
                        raise _err(f"GPU {getattr(t, end)!r} is not one of the job's gpus", f"{tw}.{end}", source)
                if t.src == t.dst:
                    raise _err("src and dst are the same GPU", tw, source)
                _check_number(t.nbytes, f"{tw}.bytes", source, positive=True, maximum=MAX_BYTES)
        else:
            raise _err(f"unknown phase type {type(p).__name__}", pw, source)
        if not isinstance(p, ComputePhase):
            if p.priority is not None:
                _check_priority(p.priority, f"{pw}.priority", source)
            if p.rate_cap is not None:
                _check_number(p.rate_cap, f"{pw}.rate_cap", source, positive=True, maximum=MAX_BANDWIDTH_GBS)
    for i, p in enumerate(job.phases):
        pw = f"{where}.phases[{i}]"
        for field_name, refs in (("after", p.after), ("after_previous", p.after_previous or ())):
            for k, ref in enumerate(refs):
                if ref not in names:
                    raise _err(f"unknown phase {ref!r}; phases: {', '.join(names)}", f"{pw}.{field_name}[{k}]", source)
                if field_name == "after" and ref == p.name:
                    raise _err("a phase cannot wait for itself", f"{pw}.after[{k}]", source)
    cycle = _find_cycle([[names[n] for n in p.after] for p in job.phases])
    if cycle:
        raise _err("the 'after' dependencies form a cycle: " + " -> ".join(job.phases[i].name for i in cycle), f"{where}.phases", source)


def _find_cycle(deps: list[list[int]]) -> list[int] | None:
    state = [0] * len(deps)  # 0 new, 1 on stack, 2 done
    for root in range(len(deps)):
        if state[root]:
            continue
        stack = [(root, iter(deps[root]))]
        path = [root]
        state[root] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state[nxt] == 1:
                return path[path.index(nxt):] + [nxt]
            elif state[nxt] == 0:
                state[nxt] = 1
                stack.append((nxt, iter(deps[nxt])))
                path.append(nxt)
    return None


def validate_workload(workload: Workload, *, source: str | None = None) -> None:
    if not workload.jobs:
        raise _err("expected at least one job", "jobs", source)
    seen: dict[str, int] = {}
    for i, job in enumerate(workload.jobs):
        validate_job(job, f"jobs[{i}]", source)
        if job.name in seen:
            raise _err(f"job name {job.name!r} is used twice (also jobs[{seen[job.name]}])", f"jobs[{i}].name", source)
        seen[job.name] = i
    runs = sum(job.iterations * len(job.phases) for job in workload.jobs)
    if runs > MAX_PHASE_RUNS:
        raise _err(f"the jobs' iterations x phases add up to {runs} phase runs, more than {MAX_PHASE_RUNS} (the limit)", "jobs", source)


def validate_against_topology(workload: Workload, topo: Any, *, source: str | None = None) -> None:
    """Every GPU the workload names must be a GPU of ``topo``."""
    graph = topo.graph
    for i, job in enumerate(workload.jobs):
        for k, g in enumerate(job.gpus):
            if g not in graph:
                hint = topo.gpus()[:1]
                raise _err(f"no GPU {g!r} in topology {topo.name!r} (ids look like {hint[0] if hint else 'host/gpu0'!r})",
                           f"jobs[{i}].gpus[{k}]", source)
            if str(graph.nodes[g].get("kind")) != "gpu":
                raise _err(f"{g!r} is a {graph.nodes[g].get('kind')}, not a GPU", f"jobs[{i}].gpus[{k}]", source)


# -- dict form (what YAML and JSON hold) ---------------------------------------------------


def _phase_to_dict(p: Phase) -> dict[str, Any]:
    d: dict[str, Any] = {"name": p.name, "kind": p.kind}
    if isinstance(p, ComputePhase):
        d["duration"] = p.duration
    elif isinstance(p, CollectivePhase):
        d.update(op=p.op, algorithm=p.algorithm, bytes=_num(p.nbytes))
        if p.group is not None:
            d["group"] = list(p.group)
    else:
        d["transfers"] = [{"src": t.src, "dst": t.dst, "bytes": _num(t.nbytes)} for t in p.transfers]
    if p.after:
        d["after"] = list(p.after)
    if p.after_previous is not None:
        d["after_previous"] = list(p.after_previous)
    if not isinstance(p, ComputePhase):
        if p.priority is not None:
            d["priority"] = p.priority
        if p.rate_cap is not None:
            d["rate_cap"] = p.rate_cap
    return d


def _num(x: float) -> float | int:
    return int(x) if float(x).is_integer() and abs(x) < 2**53 else x


def workload_to_dict(workload: Workload) -> dict[str, Any]:
    """The plain-data form written to YAML/JSON (inverse of :func:`workload_from_dict`)."""
    jobs = []
    for j in workload.jobs:
        d: dict[str, Any] = {"name": j.name, "gpus": list(j.gpus), "iterations": j.iterations}
        if j.arrival:
            d["arrival"] = j.arrival
        if j.start_offset:
            d["start_offset"] = j.start_offset
        d["priority"] = j.priority
        if j.rate_cap is not None:
            d["rate_cap"] = j.rate_cap
        if j.routing is not None:
            d["routing"] = j.routing
        d["phases"] = [_phase_to_dict(p) for p in j.phases]
        jobs.append(d)
    out: dict[str, Any] = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "name": workload.name}
    if workload.meta:
        out["meta"] = dict(workload.meta)
    out["jobs"] = jobs
    return out


_JOB_FIELDS = {"name", "gpus", "iterations", "arrival", "start_offset", "priority", "rate_cap", "routing", "phases"}
_PHASE_FIELDS = {
    "compute": {"name", "kind", "duration", "after", "after_previous"},
    "collective": {"name", "kind", "op", "algorithm", "bytes", "group", "after", "after_previous", "priority", "rate_cap"},
    "p2p": {"name", "kind", "transfers", "src", "dst", "bytes", "after", "after_previous", "priority", "rate_cap"},
}


class _Reader:
    """Typed field access that names the field in every error."""

    def __init__(self, source: str | None):
        self.source = source

    def obj(self, value: Any, where: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise _err(f"expected a mapping, got {type(value).__name__}", where, self.source)
        return value

    def unknown(self, d: dict[str, Any], allowed: set[str], where: str) -> None:
        extra = sorted(set(d) - allowed)
        if extra:
            raise _err(f"unknown field {extra[0]!r}; expected one of {', '.join(sorted(allowed))}", where, self.source)

    def req(self, d: dict[str, Any], key: str, where: str) -> Any:
        if key not in d:
            raise _err("missing required field", f"{where}.{key}" if where else key, self.source)
        return d[key]

    def string(self, value: Any, where: str) -> str:
        if not isinstance(value, str) or not value:
            raise _err(f"expected a non-empty string, got {value!r}", where, self.source)
        return value

    def strings(self, value: Any, where: str) -> tuple[str, ...]:
        if not isinstance(value, list):
            raise _err(f"expected a list of names, got {value!r}", where, self.source)
        return tuple(self.string(v, f"{where}[{k}]") for k, v in enumerate(value))

    def size(self, value: Any, where: str) -> float:
        return parse_size(value, what="a positive number of bytes", where=where, source=self.source, positive=True, error=WorkloadError)

    def duration(self, value: Any, where: str) -> float:
        return parse_duration(value, what="a non-negative number of seconds", where=where, source=self.source, error=WorkloadError)

    def integer(self, value: Any, where: str, lo: int, hi: int | None, what: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
            raise _err(f"expected {what}, got {value!r}", where, self.source)
        return value

    def rate(self, value: Any, where: str) -> float | None:
        if value is None:
            return None
        return parse_rate(value, where=where, source=self.source, what="a positive number (GB/s) or null", error=WorkloadError)


def workload_from_dict(data: Any, *, source: str | None = None) -> Workload:
    """Build a :class:`Workload` from its plain-data form, naming the field of any error.

    The structure is checked against ``emu/schemas/workload.schema.json`` first; the checks below build the objects
    and add what a schema cannot say (phase references, cycles, GPUs of the job).
    """
    validate(data, load_schema("emu", "workload"), source=source, error=WorkloadError)
    r = _Reader(source)
    data = r.obj(data, "(top level)")
    if data.get("format", FORMAT_NAME) != FORMAT_NAME:
        raise _err(f"expected {FORMAT_NAME!r}, got {data.get('format')!r}", "format", source)
    version = data.get("version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise _err(f"unsupported version {version!r}, expected {FORMAT_VERSION}", "version", source)
    r.unknown(data, {"format", "version", "name", "meta", "jobs"}, "(top level)")
    name = r.string(data.get("name", "workload"), "name")
    meta = data.get("meta") or {}
    r.obj(meta, "meta")
    raw_jobs = r.req(data, "jobs", "")
    if not isinstance(raw_jobs, list) or not raw_jobs:
        raise _err("expected a non-empty list of jobs", "jobs", source)
    if len(raw_jobs) > MAX_JOBS:
        raise _err(f"{len(raw_jobs)} jobs, more than {MAX_JOBS} (the limit)", "jobs", source)
    jobs = [_job_from_dict(r, raw, f"jobs[{i}]") for i, raw in enumerate(raw_jobs)]
    workload = Workload(name, tuple(jobs), dict(meta))
    validate_workload(workload, source=source)
    return workload


def _job_from_dict(r: _Reader, raw: Any, where: str) -> Job:
    d = r.obj(raw, where)
    r.unknown(d, _JOB_FIELDS, where)
    name = r.string(r.req(d, "name", where), f"{where}.name")
    gpus_raw = r.req(d, "gpus", where)
    if not isinstance(gpus_raw, list) or not gpus_raw:
        raise _err("expected a non-empty list of GPU ids", f"{where}.gpus", r.source)
    gpus = r.strings(gpus_raw, f"{where}.gpus")
    iterations = r.integer(d.get("iterations", 1), f"{where}.iterations", 1, None, "a positive integer")
    arrival = r.duration(d.get("arrival", 0.0), f"{where}.arrival")
    start_offset = r.duration(d.get("start_offset", 0.0), f"{where}.start_offset")
    priority = r.integer(d.get("priority", DEFAULT_PRIORITY), f"{where}.priority", 0, PRIORITY_CLASSES - 1,
                         f"a priority class 0..{PRIORITY_CLASSES - 1} (0 = most urgent)")
    rate_cap = r.rate(d.get("rate_cap"), f"{where}.rate_cap")
    routing = d.get("routing")
    if routing is not None and routing not in ROUTING_POLICIES:
        raise _err(f"expected one of {', '.join(ROUTING_POLICIES)}, got {routing!r}", f"{where}.routing", r.source)
    raw_phases = r.req(d, "phases", where)
    if not isinstance(raw_phases, list) or not raw_phases:
        raise _err("expected a non-empty list of phases", f"{where}.phases", r.source)
    phases = tuple(_phase_from_dict(r, p, f"{where}.phases[{i}]") for i, p in enumerate(raw_phases))
    return Job(name, gpus, phases, iterations=iterations, arrival=arrival, start_offset=start_offset, priority=priority,
               rate_cap=rate_cap, routing=routing)


def _phase_from_dict(r: _Reader, raw: Any, where: str) -> Phase:
    d = r.obj(raw, where)
    kind = d.get("kind")
    if kind is None:  # infer: the fields say what it is
        kind = "compute" if "duration" in d else "collective" if "op" in d else "p2p" if ("transfers" in d or "src" in d) else None
    if kind not in _PHASE_FIELDS:
        raise _err(f"expected one of {', '.join(_PHASE_FIELDS)}, got {kind!r}", f"{where}.kind", r.source)
    r.unknown(d, _PHASE_FIELDS[kind], where)
    name = r.string(r.req(d, "name", where), f"{where}.name")
    after = r.strings(d.get("after", []), f"{where}.after")
    after_previous = r.strings(d["after_previous"], f"{where}.after_previous") if d.get("after_previous") is not None else None
    if kind == "compute":
        return ComputePhase(name, r.duration(r.req(d, "duration", where), f"{where}.duration"), after, after_previous)
    priority = d.get("priority")
    if priority is not None:
        priority = r.integer(priority, f"{where}.priority", 0, PRIORITY_CLASSES - 1, f"a priority class 0..{PRIORITY_CLASSES - 1} (0 = most urgent)")
    rate_cap = r.rate(d.get("rate_cap"), f"{where}.rate_cap")
    if kind == "collective":
        op = r.string(r.req(d, "op", where), f"{where}.op")
        if op not in COLLECTIVE_OPS:
            raise _err(f"expected one of {', '.join(COLLECTIVE_OPS)}, got {op!r}", f"{where}.op", r.source)
        algorithm = d.get("algorithm", "ring")
        if algorithm not in OP_ALGORITHMS[op]:
            raise _err(f"{op} runs with {', '.join(OP_ALGORITHMS[op])}, got {algorithm!r}", f"{where}.algorithm", r.source)
        group = r.strings(d["group"], f"{where}.group") if d.get("group") is not None else None
        nbytes = r.size(r.req(d, "bytes", where), f"{where}.bytes")
        return CollectivePhase(name, op, nbytes, algorithm, group, after, after_previous, priority, rate_cap)
    if "transfers" in d:
        if any(k in d for k in ("src", "dst", "bytes")):
            raise _err("give either 'transfers' or 'src'/'dst'/'bytes', not both", where, r.source)
        raw_t = d["transfers"]
        if not isinstance(raw_t, list) or not raw_t:
            raise _err("expected a non-empty list of {src, dst, bytes}", f"{where}.transfers", r.source)
        transfers = []
        for k, t in enumerate(raw_t):
            tw = f"{where}.transfers[{k}]"
            t = r.obj(t, tw)
            r.unknown(t, {"src", "dst", "bytes"}, tw)
            transfers.append(Transfer(r.string(r.req(t, "src", tw), f"{tw}.src"), r.string(r.req(t, "dst", tw), f"{tw}.dst"),
                                      r.size(r.req(t, "bytes", tw), f"{tw}.bytes")))
    else:
        transfers = [Transfer(r.string(r.req(d, "src", where), f"{where}.src"), r.string(r.req(d, "dst", where), f"{where}.dst"),
                              r.size(r.req(d, "bytes", where), f"{where}.bytes"))]
    return P2PPhase(name, tuple(transfers), after, after_previous, priority, rate_cap)


# -- text and files -------------------------------------------------------------------------


def dumps_workload(workload: Workload, format: str = "yaml") -> str:
    """Serialise to ``"yaml"`` or ``"json"`` text."""
    data = workload_to_dict(workload)
    if format == "json":
        return json.dumps(data, indent=1) + "\n"
    if format == "yaml":
        return yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=150)
    raise WorkloadError(f"unknown format {format!r}; expected yaml or json")


def loads_workload(text: str, format: str = "yaml", *, source: str | None = None) -> Workload:
    """Parse YAML or JSON text (JSON is also valid YAML, but its errors read better from the JSON parser)."""
    if format == "json":
        data = loads_json(text, source=source, error=WorkloadError)
    elif format == "yaml":
        data = loads_yaml(text, source=source, error=WorkloadError)
    else:
        raise WorkloadError(f"unknown format {format!r}; expected yaml or json", source=source)
    return workload_from_dict(data, source=source)


def _format_of(path: str | os.PathLike[str], format: str | None) -> str:
    if format:
        return format
    return "json" if str(path).lower().endswith(".json") else "yaml"


def read_workload(path: str | os.PathLike[str], format: str | None = None) -> Workload:
    """Read a workload file (``.json`` is JSON, anything else YAML unless ``format`` says)."""
    return loads_workload(read_text(path, error=WorkloadError), _format_of(path, format), source=str(path))


def write_workload(workload: Workload, path: str | os.PathLike[str], format: str | None = None) -> None:
    """Write atomically; the format follows the extension (``.json`` or YAML)."""
    from topology.io import atomic_write_text

    atomic_write_text(path, dumps_workload(workload, _format_of(path, format)))


def packed_gpu_groups(topo: Any, sizes: Sequence[int]) -> list[list[str]]:
    """GPU groups for jobs of ``sizes`` GPUs, in order, packed as a consolidating scheduler places them.

    A job of at least a host's GPUs takes ``size // per_host`` whole hosts, from the first host no earlier
    job has used on; a smaller one takes the first GPUs left on the first host from there with room. Hosts
    are ``topo.hosts()`` in order and are assumed to hold equally many GPUs. Raises ``StopIteration``
    when a job does not fit.

    >>> import topology
    >>> groups = packed_gpu_groups(topology.build_cluster(2), [8, 2, 4])
    >>> [len(g) for g in groups], groups[1]
    ([8, 2, 4], ['node1/gpu0', 'node1/gpu1'])
    """
    hosts = topo.hosts()
    free: dict[str, list[str]] = {h: [] for h in hosts}
    for g in topo.gpus():  # one pass: topo.gpus(host) scans every node, so a call per host is quadratic
        free[topo.host_of(g)].append(g)
    per_host = max((len(v) for v in free.values()), default=1)
    next_host, out = 0, []
    for size in sizes:
        if size >= per_host:
            taken = hosts[next_host: next_host + size // per_host]
            next_host += size // per_host
            out.append([g for h in taken for g in free[h]])
            for h in taken:
                free[h] = []
        else:
            h = next(h for h in hosts[next_host:] if len(free[h]) >= size)
            out.append(free[h][:size])
            free[h] = free[h][size:]
    return out


def example_workload(topo: Any = None) -> Workload:
    """Two data-parallel jobs and a two-stage pipeline on the first two hosts of ``topo`` (default cluster ids otherwise).

    >>> [j.name for j in example_workload().jobs]
    ['dp-a', 'dp-b', 'pipe']
    """
    if topo is not None:
        hosts = topo.hosts()
        if len(hosts) < 2 or len(topo.gpus(hosts[0])) < 4:
            raise WorkloadError("the example needs at least two hosts with four GPUs each")
        h0, h1 = topo.gpus(hosts[0]), topo.gpus(hosts[1])
    else:
        h0, h1 = [f"node0/gpu{i}" for i in range(8)], [f"node1/gpu{i}" for i in range(8)]
    dp_a = Job.data_parallel("dp-a", [h0[0], h0[1], h1[0], h1[1]], compute_s=0.004, nbytes=200e6, iterations=5)
    dp_b = Job.data_parallel("dp-b", [h0[2], h0[3], h1[2], h1[3]], compute_s=0.004, nbytes=200e6, iterations=5,
                             priority=1, start_offset=0.002)
    pipe = Job.pipeline_parallel("pipe", [[h0[-1]], [h1[-1]]], stage_compute_s=0.002, activation_bytes=50e6, iterations=5)
    return Workload("example", (dp_a, dp_b, pipe), {"description": "two data-parallel jobs (the second time-shifted) and a pipeline"})


__all__ = [
    "ALGORITHMS",
    "packed_gpu_groups",
    "COLLECTIVE_OPS",
    "OP_ALGORITHMS",
    "DEFAULT_PRIORITY",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "PRIORITY_CLASSES",
    "ROUTING_POLICIES",
    "CollectivePhase",
    "CommPhase",
    "ComputePhase",
    "Job",
    "P2PPhase",
    "Phase",
    "Transfer",
    "Workload",
    "WorkloadError",
    "dumps_workload",
    "example_workload",
    "loads_workload",
    "read_workload",
    "validate_against_topology",
    "validate_job",
    "validate_workload",
    "workload_from_dict",
    "workload_to_dict",
    "write_workload",
]
