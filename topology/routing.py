"""Routing flows over a topology: which links a transfer uses, and how much of it each carries.

Every flow from ``src`` to ``dst`` is cut into three segments:

1. **source host segment** -- from ``src`` to an *egress port* (a NIC) of its
   island (server or NVLink domain), along the best path of
   :func:`topology.paths.device_path`;
2. **fabric segment** -- from the egress port through network switches to an
   *ingress port* of the destination's island, on minimum-hop paths;
3. **destination host segment** -- from the ingress port to ``dst``.

A flow that stays inside one island uses the single best path between its
ends (no network). NVSwitch planes of one domain act as one switch: a flow
crossing them is striped over the planes in proportion to their bandwidth
(5:5:4:4 on HGX H100), as a GPU drives all its NVLinks at once; bonded NVLinks
between the same two devices are striped the same way. This holds for every
policy.

Policies (they differ in the egress port and in the fabric segment):

``"shortest"``
    Egress/ingress = the GPU's nearest NIC (its own rail on DGX: the NIC on its
    PCIe switch, which is what NCCL picks without PXN). Fabric: one
    deterministic minimum-hop path; among those, the widest; among equally
    wide next hops, number ``D mod k`` of the ``k`` candidates, ``D`` being the
    destination's number -- the destination-mod-k rule of InfiniBand's
    fat-tree routing, so that different destinations spread over the spines
    while each destination keeps one fixed path. Static routing: a flow never
    splits, and flows to one destination share their path.
``"ecmp"``
    Same ports; the fabric segment is split *equally at each hop among the
    next hops on minimum-hop paths* (every parallel link is its own next hop),
    as per-hop flow hashing does on average.
``"rail"``
    Rail-aligned (NCCL's PXN on rail-optimised fabrics): the ingress port is
    the destination GPU's nearest NIC, on rail *r*; the source moves the data
    over NVLink to the local GPU on rail *r* and leaves through that GPU's NIC
    (rail *r*), so traffic between hosts of one scalable unit never crosses a
    spine. If the source island has no port on rail *r*, the source's nearest
    NIC is used. The fabric segment is split as in ``"ecmp"``.

Loads are in the unit of the flow volumes (bytes, usually). Routes are cached
per topology (see :func:`topology.paths.clear_cache`).

>>> from topology import build_cluster
>>> t = build_cluster(2)
>>> [(round(f, 3), [f"{u}->{v}" for u, v, _ in p][2:5]) for f, p in flow_paths(t, "node0/gpu0", "node1/gpu3", "rail")][:1]
[(0.278, ['node0/gpu3->node0/pcie3', 'node0/pcie3->node0/nic3', 'node0/nic3->su0/leaf3'])]
>>> loads = route_flows(t, [("node0/gpu0", "node1/gpu0", 100.0)], "ecmp")
>>> loads[("node0/nic0", "su0/leaf0", 0)]
100.0
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable
from typing import Any

import numpy as np

from .errors import TopologyError
from .model import Topology
from .paths import _GPU, _NET, _NIC, _NVS, _SW, PathType, VEdge, _islands, _link_attrs, _p2c_sensitive, _search, _search_all, _View, view

Edge = tuple[str, str, Any]
POLICIES = ("shortest", "ecmp", "rail")

# A route is a list of stages traversed one after the other; a stage is a list of
# alternatives (fraction, edges) whose fractions sum to 1.
Stage = list[tuple[float, tuple[Edge, ...]]]

_CACHE_LIMIT = 200_000


def _check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise TopologyError(f"unknown routing policy {policy!r}; expected one of {', '.join(POLICIES)}")


# --------------------------------------------------------------------------------------------
# Host segments
# --------------------------------------------------------------------------------------------


def _striped(phys: list[tuple[str, str, Any, float]]) -> Stage:
    """Parallel physical links used together, each in proportion to its bandwidth."""
    if len(phys) == 1:
        u, v, k, _ = phys[0]
        return [(1.0, ((u, v, k),))]
    total = sum(p[3] for p in phys)
    return [(p[3] / total, ((p[0], p[1], p[2]),)) for p in phys]


def _nvs_crossing(vw: _View, x: int, e_in: VEdge, e_out: VEdge) -> Stage:
    """x -> (NVSwitch planes) -> y, striped over the planes in proportion to min(bw in, bw out)."""
    ins: dict[str, list[tuple[str, str, Any, float]]] = {}
    outs: dict[str, list[tuple[str, str, Any, float]]] = {}
    for p in e_in.phys:
        ins.setdefault(p[1], []).append(p)
    for p in e_out.phys:
        outs.setdefault(p[0], []).append(p)
    weights = {}
    for plane in ins.keys() & outs.keys():
        weights[plane] = min(sum(p[3] for p in ins[plane]), sum(p[3] for p in outs[plane]))
    total = sum(weights.values())
    if not total:
        raise TopologyError(
            f"{vw.names[x]} -> {vw.names[e_out.v]}: no NVSwitch plane links both (multi-level NVSwitch domains are not supported)"
        )
    stage: Stage = []
    for plane in sorted(weights):
        for (f1, a), (f2, b) in itertools.product(_striped(ins[plane]), _striped(outs[plane])):
            stage.append((weights[plane] / total * f1 * f2, a + b))
    return stage


def _hops_to_stages(vw: _View, s: int, hops: list[tuple[int, VEdge]]) -> list[Stage]:
    stages: list[Stage] = []
    i = 0
    while i < len(hops):
        u, e = hops[i]
        if vw.kind[e.v] == _NVS and i + 1 < len(hops):
            stages.append(_nvs_crossing(vw, u, e, hops[i + 1][1]))
            i += 2
            continue
        stages.append(_striped(e.phys))
        i += 1
    return stages


def _host_segment(vw: _View, a: int, b: int) -> list[Stage]:
    """Stages of the best path a -> b inside one island; the search runs once per island structure."""
    if a == b:
        return []
    cache = vw.cache.setdefault("host_segments", {})
    key = (a, b)
    if key not in cache:
        nodes, data = _islands(vw)[vw.island[a]]
        local = vw.cache["island_local"]
        shared = vw.cache.setdefault("local_hops", {})
        lkey = (id(data), local[a], local[b])
        if lkey not in shared:
            # one single-source search gives the paths from a to every node of its island
            # (P2C-sensitive GPU targets get their own pair search, see paths._search_all)
            targets = [x for x in nodes if x != a and vw.kind[x] in (_GPU, _NIC)]
            found_all = _search_all(vw, a, [x for x in targets if not _p2c_sensitive(vw, x, a)])
            for x in targets:
                f = found_all.get(x)
                hops = f[4] if f is not None else None
                if hops is None and _p2c_sensitive(vw, x, a):
                    g = _search(vw, a, x)
                    hops = g[2] if g is not None else None
                if hops is not None:
                    # stored as (local u, local v, rank among u's links to v): valid for every island of this structure
                    shared[(id(data), local[a], local[x])] = [
                        (local[u], local[e.v], [y for y in vw.adj[u] if y.v == e.v].index(e)) for u, e in hops
                    ]
            if lkey not in shared:  # a target that is neither a GPU nor a NIC
                g = _search(vw, a, b)
                if g is None:
                    raise TopologyError(f"no path from {vw.names[a]} to {vw.names[b]}")
                shared[lkey] = [(local[u], local[e.v], [y for y in vw.adj[u] if y.v == e.v].index(e)) for u, e in g[2]]
        hops = []
        for lu, lv, k in shared[lkey]:
            u, v = nodes[lu], nodes[lv]
            hops.append((u, [x for x in vw.adj[u] if x.v == v][k]))
        cache[key] = _hops_to_stages(vw, a, hops)
    return cache[key]


def _ports_of_island(vw: _View, isl: int) -> list[int]:
    cache = vw.cache.setdefault("island_ports", {})
    if isl not in cache:
        nodes = _islands(vw)[isl][0]
        cache[isl] = [a for a in nodes if any(e.lk == _NET for e in vw.adj[a])]
    return cache[isl]


def nearest_port(topo: Topology, node: str) -> str | None:
    """The NIC a device uses for network traffic by default (``None`` when its island has none).

    The best path class, then bandwidth, then hop count wins; ties go to the NIC
    with the GPU's own ``index``, else are spread round-robin over the GPUs
    that tie, so that every NIC serves a share of the GPUs.

    >>> from topology import build_cluster
    >>> t = build_cluster(1, node="dgx-a100")
    >>> nearest_port(t, "node0/gpu1"), nearest_port(t, "node0/gpu2")
    ('node0/nic1', 'node0/nic2')
    """
    vw = view(topo)
    p = _nearest(vw, vw.idx(node))
    return None if p is None else vw.names[p]


def _nearest(vw: _View, a: int) -> int | None:
    if vw.kind[a] == _SW or any(e.lk == _NET for e in vw.adj[a]):
        return a
    nodes, data = _islands(vw)[vw.island[a]]
    if data.nearest is None:
        # decided once per island structure, on this instance, in local positions
        local = {x: i for i, x in enumerate(nodes)}
        ports = _ports_of_island(vw, vw.island[a])
        choice: dict[int, int | None] = {}
        rank_by_set: dict[tuple[int, ...], int] = {}
        for x in nodes:
            if vw.kind[x] != _GPU or x in ports:
                continue  # other devices are decided on demand, below
            found = _search_all(vw, x, ports)  # targets are NICs: the single-source search is exact
            ranks = [((found[p][0], -found[p][1], found[p][2]) if p in found else (PathType.DIS, 0.0, 1 << 30), p) for p in ports]
            best = min((r for r, _ in ranks), default=None)
            if best is None or best[0] == PathType.DIS:
                choice[local[x]] = None
                continue
            cands = tuple(p for r, p in ranks if r == best)
            own = [p for p in cands if vw.index_attr(x) is not None and vw.index_attr(p) == vw.index_attr(x)]
            if own:
                choice[local[x]] = local[own[0]]
            else:
                k = rank_by_set.get(cands, 0)
                rank_by_set[cands] = k + 1
                choice[local[x]] = local[cands[k % len(cands)]]
        data.nearest = choice
    la = vw.cache["island_local"][a]
    if la not in data.nearest:  # a CPU or PCIe switch as a flow end: its best port, lowest position on ties
        ports = _ports_of_island(vw, vw.island[a])
        found = _search_all(vw, a, ports)
        ranked = sorted(((found[p][0], -found[p][1], found[p][2]), i) for i, p in enumerate(ports) if p in found)
        data.nearest[la] = nodes.index(ports[ranked[0][1]]) if ranked else None
    p = data.nearest[la]
    return None if p is None else nodes[p]


def _rail_port(vw: _View, a: int, rail: Any) -> int | None:
    """The port of a's island on ``rail`` that is best reached from ``a``."""
    ports = [p for p in _ports_of_island(vw, vw.island[a]) if vw.rail_attr(p) == rail]
    if not ports:
        return None
    if len(ports) == 1:
        return ports[0]
    found = _search_all(vw, a, ports, hops=True)  # NIC targets: exact
    return min(ports, key=lambda p: ((found[p][0], -found[p][1], found[p][2]) if p in found else (PathType.DIS, 0.0, 1 << 30), p))


# --------------------------------------------------------------------------------------------
# Fabric segments
# --------------------------------------------------------------------------------------------


def _dist_to(vw: _View, targets: frozenset[int]) -> dict[int, int]:
    """Hop distance from every switch to the nearest switch in ``targets`` over switch-to-switch links."""
    cache = vw.cache.setdefault("dist_to", {})
    if targets in cache:
        return cache[targets]
    radj = vw.cache.get("switch_radj")
    if radj is None:
        radj = {}
        for a, lst in enumerate(vw.adj):
            if vw.kind[a] == _SW:
                for e in lst:
                    if vw.kind[e.v] == _SW:
                        radj.setdefault(e.v, []).append(a)
        vw.cache["switch_radj"] = radj
    dist = dict.fromkeys(targets, 0)
    queue = deque(targets)
    while queue:
        x = queue.popleft()
        for y in radj.get(x, ()):
            if y not in dist:
                dist[y] = dist[x] + 1
                queue.append(y)
    cache[targets] = dist
    return dist


def _into(vw: _View, q: int) -> dict[int, list[VEdge]]:
    """Switches with links into ``q``, and those links."""
    cache = vw.cache.get("into")
    if cache is None:  # one pass over the switches' links into non-switch nodes
        cache = vw.cache["into"] = {}
        for a, lst in enumerate(vw.adj):
            if vw.kind[a] == _SW:
                for e in lst:
                    if vw.kind[e.v] != _SW:
                        cache.setdefault(e.v, {}).setdefault(a, []).append(e)
    return cache.get(q, {})


def _d_mod_k(items: list, width, dest: int):
    """The widest item; ties go to item ``dest mod k`` of the k tied ones (D-mod-K, InfiniBand's fat-tree routing)."""
    scored = [(width(x), x) for x in items]
    best = max(w for w, _ in scored)
    tied = [x for w, x in scored if w == best]
    return tied[dest % len(tied)]


def _switch_alternatives(
    vw: _View, s: int, targets: frozenset[int], last_bw: tuple[tuple[int, float], ...], policy: str, dest: int = 0
) -> tuple[list[tuple[float, tuple[Edge, ...], int]], float]:
    """Switch-level routes from switch ``s`` to the nearest switch of ``targets``: ([(fraction, edges, terminal)], width).

    ``width`` (``"shortest"`` only) is the bottleneck of the chosen path including the terminal's onward link.

    ``last_bw`` gives, per target switch, the bandwidth of its widest link onward
    (used by ``"shortest"`` to pick the widest of the minimum-hop paths).
    ``dest`` (the destination's number) breaks ties for ``"shortest"``.
    Cached per (s, targets, policy): every port pair behind the same switches shares it.
    """
    cache = vw.cache.setdefault("switch_routes", {})
    key = (s, targets, last_bw, policy, dest if policy == "shortest" else None)
    if key in cache:
        return cache[key]
    dist = _dist_to(vw, targets)
    if s not in dist:
        cache[key] = ([], 0.0)
        return cache[key]

    def nexts(x: int) -> list[VEdge]:
        dx = dist[x]
        return [e for e in vw.adj[x] if e.lk == _NET and vw.kind[e.v] == _SW and dist.get(e.v) == dx - 1]

    out: list[tuple[float, tuple[Edge, ...], int]] = []
    width = float("inf")
    if policy == "shortest":
        tail = dict(last_bw)
        memo: dict[int, float] = {}

        def widest(x: int) -> float:
            if dist[x] == 0:
                return tail.get(x, float("inf"))
            if x not in memo:
                memo[x] = max(min(e.bw, widest(e.v)) for e in nexts(x))
            return memo[x]

        x, edges = s, []
        while dist[x] > 0:
            best = _d_mod_k(nexts(x), lambda e: min(e.bw, widest(e.v)), dest)
            ph = max(best.phys, key=lambda ph: ph[3])
            edges.append((ph[0], ph[1], ph[2]))
            x = best.v
        out.append((1.0, tuple(edges), x))
        width = widest(s)
    else:
        def walk(x: int, frac: float, edges: tuple[Edge, ...]) -> None:
            if dist[x] == 0:
                out.append((frac, edges, x))
                return
            hops = nexts(x)
            for e in hops:
                for f, (ph,) in _striped(e.phys):
                    walk(e.v, frac * f / len(hops), (*edges, ph))

        walk(s, 1.0, ())
    cache[key] = (out, width)
    return cache[key]


def _fabric_stage(vw: _View, p: int, q: int, policy: str) -> Stage:
    """Alternatives (fraction, edges) from port/switch p to port/switch q through network switches only."""
    cache = vw.cache.setdefault("fabric", {})
    key = (p, q, policy)
    if key in cache:
        return cache[key]
    if len(cache) > _CACHE_LIMIT:
        cache.clear()
    if p == q:
        return [(1.0, ())]
    q_is_switch = vw.kind[q] == _SW
    into = {} if q_is_switch else _into(vw, q)
    targets = frozenset([q]) if q_is_switch else frozenset(into)
    last_bw = () if q_is_switch else tuple(sorted((t, max(e.bw for e in es)) for t, es in into.items()))
    dist = _dist_to(vw, targets)

    def last_hops(t: int) -> Stage:
        """From terminal switch t into q: equal split over parallel links (ECMP) or the widest (shortest)."""
        if q_is_switch:
            return [(1.0, ())]
        links = into[t]
        if policy == "shortest":
            ph = max(max(links, key=lambda e: e.bw).phys, key=lambda ph: ph[3])
            return [(1.0, ((ph[0], ph[1], ph[2]),))]
        return [(f / len(links), es) for e in links for f, es in _striped(e.phys)]

    # first hops: p itself when it is a switch, else its network links on minimum-hop paths
    if vw.kind[p] == _SW:
        firsts: list[tuple[VEdge | None, int]] = [(None, p)]
    else:
        links = [e for e in vw.adj[p] if e.lk == _NET]
        direct = [e for e in links if e.v == q]
        if direct:  # a cable straight to q
            if policy == "shortest":
                ph = max(max(direct, key=lambda e: e.bw).phys, key=lambda ph: ph[3])
                out: Stage = [(1.0, ((ph[0], ph[1], ph[2]),))]
            else:
                out = [(f / len(direct), es) for e in direct for f, es in _striped(e.phys)]
            cache[key] = out
            return out
        links = [e for e in links if vw.kind[e.v] == _SW and e.v in dist]
        best = min((dist[e.v] for e in links), default=None)
        firsts = [(e, e.v) for e in links if dist[e.v] == best]
    if not firsts:
        raise TopologyError(f"no network path from {vw.names[p]} to {vw.names[q]}")
    alternatives: Stage = []
    if policy == "shortest":
        def score(item: tuple[VEdge | None, int]) -> float:
            e, s = item
            width = _switch_alternatives(vw, s, targets, last_bw, policy, q)[1]
            return min(e.bw if e is not None else float("inf"), width)

        e, s = _d_mod_k(firsts, score, q)
        head: tuple[Edge, ...] = ()
        if e is not None:
            ph = max(e.phys, key=lambda ph: ph[3])
            head = ((ph[0], ph[1], ph[2]),)
        ((_, mid, t),) = _switch_alternatives(vw, s, targets, last_bw, policy, q)[0]
        ((_, tail_edges),) = last_hops(t)
        alternatives.append((1.0, head + mid + tail_edges))
    else:
        for e, s in firsts:
            heads = [(1.0, ())] if e is None else _striped(e.phys)
            for fh, head in heads:
                for fm, mid, t in _switch_alternatives(vw, s, targets, last_bw, policy)[0]:
                    for fl, tail_edges in last_hops(t):
                        alternatives.append((fh * fm * fl / len(firsts), head + mid + tail_edges))
    cache[key] = alternatives
    return alternatives


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def _route(vw: _View, s: int, t: int, policy: str) -> list[Stage]:
    cache = vw.cache.setdefault("routes", {})
    key = (s, t, policy)
    if key in cache:
        return cache[key]
    if len(cache) > _CACHE_LIMIT:
        cache.clear()
    if vw.kind[s] == _NVS or vw.kind[t] == _NVS:
        raise TopologyError("flows start and end at GPUs, NICs, CPUs, PCIe or network switches, not at NVSwitch planes")
    if s == t:
        stages: list[Stage] = []
    elif vw.island[s] == vw.island[t] and vw.island[s] != -1:
        stages = _host_segment(vw, s, t)
    else:
        q = _nearest(vw, t)
        if policy == "rail" and q is not None and vw.kind[s] != _SW:
            p = _rail_port(vw, s, vw.rail_attr(q))
            if p is None:
                p = _nearest(vw, s)
        else:
            p = _nearest(vw, s)
        if p is None or q is None:
            raise TopologyError(f"no network path from {vw.names[s]} to {vw.names[t]}: {vw.names[s if p is None else t]} has no NIC")
        stages = [*_host_segment(vw, s, p), _fabric_stage(vw, p, q, policy), *_host_segment(vw, q, t)]
    cache[key] = stages
    return stages


def _remember(vw: _View, name: str, key: tuple, value: Any) -> Any:
    """Keep ``value`` under ``key`` in the view's per-pair cache ``name`` (emptied past ``_CACHE_LIMIT`` entries)."""
    cache = vw.cache[name]
    if len(cache) > _CACHE_LIMIT:
        cache.clear()
    cache[key] = value
    return value


def _edge_fractions(vw: _View, s: int, t: int, policy: str) -> list[tuple[Edge, float]]:
    out = vw.cache.setdefault("fractions", {}).get((s, t, policy))
    if out is None:
        acc: dict[Edge, float] = {}
        for stage in _route(vw, s, t, policy):
            for f, edges in stage:
                for e in edges:
                    acc[e] = acc.get(e, 0.0) + f
        out = _remember(vw, "fractions", (s, t, policy), list(acc.items()))
    return out


def _network_links(vw: _View) -> set[Edge]:
    """The network links (NIC, leaf, spine) of the view, as ``(u, v, key)``."""
    network = vw.cache.get("network_links")
    if network is None:
        network = vw.cache["network_links"] = {(u, v, k) for lst in vw.adj for e in lst if e.lk == _NET for u, v, k, _ in e.phys}
    return network


def _network_fractions(vw: _View, s: int, t: int, policy: str) -> list[tuple[Edge, float]]:
    """:func:`_edge_fractions` restricted to network links (NIC, leaf, spine), in the same order."""
    out = vw.cache.setdefault("network_fractions", {}).get((s, t, policy))
    if out is None:
        network = _network_links(vw)
        out = _remember(vw, "network_fractions", (s, t, policy), [(e, f) for e, f in _edge_fractions(vw, s, t, policy) if e in network])
    return out


def flow_paths(topo: Topology, src: str, dst: str, policy: str = "shortest") -> list[tuple[float, list[Edge]]]:
    """The physical paths a flow ``src -> dst`` takes under ``policy``, as (fraction, edges); fractions sum to 1.

    Edges are ``(u, v, key)`` of ``topo.graph``.

    >>> from topology import build_node
    >>> t = build_node("dgx-h100")
    >>> [(f, [v for _, v, _ in p]) for f, p in flow_paths(t, "node0/gpu0", "node0/gpu1")]  # striped 5:5:4:4
    [(0.2777777777777778, ['node0/nvs0', 'node0/gpu1']), (0.2777777777777778, ['node0/nvs1', 'node0/gpu1']), \
(0.2222222222222222, ['node0/nvs2', 'node0/gpu1']), (0.2222222222222222, ['node0/nvs3', 'node0/gpu1'])]
    """
    _check_policy(policy)
    vw = view(topo)
    for n in (src, dst):
        if n not in topo.graph:
            raise TopologyError(f"unknown node {n!r}")
    stages = _route(vw, vw.idx(src), vw.idx(dst), policy)
    out = []
    for combo in itertools.product(*stages):
        frac = 1.0
        edges: list[Edge] = []
        for f, es in combo:
            frac *= f
            edges.extend(es)
        out.append((frac, edges))
    return out if stages else [(1.0, [])]


def route_flows(topo: Topology, flows: Iterable[tuple[str, str, float]], policy: str = "shortest", *,
                network_only: bool = False) -> dict[Edge, float]:
    """Sum of the traffic each directed link carries when every flow ``(src, dst, volume)`` is routed by ``policy``.

    Flows between the same pair are merged first; routes are cached per pair. ``network_only``: only the
    network links (NIC, leaf, spine), each with the same sum in the same order as the full result's (for
    callers that drop the links inside hosts, without routing them).

    >>> from topology import build_node
    >>> t = build_node("dgx-h100")
    >>> loads = route_flows(t, [("node0/gpu0", "node0/gpu1", 18.0), ("node0/gpu2", "node0/gpu1", 18.0)])
    >>> loads[("node0/nvs0", "node0/gpu1", 0)], loads[("node0/gpu0", "node0/nvs3", 0)]
    (10.0, 4.0)
    """
    _check_policy(policy)
    vw = view(topo)
    pairs = _pairs(vw, flows)
    if len(pairs) >= _ARRAY_PAIRS:  # many pairs: the same sums, added by numpy (see _sum_loads)
        links, loads = _sum_loads(vw, topo, pairs, policy, network_only)
        edges = _link_ids(vw, topo)[1]
        return dict(zip([edges[i] for i in links.tolist()], loads.tolist(), strict=True))
    fractions = _network_fractions if network_only else _edge_fractions
    out: dict[Edge, float] = {}
    for s, t, vol in pairs:
        for e, f in fractions(vw, s, t, policy):
            out[e] = out.get(e, 0.0) + vol * f
    return out


def _pairs(vw: _View, flows: Iterable[tuple[str, str, float]]) -> list[tuple[int, int, float]]:
    """The flows merged per (src, dst) in order of first appearance, as view positions; empty and self flows dropped."""
    volumes: dict[tuple[str, str], float] = {}
    for src, dst, vol in flows:
        if vol < 0:
            raise TopologyError(f"flow {src} -> {dst}: volume must be >= 0, got {vol!r}")
        volumes[(src, dst)] = volumes.get((src, dst), 0.0) + vol
    index = vw.index
    rep = vw.rep
    out = []
    for (src, dst), vol in volumes.items():
        if src == dst or vol == 0:
            continue
        try:
            out.append((index[rep.get(src, src)], index[rep.get(dst, dst)], vol))
        except KeyError:
            raise TopologyError(f"flow {src} -> {dst}: unknown node") from None
    return out


def _link_ids(vw: _View, topo: Topology) -> tuple[dict[Edge, int], list[Edge], np.ndarray]:
    """Links numbered in :func:`~topology.paths.link_attrs` order: (number of each link, the links, their ``bw`` as an array)."""
    ids = vw.cache.get("link_ids")
    if ids is None:
        table = _link_attrs(vw, topo)
        edges = list(table)
        ids = vw.cache["link_ids"] = ({e: i for i, e in enumerate(edges)}, edges, np.array([d["bw"] for d in table.values()], dtype=float))
    return ids


def _fraction_arrays(vw: _View, topo: Topology, s: int, t: int, policy: str, network_only: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_edge_fractions` (or :func:`_network_fractions`) as (link numbers, fractions) arrays."""
    name = "network_fraction_arrays" if network_only else "fraction_arrays"
    out = vw.cache.setdefault(name, {}).get((s, t, policy))
    if out is None:
        number = _link_ids(vw, topo)[0]
        fr = (_network_fractions if network_only else _edge_fractions)(vw, s, t, policy)
        out = _remember(vw, name, (s, t, policy), (np.array([number[e] for e, _ in fr], dtype=np.intp), np.array([f for _, f in fr])))
    return out


# route_flows adds with numpy from this many (src, dst) pairs on: below it, the plain loop is faster
_ARRAY_PAIRS = 12
_UNSET = np.iinfo(np.intp).max


def _pair_terms(vw: _View, topo: Topology, pairs: list[tuple[int, int, float]], policy: str, network_only: bool = False
                ) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """The terms of :func:`route_flows`' loop over ``pairs`` before the volumes: (link numbers, fractions, terms per pair)."""
    cache = vw.cache.setdefault("network_fraction_arrays" if network_only else "fraction_arrays", {})
    arrays = [cache.get((s, t, policy)) or _fraction_arrays(vw, topo, s, t, policy, network_only) for s, t, _ in pairs]
    if len(arrays) == 1:
        return arrays[0][0], arrays[0][1], [len(arrays[0][0])]
    return np.concatenate([a[0] for a in arrays]), np.concatenate([a[1] for a in arrays]), [len(a[0]) for a in arrays]


def _group_links(vw: _View, topo: Topology, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct links of ``ids`` in the order of their first appearance, and each term's slot among them.

    ``np.bincount(slots, weights)`` then adds each link's terms one after another in the order of ``ids``: the
    sums of a dict filled term by term, keyed in its insertion order.
    """
    # without sorting: a scratch array over all links holds each link's first position in ``ids`` (np.minimum.at),
    # then its slot in the result; it is left as found (all _UNSET)
    scratch = vw.cache.get("link_scratch")
    if scratch is None:
        scratch = vw.cache["link_scratch"] = np.full(len(_link_ids(vw, topo)[1]), _UNSET, dtype=np.intp)
    position = np.arange(len(ids))
    np.minimum.at(scratch, ids, position)
    links = ids[scratch[ids] == position]
    scratch[links] = np.arange(len(links))
    slots = scratch[ids]
    scratch[links] = _UNSET
    return links, slots


def _sum_loads(vw: _View, topo: Topology, pairs: list[tuple[int, int, float]], policy: str, network_only: bool = False
               ) -> tuple[np.ndarray, np.ndarray]:
    """The loads of :func:`route_flows`' loop over ``pairs`` (from :func:`_pairs`), as arrays: (link numbers, loads) in its order.

    Each load is the same float: every term ``volume * fraction`` is the same product (``np.repeat`` lines each
    pair's volume up with its fractions), and :func:`_group_links` adds a link's terms in the order the loop does.
    """
    if not pairs:
        return np.zeros(0, dtype=np.intp), np.zeros(0)
    ids, fractions, counts = _pair_terms(vw, topo, pairs, policy, network_only)
    links, slots = _group_links(vw, topo, ids)
    weights = np.repeat(np.array([vol for _, _, vol in pairs]), counts) * fractions
    return links, np.bincount(slots, weights=weights, minlength=len(links))


def _network_mask(vw: _View, topo: Topology) -> np.ndarray:
    """Per link number (:func:`_link_ids`): whether it is a network link (NIC, leaf, spine), as :func:`_network_fractions` keeps."""
    mask = vw.cache.get("network_mask")
    if mask is None:
        network = _network_links(vw)
        mask = vw.cache["network_mask"] = np.array([e in network for e in _link_ids(vw, topo)[1]], dtype=bool)
    return mask


def _route_loads(topo: Topology, flows: Iterable[tuple[str, str, float]], policy: str) -> tuple[np.ndarray, np.ndarray]:
    """:func:`route_flows` as arrays: (link numbers in :func:`_link_ids`, loads), in the order ``route_flows`` lists them.

    The same floats (:func:`_sum_loads`), for the cost loops that read every loaded link.
    """
    _check_policy(policy)
    vw = view(topo)
    return _sum_loads(vw, topo, _pairs(vw, flows), policy)


def link_utilisation(topo: Topology, loads: dict[Edge, float]) -> list[tuple[Edge, float]]:
    """Links sorted by ``load / bw`` (seconds per byte-unit at full rate when loads are in GB), worst first.

    >>> from topology import build_node
    >>> t = build_node("dgx-h100")
    >>> link_utilisation(t, route_flows(t, [("node0/gpu0", "node0/nic0", 63.0)]))[0]
    (('node0/gpu0', 'node0/pcie0', 0), 1.0)
    """
    attrs = _link_attrs(view(topo), topo)
    out = [(e, load / attrs[e]["bw"]) for e, load in loads.items()]
    out.sort(key=lambda x: (-x[1], x[0][0], x[0][1]))
    return out


__all__ = ["POLICIES", "Edge", "flow_paths", "link_utilisation", "nearest_port", "route_flows"]
