"""Trace replay: run a job trace on a topology under a placement policy and measure JCT, queueing, fragmentation.

Event-driven: events are arrivals and completions. At each event the policy
places (and, for LAS, preempts) jobs; then the iteration time of every running
job is recomputed by a *slowdown model* (:mod:`placement.contention`, default
:class:`~placement.contention.FluidSlowdown`, emu's job-level fluid model
:mod:`emu.fluid`) from the jobs' communication profiles and phases, and jobs
progress at ``1 / iteration time`` iterations per second until the next event.
The model is incremental: it re-simulates only the groups of jobs (linked by
links that can saturate) that the event changed.

Policies (:data:`POLICIES`):

``fifo``
    FIFO + first-fit: the queue head starts when enough GPUs are idle, on the
    first idle GPUs in topology order; the queue blocks behind it. Contention-blind.
``las``
    Tiresias-style discretised 2D-LAS (Gu et al., NSDI 2019): jobs are ordered
    by the queue their attained service (GPU-seconds) falls in (thresholds
    ``las_thresholds``), FIFO inside a queue; at every event the highest jobs
    that fit by GPU count run and the others are preempted (progress kept, no
    restart penalty; placement first-fit, i.e. consolidation relaxed). Queues
    are re-evaluated at events (arrivals, completions), not at the instant a
    job crosses a threshold. The order is kept between events (one
    arrival-ordered list per queue, a heap of threshold-crossing times), which
    gives exactly the schedule of sorting every job at every event
    (``tests/test_scale.py`` checks it against that loop); the walk along it
    runs in C (``csrc/replay.c``) when built.
``hived``
    HiveD buddy cell allocation (:class:`~placement.hived.HivedScheduler`): each
    job placed by the buddy allocator (guaranteed in its VC when the trace names
    VCs, opportunistic otherwise). No time shifts. One FIFO queue per VC and one
    for opportunistic jobs: a head that does not fit blocks only its own queue;
    guaranteed queues go first; a request its VC can never hold is refused on
    arrival; preempted opportunistic jobs keep their progress and return to the
    head of their queue.
``hived+cassini``
    As ``hived``, but up to ``candidates`` buddy placements are ranked by
    CASSINI against the running jobs that share links with them, and the job's
    first iteration is delayed by its time shift so its communication
    interleaves with theirs.

Metrics: average and p99 JCT (finish - arrival), average queueing delay (first
start - arrival), time-averaged GPU fragmentation (share of idle GPUs outside
fully idle hosts), GPU utilisation, and per-link overload time (seconds during
which a shared link's demand exceeds its capacity, summed over links; from the
unified circles of the jobs sharing it). Its per-link state (each link's users
in join order, their summed demand, its overloaded arcs) is a table kept in C
(``csrc/replay.c``) when built, in Python otherwise: the same floats.
"""

from __future__ import annotations

import bisect
import ctypes
import gc
import heapq
import math
import time
import weakref
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from topology.clib import library_path, load_library
from topology.errors import InputError
from topology.model import SwitchTier, Topology

from .cassini import DEFAULT_BUCKETS, demand_sum, rank_candidates, unified_perimeter
from .contention import FluidSlowdown, PlacedJob
from .hived import HivedScheduler
from .profiles import CommProfile, Edge, JobSpec, _profile_links, comm_profile
from .traces import TraceJob

POLICIES = ("fifo", "las", "hived", "hived+cassini")
SlowdownModel = Callable[[Sequence[PlacedJob]], Mapping[str, float]]


class ProfileCache:
    """Communication profiles, reused across placements that the fabric's symmetry makes identical.

    On a rail-optimised fabric whose scalable units are all full, hosts of one
    SU are interchangeable and so are SUs: a placement is reduced to its
    *shape* (per host in rank order: the SU by first appearance and the local
    GPU indices), profiled once on a canonical placement of that shape, and
    translated back by renaming hosts and leaf switches. Elsewhere the exact
    GPU list is the key.

    The renaming of a shape's links is decided once, when the shape is first
    profiled: each distinct node of the canonical profile is a node of the job's
    ``j``-th host, the leaf of a rail in the job's ``c``-th SU, or a node that
    keeps its name (a spine). A hit then names each distinct node once and
    builds the link keys from those names, in the canonical profile's order.
    """

    def __init__(self, topo: Topology, routing: str = "rail"):
        self.topo, self.routing = topo, routing
        self.cache: dict[tuple, CommProfile] = {}  # by the exact GPU list (a fabric without the symmetry; else self.shapes)
        self.hits = self.misses = 0
        g = topo.graph
        self.host_of = {n: topo.host_of(n) for n in topo.gpus()}
        self.index = {n: g.nodes[n].get("index", 0) for n in topo.gpus()}
        fab = topo.meta.get("fabric") or {}
        hosts = topo.hosts()
        self.symmetric = False
        if fab.get("kind") == "rail-optimized":
            per = int(fab.get("hosts_per_su", 32))
            models = {g.nodes[n].get("model") for n in topo.gpus()}
            if len(hosts) % per == 0 and len(models) == 1:
                self.symmetric = True
                self.su_of = {h: i // per for i, h in enumerate(hosts)}
                self.su_hosts = [hosts[i : i + per] for i in range(0, len(hosts), per)]
                self.leaf = {(g.nodes[s].get("pod"), g.nodes[s].get("rail")): s for s in topo.switches(SwitchTier.LEAF)}
                self.leaf_key = {s: k for k, s in self.leaf.items()}
                self.gpu_at = {(self.host_of[n], self.index[n]): n for n in topo.gpus()}
                self.where = {n: (self.host_of[n], self.index[n], self.su_of[self.host_of[n]]) for n in topo.gpus()}
                self.local: dict[str, dict[str, str]] = {h: {} for h in hosts}  # host -> {rest: the node "host/rest"}
                for n in g:
                    host, _, rest = n.partition("/")
                    if rest and host in self.local:
                        self.local[host][rest] = n
                self.role: dict[str, tuple] = {}  # node of a canonical profile -> what it is (see _renaming)
                # per canonical profile: its distinct nodes as (0, name) kept, (1, job host j, rest) or (2, job SU c, rail),
                # and its links as (node position, node position, key); see _renaming
                self.renamings: dict[tuple, tuple[list[tuple], list[tuple[int, int, Any]]]] = {}
                # per shape its canonical profile as lists: compute_s, comm_s, and per link (in the renaming's order) GB and rate
                self.shapes: dict[tuple, tuple[float, float, list[float], list[float]]] = {}

    def profile(self, spec: JobSpec, gpus: Sequence[str]) -> CommProfile:
        shape_key = (spec.gpus, spec.tp, spec.pp, spec.compute_s, spec.grad_bytes, spec.algorithm)
        if not self.symmetric:
            key = (*shape_key, tuple(gpus))
            hit = self.cache.get(key)
            if hit is None:
                self.misses += 1
                hit = self.cache[key] = comm_profile(self.topo, spec, gpus, policy=self.routing)
            else:
                self.hits += 1
            return CommProfile(spec.name, tuple(gpus), hit.compute_s, hit.comm_s, hit.link_rates, hit.link_bytes)
        where = self.where
        per_host: dict[str, list[int]] = {}  # the job's hosts in order of first appearance -> local GPU indices in rank order
        su_map: dict[int, int] = {}  # the job's SUs -> canonical SU (order of first appearance)
        for x in gpus:
            h, i, su = where[x]
            ix = per_host.get(h)
            if ix is None:
                per_host[h] = [i]
                if su not in su_map:
                    su_map[su] = len(su_map)
            else:
                ix.append(i)
        su_of = self.su_of
        key = (*shape_key, tuple([(su_map[su_of[h]], tuple(ix)) for h, ix in per_host.items()]))
        hosts = list(per_host)
        hit = self.shapes.get(key)
        if hit is None:
            self.misses += 1
            # canonical hosts: in canonical SU c, the hosts of the job in that SU become its first hosts, in rank order
            used: dict[int, int] = {}
            canon_host = {}
            for h in hosts:
                c = su_map[su_of[h]]
                canon_host[h] = self.su_hosts[c][used.get(c, 0)]
                used[c] = used.get(c, 0) + 1
            gpu_at = self.gpu_at
            canon = [gpu_at[(canon_host[where[x][0]], where[x][1])] for x in gpus]
            comm_s, canon_links, gb, rates = _profile_links(self.topo, spec, canon, self.routing)  # comm_profile's, as lists
            hit = self.shapes[key] = (float(spec.compute_s), comm_s, gb, rates)
            self.renamings[key] = self._renaming(canon_links, list(canon_host.values()))
        else:
            self.hits += 1
        compute_s, comm_s, gb, rates = hit
        nodes, links = self.renamings[key]
        sus = list(su_map)
        local, leaf = self.local, self.leaf
        names = [n[1] if n[0] == 0 else local[hosts[n[1]]][n[2]] if n[0] == 1 else leaf[(sus[n[1]], n[2])] for n in nodes]
        keys = [(names[u], names[v], k) for u, v, k in links]
        return CommProfile(spec.name, tuple(gpus), compute_s, comm_s, dict(zip(keys, rates, strict=True)) if rates else {},
                           dict(zip(keys, gb, strict=True)))

    def _renaming(self, canon_links: list[Edge], canon_hosts: list[str]) -> tuple[list[tuple], list[tuple[int, int, Any]]]:
        """How a canonical profile's links are renamed for a placement of its shape: (distinct nodes, links by node position).

        ``canon_hosts[j]`` is the canonical host of the job's ``j``-th host; leaf switches are in canonical SU ``pod``.
        """
        slot = {h: j for j, h in enumerate(canon_hosts)}
        role = self.role
        position: dict[str, int] = {}
        nodes: list[tuple] = []

        def place(node: str) -> int:
            position[node] = len(nodes)
            r = role.get(node)
            if r is None:  # what the node is, whatever the placement: a host's (host, rest), a leaf's (2, SU, rail), else kept
                host, _, rest = node.partition("/")
                r = role[node] = (2, *self.leaf_key[node]) if node in self.leaf_key else (1, host, rest) if rest and host in self.su_of else (0, node)
            nodes.append((1, slot[r[1]], r[2]) if r[0] == 1 and r[1] in slot else (0, node) if r[0] == 1 else r)
            return position[node]

        get = position.get
        links = [(get(u) if u in position else place(u), get(v) if v in position else place(v), k) for u, v, k in canon_links]
        return nodes, links


class _Waiting(dict):
    """LAS's waiting jobs in the order they queued: a list's ``append`` and ``remove`` on an insertion-ordered dict (LAS
    starts jobs from anywhere in the queue; a list's remove is a scan of a queue that grows to thousands)."""

    def append(self, name: str) -> None:
        self[name] = None

    def remove(self, name: str) -> None:
        del self[name]


@dataclass
class _Run:
    trace: TraceJob
    spec: JobSpec
    gpus: list[str] = field(default_factory=list)
    profile: CommProfile | None = None
    first_start: float | None = None
    ready: float = 0.0
    shift: float = 0.0
    remaining: float = 0.0  # iterations left at time ``anchor`` (progress is settled lazily, when the rate changes)
    iter_time: float = math.inf
    served: float = 0.0  # GPU-seconds of attained service before its current run (see Replay.attained)
    run_start: float = 0.0  # when its current (or last) run started
    anchor: float = 0.0
    version: int = 0  # of its entry in the replay's finish heap
    has_entry: bool = False  # whether that entry is valid
    started: int = 0  # the order of its last start (the order the running jobs are listed in)
    finish: float | None = None
    running: bool = False
    reason: str | None = None


@dataclass
class ReplayResult:
    """Per-job times and the aggregate metrics of one replay."""

    policy: str
    jobs: list[dict[str, Any]]
    metrics: dict[str, Any]

    def jct(self) -> np.ndarray:
        return np.array([j["jct_s"] for j in self.jobs if j["jct_s"] is not None])

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "metrics": self.metrics, "jobs": self.jobs}


class Replay:
    """One replay of ``trace`` on ``topo`` under ``policy`` (see the module docstring)."""

    def __init__(self, topo: Topology, trace: Sequence[TraceJob], policy: str = "hived", *, slowdown: SlowdownModel | None = None,
                 virtual_clusters: Mapping[str, Any] | None = None, candidates: int = 4, routing: str = "rail",
                 las_thresholds: Sequence[float] = (3600.0, 36000.0), profiles: ProfileCache | None = None):
        if policy not in POLICIES:
            raise InputError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}", where="policy")
        self.topo, self.policy = topo, policy
        self.slowdown = slowdown or FluidSlowdown(topo)
        self.candidates, self.las_thresholds = candidates, tuple(las_thresholds)
        self._las_sorted = sorted(self.las_thresholds)
        # LAS's order across events: per queue, (arrival, name) sorted; each job's queue; crossing heap (time, start, name).
        # The queues laid end to end, position by position: each job's GPUs and whether it holds them (the last walk kept
        # it), in arrays with room to grow, for the walk (see _schedule_las)
        self._las_order: list[list[tuple[float, str]]] = [[] for _ in range(len(self._las_sorted) + 1)]
        self._las_level: dict[str, int] = {}
        self._las_cross: list[tuple[float, int, str]] = []
        self._las_n = 0
        self._las_size = np.zeros(0, dtype=np.int32)
        self._las_on = np.zeros(0, dtype=np.uint8)
        self._las_flips = np.zeros(0, dtype=np.int32)
        self._las_at = (0, 0, 0)
        self._las_lib = _replay_library() if policy == "las" else None
        self.profiles = profiles or ProfileCache(topo, routing)
        self.gpus = topo.gpus()
        self.gpu_pos = {g: i for i, g in enumerate(self.gpus)}
        self.host_of = {g: topo.host_of(g) for g in self.gpus}
        self.gpu_index = {g: topo.graph.nodes[g].get("index", 0) for g in self.gpus}  # the local index (rank order's key)
        self.host_size: dict[str, int] = {}
        for g in self.gpus:
            self.host_size[self.host_of[g]] = self.host_size.get(self.host_of[g], 0) + 1
        self.host_idle = dict(self.host_size)
        self.idle = np.ones(len(self.gpus), dtype=bool)
        self.n_idle = len(self.gpus)
        self.whole_idle = len(self.gpus)  # idle GPUs on fully idle hosts
        vcs = dict(virtual_clusters or {})
        self.use_vcs = bool(vcs)
        self.sched = HivedScheduler(topo, vcs) if policy.startswith("hived") else None
        self.jobs = {t.name: _Run(t, t.spec()) for t in trace}
        too_big = [t.name for t in trace if t.gpus > len(self.gpus)]
        for name in too_big:
            self.jobs[name].reason = f"needs {self.jobs[name].spec.gpus} GPUs, the cluster has {len(self.gpus)}"
        self.arrivals = sorted((t for t in trace if t.name not in too_big), key=lambda t: (t.arrival_s, t.name))
        self.queue: list[str] | _Waiting = _Waiting() if policy == "las" else []
        self.running: dict[str, _Run] = {}
        self.now = 0.0
        self.capacity = {(u, v, k): float(d["bw"]) for u, v, k, d in topo.links()}
        self.stats = {"frag_integral": 0.0, "busy_integral": 0.0, "overload_link_s": 0.0, "events": 0, "preemptions": 0, "span": 0.0,
                      "frag_wait_integral": 0.0, "wait_time": 0.0}
        self._overload_rate = 0.0
        self._overload_cache: dict[tuple, int] = {}
        self.overload_cache_limit = 100_000  # entries; then it is emptied
        # the overloaded-link metric: links numbered in the topology's order; per link its users, their summed demand and its
        # overloaded arcs in a table (C, or its Python twin; see _overload); per user its slot there and its keys (_overload_keys)
        self._ov_link_id = {e: i for i, e in enumerate(self.capacity)}
        self._ov_limit = [c * (1 + 1e-9) for c in self.capacity.values()]  # a link is overloaded above this
        self._ov_cap_key = [round(c, 6) for c in self.capacity.values()]
        lib = _replay_library()
        self._ov_table: _LinkTable | _CLinkTable = _CLinkTable(lib, self._ov_limit) if lib is not None else _LinkTable(self._ov_limit)
        self._ov_jobs: dict[str, tuple[CommProfile, float, int, Any]] = {}  # per user: profile, phase, slot, its handle in the table
        self._ov_keys: list[dict[float, tuple[float, float, float, float]]] = []  # per slot
        self._ov_free: list[int] = []  # slots to reuse
        # hived+cassini: the running jobs on each link (the candidates' link-sharing neighbours without a scan of all jobs)
        self._link_jobs: dict[Edge, dict[str, None]] | None = {} if policy == "hived+cassini" else None
        # the event loop's incremental state: the jobs started or stopped since the last recompute (in the order of their
        # last change), the finish heap ``(finish time, version, name)`` and the largest finish slack (see _finishing)
        self._changed: dict[str, None] = {}
        self._finish_heap: list[tuple[float, int, str]] = []
        self._slack = 0.0
        self._starts = 0

    # -- GPU bookkeeping ------------------------------------------------------------------------
    def _take(self, gpus: Sequence[str]) -> None:
        for g in gpus:
            i = self.gpu_pos[g]
            assert self.idle[i], g
            self.idle[i] = False
            h = self.host_of[g]
            if self.host_idle[h] == self.host_size[h]:
                self.whole_idle -= self.host_size[h]
            self.host_idle[h] -= 1
        self.n_idle -= len(gpus)

    def _give(self, gpus: Sequence[str]) -> None:
        for g in gpus:
            self.idle[self.gpu_pos[g]] = True
            h = self.host_of[g]
            self.host_idle[h] += 1
            if self.host_idle[h] == self.host_size[h]:
                self.whole_idle += self.host_size[h]
        self.n_idle += len(gpus)

    def fragmentation(self) -> float:
        """The share of idle GPUs outside fully idle hosts (kept up to date by _take and _give: O(1))."""
        return 0.0 if self.n_idle == 0 else 1.0 - self.whole_idle / self.n_idle

    def _first_fit(self, n: int) -> list[str] | None:
        if self.n_idle < n:
            return None
        if n == 1:  # most jobs: the first idle GPU without listing them all (argmax stops at the first True)
            return [self.gpus[int(self.idle.argmax())]]
        return [self.gpus[i] for i in np.flatnonzero(self.idle)[:n].tolist()]

    def _rank_order(self, gpus: Sequence[str]) -> list[str]:
        """:func:`placement.planner.rank_order` from this replay's tables (the same keys, so the same order), not the graph's."""
        host_of, index = self.host_of, self.gpu_index
        first: dict[str, int] = {}
        for g in gpus:
            first.setdefault(host_of[g], len(first))
        return sorted(gpus, key=lambda g: (first[host_of[g]], index[g], g))

    # -- starting and stopping jobs ----------------------------------------------------------------
    def _start(self, r: _Run, gpus: Sequence[str], shift: float = 0.0, profile: CommProfile | None = None) -> None:
        ordered = self._rank_order(gpus)
        r.gpus = ordered
        r.profile = profile or self.profiles.profile(r.spec, ordered)
        r.shift = shift
        r.ready = self.now + shift
        if r.first_start is None:
            r.first_start = self.now
            r.remaining = float(r.spec.iterations)
        r.running = True
        r.anchor = self.now
        r.run_start = self.now
        self._starts += 1
        r.started = self._starts
        self.running[r.trace.name] = r
        self._mark(r.trace.name)
        self._take(ordered)
        if self._link_jobs is not None:
            for e in r.profile.link_rates:
                self._link_jobs.setdefault(e, {})[r.trace.name] = None

    def _stop(self, r: _Run, free_cells: bool = True) -> None:
        """Stop a running job (finished or preempted); ``free_cells=False`` when HiveD freed its cells already."""
        self._settle(r)
        r.served = self.attained(r)
        r.running = False
        r.version += 1  # its finish entry is void
        r.has_entry = False
        name = r.trace.name
        del self.running[name]
        self._mark(name)
        self._give(r.gpus)
        if self._link_jobs is not None:
            for e in r.profile.link_rates:
                users = self._link_jobs[e]
                del users[name]
                if not users:
                    del self._link_jobs[e]
        if free_cells and self.sched is not None and name in self.sched.jobs:
            self.sched.free(name)

    # -- policies -------------------------------------------------------------------------------------
    def _schedule(self) -> bool:
        changed = False
        if self.policy == "las":
            return self._schedule_las()
        if self.policy != "fifo":
            return self._schedule_hived()
        while self.queue:
            r = self.jobs[self.queue[0]]
            gpus = self._first_fit(r.spec.gpus)
            if gpus is None:
                if not self.running:  # the whole cluster is idle and it still does not fit: it never will
                    r.reason = r.reason or "does not fit the idle cluster"
                    self.queue.pop(0)
                    continue
                break
            self._start(r, gpus)
            self.queue.pop(0)
            changed = True
        return changed

    def _queue_of(self, r: _Run) -> str | None:
        return r.spec.vc if self.use_vcs else None

    def _schedule_hived(self) -> bool:
        """One FIFO queue per VC (opportunistic jobs form their own), as HiveD's intra-VC schedulers: a head that does not fit blocks its VC only."""
        changed, again = False, True
        while again:  # one pass, and another only when preempted jobs went back to a queue already passed
            preemptions = self.stats["preemptions"]
            blocked: set[str | None] = set()
            # guaranteed jobs before opportunistic ones (higher priority first, as HiveD): an opportunistic job must not take
            # the cells a waiting guaranteed job is about to preempt it from
            for name in sorted(self.queue, key=lambda n: self.jobs[n].spec.vc is None or not self.use_vcs):
                r = self.jobs[name]
                q = self._queue_of(r)
                if q in blocked or r.running:
                    continue
                if self._place_hived(r):
                    self.queue.remove(name)
                    changed = True
                elif not self.running:  # the whole cluster is idle and it still does not fit: it never will
                    r.reason = r.reason or "does not fit the idle cluster"
                    self.queue.remove(name)
                else:
                    blocked.add(q)
            again = self.stats["preemptions"] > preemptions
        return changed

    def _las_queue(self, r: _Run) -> int:
        """The LAS queue a job is in now: the number of thresholds its attained service has reached."""
        return bisect.bisect_right(self._las_sorted, self.attained(r))

    def _las_add(self, r: _Run) -> None:
        """Enter a job (arrived) into the LAS order."""
        level = self._las_level[r.trace.name] = self._las_queue(r)
        self._las_insert(level, (r.trace.arrival_s, r.trace.name), r.spec.gpus, 0)

    def _las_remove(self, r: _Run) -> None:
        """Take a job (finished) out of the LAS order."""
        self._las_delete(self._las_level.pop(r.trace.name), (r.trace.arrival_s, r.trace.name))

    def _las_position(self, level: int, i: int) -> int:
        return sum(len(self._las_order[q]) for q in range(level)) + i

    def _las_insert(self, level: int, entry: tuple[float, str], gpus: int, on: int) -> None:
        order = self._las_order[level]
        i = bisect.bisect_left(order, entry)
        order.insert(i, entry)
        at, n = self._las_position(level, i), self._las_n
        if n == len(self._las_size):  # full: twice the room
            room = max(64, 2 * n)
            for name in ("_las_size", "_las_on", "_las_flips"):
                old = getattr(self, name)
                new = np.zeros(room, dtype=old.dtype)
                new[:n] = old[:n]
                setattr(self, name, new)
            # their addresses for nw_las_walk, taken once (numpy's .ctypes.data costs microseconds a call)
            self._las_at = (self._las_size.ctypes.data, self._las_on.ctypes.data, self._las_flips.ctypes.data)
        size, flag = self._las_size, self._las_on
        size[at + 1 : n + 1] = size[at:n]  # numpy copies overlapping slices safely
        flag[at + 1 : n + 1] = flag[at:n]
        size[at], flag[at] = gpus, on
        self._las_n = n + 1

    def _las_delete(self, level: int, entry: tuple[float, str]) -> int:
        """Take ``entry`` out of queue ``level``; return whether it held GPUs (its flag)."""
        order = self._las_order[level]
        i = bisect.bisect_left(order, entry)
        del order[i]
        at, n = self._las_position(level, i), self._las_n
        size, flag = self._las_size, self._las_on
        on = int(flag[at])
        size[at : n - 1] = size[at + 1 : n]
        flag[at : n - 1] = flag[at + 1 : n]
        self._las_n = n - 1
        return on

    def _las_watch(self, r: _Run) -> None:
        """Note when a running job's attained service reaches its queue's threshold (when it moves down a queue)."""
        level = self._las_level[r.trace.name]
        if level < len(self._las_sorted):
            cross = r.run_start + (self._las_sorted[level] - r.served) / r.spec.gpus
            heapq.heappush(self._las_cross, (cross, r.started, r.trace.name))

    def _las_demote(self) -> None:
        """Move the running jobs whose attained service crossed a threshold by now to their new queue.

        The heap's crossing times are computed ahead; each one near now is checked against :meth:`_las_queue` itself (the
        queue of every job is exactly what sorting all of them at this event would give), and a crossing a rounding error
        late stays for the next event.
        """
        heap, later = self._las_cross, []
        while heap and heap[0][0] <= self.now + 1e-9 * max(1.0, abs(self.now)):
            entry = heapq.heappop(heap)
            r = self.jobs[entry[2]]
            if not r.running or r.started != entry[1]:
                continue  # stopped (or restarted: a newer entry stands for it)
            level = self._las_queue(r)
            name = r.trace.name
            if level == self._las_level[name]:
                later.append(entry)
                continue
            on = self._las_delete(self._las_level[name], (r.trace.arrival_s, name))
            self._las_insert(level, (r.trace.arrival_s, name), r.spec.gpus, on)
            self._las_level[name] = level
            self._las_watch(r)
        for entry in later:
            heapq.heappush(heap, entry)

    def _schedule_las(self) -> bool:
        """Discretised LAS: the jobs, by (queue, arrival, name), run while they fit by GPU count; the rest wait or are preempted.

        The order is kept across events (one arrival-sorted list per queue; running jobs move down a queue when their
        attained service crosses a threshold, found through a heap of crossing times), with each position's GPUs and
        whether its job holds GPUs in two arrays. The walk along it (a job is kept when its GPUs fit in what the jobs
        before it left) is redone whole at every event by ``nw_las_walk`` (``csrc/replay.c``; the same loop in Python
        when the library is not built): a few microseconds for the few thousand jobs of a full cluster, where an
        arrival near the front changes the walk of every job behind it. The positions whose flag changed are the jobs
        to start (in the order's order) and to preempt (in the order they started).
        """
        self._las_demote()
        n, size, flag, flips = self._las_n, self._las_size, self._las_on, self._las_flips
        if self._las_lib is not None:
            size_at, flag_at, flips_at = self._las_at
            count = self._las_lib.nw_las_walk(n, size_at, flag_at, len(self.gpus), flips_at)
            if count < 0:
                raise RuntimeError(f"nw_las_walk failed with code {count} (invalid arguments)")
            changed_at = flips[:count].tolist()
        else:
            changed_at = _las_walk(size, flag, n, len(self.gpus))
        if not changed_at:
            return False
        jobs, orders = self.jobs, self._las_order
        start: list[_Run] = []
        preempt: list[_Run] = []
        level, base = 0, 0
        for at in changed_at:  # ascending: map each position to its queue and index
            while at - base >= len(orders[level]):
                base += len(orders[level])
                level += 1
            r = jobs[orders[level][at - base][1]]
            (start if flag[at] else preempt).append(r)
        for r in sorted(preempt, key=lambda r: r.started):  # in the order they started (the running jobs' order)
            self._stop(r)
            self.queue.append(r.trace.name)
            self.stats["preemptions"] += 1
        for r in start:
            gpus = self._first_fit(r.spec.gpus)
            if gpus is None:  # the kept jobs fit by count and first-fit takes any idle GPU
                raise RuntimeError(f"LAS kept {r.trace.name!r} but {self.n_idle} idle GPUs cannot hold its {r.spec.gpus}")
            self.queue.remove(r.trace.name)
            self._start(r, gpus)
            self._las_watch(r)
        return True

    def _place_hived(self, r: _Run) -> bool:
        vc = r.spec.vc if self.use_vcs else None
        name = r.trace.name
        if self.policy == "hived":
            res = self.sched.allocate(name, r.spec.gpus, vc=vc, priority=r.spec.priority)
            if not res.ok:
                r.reason = res.reason["message"] if res.reason else "no cells"
                return False
            self._preempted(res.preempted)
            self._start(r, res.gpus)
            return True
        cands = [c for c in self.sched.candidates(name, r.spec.gpus, vc=vc, priority=r.spec.priority, limit=self.candidates) if c.ok]
        if not cands:
            res = self.sched.allocate(name, r.spec.gpus, vc=vc, priority=r.spec.priority, dry=True)
            r.reason = res.reason["message"] if res.reason else "no cells"
            return False
        profs = [self.profiles.profile(r.spec, self._rank_order(c.gpus)) for c in cands]
        pick, shift = 0, 0.0
        if any(p.link_rates for p in profs):
            running = self._sharing({e for p in profs for e in p.link_rates})
            ranked = rank_candidates(self.capacity, running, profs)
            pick = ranked[0].index
            phase = ranked[0].shifts.shifts.get(name, 0.0)
            period = profs[pick].period_s
            shift = (phase - self.now) % period if running else 0.0
        res = self.sched.allocate(name, r.spec.gpus, vc=vc, priority=r.spec.priority, plan=cands[pick].plan)
        self._preempted(res.preempted)
        self._start(r, res.gpus, shift, profs[pick])
        return True

    def _sharing(self, links: set[Edge]) -> dict[str, tuple[CommProfile, float]]:
        """The running jobs that use any of ``links``: ``{name: (profile, start of its first iteration)}``, in start order."""
        names = {n for e in links for n in self._link_jobs.get(e, ())}
        return {r.trace.name: (r.profile, r.ready) for r in sorted((self.running[n] for n in names), key=lambda r: r.started)}

    def _preempted(self, names: Sequence[str]) -> None:
        for n in names:  # HiveD preempted these opportunistic jobs; they go back to the queue
            r = self.running.get(n)
            if r is not None:
                self._stop(r, free_cells=False)
                self.queue.insert(0, n)  # the oldest work of its queue: it goes first when cells free up
                self.stats["preemptions"] += 1

    # -- contention ---------------------------------------------------------------------------------
    def _mark(self, name: str) -> None:
        """Note a start or stop for the next recompute (a job's last change decides its place in the order)."""
        self._changed.pop(name, None)
        self._changed[name] = None

    def attained(self, r: _Run) -> float:
        """A job's attained service (GPU-seconds) now: its earlier runs' plus ``gpus * (now - run_start)`` while it runs."""
        return r.served + r.spec.gpus * (self.now - r.run_start) if r.running else r.served

    def remaining(self, r: _Run) -> float:
        """A running job's iterations left now (its rate has been constant since ``anchor``)."""
        return r.remaining - max(0.0, self.now - max(r.anchor, r.ready)) / r.iter_time

    def _settle(self, r: _Run) -> None:
        """Bring a running job's ``remaining`` up to now; called only when its rate changes or it stops, so a job's progress is
        summed over the stretches of constant rate (the reference loop, ``tests/replay_reference.py``, does the same)."""
        if self.now > r.anchor:
            r.remaining = self.remaining(r)
            r.anchor = self.now

    def _set_iter_time(self, r: _Run, iter_time: float) -> None:
        if iter_time == r.iter_time and r.has_entry:
            return  # the same rate: its finish entry still holds
        now = self.now
        if now > r.anchor:  # _settle, inline (called for every refreshed answer)
            r.remaining -= max(0.0, now - max(r.anchor, r.ready)) / r.iter_time
            r.anchor = now
        r.iter_time = iter_time
        r.version += 1
        r.has_entry = True
        finish = max(r.ready, r.anchor) + r.remaining * iter_time
        heapq.heappush(self._finish_heap, (finish, r.version, r.trace.name))
        self._slack = max(self._slack, 1e-9 * max(1.0, r.spec.iterations) * iter_time)

    def _recompute(self) -> None:
        changed, self._changed = self._changed, {}
        update = getattr(self.slowdown, "update", None)
        overload = None
        if update is not None:  # incremental: only the started and stopped jobs, and those whose answers moved
            running = self.running
            placed = {n: (PlacedJob(running[n].profile, running[n].ready) if n in running else None) for n in changed}
            if isinstance(self.slowdown, FluidSlowdown):  # the overloaded-link metric meanwhile (it reads the profiles only)
                overload = []
                times = update(placed, alongside=lambda: overload.append(self._overload(changed)))
            else:
                times = update(placed)
            for name, x in times.items():
                r = running.get(name)
                if r is not None:
                    self._set_iter_time(r, max(x, 1e-12))
            for name in changed:  # a job restarted on the same placement keeps its answer, but needs a finish entry
                r = running.get(name)
                if r is not None and name not in times:
                    self._set_iter_time(r, r.iter_time if math.isfinite(r.iter_time) else max(r.profile.period_s, 1e-12))
        else:
            placed = [PlacedJob(r.profile, r.ready) for r in self.running.values()]
            times = self.slowdown(placed)
            for name, r in self.running.items():
                self._set_iter_time(r, max(times.get(name, r.profile.period_s), 1e-12))
        self._overload_rate = overload[0] if overload else self._overload(changed)

    _ov_every_shared = False  # whether _over_capacity decides every touched link of two users or more (the reference loop's)

    def _overload(self, changed: Mapping[str, None]) -> float:
        """Overloaded links right now, each weighted by the share of its users' unified circle during which it is overloaded.

        Incremental: only the links of the jobs that started or stopped since
        the last call (``changed``) are re-evaluated. A link whose users'
        demands sum to at most its capacity is never overloaded and costs
        nothing. The per-link work (users joining and leaving in order, their
        summed demand, the links to look at) is the link table's, in C when
        ``csrc/`` is built; what is left here is per job and per link near or
        above its limit.
        """
        current = {}
        for n in changed:
            r = self.running.get(n)
            if r is not None and r.profile is not None and r.profile.comm_s > 0:
                current[n] = (r.profile, r.ready)
        table, ov_jobs, keys = self._ov_table, self._ov_jobs, self._ov_keys
        for name in [n for n in changed if n in ov_jobs]:
            prof, ready, slot, handle = ov_jobs[name]
            now = current.get(name)
            if now is not None and now[0] is prof and now[1] == ready:
                continue
            del ov_jobs[name]
            table.leave(handle)
            self._ov_free.append(slot)
        link_id = self._ov_link_id
        for name, (prof, ready) in current.items():
            if name in ov_jobs:
                continue
            if self._ov_free:
                slot = self._ov_free.pop()
                keys[slot] = _overload_keys(prof, ready)
            else:
                slot = len(keys)
                keys.append(_overload_keys(prof, ready))
            rates = prof.link_rates
            handle = table.join(slot, prof.period_s, prof.compute_s, ready, map(link_id.__getitem__, rates), rates.values(), len(rates))
            ov_jobs[name] = (prof, ready, slot, handle)
        # the links to re-evaluate, in the order first touched (it decides which entries the overload cache holds when it is
        # emptied, hence which rounded key answers later: a fixed order, never one of string hashes)
        for link in table.collect(self._ov_every_shared):
            slots, rates = table.users(link)
            table.settle(link, self._link_overload(link, slots, rates) if self._over_capacity(link, rates) else 0)
        return table.total() / DEFAULT_BUCKETS

    def _over_capacity(self, link: int, rates: list[float]) -> bool:
        """Whether the users' demands ``rates`` on ``link`` sum above its limit: the running sum decides unless it is within 1e-6
        of the limit (its rounding drifts by far less); there the demands are summed afresh, so the answer is a fresh sum's."""
        load, limit = self._ov_table.load(link), self._ov_limit[link]
        if abs(load - limit) <= 1e-6 * limit:
            load = sum(rates)
            self._ov_table.set_load(link, load)
        return load > limit

    def _link_overload(self, link: int, slots: list[int], rates: list[float]) -> int:
        """The arcs of the users' unified circle (of DEFAULT_BUCKETS) during which their demands on ``link`` overload it."""
        keys = self._ov_keys
        key = (tuple(sorted([keys[s][r] for s, r in zip(slots, rates, strict=True)])), self._ov_cap_key[link])  # the users' rounded circles
        hit = self._overload_cache.get(key)
        if hit is None:
            hit = self._ov_table.arcs(link)
            if len(self._overload_cache) > self.overload_cache_limit:
                self._overload_cache.clear()
            self._overload_cache[key] = hit
        return hit

    # -- the event loop -------------------------------------------------------------------------------
    def _advance(self, t: float) -> None:
        """Move the clock to ``t``: the time integrals; running jobs progress lazily (see _settle)."""
        dt = t - self.now
        if dt > 0:
            busy = len(self.gpus) - self.n_idle
            self.stats["frag_integral"] += self.fragmentation() * dt
            self.stats["busy_integral"] += busy * dt
            self.stats["overload_link_s"] += self._overload_rate * dt
            if self.queue:
                self.stats["frag_wait_integral"] += self.fragmentation() * dt
                self.stats["wait_time"] += dt
        self.now = t

    def _next_finish(self) -> float:
        heap, jobs = self._finish_heap, self.jobs
        if len(heap) > 4 * len(self.running) + 1024:  # mostly void entries (rates change often): dropped at once, not popped one
            # by one; the valid entries and so their order are the same
            heap[:] = [e for e in heap if (r := jobs[e[2]]).running and r.version == e[1]]
            heapq.heapify(heap)
        while heap:
            _, version, name = heap[0]
            r = jobs[name]
            if r.running and r.version == version:
                return max(heap[0][0], self.now)
            heapq.heappop(heap)
        return math.inf

    def _finishing(self) -> list[str]:
        """The running jobs done by now, in the order they run.

        A job is done when at most ``1e-9 * iterations`` iterations are left,
        i.e. its finish time is at most ``1e-9 * iterations * iter_time`` away:
        the heap entries within the largest such slack are checked.
        """
        heap, out, later = self._finish_heap, [], []
        while heap and heap[0][0] <= self.now + self._slack:
            entry = heapq.heappop(heap)
            r = self.jobs[entry[2]]
            if not r.running or r.version != entry[1]:
                continue
            if self.remaining(r) <= 1e-9 * max(1.0, r.spec.iterations):
                out.append(r)
            else:
                later.append(entry)
        for entry in later:
            heapq.heappush(heap, entry)
        return [r.trace.name for r in sorted(out, key=lambda r: r.started)]

    def run(self) -> ReplayResult:
        """Replay the trace to its end (see the module docstring).

        Python's cyclic garbage collector is paused while it runs (and resumed after, if it was on): the loop makes
        millions of short-lived objects, freed by reference counting, and the collector would keep rescanning the
        long-lived caches beside them (about a tenth of a 25,000-job FIFO replay's time and more as the caches grow);
        the loop's own objects form almost no cycles (a 10,000-job replay leaves about 3,000 objects for the next
        collection).
        """
        collecting = gc.isenabled()
        gc.disable()
        try:
            return self._run()
        finally:
            if collecting:
                gc.enable()

    def _run(self) -> ReplayResult:
        wall = time.perf_counter()
        i = 0
        while i < len(self.arrivals) or self.queue or self.running:
            t_arr = self.arrivals[i].arrival_s if i < len(self.arrivals) else math.inf
            t_fin = self._next_finish()
            t_next = min(t_arr, t_fin)
            if not math.isfinite(t_next):
                for n in self.queue:  # nothing runs and nothing arrives: these can never be placed
                    self.jobs[n].reason = self.jobs[n].reason or "never fits"
                break
            self._advance(max(t_next, self.now))
            self.stats["events"] += 1
            changed = False
            for name in self._finishing():
                r = self.running[name]
                r.finish = self.now
                self._stop(r)
                if self.policy == "las":
                    self._las_remove(r)
                changed = True
            while i < len(self.arrivals) and self.arrivals[i].arrival_s <= self.now:
                r = self.jobs[self.arrivals[i].name]
                i += 1
                never = self.sched.never_fits(r.spec.gpus, self._queue_of(r)) if self.sched is not None else None
                if never is not None:  # refused on arrival with the reason: it would block its queue forever
                    r.reason = never["message"]
                    continue
                self.queue.append(r.trace.name)
                if self.policy == "las":
                    self._las_add(r)
                changed = True
            if changed:
                self._schedule()
                self._recompute()
        self.stats["span"] = self.now
        return self._result(time.perf_counter() - wall)

    def _result(self, wall: float) -> ReplayResult:
        rows = []
        for name, r in self.jobs.items():
            jct = None if r.finish is None else r.finish - r.trace.arrival_s
            queued = None if r.first_start is None else r.first_start - r.trace.arrival_s
            rows.append({"name": name, "gpus": r.spec.gpus, "arrival_s": r.trace.arrival_s, "start_s": r.first_start, "finish_s": r.finish,
                         "jct_s": jct, "queue_s": queued, "shift_s": r.shift, "hosts": len({self.host_of[g] for g in r.gpus}),
                         "reason": r.reason if r.finish is None else None})
        jcts = np.array([x["jct_s"] for x in rows if x["jct_s"] is not None])
        queue = np.array([x["queue_s"] for x in rows if x["queue_s"] is not None])
        span = max(self.stats["span"], 1e-12)
        metrics = {
            "jobs": len(rows), "finished": int(len(jcts)), "unfinished": len(rows) - int(len(jcts)),
            "avg_jct_s": float(jcts.mean()) if len(jcts) else None,
            "p99_jct_s": float(np.percentile(jcts, 99)) if len(jcts) else None,
            "avg_queue_s": float(queue.mean()) if len(queue) else None,
            "p99_queue_s": float(np.percentile(queue, 99)) if len(queue) else None,
            "makespan_s": self.stats["span"],
            "fragmentation": self.stats["frag_integral"] / span,
            "fragmentation_while_waiting": self.stats["frag_wait_integral"] / self.stats["wait_time"] if self.stats["wait_time"] else 0.0,
            "gpu_utilisation": self.stats["busy_integral"] / (span * len(self.gpus)),
            "overloaded_link_s": self.stats["overload_link_s"],
            "preemptions": self.stats["preemptions"], "events": self.stats["events"], "wall_s": wall,
            "profile_cache": {"hits": self.profiles.hits, "misses": self.profiles.misses},
        }
        if isinstance(self.slowdown, FluidSlowdown):
            metrics["slowdown_cache"] = {"calls": self.slowdown.calls, "hits": self.slowdown.hits, "simulations": self.slowdown.simulations}
        return ReplayResult(self.policy, rows, metrics)


REPLAY_ABI = 2  # the nw_replay_version() this module speaks
_replay_lib: dict[str, Any] = {}


def _replay_library() -> Any:
    """``csrc/replay.c``'s library (``$NETWEAVE_REPLAY_LIB`` or ``csrc/build/``), or None when it is not built; loaded once."""
    if "lib" not in _replay_lib:
        lib, why = load_library(library_path("libnetweave-replay.so", "NETWEAVE_REPLAY_LIB"), "nw_replay_version", REPLAY_ABI)
        if lib is not None:  # arrays by address (C-contiguous numpy arrays of the C types)
            ptr, i32, i64, f64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_double
            for name, restype, argtypes in [
                    ("nw_las_walk", ctypes.c_int, [ctypes.c_int, ptr, ptr, ctypes.c_int64, ptr]),
                    ("nw_ov_new", ptr, [i32, ptr]), ("nw_ov_free", None, [ptr]),
                    ("nw_ov_join", ctypes.c_int, [ptr, i32, f64, f64, f64, i32, ptr, ptr, ptr]),
                    ("nw_ov_leave", ctypes.c_int, [ptr, i32, ptr]), ("nw_ov_collect", i32, [ptr, ctypes.c_int, ptr]),
                    ("nw_ov_users", i32, [ptr, i32, i32, ptr, ptr]), ("nw_ov_load", f64, [ptr, i32]),
                    ("nw_ov_set_load", ctypes.c_int, [ptr, i32, f64]), ("nw_ov_settle", ctypes.c_int, [ptr, i32, i64]),
                    ("nw_ov_total", i64, [ptr]), ("nw_ov_arcs", i64, [ptr, i32, i32]),
                    ("nw_overload_arcs", i64, [i32, ptr, ptr, ptr, ptr, f64, i32, ptr])]:
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = restype, argtypes
        _replay_lib["lib"], _replay_lib["why"] = lib, why
    return _replay_lib["lib"]


class _LinkTable:
    """The overloaded-link metric's per-link state (:meth:`Replay._overload`), in Python: the twin of ``csrc/replay.c``'s
    table (:class:`_CLinkTable`, tested equal), used when the library is not built.

    Links are numbers (``0..len(limit)-1``); a link is overloaded above ``limit[link]``. Per link: its users (slots) in
    the order they joined with their demands, the demands summed as they come and go (a link left without users is
    forgotten at the next :meth:`collect`, so its next user starts a fresh sum), and its overloaded arcs; their total.

    >>> t = _LinkTable([10.0, 10.0])
    >>> h = t.join(0, 1.0, 0.5, 0.0, iter([0, 1]), [6.0, 6.0], 2)
    >>> _ = t.join(1, 1.0, 0.5, 0.25, iter([0]), [6.0], 1)
    >>> t.collect(False), t.users(0), t.load(0)     # link 0: two users above the limit; link 1: one user
    ([0], ([0, 1], [6.0, 6.0]), 12.0)
    >>> t.arcs(0), t.settle(0, t.arcs(0)), t.total()   # they communicate together a quarter of the circle
    (90, None, 90)
    """

    def __init__(self, limit: Sequence[float]):
        self.limit = list(limit)
        self._users: dict[int, dict[int, float]] = {}
        self._load: dict[int, float] = {}
        self._arcs: dict[int, int] = {}
        self._total = 0
        self._jobs: dict[int, tuple[float, float, float]] = {}  # per slot: period, compute time, start of its first iteration
        self._touched: dict[int, None] = {}

    def join(self, slot: int, period_s: float, compute_s: float, ready: float, links: Iterable[int], rates: Iterable[float],
             n: int) -> tuple[int, list[int], list[float]]:
        """User ``slot`` joins ``links`` with demands ``rates`` (``n`` of each); returns its handle for :meth:`leave`."""
        self._jobs[slot] = (period_s, compute_s, ready)
        links, rates = list(links), list(rates)
        users, load, touched = self._users, self._load, self._touched
        for link, rate in zip(links, rates, strict=True):
            us = users.get(link)
            if us is None:
                users[link] = {slot: rate}
                load[link] = rate
            else:
                us[slot] = rate
                load[link] += rate
            touched[link] = None
        return slot, links, rates

    def leave(self, handle: tuple[int, list[int], list[float]]) -> None:
        slot, links, rates = handle
        users, load, touched = self._users, self._load, self._touched
        for link, rate in zip(links, rates, strict=True):
            del users[link][slot]
            load[link] -= rate
            touched[link] = None

    def collect(self, every_shared: bool) -> list[int]:
        """The links touched since the last call, in the order first touched, with two users or more and a summed demand
        above or within 1e-6 of the limit (every one with two users or more when ``every_shared``): the caller settles
        them. The others get no arcs."""
        out = []
        for link in self._touched:
            us = self._users.get(link)
            if not us:
                self._users.pop(link, None)
                self._load.pop(link, None)
            elif len(us) > 1:
                load, limit = self._load[link], self.limit[link]
                if every_shared or abs(load - limit) <= 1e-6 * limit or load > limit:
                    out.append(link)
                    continue
            self._total -= self._arcs.pop(link, 0)
        self._touched = {}
        return out

    def users(self, link: int) -> tuple[list[int], list[float]]:
        """``link``'s users (slots) in the order they joined, and their demands."""
        us = self._users[link]
        return list(us), list(us.values())

    def load(self, link: int) -> float:
        return self._load[link]

    def set_load(self, link: int, load: float) -> None:
        self._load[link] = load

    def settle(self, link: int, arcs: int) -> None:
        self._total += arcs - self._arcs.pop(link, 0)
        if arcs:
            self._arcs[link] = arcs

    def total(self) -> int:
        """The overloaded arcs of all links."""
        return self._total

    def arcs(self, link: int) -> int:
        """The arcs of ``link``'s users' unified circle in which their summed demand (:func:`~placement.cassini.demand_sum`,
        in the order they joined) exceeds its limit."""
        us = self._users[link]
        period, compute, ready = zip(*(self._jobs[s] for s in us), strict=True)
        load = demand_sum(period, compute, ready, list(us.values()), unified_perimeter(period))
        return int(np.count_nonzero(load > self.limit[link]))


class _CLinkTable:
    """:class:`_LinkTable` in C (``csrc/replay.c``'s ``nw_ov_*``): the same methods and the same floats.

    Its buffers are kept with their addresses (numpy's ``.ctypes.data`` costs microseconds, as much as a call).
    """

    def __init__(self, lib: Any, limit: Sequence[float]):
        limits = np.ascontiguousarray(limit, dtype=np.float64)
        self._lib = lib
        self._table = lib.nw_ov_new(len(limits), limits.ctypes.data)
        if not self._table:
            raise MemoryError(f"nw_ov_new failed for {len(limits)} links")
        weakref.finalize(self, lib.nw_ov_free, self._table)
        self._out = np.empty(max(1, len(limits)), dtype=np.int32)
        self._out_at = self._out.ctypes.data
        self._grow(64)

    def _grow(self, room: int) -> None:
        """Buffers for ``room`` links of a job or users of a link."""
        self._room = room
        self._ints, self._floats = np.empty(room, dtype=np.int32), np.empty(room, dtype=np.float64)
        self._ints_at, self._floats_at = self._ints.ctypes.data, self._floats.ctypes.data

    def join(self, slot: int, period_s: float, compute_s: float, ready: float, links: Iterable[int], rates: Iterable[float],
             n: int) -> tuple[array, int]:
        # array.array: a buffer and its address for a few hundred values cost far less than numpy's (fromiter, .ctypes.data)
        ints, floats = array("i", links), array("d", rates)
        if len(ints) != n or len(floats) != n:
            raise ValueError(f"a join of {n} links was given {len(ints)} links and {len(floats)} rates")
        handles = array("i", bytes(4 * n))
        at = handles.buffer_info()[0]
        code = self._lib.nw_ov_join(self._table, slot, period_s, compute_s, ready, n, ints.buffer_info()[0], floats.buffer_info()[0], at)
        if code:
            raise MemoryError(f"nw_ov_join failed with code {code}") if code == -2 else RuntimeError(f"nw_ov_join: invalid arguments ({code})")
        return handles, at

    def leave(self, handle: tuple[array, int]) -> None:
        handles, at = handle
        if self._lib.nw_ov_leave(self._table, len(handles), at):
            raise RuntimeError("nw_ov_leave: a handle out of range, free or given twice")

    def collect(self, every_shared: bool) -> list[int]:
        return self._out[: self._lib.nw_ov_collect(self._table, every_shared, self._out_at)].tolist()

    def users(self, link: int) -> tuple[list[int], list[float]]:
        n = self._lib.nw_ov_users(self._table, link, self._room, self._ints_at, self._floats_at)
        if n > self._room:
            self._grow(2 * n)
            n = self._lib.nw_ov_users(self._table, link, self._room, self._ints_at, self._floats_at)
        return self._ints[:n].tolist(), self._floats[:n].tolist()

    def load(self, link: int) -> float:
        return self._lib.nw_ov_load(self._table, link)

    def set_load(self, link: int, load: float) -> None:
        self._lib.nw_ov_set_load(self._table, link, load)

    def settle(self, link: int, arcs: int) -> None:
        self._lib.nw_ov_settle(self._table, link, arcs)

    def total(self) -> int:
        return self._lib.nw_ov_total(self._table)

    def arcs(self, link: int) -> int:
        arcs = self._lib.nw_ov_arcs(self._table, link, DEFAULT_BUCKETS)
        if arcs < 0:
            raise MemoryError("nw_ov_arcs: out of memory") if arcs == -2 else RuntimeError(f"nw_ov_arcs: invalid arguments ({arcs})")
        return arcs


def _las_walk(size: np.ndarray, flag: np.ndarray, n: int, budget: int) -> list[int]:
    """``nw_las_walk`` in Python: keep each of the first ``n`` jobs whose ``size`` fits in what those before left; set
    ``flag`` to whether it is kept and return the positions whose flag changed, ascending."""
    changed = []
    for i, (g, on) in enumerate(zip(size[:n].tolist(), flag[:n].tolist(), strict=True)):
        keep = g <= budget
        if keep:
            budget -= g
        if keep != on:
            flag[i] = keep
            changed.append(i)
    return changed


def _overload_keys(p: CommProfile, ready: float) -> dict[float, tuple[float, float, float, float]]:
    """A user's parts of its links' overload-cache keys, per demand: its timings, its phase on its circle and its demand on
    the link, rounded (computed once per start: a job's links share the first three, and many share the demand)."""
    base = (round(p.compute_s, 9), round(p.comm_s, 9), round(ready % p.period_s, 4))
    return {rate: (*base, round(rate, 6)) for rate in set(p.link_rates.values())}


def replay(topo: Topology, trace: Sequence[TraceJob], policy: str = "hived", **options: Any) -> ReplayResult:
    """Replay ``trace`` on ``topo`` with ``policy``; ``options`` go to :class:`Replay`."""
    return Replay(topo, trace, policy, **options).run()

