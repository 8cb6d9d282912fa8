"""Job specifications and per-job communication profiles (CASSINI's per-link demand over one iteration).

A :class:`JobSpec` is what a user asks for: a GPU count and a parallel plan
(tensor parallelism ``tp`` inside an NVLink domain, pipeline parallelism ``pp``,
data parallelism across the rest) with the compute time and gradient volume of
one iteration, plus what ``netweave launch`` needs to start it (:class:`LaunchSpec`).
Once the job has GPUs, :func:`comm_profile` turns it into a :class:`CommProfile`: the
iteration is a compute phase followed by a communication phase (the
gradient all-reduce of each data-parallel group, ``grad_bytes / (tp * pp)`` bytes
each), and during the communication phase every network link the routed
collective crosses carries ``bytes_on_link / comm_time`` GB/s. Ranks are laid out
pipeline-major, tensor-minor: rank ``(s * dp + d) * tp + t`` is pipeline stage
``s``, replica ``d``, tensor rank ``t`` (torch's ``init_device_mesh(("pp", "dp", "tp"))``).
The point-to-point activations between pipeline stages are not in the profile
(a stated simplification: per iteration they are small next to the gradients).

The collective is decomposed with :func:`topology.collectives.collective_flows`
and routed with :func:`topology.routing.route_flows`; its duration is the
alpha-beta cost of :func:`topology.collectives.collective_time` for the
slowest group. Only network links (NIC, leaf, spine) enter the profile: GPUs
are exclusive to one job, so NVLink and PCIe inside a job's servers are not
shared between jobs (a stated simplification: two jobs splitting one server
share its PCIe switches to the CPU, which is ignored).

>>> import topology
>>> t = topology.default_cluster()
>>> spec = JobSpec("a", gpus=16, compute_s=0.2, grad_bytes=2e9)
>>> p = comm_profile(t, spec, t.gpus()[:16])
>>> p.comm_s > 0 and p.period_s == p.compute_s + p.comm_s and len(p.link_rates) > 0
True
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from topology.errors import InputError
from topology.model import Topology
from topology.units import parse_duration, parse_size

Edge = tuple[str, str, Any]


SCHEDULES = ("auto", "1f1b", "gpipe", "interleaved", "zbh1")
DP_POLICIES = ("ddp", "bytescheduler", "prophet")
BACKENDS = ("nccl", "gloo")
NCCL_PLUGINS = ("tuner", "profiler")


@dataclass(frozen=True)
class LaunchSpec:
    """What ``netweave launch`` needs beyond placement (jobs-file fields; see ``docs/launch.md``).

    ``script``: the training script, an absolute path (relative paths in the jobs file are taken from the
    file's directory). ``args``: its arguments. ``model``: a pipeline model description (GPT/Llama mapping,
    or the path of a model YAML or ``netweave pipe profile`` JSON), unchecked here. ``auto``: the jobs file
    said ``parallelism: auto`` (launch picks ``pp``). ``data_parallel``: ``{policy, partition, credit,
    barrier}`` as given (sizes in bytes). ``backend``: ``nccl`` (GPUs) or ``gloo`` (CPU, emulation).
    ``nccl_plugins``: the project's NCCL tuner/profiler plugins to load. ``port``: a fixed rendezvous port.
    ``memory``: the per-GPU memory budget the pipeline planner plans against (default: each GPU's own).
    """

    script: str | None = None
    args: tuple[str, ...] = ()
    model: Any = None
    auto: bool = False
    microbatches: int | None = None
    schedule: str = "auto"
    chunks: int = 2
    data_parallel: dict[str, Any] = field(default_factory=dict)
    backend: str = "nccl"
    nccl_plugins: tuple[str, ...] = ()
    port: int | None = None
    memory: float | None = None       # bytes per GPU the pipeline planner may use (None: each GPU's memory)
    given: frozenset[str] = frozenset()   # the fields the jobs file set (explicit values beat derived ones)


@dataclass(frozen=True)
class JobSpec:
    """A training job request: GPUs, parallel plan and per-iteration work.

    ``compute_s``: forward+backward time of one iteration (s). ``grad_bytes``:
    gradient bytes all-reduced per iteration across data-parallel replicas.
    ``tp``: tensor-parallel degree (ranks of one replica share an NVLink
    domain). ``pp``: pipeline-parallel degree. ``vc``/``priority``: HiveD virtual cluster and priority (no VC:
    opportunistic). ``arrival``: submission time (s) for replays.
    """

    name: str
    gpus: int
    compute_s: float = 0.1
    grad_bytes: float = 0.0
    iterations: int = 100
    tp: int = 1
    vc: str | None = None
    priority: int = 0
    arrival: float = 0.0
    gpu_model: str | None = None
    algorithm: str = "ring"
    meta: dict[str, Any] = field(default_factory=dict, compare=False)
    pp: int = 1
    launch: LaunchSpec = field(default_factory=LaunchSpec, compare=False)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if not d["meta"]:
            del d["meta"]
        if d["pp"] == 1:
            del d["pp"]
        del d["launch"]
        return d


@dataclass(frozen=True)
class CommProfile:
    """One iteration of a placed job: compute for ``compute_s`` then communicate for ``comm_s``.

    ``link_rates`` maps each network link the job uses to its demand (GB/s)
    during the communication phase, which occupies ``[compute_s, period_s)`` of
    the iteration (CASSINI's "Up" arc).
    """

    job: str
    gpus: tuple[str, ...]
    compute_s: float
    comm_s: float
    link_rates: dict[Edge, float]
    link_bytes: dict[Edge, float]

    @property
    def period_s(self) -> float:
        return self.compute_s + self.comm_s

    def to_dict(self) -> dict[str, Any]:
        return {"job": self.job, "compute_s": self.compute_s, "comm_s": self.comm_s, "period_s": self.period_s,
                "links": {f"{u}->{v}": round(r, 6) for (u, v, _), r in sorted(self.link_rates.items(), key=lambda x: (x[0][0], x[0][1]))}}


def dp_groups(gpus: Sequence[str], tp: int, pp: int = 1) -> list[list[str]]:
    """Data-parallel groups of a rank-ordered GPU list: rank ``(s*dp + d)*tp + t`` is stage ``s``, replica ``d``, tensor rank ``t``.

    One group per (stage, tensor rank), stage-major.

    >>> dp_groups(["a", "b", "c", "d"], 2)
    [['a', 'c'], ['b', 'd']]
    >>> dp_groups(["a", "b", "c", "d"], 1, pp=2)
    [['a', 'b'], ['c', 'd']]
    """
    if tp < 1 or pp < 1 or len(gpus) % (tp * pp):
        raise InputError(f"tp*pp={tp}*{pp} must divide the job's {len(gpus)} GPUs", where="tp")
    dp = len(gpus) // (tp * pp)
    return [[gpus[(s * dp + d) * tp + t] for d in range(dp)] for s in range(pp) for t in range(tp)]


# one cache per topology graph, dropped with the graph: keying a shared dict by id(graph) let a new topology
# that reused a freed one's id (same size, other bandwidths) read the old topology's profiles
_PROFILE_CACHE: weakref.WeakKeyDictionary[Any, dict[tuple, CommProfile]] = weakref.WeakKeyDictionary()
_CACHE_LIMIT = 50_000


def comm_profile(topo: Topology, spec: JobSpec, gpus: Sequence[str], *, policy: str = "rail") -> CommProfile:
    """The communication profile of ``spec`` running on ``gpus`` (rank order) of ``topo``, routed with ``policy``.

    Results are cached per (topology, job shape, GPUs, policy).
    """
    cache = _PROFILE_CACHE.get(topo.graph)
    if cache is None:
        cache = _PROFILE_CACHE[topo.graph] = {}
    key = (len(topo.graph), spec.gpus, spec.tp, spec.pp, spec.compute_s, spec.grad_bytes, spec.algorithm, tuple(gpus), policy)
    hit = cache.get(key)
    if hit is not None:
        return hit if hit.job == spec.name else CommProfile(spec.name, hit.gpus, hit.compute_s, hit.comm_s, hit.link_rates, hit.link_bytes)
    comm_s, keys, gb, rates = _profile_links(topo, spec, gpus, policy)
    prof = CommProfile(spec.name, tuple(gpus), float(spec.compute_s), comm_s, dict(zip(keys, rates, strict=True)) if rates else {},
                       dict(zip(keys, gb, strict=True)))
    if len(cache) > _CACHE_LIMIT:
        cache.clear()
    cache[key] = prof
    return prof


def _profile_links(topo: Topology, spec: JobSpec, gpus: Sequence[str], policy: str) -> tuple[float, list[Edge], list[float], list[float]]:
    """What :func:`comm_profile` computes, uncached and as lists: ``comm_s``, the loaded network links in its order, their GB
    per iteration and their rates (empty unless ``comm_s > 0``); the replay's :class:`~placement.replay.ProfileCache` keeps
    these lists instead of the dicts it would only rename."""
    if len(gpus) != spec.gpus:
        raise InputError(f"job {spec.name!r}: placed on {len(gpus)} GPUs, asked for {spec.gpus}")
    groups = dp_groups(list(gpus), spec.tp, spec.pp)  # (refuses a tp*pp that does not divide the GPUs, whatever the traffic)
    comm_s = 0.0
    if not (spec.grad_bytes > 0 and spec.dp > 1):
        return comm_s, [], [], []
    from topology.collectives import _schedules_cost_and_link_loads, plan_collective
    from topology.paths import view
    from topology.routing import _link_ids

    nbytes = spec.grad_bytes / (spec.tp * spec.pp)
    plans = [plan_collective(topo, "all_reduce", group, nbytes, algorithm=spec.algorithm) for group in groups]
    # the groups' collectives, each routed once: their times, and the bytes one iteration puts on each network link
    costs, links, loads = _schedules_cost_and_link_loads(topo, plans, policy, network_only=True)
    for cost in costs:
        comm_s = max(comm_s, float(cost.time_s))
    loaded = loads > 0
    links, gb = links[loaded], loads[loaded] / 1e9  # GB; numpy's IEEE division and max: the floats of a loop over a dict
    if not len(links):
        return comm_s, [], [], []
    _, edges, bws = _link_ids(view(topo), topo)
    # the phase can be no shorter than its busiest shared link allows
    comm_s = max(comm_s, float((gb / bws[links]).max()))
    keys = list(map(edges.__getitem__, links.tolist()))
    return comm_s, keys, gb.tolist(), (gb / comm_s).tolist() if comm_s > 0 else []


def solo_iteration_time(topo: Topology, spec: JobSpec, gpus: Sequence[str], *, policy: str = "rail") -> float:
    """Iteration time of ``spec`` alone on ``gpus``: compute then the alpha-beta all-reduce time."""
    return comm_profile(topo, spec, gpus, policy=policy).period_s


def parse_job(item: Any, where: str, source: str | None = None, *, defaults: Mapping[str, Any] | None = None,
              base_dir: str | Path | None = None) -> JobSpec:
    """A :class:`JobSpec` from a jobs-file entry; errors name the field (see ``docs/placement.md``, ``docs/launch.md``).

    ``base_dir``: where a relative ``script`` path is taken from (the jobs file's directory; default the
    current directory).
    """
    if not isinstance(item, Mapping):
        raise InputError("expected a mapping with at least 'name' and 'gpus'", source=source, where=where)
    data = {**(defaults or {}), **item}
    known = {"name", "gpus", "compute", "compute_s", "compute_ms", "grad_bytes", "iterations", "tp", "vc", "priority", "arrival",
             "gpu_model", "algorithm", "model", *LAUNCH_FIELDS}
    for k in data:
        if k not in known:
            raise InputError(f"unknown field {k!r}; expected one of {', '.join(sorted(known))}", source=source, where=f"{where}.{k}")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise InputError("expected a non-empty job name", source=source, where=f"{where}.name")
    gpus = data.get("gpus")
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise InputError(f"expected a positive integer GPU count, got {gpus!r}", source=source, where=f"{where}.gpus")

    def num(field_name: str, parse, default, *, positive: bool = False, integer: bool = False):
        if field_name not in data:
            return default
        value = data[field_name]
        if parse is not None:  # a size or a duration: topology.units reads it, in the field's unit
            return parse(value, where=f"{where}.{field_name}", source=source, positive=positive)
        try:
            if integer:
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ValueError
                out = value
            else:
                out = parse(value)
        except (ValueError, TypeError):
            kind = "an integer" if integer else "a number"
            raise InputError(f"expected {kind}, got {value!r}", source=source, where=f"{where}.{field_name}") from None
        if not math.isfinite(out) or out < 0 or (positive and out == 0):
            sign = "positive" if positive else "non-negative"
            raise InputError(f"expected a {sign} value, got {value!r}", source=source, where=f"{where}.{field_name}")
        return out

    compute = num("compute_s", parse_duration, None)
    if compute is None and "compute_ms" in data:
        compute = num("compute_ms", partial(parse_duration, unit="ms"), 0.0) / 1e3
    if compute is None:
        compute = num("compute", parse_duration, 0.1)
    tp = num("tp", None, 1, positive=True, integer=True)
    if gpus % tp:
        raise InputError(f"tp={tp} must divide gpus={gpus}", source=source, where=f"{where}.tp")
    pp = num("pp", None, 1, positive=True, integer=True)
    auto = False
    if "parallelism" in data:
        if data["parallelism"] != "auto":
            raise InputError(f"expected 'auto' (or give dp/tp/pp), got {data['parallelism']!r}", source=source, where=f"{where}.parallelism")
        if "pp" in data or "dp" in data:
            raise InputError("parallelism: auto picks dp and pp; drop dp/pp or drop auto", source=source, where=f"{where}.parallelism")
        auto = True
    if gpus % (tp * pp):
        raise InputError(f"tp*pp = {tp}*{pp} = {tp * pp} does not divide gpus={gpus}", source=source, where=f"{where}.pp")
    dp = num("dp", None, gpus // (tp * pp), positive=True, integer=True)
    if dp * tp * pp != gpus:
        raise InputError(f"dp*tp*pp = {dp}*{tp}*{pp} = {dp * tp * pp}, expected gpus={gpus}", source=source, where=f"{where}.dp")
    vc = data.get("vc")
    if vc is not None and not isinstance(vc, str):
        raise InputError(f"expected a virtual-cluster name, got {vc!r}", source=source, where=f"{where}.vc")
    algorithm = data.get("algorithm", "ring")
    if algorithm not in ("ring", "tree", "hierarchical"):
        raise InputError(f"expected ring, tree or hierarchical, got {algorithm!r}", source=source, where=f"{where}.algorithm")
    launch = _parse_launch(data, where, source, base_dir, auto, num)
    return JobSpec(
        name=name, gpus=gpus, compute_s=compute, grad_bytes=num("grad_bytes", parse_size, 0.0),
        iterations=num("iterations", None, 100, positive=True, integer=True), tp=tp, vc=vc,
        priority=num("priority", None, 0, integer=True), arrival=num("arrival", parse_duration, 0.0),
        gpu_model=data.get("gpu_model"), algorithm=algorithm, meta={"model": data["model"]} if "model" in data else {},
        pp=pp, launch=launch,
    )


LAUNCH_FIELDS = ("dp", "pp", "parallelism", "script", "args", "microbatches", "schedule", "chunks", "data_parallel", "backend",
                 "nccl_plugins", "port", "memory")


def _parse_launch(data: Mapping[str, Any], where: str, source: str | None, base_dir: str | Path | None, auto: bool, num) -> LaunchSpec:
    """The launch fields of a jobs-file entry (``num`` is :func:`parse_job`'s number reader)."""
    def bad(msg: str, key: str) -> InputError:
        return InputError(msg, source=source, where=f"{where}.{key}")

    script = data.get("script")
    if script is not None:
        if not isinstance(script, str) or not script:
            raise bad(f"expected the path of the training script, got {script!r}", "script")
        path = Path(script).expanduser()
        if not path.is_absolute():
            path = Path(base_dir or ".") / path
        if not path.is_file():
            raise bad(f"no such file: {str(path)!r}", "script")
        script = str(path.resolve())
    args = data.get("args", [])
    if isinstance(args, str) or not isinstance(args, list) or not all(isinstance(a, str | int | float) and not isinstance(a, bool) for a in args):
        raise bad(f"expected a list of arguments (strings or numbers), got {args!r}", "args")
    schedule = data.get("schedule", "auto")
    if schedule not in SCHEDULES:
        raise bad(f"expected one of {', '.join(SCHEDULES)}, got {schedule!r}", "schedule")
    dp_in = data.get("data_parallel", {})
    if isinstance(dp_in, str):
        dp_in = {"policy": dp_in}
    if not isinstance(dp_in, Mapping):
        raise bad(f"expected a policy name or a mapping {{policy, partition, credit, barrier}}, got {dp_in!r}", "data_parallel")
    unknown = set(dp_in) - {"policy", "partition", "credit", "barrier"}
    if unknown:
        raise bad(f"unknown knob {sorted(unknown)[0]!r}; expected policy, partition, credit, barrier", "data_parallel")
    dpp: dict[str, Any] = {"policy": dp_in.get("policy", "ddp")}
    if dpp["policy"] not in DP_POLICIES:
        raise bad(f"expected one of {', '.join(DP_POLICIES)}, got {dpp['policy']!r}", "data_parallel.policy")
    for knob in ("partition", "credit"):
        if knob in dp_in:
            dpp[knob] = parse_size(dp_in[knob], what=f"a {'positive' if knob == 'partition' else 'non-negative'} size",
                                   where=f"{where}.data_parallel.{knob}", source=source, positive=knob == "partition")
    if "barrier" in dp_in:
        if not isinstance(dp_in["barrier"], bool):
            raise bad(f"expected true or false, got {dp_in['barrier']!r}", "data_parallel.barrier")
        dpp["barrier"] = dp_in["barrier"]
    backend = data.get("backend", "nccl")
    if backend not in BACKENDS:
        raise bad(f"expected one of {', '.join(BACKENDS)}, got {backend!r}", "backend")
    plugins = data.get("nccl_plugins", [])
    if not isinstance(plugins, list) or any(x not in NCCL_PLUGINS for x in plugins):
        raise bad(f"expected a list of {', '.join(NCCL_PLUGINS)}, got {plugins!r}", "nccl_plugins")
    port = num("port", None, None, positive=True, integer=True)
    if port is not None and not 1024 <= port <= 65535:
        raise bad(f"expected a port in 1024..65535, got {port}", "port")
    memory = num("memory", parse_size, None, positive=True)
    return LaunchSpec(script=script, args=tuple(str(a) for a in args), model=data.get("model"), auto=auto, memory=memory,
                      microbatches=num("microbatches", None, None, positive=True, integer=True), schedule=schedule,
                      chunks=num("chunks", None, 2, positive=True, integer=True), data_parallel=dpp, backend=backend,
                      nccl_plugins=tuple(dict.fromkeys(plugins)), port=port, given=frozenset(data))
