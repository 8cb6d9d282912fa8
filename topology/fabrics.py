"""Fabric builders: cable the NICs of many servers through network switches.

A fabric builder takes the NIC lists that node builders returned (one list per
host, in rail order) and adds switches and network links. ``build_cluster``
puts node and fabric builders together. Three fabrics exist:

``rail-optimized``
    NVIDIA SuperPOD style: NIC *i* of every host of a scalable unit goes to
    that unit's leaf *i* (rail *i*); leaves connect to spine groups.
``leaf-spine``
    Two-tier Clos with top-of-rack leaves: all NICs of a host go to its leaf.
``fat-tree``
    The k-ary fat tree of Al-Fares et al. (SIGCOMM 2008), edge/aggregation/core.

Spine-group aggregation (rail-optimized and leaf-spine): a spine node may stand
for a *group* of physical spine switches. All cables between one leaf and one
spine group are one link whose ``bw`` is their sum; ``count`` is their number
when it is a whole number. ECMP spreads over the spine groups. This keeps
8192-GPU clusters at ~10^5 links while keeping every leaf's uplink capacity,
the bisection bandwidth and the oversubscription ratio exact; what it hides is
the imbalance of ECMP hashing *inside* a group. The fat tree is built switch by
switch and cable by cable, with no aggregation.

Every fabric records its parameters in ``topo.meta["fabric"]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from . import hardware as hw
from .builders import NVLINK_DOMAIN_HOSTS, add_hosts, node_builder
from .errors import TopologyError
from .model import LinkKind, NodeKind, SwitchTier, Topology


def _nic_bw(topo: Topology, nic: str) -> float:
    return hw.nic_bw(topo.graph.nodes[nic].get("speed_gbps", 400))


class _Links:
    """Collects duplex links and adds them to the graph in one ``add_edges_from`` call.

    Same result as :meth:`Topology.add_link` per link (two directed edges with
    ``kind``, float ``bw``, ``latency_us`` and extra attributes), without the
    per-call enum conversion and node look-ups (about a fifth of the time of a
    1024-node fabric); the ends are checked once, at ``commit``.
    """

    def __init__(self, topo: Topology):
        self.topo = topo
        self.edges: list[tuple[str, str, dict[str, Any]]] = []

    def add(self, u: str, v: str, bw: float, latency_us: float, **attrs: Any) -> None:
        if not bw > 0:
            raise TopologyError(f"link {u} -> {v}: bandwidth must be positive, got {bw!r}")
        data = {"kind": LinkKind.NETWORK, "bw": float(bw), "latency_us": float(latency_us), **attrs}
        self.edges.append((u, v, data))
        self.edges.append((v, u, dict(data)))

    def commit(self) -> None:
        graph = self.topo.graph
        for u, v, _ in self.edges[::2]:
            for end in (u, v):
                if end not in graph:
                    raise TopologyError(f"link {u} -> {v}: unknown node {end!r}")
        graph.add_edges_from(self.edges)
        self.topo.touch()
        self.edges = []


def _check_hosts(name: str, nics_by_host: Sequence[Sequence[str]]) -> None:
    if not nics_by_host:
        raise TopologyError(f"{name}: no hosts to connect")
    for i, nics in enumerate(nics_by_host):
        if not nics:
            raise TopologyError(f"{name}: host #{i} has no NICs, so it cannot join a network fabric")


def _check_oversubscription(name: str, oversubscription: float) -> None:
    if not oversubscription >= 1:
        raise TopologyError(f"{name}: oversubscription must be >= 1 (downlink:uplink), got {oversubscription!r}")


def _whole(x: float) -> dict[str, int]:
    """``{"count": n}`` when ``x`` is (numerically) the whole number n >= 1, else nothing."""
    n = round(x)
    return {"count": n} if n >= 1 and abs(x - n) < 1e-9 else {}


def rail_optimized(
    topo: Topology,
    nics_by_host: Sequence[Sequence[str]],
    *,
    hosts_per_su: int = 32,
    spines: int | None = None,
    oversubscription: float = 1.0,
) -> None:
    """Rail-optimized fat tree: NIC *i* of every host in a scalable unit (SU) goes to leaf *i* of that SU.

    Hosts are grouped into SUs of ``hosts_per_su`` (32 DGX in NVIDIA's SuperPOD
    reference architecture). Each leaf's uplink capacity is its downlink
    capacity divided by ``oversubscription`` and is spread evenly over
    ``spines`` spine groups (default: one per rail); see the module docstring
    for what a spine group is. Leaves are ``su<s>/leaf<rail>``, spines ``spine<j>``.

    >>> from topology.builders import add_dgx_h100
    >>> t = Topology(); nics = [add_dgx_h100(t, f"n{i}") for i in range(2)]
    >>> rail_optimized(t, nics)
    >>> len(t.switches("leaf")), len(t.switches("spine"))
    (8, 8)
    """
    _check_hosts("rail_optimized", nics_by_host)
    rails = len(nics_by_host[0])
    if any(len(n) != rails for n in nics_by_host):
        raise TopologyError("rail_optimized: every host must have the same number of NICs (one per rail)")
    _check_oversubscription("rail_optimized", oversubscription)
    if hosts_per_su < 1:
        raise TopologyError(f"rail_optimized: hosts_per_su must be >= 1, got {hosts_per_su}")
    spines = spines or rails
    if spines < 1:
        raise TopologyError(f"rail_optimized: spines must be >= 1, got {spines}")
    sus = math.ceil(len(nics_by_host) / hosts_per_su)
    spine_ids = [topo.add_node(f"spine{j}", NodeKind.SWITCH, tier=SwitchTier.SPINE, index=j) for j in range(spines)]
    links = _Links(topo)
    for su in range(sus):
        members = nics_by_host[su * hosts_per_su : (su + 1) * hosts_per_su]
        for rail in range(rails):
            leaf = topo.add_node(f"su{su}/leaf{rail}", NodeKind.SWITCH, tier=SwitchTier.LEAF, rail=rail, pod=su, index=rail)
            down = 0.0
            for host_nics in members:
                nic = host_nics[rail]
                bw = _nic_bw(topo, nic)
                links.add(nic, leaf, bw, hw.LATENCY_US["nic"], rail=rail)
                down += bw
            up = down / oversubscription / spines
            cables = _whole(len(members) / oversubscription / spines)
            for spine in spine_ids:
                links.add(leaf, spine, up, hw.LATENCY_US["switch"], **cables)
    links.commit()
    topo.meta["fabric"] = {"kind": "rail-optimized", "hosts_per_su": hosts_per_su, "spines": spines, "oversubscription": oversubscription}


def leaf_spine(
    topo: Topology,
    nics_by_host: Sequence[Sequence[str]],
    *,
    hosts_per_leaf: int | None = None,
    spines: int | None = None,
    oversubscription: float = 1.0,
    leaf_ports: int = hw.SWITCH_PORTS[hw.DEFAULT_SWITCH],
) -> None:
    """Two-tier leaf-spine (top-of-rack) fabric: every NIC of a host goes to the host's leaf.

    Hosts fill leaves ``leaf0, leaf1, ...`` in order, ``hosts_per_leaf`` each.
    The default fills a ``leaf_ports``-port switch (64, Quantum-2 QM9700):
    ``leaf_ports * o / (1 + o)`` ports face the hosts at oversubscription ``o``.
    Each leaf's uplink capacity is its downlink capacity divided by
    ``oversubscription``, spread evenly over ``spines`` spine groups ``spine<j>``;
    by default one per uplink cable of a full leaf, the textbook Clos rule
    that every leaf has one cable to every spine.

    >>> from topology.builders import add_dgx_h100
    >>> t = Topology(); nics = [add_dgx_h100(t, f"n{i}") for i in range(6)]
    >>> leaf_spine(t, nics)  # 64-port leaves at 1:1 take 4 DGX (32 NICs) each
    >>> len(t.switches("leaf")), len(t.switches("spine"))
    (2, 32)
    """
    _check_hosts("leaf_spine", nics_by_host)
    _check_oversubscription("leaf_spine", oversubscription)
    widest = max(len(n) for n in nics_by_host)
    if hosts_per_leaf is None:
        down_ports = int(leaf_ports * oversubscription / (1 + oversubscription))
        hosts_per_leaf = max(1, down_ports // widest)
    if hosts_per_leaf < 1:
        raise TopologyError(f"leaf_spine: hosts_per_leaf must be >= 1, got {hosts_per_leaf}")
    if spines is None:
        spines = max(1, math.ceil(hosts_per_leaf * widest / oversubscription))
    if spines < 1:
        raise TopologyError(f"leaf_spine: spines must be >= 1, got {spines}")
    leaves = math.ceil(len(nics_by_host) / hosts_per_leaf)
    spine_ids = [topo.add_node(f"spine{j}", NodeKind.SWITCH, tier=SwitchTier.SPINE, index=j) for j in range(spines)]
    links = _Links(topo)
    for li in range(leaves):
        leaf = topo.add_node(f"leaf{li}", NodeKind.SWITCH, tier=SwitchTier.LEAF, index=li, pod=li)
        down = 0.0
        ports = 0
        for host_nics in nics_by_host[li * hosts_per_leaf : (li + 1) * hosts_per_leaf]:
            for nic in host_nics:
                bw = _nic_bw(topo, nic)
                links.add(nic, leaf, bw, hw.LATENCY_US["nic"], rail=topo.graph.nodes[nic].get("rail"))
                down += bw
                ports += 1
        up = down / oversubscription / spines
        cables = _whole(ports / oversubscription / spines)
        for spine in spine_ids:
            links.add(leaf, spine, up, hw.LATENCY_US["switch"], **cables)
    links.commit()
    topo.meta["fabric"] = {
        "kind": "leaf-spine", "hosts_per_leaf": hosts_per_leaf, "spines": spines,
        "oversubscription": oversubscription, "leaf_ports": leaf_ports,
    }


def fat_tree_ports(k: int) -> int:
    """Host ports of a k-ary fat tree: k^3/4 (Al-Fares et al., SIGCOMM 2008).

    >>> fat_tree_ports(4), fat_tree_ports(32)
    (16, 8192)
    """
    return k**3 // 4


def fat_tree(topo: Topology, nics_by_host: Sequence[Sequence[str]], *, k: int | None = None, link_gbps: float | None = None) -> None:
    """The k-ary fat tree of Al-Fares, Loukissas and Vahdat (SIGCOMM 2008).

    ``k`` pods, each with k/2 edge switches ``pod<p>/edge<e>`` (tier leaf) and
    k/2 aggregation switches ``pod<p>/agg<a>`` (tier spine) wired as a complete
    bipartite graph; (k/2)^2 core switches ``core<c>`` (tier core), where core
    ``c = a*(k/2) + j`` connects to aggregation switch ``a`` of every pod. Each
    edge switch has k/2 host ports, k^3/4 in all. The hosts' NICs fill the
    host ports in order, host by host (so one host's NICs may span edges and
    pods). Every cable runs at ``link_gbps`` (default: the fastest NIC), as
    all switches are identical k-port switches; the fabric is 1:1 (full
    bisection). ``k`` defaults to the smallest even k whose k^3/4 ports hold
    every NIC; all switches of the k-ary tree are built, used or not.

    >>> from topology.builders import add_dgx_h100
    >>> t = Topology(); nics = [add_dgx_h100(t, "n0"), add_dgx_h100(t, "n1")]
    >>> fat_tree(t, nics, k=4)
    >>> [len(t.switches(tier)) for tier in ("leaf", "spine", "core")]
    [8, 8, 4]
    """
    _check_hosts("fat_tree", nics_by_host)
    ports = [nic for nics in nics_by_host for nic in nics]
    if k is None:
        k = 2
        while fat_tree_ports(k) < len(ports):
            k += 2
    if k < 2 or k % 2:
        raise TopologyError(f"fat_tree: k must be an even number >= 2, got {k!r}")
    if len(ports) > fat_tree_ports(k):
        need = 2
        while fat_tree_ports(need) < len(ports):
            need += 2
        raise TopologyError(
            f"fat_tree: k={k} has {fat_tree_ports(k)} host ports (k^3/4) but the hosts have {len(ports)} NICs; use k >= {need}"
        )
    bw = hw.nic_bw(link_gbps) if link_gbps is not None else max(_nic_bw(topo, n) for n in ports)
    half = k // 2
    core = [topo.add_node(f"core{c}", NodeKind.SWITCH, tier=SwitchTier.CORE, index=c) for c in range(half * half)]
    links = _Links(topo)
    edges_by_pod = []
    for p in range(k):
        edges = [topo.add_node(f"pod{p}/edge{e}", NodeKind.SWITCH, tier=SwitchTier.LEAF, pod=p, index=e) for e in range(half)]
        aggs = [topo.add_node(f"pod{p}/agg{a}", NodeKind.SWITCH, tier=SwitchTier.SPINE, pod=p, index=a) for a in range(half)]
        for e in edges:
            for a in aggs:
                links.add(e, a, bw, hw.LATENCY_US["switch"], count=1)
        for a, agg in enumerate(aggs):
            for j in range(half):
                links.add(agg, core[a * half + j], bw, hw.LATENCY_US["switch"], count=1)
        edges_by_pod.append(edges)
    for q, nic in enumerate(ports):
        pod, slot = divmod(q, half * half)
        links.add(nic, edges_by_pod[pod][slot // half], _nic_bw(topo, nic), hw.LATENCY_US["nic"], rail=topo.graph.nodes[nic].get("rail"))
    links.commit()
    topo.meta["fabric"] = {"kind": "fat-tree", "k": k, "link_gbps": bw * 8, "host_ports": fat_tree_ports(k), "oversubscription": 1.0}


def star(hosts: int, *, gpus_per_host: int = 1, nic_bw: float = 25.0, pcie_bw: float = 64.0, name: str | None = None) -> Topology:
    """``hosts`` small servers (``gpus_per_host`` GPUs behind one NIC of ``nic_bw`` GB/s) on one leaf switch.

    The smallest network the emulator can run and the simulator can check in
    closed form: every inter-host flow crosses exactly its two hosts' NIC links.

    >>> t = star(3)
    >>> len(t.gpus()), len(t.switches("leaf")), t.graph["n0/nic0"]["leaf"][0]["bw"]
    (3, 1, 25.0)
    """
    if hosts < 1 or gpus_per_host < 1:
        raise TopologyError(f"star needs hosts >= 1 and gpus_per_host >= 1, got {hosts} and {gpus_per_host}")
    t = Topology(name or f"star{hosts}", builder={"kind": "star", "hosts": hosts, "gpus_per_host": gpus_per_host, "nic_bw": nic_bw})
    t.add_node("leaf", NodeKind.SWITCH, tier=SwitchTier.LEAF)
    for i in range(hosts):
        h = f"n{i}"
        t.add_node(f"{h}/nic0", NodeKind.NIC, host=h, index=0, rail=0)
        t.add_link(f"{h}/nic0", "leaf", LinkKind.NETWORK, nic_bw)
        for k in range(gpus_per_host):
            t.add_node(f"{h}/gpu{k}", NodeKind.GPU, host=h, index=k)
            t.add_link(f"{h}/gpu{k}", f"{h}/nic0", LinkKind.PCIE, pcie_bw)
    return t


FabricBuilder = Callable[..., None]

FABRIC_BUILDERS: dict[str, FabricBuilder] = {
    "rail-optimized": rail_optimized,
    "leaf-spine": leaf_spine,
    "fat-tree": fat_tree,
}


def build_cluster(
    nodes: int = 4,
    *,
    node: str = "dgx-h100",
    fabric: str = "rail-optimized",
    name: str | None = None,
    node_options: dict[str, Any] | None = None,
    **fabric_options: Any,
) -> Topology:
    """Build ``nodes`` servers of kind ``node`` cabled by ``fabric``.

    ``nodes`` always counts hosts (servers), named ``node0..`` (zero-padded).
    For ``node="gb200-nvl72"`` a host is one compute tray (4 GPUs) and every 18
    consecutive trays form one NVL72 rack, i.e. NVLink domain ``rack<r>``:
    ``nodes=36`` is two full racks, ``nodes=9`` one half-populated rack.

    >>> t = build_cluster(4)
    >>> t.summary()["gpus"], len(t.hosts())
    (32, 4)
    >>> t = build_cluster(36, node="gb200-nvl72", fabric="leaf-spine")
    >>> t.summary()["gpus"], len(t.nodes("nvswitch"))
    (144, 36)
    """
    if nodes < 1:
        raise TopologyError(f"nodes must be >= 1, got {nodes}")
    try:
        fabric_builder = FABRIC_BUILDERS[fabric]
    except KeyError:
        raise TopologyError(f"unknown fabric {fabric!r}; expected one of {', '.join(sorted(FABRIC_BUILDERS))}") from None
    node_builder(node)  # fail early on an unknown node kind
    node_options = node_options or {}
    topo = Topology(
        name or f"{nodes}x{node}-{fabric}",
        builder={"kind": "cluster", "nodes": nodes, "node": node, "fabric": fabric, "node_options": node_options, **fabric_options},
    )
    if node in NVLINK_DOMAIN_HOSTS:
        topo.meta["nvlink_domain_hosts"] = NVLINK_DOMAIN_HOSTS[node]
    nics = add_hosts(topo, node, nodes, **node_options)
    fabric_builder(topo, nics, **fabric_options)
    return topo


def default_cluster() -> Topology:
    """The embedded default: 4 DGX H100 nodes on a rail-optimized 400 Gb/s fabric."""
    return build_cluster(4, node="dgx-h100", fabric="rail-optimized", name="default-4xdgx-h100")
