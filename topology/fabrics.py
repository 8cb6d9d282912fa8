"""Fabric builders: cable the NICs of many servers through network switches.

A fabric builder takes the NIC lists that node builders returned (one list per
host, in rail order) and adds switches and network links. ``build_cluster``
puts node and fabric builders together.

Aggregation note: a spine node may stand for a *group* of physical spine
switches. Parallel cables between one leaf and one spine group are one link
whose ``bw`` is their sum and whose ``count`` is their number; ECMP spreads over
the spine groups. This keeps 8192-GPU clusters at ~10^5 links while keeping the
bisection and oversubscription exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from . import hardware as hw
from .builders import node_builder
from .errors import TopologyError
from .model import LinkKind, NodeKind, SwitchTier, Topology


def _nic_bw(topo: Topology, nic: str) -> float:
    return hw.nic_bw(topo.graph.nodes[nic].get("speed_gbps", 400))


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
    ``spines`` spine groups (default: one per rail).

    >>> from topology.builders import add_dgx_h100
    >>> t = Topology(); nics = [add_dgx_h100(t, f"n{i}") for i in range(2)]
    >>> rail_optimized(t, nics)
    >>> len(t.switches("leaf")), len(t.switches("spine"))
    (8, 8)
    """
    if not nics_by_host:
        raise TopologyError("rail_optimized: no hosts to connect")
    rails = len(nics_by_host[0])
    if any(len(n) != rails for n in nics_by_host):
        raise TopologyError("rail_optimized: every host must have the same number of NICs (one per rail)")
    if oversubscription < 1:
        raise TopologyError(f"oversubscription must be >= 1, got {oversubscription}")
    spines = spines or rails
    sus = math.ceil(len(nics_by_host) / hosts_per_su)
    spine_ids = [topo.add_node(f"spine{j}", NodeKind.SWITCH, tier=SwitchTier.SPINE, index=j) for j in range(spines)]
    for su in range(sus):
        members = nics_by_host[su * hosts_per_su : (su + 1) * hosts_per_su]
        for rail in range(rails):
            leaf = topo.add_node(f"su{su}/leaf{rail}", NodeKind.SWITCH, tier=SwitchTier.LEAF, rail=rail, pod=su)
            down = 0.0
            for host_nics in members:
                nic = host_nics[rail]
                bw = _nic_bw(topo, nic)
                topo.add_link(nic, leaf, LinkKind.NETWORK, bw, latency_us=hw.LATENCY_US["nic"], rail=rail)
                down += bw
            up = down / oversubscription / spines
            for spine in spine_ids:
                topo.add_link(leaf, spine, LinkKind.NETWORK, up, latency_us=hw.LATENCY_US["switch"], count=len(members))
    topo.meta["fabric"] = {"kind": "rail-optimized", "hosts_per_su": hosts_per_su, "spines": spines, "oversubscription": oversubscription}


FabricBuilder = Callable[..., None]

FABRIC_BUILDERS: dict[str, FabricBuilder] = {
    "rail-optimized": rail_optimized,
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

    >>> t = build_cluster(4)
    >>> t.summary()["gpus"], len(t.hosts())
    (32, 4)
    """
    if nodes < 1:
        raise TopologyError(f"nodes must be >= 1, got {nodes}")
    try:
        fabric_builder = FABRIC_BUILDERS[fabric]
    except KeyError:
        raise TopologyError(f"unknown fabric {fabric!r}; expected one of {', '.join(sorted(FABRIC_BUILDERS))}") from None
    add_node = node_builder(node)
    node_options = node_options or {}
    topo = Topology(
        name or f"{nodes}x{node}-{fabric}",
        builder={"kind": "cluster", "nodes": nodes, "node": node, "fabric": fabric, "node_options": node_options, **fabric_options},
    )
    width = len(str(nodes - 1))
    nics = [add_node(topo, f"node{i:0{width}d}", **node_options) for i in range(nodes)]
    fabric_builder(topo, nics, **fabric_options)
    return topo


def default_cluster() -> Topology:
    """The embedded default: 4 DGX H100 nodes on a rail-optimized 400 Gb/s fabric."""
    return build_cluster(4, node="dgx-h100", fabric="rail-optimized", name="default-4xdgx-h100")
