"""HiveD cell hierarchies derived from a :class:`~topology.Topology`.

HiveD (Zhao et al., OSDI 2020) describes a cluster as *cells*: a cell is a set
of GPUs that the interconnect makes affine (a PCIe-switch pair, a NUMA half, a
server, a rack). Cells form a tree per GPU type (a *chain*); a level is a cell
type, level 0 being the single GPU (HiveD's "leaf cell", its level 1).

HiveD's operators write the hierarchy by hand in YAML. Here it is *derived*
from the graph, level by level, from the structure that exists:

``gpu``
    one GPU (the leaf).
``pcie``
    GPUs behind one PCIe switch (DGX A100 pairs; absent on DGX H100 where each
    GPU has its own switch).
``numa``
    GPUs of one CPU socket.
``host``
    one server (HiveD's ``isNodeLevel``).
``nvl-domain``
    a multi-node NVLink domain (GB200 NVL72), only when a domain spans hosts.
``su``
    hosts whose NICs reach the same set of leaf switches (a scalable unit of a
    rail-optimized fabric, a rack under one ToR).
``cluster``
    every host of the chain.

A level in which every cell has exactly one child adds nothing and is dropped
(``gpu`` and ``host`` are always kept).
Like HiveD's "forged" cell types, levels whose fan-out is a power of two
greater than 2 get binary intermediate levels (``gpux2``, ``hostx4``...) so
that requests of 2, 4, 16... GPUs map to one cell; forged multi-host groups
take consecutive hosts.

Deviation from HiveD: buddies need not be identical. A cell whose leaves do not
fill its level's nominal size (the last, partial SU) is marked ``full=False``;
quota guarantees count only full cells, and the buddy allocator splits partial
cells instead of handing them out whole.

>>> import topology
>>> tree = cell_hierarchy(topology.default_cluster())["H100-SXM5-80GB"]
>>> [lv.name for lv in tree.levels], [lv.size for lv in tree.levels]
(['gpu', 'gpux2', 'numa', 'host', 'hostx2', 'su'], [1, 2, 4, 8, 16, 32])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from topology.errors import InputError
from topology.model import LinkKind, NodeKind, SwitchTier, Topology


@dataclass(frozen=True)
class Level:
    """One cell type of a chain: its name, nominal GPU count and fan-out from the level below."""

    name: str
    size: int
    fanout: int
    forged: bool = False
    node_level: bool = False


@dataclass(eq=False, slots=True)
class Cell:
    """A physical cell: GPUs ``tree.leaves[lo:hi]`` under one interconnect element."""

    index: int
    level: int
    address: str
    lo: int
    hi: int
    parent: Cell | None = None
    children: list[Cell] = field(default_factory=list)
    full: bool = True

    @property
    def size(self) -> int:
        return self.hi - self.lo

    def __repr__(self) -> str:
        return f"<Cell {self.address} L{self.level} [{self.lo}:{self.hi}]>"


@dataclass(eq=False)
class CellTree:
    """The cell forest of one chain (one GPU model)."""

    chain: str
    levels: list[Level]
    cells: list[Cell]
    leaves: list[str]  # GPU ids, in tree order (cells are contiguous ranges of it)
    tops: list[Cell]
    by_address: dict[str, Cell] = field(default_factory=dict)
    leaf_of_gpu: dict[str, int] = field(default_factory=dict)

    def level_index(self, name: str) -> int:
        for i, lv in enumerate(self.levels):
            if lv.name == name:
                return i
        raise InputError(f"chain {self.chain}: unknown cell level {name!r}; expected one of {', '.join(lv.name for lv in self.levels)}")

    def cells_at(self, level: int) -> list[Cell]:
        return [c for c in self.cells if c.level == level]

    def gpus_of(self, cell: Cell) -> list[str]:
        return self.leaves[cell.lo : cell.hi]

    def hosts_of(self, cell: Cell, topo_hosts: dict[str, str]) -> list[str]:
        seen: dict[str, None] = {}
        for g in self.gpus_of(cell):
            seen.setdefault(topo_hosts[g], None)
        return list(seen)

    def describe(self) -> dict[str, Any]:
        return {
            "chain": self.chain,
            "gpus": len(self.leaves),
            "levels": [
                {"name": lv.name, "size": lv.size, "fanout": lv.fanout, "forged": lv.forged, "node_level": lv.node_level,
                 "cells": sum(1 for c in self.cells if c.level == i), "full_cells": sum(1 for c in self.cells if c.level == i and c.full)}
                for i, lv in enumerate(self.levels)
            ],
        }


# -- derivation -------------------------------------------------------------------

_STRUCTURAL = ("cluster", "su", "nvl-domain", "host", "numa", "pcie")  # top-down, before the leaf


def _gpu_keys(topo: Topology) -> dict[str, dict[str, Any]]:
    """For each GPU, the key of its group at every structural level."""
    g = topo.graph
    leafs_of_host: dict[str, tuple[str, ...]] = {}
    for nic in topo.nodes(NodeKind.NIC):
        host = topo.host_of(nic)
        for _, sw, d in g.out_edges(nic, data=True):
            if d["kind"] == LinkKind.NETWORK and g.nodes[sw]["kind"] == NodeKind.SWITCH and g.nodes[sw].get("tier") == SwitchTier.LEAF:
                leafs_of_host[host] = tuple(sorted({*leafs_of_host.get(host, ()), sw}))
    domain_hosts: dict[str, set[str]] = {}
    for gpu in topo.gpus():
        dom = g.nodes[gpu].get("domain")
        if dom is not None:
            domain_hosts.setdefault(dom, set()).add(topo.host_of(gpu))
    keys: dict[str, dict[str, Any]] = {}
    for gpu in topo.gpus():
        d = g.nodes[gpu]
        host = d["host"]
        pcie = next((n for n in g.successors(gpu) if g.nodes[n]["kind"] == NodeKind.PCIE_SWITCH), None)
        dom = d.get("domain")
        leaves = leafs_of_host.get(host, ())
        su_name = None
        if leaves:
            pods = {g.nodes[sw].get("pod") for sw in leaves}
            su_name = f"su{pods.pop()}" if len(pods) == 1 and None not in pods else "+".join(leaves)
        keys[gpu] = {
            "cluster": "cluster",
            "su": su_name or f"isolated:{host}",
            "nvl-domain": dom if dom is not None and len(domain_hosts.get(dom, ())) > 1 else None,
            "host": host,
            "numa": f"{host}/numa{d.get('numa', 0)}",
            "pcie": pcie or f"{gpu}/pcie",
        }
    return keys


def cell_hierarchy(topo: Topology, *, forge: bool = True) -> dict[str, CellTree]:
    """Derive one :class:`CellTree` per GPU model (HiveD chain) from ``topo``.

    >>> import topology
    >>> trees = cell_hierarchy(topology.build_cluster(2, node="dgx-a100"))
    >>> [lv.name for lv in trees["A100-SXM4-80GB"].levels]
    ['gpu', 'pcie', 'numa', 'host', 'su']
    """
    gpus = topo.gpus()
    if not gpus:
        raise InputError("the topology has no GPUs; cannot build cells")
    keys = _gpu_keys(topo)
    chains: dict[str, list[str]] = {}
    for gpu in gpus:
        chains.setdefault(str(topo.graph.nodes[gpu].get("model") or "gpu"), []).append(gpu)
    return {chain: _build_tree(chain, members, keys, topo, forge) for chain, members in chains.items()}


class _Node:
    __slots__ = ("name", "level", "children", "gpu")

    def __init__(self, name: str, level: str, gpu: str | None = None):
        self.name, self.level, self.children, self.gpu = name, level, [], gpu


def _build_tree(chain: str, gpus: list[str], keys: dict[str, dict[str, Any]], topo: Topology, forge: bool) -> CellTree:
    # 1. a trie over the structural keys (top-down), GPUs as leaves, in canonical GPU order
    root = _Node("root", "root")
    index: dict[tuple, _Node] = {}
    levels = [lv for lv in _STRUCTURAL if lv != "nvl-domain" or any(keys[g]["nvl-domain"] for g in gpus)]
    for gpu in gpus:
        parent, path = root, ()
        for lv in levels:
            k = keys[gpu][lv] if keys[gpu][lv] is not None else keys[gpu]["host"]
            path = (*path, k)
            node = index.get(path)
            if node is None:
                node = index[path] = _Node(str(k), lv)
                parent.children.append(node)
            parent = node
        parent.children.append(_Node(gpu, "gpu", gpu))
    level_names = [*levels, "gpu"]

    # 2. drop levels where every node has exactly one child (they add no grouping)
    def nodes_at(name: str) -> list[_Node]:
        out, frontier = [], [root]
        while frontier:
            nxt = []
            for n in frontier:
                for c in n.children:
                    (out if c.level == name else nxt).append(c)
            frontier = nxt
        return out

    keep_always = {"gpu", "host"}
    for name in list(level_names):
        if name not in keep_always and all(len(n.children) == 1 for n in nodes_at(name)):
            _splice_out(root, name)
            level_names.remove(name)

    # 3. forge binary levels under power-of-two fan-outs > 2 (HiveD's forged cell types)
    bottom_up = list(reversed(level_names))  # gpu first
    out_levels: list[tuple[str, bool]] = [("gpu", False)]
    for lower, upper in zip(bottom_up, bottom_up[1:], strict=False):
        nodes = nodes_at(upper)
        fan = max(len(n.children) for n in nodes)
        if forge and fan > 2 and fan & (fan - 1) == 0:
            width = 2
            while width < fan:
                fname = f"{lower}x{width}"
                for n in nodes:
                    kids = n.children
                    groups = [kids[i : i + 2] for i in range(0, len(kids), 2)]
                    n.children = []
                    for j, grp in enumerate(groups):
                        f = _Node(f"{n.name}/{fname}.{j}", fname)
                        f.children = grp
                        n.children.append(f)
                out_levels.append((fname, True))
                width *= 2
        out_levels.append((upper, False))

    # 4. materialise cells bottom-up with leaf ranges
    leaves: list[str] = []
    cells: list[Cell] = []
    level_pos = {name: i for i, (name, _) in enumerate(out_levels)}

    def build(node: _Node) -> Cell:
        li = level_pos[node.level]
        if node.gpu is not None:
            cell = Cell(len(cells), 0, node.gpu, len(leaves), len(leaves) + 1)
            leaves.append(node.gpu)
            cells.append(cell)
            return cell
        lo = len(leaves)
        kids = [build(c) for c in node.children]
        cell = Cell(len(cells), li, node.name, lo, len(leaves), children=kids)
        for k in kids:
            k.parent = cell
        cells.append(cell)
        return cell

    tops = [build(n) for n in root.children]
    sizes = [1] * len(out_levels)
    for c in cells:
        sizes[c.level] = max(sizes[c.level], c.size)
    fanouts = [1] * len(out_levels)
    for c in cells:
        fanouts[c.level] = max(fanouts[c.level], len(c.children))
    lv_objs = [Level(name, sizes[i], fanouts[i], forged, name == "host") for i, (name, forged) in enumerate(out_levels)]
    for c in cells:  # children come before parents in ``cells``
        c.full = c.size == sizes[c.level] and all(k.full for k in c.children) and (c.level == 0 or len(c.children) == fanouts[c.level])
    tree = CellTree(chain, lv_objs, cells, leaves, tops)
    tree.by_address = {c.address: c for c in cells}
    tree.leaf_of_gpu = {g: i for i, g in enumerate(leaves)}
    return tree


def _splice_out(root: _Node, name: str) -> None:
    """Replace every node of level ``name`` by its children."""
    frontier = [root]
    while frontier:
        nxt = []
        for n in frontier:
            new_children = []
            for c in n.children:
                if c.level == name:
                    new_children.extend(c.children)
                else:
                    new_children.append(c)
            n.children = new_children
            nxt.extend(n.children)
        frontier = nxt


def lowest_common_level(tree: CellTree, leaf_indices: list[int]) -> int:
    """The level of the lowest cell containing every given leaf (HiveD's affinity measure)."""
    cell = tree.cells[_leaf_cell_index(tree, leaf_indices[0])]
    lo, hi = min(leaf_indices), max(leaf_indices) + 1
    while not (cell.lo <= lo and hi <= cell.hi):
        if cell.parent is None:
            return len(tree.levels)
        cell = cell.parent
    return cell.level


def _leaf_cell_index(tree: CellTree, leaf: int) -> int:
    cell = tree.tops[0]
    for top in tree.tops:
        if top.lo <= leaf < top.hi:
            cell = top
    while cell.children:
        cell = next(k for k in cell.children if k.lo <= leaf < k.hi)
    return cell.index
