"""Collectives as data (steps of point-to-point flows) and their alpha-beta cost on a topology.

A collective is planned as a list of sequential *steps*; each step is a list of
concurrent :class:`P2PFlow` transfers. Its cost is the sum over steps of

* **beta**: route the step's flows with :func:`topology.routing.route_flows`
  and take the most loaded link's ``load / bw`` -- so contention, NVSwitch
  striping, rails and spines are modelled by the same routing the simulator uses;
* **alpha**: the latency of the step's longest chain of dependent transfers
  (one transfer for ring steps; the tree's depth up and down for the pipelined
  tree; the whole chain for a pipelined broadcast), each transfer costing the
  sum of its links' ``latency_us``, plus an optional per-step overhead.

``nbytes`` means what nccl-tests calls S: the all-reduce and broadcast buffer,
the *total* gathered/scattered array for all-gather and reduce-scatter
(each rank owns S/n), each rank's whole send buffer for all-to-all (S/n to each
peer), and the message each rank sends for send/recv. ``algbw = S / time``
and ``busbw = algbw * factor`` with nccl-tests' factors: 2(n-1)/n for
all-reduce, (n-1)/n for all-gather, reduce-scatter and all-to-all, 1 for
broadcast and send/recv (:func:`bus_factor`).

Algorithms
----------
``ring`` (every op but all-to-all's default)
    NCCL-like ring order: GPUs grouped by island (server or NVLink domain) in
    order of first appearance, inside an island by the rail of their nearest
    NIC, then index -- host-major, so each ring crosses every host boundary
    once. With several islands the data is split over ``C`` channels, ``C`` =
    the smallest number of ring GPUs on an island (8 on full DGX nodes). In
    channel ``c`` every island's chain is rotated to start at its ``c``-th GPU
    and the ring leaves island ``h`` from the chain's last GPU to the first GPU
    of island ``h+1``; with the ``"rail"`` policy that hop moves over NVLink to
    the GPU on the receiver's rail and uses that rail's NIC, so channel ``c``
    uses rail ``c`` of every host in both directions (NCCL's rings on
    rail-optimised clusters use one NIC per channel the same way). On one
    island a single channel is used: NVSwitch striping already spreads it.
``tree`` (all-reduce)
    NCCL's double binary tree over the islands (tree 0: the binary tree in
    which rank r's parent is found from its lowest set bit; tree 1: its mirror
    for an even number of islands, its shift by one for an odd number), and a
    chain inside each island from the head GPU (the one on the channel's rail).
    Each channel carries S/C, half of it on each tree. Reduce (up) and
    broadcast (down) are pipelined, so all tree and chain edges carry their
    data concurrently in one step; alpha is the depth up and down.
``hierarchical`` (all-reduce)
    Intra-island ring reduce-scatter, then for every local rank a ring
    all-reduce of its 1/k shard across islands (local rank i is on rail i),
    then intra-island ring all-gather; the phases run one after the other.
    Needs the same number of GPUs on every island.
``direct`` (all-to-all default)
    Every rank sends S/n to every other rank at once (NCCL's grouped send/recv).
``ring`` for all-to-all
    n-1 shift steps: in step k rank i sends S/n to rank i+k.
``ring`` for send/recv
    nccl-tests' pattern: rank i sends S to rank i+1 (in the given order).

Identical consecutive steps (the 2(n-1) steps of a ring) are the *same list
object*: do not mutate the steps you get back.

>>> from topology import build_node
>>> t = build_node("dgx-h100")
>>> c = collective_time(t, "all_reduce", t.gpus(), 2**30)
>>> round(c.busbw_beta, 6), c.bottleneck_link[0]
(450.0, 'node0/gpu0')
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from itertools import repeat
from typing import Any, NamedTuple

import numpy as np

from .errors import InputError
from .model import Topology
from .paths import _link_attrs, view
from .routing import (
    _CACHE_LIMIT,
    POLICIES,
    Edge,
    _group_links,
    _link_ids,
    _nearest,
    _network_mask,
    _pair_terms,
    _pairs,
    _route,
    _route_loads,
    _sum_loads,
)


class P2PFlow(NamedTuple):
    """One point-to-point transfer of ``nbytes`` bytes (a ``(src, dst, volume)`` triple for ``route_flows``)."""

    src: str
    dst: str
    nbytes: float


OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send_recv")
ALGORITHMS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("ring", "tree", "hierarchical"),
    "reduce_scatter": ("ring",),
    "all_gather": ("ring",),
    "all_to_all": ("direct", "ring"),
    "broadcast": ("ring",),
    "send_recv": ("ring",),
}
DEFAULT_ALGORITHM = {op: algs[0] for op, algs in ALGORITHMS.items()}


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw factor for ``n`` ranks.

    >>> bus_factor("all_reduce", 8), bus_factor("all_gather", 8), bus_factor("broadcast", 8)
    (1.75, 0.875, 1.0)
    """
    _check_op(op)
    if n < 1:
        raise InputError(f"need at least one rank, got {n}")
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    return 1.0


def ideal_time(op: str, n: int, nbytes: float, bw: float) -> float:
    """The bus-bandwidth bound: ``bus_factor * nbytes / bw`` seconds, ``bw`` in GB/s per rank.

    >>> ideal_time("all_reduce", 4, 1e9, 100.0)
    0.015
    """
    return bus_factor(op, n) * nbytes / (bw * 1e9)


def _check_op(op: str) -> None:
    if op not in ALGORITHMS:
        raise InputError(f"unknown collective {op!r}; expected one of {', '.join(OPS)}")


# --------------------------------------------------------------------------------------------
# Planning
# --------------------------------------------------------------------------------------------


@dataclass
class CollectiveSchedule:
    """A planned collective: ``steps`` run one after another; ``chains`` maps a step's ``id`` to its latency chains."""

    op: str
    algorithm: str
    gpus: list[str]
    nbytes: float
    channels: int
    steps: list[list[P2PFlow]]
    chains: dict[int, list[list[tuple[str, str]]]] = field(default_factory=dict)


def _islands_order(topo: Topology, gpus: Sequence[str]) -> list[list[str]]:
    """GPUs grouped by island in order of first appearance; inside, by (rail of nearest NIC, index, id)."""
    vw = view(topo)
    keys = vw.cache.setdefault("ring_keys", {})  # GPU -> (its island, its place in the island's order): fixed per view
    groups: dict[int, list[str]] = {}
    for g in gpus:
        k = keys.get(g)
        if k is None:
            a = vw.idx(g)
            p = _nearest(vw, a)
            rail = vw.rail_attr(p) if p is not None else None
            idx = vw.index_attr(a)
            k = keys[g] = (vw.island[a], (rail is None, rail if isinstance(rail, int) else 0, idx if isinstance(idx, int) else 0, g))
        groups.setdefault(k[0], []).append(g)
    return [sorted(members, key=lambda g: keys[g][1]) for members in groups.values()]


def _rings(islands: list[list[str]]) -> list[list[str]]:
    """One ring per channel (see the module docstring)."""
    if len(islands) == 1:
        return [list(islands[0])]
    channels = min(len(m) for m in islands)
    rings = []
    for c in range(channels):
        ring: list[str] = []
        for members in islands:
            r = c % len(members)
            ring.extend(members[r:] + members[:r])
        rings.append(ring)
    return rings


def _ring_step(rings: list[list[str]], size: float) -> list[P2PFlow]:
    """Each ring's flows, rank ``i`` to ``i + 1`` (the last to the first), rings in order.

    >>> _ring_step([["a", "b", "c"], ["d"]], 2.0)
    [P2PFlow(src='a', dst='b', nbytes=2.0), P2PFlow(src='b', dst='c', nbytes=2.0), P2PFlow(src='c', dst='a', nbytes=2.0)]
    """
    make = partial(tuple.__new__, P2PFlow)  # over zip: a 64-GPU, 8-channel ring's 512 flows without a Python call each
    return [flow for r in rings if len(r) > 1 for flow in map(make, zip(r, r[1:] + r[:1], repeat(size)))]


def _btree_parents(m: int) -> list[int]:
    """Parent of every rank in NCCL's binary tree over ranks 0..m-1 (root 0 has parent -1).

    Rank r > 0 with lowest set bit b has parent (r ^ b) | (b << 1) when that is
    a rank, else r ^ b; this builds a balanced tree on powers of two.
    """
    parents = [-1] * m
    for r in range(1, m):
        b = r & -r
        up = (r ^ b) | (b << 1)
        parents[r] = up if up < m else r ^ b
    return parents


def double_binary_tree(m: int) -> tuple[list[int], list[int]]:
    """Parents in NCCL's two complementary trees over ``m`` ranks (-1 marks a root).

    Tree 1 mirrors tree 0 (rank r -> m-1-r) when ``m`` is even and shifts it by
    one rank when ``m`` is odd, so that most ranks that are leaves in one tree
    are inner nodes in the other.

    >>> double_binary_tree(4)
    ([-1, 2, 0, 2], [1, 3, 1, -1])
    """
    t0 = _btree_parents(m)
    t1 = [-1] * m
    for r in range(m):
        if m % 2 == 0:
            p = t0[m - 1 - r]
            t1[r] = -1 if p == -1 else m - 1 - p
        else:
            p = t0[(r - 1) % m]
            t1[r] = -1 if p == -1 else (p + 1) % m
    return t0, t1


def _check_gpus(topo: Topology, gpus: Sequence[str | int]) -> list[str]:
    known = view(topo).cache.get("gpu_ids")
    if known is None:
        known = view(topo).cache["gpu_ids"] = frozenset(topo.gpus())
    out = list(gpus) if known.issuperset(gpus) else [topo.resolve_gpu(g) for g in gpus]  # GPU ids resolve to themselves
    if len(set(out)) != len(out):
        dup = next(g for g in out if out.count(g) > 1)
        raise InputError(f"GPU {dup!r} appears twice in the collective's group")
    if not out:
        raise InputError("a collective needs at least one GPU")
    return out


def plan_collective(
    topo: Topology, op: str, gpus: Sequence[str | int], nbytes: float, algorithm: str | None = None
) -> CollectiveSchedule:
    """The :class:`CollectiveSchedule` behind :func:`collective_flows` (steps plus latency chains)."""
    _check_op(op)
    algorithm = algorithm or DEFAULT_ALGORITHM[op]
    if algorithm not in ALGORITHMS[op]:
        raise InputError(f"{op}: unknown algorithm {algorithm!r}; expected one of {', '.join(ALGORITHMS[op])}")
    if not nbytes >= 0:
        raise InputError(f"nbytes must be >= 0, got {nbytes!r}")
    gpus = _check_gpus(topo, gpus)
    n = len(gpus)
    S = float(nbytes)
    if n == 1:
        return CollectiveSchedule(op, algorithm, gpus, S, 1, [])
    if op in ("all_to_all", "send_recv"):
        order = list(gpus)
        if op == "send_recv":
            return CollectiveSchedule(op, algorithm, order, S, 1, [[P2PFlow(order[i], order[(i + 1) % n], S) for i in range(n)]])
        if algorithm == "direct":
            return CollectiveSchedule(op, algorithm, order, S, 1, [[P2PFlow(a, b, S / n) for a in order for b in order if a != b]])
        steps = [[P2PFlow(order[i], order[(i + k) % n], S / n) for i in range(n)] for k in range(1, n)]
        return CollectiveSchedule(op, algorithm, order, S, 1, steps)
    islands = _islands_order(topo, gpus)
    order = [g for members in islands for g in members]
    if algorithm == "ring":
        rings = _rings(islands)
        C = len(rings)
        if op == "broadcast":
            root = gpus[0]
            flows, chains = [], []
            for r in rings:
                i0 = r.index(root)
                chain = r[i0:] + r[:i0]
                hops = [(chain[i], chain[i + 1]) for i in range(n - 1)]
                flows += [P2PFlow(a, b, S / C) for a, b in hops]
                chains.append(hops)
            return CollectiveSchedule(op, algorithm, order, S, C, [flows], {id(flows): chains})
        step = _ring_step(rings, S / (n * C))
        count = 2 * (n - 1) if op == "all_reduce" else n - 1
        return CollectiveSchedule(op, algorithm, order, S, C, [step] * count)
    if algorithm == "tree":
        return _plan_tree(op, order, islands, S)
    return _plan_hierarchical(op, order, islands, S)


def _plan_tree(op: str, order: list[str], islands: list[list[str]], S: float) -> CollectiveSchedule:
    m = len(islands)
    C = 1 if m == 1 else min(len(x) for x in islands)
    trees = double_binary_tree(m)
    D = S / (2 * C)
    flows: list[P2PFlow] = []
    chains: list[list[tuple[str, str]]] = []
    for c in range(C):
        chains_c = []
        for members in islands:
            r = c % len(members)
            chains_c.append(members[r:] + members[:r])
        for parents in trees:
            up_edges: dict[str, str] = {}  # child -> parent over every GPU of the channel
            for chain in chains_c:
                for i in range(1, len(chain)):
                    up_edges[chain[i]] = chain[i - 1]
            for h, p in enumerate(parents):
                if p >= 0:
                    up_edges[chains_c[h][0]] = chains_c[p][0]
            for child, parent in up_edges.items():
                flows.append(P2PFlow(child, parent, D))
                flows.append(P2PFlow(parent, child, D))
            # latency chains: every leaf-to-root path up, then back down
            for leaf in up_edges.keys() - set(up_edges.values()):
                path = [leaf]
                while path[-1] in up_edges:
                    path.append(up_edges[path[-1]])
                ups = list(zip(path, path[1:], strict=False))
                chains.append(ups + [(b, a) for a, b in reversed(ups)])
    return CollectiveSchedule(op, "tree", order, S, C, [flows], {id(flows): chains})


def _plan_hierarchical(op: str, order: list[str], islands: list[list[str]], S: float) -> CollectiveSchedule:
    k = len(islands[0])
    if any(len(x) != k for x in islands):
        sizes = sorted({len(x) for x in islands})
        raise InputError(f"hierarchical all-reduce needs the same number of GPUs on every host; the group has {sizes}")
    m = len(islands)
    steps: list[list[P2PFlow]] = []
    if k > 1:
        intra = _ring_step(islands, S / k)
        steps += [intra] * (k - 1)
    if m > 1:
        cross = _ring_step([[isl[i] for isl in islands] for i in range(k)], S / (k * m))
        steps += [cross] * (2 * (m - 1))
    if k > 1:
        steps += [intra] * (k - 1)
    return CollectiveSchedule(op, "hierarchical", order, S, k, steps)


def collective_flows(
    topo: Topology, op: str, gpus: Sequence[str | int], nbytes: float, algorithm: str | None = None
) -> list[list[P2PFlow]]:
    """The collective as sequential steps of concurrent point-to-point flows (see the module docstring).

    ``algorithm`` defaults to ``"ring"`` (``"direct"`` for all-to-all).

    >>> from topology import build_node
    >>> t = build_node("dgx-h100")
    >>> steps = collective_flows(t, "all_reduce", t.gpus()[:4], 4e6)
    >>> len(steps), steps[0][0]
    (6, P2PFlow(src='node0/gpu0', dst='node0/gpu1', nbytes=1000000.0))
    """
    return plan_collective(topo, op, gpus, nbytes, algorithm).steps


# --------------------------------------------------------------------------------------------
# Cost
# --------------------------------------------------------------------------------------------


@dataclass
class CollectiveCost:
    """Time and bandwidth of one collective; bandwidths in GB/s (1e9 B/s) as nccl-tests reports them.

    ``busbw_beta`` is the bus bandwidth without the latency term (the large-message
    limit); ``bottleneck_link`` is the link that sets the beta time of the most
    expensive step, with its ``bw`` and its load in that step (bytes).
    """

    op: str
    algorithm: str
    policy: str
    ranks: int
    nbytes: float
    time_s: float
    alpha_s: float
    beta_s: float
    algbw: float
    busbw: float
    busbw_beta: float
    bottleneck_link: Edge | None
    bottleneck_bw: float
    bottleneck_load: float
    steps: int
    channels: int

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["bottleneck_link"] = list(self.bottleneck_link) if self.bottleneck_link else None
        for k, v in d.items():
            if isinstance(v, float) and not math.isfinite(v):
                d[k] = None
        return d


def _route_latency_us(vw, s: int, t: int, policy: str) -> float:
    cache = vw.cache.setdefault("route_latency", {})
    key = (s, t, policy)
    if key not in cache:
        G_lat = vw.cache.get("edge_latency")
        if G_lat is None:
            G_lat = vw.cache["edge_latency"] = {}
            for lst in vw.adj:
                for e in lst:
                    for u, v, k, _ in e.phys:
                        G_lat[(u, v, k)] = e.latency_us
        total = 0.0
        for stage in _route(vw, s, t, policy):
            total += max((sum(G_lat[e] for e in edges) for _, edges in stage), default=0.0)
        cache[key] = total
    return cache[key]


def _step_cost(topo: Topology, vw, step: list[P2PFlow], chains, policy: str, overhead_us: float,
               link_loads: tuple[np.ndarray, np.ndarray] | None = None, flow_pairs: list[tuple[int, int, float]] | None = None
               ) -> tuple[float, float, Edge | None, float, float]:
    # beta: the most loaded link's load / bw, the first such link in route_flows' order (as arrays: same floats);
    # ``link_loads``: the step's (link numbers, loads) as routing._route_loads gives them, when the caller has them;
    # ``flow_pairs``: the step's flows as view positions, one per flow (routing._pairs when it merged and dropped none)
    links, loads = _route_loads(topo, step, policy) if link_loads is None else link_loads
    beta, worst, worst_bw, worst_load = 0.0, None, math.inf, 0.0
    if len(links):
        _, edges, bws = _link_ids(vw, topo)
        times = loads / (bws[links] * 1e9)
        i = int(np.argmax(times))
        if times[i] > 0:
            worst = edges[links[i]]
            beta, worst_bw, worst_load = float(times[i]), _link_attrs(vw, topo)[worst]["bw"], float(loads[i])
    alpha_us = 0.0
    if chains is None and flow_pairs is not None:  # every flow is its own chain: the step's alpha is its slowest route
        route_latency = vw.cache.setdefault("route_latency", {})
        for a, b, _ in flow_pairs:
            lat = route_latency.get((a, b, policy))
            if lat is None:
                lat = _route_latency_us(vw, a, b, policy)
            if lat > alpha_us:
                alpha_us = lat
    elif chains is None:
        pair_latency = vw.cache.setdefault("pair_latency", {})
        if len(pair_latency) > _CACHE_LIMIT:
            pair_latency.clear()
        for f in step:
            lat = pair_latency.get((f.src, f.dst, policy))
            if lat is None:
                lat = pair_latency[(f.src, f.dst, policy)] = _route_latency_us(vw, vw.idx(f.src), vw.idx(f.dst), policy)
            alpha_us = max(alpha_us, lat)
    for chain in chains or ():
        lat = sum(_route_latency_us(vw, vw.idx(a), vw.idx(b), policy) for a, b in chain)
        alpha_us = max(alpha_us, lat)
    return beta, (alpha_us + overhead_us) * 1e-6, worst, worst_bw, worst_load


def _check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise InputError(f"unknown routing policy {policy!r}; expected one of {', '.join(POLICIES)}")


def schedule_time(topo: Topology, schedule: CollectiveSchedule, policy: str = "rail", step_overhead_us: float = 0.0) -> CollectiveCost:
    """Alpha-beta cost of a planned collective (see :func:`collective_time`)."""
    _check_policy(policy)
    vw = view(topo)
    per_step: dict[int, tuple] = {}
    for step in schedule.steps:
        key = id(step)
        if key not in per_step:
            per_step[key] = _step_cost(topo, vw, step, schedule.chains.get(key), policy, step_overhead_us)
    return _schedule_cost(schedule, policy, per_step)


def _schedule_cost(schedule: CollectiveSchedule, policy: str, per_step: dict[int, tuple]) -> CollectiveCost:
    """The cost of ``schedule`` from the :func:`_step_cost` of each of its distinct steps (by ``id``)."""
    n = len(schedule.gpus)
    alpha = beta = 0.0
    best = (0.0, None, math.inf, 0.0)
    for step in schedule.steps:
        b, a, edge, bw, load = per_step[id(step)]
        alpha += a
        beta += b
        if b > best[0]:
            best = (b, edge, bw, load)
    time_s = alpha + beta
    S = schedule.nbytes
    factor = bus_factor(schedule.op, n)
    algbw = S / time_s / 1e9 if time_s > 0 else math.inf
    busbw = algbw * factor if time_s > 0 else 0.0
    busbw_beta = factor * S / beta / 1e9 if beta > 0 else math.inf
    return CollectiveCost(
        schedule.op, schedule.algorithm, policy, n, S, time_s, alpha, beta, algbw, busbw, busbw_beta,
        best[1], best[2], best[3], len(schedule.steps), schedule.channels,
    )


def schedules_cost_and_loads(topo: Topology, schedules: Sequence[CollectiveSchedule], policy: str = "rail", *,
                             network_only: bool = False) -> tuple[list[CollectiveCost], dict[Edge, float]]:
    """The cost of each planned collective (:func:`schedule_time`) and the traffic each link carries over all their steps.

    The loads are :func:`~topology.routing.route_flows` of every distinct step's flows, each volume times the
    step's repetitions, the schedules' flows one after the other (the bytes one run of the collectives puts on
    each link); ``network_only`` keeps the network links. Each step is routed once for both.

    >>> from topology import build_cluster
    >>> t = build_cluster(2)
    >>> plan = plan_collective(t, "all_reduce", ["node0/gpu0", "node1/gpu0"], 1e9)
    >>> (cost,), loads = schedules_cost_and_loads(t, [plan], network_only=True)
    >>> cost.time_s == schedule_time(t, plan).time_s, loads[("node0/nic0", "su0/leaf0", 0)]   # 2(n-1) steps of S/n
    (True, 1000000000.0)
    """
    costs, links, loads = _schedules_cost_and_link_loads(topo, schedules, policy, network_only=network_only)
    edges = _link_ids(view(topo), topo)[1]
    return costs, dict(zip([edges[i] for i in links.tolist()], loads.tolist(), strict=True))


def _term_weights(fractions: np.ndarray, volumes: list[float], terms: list[int], n: int) -> np.ndarray:
    """Each routing term's ``(volume * n) * fraction`` (route_flows' product; ``terms``: the terms per pair); one volume
    (a ring's every flow) scales the fractions without ``np.repeat``."""
    if volumes.count(volumes[0]) == len(volumes):
        return fractions * (volumes[0] * n)
    return np.repeat(np.array(volumes) * n, terms) * fractions


def _schedules_cost_and_link_loads(topo: Topology, schedules: Sequence[CollectiveSchedule], policy: str = "rail", *,
                                   network_only: bool = False) -> tuple[list[CollectiveCost], np.ndarray, np.ndarray]:
    """:func:`schedules_cost_and_loads` with the loads as arrays: (link numbers of ``routing._link_ids``, loads), in its order.

    Each distinct step's flows are routed and grouped by link once: the step's loads (its cost) and its share of
    the total, ``(volume * repetitions) * fraction`` per term (route_flows' product), are two ``np.bincount`` over
    that one grouping. While no (src, dst) pair repeats across the steps, the total is those terms summed link by
    link in the steps' order (one step: its own grouping; the network links are the full result's, in its order);
    a repeated pair is merged first, as route_flows does.
    """
    _check_policy(policy)
    vw = view(topo)
    costs: list[CollectiveCost] = []
    repeated: list[tuple[list[P2PFlow], int]] = []  # every distinct step and its repetitions
    # per distinct step while no pair repeats: (its terms' link numbers, their weights in the total, its links, the terms' slots)
    totals: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] | None = []
    seen: set[tuple[int, int]] = set()
    no_links = np.zeros(0, dtype=np.intp), np.zeros(0)
    for schedule in schedules:
        # identical consecutive steps (a ring's 2(n-1)) are one list object: route each distinct step once
        counts: dict[int, list] = {}
        for step in schedule.steps:
            entry = counts.get(id(step))
            if entry is None:
                counts[id(step)] = [step, 1]
            else:
                entry[1] += 1
        per_step: dict[int, tuple] = {}
        for key, (step, n) in counts.items():
            step_pairs = _pairs(vw, step)
            step_loads = no_links
            if step_pairs:
                ids, fractions, terms = _pair_terms(vw, topo, step_pairs, policy)
                links, slots = _group_links(vw, topo, ids)
                volumes = [v for _, _, v in step_pairs]
                weights = _term_weights(fractions, volumes, terms, 1)
                step_loads = links, np.bincount(slots, weights=weights, minlength=len(links))
            one_each = len(step_pairs) == len(step)
            per_step[key] = _step_cost(topo, vw, step, schedule.chains.get(key), policy, 0.0, step_loads, step_pairs if one_each else None)
            repeated.append((step, n))
            if totals is not None:
                before = len(seen)
                seen.update([(a, b) for a, b, _ in step_pairs])
                # every flow its own pair, never seen before: route_flows' merged volume is this one, times n
                if one_each and len(seen) == before + len(step_pairs):
                    if step_pairs:
                        totals.append((ids, _term_weights(fractions, volumes, terms, n), links, slots))
                else:
                    totals = None
        costs.append(_schedule_cost(schedule, policy, per_step))
    if totals is None:
        flows = [(f.src, f.dst, float(f.nbytes) * n) for step, n in repeated for f in step]
        links, loads = _sum_loads(vw, topo, _pairs(vw, flows), policy, network_only)
        return costs, links, loads
    if not totals:
        return costs, *no_links
    if len(totals) == 1:
        _, weights, links, slots = totals[0]
    else:
        weights = np.concatenate([w for _, w, _, _ in totals])
        links, slots = _group_links(vw, topo, np.concatenate([ids for ids, _, _, _ in totals]))
    loads = np.bincount(slots, weights=weights, minlength=len(links))
    if network_only:
        keep = _network_mask(vw, topo)[links]
        links, loads = links[keep], loads[keep]
    return costs, links, loads


def collective_time(
    topo: Topology,
    op: str,
    gpus: Sequence[str | int],
    nbytes: float,
    algorithm: str | None = None,
    policy: str = "rail",
    step_overhead_us: float = 0.0,
) -> CollectiveCost:
    """Alpha-beta time of a collective on ``topo`` (module docstring: meaning of ``nbytes``, algorithms).

    ``policy`` is the routing policy for every step (default ``"rail"``, NCCL's
    behaviour on rail-optimised fabrics with PXN; ``"ecmp"`` models plain
    per-hop hashing). ``step_overhead_us`` adds a fixed software cost per step.

    >>> from topology import build_cluster
    >>> t = build_cluster(2)
    >>> c = collective_time(t, "all_reduce", t.gpus(), 2**30)
    >>> round(c.busbw_beta, 6), c.channels      # min(450 NVLink, 8 x 50 GB/s NICs)
    (400.0, 8)
    """
    return schedule_time(topo, plan_collective(topo, op, gpus, nbytes, algorithm), policy, step_overhead_us)


@dataclass(frozen=True)
class AlphaBeta:
    """``time(S) = alpha_s + beta_s_per_byte * S`` for one collective on one group (exact for this model)."""

    op: str
    ranks: int
    alpha_s: float
    beta_s_per_byte: float

    def time(self, nbytes: float) -> float:
        return self.alpha_s + self.beta_s_per_byte * nbytes if self.ranks > 1 else 0.0

    def busbw(self, nbytes: float) -> float:
        """Bus bandwidth (GB/s) at message size ``nbytes``."""
        t = self.time(nbytes)
        return bus_factor(self.op, self.ranks) * nbytes / t / 1e9 if t > 0 else 0.0

    @property
    def busbw_limit(self) -> float:
        """Large-message bus bandwidth (GB/s)."""
        return bus_factor(self.op, self.ranks) / self.beta_s_per_byte / 1e9 if self.beta_s_per_byte > 0 else math.inf


def alpha_beta(
    topo: Topology, op: str, gpus: Sequence[str | int], algorithm: str | None = None, policy: str = "rail", step_overhead_us: float = 0.0
) -> AlphaBeta:
    """The collective's cost as ``alpha + beta * S``, computed once per (group, op, algorithm, policy) and cached.

    Every flow of a plan is proportional to S, so the beta part is exactly
    linear and the alpha part does not depend on S: planners that sweep message
    sizes or evaluate many candidate groups call this instead of
    :func:`collective_time`.

    >>> from topology import build_node
    >>> t = build_node("dgx-h100")
    >>> ab = alpha_beta(t, "all_gather", t.gpus())
    >>> round(ab.busbw_limit, 6), ab.time(0) == ab.alpha_s
    (450.0, True)
    """
    vw = view(topo)
    key = (op, tuple(topo.resolve_gpu(g) for g in gpus), algorithm or DEFAULT_ALGORITHM.get(op, ""), policy, step_overhead_us)
    cache = vw.cache.setdefault("alpha_beta", {})
    if key not in cache:
        cost = collective_time(topo, op, key[1], 1.0, algorithm, policy, step_overhead_us)
        cache[key] = AlphaBeta(op, cost.ranks, cost.alpha_s, cost.beta_s)
    return cache[key]


__all__ = [
    "ALGORITHMS", "OPS", "AlphaBeta", "CollectiveCost", "CollectiveSchedule", "P2PFlow", "alpha_beta", "bus_factor",
    "collective_flows", "collective_time", "double_binary_tree", "ideal_time", "plan_collective", "schedule_time",
    "schedules_cost_and_loads",
]

