"""netweave.topology: the hardware graph every other package reads.

The public API is re-exported here; see ``docs/topology.md``.

>>> import topology
>>> topo = topology.default_cluster()
>>> len(topo.gpus())
32
"""

from .builders import NODE_BUILDERS, add_dgx_a100, add_dgx_h100, build_node
from .errors import InputError, TopologyError
from .fabrics import FABRIC_BUILDERS, build_cluster, default_cluster, rail_optimized
from .model import LinkKind, NodeKind, SwitchTier, Topology

__all__ = [
    "FABRIC_BUILDERS",
    "NODE_BUILDERS",
    "InputError",
    "LinkKind",
    "NodeKind",
    "SwitchTier",
    "Topology",
    "TopologyError",
    "add_dgx_a100",
    "add_dgx_h100",
    "build_cluster",
    "build_node",
    "default_cluster",
    "rail_optimized",
]
