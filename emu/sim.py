"""Flow-level discrete-event simulation of a workload on a topology.

Model
    - Every communication phase becomes point-to-point flows:
      :func:`topology.collectives.collective_flows` decomposes a collective into
      sequential *steps* of concurrent flows; a ``p2p`` phase is one step.
      Step *k+1* starts when every flow of step *k* has arrived.
    - Every flow is routed with :func:`topology.routing.flow_paths`; an ECMP
      split into paths with fractions ``w`` becomes sub-flows carrying ``w`` of
      the bytes each (the fluid view of per-packet spraying). A flow has
      arrived when all its sub-flows have, plus the propagation latency of its
      slowest path (``SimConfig.latency``).
    - Links are shared max-min fairly among the sub-flows crossing them
      (progressive filling, :mod:`emu.sim_maxmin`), recomputed at every event.
      Traffic classes (``priority`` 0..7, 0 first) are served in strict
      priority (``sharing="strict"``) or share by class weights
      (``sharing="weighted"``, weight ``class_weights[priority]``). A phase's
      ``rate_cap`` (GB/s) caps each of its flows; a split flow's sub-flow gets
      ``w`` of the cap (so the flow never exceeds the cap).
    - Compute phases are delays. Dependencies follow :mod:`emu.workload`.
    - Optional transport convergence (``SimConfig.join_ramp_s`` > 0, off by
      default): a step whose flows start while another step's flows are in
      flight on one of its shared links *joins* them, and for its first
      ``join_ramp_s`` seconds shares with ``join_weight`` times its weight
      (see :class:`SimConfig`).

Events are sub-flow completions (per step in flight, the earliest), step and
phase completions, and job releases; between events all rates are constant,
so the simulation is exact for the fluid model (no time step).

Speed (``bench/bench_sim.py``):

- every distinct step is routed once (a ring's 2(n-1) steps are one template);
- a link used by one phase only can never couple two steps in flight, so an
  event recomputes only the connected component of steps linked through the
  other, *shared* links (a search over the static adjacency of step
  templates through shared links, as bit sets over templates, intersected
  with the templates in flight: its cost grows with the component, not with
  the number of groups in flight), and a link used by a single sub-flow is
  folded into that sub-flow's cap;
- each max-min solve is vectorised over the component's sub-flow x link
  incidence (COO index arrays, ``np.bincount`` per filling round);
- the rates depend only on which sub-flows are in flight, not on their bytes,
  so a component's solution is memoised and reused whenever the same set is in
  flight again (every step of a ring, every iteration of a job).

Deviation from packet reality (by design of the fluid model): no slow start,
no queueing delay, no loss; ECMP hashing is modelled by its mean split. With
``join_ramp_s`` = 0 the shares are exactly fair, so two identical jobs that
start aligned on a shared link stay aligned forever (their relative phase is
neutrally stable); ``join_ramp_s`` > 0 models the one transport effect that
moves them, the late joiner's slow convergence to its share.

>>> from topology import Topology
>>> from emu.workload import Job, Workload
>>> t = Topology("pair")
>>> for g in ("h/gpu0", "h/gpu1"): _ = t.add_node(g, "gpu", host="h")
>>> t.add_link("h/gpu0", "h/gpu1", "nvlink", bw=10.0)
>>> w = Workload("w", [Job.data_parallel("a", ["h/gpu0", "h/gpu1"], compute_s=0.5, nbytes=10e9, iterations=2)])
>>> r = simulate(t, w)
>>> [round(x, 9) for x in r.jobs["a"].iteration_times()]   # 0.5 s compute + 2(n-1)/n * 10 GB / 10 GB/s
[1.5, 1.5]
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from topology.errors import InputError
from topology.model import Topology

from .results import FlowRecord, JobResult, LinkUtilisation, PhaseRecord, RunResult
from .sim_maxmin import maxmin_rates_coo, maxmin_rates_reference
from .workload import CollectivePhase, ComputePhase, Job, P2PPhase, Workload, validate_against_topology, validate_workload

DEFAULT_CLASS_WEIGHTS = (8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0)


@dataclass(frozen=True)
class SimConfig:
    """Simulator options.

    ``routing``: default policy for jobs that do not set one (``shortest``,
    ``ecmp``, ``rail``). ``sharing``: ``strict`` priority between classes or
    ``weighted`` shares by ``class_weights``. ``latency``: add each flow's path
    propagation latency. ``record_flows``: keep a record per flow.
    ``track_links``: which links get a utilisation series (``all``,
    ``network`` or ``none``); ``util_bins``: at most this many time bins.
    ``solver``: ``numpy`` (vectorised) or ``python`` (the reference loops; slow,
    for the benchmark baseline). ``memo``: reuse the rates of a component whose
    in-flight sub-flows were seen before (the result is the same; off only to
    measure the solvers).

    ``join_ramp_s`` and ``join_weight``: transport convergence, a deviation
    from the plain fluid model (off at ``join_ramp_s=0``, the default). A
    congestion-controlled flow that joins a link already carrying
    established flows does not get its fair share at once: it starts from an
    initial window and grows it once per round trip, and the established
    flows' queue makes those round trips long. The simulator models that as
    a step: a communication step that starts while a step of another phase
    (of any job) that uses one of its links is in flight shares with
    ``join_weight`` times its weight for its first ``join_ramp_s`` seconds,
    then with its full weight. Steps that start at the same instant are
    taken in the order the simulator starts them (the workload's job order
    for jobs released together): the first counts as established. That is a
    deterministic tie-break, not a claim: real flows never start at the same
    instant, and which one is late is chance. Without the ramp two
    identical jobs started together stay in lockstep (the worst alignment)
    forever; with it the one that started its communication first keeps the
    larger share and the jobs settle one ring step apart, as TCP moves them
    in the Mininet emulation (docs/validation/emu.md; there noise later
    interleaves them fully, which this noise-free model does not).
    ``join_ramp_s`` is a time of the transport, so
    for an emulation at time scale K and byte scale M it is the emulated
    TCP's convergence time divided by K/M; a fabric whose transport
    converges in microseconds (RDMA, NCCL's long-lived connections) is the
    plain model.
    """

    routing: str = "ecmp"
    sharing: str = "strict"
    class_weights: tuple[float, ...] = DEFAULT_CLASS_WEIGHTS
    latency: bool = True
    record_flows: bool = True
    track_links: str = "all"
    util_bins: int = 200
    solver: str = "numpy"
    memo: bool = True
    join_ramp_s: float = 0.0
    join_weight: float = 0.2

    def validated(self) -> SimConfig:
        if self.routing not in ("shortest", "ecmp", "rail"):
            raise InputError(f"routing: expected shortest, ecmp or rail, got {self.routing!r}")
        if self.sharing not in ("strict", "weighted"):
            raise InputError(f"sharing: expected strict or weighted, got {self.sharing!r}")
        if len(self.class_weights) != 8 or any(not w > 0 for w in self.class_weights):
            raise InputError("class_weights: expected 8 positive weights, one per priority class 0..7")
        if self.track_links not in ("all", "network", "none"):
            raise InputError(f"track_links: expected all, network or none, got {self.track_links!r}")
        if self.util_bins < 1:
            raise InputError("util_bins: expected a positive integer")
        if self.solver not in ("numpy", "python"):
            raise InputError(f"solver: expected numpy or python, got {self.solver!r}")
        if not (math.isfinite(self.join_ramp_s) and self.join_ramp_s >= 0):
            raise InputError(f"join_ramp_s: expected a finite time >= 0 in seconds, got {self.join_ramp_s!r}")
        if not 0 < self.join_weight <= 1:
            raise InputError(f"join_weight: expected a weight factor in (0, 1], got {self.join_weight!r}")
        return self


# -- static preparation: links, routes, step templates -------------------------------------------


class _Network:
    """Integer ids for the topology's directed links, and a route cache."""

    def __init__(self, topo: Topology):
        from topology.routing import flow_paths

        self.topo = topo
        self._flow_paths = flow_paths
        self.edges: list[tuple[str, str, Any]] = []
        self.index: dict[tuple[str, str, Any], int] = {}
        caps, lats, kinds = [], [], []
        for u, v, k, d in topo.graph.edges(keys=True, data=True):
            self.index[(u, v, k)] = len(self.edges)
            self.edges.append((u, v, k))
            caps.append(float(d["bw"]) * 1e9)
            lats.append(float(d.get("latency_us", 0.0)) * 1e-6)
            kinds.append(str(d["kind"]))
        self.capacity = np.asarray(caps)  # bytes per second
        self.latency = np.asarray(lats)  # seconds
        self.kinds = kinds
        self._routes: dict[tuple[str, str, str], list[tuple[float, np.ndarray, float]]] = {}

    def routes(self, src: str, dst: str, policy: str) -> list[tuple[float, np.ndarray, float]]:
        """``[(fraction, link ids, path latency s)]`` for ``src -> dst``."""
        key = (src, dst, policy)
        cached = self._routes.get(key)
        if cached is None:
            cached = []
            for frac, path in self._flow_paths(self.topo, src, dst, policy=policy):
                if frac <= 0:
                    continue
                ids = np.fromiter((self.index[tuple(e)] for e in path), dtype=np.intp, count=len(path))
                cached.append((float(frac), ids, float(self.latency[ids].sum())))
            self._routes[key] = cached
        return cached


@dataclass
class _StepTemplate:
    """One step of a communication phase, routed: its flows and their sub-flows (the same in every iteration)."""

    src: list[str]
    dst: list[str]
    nbytes: np.ndarray  # per flow
    latency: np.ndarray  # per flow, seconds (0 when latency is off)
    sub_flow: np.ndarray  # per sub-flow: parent flow
    sub_bytes: np.ndarray
    sub_cap: np.ndarray  # bytes/s (inf: none)
    sub_weight: np.ndarray
    sub_prio: np.ndarray
    entry_sub: np.ndarray  # per (sub-flow, link) entry: the sub-flow
    entry_link: np.ndarray  # per entry: global link id
    links: tuple[int, ...]  # distinct links
    subs_per_flow: np.ndarray
    uid: int = 0
    link_arr: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.intp))
    tol: np.ndarray = field(default_factory=lambda: np.zeros(0))  # bytes left that count as done
    zero_rate: np.ndarray = field(default_factory=lambda: np.zeros(0))
    inf_rate: np.ndarray = field(default_factory=lambda: np.zeros(0))
    all_alive: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    shared: tuple[int, ...] = ()  # the links that another phase (of any job) may use at the same time
    adjacent: int = 0  # bit set over template uids: the templates using one of this template's shared links (itself included)
    # the incidence the solver sees: a link that only one sub-flow can ever use is a cap on that sub-flow, not an entry
    solve_sub: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.intp))
    solve_link: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.intp))
    solve_cap: np.ndarray = field(default_factory=lambda: np.zeros(0))
    own_sub: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.intp))  # (sub-flow, link) of those links
    own_link: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.intp))
    util_links: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.intp))  # link_arr as the utilisation recorder numbers them


def _build_step(net: _Network, flows: list[tuple[str, str, float]], policy: str, *, prio: int, cap_gbs: float | None,
                weight: float, latency: bool, uid: int = 0) -> _StepTemplate:
    src, dst, nbytes, lat = [], [], [], []
    sub_flow, sub_bytes, sub_cap, entry_sub, entry_link, subs_per_flow = [], [], [], [], [], []
    cap = math.inf if cap_gbs is None else cap_gbs * 1e9
    for f, (a, b, size) in enumerate(flows):
        src.append(a)
        dst.append(b)
        nbytes.append(float(size))
        routes = net.routes(a, b, policy) if (a != b and size > 0) else []
        if a != b and size > 0 and not routes:
            raise InputError(f"no route from {a} to {b} in topology {net.topo.name!r}")
        lat.append(max((r[2] for r in routes), default=0.0) if latency else 0.0)
        subs_per_flow.append(len(routes))
        for frac, ids, _ in routes:
            s = len(sub_bytes)
            sub_flow.append(f)
            sub_bytes.append(frac * size)
            sub_cap.append(frac * cap)
            entry_sub.extend([s] * len(ids))
            entry_link.extend(ids.tolist())
    n_sub = len(sub_bytes)
    return _StepTemplate(
        src, dst, np.asarray(nbytes), np.asarray(lat), np.asarray(sub_flow, dtype=np.intp), np.asarray(sub_bytes, dtype=float),
        np.asarray(sub_cap, dtype=float), np.full(n_sub, weight), np.full(n_sub, prio, dtype=np.int64),
        np.asarray(entry_sub, dtype=np.intp), np.asarray(entry_link, dtype=np.intp), tuple(sorted(set(entry_link))),
        np.asarray(subs_per_flow, dtype=np.intp), uid, np.asarray(sorted(set(entry_link)), dtype=np.intp),
        np.maximum(np.asarray(sub_bytes) * 1e-9, 1e-6), np.zeros(n_sub), np.full(n_sub, np.inf), np.ones(n_sub, dtype=bool),
    )


def phase_flows(topo: Topology, job: Job, phase: CollectivePhase | P2PPhase) -> list[list[tuple[str, str, float]]]:
    """The sequential steps of concurrent ``(src, dst, bytes)`` flows of a communication phase."""
    if isinstance(phase, P2PPhase):
        return [[(t.src, t.dst, t.nbytes) for t in phase.transfers]]
    from topology.collectives import collective_flows

    group = list(phase.group or job.gpus)
    if len(group) < 2:
        return []
    steps = collective_flows(topo, phase.op, group, phase.nbytes, algorithm=phase.algorithm)
    return [[(f.src, f.dst, float(f.nbytes)) for f in step] for step in steps]


# -- dynamic state ------------------------------------------------------------------------------------


def _bits(mask: int) -> list[int]:
    """The positions of the set bits of ``mask``, lowest first."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


_EV_GROUP, _EV_STEP, _EV_PHASE, _EV_RELEASE, _EV_JOINED = 0, 1, 2, 3, 4


class _Group:
    """A step in flight: the live state of its sub-flows.

    Arrays are replaced, never modified in place (except ``flow_end``): the
    initial ones are the template's and the rates are shared with the memo.
    A finished sub-flow has ``rem = inf`` and rate 0, so that ``rem / rate``
    (as ``rem * inv_rate``) never picks it.
    """

    __slots__ = ("all_alive", "alive", "flow_end", "flows_left", "gid", "inv_rate", "joining", "last", "n_alive", "rate", "rem", "run", "start",
                 "tpl", "version")

    def __init__(self, gid: int, tpl: _StepTemplate, run: _CommRun, now: float):
        self.gid = gid
        self.tpl = tpl
        self.run = run
        self.start = now
        self.last = now
        self.rem = tpl.sub_bytes
        self.rate = tpl.zero_rate
        self.inv_rate = tpl.inf_rate
        self.alive = tpl.all_alive
        self.n_alive = len(tpl.sub_bytes)
        self.all_alive = True
        self.flows_left = tpl.subs_per_flow
        self.flow_end = np.where(tpl.subs_per_flow == 0, now, np.nan)
        self.version = 0
        self.joining = False  # within its join ramp (SimConfig.join_ramp_s): shares with join_weight times its weight


@dataclass
class _CommRun:
    job: int
    iteration: int
    phase: int
    steps: list[_StepTemplate]
    step: int = 0
    start: float = 0.0


@dataclass
class _JobState:
    job: Job
    within_succ: list[list[int]]
    prev_succ: list[list[int]]
    need_first: list[int]
    need_later: list[int]
    pending: dict[int, list[int]] = field(default_factory=dict)
    done: dict[int, int] = field(default_factory=dict)
    ends: list[float] = field(default_factory=list)


class _UtilRecorder:
    """Exact per-link byte counts sampled at bin boundaries; bins double in width to stay under ``max_bins``."""

    def __init__(self, n_links: int, max_bins: int):
        self.cum = np.zeros(n_links)
        self.load = np.zeros(n_links)
        self.last = np.zeros(n_links)
        self.width = 1e-6
        self.next = self.width
        self.snaps: list[np.ndarray] = []
        self.max_bins = max_bins

    def advance(self, t: float) -> None:
        if not self.max_bins:  # no series wanted (track_links="none"): no snapshots of every link
            return
        while self.next <= t:
            self.snaps.append(self.cum + self.load * (self.next - self.last))
            self.next += self.width
            if len(self.snaps) >= 2 * self.max_bins:
                self.snaps = self.snaps[1::2]
                self.width *= 2
                self.next = (len(self.snaps) + 1) * self.width

    def set_load(self, links: np.ndarray, load: np.ndarray, t: float) -> None:
        self.cum[links] += self.load[links] * (t - self.last[links])
        self.last[links] = t
        self.load[links] = load

    def series(self, end: float) -> tuple[np.ndarray, np.ndarray]:
        """``(bin_edges, bytes per link per bin)``."""
        final = self.cum + self.load * (end - self.last)
        snaps = [s for k, s in enumerate(self.snaps) if (k + 1) * self.width < end]
        edges = [0.0] + [(k + 1) * self.width for k in range(len(snaps))] + [end]
        stack = np.vstack([np.zeros_like(final), *snaps, final])
        return np.asarray(edges), np.diff(stack, axis=0).T


class Simulator:
    """One simulation run; use :func:`simulate`."""

    def __init__(self, topo: Topology, workload: Workload, config: SimConfig):
        self.topo, self.workload, self.cfg = topo, workload, config
        self.net = _Network(topo)
        self.heap: list[tuple[float, int, int, Any, Any]] = []
        self.seq = 0
        self.groups: dict[int, _Group] = {}
        self.by_template: dict[int, dict[int, _Group]] = {}  # template uid -> its groups in flight (templates with shared links)
        self.in_flight = 0  # bit set over template uids: the keys of by_template
        self.dirty: set[int] = set()  # groups whose rates must be recomputed
        self.next_gid = 0
        self.phases: list[PhaseRecord] = []
        self.flows: list[FlowRecord] = []
        self.events = 0
        self.recomputes = 0
        self.max_component = 0
        self.now = 0.0
        self.templates: dict[tuple[int, int], list[_StepTemplate]] = {}
        self.step_cache: dict[tuple, _StepTemplate] = {}
        self.rate_cache: dict[tuple, tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray, np.ndarray]] = {}
        self.cache_hits = 0
        self.jobs = [self._job_state(j) for j in workload.jobs]
        self._prepare()
        # utilisation is recorded for the links some step uses only (a fraction of a big cluster's links): its snapshots
        # copy every recorded link, and a sim of 16k GPUs has 274k links
        self.util = _UtilRecorder(len(self.used_links), config.util_bins if config.track_links != "none" else 0)

    def _prepare(self) -> None:
        """Route every communication phase once, and find the links that two phases may use at the same time.

        Steps of one phase run one after another and a phase never overlaps its
        own next instance, so a link used by a single phase carries at most one
        group at a time: it can never couple two groups. Rate recomputations
        follow only the other, *shared* links to find which groups interact.
        """
        # per phase, its distinct links (over its distinct step templates); a link is shared when two phases use it
        per_phase = []
        for j, job in enumerate(self.workload.jobs):
            for p, phase in enumerate(job.phases):
                if isinstance(phase, ComputePhase):
                    continue
                distinct = {id(tpl): tpl.link_arr for tpl in self._steps(j, p)}
                if distinct:
                    per_phase.append(np.unique(np.concatenate(list(distinct.values()))))
        users = np.bincount(np.concatenate(per_phase), minlength=len(self.net.edges)) if per_phase else np.zeros(len(self.net.edges), dtype=np.intp)
        is_shared = users > 1
        self.used_links = np.flatnonzero(users)  # global ids of the links some step uses; the recorder numbers them 0, 1, ...
        self._util_of = np.full(len(self.net.edges), -1, dtype=np.intp)
        self._util_of[self.used_links] = np.arange(len(self.used_links))
        link_users: dict[int, int] = {}  # shared link -> bit set of the templates using it
        for tpl in self.step_cache.values():
            tpl.shared = tuple(tpl.link_arr[is_shared[tpl.link_arr]].tolist())
            tpl.util_links = self._util_of[tpl.link_arr]
            for link in tpl.shared:
                link_users[link] = link_users.get(link, 0) | (1 << tpl.uid)
            self._reduce(tpl, is_shared)
        for tpl in self.step_cache.values():
            adjacent = 0
            for link in tpl.shared:
                adjacent |= link_users[link]
            tpl.adjacent = adjacent
        self.adjacent = [0] * len(self.step_cache)  # by template uid
        for tpl in self.step_cache.values():
            self.adjacent[tpl.uid] = tpl.adjacent
        self.shared_links = int(np.count_nonzero(is_shared))

    def _reduce(self, tpl: _StepTemplate, is_shared: np.ndarray) -> None:
        """Turn the links that a single sub-flow of the template uses, and no other phase, into caps on that sub-flow.

        Such a link only ever carries that sub-flow (the template's group is
        the only one on it at any time), so ``rate <= capacity`` is all it
        says; as a cap it leaves the max-min solution unchanged and the
        incidence the solver works on much smaller (NVLink and PCIe hops).
        """
        links, counts = np.unique(tpl.entry_link, return_counts=True)
        single = links[(counts == 1) & ~is_shared[links]]
        own = np.isin(tpl.entry_link, single)
        tpl.solve_sub, tpl.solve_link = tpl.entry_sub[~own], tpl.entry_link[~own]
        tpl.own_sub, tpl.own_link = tpl.entry_sub[own], tpl.entry_link[own]
        tpl.solve_cap = tpl.sub_cap.copy()
        np.minimum.at(tpl.solve_cap, tpl.own_sub, self.net.capacity[tpl.own_link])

    # -- setup -------------------------------------------------------------------------------------------
    def _job_state(self, job: Job) -> _JobState:
        within, previous = job.dependencies()
        n = len(job.phases)
        within_succ: list[list[int]] = [[] for _ in range(n)]
        prev_succ: list[list[int]] = [[] for _ in range(n)]
        for q in range(n):
            for p in within[q]:
                within_succ[p].append(q)
            for p in previous[q]:
                prev_succ[p].append(q)
        need_first = [len(within[q]) for q in range(n)]
        need_later = [len(within[q]) + len(previous[q]) for q in range(n)]
        return _JobState(job, within_succ, prev_succ, need_first, need_later)

    def _steps(self, j: int, p: int) -> list[_StepTemplate]:
        key = (j, p)
        steps = self.templates.get(key)
        if steps is None:
            job = self.workload.jobs[j]
            phase = job.phases[p]
            prio = job.phase_priority(phase)
            weight = self.cfg.class_weights[prio] if self.cfg.sharing == "weighted" else 1.0
            policy = job.routing or self.cfg.routing
            cap = job.phase_rate_cap(phase)
            steps = []
            for flows in phase_flows(self.topo, job, phase):
                # identical steps (the 2(n-1) steps of a ring, equal jobs) share one template: routed once, and
                # their max-min solutions are memoised together
                tkey = (policy, prio, cap, weight, tuple(flows))
                tpl = self.step_cache.get(tkey)
                if tpl is None:
                    tpl = self.step_cache[tkey] = _build_step(self.net, flows, policy, prio=prio, cap_gbs=cap, weight=weight,
                                                              latency=self.cfg.latency, uid=len(self.step_cache))
                steps.append(tpl)
            self.templates[key] = steps
        return steps

    def _push(self, t: float, kind: int, a: Any, b: Any = None) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, a, b))

    # -- the workload's logic -----------------------------------------------------------------------------
    def _start_phase(self, j: int, it: int, p: int, t: float) -> None:
        phase = self.workload.jobs[j].phases[p]
        if isinstance(phase, ComputePhase):
            self._push(t + phase.duration, _EV_PHASE, (j, it, p, t))
            return
        run = _CommRun(j, it, p, self._steps(j, p), 0, t)
        self._start_step(run, t)

    def _start_step(self, run: _CommRun, t: float) -> None:
        while run.step < len(run.steps):
            tpl = run.steps[run.step]
            if len(tpl.sub_bytes):
                gid = self.next_gid
                self.next_gid += 1
                g = _Group(gid, tpl, run, t)
                self.groups[gid] = g
                if self.cfg.join_ramp_s > 0 and tpl.adjacent & self.in_flight:
                    # it joins flows in flight on a shared link (checked before it counts as in flight itself)
                    g.joining = True
                    self._push(t + self.cfg.join_ramp_s, _EV_JOINED, g)
                if tpl.adjacent:
                    same = self.by_template.get(tpl.uid)
                    if same is None:
                        self.by_template[tpl.uid] = {gid: g}
                        self.in_flight |= 1 << tpl.uid
                    else:
                        same[gid] = g
                self.dirty.add(gid)
                return
            # nothing to send (local or empty flows): the step takes its latency only
            self._record_flows(run, tpl, t, np.full(len(tpl.src), t))
            end = t + (float(tpl.latency.max()) if len(tpl.latency) else 0.0)
            if end > t:
                self._push(end, _EV_STEP, run)
                return
            run.step += 1
        self._push(t, _EV_PHASE, (run.job, run.iteration, run.phase, run.start))

    def _step_done(self, run: _CommRun, t: float) -> None:
        run.step += 1
        self._start_step(run, t)

    def _phase_done(self, j: int, it: int, p: int, start: float, t: float) -> None:
        js = self.jobs[j]
        job = js.job
        self.phases.append(PhaseRecord(job.name, it, job.phases[p].name, job.phases[p].kind, start, t))
        for q in js.within_succ[p]:
            self._satisfy(j, it, q, t)
        if it + 1 < job.iterations:
            for q in js.prev_succ[p]:
                self._satisfy(j, it + 1, q, t)
        js.done[it] = js.done.get(it, 0) + 1
        if js.done[it] == len(job.phases):
            del js.done[it]
            js.pending.pop(it, None)
            js.ends.append(t)

    def _satisfy(self, j: int, it: int, q: int, t: float) -> None:
        js = self.jobs[j]
        need = js.pending.get(it)
        if need is None:
            need = js.pending[it] = list(js.need_first if it == 0 else js.need_later)
        need[q] -= 1
        if need[q] == 0:
            self._start_phase(j, it, q, t)

    def _release(self, j: int, t: float) -> None:
        js = self.jobs[j]
        js.pending[0] = list(js.need_first)
        for q, need in enumerate(js.need_first):
            if need == 0:
                self._start_phase(j, 0, q, t)

    def _record_flows(self, run: _CommRun, tpl: _StepTemplate, start: float, tx_end: np.ndarray) -> float:
        ends = tx_end + tpl.latency
        if self.cfg.record_flows:
            job = self.workload.jobs[run.job]
            name = job.name
            phase = job.phases[run.phase].name
            it, step, src, dst = run.iteration, run.step, tpl.src, tpl.dst
            for f, (size, end) in enumerate(zip(tpl.nbytes.tolist(), ends.tolist(), strict=True)):
                self.flows.append(FlowRecord(name, it, phase, step, src[f], dst[f], size, start, end))
        return float(ends.max()) if len(ends) else start

    # -- network dynamics -----------------------------------------------------------------------------------
    def _group_event(self, g: _Group, t: float) -> None:
        tpl = g.tpl
        if t != g.last:
            g.rem = g.rem - g.rate * (t - g.last)
            g.last = t
        finished = g.rem <= np.maximum(tpl.tol, g.rate * (1e-12 * max(t, 1e-3)))
        if not finished.any():
            # floating point put the finish a hair later: the event is the earliest finisher's, finish it
            eta = g.rem * g.inv_rate
            finished = eta <= eta.min() * (1 + 1e-9)
        g.n_alive -= int(np.count_nonzero(finished))
        if g.n_alive == 0:
            g.flow_end[np.isnan(g.flow_end)] = t
            del self.groups[g.gid]
            self.dirty.discard(g.gid)
            if tpl.adjacent:
                same = self.by_template[tpl.uid]
                del same[g.gid]
                if not same:
                    del self.by_template[tpl.uid]
                    self.in_flight &= ~(1 << tpl.uid)
                by_template = self.by_template
                for uid in _bits(tpl.adjacent & self.in_flight):
                    self.dirty.update(by_template[uid])
            self.util.set_load(tpl.util_links, np.zeros(len(tpl.util_links)), t)
            g.version += 1
            end = self._record_flows(g.run, tpl, g.start, g.flow_end)
            if end > t:
                self._push(end, _EV_STEP, g.run)
            else:
                self._step_done(g.run, t)
            return
        g.alive = g.alive & ~finished
        g.all_alive = False
        g.rem = np.where(finished, np.inf, g.rem)
        g.rate = np.where(finished, 0.0, g.rate)
        g.inv_rate = np.where(finished, np.inf, g.inv_rate)
        counts = np.bincount(tpl.sub_flow[finished], minlength=len(g.flows_left))
        g.flows_left = g.flows_left - counts
        g.flow_end[(g.flows_left == 0) & (counts > 0)] = t
        self.dirty.add(g.gid)

    def _components(self, seeds: set[int]) -> list[list[_Group]]:
        """The groups in flight connected to the ``seeds`` through shared links, one list per connected component.

        A breadth-first search over templates: a template's static adjacency
        (bit set) intersected with the templates in flight gives the next
        templates, each expanded once, so the cost grows with the component,
        not with the number of groups in flight.
        """
        groups, by_template, in_flight, adjacent = self.groups, self.by_template, self.in_flight, self.adjacent
        assigned: set[int] = set()
        components = []
        for seed in seeds:
            if seed in assigned or seed not in groups:
                continue
            g = groups[seed]
            assigned.add(seed)
            comp = [g]
            reached = 0
            frontier = g.tpl.adjacent & in_flight
            while frontier:
                reached |= frontier
                grown = 0
                for uid in _bits(frontier):
                    for gid, h in by_template[uid].items():
                        if gid not in assigned:
                            assigned.add(gid)
                            comp.append(h)
                    grown |= adjacent[uid]
                frontier = grown & in_flight & ~reached
            components.append(comp)
        return components

    def _recompute(self, t: float) -> None:
        seeds, self.dirty = self.dirty, set()
        for comp in self._components(seeds):
            self._recompute_component(comp, t)

    def _recompute_component(self, comp: list[_Group], t: float) -> None:
        self.recomputes += 1
        self.max_component = max(self.max_component, len(comp))
        for g in comp:
            if g.last != t:
                g.rem = np.maximum(g.rem - g.rate * (t - g.last), 0.0)
                g.last = t
        # max-min rates depend only on which sub-flows of which templates are in flight: memoise them
        if len(comp) > 1:
            comp.sort(key=lambda g: (g.tpl.uid, g.joining, b"" if g.all_alive else g.alive.tobytes()))
        key = tuple((g.tpl.uid, g.joining, b"" if g.all_alive else g.alive.tobytes()) for g in comp)
        hit = self.rate_cache.get(key) if self.cfg.memo else None
        if hit is None:
            hit = self._solve(comp)
            if len(self.rate_cache) >= 20_000:
                self.rate_cache.clear()
            if self.cfg.memo:
                self.rate_cache[key] = hit
        else:
            self.cache_hits += 1
        group_rates, uniq, load = hit
        for g, (rate, inv_rate) in zip(comp, group_rates, strict=True):
            g.rate, g.inv_rate = rate, inv_rate
            g.version += 1
            eta = float((g.rem * inv_rate).min())
            if eta != eta:  # nan: a live sub-flow with nothing left and no rate (0 * inf); it is due now
                eta = 0.0
            if eta < math.inf:
                self._push(t + eta, _EV_GROUP, g, g.version)
        self.util.set_load(uniq, load, t)

    def _solve(self, comp: list[_Group]) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray, np.ndarray]:
        """Max-min rates of the component's live sub-flows: per group rates, the links used and their loads."""
        if len(comp) == 1:
            g = comp[0]
            tpl = g.tpl
            entry_sub, entry_link, own_sub, own_link = tpl.solve_sub, tpl.solve_link, tpl.own_sub, tpl.own_link
            alive, weight, cap, prio = g.alive, tpl.sub_weight, tpl.solve_cap, tpl.sub_prio  # alone, its join weight changes nothing
            sizes = [len(g.rem)]
        else:
            sizes = [len(g.rem) for g in comp]
            offsets = np.cumsum([0, *sizes[:-1]]).tolist()
            entry_sub = np.concatenate([g.tpl.solve_sub + off for g, off in zip(comp, offsets, strict=True)])
            entry_link = np.concatenate([g.tpl.solve_link for g in comp])
            own_sub = np.concatenate([g.tpl.own_sub + off for g, off in zip(comp, offsets, strict=True)])
            own_link = np.concatenate([g.tpl.own_link for g in comp])
            alive = np.concatenate([g.alive for g in comp])
            join = self.cfg.join_weight
            weight = np.concatenate([g.tpl.sub_weight * join if g.joining else g.tpl.sub_weight for g in comp])
            cap = np.concatenate([g.tpl.solve_cap for g in comp])
            prio = np.concatenate([g.tpl.sub_prio for g in comp])
        # local link numbers: a sort of the component's entries (not a scan of every link of the network, which made
        # each solve O(links) and the run quadratic in the cluster's size)
        uniq, local = np.unique(entry_link, return_inverse=True)
        capacity = self.net.capacity[uniq]
        if self.cfg.solver == "numpy":
            rates = maxmin_rates_coo(entry_sub, local, len(alive), capacity, weight=weight, cap=cap, prio=prio, alive=alive,
                                     sharing=self.cfg.sharing)
        else:
            rates = self._reference_rates(entry_sub, local, capacity, alive, weight, cap, prio)
        load = np.bincount(local, weights=rates[entry_sub], minlength=len(uniq))
        # the single-user links carry their sub-flow's rate
        links = self._util_of[np.concatenate([uniq, own_link])]  # as the recorder numbers them
        load = np.concatenate([load, rates[own_sub]])
        bounds = np.cumsum([0, *sizes])
        with np.errstate(divide="ignore"):
            inv = np.where(rates > 0, 1.0 / rates, np.inf)
        return [(rates[a:b], inv[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)], links, load

    def _reference_rates(self, entry_sub: np.ndarray, local: np.ndarray, capacity: np.ndarray, alive: np.ndarray, weight: np.ndarray,
                         cap: np.ndarray, prio: np.ndarray) -> np.ndarray:
        idx = np.flatnonzero(alive)
        paths: list[list[int]] = [[] for _ in range(len(alive))]
        for s, link in zip(entry_sub.tolist(), local.tolist(), strict=True):
            paths[s].append(link)
        sub = maxmin_rates_reference([paths[i] for i in idx], capacity.tolist(), weight=weight[idx].tolist(), cap=cap[idx].tolist(),
                                     prio=prio[idx].tolist(), sharing=self.cfg.sharing)
        rates = np.zeros(len(alive))
        rates[idx] = sub
        return rates

    # -- the loop ------------------------------------------------------------------------------------------------
    def run(self) -> RunResult:
        wall0 = time.perf_counter()
        for j, job in enumerate(self.workload.jobs):
            self._push(job.arrival + job.start_offset, _EV_RELEASE, j)
        heap = self.heap
        while heap:
            t = heap[0][0]
            horizon = t + 1e-12 * max(abs(t), 1e-6)
            self.util.advance(t)
            self.now = t
            while heap and heap[0][0] <= horizon:
                _, _, kind, a, b = heapq.heappop(heap)
                if kind == _EV_GROUP:
                    if a.version != b or a.gid not in self.groups:
                        continue
                    self.events += 1
                    self._group_event(a, t)
                elif kind == _EV_STEP:
                    self.events += 1
                    self._step_done(a, t)
                elif kind == _EV_PHASE:
                    self.events += 1
                    j, it, p, start = a
                    self._phase_done(j, it, p, start, t)
                elif kind == _EV_JOINED:
                    if a.gid in self.groups:  # its ramp is over: full weight from now on
                        self.events += 1
                        a.joining = False
                        self.dirty.add(a.gid)
                else:
                    self.events += 1
                    self._release(a, t)
            if self.dirty:
                self._recompute(t)
        stuck = [js.job.name for js in self.jobs if len(js.ends) < js.job.iterations]
        if stuck or self.groups:
            raise InputError(f"simulation stalled with unfinished jobs {stuck}: a dependency can never be met or a flow has no capacity")
        return self._result(time.perf_counter() - wall0)

    def _result(self, wall: float) -> RunResult:
        jobs = {}
        for js in self.jobs:
            job = js.job
            jobs[job.name] = JobResult(job.name, job.arrival, job.arrival + job.start_offset, list(js.ends))
        end = max((js.ends[-1] for js in self.jobs if js.ends), default=0.0)
        links = None
        if self.cfg.track_links != "none" and end > 0:
            edges, nbytes = self.util.series(end)
            keep = nbytes.sum(axis=1) > 0  # per recorded link
            if self.cfg.track_links == "network":
                keep &= np.array([self.net.kinds[i] == "network" for i in self.used_links.tolist()], dtype=bool)
            rec = np.flatnonzero(keep)
            idx = self.used_links[rec].tolist()  # global link ids, ascending
            widths = np.diff(edges)
            util = nbytes[rec] / (self.net.capacity[idx, None] * np.maximum(widths[None, :], 1e-300))
            names = []
            for i in idx:
                u, v, k = self.net.edges[i]
                names.append(f"{u}->{v}" if k in (0, None) else f"{u}->{v}#{k}")
            links = LinkUtilisation(names, [float(self.net.capacity[i] / 1e9) for i in idx], [self.net.kinds[i] for i in idx], edges, util)
        meta = {"events": self.events, "recomputes": self.recomputes, "memo_hits": self.cache_hits, "step_templates": len(self.step_cache),
                "largest_component_groups": self.max_component,
                "shared_links": self.shared_links,
                "wall_s": wall, "events_per_s": self.events / wall if wall > 0 else math.inf, "config": asdict(self.cfg),
                "links": len(self.net.edges), "routes_cached": len(self.net._routes)}
        return RunResult("sim", self.workload.name, self.topo.name, jobs, self.phases, self.flows, links, 1.0, meta)


def simulate(topo: Topology, workload: Workload, config: SimConfig | None = None, **options: Any) -> RunResult:
    """Simulate ``workload`` on ``topo``; ``options`` override fields of ``config`` (see :class:`SimConfig`)."""
    cfg = replace(config or SimConfig(), **options).validated()
    validate_workload(workload)
    validate_against_topology(workload, topo)
    return Simulator(topo, workload, cfg).run()


__all__ = ["DEFAULT_CLASS_WEIGHTS", "SimConfig", "Simulator", "phase_flows", "simulate"]
