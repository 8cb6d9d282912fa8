"""HiveD: virtual clusters of cells, buddy cell allocation, guaranteed and opportunistic jobs.

A re-implementation of the mechanism of HiveD (Zhao et al., "HiveD: Sharing a
GPU Cluster for Deep Learning with Guarantees", OSDI 2020;
``microsoft/hivedscheduler``) over the cells of :mod:`placement.cells`.

Mechanism (as in HiveD):

* A **virtual cluster (VC)** owns a quota of *preassigned* virtual cells per
  level (``{"host": 2, "numa": 1}``). Virtual cells are split buddy-style inside
  the VC to serve smaller requests and merge back when freed.
* A preassigned virtual cell **binds** to a physical cell of its level only when
  a job first uses it, through **buddy allocation** on the physical free list
  (take a free cell of that level, else split the smallest larger free cell);
  it unbinds, and the physical cell merges with its free buddies, when the VC
  no longer uses it. Virtual children map to the bound cell's children, so a
  VC always sees the intra-cell topology it was promised.
* The **safety check** (HiveD's ``initCellNums``) walks each chain top-down:
  ``left = available - sum of VC demand`` at each level, ``available`` at the
  next level being ``left * fan-out`` plus free cells of that level. A quota
  assignment that makes ``left`` negative is refused, naming the chain, level
  and number of missing cells (:class:`QuotaError`).
* **Guaranteed** jobs (priority 0..1000) run only in their VC's cells; within a
  VC a higher priority preempts a lower one. **Opportunistic** jobs (priority
  -1) use any idle GPU, preferring nodes without VC-bound cells, then GPUs
  outside bound cells ("stay away from guaranteed jobs", node by node); a
  guaranteed job whose cells they occupy preempts them.
* Jobs are **gangs**: all of a job's cells are allocated or none.
* **Bad hardware**: a failed GPU or host makes its cells bad (a cell is bad when
  any leaf is). Allocation avoids bad cells; when healthy free cells no longer
  cover every VC's quota the shortfall is *reported* per level and VC
  (:meth:`HivedScheduler.guarantee_report`), never silently absorbed.

Also as in HiveD: lazy preemption (a lazily preemptible guaranteed job is
downgraded to opportunistic on its GPUs), pinned cells (bound for good), pod
groups (:meth:`HivedScheduler.allocate_group`: each pod within one node-level
cell, optionally all within one cell of a level), HiveD's configuration file
(:mod:`placement.hived_config`).

Deviations, stated: plain requests are GPU counts decomposed into cells of the
derived levels (largest first), and by default a piece that finds no free cell
is split into smaller cells even across nodes (``relax="node"`` is HiveD's
rule); pod groups are placed greedily with retries, not by HiveD's
backtracking search; binding prefers a clean larger cell to a cell with
opportunistic work (``spare_opportunistic=False`` restores HiveD's order);
virtual children bind to the physical children at the same position rather
than by a search (equivalent, as virtual siblings are interchangeable and the
choice among them avoids bad and busy counterparts); buddies may be
non-identical (see :mod:`placement.cells`). Job placements use a second buddy
structure over *idle* GPUs (the occupancy free list) so that opportunistic and
baseline placement is O(levels) as well.

>>> import topology
>>> s = HivedScheduler(topology.default_cluster(), {"a": {"host": 2}, "b": {"numa": 3}})
>>> r = s.allocate("j1", 8, vc="a")
>>> r.ok, len(r.gpus), s.allocate("j2", 16, vc="b").reason["level"]
(True, 8, 'hostx2')
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from topology.errors import InputError
from topology.inputs import loads_json, read_text
from topology.io import atomic_write_text
from topology.limits import MAX_QUOTA_CELLS
from topology.model import Topology
from topology.schema import load_schema, validate

from .cells import Cell, CellTree, cell_hierarchy, lowest_common_level

OPPORTUNISTIC = -1
MIN_GUARANTEED, MAX_GUARANTEED = 0, 1000
STATE_FORMAT = "netweave-hived-state"


def read_state(path: str | Path) -> dict[str, Any]:
    """The state file at ``path`` (:meth:`HivedScheduler.save`), parsed and checked against
    ``placement/schemas/hived-state.schema.json``; :meth:`HivedScheduler.from_state` checks it against the topology.

    >>> import json, pathlib, tempfile, topology
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "cluster.state"
    >>> HivedScheduler(topology.default_cluster(), {"research": {"host": 1}}).save(str(path))
    >>> read_state(path)["virtual_clusters"]
    {'research': {'host': 1}}
    >>> _ = path.write_text(json.dumps({**read_state(path), "relax": "yes"}))
    >>> read_state(path)
    Traceback (most recent call last):
    ...
    topology.errors.InputError: ...cluster.state: relax: expected true, false or node, got 'yes'
    """
    data = loads_json(read_text(path), source=str(path))
    validate(data, load_schema("placement", "hived-state"), source=str(path))
    return data
SCAN_LIMIT = 48  # free-list entries examined per choice (HiveD scans all; a bound keeps choices O(1))


PHASES = ("search", "walk", "bind", "preempt", "occupy", "release", "other")


def _phase(name: str) -> Callable:
    """Charge a method's own time (callees' phases excluded) to ``name`` in ``self.phase_s``, when that is a dict.

    ``release`` (freeing a job) counts as its own phase only when called
    directly; a free inside preemption stays part of ``preempt``.
    """
    def deco(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(self: HivedScheduler, *args: Any, **kwargs: Any) -> Any:
            if self.phase_s is None or (name == "release" and self._phase_stack):
                return fn(self, *args, **kwargs)
            stack, now = self._phase_stack, time.perf_counter()
            if stack:
                self.phase_s[stack[-1]] += now - self._phase_t0
            stack.append(name)
            self._phase_t0 = now
            try:
                return fn(self, *args, **kwargs)
            finally:
                now = time.perf_counter()
                self.phase_s[stack.pop()] += now - self._phase_t0
                self._phase_t0 = now
        return wrapper
    return deco


class QuotaError(InputError):
    """A virtual-cluster quota assignment that the physical cluster cannot guarantee."""


@dataclass
class AllocationResult:
    """Outcome of :meth:`HivedScheduler.allocate`: the GPUs, or a reason naming the resource and level."""

    job: str
    ok: bool
    gpus: list[str] = field(default_factory=list)
    cells: list[str] = field(default_factory=list)
    chain: str | None = None
    preempted: list[str] = field(default_factory=list)
    downgraded: list[str] = field(default_factory=list)  # lazily preempted guaranteed jobs, still running as opportunistic
    reason: dict[str, Any] | None = None
    plan: list[tuple] | None = None  # exact pieces, for committing a candidate

    def to_dict(self) -> dict[str, Any]:
        return {"job": self.job, "ok": self.ok, "gpus": self.gpus, "cells": self.cells, "chain": self.chain,
                "preempted": self.preempted, "downgraded": self.downgraded, "reason": self.reason}


class VirtualCell:
    __slots__ = ("vc", "level", "parent", "pos", "children", "physical", "job", "root_index", "pid")

    def __init__(self, vc: str, level: int, parent: VirtualCell | None, pos: int, root_index: int, pid: str | None = None):
        self.vc, self.level, self.parent, self.pos, self.root_index = vc, level, parent, pos, root_index
        self.pid = pid  # the pinned cell (its address) this virtual cell belongs to; None for ordinary quota
        self.children: list[VirtualCell] | None = None
        self.physical: Cell | None = None  # set on preassigned (root) cells only
        self.job: str | None = None

    def path(self) -> list[int]:
        out, c = [], self
        while c.parent is not None:
            out.append(c.pos)
            c = c.parent
        return [c.root_index, *reversed(out)]


class _VCChain:
    """One VC's virtual cells in one chain: preassigned roots and a virtual buddy free list."""

    def __init__(self, vc: str, tree: CellTree, quota: dict[int, int]):
        self.vc, self.tree = vc, tree
        self.roots: list[VirtualCell] = []
        self.free: list[dict[int, VirtualCell]] = [{} for _ in tree.levels]
        for level in sorted(quota, reverse=True):
            for _ in range(quota[level]):
                v = VirtualCell(vc, level, None, 0, len(self.roots))
                self.roots.append(v)
                self.free[level][id(v)] = v
        self.quota = dict(quota)
        self.jobs: dict[str, _Job] = {}  # the VC's running jobs in this chain (for intra-VC preemption)
        self.gpus_at: dict[int, int] = {}  # GPUs those jobs use, by priority
        self.pinned: dict[str, VirtualCell] = {}  # pinned cell address -> its root, bound for good

    def add_job(self, j: _Job) -> None:
        self.jobs[j.id] = j
        self.gpus_at[j.priority] = self.gpus_at.get(j.priority, 0) + len(j.leaves)

    def drop_job(self, j: _Job) -> None:
        del self.jobs[j.id]
        self.gpus_at[j.priority] -= len(j.leaves)
        if not self.gpus_at[j.priority]:
            del self.gpus_at[j.priority]


@dataclass
class _Job:
    id: str
    vc: str | None
    priority: int
    chain: str
    leaves: list[int]
    virtual: list[VirtualCell]  # guaranteed pieces
    physical: list[Cell]  # opportunistic pieces (and the physical counterparts of guaranteed ones)
    seq: int = 0
    lazy: bool = False  # when preempted inside its VC, downgrade to opportunistic instead of stopping (HiveD's lazy preemption)
    plan: list[tuple] | None = None  # its pieces, to put it back exactly


class _Chain:
    """Physical state of one chain: binding free list, occupancy free list and per-cell counters."""

    def __init__(self, tree: CellTree):
        self.tree = tree
        n, nl = len(tree.cells), len(tree.levels)
        self.node_level = next((i for i, lv in enumerate(tree.levels) if lv.node_level), 0)
        self.bind_free: list[dict[int, Cell]] = [{} for _ in range(nl)]
        self.occ_free: list[dict[int, Cell]] = [{} for _ in range(nl)]
        for top in tree.tops:
            self.bind_free[top.level][top.index] = top
            self.occ_free[top.level][top.index] = top
        self.bound: list[VirtualCell | None] = [None] * n
        self.bound_in = [0] * n  # bound roots in the subtree
        self.covered = [0] * n  # bound roots among the cell and its ancestors (> 0: inside a bound cell)
        self.sizes = [c.hi - c.lo for c in tree.cells]
        # the node-level cell holding each cell at or below the node level (None above it)
        self.node_of: list[int | None] = [None] * n
        for c in reversed(tree.cells):  # parents before children
            if c.level == self.node_level:
                self.node_of[c.index] = c.index
            elif c.level < self.node_level and c.parent is not None:
                self.node_of[c.index] = self.node_of[c.parent.index]
        self.busy = [0] * n  # leaves used by a job or bad
        self.bad = [0] * n
        self.opp = [0] * n  # leaves used by opportunistic jobs
        self.leaf_job: list[str | None] = [None] * len(tree.leaves)
        self.leaf_bad = [False] * len(tree.leaves)
        self.leaf_cell = [None] * len(tree.leaves)
        for c in tree.cells:
            if c.level == 0:
                self.leaf_cell[c.lo] = c
        # descendants of each cell at each level, bottom-up (cells are stored children first): O(1) lookups on the hot path
        self.desc_at: list[list[int]] = [[0] * nl for _ in range(n)]
        for c in tree.cells:
            row = self.desc_at[c.index]
            row[c.level] = 1
            for k in c.children:
                for lv, cnt in enumerate(self.desc_at[k.index]):
                    if cnt:
                        row[lv] += cnt
        # cells are stored in post-order, so a subtree is the index range [first[c], c]
        self.first = [0] * n
        for c in tree.cells:
            self.first[c.index] = self.first[c.children[0].index] if c.children else c.index

    def ancestors(self, cell: Cell) -> Iterable[Cell]:
        c = cell
        while c is not None:
            yield c
            c = c.parent

    def count_at(self, cell: Cell, level: int) -> int:
        """Number of descendants of ``cell`` at ``level`` (1 for the cell's own level, 0 above it)."""
        return self.desc_at[cell.index][level]

    # -- occupancy buddy: maximal idle (no job, healthy) cells --------------------------
    def mark_busy(self, leaf: int) -> None:
        cell = self.leaf_cell[leaf]
        top = cell
        while top.parent is not None and self.busy[top.parent.index] == 0:
            top = top.parent
        if self.busy[top.index] == 0:
            self.occ_free[top.level].pop(top.index, None)
            node = top
            while node is not cell:
                nxt = next(k for k in node.children if k.lo <= leaf < k.hi)
                for k in node.children:
                    if k is not nxt:
                        self.occ_free[k.level][k.index] = k
                node = nxt
        for a in self.ancestors(cell):
            self.busy[a.index] += 1

    def mark_busy_cell(self, cell: Cell) -> None:
        """Mark a wholly idle cell busy in one step (split its maximal idle ancestor down to it)."""
        top = cell
        while top.parent is not None and self.busy[top.parent.index] == 0:
            top = top.parent
        self.occ_free[top.level].pop(top.index, None)
        node = top
        while node is not cell:
            nxt = next(k for k in node.children if k.lo <= cell.lo < k.hi)
            for k in node.children:
                if k is not nxt:
                    self.occ_free[k.level][k.index] = k
            node = nxt
        self.add_subtree(self.busy, cell, +1)

    def mark_idle_cell(self, cell: Cell) -> None:
        """Inverse of :meth:`mark_busy_cell` for a cell whose leaves are all busy with one healthy job."""
        self.add_subtree(self.busy, cell, -1)
        cur = cell
        self.occ_free[cur.level][cur.index] = cur
        while cur.parent is not None and self.busy[cur.parent.index] == 0:
            for k in cur.parent.children:
                self.occ_free[k.level].pop(k.index, None)
            cur = cur.parent
            self.occ_free[cur.level][cur.index] = cur

    def add_subtree(self, counter: list[int], cell: Cell, sign: int) -> None:
        """Count every leaf of ``cell`` once more (``sign=+1``) or less in ``counter`` for the cell, its subtree and ancestors."""
        lo, hi = self.first[cell.index], cell.index + 1
        if hi - lo == 1:
            counter[lo] += sign
        elif sign > 0:
            counter[lo:hi] = [x + n for x, n in zip(counter[lo:hi], self.sizes[lo:hi], strict=True)]
        else:
            counter[lo:hi] = [x - n for x, n in zip(counter[lo:hi], self.sizes[lo:hi], strict=True)]
        a = cell.parent
        while a is not None:
            counter[a.index] += sign * cell.size
            a = a.parent

    def mark_idle(self, leaf: int) -> None:
        cell = self.leaf_cell[leaf]
        for a in self.ancestors(cell):
            self.busy[a.index] -= 1
        cur = cell
        self.occ_free[cur.level][cur.index] = cur
        while cur.parent is not None and self.busy[cur.parent.index] == 0:
            for k in cur.parent.children:
                self.occ_free[k.level].pop(k.index, None)
            cur = cur.parent
            self.occ_free[cur.level][cur.index] = cur

    # -- binding buddy ----------------------------------------------------------------
    def bind_take(self, target: Cell) -> None:
        """Remove ``target`` from the binding free list, splitting its maximal free ancestor."""
        path = []
        a = target
        while a is not None and a.index not in self.bind_free[a.level]:
            path.append(a)
            a = a.parent
        if a is None:
            raise InputError(f"cell {target.address} is not free for binding")
        del self.bind_free[a.level][a.index]
        node = a
        for nxt in reversed(path):
            for k in node.children:
                if k is not nxt:
                    self.bind_free[k.level][k.index] = k
            node = nxt

    def bind_give(self, cell: Cell) -> None:
        """Return ``cell`` to the binding free list and merge with free buddies (HiveD addCellToFreeList)."""
        cur = cell
        self.bind_free[cur.level][cur.index] = cur
        while cur.parent is not None and all(k.index in self.bind_free[k.level] for k in cur.parent.children):
            for k in cur.parent.children:
                del self.bind_free[k.level][k.index]
            cur = cur.parent
            self.bind_free[cur.level][cur.index] = cur


def _parse_quota(spec: Any, trees: dict[str, CellTree], vc: str) -> dict[str, dict[int, int]]:
    if not isinstance(spec, Mapping):
        raise InputError(f"expected a mapping of cell level to count, got {type(spec).__name__}", where=f"virtual_clusters.{vc}")
    out: dict[str, dict[int, int]] = {}

    def add(chain: str, level_name: str, count: Any, where: str) -> None:
        tree = trees[chain]
        names = [lv.name for lv in tree.levels]
        if level_name not in names:
            raise InputError(f"unknown cell level {level_name!r}; chain {chain} has {', '.join(names)}", where=where)
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise InputError(f"expected a non-negative integer cell count, got {count!r}", where=where)
        if count > MAX_QUOTA_CELLS:
            raise QuotaError(f"expected a cell count <= {MAX_QUOTA_CELLS} (the limit), got {count}", where=where)
        if count:
            lv = names.index(level_name)
            out.setdefault(chain, {})[lv] = out.setdefault(chain, {}).get(lv, 0) + count
            cells = sum(1 for c in tree.cells if c.level == lv and c.full)
            if out[chain][lv] > cells:  # checked before any virtual cell is built: a quota of 2^31 cells costs nothing
                raise QuotaError(f"illegal virtual cluster assignment: chain {chain} level {level_name!r} is short of {out[chain][lv] - cells} "
                                 f"cell(s) (VC {vc} demands {out[chain][lv]}, the cluster has {cells})", where=where)

    for key, value in spec.items():
        where = f"virtual_clusters.{vc}.{key}"
        if key in trees:
            if not isinstance(value, Mapping):
                raise InputError("expected a mapping of cell level to count", where=where)
            for lv, cnt in value.items():
                add(key, lv, cnt, f"{where}.{lv}")
            continue
        chains = [c for c, t in trees.items() if any(lv.name == key for lv in t.levels)]
        if not chains:
            known = sorted({lv.name for t in trees.values() for lv in t.levels})
            raise InputError(f"unknown cell level {key!r}; expected one of {', '.join(known)} or a chain ({', '.join(trees)})", where=where)
        if len(chains) > 1:
            raise InputError(f"level {key!r} exists in chains {', '.join(chains)}; write {{chain: {{{key}: n}}}}", where=where)
        add(chains[0], key, value, where)
    return out


def decompose(tree: CellTree, gpus: int, below: int | None = None) -> list[int]:
    """Split a GPU count into cell levels, largest first (12 GPUs on DGX H100: host + numa).

    >>> import topology
    >>> t = cell_hierarchy(topology.default_cluster())["H100-SXM5-80GB"]
    >>> [t.levels[i].name for i in decompose(t, 12)]
    ['host', 'numa']
    """
    out, rem = [], gpus
    for level in range(len(tree.levels) - 1 if below is None else below - 1, -1, -1):
        size = tree.levels[level].size
        while rem >= size:
            out.append(level)
            rem -= size
    return out


_NO_VC = _VCChain("", CellTree("", [], [], [], []), {})  # an empty VC chain, for lookups


class HivedScheduler:
    """HiveD's allocator over a topology: VCs, buddy cells, gangs, preemption, bad hardware.

    ``virtual_clusters`` maps a VC name to its quota, ``{level: count}`` or
    ``{chain: {level: count}}``; infeasible quotas raise :class:`QuotaError`.
    ``relax``: when no cell of a piece's level is free, ``True`` splits the
    piece into smaller cells, possibly on several nodes (the planner's rule, not
    HiveD's); ``"node"`` is HiveD's rule: pieces at or below the node level stay
    whole (a pod stays within one node-level cell), larger ones split into
    node-sized pieces; ``False`` never splits. ``pinned`` maps a VC to cells it
    pins (addresses, or ``[chain, address]``): bound for good, used only by
    requests that name them.
    """

    def __init__(self, topo: Topology, virtual_clusters: Mapping[str, Any] | None = None, *, forge: bool = True,
                 trees: dict[str, CellTree] | None = None, relax: bool | str = True, pinned: Mapping[str, Any] | None = None):
        self.topo = topo
        self.forge = forge
        if relax not in (True, False, "node"):
            raise InputError(f"relax must be true, false or 'node', got {relax!r}", where="relax")
        self.relax = relax
        self.trees = trees or cell_hierarchy(topo, forge=forge)
        self.spare_opportunistic = True  # binding splits a larger clean cell rather than take one with opportunistic work
        self.opportunistic_in_bound_cells = True  # as HiveD: opportunistic jobs may use idle GPUs of VC-bound cells (last resort)
        self.phase_s: dict[str, float] | None = None  # set to dict.fromkeys(PHASES, 0.0) to time allocations by phase
        self._phase_stack: list[str] = []
        self._phase_t0 = 0.0
        self.chains = {name: _Chain(t) for name, t in self.trees.items()}
        self.vc_spec = {str(k): v for k, v in (virtual_clusters or {}).items()}
        self.vcs: dict[str, dict[str, _VCChain]] = {}
        for vc, spec in self.vc_spec.items():
            quota = _parse_quota(spec, self.trees, vc)
            self.vcs[vc] = {chain: _VCChain(vc, self.trees[chain], q) for chain, q in quota.items()}
        self.pinned_spec = {str(vc): [list(p) if isinstance(p, (list, tuple)) else p for p in cells] for vc, cells in (pinned or {}).items()}
        for vc, cells in self.pinned_spec.items():
            self._pin(vc, cells)
        self.jobs: dict[str, _Job] = {}
        self.groups: dict[str, list[str]] = {}  # pod group -> its pods' job names (allocate_group)
        self._group_of: dict[str, str] = {}
        self._seq = 0
        self.host_of_gpu = {g: self.topo.host_of(g) for g in self.topo.gpus()}
        for chain, report in self._walk(healthy=False).items():
            if report["deficits"]:
                d = report["deficits"][0]
                raise QuotaError(
                    f"illegal virtual cluster assignment: chain {chain} level {d['level']!r} is short of {d['missing']} cell(s) "
                    f"(VCs demand {d['demand']}, the cluster can provide {d['available']} after higher levels)",
                    where="virtual_clusters")

    def _pin(self, vc: str, cells: Any) -> None:
        """Bind each pinned cell to a preassigned virtual cell of ``vc`` for good (HiveD's ``initPinnedCells``)."""
        where = f"pinned.{vc}"
        if not isinstance(cells, list):
            raise InputError("expected a list of cell addresses (or [chain, address] pairs)", where=where)
        for k, item in enumerate(cells):
            chain, addr = (item if isinstance(item, list) and len(item) == 2 else (None, item))
            matches = [(c, t) for c, t in self.trees.items() if (chain is None or c == chain) and addr in t.by_address]
            if len(matches) != 1:
                raise InputError(f"{'no' if not matches else 'more than one'} cell with address {addr!r}", where=f"{where}[{k}]")
            chain, tree = matches[0]
            cell = tree.by_address[addr]
            vch = self.vcs.setdefault(vc, {}).setdefault(chain, _VCChain(vc, tree, {}))
            if addr in vch.pinned:
                raise InputError(f"cell {addr!r} is pinned twice", where=f"{where}[{k}]")
            root = VirtualCell(vc, cell.level, None, 0, len(vch.roots), pid=addr)
            try:
                self._bind(self.chains[chain], root, cell)
            except InputError:
                raise InputError(f"cell {addr!r} overlaps another pinned cell", where=f"{where}[{k}]") from None
            vch.roots.append(root)
            vch.pinned[addr] = root
            vch.free[cell.level][id(root)] = root

    # -- public queries -----------------------------------------------------------------
    def levels(self, chain: str | None = None) -> list[str]:
        return [lv.name for lv in self._tree(chain).levels]

    def _tree(self, chain: str | None) -> CellTree:
        if chain is None:
            return next(iter(self.trees.values()))
        try:
            return self.trees[chain]
        except KeyError:
            raise InputError(f"unknown GPU chain {chain!r}; expected one of {', '.join(self.trees)}") from None

    def free_lists(self) -> dict[str, dict[str, dict[str, list[str]]]]:
        """The binding and occupancy free lists, by chain and level, as cell addresses (in list order)."""
        out = {}
        for name, ch in self.chains.items():
            out[name] = {
                "binding": {ch.tree.levels[lv].name: [c.address for c in d.values()] for lv, d in enumerate(ch.bind_free) if d},
                "occupancy": {ch.tree.levels[lv].name: [c.address for c in d.values()] for lv, d in enumerate(ch.occ_free) if d},
            }
        return out

    def idle_gpus(self, chain: str | None = None) -> int:
        """Healthy GPUs that no job uses."""
        return sum(len(ch.tree.leaves) - ch.busy[top.index] for ch in self._chains(chain) for top in ch.tree.tops)

    def _chains(self, chain: str | None) -> list[_Chain]:
        return list(self.chains.values()) if chain is None else [self.chains[self._tree(chain).chain]]

    # -- the safety walk -----------------------------------------------------------------
    @_phase("walk")
    def _walk(self, *, healthy: bool, chain: str | None = None) -> dict[str, dict[str, Any]]:
        """HiveD's top-down cell-count check against every VC's unbound quota."""
        out = {}
        for name, ch in self.chains.items():
            if chain is not None and name != chain:
                continue
            tree = ch.tree
            nl = len(tree.levels)
            usable = [0] * nl
            stack = [c for lv in range(nl) for c in ch.bind_free[lv].values()]
            while stack:  # maximal usable (full, healthy when asked) cells inside the free cells
                c = stack.pop()
                if c.full and not (healthy and ch.bad[c.index]):
                    usable[c.level] += 1
                else:
                    stack.extend(c.children)
            demand = [0] * nl
            for vcs in self.vcs.values():
                vch = vcs.get(name)
                if vch:
                    for r in vch.roots:
                        if r.physical is None:
                            demand[r.level] += 1
            carry, deficits, rows = 0, [], []
            for lv in range(nl - 1, -1, -1):
                avail = carry + usable[lv]
                left = avail - demand[lv]
                rows.append({"level": tree.levels[lv].name, "available": avail, "demand": demand[lv]})
                if left < 0:
                    deficits.append({"level": tree.levels[lv].name, "missing": -left, "demand": demand[lv], "available": avail})
                    left = 0
                carry = left * tree.levels[lv].fanout if lv > 0 else 0
            out[name] = {"levels": rows, "deficits": deficits}
        return out

    def guarantee_report(self) -> dict[str, Any]:
        """Per chain: whether healthy free cells still cover every VC's unbound quota; per VC: bad GPUs in its bound cells.

        ``ok`` is False when bad hardware has degraded a guarantee; ``deficits``
        say at which level and by how many cells.
        """
        walk = self._walk(healthy=True)
        vcs = {}
        for vc, chains in self.vcs.items():
            entry = {}
            for name, vch in chains.items():
                ch = self.chains[name]
                bad_bound = sum(ch.bad[r.physical.index] for r in vch.roots if r.physical is not None)
                entry[name] = {"quota": {ch.tree.levels[lv].name: n for lv, n in sorted(vch.quota.items())},
                               "bound_cells": sum(r.physical is not None for r in vch.roots), "bad_gpus_in_bound_cells": bad_bound}
            vcs[vc] = entry
        ok = all(not w["deficits"] for w in walk.values()) and all(
            e["bad_gpus_in_bound_cells"] == 0 for chains in vcs.values() for e in chains.values())
        return {"ok": ok, "chains": walk, "virtual_clusters": vcs}

    # -- allocation ------------------------------------------------------------------------
    @_phase("other")
    def allocate(self, job: str, gpus: int, *, vc: str | None = None, priority: int = 0, chain: str | None = None,
                 plan: list[tuple] | None = None, exclude: set[str] | None = None, dry: bool = False, lazy: bool = False,
                 pinned: str | None = None) -> AllocationResult:
        """Place a gang of ``gpus`` GPUs for ``job``: in VC ``vc`` (guaranteed) or anywhere (``vc=None``, opportunistic).

        ``plan`` commits a candidate found by :meth:`candidates`; ``exclude`` names
        cells the first piece must avoid (used to enumerate alternatives); ``dry``
        finds the placement (and whom it would preempt) and changes nothing.
        ``lazy``: when a higher-priority job of its VC preempts this (guaranteed)
        job, it is downgraded to opportunistic on the same GPUs instead of
        stopped, and stopped only if the preemptor needs those very GPUs
        (HiveD's ``lazyPreemptionEnable``). ``pinned`` (a cell address the VC
        pins) places the job inside that pinned cell; without it, a guaranteed
        job uses only the VC's ordinary quota (HiveD's ``pinnedCellId``). A
        request its VC can never hold fails at once with ``reason["never"] = True``.
        """
        if job in self.jobs:
            raise InputError(f"job {job!r} is already running")
        if not isinstance(gpus, int) or gpus < 1:
            raise InputError(f"job {job!r}: gpus must be a positive integer, got {gpus!r}")
        if vc is None:
            priority = OPPORTUNISTIC
        elif vc not in self.vcs:
            raise InputError(f"job {job!r}: unknown virtual cluster {vc!r}; expected one of {', '.join(self.vcs) or '(none)'}")
        elif not MIN_GUARANTEED <= priority <= MAX_GUARANTEED:
            raise InputError(f"job {job!r}: guaranteed priority must be in {MIN_GUARANTEED}..{MAX_GUARANTEED}, got {priority}")
        chains = [self._tree(chain).chain] if chain else list(self.trees)
        if pinned is not None:
            if vc is None or not any(pinned in v.pinned for v in self.vcs[vc].values()):
                raise InputError(f"job {job!r}: VC {vc} pins no cell {pinned!r}")
            chains = [c for c in chains if pinned in self.vcs[vc].get(c, _NO_VC).pinned]
        if vc is not None:
            chains = [c for c in chains if c in self.vcs[vc]]
            if not chains:
                return AllocationResult(job, False, reason={"resource": "quota", "level": None, "chain": chain,
                                                            "message": f"VC {vc} has no quota in chain {chain or 'any'}"})
        if plan is None and vc is not None:
            never = self.never_fits(gpus, vc, chain, pinned=pinned)
            if never is not None:
                return AllocationResult(job, False, reason=never)
        last: dict[str, Any] | None = None
        for name in chains:
            if plan is not None and plan and plan[0][0] != name:
                continue
            if vc is None:
                res = self._alloc_opportunistic(job, gpus, name, plan, exclude or set(), dry)
            elif plan is None and not (vch := self.vcs[vc][name]).pinned and self._quota_gpus(vch) - sum(vch.gpus_at.values()) < gpus:
                tree = self.trees[name]
                lv = decompose(tree, gpus)[0]
                res = AllocationResult(job, False, chain=name, reason={  # by count alone: only preemption can help
                    "resource": "quota", "level": tree.levels[lv].name, "chain": name, "vc": vc,
                    "message": f"VC {vc} quota exhausted: fewer than {gpus} GPUs of its quota are free"})
            else:
                res = self._alloc_guaranteed(job, gpus, vc, priority, name, plan, exclude or set(), dry, pid=pinned)
            if vc is not None and not res.ok and not dry and res.reason and res.reason.get("resource") == "quota":
                pre = self._try_priority_preemption(job, gpus, vc, priority, name, pinned)
                if pre is not None:
                    res = pre
            if res.ok:
                if not dry and vc is not None:
                    self.jobs[job].lazy = lazy
                return res
            last = res.reason
        return AllocationResult(job, False, reason=last)

    def _may_split(self, tree: CellTree, lv: int) -> bool:
        """Whether a piece of level ``lv`` that finds no free cell may be split into smaller cells (see ``relax``)."""
        if self.relax is True:
            return lv > 0
        if self.relax == "node":
            return lv > self.chains[tree.chain].node_level
        return False

    def _downgrade(self, victim: _Job) -> None:
        """Lazy preemption: the freed guaranteed job keeps its GPUs as an opportunistic job (HiveD's lazyPreemptAffinityGroup)."""
        plan = [(victim.chain, c.level, c.address) for c in victim.physical]
        res = self._alloc_opportunistic(victim.id, 0, victim.chain, plan, set())
        assert res.ok, res.reason
        self.jobs[victim.id].seq = victim.seq

    def _physical_of(self, v: VirtualCell) -> Cell | None:
        if v.parent is None:
            return v.physical
        p = self._physical_of(v.parent)
        return None if p is None else p.children[v.pos]

    def _alloc_guaranteed(self, job: str, gpus: int, vc: str, priority: int, chain: str, plan: list[tuple] | None,
                          exclude: set[str], dry: bool = False, pid: str | None = None) -> AllocationResult:
        ch, vch = self.chains[chain], self.vcs[vc][chain]
        tree = ch.tree
        work = decompose(tree, gpus) if plan is None else [p[1] for p in plan]
        taken: list[VirtualCell] = []
        first_fail: int | None = None
        i = 0
        while work:
            lv = work.pop(0)
            if plan is not None:
                v = self._vtake_path(ch, vch, plan[i][2], plan[i][3], plan[i][4])
            else:
                v = self._valloc(ch, vch, lv, taken, exclude if i == 0 else set(), pid)
            if v is None and plan is None and self._may_split(tree, lv):
                # split the piece into smaller cells (see ``relax``: the planner's rule, or HiveD's within one node)
                first_fail = lv if first_fail is None else first_fail
                work[0:0] = decompose(tree, tree.levels[lv].size, below=lv)
                continue
            if v is None:
                for t in taken:
                    self._vfree(ch, vch, t)
                lv = lv if first_fail is None else first_fail
                healthy_short = self._vc_has_only_bad(ch, vch, lv)
                msg = (f"VC {vc} has no healthy free cell of level {tree.levels[lv].name!r} (bad hardware degrades its guarantee)"
                       if healthy_short else f"VC {vc} quota exhausted: no free {tree.levels[lv].name!r} cell ({tree.levels[lv].size} GPUs) left")
                return AllocationResult(job, False, chain=chain, reason={"resource": "bad_hardware" if healthy_short else "quota",
                                                                         "level": tree.levels[lv].name, "chain": chain, "vc": vc, "message": msg})
            v.job = job
            taken.append(v)
            i += 1
        # occupy: preempt opportunistic jobs first (inter-VC preemption)
        phys = [self._physical_of(v) for v in taken]
        victims = {ch.leaf_job[leaf] for p in phys for leaf in range(p.lo, p.hi) if ch.leaf_job[leaf] is not None}
        plan_out = [(chain, v.level, v.vc, v.path(), vch.roots[v.root_index].physical.address) for v in taken]
        if dry:
            result = self._result(job, chain, phys, sorted(victims), plan_out)
            for v in reversed(taken):
                self._vfree(ch, vch, v)
            return result
        self._stop_victims(sorted(victims))
        leaves = [leaf for p in phys for leaf in range(p.lo, p.hi)]
        self._occupy(ch, job, phys, opportunistic=False)
        self._seq += 1
        self.jobs[job] = _Job(job, vc, priority, chain, leaves, taken, phys, self._seq, plan=plan_out)
        vch.add_job(self.jobs[job])
        return self._result(job, chain, phys, sorted(victims), plan_out)

    @_phase("preempt")
    def _stop_victims(self, victims: list[str]) -> None:
        for victim in victims:
            self.free(victim)

    def _vc_has_only_bad(self, ch: _Chain, vch: _VCChain, lv: int) -> bool:
        """True when the VC still has free quota of level >= ``lv`` but bad hardware makes all of it unusable."""
        any_free = False
        for lvl in range(lv, len(vch.free)):
            for v in vch.free[lvl].values():
                any_free = True
                p = self._physical_of(v)
                if p is None:
                    if self._bind_safely(ch, v, lvl, lv, set(), keep=False):
                        return False
                elif ch.bad[p.index] < ch.count_at(p, lv):
                    return False
        return any_free

    @_phase("search")
    def _valloc(self, ch: _Chain, vch: _VCChain, lv: int, near: list[VirtualCell], exclude: set[str], pid: str | None = None) -> VirtualCell | None:
        """Virtual buddy allocation inside a VC, binding the preassigned cell on first use; ``pid``: inside that pinned cell only."""
        anchor = self._physical_of(near[0]) if near else None
        if anchor is not None:
            # a later piece of a gang: the bound free cell closest to the first piece at any level (lowest common ancestor
            # first, then the lowest level), as HiveD's search for the lowest LCA; else the buddy order below
            close, close_key = None, None
            for lvl in range(lv, len(vch.free)):
                for n, v in enumerate(vch.free[lvl].values()):
                    if n >= SCAN_LIMIT and close is not None:
                        break
                    p = self._physical_of(v) if v.pid == pid else None
                    if p is None or ch.bad[p.index] >= ch.count_at(p, lv) or (lvl == lv and (ch.bad[p.index] or p.address in exclude)):
                        continue
                    key = (self._affinity(anchor, p), lvl, ch.bad[p.index], ch.opp[p.index])
                    if close_key is None or key < close_key:
                        close, close_key = v, key
            if close is not None and close_key[0] <= ch.node_level:  # within the first piece's node: stay there
                return self._vsplit_down(ch, vch, close, lv, anchor, exclude)
        for lvl in range(lv, len(vch.free)):
            best, best_key, unbound = None, None, None
            for n, v in enumerate(vch.free[lvl].values()):
                if n >= SCAN_LIMIT and best is not None:
                    break
                if v.pid != pid:
                    continue
                p = self._physical_of(v)
                if p is None:  # an unbound preassigned cell; all are alike, so consider the first one only
                    unbound = unbound or v
                    continue
                else:
                    if ch.bad[p.index] >= ch.count_at(p, lv) or (lvl == lv and (ch.bad[p.index] or p.address in exclude)):
                        continue
                    key = (0, self._affinity(anchor, p), ch.bad[p.index], ch.opp[p.index])
                if best_key is None or key < best_key:
                    best, best_key = v, key
            if (best is not None and unbound is not None and lvl == lv and self.spare_opportunistic and ch.opp[self._physical_of(best).index]
                    and self._bind_safely(ch, unbound, lvl, lv, exclude, clean=True)):
                best = unbound  # the free virtual cell would preempt opportunistic work: bind another preassigned cell to a clean cell
            if best is None and unbound is not None and self._bind_safely(ch, unbound, lvl, lv, exclude):
                best = unbound  # bound now: a healthy physical cell with a healthy level-lv part, safe for the other VCs
            if best is None:
                continue
            return self._vsplit_down(ch, vch, best, lv, anchor, exclude)
        return None

    def _vsplit_down(self, ch: _Chain, vch: _VCChain, v: VirtualCell, lv: int, anchor: Cell | None, exclude: set[str]) -> VirtualCell:
        """Take free virtual cell ``v`` and split it down to level ``lv``, choosing the closest, healthiest, least-busy child."""
        del vch.free[v.level][id(v)]
        while v.level > lv:
            self._vsplit(vch, v)
            p = self._physical_of(v)
            choices = [k for k in v.children if ch.bad[p.children[k.pos].index] < ch.count_at(p.children[k.pos], lv)]
            if v.level - 1 == lv:
                choices = [k for k in choices if not ch.bad[p.children[k.pos].index]]

            def rank(k: VirtualCell, p: Cell = p) -> tuple:
                pc = p.children[k.pos]
                return (pc.address in exclude, self._affinity(anchor, pc), ch.bad[pc.index], ch.opp[pc.index], k.pos)

            k = min(choices, key=rank)
            del vch.free[k.level][id(k)]
            v = k
        return v

    def _vsplit(self, vch: _VCChain, v: VirtualCell) -> None:
        fan = vch.tree.levels[v.level].fanout
        v.children = [VirtualCell(v.vc, v.level - 1, v, i, v.root_index, v.pid) for i in range(fan)]
        for k in v.children:
            vch.free[k.level][id(k)] = k

    def _vtake_path(self, ch: _Chain, vch: _VCChain, vc: str, path: list[int], root_cell: str) -> VirtualCell:
        """Take the virtual cell at ``path`` (root index, child positions), binding its root to ``root_cell`` if unbound."""
        v = vch.roots[path[0]]
        if v.physical is None:
            self._bind(ch, v, ch.tree.by_address[root_cell])
        elif v.physical.address != root_cell:
            raise InputError(f"VC {vc}: preassigned cell {path[0]} is bound to {v.physical.address}, not {root_cell}")
        for pos in path[1:]:
            if id(v) in vch.free[v.level]:
                del vch.free[v.level][id(v)]
                self._vsplit(vch, v)
            elif v.children is None:
                raise InputError(f"VC {vc}: virtual cell {v.path()} is in use")
            v = v.children[pos]
        if id(v) not in vch.free[v.level]:
            raise InputError(f"VC {vc}: virtual cell {path} is not free")
        del vch.free[v.level][id(v)]
        return v

    def _vfree(self, ch: _Chain, vch: _VCChain, v: VirtualCell) -> None:
        v.job = None
        vch.free[v.level][id(v)] = v
        while v.parent is not None and all(id(k) in vch.free[k.level] and k.children is None for k in v.parent.children):
            for k in v.parent.children:
                del vch.free[k.level][id(k)]
            v = v.parent
            v.children = None
            vch.free[v.level][id(v)] = v
        if v.parent is None and v.physical is not None and v.children is None and v.pid is None:  # pinned cells stay bound
            self._unbind(ch, v)

    def _affinity(self, anchor: Cell | None, p: Cell) -> int:
        """Level of the lowest common ancestor of ``anchor`` and ``p`` (lower is closer)."""
        if anchor is None:
            return 0
        a, b = anchor, p
        while a is not None and b is not None and a is not b:
            if a.level <= b.level:
                a = a.parent
            else:
                b = b.parent
        return 99 if a is None or b is None else a.level

    def _bind_choice(self, ch: _Chain, level: int, need: int, exclude: set[str]) -> Cell | None:
        """Buddy allocation on the binding free list: a full cell of ``level`` with a healthy level-``need`` part."""
        return next(self._bind_candidates(ch, level, need, exclude), None)

    def _bind_safely(self, ch: _Chain, v: VirtualCell, level: int, need: int, exclude: set[str], *, keep: bool = True,
                     clean: bool = False) -> bool:
        """Bind root ``v`` to the first candidate that keeps HiveD's safety walk feasible; False when none does.

        Preferring healthy cells (and cells with fewer opportunistic jobs) over
        the plain buddy order can split a cell another VC is owed; each choice is
        therefore checked with the walk and undone when it breaks it. When only
        bad hardware could serve the request without breaking another VC's
        guarantee, nothing is bound: the request fails (HiveD's "doomed bad
        cell" case) instead of taking another VC's cells. ``keep=False`` only tests;
        ``clean=True`` considers only cells without opportunistic work.
        """
        for c in self._bind_candidates(ch, level, need, exclude):
            if clean and ch.opp[c.index]:
                return False  # candidates come clean ones first
            self._bind(ch, v, c)
            if not self._walk(healthy=False, chain=ch.tree.chain)[ch.tree.chain]["deficits"]:
                if not keep:
                    self._unbind(ch, v)
                return True
            self._unbind(ch, v)
        return False

    def _bind_candidates(self, ch: _Chain, level: int, need: int, exclude: set[str]):
        """Binding choices in preference order: cells without opportunistic work first (when ``spare_opportunistic``),
        then lowest level (buddy), healthy, fewest opportunistic GPUs.

        HiveD's buddy allocation takes a free cell of the level when there is one,
        preferring the fewest opportunistic GPUs; splitting a larger clean cell
        instead, when the walk allows it, preempts fewer opportunistic jobs
        (``spare_opportunistic=False`` restores HiveD's order).
        """
        def ok(c: Cell) -> bool:
            return c.full and ch.bad[c.index] < ch.count_at(c, need) and c.address not in exclude and not (level == need and ch.bad[c.index])

        def key(c: Cell) -> tuple:
            return (ch.bad[c.index] > 0, ch.opp[c.index], ch.bad[c.index], c.index)

        dirty: list[Cell] = []  # cells with opportunistic work: taken only when no clean cell of any level can be split
        for lvl in range(level, len(ch.bind_free)):
            cands = []
            for n, c in enumerate(ch.bind_free[lvl].values()):
                if n >= SCAN_LIMIT and cands:
                    break
                if lvl == level:
                    if ok(c):
                        cands.append(c)
                elif self._has_bindable(ch, c, level, ok, bool(exclude)):
                    cands.append(c)
            for c in sorted(cands, key=key):
                while c.level > level:
                    c = min((k for k in c.children if self._has_bindable(ch, k, level, ok, bool(exclude))), key=key)
                if ch.opp[c.index] and self.spare_opportunistic:
                    dirty.append(c)
                else:
                    yield c
        yield from sorted(dirty, key=lambda c: (ch.bad[c.index] > 0, ch.opp[c.index], c.level, c.index))

    def _has_bindable(self, ch: _Chain, c: Cell, level: int, ok, excluding: bool) -> bool:
        if c.level == level:
            return ok(c)
        if c.full and ch.bad[c.index] == 0 and not excluding:
            return True  # a healthy full cell has healthy full descendants at every lower level
        return any(self._has_bindable(ch, k, level, ok, excluding) for k in c.children)

    @_phase("bind")
    def _bind(self, ch: _Chain, v: VirtualCell, cell: Cell) -> None:
        ch.bind_take(cell)
        v.physical = cell
        ch.bound[cell.index] = v
        for a in ch.ancestors(cell):
            ch.bound_in[a.index] += 1
        lo = ch.first[cell.index]
        ch.covered[lo:cell.index + 1] = [x + 1 for x in ch.covered[lo:cell.index + 1]]

    @_phase("bind")
    def _unbind(self, ch: _Chain, v: VirtualCell) -> None:
        cell = v.physical
        v.physical = None
        ch.bound[cell.index] = None
        for a in ch.ancestors(cell):
            ch.bound_in[a.index] -= 1
        lo = ch.first[cell.index]
        ch.covered[lo:cell.index + 1] = [x - 1 for x in ch.covered[lo:cell.index + 1]]
        ch.bind_give(cell)

    def _alloc_opportunistic(self, job: str, gpus: int, chain: str, plan: list[tuple] | None, exclude: set[str],
                             dry: bool = False) -> AllocationResult:
        ch = self.chains[chain]
        tree = ch.tree
        if plan is not None:
            cells = [tree.by_address[p[2]] for p in plan]
            for c in cells:
                if ch.busy[c.index]:
                    raise InputError(f"job {job!r}: planned cell {c.address} is no longer idle")
        elif self.idle_gpus(chain) < gpus:
            lv = decompose(tree, gpus)[0]
            return AllocationResult(job, False, chain=chain, reason={
                "resource": "gpus", "level": tree.levels[lv].name, "chain": chain,
                "message": f"only {self.idle_gpus(chain)} idle healthy GPUs in chain {chain}, {gpus} needed"})
        else:
            cells: list[Cell] = []
            work = decompose(tree, gpus)
            first_fail: int | None = None
            while work:
                lv = work.pop(0)
                c = self._occ_choice(ch, lv, cells[0] if cells else None, exclude if not cells else set())
                if c is None and self._may_split(tree, lv):
                    first_fail = lv if first_fail is None else first_fail
                    work[0:0] = decompose(tree, tree.levels[lv].size, below=lv)
                    continue
                if c is None:
                    lv = lv if first_fail is None else first_fail
                    for t in cells:
                        ch.mark_idle_cell(t)
                    return AllocationResult(job, False, chain=chain, reason={
                        "resource": "gpus", "level": tree.levels[lv].name, "chain": chain,
                        "message": f"no idle healthy {tree.levels[lv].name!r} cell ({tree.levels[lv].size} GPUs) in chain {chain}"})
                cells.append(c)
                ch.mark_busy_cell(c)  # reserve now so the next piece does not pick the same GPUs
            for c in reversed(cells):
                ch.mark_idle_cell(c)
        leaves = [leaf for c in cells for leaf in range(c.lo, c.hi)]
        if dry:
            return self._result(job, chain, cells, [], [(chain, c.level, c.address) for c in cells])
        self._occupy(ch, job, cells, opportunistic=True)
        self._seq += 1
        self.jobs[job] = _Job(job, None, OPPORTUNISTIC, chain, leaves, [], cells, self._seq)
        return self._result(job, chain, cells, [], [(chain, c.level, c.address) for c in cells])

    @_phase("search")
    def _occ_choice(self, ch: _Chain, lv: int, anchor: Cell | None, exclude: set[str], inside: Cell | None = None) -> Cell | None:
        """Buddy choice on the occupancy list for an opportunistic piece, keeping away from guaranteed work.

        Three tiers, as HiveD's opportunistic scheduler, which "stays away from
        guaranteed pods" node by node: (0) a level-``lv`` idle cell in a node
        that holds no VC-bound cell, (1) one outside every bound cell, (2) any
        idle cell (a guaranteed job may preempt it later). Within a tier, the
        lowest level with such a cell wins (buddy best fit), then affinity to
        ``anchor``. ``inside`` restricts the choice to one cell's subtree.
        """
        node_lv = ch.node_level
        memo: dict[tuple[int, int], bool] = {}

        def ok(c: Cell, tier: int, inside_bound: bool, tainted: bool) -> bool:
            """Whether idle cell ``c`` holds a full level-``lv`` cell of this tier or better."""
            if inside is not None and not (c.lo < inside.hi and inside.lo < c.hi):
                return False
            if c.level == lv:
                if not c.full or (inside is not None and not (inside.lo <= c.lo and c.hi <= inside.hi)):
                    return False
                return tier >= (2 if inside_bound or ch.bound_in[c.index] else 1 if tainted else 0)
            if inside_bound and tier < 2:
                return False
            if (tier >= 2 or (ch.bound_in[c.index] == 0 and not tainted)) and c.full and inside is None:
                return True  # a full cell has full descendants at every lower level
            key = (c.index, tier)
            if key not in memo:
                memo[key] = any(ok(k, tier, ch.bound[k.index] is not None,
                                   tainted or (k.level == node_lv and ch.bound_in[k.index] > 0)) for k in c.children if k.level >= lv)
            return memo[key]

        def flags(c: Cell) -> tuple[bool, bool]:
            node = ch.node_of[c.index]
            return ch.covered[c.index] > 0, node is not None and (ch.bound_in[node] > 0 or ch.covered[node] > 0)

        def key(c: Cell) -> tuple:
            return (self._affinity(anchor, c), c.index)

        def descend(c: Cell, f: tuple[bool, bool], tier: int) -> Cell:
            inside_bound, tainted = f
            while c.level > lv:
                kids = []
                for k in c.children:
                    fk = (inside_bound or ch.bound[k.index] is not None, tainted or (k.level == node_lv and ch.bound_in[k.index] > 0))
                    if k.level >= lv and ok(k, tier, *fk):
                        kids.append((key(k), k, fk))
                _, c, (inside_bound, tainted) = min(kids, key=lambda t: t[0])
            return c

        for tier in (0, 1, 2) if self.opportunistic_in_bound_cells else (0, 1):
            if anchor is not None and anchor.level <= node_lv:
                # a later piece of a gang: an idle cell in the first piece's node, at any level, comes first
                node = anchor
                while node.level < node_lv:
                    node = node.parent
                near, nkey, nflags = None, None, None
                for c in ch.tree.cells[ch.first[node.index]: node.index + 1]:  # the node's subtree (cells are stored in post-order)
                    if c.level < lv or c.index not in ch.occ_free[c.level]:
                        continue
                    f = flags(c)
                    if ok(c, tier, *f) and (nkey is None or (self._affinity(anchor, c), c.level) < nkey):
                        near, nkey, nflags = c, (self._affinity(anchor, c), c.level), f
                if near is not None:
                    return descend(near, nflags, tier)
            for lvl in range(lv, len(ch.occ_free)):
                best, bkey, bflags = None, None, None
                for n, c in enumerate(ch.occ_free[lvl].values()):
                    if n >= SCAN_LIMIT and best is not None:
                        break
                    if lvl == lv and c.address in exclude:
                        continue
                    f = flags(c)
                    if not ok(c, tier, *f):
                        continue
                    k = key(c)
                    if bkey is None or k < bkey:
                        best, bkey, bflags = c, k, f
                if best is None:
                    continue
                return descend(best, bflags, tier)
        return None

    @_phase("occupy")
    def _occupy(self, ch: _Chain, job: str, cells: list[Cell], *, opportunistic: bool) -> None:
        for c in cells:
            for leaf in range(c.lo, c.hi):
                ch.leaf_job[leaf] = job
            ch.mark_busy_cell(c)
            if opportunistic:
                ch.add_subtree(ch.opp, c, +1)

    def _result(self, job: str, chain: str, cells: list[Cell], preempted: list[str], plan: list[tuple]) -> AllocationResult:
        tree = self.trees[chain]
        return AllocationResult(job, True, gpus=[tree.leaves[leaf] for c in cells for leaf in range(c.lo, c.hi)],
                                cells=[c.address for c in cells], chain=chain, preempted=preempted, plan=plan)

    @_phase("preempt")
    def _try_priority_preemption(self, job: str, gpus: int, vc: str, priority: int, chain: str, pid: str | None = None) -> AllocationResult | None:
        """Intra-VC preemption: free lower-priority jobs of the same VC, lowest priority and newest first, until the job fits.

        Victims are counted before anything changes: when the VC's free GPUs plus
        every lower-priority job's GPUs cannot cover the request, nothing is
        touched. Otherwise victims are freed one by one until the job fits; if it
        still does not (bad hardware, or ``relax=False`` and the wrong shapes),
        the victims are put back on their exact cells.
        """
        vch = self.vcs[vc][chain]
        short = 0 if vch.pinned else gpus - (self._quota_gpus(vch) - sum(vch.gpus_at.values()))
        if not any(p < priority for p in vch.gpus_at) or sum(n for p, n in vch.gpus_at.items() if p < priority) < short:
            return None  # freeing every lower-priority job of the VC would not make room: touch nothing
        victims = sorted((j for j in vch.jobs.values() if j.priority < priority and j.virtual[0].pid == pid), key=lambda j: (j.priority, -j.seq))
        if not victims:
            return None
        freed: list[_Job] = []
        for v in victims:
            lazy = v.lazy
            self.free(v.id)
            freed.append(v)
            if lazy:
                self._downgrade(v)
            if sum(len(f.leaves) for f in freed) < short:
                continue
            res = self._alloc_guaranteed(job, gpus, vc, priority, chain, None, set(), pid=pid)
            if res.ok:
                lazily = [f.id for f in freed if f.lazy and f.id in self.jobs]
                res.preempted = sorted({f.id for f in freed if f.id not in lazily} | set(res.preempted))
                res.downgraded = lazily
                return res
        for v in reversed(freed):  # undo: every victim back on its cells, with its sequence number
            if v.id in self.jobs:
                self.free(v.id)
            back = self._alloc_guaranteed(v.id, 0, vc, v.priority, chain, v.plan, set())
            assert back.ok, (v.id, v.plan, back.reason)
            self.jobs[v.id].seq, self.jobs[v.id].lazy = v.seq, v.lazy
        return None

    def _quota_gpus(self, vch: _VCChain) -> int:
        return sum(vch.tree.levels[lv].size * n for lv, n in vch.quota.items())

    def never_fits(self, gpus: int, vc: str | None, chain: str | None = None, *, pinned: str | None = None) -> dict[str, Any] | None:
        """Why a request can never be placed, however the cluster drains (None when it can).

        A guaranteed request must fit its VC's whole quota: by GPU count when
        pieces may be split (``relax=True``), else by cells, as the virtual buddy
        allocator would cut them from an empty VC. An opportunistic request must
        fit the chain's GPUs.

        >>> import topology
        >>> s = HivedScheduler(topology.default_cluster(), {"a": {"host": 1}})
        >>> s.never_fits(16, "a")["message"]
        'VC a can never hold 16 GPUs: its quota in chain H100-SXM5-80GB is 8 GPUs (host x1)'
        >>> s.never_fits(8, "a") is None
        True
        """
        chains = [self._tree(chain).chain] if chain else list(self.trees)
        if vc is None:
            if any(gpus <= len(self.trees[c].leaves) for c in chains):
                return None
            return {"resource": "gpus", "level": None, "chain": chain, "never": True,
                    "message": f"needs {gpus} GPUs, no GPU chain has that many"}
        if pinned is not None:
            cells = [v.pinned[pinned].physical for v in self.vcs.get(vc, {}).values() if pinned in v.pinned]
            if cells and cells[0].size < gpus:
                return {"resource": "quota", "level": None, "chain": chain, "vc": vc, "never": True,
                        "message": f"pinned cell {pinned} of VC {vc} has {cells[0].size} GPUs, {gpus} requested"}
            return None
        why, level = None, None
        for name in chains:
            vch = self.vcs.get(vc, {}).get(name)
            if vch is None:
                continue
            tree = vch.tree
            desc = ", ".join(f"{tree.levels[lv].name} x{n}" for lv, n in sorted(vch.quota.items(), reverse=True))
            if self._quota_gpus(vch) < gpus:
                level = tree.levels[decompose(tree, gpus)[0]].name
                why = f"VC {vc} can never hold {gpus} GPUs: its quota in chain {name} is {self._quota_gpus(vch)} GPUs ({desc})"
                continue
            if self.relax is True:
                return None
            free = [vch.quota.get(lv, 0) for lv in range(len(tree.levels))]
            work, fits = decompose(tree, gpus), True
            while work:
                lv = work.pop(0)
                up = next((u for u in range(lv, len(free)) if free[u]), None)
                if up is None:
                    if self._may_split(tree, lv):
                        work[0:0] = decompose(tree, tree.levels[lv].size, below=lv)
                        continue
                    fits, level = False, tree.levels[lv].name
                    why = (f"VC {vc} can never hold a {tree.levels[lv].name!r} cell: its quota in chain {name} is {desc}, "
                           f"and that piece may not be split")
                    break
                free[up] -= 1
                for lower in range(lv, up):  # each split leaves the other children free
                    free[lower] += tree.levels[lower + 1].fanout - 1
            if fits:
                return None
        if why is None:
            why = f"VC {vc} has no quota in chain {chain or 'any'}"
        return {"resource": "quota", "level": level, "chain": chain, "vc": vc, "never": True, "message": why}

    @_phase("release")
    def free(self, job: str) -> list[str]:
        """Release a job's GPUs and cells (buddies merge back); returns its GPU ids.

        A pod group (:meth:`allocate_group`) is released whole, by its name or by
        any of its pods' (a preempted pod stops its whole gang).
        """
        group = self.groups.pop(job, None) or self.groups.pop(self._group_of.get(job, ""), None)
        if group is not None:
            out = []
            for pod in group:
                self._group_of.pop(pod, None)
                if pod in self.jobs:
                    out += self.free(pod)
            return out
        j = self.jobs.pop(job, None)
        if j is None:
            raise InputError(f"unknown job {job!r}")
        ch = self.chains[j.chain]
        for leaf in j.leaves:
            ch.leaf_job[leaf] = None
        for c in reversed(j.physical):
            ch.mark_idle_cell(c)
            if j.vc is None:
                ch.add_subtree(ch.opp, c, -1)
        if j.vc is not None:
            vch = self.vcs[j.vc][j.chain]
            vch.drop_job(j)
            for v in j.virtual:
                self._vfree(ch, vch, v)
        return [ch.tree.leaves[leaf] for leaf in j.leaves]

    # -- pod groups -----------------------------------------------------------------------------
    def allocate_group(self, job: str, pods: list[int], *, vc: str | None = None, priority: int = 0, within: str | None = None,
                       chain: str | None = None, lazy: bool = False, attempts: int = 8) -> AllocationResult:
        """Place a gang of pods of different sizes (HiveD's affinity group): each pod inside one node-level cell,
        all pods inside one cell of level ``within`` when given (V2's ``withinOneCell``); all or nothing.

        Pods are placed largest first, each as a job ``<job>/pod<i>``, by the
        same buddy choices as :meth:`allocate`; a pod whose pieces straddle two
        nodes, or a group that leaves its ``within`` cell, is retried with that
        pod's first cell excluded (up to ``attempts`` times per pod), so a
        placement that exists may be missed when the cluster is fragmented (no
        backtracking search, unlike HiveD's). On failure every change is undone.

        >>> import topology
        >>> s = HivedScheduler(topology.default_cluster(), {"a": {"hostx2": 1}})
        >>> r = s.allocate_group("g", [6, 6, 2], vc="a", within="hostx2")
        >>> r.ok, len(r.gpus), sorted({g.split("/")[0] for g in r.gpus})
        (True, 14, ['node0', 'node1'])
        """
        if job in self.jobs or job in self.groups:
            raise InputError(f"job {job!r} is already running")
        if not pods or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in pods):
            raise InputError(f"job {job!r}: pods must be a non-empty list of positive GPU counts, got {pods!r}")
        saved = self.to_state()
        order = sorted(range(len(pods)), key=lambda i: -pods[i])
        names = [f"{job}/pod{i}" for i in range(len(pods))]
        placed: dict[int, AllocationResult] = {}
        region: Cell | None = None
        reason = None
        for i in order:
            exclude: set[str] = set()
            res = None
            for _ in range(attempts):
                res = self.allocate(names[i], pods[i], vc=vc, priority=priority, chain=chain, exclude=exclude, lazy=lazy)
                if not res.ok:
                    break
                tree = self.trees[res.chain]
                leaves = [tree.leaf_of_gpu[g] for g in res.gpus]
                node_lv = self.chains[res.chain].node_level
                fits = lowest_common_level(tree, leaves) <= node_lv or pods[i] > tree.levels[node_lv].size
                if fits and within is not None:
                    cell = self._ancestor_at(tree, leaves[0], tree.level_index(within))
                    fits = cell is not None and (region is None or cell is region) and all(cell.lo <= x < cell.hi for x in leaves)
                    if fits:
                        region = cell
                if fits:
                    break
                self.free(names[i])
                exclude.add(res.cells[0])
                res = AllocationResult(names[i], False, reason={"resource": "affinity", "level": within, "chain": res.chain,
                                                                 "message": f"pod {i} ({pods[i]} GPUs) found no cells within one node"
                                                                            + (f" inside one {within!r} cell" if within else "")})
            if res is None or not res.ok:
                reason = res.reason if res is not None else None
                break
            placed[i] = res
        if reason is not None or len(placed) < len(pods):
            self.__dict__.update(HivedScheduler.from_state(self.topo, saved, trees=self.trees).__dict__)
            return AllocationResult(job, False, reason=reason)
        self.groups[job] = names
        for n in names:
            self._group_of[n] = job
        out = AllocationResult(job, True, chain=placed[order[0]].chain)
        for i in range(len(pods)):
            r = placed[i]
            out.gpus += r.gpus
            out.cells += r.cells
            out.preempted += [p for p in r.preempted if p not in out.preempted]
            out.downgraded += r.downgraded
        return out

    def _ancestor_at(self, tree: CellTree, leaf: int, level: int) -> Cell | None:
        c = self.chains[tree.chain].leaf_cell[leaf]
        while c is not None and c.level < level:
            c = c.parent
        return c if c is not None and c.level == level else None

    # -- candidates (for CASSINI) ------------------------------------------------------------
    def candidates(self, job: str, gpus: int, *, vc: str | None = None, priority: int = 0, chain: str | None = None,
                   limit: int = 4) -> list[AllocationResult]:
        """Up to ``limit`` distinct placements the allocator would accept (dry runs; nothing changes).

        Each alternative excludes the first cells of the previous ones; commit one
        with ``allocate(..., plan=result.plan)``. A search that lands on GPUs already
        listed (a gang's later pieces can return to the cell just excluded as its
        first) excludes that first cell too and goes on, for at most ``2 * limit``
        searches in all.
        """
        out, exclude, seen = [], set(), set()
        for _ in range(2 * limit):
            res = self.allocate(job, gpus, vc=vc, priority=priority, chain=chain, exclude=exclude, dry=True)
            if not res.ok:
                if not out:
                    out.append(res)
                break
            first = (res.cells[0], res.plan[0][4] if vc is not None else None)
            if first[0] in exclude and (vc is None or first[1] in exclude):
                break  # the allocator ignored the exclusion: nothing new to find
            exclude.add(first[0])
            if vc is not None:
                exclude.add(first[1])  # the preassigned cell it bound: try another one next
            key = frozenset(res.gpus)
            if key in seen:
                continue
            seen.add(key)
            out.append(res)
            if len(out) >= limit:
                break
        return out

    # -- bad hardware ---------------------------------------------------------------------
    def _leaves_named(self, names: Iterable[str]) -> list[tuple[_Chain, int]]:
        out = []
        hosts = set(self.topo.hosts())
        for name in names:
            gpus = self.topo.gpus(host=name) if name in hosts else [self.topo.resolve_gpu(name)]
            for g in gpus:
                for ch in self.chains.values():
                    if g in ch.tree.leaf_of_gpu:
                        out.append((ch, ch.tree.leaf_of_gpu[g]))
        return out

    def fail(self, names: Iterable[str]) -> dict[str, Any]:
        """Mark GPUs or whole hosts bad; jobs on them are stopped. Returns what happened and the guarantee report."""
        killed, failed = set(), []
        for ch, leaf in self._leaves_named(names):
            if ch.leaf_bad[leaf]:
                continue
            if ch.leaf_job[leaf] is not None:
                killed.add(ch.leaf_job[leaf])
                self.free(ch.leaf_job[leaf])
            ch.leaf_bad[leaf] = True
            ch.mark_busy(leaf)
            for a in ch.ancestors(ch.leaf_cell[leaf]):
                ch.bad[a.index] += 1
            failed.append(ch.tree.leaves[leaf])
        return {"failed_gpus": failed, "stopped_jobs": sorted(killed), "guarantees": self.guarantee_report()}

    def recover(self, names: Iterable[str]) -> dict[str, Any]:
        """Mark GPUs or hosts healthy again."""
        healed = []
        for ch, leaf in self._leaves_named(names):
            if not ch.leaf_bad[leaf]:
                continue
            ch.leaf_bad[leaf] = False
            for a in ch.ancestors(ch.leaf_cell[leaf]):
                ch.bad[a.index] -= 1
            ch.mark_idle(leaf)
            healed.append(ch.tree.leaves[leaf])
        return {"recovered_gpus": healed, "guarantees": self.guarantee_report()}

    # -- state files -------------------------------------------------------------------------
    def to_state(self) -> dict[str, Any]:
        """A JSON-ready snapshot: VCs, bad GPUs, bindings, jobs and both free lists (in order)."""
        bindings = {vc: {chain: [None if r.physical is None else r.physical.address for r in vch.roots] for chain, vch in chains.items()}
                    for vc, chains in self.vcs.items()}
        jobs = []
        for j in sorted(self.jobs.values(), key=lambda j: j.seq):
            if j.vc is None:
                pieces = [[c.level, c.address] for c in j.physical]
            else:
                pieces = [[v.level, v.path(), self.vcs[j.vc][j.chain].roots[v.root_index].physical.address] for v in j.virtual]
            jobs.append({"id": j.id, "vc": j.vc, "priority": j.priority, "chain": j.chain, "pieces": pieces, "seq": j.seq, "lazy": j.lazy})
        bad = [ch.tree.leaves[i] for ch in self.chains.values() for i, b in enumerate(ch.leaf_bad) if b]
        return {"format": STATE_FORMAT, "version": 1, "topology": self.topo.name, "forge": self.forge, "relax": self.relax,
                "virtual_clusters": self.vc_spec, "pinned": self.pinned_spec, "groups": self.groups, "bad_gpus": bad,
                "bindings": bindings, "jobs": jobs,
                "free_lists": self.free_lists(), "seq": self._seq}

    def save(self, path: str) -> None:
        """Write the state atomically (readers see the old file or the new one)."""
        atomic_write_text(path, json.dumps(self.to_state(), indent=1) + "\n")

    @classmethod
    def from_state(cls, topo: Topology, state: Mapping[str, Any], *, source: str | None = None,
                   trees: dict[str, CellTree] | None = None) -> HivedScheduler:
        """Rebuild a scheduler from :meth:`to_state`; the free lists come back identical, in order.

        A state that does not match ``topo`` or is malformed raises :class:`InputError` naming ``source``.
        """
        try:
            return cls._from_state(topo, state, source=source, trees=trees)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            if isinstance(exc, InputError):
                if exc.source is None and source is not None:   # the constructor's and the replay's errors name the file too
                    raise type(exc)(exc.message, source=source, where=exc.where) from None
                raise
            raise InputError(f"state does not match the topology or is malformed ({type(exc).__name__}: {str(exc)[:80]})",
                             source=source) from None

    @classmethod
    def _from_state(cls, topo: Topology, state: Mapping[str, Any], *, source: str | None = None,
                    trees: dict[str, CellTree] | None = None) -> HivedScheduler:
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            raise InputError(f"expected a JSON object with \"format\": \"{STATE_FORMAT}\"", source=source)
        if state.get("version") != 1:
            raise InputError(f"unsupported version {state.get('version')!r}, expected 1", source=source, where="version")
        s = cls(topo, state.get("virtual_clusters") or {}, forge=bool(state.get("forge", True)), trees=trees,
                relax=state.get("relax", True), pinned=state.get("pinned") or None)
        try:
            for g in state.get("bad_gpus", []):
                for ch, leaf in s._leaves_named([g]):
                    ch.leaf_bad[leaf] = True
                    ch.mark_busy(leaf)
                    for a in ch.ancestors(ch.leaf_cell[leaf]):
                        ch.bad[a.index] += 1
            for i, item in enumerate(state.get("jobs", [])):
                where = f"jobs[{i}]"
                if item["chain"] not in s.chains:
                    raise InputError(f"unknown chain {item['chain']!r}", source=source, where=where)
                if item["vc"] is None:
                    plan = [(item["chain"], lv, addr) for lv, addr in item["pieces"]]
                    res = s._alloc_opportunistic(item["id"], 0, item["chain"], plan, set())
                else:
                    plan = [(item["chain"], lv, item["vc"], path, root) for lv, path, root in item["pieces"]]
                    res = s._alloc_guaranteed(item["id"], 0, item["vc"], item["priority"], item["chain"], plan, set())
                if not res.ok:
                    raise InputError(f"job {item['id']!r} cannot be restored: {res.reason}", source=source, where=where)
                s.jobs[item["id"]].seq = item.get("seq", i)
                s.jobs[item["id"]].lazy = bool(item.get("lazy", False))
            s._seq = int(state.get("seq", len(s.jobs)))
            s.groups = {str(g): [str(p) for p in pods] for g, pods in (state.get("groups") or {}).items()}
            s._group_of = {p: g for g, pods in s.groups.items() for p in pods}
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            if isinstance(exc, InputError):
                raise
            raise InputError(f"state does not match the topology or is malformed ({exc!r})", source=source) from None
        s._reorder_free_lists(state.get("free_lists") or {}, source)
        return s

    def _reorder_free_lists(self, saved: Mapping[str, Any], source: str | None) -> None:
        for chain, lists in saved.items():
            ch = self.chains[chain]
            for kind, store in (("binding", ch.bind_free), ("occupancy", ch.occ_free)):
                for lv_name, addrs in lists.get(kind, {}).items():
                    lv = ch.tree.level_index(lv_name)
                    if set(addrs) != {c.address for c in store[lv].values()}:
                        raise InputError(f"{kind} free list of level {lv_name!r} differs after replaying the jobs; the state is inconsistent",
                                         source=source, where=f"free_lists.{chain}.{kind}.{lv_name}")
                    store[lv] = {ch.tree.by_address[a].index: ch.tree.by_address[a] for a in addrs}

    @classmethod
    def load(cls, topo: Topology, path: str) -> HivedScheduler:
        """The scheduler saved in ``path`` (:func:`read_state`, then :meth:`from_state`)."""
        return cls.from_state(topo, read_state(path), source=str(path))

    # -- reporting ---------------------------------------------------------------------------
    def job_gpus(self, job: str) -> list[str]:
        j = self.jobs[job]
        return [self.chains[j.chain].tree.leaves[leaf] for leaf in j.leaves]

    def fragmentation(self, chain: str | None = None) -> float:
        """Share of idle healthy GPUs outside fully idle hosts: 0 when every idle GPU sits in a free whole server."""
        idle = whole = 0
        for ch in self._chains(chain):
            host_lv = next((i for i, lv in enumerate(ch.tree.levels) if lv.node_level), 0)
            for c in ch.tree.cells:
                if c.level == host_lv:
                    free = c.size - ch.busy[c.index]
                    idle += free
                    whole += free if ch.busy[c.index] == 0 else 0
        return 0.0 if idle == 0 else 1.0 - whole / idle
