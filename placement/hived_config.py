"""HiveD's own configuration file: read it into cell trees and quotas, write it back exactly, export ours as one.

A HiveD user brings ``hivedscheduler.yaml`` unchanged (``microsoft/hivedscheduler``,
``pkg/api/types.go``): ``physicalCluster`` (``skuTypes``, OpenPAI's, kept as is;
``cellTypes``; ``physicalCells``) and ``virtualClusters`` (``virtualCells``,
``pinnedCells``); :data:`EXAMPLE` is a small one.

What it becomes (:meth:`HivedConfig.trees`, :meth:`HivedConfig.virtual_clusters`,
:meth:`HivedConfig.pinned_cells`, :func:`scheduler_from_config`):

* one :class:`~placement.cells.CellTree` per **chain** (a top-level cell type of
  ``physicalCells``), its levels the cell types from the leaf up, named as in the
  file, ``isNodeLevel`` marking the host level;
* cell addresses: a node-level cell's ``cellAddress`` is its host name (required,
  as in HiveD); a leaf (one GPU) is ``<host>/gpu<address>``, its address
  defaulting to its index in the node, so the ids match netweave topologies; other
  cells are ``<parent address>/<address>`` (a top-level cell: its address, or
  ``<chain>.<index>`` without one), addresses defaulting to the index among
  siblings (HiveD numbers them the same way);
* ``virtualCells`` (``cellType`` is a dotted path from a chain's top type) become
  ``{vc: {chain: {cell type: count}}}`` quotas; ``pinnedCells`` become
  ``{vc: [cell address, ...]}`` and ``pinnedCellId`` names are kept for requests.

:func:`read_hived_config` checks the structure and names the field of every
error; :func:`dumps_hived_config` writes the same data back, so that
``read(dumps(cfg))`` equals ``cfg`` and the YAML data of a file equals that of its
rewrite (comments are not data and are not kept). :func:`config_from_trees`
exports netweave's derived hierarchy and quotas as a HiveD file.

>>> cfg = loads_hived_config(EXAMPLE)
>>> [lv.name for lv in cfg.trees()["H100-2NODE"].levels], cfg.virtual_clusters()
(['H100', 'H100-NODE', 'H100-2NODE'], {'vc1': {'H100-2NODE': {'H100-NODE': 1}}})
>>> cfg.pinned_cells(), loads_hived_config(dumps_hived_config(cfg)).data == cfg.data
({'vc1': [('H100-2NODE', 'node1')]}, True)
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from topology.errors import InputError
from topology.io import atomic_write_text
from topology.model import NodeKind, Topology
from topology.schema import load_schema, validate

from .cells import Cell, CellTree, Level

EXAMPLE = """\
physicalCluster:
  skuTypes: {H100: {gpu: 1, cpu: 14, memory: 240Gi}}
  cellTypes:
    H100-NODE: {childCellType: H100, childCellNumber: 8, isNodeLevel: true}
    H100-2NODE: {childCellType: H100-NODE, childCellNumber: 2}
  physicalCells:
  - cellType: H100-2NODE
    cellChildren: [{cellAddress: node0}, {cellAddress: node1, pinnedCellId: pin-a}]
virtualClusters:
  vc1:
    virtualCells: [{cellType: H100-2NODE.H100-NODE, cellNumber: 1}]
    pinnedCells: [{pinnedCellId: pin-a}]
"""

_TYPE_KEYS = {"childCellType", "childCellNumber", "isNodeLevel"}
_CELL_KEYS = {"cellType", "cellAddress", "pinnedCellId", "cellChildren"}


@dataclass
class HivedConfig:
    """A parsed HiveD configuration: ``data`` is the file's mapping (unchanged); the rest is derived from it."""

    data: dict[str, Any]
    source: str | None = None

    def __post_init__(self) -> None:
        self._trees: dict[str, CellTree] | None = None
        self._pins: dict[str, tuple[str, str]] = {}
        self._node_start = 0
        self._check()

    # -- structure ------------------------------------------------------------------------------
    def _err(self, message: str, where: str) -> InputError:
        return InputError(message, source=self.source, where=where)

    def _check(self) -> None:
        if not isinstance(self.data, Mapping) or not isinstance(self.data.get("physicalCluster"), Mapping):
            raise self._err("expected a mapping with a 'physicalCluster' mapping (HiveD's configuration)", "physicalCluster")
        pc = self.data["physicalCluster"]
        types = pc.get("cellTypes")
        if not isinstance(types, Mapping) or not types:
            raise self._err("expected a non-empty mapping of cell type to {childCellType, childCellNumber, isNodeLevel}",
                            "physicalCluster.cellTypes")
        for name, spec in types.items():
            where = f"physicalCluster.cellTypes.{name}"
            if not isinstance(spec, Mapping) or set(spec) - _TYPE_KEYS:
                raise self._err(f"expected keys among {', '.join(sorted(_TYPE_KEYS))}, got {spec!r}", where)
            child, number = spec.get("childCellType"), spec.get("childCellNumber")
            if not isinstance(child, str) or not child:
                raise self._err("expected childCellType, a cell type name", f"{where}.childCellType")
            if not isinstance(number, int) or isinstance(number, bool) or number < 1:
                raise self._err(f"expected a positive integer childCellNumber, got {number!r}", f"{where}.childCellNumber")
            if not isinstance(spec.get("isNodeLevel", False), bool):
                raise self._err("expected true or false", f"{where}.isNodeLevel")
        for name in types:  # the types must form a forest: no cycles
            seen, t = set(), name
            while t in types:
                if t in seen:
                    raise self._err(f"cell type {name!r} contains itself (via {t!r}); cell types must form a forest",
                                    f"physicalCluster.cellTypes.{name}")
                seen.add(t)
                t = types[t]["childCellType"]
        cells = pc.get("physicalCells")
        if not isinstance(cells, list) or not cells:
            raise self._err("expected a non-empty list of physical cells", "physicalCluster.physicalCells")
        sku = pc.get("skuTypes")
        if sku is not None and not isinstance(sku, Mapping):
            raise self._err("expected a mapping of SKU type to its resources", "physicalCluster.skuTypes")
        vcs = self.data.get("virtualClusters") or {}
        if not isinstance(vcs, Mapping):
            raise self._err("expected a mapping of virtual cluster to {virtualCells, pinnedCells}", "virtualClusters")
        self.trees()  # builds and checks the physical cells
        for vc, spec in vcs.items():
            self._vc_entries(str(vc), spec)

    def leaf_type(self, cell_type: str) -> str:
        types = self.data["physicalCluster"]["cellTypes"]
        while cell_type in types:
            cell_type = types[cell_type]["childCellType"]
        return cell_type

    def _chain_types(self, top: str) -> list[str]:
        """Cell types of a chain from the top down to the leaf."""
        types = self.data["physicalCluster"]["cellTypes"]
        out = [top]
        while out[-1] in types:
            out.append(types[out[-1]]["childCellType"])
        return out

    # -- physical cells -> trees -------------------------------------------------------------------
    def trees(self) -> dict[str, CellTree]:
        """One cell tree per chain (top-level cell type), in file order."""
        if self._trees is not None:
            return self._trees
        pc = self.data["physicalCluster"]
        types = pc["cellTypes"]
        chains: dict[str, list[tuple[int, Mapping[str, Any]]]] = {}
        for i, spec in enumerate(pc["physicalCells"]):
            where = f"physicalCluster.physicalCells[{i}]"
            if not isinstance(spec, Mapping) or set(spec) - _CELL_KEYS:
                raise self._err(f"expected keys among {', '.join(sorted(_CELL_KEYS))}", where)
            top = spec.get("cellType")
            if not isinstance(top, str) or top not in types:
                raise self._err(f"expected cellType, one of the cellTypes ({', '.join(types)}), got {top!r}", f"{where}.cellType")
            chains.setdefault(top, []).append((i, spec))
        trees = {}
        self._pins = {}
        for top, specs in chains.items():
            names = list(reversed(self._chain_types(top)))  # leaf first
            node_levels = [k for k, n in enumerate(names) if n in types and types[n].get("isNodeLevel", False)]
            if len(node_levels) != 1:
                raise self._err(f"chain {top}: expected exactly one cell type with isNodeLevel: true, got {len(node_levels)}",
                                "physicalCluster.cellTypes")
            node_lv = node_levels[0]
            sizes = [1]
            for n in names[1:]:
                sizes.append(sizes[-1] * types[n]["childCellNumber"])
            levels = [Level(n, sizes[k], types[n]["childCellNumber"] if k else 1, False, k == node_lv) for k, n in enumerate(names)]
            cells: list[Cell] = []
            leaves: list[str] = []
            tops = []
            for top_index, (i, spec) in enumerate(specs):
                tops.append(self._build(spec, len(names) - 1, names, levels, node_lv, None, None, str(top_index), cells, leaves,
                                        f"physicalCluster.physicalCells[{i}]", top))
            tree = CellTree(top, levels, cells, leaves, tops)
            tree.by_address = {}
            for c in cells:
                if c.address in tree.by_address:
                    raise self._err(f"two cells have the address {c.address!r}", "physicalCluster.physicalCells")
                tree.by_address[c.address] = c
            tree.leaf_of_gpu = {g: k for k, g in enumerate(leaves)}
            trees[top] = tree
        gpus = [g for t in trees.values() for g in t.leaves]
        if len(set(gpus)) != len(gpus):
            dup = next(g for g in gpus if gpus.count(g) > 1)
            raise self._err(f"GPU {dup!r} appears twice", "physicalCluster.physicalCells")
        self._trees = trees
        return trees

    def _build(self, spec: Any, lv: int, names: list[str], levels: list[Level], node_lv: int, parent: str | None, node: str | None,
               default: str, cells: list[Cell], leaves: list[str], where: str, chain: str) -> Cell:
        if spec is None:
            spec = {}
        if not isinstance(spec, Mapping) or set(spec) - _CELL_KEYS:
            raise self._err(f"expected a mapping with keys among {', '.join(sorted(_CELL_KEYS))}", where)
        if "cellType" in spec and spec["cellType"] != names[lv] and parent is not None:
            raise self._err(f"expected cellType {names[lv]!r} (or none) at this depth, got {spec['cellType']!r}", f"{where}.cellType")
        raw = spec.get("cellAddress")
        if raw is not None and (isinstance(raw, bool) or not isinstance(raw, (str, int))):
            raise self._err(f"expected a string or integer address, got {raw!r}", f"{where}.cellAddress")
        addr = default if raw is None else str(raw)
        if lv == node_lv:
            if raw is None:
                raise self._err(f"a node-level cell ({names[lv]}) needs cellAddress, its host name", f"{where}.cellAddress")
            node = address = addr
            self._node_start = len(leaves)
        elif lv == 0:
            address = f"{node}/gpu{addr}"
        elif parent is None:
            address = addr if raw is not None else f"{chain}.{addr}"
        else:
            address = f"{parent}/{addr}"
        kids_spec = spec.get("cellChildren")
        if kids_spec is not None and not isinstance(kids_spec, list):
            raise self._err("expected a list of child cells", f"{where}.cellChildren")
        if lv == 0:
            if kids_spec:
                raise self._err(f"a leaf cell ({names[0]}) has no children", f"{where}.cellChildren")
            cell = Cell(len(cells), 0, address, len(leaves), len(leaves) + 1)
            leaves.append(address)
        else:
            fan = levels[lv].fanout
            kids_spec = list(kids_spec or [])
            if len(kids_spec) > fan:
                raise self._err(f"{names[lv]} has {fan} children ({names[lv - 1]}), got {len(kids_spec)}", f"{where}.cellChildren")
            kids_spec += [None] * (fan - len(kids_spec))  # HiveD: unspecified children take default addresses
            lo = len(leaves)
            kids = []
            for k, ks in enumerate(kids_spec):
                # a GPU's default address is its index in its node; any other cell's is its index among its siblings
                kid_default = str(len(leaves) - self._node_start) if lv - 1 == 0 else str(k)
                kids.append(self._build(ks, lv - 1, names, levels, node_lv, address, node, kid_default, cells, leaves,
                                        f"{where}.cellChildren[{k}]", chain))
            cell = Cell(len(cells), lv, address, lo, len(leaves), children=kids)
            for k in kids:
                k.parent = cell
        cells.append(cell)
        pid = spec.get("pinnedCellId")
        if pid is not None:
            if not isinstance(pid, str) or not pid:
                raise self._err(f"expected a non-empty pinnedCellId, got {pid!r}", f"{where}.pinnedCellId")
            if pid in self._pins:
                raise self._err(f"pinnedCellId {pid!r} names two cells", f"{where}.pinnedCellId")
            self._pins[pid] = (chain, cell.address)
        return cell

    # -- virtual clusters -----------------------------------------------------------------------
    def _vc_entries(self, vc: str, spec: Any) -> tuple[dict[str, dict[str, int]], list[tuple[str, str]]]:
        where = f"virtualClusters.{vc}"
        if spec is None:
            spec = {}
        if not isinstance(spec, Mapping) or set(spec) - {"virtualCells", "pinnedCells"}:
            raise self._err("expected a mapping with virtualCells and/or pinnedCells", where)
        trees = self.trees()
        quota: dict[str, dict[str, int]] = {}
        for k, item in enumerate(spec.get("virtualCells") or []):
            w = f"{where}.virtualCells[{k}]"
            if not isinstance(item, Mapping) or set(item) - {"cellType", "cellNumber"}:
                raise self._err("expected {cellType, cellNumber}", w)
            path, number = item.get("cellType"), item.get("cellNumber")
            if not isinstance(path, str) or not path:
                raise self._err("expected cellType, a dotted path from a top-level cell type", f"{w}.cellType")
            parts = path.split(".")
            if parts[0] not in trees:
                raise self._err(f"{path!r} does not start with a top-level cell type of physicalCells ({', '.join(trees)})", f"{w}.cellType")
            chain_names = self._chain_types(parts[0])
            if parts != chain_names[: len(parts)]:
                raise self._err(f"{path!r} is not a path down chain {parts[0]} ({'.'.join(chain_names)})", f"{w}.cellType")
            if not isinstance(number, int) or isinstance(number, bool) or number < 0:
                raise self._err(f"expected a non-negative integer cellNumber, got {number!r}", f"{w}.cellNumber")
            if number:
                q = quota.setdefault(parts[0], {})
                q[parts[-1]] = q.get(parts[-1], 0) + number
        pins = []
        for k, item in enumerate(spec.get("pinnedCells") or []):
            w = f"{where}.pinnedCells[{k}]"
            if not isinstance(item, Mapping) or set(item) != {"pinnedCellId"}:
                raise self._err("expected {pinnedCellId}", w)
            pid = item["pinnedCellId"]
            if pid not in self._pins:
                raise self._err(f"unknown pinnedCellId {pid!r}; physicalCells pin {', '.join(self._pins) or 'none'}", f"{w}.pinnedCellId")
            pins.append(self._pins[pid])
        return quota, pins

    def virtual_clusters(self) -> dict[str, dict[str, dict[str, int]]]:
        """Quotas as :class:`~placement.hived.HivedScheduler` takes them: ``{vc: {chain: {cell type: count}}}``."""
        return {str(vc): self._vc_entries(str(vc), spec)[0] for vc, spec in (self.data.get("virtualClusters") or {}).items()}

    def pinned_cells(self) -> dict[str, list[tuple[str, str]]]:
        """Pinned cells per VC, as ``(chain, cell address)``."""
        out = {}
        for vc, spec in (self.data.get("virtualClusters") or {}).items():
            pins = self._vc_entries(str(vc), spec)[1]
            if pins:
                out[str(vc)] = pins
        return out

    def pinned_ids(self) -> dict[str, tuple[str, str]]:
        """Every ``pinnedCellId`` of the physical cells: ``{id: (chain, cell address)}``."""
        return dict(self._pins)

    def topology(self) -> Topology:
        """A bare topology with the file's hosts and GPUs (no links), for when no netweave topology is given."""
        topo = Topology("hived-config")
        for chain, tree in self.trees().items():
            leaf = tree.levels[0].name
            for g in tree.leaves:
                host, _, idx = g.rpartition("/")
                index = int(idx[3:]) if idx[3:].isdigit() else 0
                topo.add_node(g, NodeKind.GPU, host=host, model=chain if len(self.trees()) > 1 else leaf, index=index)
        return topo


def loads_hived_config(text: str, *, source: str | None = None) -> HivedConfig:
    """Parse HiveD's YAML configuration text."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        line = getattr(getattr(exc, "problem_mark", None), "line", None)
        raise InputError(f"invalid YAML ({getattr(exc, 'problem', None) or exc})", source=source,
                         where=None if line is None else line + 1) from None
    validate(data, load_schema("placement", "hived-config"), source=source)  # the structure; the cell trees are checked as they are built
    return HivedConfig(data, source)


def read_hived_config(path: str) -> HivedConfig:
    """Read HiveD's configuration file (``hivedscheduler.yaml``; other top-level keys, such as the API server's, are kept)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise InputError(f"cannot read ({exc.strerror})", source=str(path)) from None
    return loads_hived_config(text, source=str(path))


def dumps_hived_config(cfg: HivedConfig | Mapping[str, Any]) -> str:
    """The configuration as YAML, keys in their original order: reading it back gives the same data."""
    data = cfg.data if isinstance(cfg, HivedConfig) else cfg
    return yaml.safe_dump(copy.deepcopy(dict(data)), sort_keys=False, default_flow_style=False)


def write_hived_config(cfg: HivedConfig | Mapping[str, Any], path: str) -> None:
    """Write the configuration atomically."""
    atomic_write_text(path, dumps_hived_config(cfg))


def config_from_trees(trees: Mapping[str, CellTree], virtual_clusters: Mapping[str, Mapping[str, Mapping[int | str, int]]] | None = None,
                      *, pinned: Mapping[str, list[tuple[str, str]]] | None = None) -> dict[str, Any]:
    """netweave's cell trees (and quotas ``{vc: {chain: {level: count}}}``) as a HiveD configuration mapping.

    Cell types are named ``<chain>/<level>`` (the leaf type is the chain, HiveD's
    leaf cell type), or keep their names when the trees came from a HiveD file;
    every cell keeps its address (GPUs their index). Only
    *full* cells are expressible (HiveD's buddies are identical): a partial cell
    of a level is written as its children, each a top-level cell of its own chain
    ``<chain>/<level>``, which loses no GPU but splits the chain.
    """
    cell_types: dict[str, Any] = {}
    physical: list[dict[str, Any]] = []
    pins = {(c, a): f"pin-{vc}-{k}" for vc, lst in (pinned or {}).items() for k, (c, a) in enumerate(lst)}

    def tname(tree: CellTree, lv: int) -> str:
        if tree.levels[0].name != "gpu":  # read from a HiveD file: the levels are its cell types
            return tree.levels[lv].name
        return tree.chain if lv == 0 else f"{tree.chain}/{tree.levels[lv].name}"

    def spec(tree: CellTree, c: Cell, top: bool) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if top:
            out["cellType"] = tname(tree, c.level)
        if c.level == 0:
            out["cellAddress"] = int(c.address.rsplit("gpu", 1)[-1]) if c.address.rsplit("/", 1)[-1].startswith("gpu") else c.address
        elif tree.levels[c.level].node_level or top:
            out["cellAddress"] = c.address
        else:
            out["cellAddress"] = c.address.rsplit("/", 1)[-1]
        if (tree.chain, c.address) in pins:
            out["pinnedCellId"] = pins[(tree.chain, c.address)]
        if c.children:
            out["cellChildren"] = [spec(tree, k, False) for k in c.children]
        return out

    def emit(tree: CellTree, c: Cell) -> None:
        if c.full or c.level == 0:
            physical.append(spec(tree, c, True))
        else:
            for k in c.children:
                emit(tree, k)

    for tree in trees.values():
        for lv in range(1, len(tree.levels)):
            entry: dict[str, Any] = {"childCellType": tname(tree, lv - 1), "childCellNumber": tree.levels[lv].fanout}
            if tree.levels[lv].node_level:
                entry["isNodeLevel"] = True
            cell_types[tname(tree, lv)] = entry
        for top in tree.tops:
            emit(tree, top)
    vcs: dict[str, Any] = {}
    for vc, chains in (virtual_clusters or {}).items():
        cells = []
        for chain, quota in chains.items():
            tree = trees[chain]
            top_lv = max(c.level for c in tree.tops if c.full) if any(c.full for c in tree.tops) else len(tree.levels) - 1
            for lv, n in quota.items():
                lvi = lv if isinstance(lv, int) else tree.level_index(lv)
                path = ".".join(tname(tree, k) for k in range(top_lv, lvi - 1, -1))
                cells.append({"cellType": path, "cellNumber": n})
        entry = {"virtualCells": cells}
        if pinned and pinned.get(vc):
            entry["pinnedCells"] = [{"pinnedCellId": pins[p]} for p in pinned[vc]]
        vcs[vc] = entry
    return {"physicalCluster": {"cellTypes": cell_types, "physicalCells": physical}, "virtualClusters": vcs}


def scheduler_from_config(cfg: HivedConfig, topo: Topology | None = None, **options: Any):
    """A :class:`~placement.hived.HivedScheduler` over the file's cells, quotas and pinned cells.

    With ``topo`` (a netweave topology), every GPU of the file must be one of its
    GPUs (``<host>/gpu<index>``); without, a bare topology of the file's hosts and
    GPUs is used. Infeasible quotas raise :class:`~placement.hived.QuotaError`.
    """
    from .hived import HivedScheduler

    trees = cfg.trees()
    if topo is None:
        topo = cfg.topology()
    else:
        known = set(topo.gpus())
        for tree in trees.values():
            missing = [g for g in tree.leaves if g not in known]
            if missing:
                raise InputError(f"GPU {missing[0]!r} of chain {tree.chain} is not in topology {topo.name!r} "
                                 f"(HiveD leaf addresses are GPU indices in their node: <host>/gpu<index>)", source=cfg.source)
    return HivedScheduler(topo, cfg.virtual_clusters(), trees=trees, pinned=cfg.pinned_cells(), **options)
