"""netweave.topology: the hardware graph every other package reads.

The public API is re-exported here; see ``docs/topology.md``. Drawing
(``topology.draw``) and the file formats (``topology.io``) are imported from
their modules so that ``import topology`` stays light.

>>> import topology
>>> topo = topology.default_cluster()
>>> len(topo.gpus())
32
"""

from .builders import (
    NODE_BUILDERS,
    NVLINK_DOMAIN_HOSTS,
    add_dgx_a100,
    add_dgx_h100,
    add_gb200_nvl72_tray,
    add_hosts,
    add_pcie_server,
    build_node,
)
from .collectives import P2PFlow, alpha_beta, collective_flows, collective_time
from .errors import InputError, TopologyError
from .fabrics import FABRIC_BUILDERS, build_cluster, default_cluster, fat_tree, fat_tree_ports, leaf_spine, rail_optimized
from .model import LinkKind, NodeKind, SwitchTier, Topology
from .paths import PathType, bandwidth_classes, bandwidth_matrix, bisection_bandwidth, clear_cache, device_path, gpu_path
from .routing import flow_paths, route_flows

__all__ = [
    "P2PFlow",
    "PathType",
    "alpha_beta",
    "bandwidth_classes",
    "bandwidth_matrix",
    "bisection_bandwidth",
    "clear_cache",
    "collective_flows",
    "collective_time",
    "device_path",
    "flow_paths",
    "gpu_path",
    "route_flows",
    "FABRIC_BUILDERS",
    "NODE_BUILDERS",
    "NVLINK_DOMAIN_HOSTS",
    "InputError",
    "LinkKind",
    "NodeKind",
    "SwitchTier",
    "Topology",
    "TopologyError",
    "add_dgx_a100",
    "add_dgx_h100",
    "add_gb200_nvl72_tray",
    "add_hosts",
    "add_pcie_server",
    "build_cluster",
    "build_node",
    "default_cluster",
    "fat_tree",
    "fat_tree_ports",
    "leaf_spine",
    "rail_optimized",
]
