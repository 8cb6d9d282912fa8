"""Paths between devices with NCCL's path classes, GPU bandwidth matrices and bisection bandwidth.

NCCL (``src/graph/paths.cc``) describes the route between two devices by a
*path type* -- the worst kind of hop on it -- and a *bandwidth* -- the
narrowest hop. Planners that agree with NCCL's view of a machine use the same
two numbers, so this module computes them on a :class:`~topology.model.Topology`.

Hop classes (an edge's class, the path's class is the maximum):

========  ===================================================================
NVL       an NVLink, GPU<->GPU or GPU<->NVSwitch (the NVSwitch planes of one
          NVLink domain act as one switch, as NCCL collapses them into one
          NVS node; the bandwidth to it is the sum over the planes)
NVB       an NVLink hop *out of* an intermediate GPU (GPU relay)
C2C       an NVLink-C2C host link (edge attribute ``c2c``; Grace Hopper/GB200)
PIX       a PCIe link through a single PCIe switch
PXB       a PCIe link between two PCIe switches (several bridges, no host bridge)
P2C       PCIe to/from a CPU that the GPU reaches over C2C (GPU -> Grace -> NIC)
PXN       a PCIe hop out of an intermediate GPU: GPU -> NVLink -> GPU -> NIC
PHB       a PCIe link to or from a CPU (host bridge) otherwise
SYS       the SMP interconnect between CPU sockets
NET       a network link
========  ===================================================================

Which path (NCCL's rule, extended): among all paths pick the best class, then
the widest bottleneck, then the fewest *network* hops, then the lowest sum of
hop classes (so a receiving NIC writes to its GPU through the PCIe switch
rather than through the CPU, as GPUDirect RDMA does), then the fewest hops.
The network-hop rule breaks ties between equally wide inter-host paths in
favour of the rail-local one -- for GPU *i* of one host to GPU *j* of another,
moving over NVLink to local GPU *j* first and using rail *j* (NCCL's PXN)
rather than crossing a spine -- because it keeps traffic off the fabric's upper
tiers, which is what NCCL's PXN does on rail-optimised fabrics. When the spine
path is wider (an oversubscribed or narrow spine), the PXN path wins on
bandwidth anyway.

Transit rules, so that paths are ones a real system would use:

* devices are grouped into *islands*: the connected components of the graph
  without network links and network switches (one server, or one multi-node
  NVLink domain such as a GB200 NVL72 rack);
* a path between two islands starts in the source island, crosses only
  network switches (or a direct cable) and ends in the destination island; it
  never transits a third server, never re-enters the source island and never
  leaves the destination island again. A path inside one island stays inside it;
* a GPU relays only traffic that reached it over NVLink (NCCL's NVB/PXN).

Bandwidths are GB/s per direction; latencies are the sum of the links'
``latency_us``. A path from a device to itself is ``LOC`` with NCCL's
``LOC_BW`` (5000 GB/s).

Results are cached per topology. The cache is rebuilt when the number of
nodes changes; after any other edit (a link added, removed or re-rated), call
:func:`clear_cache` -- checking every link on every query would cost more than
most queries (tens of ms on a 1024-GPU cluster).

>>> from topology import build_cluster
>>> t = build_cluster(2)
>>> p = gpu_path(t, "node0/gpu0", "node0/gpu5")
>>> p.path_type.name, p.bw
('NVL', 450.0)
>>> p = gpu_path(t, "node0/gpu0", "node1/gpu3")   # rail 3 via NVLink to local GPU 3 (PXN style)
>>> p.path_type.name, p.bw, p.nodes[:3]
('NET', 50.0, ('node0/gpu0', 'node0/nvs0', 'node0/gpu3'))
"""

from __future__ import annotations

import heapq
import math
import weakref
from collections import Counter
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import networkx as nx
import numpy as np

from .errors import TopologyError
from .model import LinkKind, NodeKind, Topology

LOC_BW = 5000.0  # NCCL's bandwidth of a device to itself (src/graph/topo.h: LOC_BW)


class PathType(IntEnum):
    """NCCL's path types, best first (``src/include/graph.h``)."""

    LOC = 0
    NVL = 1
    NVB = 2
    C2C = 3
    PIX = 4
    PXB = 5
    P2C = 6
    PXN = 7
    PHB = 8
    SYS = 9
    NET = 10
    DIS = 11


@dataclass(frozen=True)
class GpuPath:
    """The chosen path between two devices.

    ``nodes`` are node ids of ``topo.graph``; a crossing of an NVSwitch layer is
    named by the domain's first NVSwitch plane (traffic is striped over all
    planes, see :func:`topology.routing.flow_paths` for the per-plane split).
    """

    src: str
    dst: str
    path_type: PathType
    bw: float
    latency_us: float
    nodes: tuple[str, ...]

    @property
    def hops(self) -> int:
        return max(0, len(self.nodes) - 1)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; a disconnected pair has ``latency_us`` None."""
        return {
            "src": self.src, "dst": self.dst, "path_type": self.path_type.name, "bw": self.bw,
            "latency_us": self.latency_us if math.isfinite(self.latency_us) else None, "hops": self.hops, "nodes": list(self.nodes),
        }


# --------------------------------------------------------------------------------------------
# The indexed view: NVSwitch planes collapsed, adjacency as tuples, islands, ports.
# --------------------------------------------------------------------------------------------

# link-kind codes in the view
_NVL, _PCI, _CPU, _NET = 0, 1, 2, 3
_LK = {LinkKind.NVLINK: _NVL, LinkKind.PCIE: _PCI, LinkKind.CPU: _CPU, LinkKind.NETWORK: _NET}
# node-kind codes in the view
_GPU, _NVS, _PCIESW, _CPUN, _NIC, _SW = 0, 1, 2, 3, 4, 5
_NK = {NodeKind.GPU: _GPU, NodeKind.NVSWITCH: _NVS, NodeKind.PCIE_SWITCH: _PCIESW, NodeKind.CPU: _CPUN, NodeKind.NIC: _NIC, NodeKind.SWITCH: _SW}


@dataclass
class VEdge:
    """One link of the view: ``phys`` lists the physical ``(u, v, key, bw)`` edges it stands for."""

    v: int
    bw: float
    latency_us: float
    lk: int
    c2c: bool
    phys: list[tuple[str, str, Any, float]]


@dataclass
class _View:
    names: list[str]
    index: dict[str, int]
    kind: list[int]
    adj: list[list[VEdge]]
    island: list[int]  # -1 for network switches
    rep: dict[str, str]  # physical NVSwitch -> the plane that names its group
    groups: dict[int, list[str]]  # view index of a group -> its physical planes
    c2c_cpus: dict[int, frozenset[int]]  # GPU -> CPUs it reaches over C2C
    fingerprint: tuple[int, int]
    attrs: list[dict[str, Any]] = field(default_factory=list)  # node attribute dicts of topo.graph
    cache: dict[str, Any] = field(default_factory=dict)

    def index_attr(self, a: int) -> Any:
        return self.attrs[a].get("index")

    def rail_attr(self, a: int) -> Any:
        return self.attrs[a].get("rail")

    def idx(self, node: str) -> int:
        try:
            return self.index[self.rep.get(node, node)]
        except KeyError:
            raise TopologyError(f"unknown node {node!r}") from None


_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _fingerprint(topo: Topology) -> tuple[int, int]:
    # Changes made through Topology bump its revision; direct graph edits must call topo.touch() or clear_cache().
    return topo.graph.number_of_nodes(), getattr(topo, "revision", 0)


def clear_cache(topo: Topology) -> None:
    """Forget cached paths, matrices and routes of ``topo`` (call after editing it)."""
    _VIEWS.pop(topo.graph, None)


def view(topo: Topology, *, check: bool = True) -> _View:
    """The cached indexed view of ``topo`` (rebuilt after changes made through the Topology, ``topo.touch()`` or :func:`clear_cache`)."""
    v = _VIEWS.get(topo.graph)
    if v is not None and (not check or v.fingerprint == _fingerprint(topo)):
        return v
    v = _build_view(topo)
    _VIEWS[topo.graph] = v
    return v


def link_attrs(topo: Topology) -> dict[tuple[str, str, Any], dict[str, Any]]:
    """Every link's attribute dict keyed ``(u, v, key)``: the graph's own dicts, read without networkx's edge views.

    ``link_attrs(topo)[e]`` is the very dict ``topo.graph.edges[e]`` returns, at a third of the cost; the table is
    built once and kept with the cached view (see :func:`clear_cache`), for the loops that read the ``bw`` or
    ``kind`` of every link a routing touched.

    >>> from topology import build_node
    >>> t = build_node("dgx-h100")
    >>> e = ("node0/gpu0", "node0/pcie0", 0)
    >>> link_attrs(t)[e] is t.graph.edges[e], link_attrs(t)[e]["bw"]
    (True, 63.0)
    """
    return _link_attrs(view(topo), topo)


def _link_attrs(vw: _View, topo: Topology) -> dict[tuple[str, str, Any], dict[str, Any]]:
    table = vw.cache.get("link_attrs")
    if table is None:
        table = vw.cache["link_attrs"] = {(u, v, k): d for u, v, k, d in topo.graph.edges(keys=True, data=True)}
    return table


def _build_view(topo: Topology) -> _View:
    G = topo.graph
    rep: dict[str, str] = {}
    planes: dict[Any, list[str]] = {}
    for n, d in G.nodes(data=True):
        if d["kind"] == NodeKind.NVSWITCH:
            planes.setdefault(d.get("domain") or d.get("host") or n, []).append(n)
    for members in planes.values():
        for m in members:
            rep[m] = members[0]
    names = [n for n in G.nodes if rep.get(n, n) == n]
    index = {n: i for i, n in enumerate(names)}
    kind = [_NK[NodeKind(G.nodes[n]["kind"])] for n in names]
    adj: list[list[VEdge]] = [[] for _ in names]
    merged: dict[tuple[int, int], VEdge] = {}
    for u, v, k, d in G.edges(keys=True, data=True):
        a, b = index[rep.get(u, u)], index[rep.get(v, v)]
        if a == b:
            continue  # links between planes of one NVSwitch group
        lk = _LK[LinkKind(d["kind"])]
        bw = float(d["bw"])
        if lk == _NVL or kind[a] == _NVS or kind[b] == _NVS:
            # bonded NVLinks and NVSwitch planes are used together: one link of summed bandwidth
            e = merged.get((a, b))
            if e is None:
                e = merged[(a, b)] = VEdge(b, 0.0, float(d.get("latency_us", 0.0)), lk, bool(d.get("c2c")), [])
                adj[a].append(e)
            e.bw += bw
            e.phys.append((u, v, k, bw))
        else:
            adj[a].append(VEdge(b, bw, float(d.get("latency_us", 0.0)), lk, bool(d.get("c2c")), [(u, v, k, bw)]))
    for lst in adj:
        lst.sort(key=lambda e: e.v)  # deterministic neighbour order
    # islands: components over non-network links among non-switch nodes
    parent = list(range(len(names)))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, lst in enumerate(adj):
        if kind[a] == _SW:
            continue
        for e in lst:
            if e.lk != _NET and kind[e.v] != _SW:
                ra, rb = find(a), find(e.v)
                if ra != rb:
                    parent[max(ra, rb)] = min(ra, rb)
    roots: dict[int, int] = {}
    island = []
    for a in range(len(names)):
        if kind[a] == _SW:
            island.append(-1)
        else:
            island.append(roots.setdefault(find(a), len(roots)))
    c2c: dict[int, set[int]] = {}
    for a, lst in enumerate(adj):
        if kind[a] == _GPU:
            for e in lst:
                if e.c2c and kind[e.v] == _CPUN:
                    c2c.setdefault(a, set()).add(e.v)
    groups = {index[m[0]]: m for m in planes.values()}
    c2c_cpus = {g: frozenset(c) for g, c in c2c.items()}
    return _View(names, index, kind, adj, island, rep, groups, c2c_cpus, _fingerprint(topo), [G.nodes[n] for n in names])


# --------------------------------------------------------------------------------------------
# Edge classes, transit rules and the three-pass search
# --------------------------------------------------------------------------------------------


def _edge_class(vw: _View, u: int, e: VEdge, s: int, t: int) -> int:
    if e.lk == _NET:
        return PathType.NET
    if e.lk == _CPU:
        return PathType.SYS
    ku, kv = vw.kind[u], vw.kind[e.v]
    if ku == _GPU and u != s:  # leaving a relay GPU
        return PathType.NVB if e.lk == _NVL else PathType.PXN
    if e.lk == _NVL or ku == _NVS or kv == _NVS:
        return PathType.NVL
    if e.c2c:
        return PathType.C2C
    if ku == _CPUN or kv == _CPUN:
        cpu = u if ku == _CPUN else e.v
        if cpu in vw.c2c_cpus.get(s, ()) or cpu in vw.c2c_cpus.get(t, ()):
            return PathType.P2C
        return PathType.PHB
    if ku == _PCIESW and kv == _PCIESW:
        return PathType.PXB
    return PathType.PIX


def _allowed(vw: _View, u: int, e: VEdge, t: int, si: int, ti: int) -> bool:
    v = e.v
    if vw.kind[v] == _GPU and v != t and e.lk != _NVL:
        return False  # GPUs relay only NVLink traffic
    iv = vw.island[v]
    if si == ti:
        return iv == si
    iu = vw.island[u]
    if iv == -1:
        return ti == -1 or iu != ti  # never leave the destination island again
    if iv == si:
        return iu == si  # never re-enter the source island
    return iv == ti


def _search(vw: _View, s: int, t: int, max_class: int = PathType.NET, classes: bool = True) -> tuple[int, float, list[tuple[int, VEdge]]] | None:
    """Best path s -> t: (class, bottleneck bw, [(u, edge), ...]) or None when disconnected.

    Pass 1 minimises the worst hop class (bottleneck Dijkstra), pass 2 maximises
    the narrowest bandwidth among paths of that class, pass 3 minimises
    (network hops, hops) among paths meeting both.
    """
    si, ti = vw.island[s], vw.island[t]
    adj = vw.adj
    # pass 1: minimax class
    if classes:
        best = {s: 0}
        heap = [(0, s)]
        done = set()
        found = None
        while heap:
            c, u = heapq.heappop(heap)
            if u in done:
                continue
            if u == t:
                found = c
                break
            done.add(u)
            for e in adj[u]:
                if not _allowed(vw, u, e, t, si, ti):
                    continue
                ce = _edge_class(vw, u, e, s, t)
                if ce > max_class:
                    continue
                nc = c if c > ce else ce
                if nc < best.get(e.v, 99):
                    best[e.v] = nc
                    heapq.heappush(heap, (nc, e.v))
        if found is None:
            return None
        cls = found
    else:
        cls = max_class
    # pass 2: widest among class <= cls
    width = {s: math.inf}
    heap2 = [(-math.inf, s)]
    done = set()
    w_best = None
    while heap2:
        negw, u = heapq.heappop(heap2)
        if u in done:
            continue
        if u == t:
            w_best = -negw
            break
        done.add(u)
        for e in adj[u]:
            if not _allowed(vw, u, e, t, si, ti) or _edge_class(vw, u, e, s, t) > cls:
                continue
            nw = min(-negw, e.bw)
            if nw > width.get(e.v, 0.0):
                width[e.v] = nw
                heapq.heappush(heap2, (-nw, e.v))
    if w_best is None:
        return None
    # pass 3: fewest (network hops, sum of hop classes, hops) among class <= cls and bw >= w_best
    dist = {s: (0, 0, 0)}
    pred: dict[int, tuple[int, VEdge]] = {}
    heap3 = [(0, 0, 0, s)]
    done = set()
    while heap3:
        nh, cs, h, u = heapq.heappop(heap3)
        if u in done:
            continue
        if u == t:
            break
        done.add(u)
        for e in adj[u]:
            if e.bw < w_best or not _allowed(vw, u, e, t, si, ti):
                continue
            ce = _edge_class(vw, u, e, s, t)
            if ce > cls:
                continue
            nd = (nh + (e.lk == _NET), cs + ce, h + 1)
            if nd < dist.get(e.v, (1 << 30, 0, 0)):
                dist[e.v] = nd
                pred[e.v] = (u, e)
                heapq.heappush(heap3, (*nd, e.v))
    hops: list[tuple[int, VEdge]] = []
    x = t
    while x != s:
        u, e = pred[x]
        hops.append((u, e))
        x = u
    hops.reverse()
    if not classes:
        cls = max((_edge_class(vw, u, e, s, t) for u, e in hops), default=PathType.LOC)
    return cls, w_best, hops


def _p2c_sensitive(vw: _View, t: int, s: int) -> bool:
    """Whether a path s -> t can contain a PCIe hop whose class depends on ``t`` (P2C rather than PHB).

    That hop touches a CPU that ``t`` reaches over C2C and comes from a PCIe
    switch, a GPU or ``s`` itself (a NIC is never crossed, only an end).
    """
    for cpu in vw.c2c_cpus.get(t, ()):
        for e in vw.adj[cpu]:
            if e.lk == _PCI and not e.c2c and (vw.kind[e.v] in (_GPU, _PCIESW) or e.v == s):
                return True
    return False


def _search_all(
    vw: _View, s: int, targets: list[int], hops: bool = True, width_only: bool = False
) -> dict[int, tuple[int, float, int, float, list]]:
    """:func:`_search` from ``s`` to many targets of its own island at once: {t: (class, bw, hop count, widest, hops)}.

    ``widest`` is the widest path of any class, computed only with
    ``width_only`` (then the other items are placeholders; otherwise it is 0).
    Hop counts and hop lists ``[(u, edge), ...]`` come from pass 3 of
    :func:`_search` (an optimal path of the same cost; skipped when ``hops`` is false).

    A pair search depends on its target in two ways. A GPU may be *entered*
    over PCIe only when it is the target: single-source labels model that as
    terminal states (node, entered over PCIe), exactly. And a PCIe hop at a
    CPU that the target reaches over C2C is P2C rather than PHB: results are
    exact for every target unless ``_p2c_sensitive(vw, t, s)``, and callers
    fall back to :func:`_search` for those (the widest item is always exact).
    """
    static = vw.cache.get("island_moves")
    if static is None:
        # per node: its links inside its island with the class they have when the node is not the
        # source (t-independent), the end that is a CPU (for P2C), and whether they enter a GPU over PCIe
        static = vw.cache["island_moves"] = []
        for u, lst in enumerate(vw.adj):
            row = []
            for e in lst:
                if vw.island[e.v] != vw.island[u] or vw.island[u] == -1:
                    continue
                cpu = u if vw.kind[u] == _CPUN else e.v if vw.kind[e.v] == _CPUN else -1
                row.append((e, _edge_class(vw, u, e, -1, -1), cpu, vw.kind[e.v] == _GPU and e.lk != _NVL))
            static.append(row)
    src_moves = [(e, _edge_class(vw, s, e, s, -1), tv) for e, _, _, tv in static[s]]
    c2c_s = vw.c2c_cpus.get(s, ())

    def moves(u: int):
        if u == s:
            yield from src_moves
            return
        for e, ce, cpu, tv in static[u]:
            if ce == PathType.PHB and cpu in c2c_s and e.lk == _PCI and not e.c2c:
                ce = PathType.P2C
            yield e, ce, tv

    def minimax() -> dict[tuple[int, bool], int]:  # pass 1: minimax class
        best: dict[tuple[int, bool], int] = {(s, False): 0}
        heap: list = [(0, s, False)]
        done = set()
        while heap:
            c, u, term = heapq.heappop(heap)
            if (u, term) in done:
                continue
            done.add((u, term))
            if term:
                continue
            for e, ce, tv in moves(u):
                nc = c if c > ce else ce
                key = (e.v, tv)
                if nc < best.get(key, 99):
                    best[key] = nc
                    heapq.heappush(heap, (nc, e.v, tv))
        return best

    def widest(max_cls: int) -> dict[tuple[int, bool], float]:
        width: dict[tuple[int, bool], float] = {(s, False): math.inf}
        heap2: list = [(-math.inf, s, False)]
        done2 = set()
        while heap2:
            negw, u, term = heapq.heappop(heap2)
            if (u, term) in done2:
                continue
            done2.add((u, term))
            if term:
                continue
            for e, ce, tv in moves(u):
                if ce > max_cls:
                    continue
                nw = min(-negw, e.bw)
                key = (e.v, tv)
                if nw > width.get(key, 0.0):
                    width[key] = nw
                    heapq.heappush(heap2, (-nw, e.v, tv))
        return width

    def fewest(max_cls: int, min_bw: float) -> tuple[dict, dict]:
        dist: dict[tuple[int, bool], tuple[int, int, int]] = {(s, False): (0, 0, 0)}
        pred: dict[tuple[int, bool], tuple[tuple[int, bool], VEdge]] = {}
        heap3: list = [(0, 0, 0, s, False)]
        done3 = set()
        while heap3:
            nh, cs, h, u, term = heapq.heappop(heap3)
            if (u, term) in done3:
                continue
            done3.add((u, term))
            if term:
                continue
            for e, ce, tv in moves(u):
                if ce > max_cls or e.bw < min_bw:
                    continue
                nd = (nh + (e.lk == _NET), cs + ce, h + 1)
                key = (e.v, tv)
                if nd < dist.get(key, (1 << 30, 0, 0)):
                    dist[key] = nd
                    pred[key] = ((u, False), e)
                    heapq.heappush(heap3, (*nd, e.v, tv))
        return dist, pred

    def pick(labels: dict, t: int, better) -> Any:
        vals = [labels[k] for k in ((t, False), (t, True)) if k in labels]
        return better(vals) if vals else None

    if width_only:
        any_w = widest(PathType.DIS)
        return {t: (PathType.DIS, 0.0, 0, w, []) for t in targets if (w := pick(any_w, t, max)) is not None}
    best = minimax()
    cls = {t: pick(best, t, min) for t in targets}
    widths: dict[int, dict] = {}
    out: dict[int, tuple[int, float, int, float, list]] = {}
    groups: dict[tuple[int, float], list[int]] = {}
    for t in targets:
        if cls[t] is None:
            continue
        c = cls[t]
        if c not in widths:
            widths[c] = widest(c)
        w = pick(widths[c], t, max)
        groups.setdefault((c, w), []).append(t)
    for (c, w), ts in groups.items():
        if not hops:
            for t in ts:
                out[t] = (c, w, 0, 0.0, [])
            continue
        dist, pred = fewest(c, w)
        for t in ts:
            key = min((k for k in ((t, False), (t, True)) if k in dist), key=lambda k: dist[k])
            path = []
            while key != (s, False):
                prev, e = pred[key]
                path.append((prev[0], e))
                key = prev
            path.reverse()
            out[t] = (c, w, len(path), 0.0, path)
    return out


def _resolve(vw: _View, topo: Topology, node: str) -> int:
    if node not in topo.graph:
        raise TopologyError(f"unknown node {node!r}")
    return vw.idx(node)


def device_path(topo: Topology, a: str, b: str) -> GpuPath:
    """The best path between any two devices (GPU, NIC, CPU, PCIe or network switch).

    >>> from topology import build_node
    >>> t = build_node("dgx-h100")
    >>> p = device_path(t, "node0/gpu0", "node0/nic0")
    >>> p.path_type.name, p.bw, p.nodes
    ('PIX', 63.0, ('node0/gpu0', 'node0/pcie0', 'node0/nic0'))
    >>> device_path(t, "node0/gpu0", "node0/nic3").path_type.name   # via GPU 3 over NVLink
    'PXN'
    """
    vw = view(topo)
    s, t = _resolve(vw, topo, a), _resolve(vw, topo, b)
    if s == t:
        return GpuPath(a, b, PathType.LOC, LOC_BW, 0.0, (a,))
    found = _search(vw, s, t)
    if found is None:
        return GpuPath(a, b, PathType.DIS, 0.0, math.inf, ())
    cls, bw, hops = found
    nodes = (a, *(vw.names[e.v] for _, e in hops[:-1]), b)
    return GpuPath(a, b, PathType(cls), bw, sum(e.latency_us for _, e in hops), nodes)


def gpu_path(topo: Topology, a: str | int, b: str | int) -> GpuPath:
    """The path NCCL would see between two GPUs (ids or global GPU numbers).

    >>> from topology import build_node
    >>> t = build_node("dgx-h100")
    >>> gpu_path(t, 0, 7).to_dict()["path_type"], gpu_path(t, 0, 7).bw
    ('NVL', 450.0)
    """
    return device_path(topo, topo.resolve_gpu(a), topo.resolve_gpu(b))


# --------------------------------------------------------------------------------------------
# All-pairs GPU bandwidth
# --------------------------------------------------------------------------------------------


@dataclass
class BandwidthMatrix:
    """All-pairs GPU path bandwidth (GB/s) and path type (``PathType`` values) in ``gpus`` order."""

    gpus: list[str]
    bw: np.ndarray
    path_type: np.ndarray

    def position(self, gpu: str) -> int:
        if not hasattr(self, "_pos"):
            self._pos = {g: i for i, g in enumerate(self.gpus)}
        return self._pos[gpu]

    def get(self, a: str, b: str) -> tuple[PathType, float]:
        i, j = self.position(a), self.position(b)
        return PathType(int(self.path_type[i, j])), float(self.bw[i, j])

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: GPU ids, bandwidth rows (GB/s) and path-type names."""
        names = [p.name for p in PathType]
        return {"gpus": list(self.gpus), "bw": self.bw.tolist(), "path_type": [[names[int(x)] for x in row] for row in self.path_type]}


@dataclass
class _IslandData:
    gpus: list[int]  # local positions of GPUs
    ports: list[int]  # local positions of network ports
    bw: np.ndarray  # GPU x GPU
    ptype: np.ndarray
    up: np.ndarray  # GPU x port: widest bw GPU -> port
    down: np.ndarray  # port x GPU
    nearest: dict[int, int | None] | None = None  # local node -> local port it uses by default (filled by routing)


def _island_members(vw: _View) -> dict[int, list[int]]:
    if "islands" not in vw.cache:
        members: dict[int, list[int]] = {}
        for a, isl in enumerate(vw.island):
            if isl >= 0:
                members.setdefault(isl, []).append(a)
        vw.cache["islands"] = members
    return vw.cache["islands"]


def _is_port(vw: _View, a: int) -> bool:
    return vw.kind[a] != _SW and any(e.lk == _NET for e in vw.adj[a])


def _island_signature(vw: _View, nodes: list[int]) -> tuple:
    local = {a: i for i, a in enumerate(nodes)}
    node_sig = tuple((vw.kind[a], _is_port(vw, a), vw.index_attr(a), vw.rail_attr(a)) for a in nodes)
    edge_sig = []
    for a in nodes:
        for e in vw.adj[a]:
            j = local.get(e.v)
            if j is not None:
                edge_sig.append((local[a], j, round(e.bw, 9), round(e.latency_us, 9), e.lk, e.c2c))
    return node_sig, tuple(edge_sig), tuple(sorted((local[g], local[c]) for g, cs in vw.c2c_cpus.items() if g in local for c in cs))


def _island_data(vw: _View, nodes: list[int]) -> _IslandData:
    gl = [i for i, a in enumerate(nodes) if vw.kind[a] == _GPU]
    pl = [i for i, a in enumerate(nodes) if _is_port(vw, a)]
    k = len(gl)
    bw = np.zeros((k, k))
    pt = np.full((k, k), int(PathType.DIS), dtype=np.int8)
    up = np.zeros((k, len(pl)))
    down = np.zeros((len(pl), k))
    gpu_nodes = [nodes[i] for i in gl]
    for x, g in enumerate(gpu_nodes):
        found = _search_all(vw, g, gpu_nodes, hops=False)
        reach = _search_all(vw, g, [nodes[p] for p in pl], width_only=True)
        for y, h in enumerate(gpu_nodes):
            if g == h:
                bw[x, y], pt[x, y] = LOC_BW, PathType.LOC
            elif _p2c_sensitive(vw, h, g):
                f = _search(vw, g, h)
                if f is not None:
                    pt[x, y], bw[x, y] = f[0], f[1]
            elif h in found:
                pt[x, y], bw[x, y] = found[h][0], found[h][1]
        for y, p in enumerate(pl):
            up[x, y] = reach[nodes[p]][3] if nodes[p] in reach else 0.0
    for y, p in enumerate(pl):
        found = _search_all(vw, nodes[p], gpu_nodes, width_only=True)
        for x, g in enumerate(gpu_nodes):
            down[y, x] = found[g][3] if g in found else 0.0
    return _IslandData(gl, pl, bw, pt, up, down)


def _islands(vw: _View) -> dict[int, tuple[list[int], _IslandData]]:
    """Per island: its view nodes and its (shared, cached by structure) data."""
    if "island_data" not in vw.cache:
        by_sig: dict[tuple, _IslandData] = {}
        out = {}
        for isl, nodes in _island_members(vw).items():
            sig = _island_signature(vw, nodes)
            data = by_sig.get(sig)
            if data is None:
                data = by_sig[sig] = _island_data(vw, nodes)
            out[isl] = (nodes, data)
        vw.cache["island_data"] = out
        vw.cache["island_structures"] = len(by_sig)
        vw.cache["island_local"] = {a: i for nodes, _ in out.values() for i, a in enumerate(nodes)}
    return vw.cache["island_data"]


def _switch_widest(vw: _View) -> tuple[list[int], dict[int, int], np.ndarray]:
    """Switches, their positions, and the all-pairs widest-path matrix over switch-to-switch links."""
    if "switch_widest" not in vw.cache:
        sws = [a for a, k in enumerate(vw.kind) if k == _SW]
        pos = {a: i for i, a in enumerate(sws)}
        W = np.zeros((len(sws), len(sws)))
        for a in sws:
            for e in vw.adj[a]:
                j = pos.get(e.v)
                if j is not None and e.bw > W[pos[a], j]:
                    W[pos[a], j] = e.bw
        np.fill_diagonal(W, math.inf)
        for m in range(len(sws)):  # Floyd-Warshall in the (max, min) semiring
            np.maximum(W, np.minimum(W[:, m : m + 1], W[m : m + 1, :]), out=W)
        vw.cache["switch_widest"] = (sws, pos, W)
    return vw.cache["switch_widest"]


@dataclass
class _MatrixParts:
    """The all-pairs matrix before it is expanded: GPUs, their islands, and the inter-island bandwidth by row and column class.

    Between islands, GPU ``i`` to GPU ``j`` has bandwidth ``classes_bw[row_class[i], col_class[j]]`` (when ``classes_bw`` is
    set: a fabric of switches and no cables straight between islands); inside an island, its ``_IslandData`` block.
    """

    gpus: list[str]
    idx: np.ndarray
    isl: np.ndarray
    lpos: np.ndarray
    islands: dict[int, tuple[list[int], _IslandData]]
    vw: _View
    classes_bw: np.ndarray | None = None
    row_class: np.ndarray | None = None
    col_class: np.ndarray | None = None
    direct: bool = False


def _matrix_parts(topo: Topology, gpus: list[str] | None) -> _MatrixParts:
    vw = view(topo)
    gpus = topo.gpus() if gpus is None else [topo.resolve_gpu(g) for g in gpus]
    n = len(gpus)
    idx = np.array([vw.idx(g) for g in gpus], dtype=np.int64)
    islands = _islands(vw)
    isl = np.array([vw.island[a] for a in idx], dtype=np.int64)
    # position of each GPU inside its island's GPU list
    local_pos = {}
    for nodes, data in islands.values():
        for x, i in enumerate(data.gpus):
            local_pos[nodes[i]] = x
    lpos = np.array([local_pos[a] for a in idx], dtype=np.int64)
    parts = _MatrixParts(gpus, idx, isl, lpos, islands, vw, direct=_has_direct_port_links(vw))
    sws, spos, W = _switch_widest(vw)
    S = len(sws)
    if S or parts.direct:
        into: dict[int, list[tuple[int, float]]] = {}  # port -> [(switch, bw)] of the links into it
        for j_sw in sws:
            for e in vw.adj[j_sw]:
                if vw.kind[e.v] != _SW:
                    into.setdefault(e.v, []).append((j_sw, e.bw))
        E = np.zeros((n, max(S, 1)))
        Ing = np.zeros((max(S, 1), n))
        for i_l in np.unique(isl):
            nodes, data = islands[int(i_l)]
            Ei = np.zeros((len(data.gpus), max(S, 1)))
            Ii = np.zeros((max(S, 1), len(data.gpus)))
            for y, p in enumerate(data.ports):
                a = nodes[p]
                for e in vw.adj[a]:
                    j = spos.get(e.v)
                    if j is not None:
                        np.maximum(Ei[:, j], np.minimum(data.up[:, y], e.bw), out=Ei[:, j])
            for y, p in enumerate(data.ports):
                for j_sw, ebw in into.get(nodes[p], ()):
                    np.maximum(Ii[spos[j_sw], :], np.minimum(ebw, data.down[y, :]), out=Ii[spos[j_sw], :])
            members = np.nonzero(isl == i_l)[0]
            E[members] = Ei[lpos[members]]
            Ing[:, members] = Ii[:, lpos[members]]
        if S:
            Eu, rinv = np.unique(E, axis=0, return_inverse=True)
            Iu, cinv = np.unique(Ing, axis=1, return_inverse=True)
            vals = np.unique(np.concatenate([Eu.ravel(), Iu.ravel(), W[np.isfinite(W)].ravel()]))
            vals = vals[vals > 0][::-1]
            bu = np.zeros((len(Eu), Iu.shape[1]))
            for theta in vals:
                A = (Eu >= theta).astype(np.float32)
                M = (theta <= W).astype(np.float32)
                B = (Iu >= theta).astype(np.float32)
                reach = ((A @ M) @ B) > 0
                bu[reach & (bu == 0)] = theta
            parts.classes_bw, parts.row_class, parts.col_class = bu, rinv.ravel(), cinv.ravel()
    return parts


def bandwidth_matrix(topo: Topology, gpus: list[str] | None = None) -> BandwidthMatrix:
    """Path bandwidth and type for every ordered GPU pair, equal to :func:`gpu_path` pair by pair.

    Paths inside an island are searched once per distinct island *structure*
    (identically built servers share one result). Paths between islands are
    all ``NET`` and their bandwidth is
    ``max over ports p, q and switches s, t of min(up[a,p], bw(p,s), W[s,t], bw(t,q), down[q,b])``,
    computed for all pairs at once: each threshold of the few distinct
    bandwidths is one boolean matrix product, on de-duplicated rows.

    >>> from topology import build_cluster
    >>> m = bandwidth_matrix(build_cluster(2))
    >>> m.bw.shape, float(m.bw[0, 1]), float(m.bw[0, 9]), PathType(int(m.path_type[0, 9])).name
    ((16, 16), 450.0, 50.0, 'NET')
    """
    parts = _matrix_parts(topo, gpus)
    gpus, idx, isl, lpos, islands, vw = parts.gpus, parts.idx, parts.isl, parts.lpos, parts.islands, parts.vw
    n = len(gpus)
    bw = np.zeros((n, n))
    pt = np.full((n, n), int(PathType.DIS), dtype=np.int8)
    if parts.classes_bw is not None:
        bw = parts.classes_bw[parts.row_class][:, parts.col_class]
    if parts.direct:
        _direct_port_links(vw, islands, isl, lpos, bw)
    pt[bw > 0] = PathType.NET
    # intra-island blocks
    for i_l in np.unique(isl):
        members = np.nonzero(isl == i_l)[0]
        _, data = islands[int(i_l)]
        sub = np.ix_(members, members)
        bw[sub] = data.bw[np.ix_(lpos[members], lpos[members])]
        pt[sub] = data.ptype[np.ix_(lpos[members], lpos[members])]
    # a GPU listed twice is LOC with itself
    same = idx[:, None] == idx[None, :]
    bw[same], pt[same] = LOC_BW, PathType.LOC
    return BandwidthMatrix(gpus, bw, pt)


def _has_direct_port_links(vw: _View) -> bool:
    return bool(_direct_links(vw))


def _direct_links(vw: _View) -> list[tuple[int, VEdge]]:
    if "direct" not in vw.cache:
        vw.cache["direct"] = [
            (a, e) for a, lst in enumerate(vw.adj) if vw.kind[a] != _SW for e in lst
            if e.lk == _NET and vw.kind[e.v] != _SW and vw.island[e.v] != vw.island[a]
        ]
    return vw.cache["direct"]


def _direct_port_links(vw: _View, islands, isl: np.ndarray, lpos: np.ndarray, bw: np.ndarray) -> None:
    """Network cables straight from a port of one island to a port of another (no switch)."""
    for a, e in _direct_links(vw):
        ia, ib = vw.island[a], vw.island[e.v]
        src = np.nonzero(isl == ia)[0]
        dst = np.nonzero(isl == ib)[0]
        if not len(src) or not len(dst):
            continue
        na, da = islands[ia]
        nb, db = islands[ib]
        up = da.up[lpos[src], da.ports.index(na.index(a))]
        down = db.down[db.ports.index(nb.index(e.v)), lpos[dst]]
        cand = np.minimum(np.minimum(up[:, None], e.bw), down[None, :])
        bw[np.ix_(src, dst)] = np.maximum(bw[np.ix_(src, dst)], cand)


def bandwidth_classes(topo: Topology, gpus: list[str] | None = None) -> list[dict[str, Any]]:
    """Distinct (path type, bandwidth) classes over ordered pairs of distinct GPUs, best first.

    Counted without expanding the all-pairs matrix: pairs between islands by (row class, column class) of
    :func:`bandwidth_matrix`'s de-duplicated inter-island figure, minus the pairs that fall inside one island, plus each
    island's own block. Equal to counting :func:`bandwidth_matrix` entry by entry (tested); seconds instead of minutes
    on 8,192 GPUs. Falls back to the matrix with cables straight between islands or a GPU listed twice.

    >>> from topology import build_cluster
    >>> [(c["path_type"], c["bw"], c["pairs"]) for c in bandwidth_classes(build_cluster(2))]
    [('NVL', 450.0, 112), ('NET', 50.0, 128)]
    """
    parts = _matrix_parts(topo, gpus)
    n = len(parts.gpus)
    if parts.direct or len(np.unique(parts.idx)) != n:
        return matrix_classes(bandwidth_matrix(topo, gpus))
    inter = parts.classes_bw if parts.classes_bw is not None else np.zeros((1, 1))
    rows = parts.row_class if parts.row_class is not None else np.zeros(n, dtype=np.int64)
    cols = parts.col_class if parts.col_class is not None else np.zeros(n, dtype=np.int64)
    R, C = inter.shape
    pairs = np.outer(np.bincount(rows, minlength=R), np.bincount(cols, minlength=C))
    counts: Counter[tuple[int, float]] = Counter()
    blocks: dict[tuple[int, bytes], Counter[tuple[int, float]]] = {}  # identical islands share their block's count
    order = np.argsort(parts.isl, kind="stable")
    starts = np.flatnonzero(np.r_[True, parts.isl[order][1:] != parts.isl[order][:-1]])
    for members in np.split(order, starts[1:]) if n else []:
        pairs -= np.outer(np.bincount(rows[members], minlength=R), np.bincount(cols[members], minlength=C))
        data = parts.islands[int(parts.isl[members[0]])][1]
        lp = parts.lpos[members]
        key = (id(data), lp.tobytes())
        if key not in blocks:
            sub = np.ix_(lp, lp)
            off = ~np.eye(len(lp), dtype=bool)
            blocks[key] = Counter(zip(data.ptype[sub][off].astype(int).tolist(), np.round(data.bw[sub][off], 9).tolist(), strict=True))
        counts.update(blocks[key])
    for r, c in zip(*np.nonzero(pairs), strict=True):
        bw = float(np.round(inter[r, c], 9))
        counts[(int(PathType.NET) if bw > 0 else int(PathType.DIS), bw)] += int(pairs[r, c])
    return _class_rows(counts)


def matrix_classes(m: BandwidthMatrix) -> list[dict[str, Any]]:
    """:func:`bandwidth_classes` counted entry by entry over an expanded matrix (the reference; memory and time grow as n^2).

    >>> from topology import build_cluster
    >>> matrix_classes(bandwidth_matrix(build_cluster(2))) == bandwidth_classes(build_cluster(2))
    True
    """
    off = ~np.eye(len(m.gpus), dtype=bool)
    if not off.any():
        return []
    bws, bw_code = np.unique(np.round(m.bw[off], 9), return_inverse=True)
    code = m.path_type[off].astype(np.int64) * len(bws) + bw_code.ravel()
    uniq, counts = np.unique(code, return_counts=True)
    return _class_rows(Counter({(int(c // len(bws)), float(bws[c % len(bws)])): int(k) for c, k in zip(uniq.tolist(), counts.tolist(), strict=True)}))


def _class_rows(counts: Counter[tuple[int, float]]) -> list[dict[str, Any]]:
    rows = sorted(((pt, bw, k) for (pt, bw), k in counts.items() if k), key=lambda r: (r[0], -r[1]))
    return [{"path_type": PathType(pt).name, "bw": bw, "pairs": k} for pt, bw, k in rows]


# --------------------------------------------------------------------------------------------
# Bisection bandwidth
# --------------------------------------------------------------------------------------------


def _host_ports(topo: Topology, vw: _View) -> dict[str, list[int]]:
    ports: dict[str, list[int]] = {}
    for a, name in enumerate(vw.names):
        h = topo.graph.nodes[name].get("host")
        if h is not None and _is_port(vw, a):
            ports.setdefault(h, []).append(a)
    return ports


def _max_flow(vw: _View, sources: list[int], sinks: list[int]) -> float:
    """Max flow over the network from the ports ``sources`` to the ports ``sinks`` (no host transit).

    The source ports only send (they have unlimited supply) and the sink ports
    only receive, so they are contracted into the super source and sink: the
    flow network is the switches plus two nodes, exact and small.
    """
    src_set, dst_set = set(sources), set(sinks)
    cap: dict[tuple[Any, Any], float] = {}

    def node(a: int) -> Any:
        return "S" if a in src_set else "T" if a in dst_set else a

    for a, lst in enumerate(vw.adj):
        if vw.kind[a] != _SW and a not in src_set:
            continue  # only the source half's ports send into the fabric
        for e in lst:
            if e.lk != _NET or (vw.kind[e.v] != _SW and e.v not in dst_set):
                continue  # only the sink half's ports take flow out of it
            u, v = node(a), node(e.v)
            if u != v and v != "S" and u != "T":
                cap[(u, v)] = cap.get((u, v), 0.0) + e.bw
    direct = cap.pop(("S", "T"), 0.0)
    F = nx.DiGraph()
    F.add_weighted_edges_from(((u, v, c) for (u, v), c in cap.items()), weight="capacity")
    if "S" not in F or "T" not in F:
        return direct
    return direct + float(nx.maximum_flow_value(F, "S", "T"))


def bisection_bandwidth(topo: Topology) -> dict[str, Any]:
    """Network bandwidth (GB/s per direction) between two equal halves of the hosts, minimised over a few cuts.

    Each cut splits the hosts in two halves; its bandwidth is the max flow over
    the network from the first half's NIC ports to the second half's (and the
    reverse; the smaller counts), with links at their ``bw`` and no transit
    through other hosts. The cuts tried are: hosts in order (first half /
    second half), hosts grouped by the set of leaf switches they attach to
    (scalable unit, rack, pod) then halved, and interleaved (even / odd). The
    true bisection is the minimum over *all* balanced cuts, so this is an upper
    bound on it; for the symmetric fabrics the builders make (rail-optimized,
    leaf-spine, k-ary fat tree) the group cut is a minimum cut and the result
    is exact: ``hosts/2 * NICs * NIC bw`` when non-blocking, divided by the
    oversubscription when the spine limits, ``k^3/8 * link bw`` for a fat tree.
    NVLink between hosts of one NVLink domain is not counted (network only).

    >>> from topology import build_cluster
    >>> bisection_bandwidth(build_cluster(4))["bw"]
    800.0
    """
    vw = view(topo)
    ports = _host_ports(topo, vw)
    hosts = [h for h in topo.hosts() if h in ports]
    if len(hosts) < 2:
        return {"bw": 0.0, "cut": "fewer than two hosts with network ports", "cuts": {}}
    half = len(hosts) // 2

    def leaf_key(h: str) -> tuple:
        leaves = sorted({vw.names[e.v] for p in ports[h] for e in vw.adj[p] if vw.kind[e.v] == _SW})
        return tuple(leaves)

    order = {h: i for i, h in enumerate(hosts)}
    grouped = sorted(hosts, key=lambda h: (leaf_key(h), order[h]))
    even = set(hosts[0::2][:half])  # with an odd count the last even host joins the other side
    cuts = {
        "hosts in order, first half | second half": (hosts[:half], hosts[half:]),
        "hosts grouped by leaf switches (scalable unit / rack / pod), halved": (grouped[:half], grouped[half:]),
        "interleaved hosts, even | odd": ([h for h in hosts if h in even], [h for h in hosts if h not in even]),
    }
    results: dict[str, float] = {}
    seen: dict[frozenset, float] = {}
    for name, (a, b) in cuts.items():
        key = frozenset(a)
        if key in seen:
            results[name] = seen[key]
            continue
        pa = [p for h in a for p in ports[h]]
        pb = [p for h in b for p in ports[h]]
        value = min(_max_flow(vw, pa, pb), _max_flow(vw, pb, pa))
        seen[key] = value
        results[name] = value
    cut = min(results, key=lambda k: results[k])
    return {"bw": results[cut], "cut": cut, "cuts": results}


__all__ = [
    "LOC_BW", "BandwidthMatrix", "GpuPath", "PathType", "bandwidth_classes", "bandwidth_matrix", "bisection_bandwidth",
    "clear_cache", "device_path", "gpu_path", "link_attrs",
]
