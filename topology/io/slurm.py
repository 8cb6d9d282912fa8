"""Slurm ``topology.conf`` (topology/tree plugin): import and export, plus hostlist expressions.

The file lists switches, one per logical line::

    # leaf switches name their nodes, upper switches name their child switches
    SwitchName=s0 Nodes=tux[0-3,7,010-012] LinkSpeed=900
    SwitchName=s1 Nodes=tux[4-6]
    SwitchName=s4 Switches=s[0-1]

Keys are case-insensitive, ``#`` starts a comment, a trailing ``\\`` continues
a line, and node and switch lists are Slurm *hostlist expressions*
(:func:`expand_hostlist`, :func:`compress_hostlist`). Slurm uses the file only
for containment (which nodes share a switch); ``LinkSpeed`` "is currently not
used" by Slurm, so bandwidths do not come from the file.

Import (:func:`parse_slurm_topology`)
    Every switch becomes a :attr:`~topology.model.NodeKind.SWITCH` node whose
    tier follows its height above the nodes: switches with ``Nodes=`` are
    ``leaf``, their parents ``spine``, anything higher ``core`` (the exact
    height is kept in the ``level`` attribute). Every Slurm node becomes a host:
    by default a host with one NIC (``<host>/nic0``) cabled to its leaf; with
    ``node="dgx-h100"`` (any :data:`topology.builders.NODE_BUILDERS` kind) a full
    server whose NICs are all cabled to its leaf. Downlinks run at the NIC rate
    (``nic_gbps``, default 400 Gb/s = 50 GB/s); a switch's uplinks carry its
    total downlink capacity divided by ``oversubscription`` (default 1:
    non-blocking), split evenly when a switch has several parents.
Export (:func:`to_slurm_topology`)
    Hosts are grouped by the leaf switches their NICs reach. Slurm's tree needs
    each node under exactly one leaf switch, but on a *rail-optimized* fabric a
    host reaches one leaf per rail (eight for a DGX H100). Leaves that share a
    host are therefore merged into one Slurm leaf switch that stands for the
    whole scalable unit. This is what Slurm needs to know: every rail leaf of
    a scalable unit reaches the same hosts, so "same leaf" and "same scalable
    unit" are the same containment, and a job that fits in one SU gets
    one-hop rail-local traffic. Upper levels are built the same way: switches
    that are co-parents of one group (all spines of a rail-optimized or
    leaf-spine fabric) become one Slurm switch, repeated until nothing changes.
    A group of one switch keeps its name (``/`` becomes ``-``); a group that is
    every switch of one tier of a pod (the ``pod`` attribute that
    :func:`topology.fabrics.rail_optimized` sets) is ``su<pod>`` (leaf tier) or
    ``su<pod>-<tier>``; other groups are ``<tier>group<k>``. Bandwidths, rails
    and oversubscription are not representable and are dropped;
    ``LinkSpeed`` is written only when the import recorded one. Hosts that
    reach no switch are listed in a trailing comment; a switch with both
    hosts and child switches below it, or links between switches of one
    level, raise :class:`~topology.errors.TopologyError` (topology/tree cannot
    say either).

>>> text = "SwitchName=s0 Nodes=tux[0-1]\\nSwitchName=s1 Nodes=tux[2-3]\\nSwitchName=top Switches=s[0-1]\\n"
>>> topo = parse_slurm_topology(text)
>>> topo.hosts(), [str(topo.graph.nodes[s]["tier"]) for s in topo.switches()]
(['tux0', 'tux1', 'tux2', 'tux3'], ['leaf', 'leaf', 'spine'])
>>> print(to_slurm_topology(topo), end="")
SwitchName=s0 Nodes=tux[0-1]
SwitchName=s1 Nodes=tux[2-3]
SwitchName=top Switches=s[0-1]
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from .. import hardware as hw
from ..builders import node_builder
from ..errors import InputError, TopologyError
from ..inputs import check_name
from ..limits import MAX_HOSTS
from ..model import LinkKind, NodeKind, SwitchTier, Topology

__all__ = ["compress_hostlist", "expand_hostlist", "parse_slurm_topology", "to_slurm_topology"]

# --- hostlist expressions ------------------------------------------------------------------

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top_level(expr: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(expr):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise InputError(f"nested '[' in hostlist {expr!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise InputError(f"unbalanced ']' in hostlist {expr!r}")
        elif ch == "," and depth == 0:
            parts.append(expr[start:i])
            start = i + 1
    if depth != 0:
        raise InputError(f"unclosed '[' in hostlist {expr!r}")
    parts.append(expr[start:])
    return parts


def _expand_ranges(body: str, expr: str) -> list[str]:
    out = []
    for item in body.split(","):
        m = _RANGE.match(item.strip())
        if not m:
            raise InputError(f"bad range {item!r} in hostlist {expr!r}; expected N or N-M")
        lo_text, hi_text = m.group(1), m.group(2) or m.group(1)
        lo, hi = int(lo_text), int(hi_text)
        if hi < lo:
            raise InputError(f"descending range {item!r} in hostlist {expr!r}")
        width = len(lo_text)  # Slurm pads every number of a range to the width of its first bound
        if len(out) + hi - lo + 1 > MAX_HOSTS:
            raise InputError(f"hostlist {_short(expr)} names more than {MAX_HOSTS} hosts (the limit)")
        out.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return out


def expand_hostlist(expr: str) -> list[str]:
    """Expand a Slurm hostlist expression into names, in order, without duplicates.

    Brackets hold comma-separated numbers and ranges; zero padding follows the
    first bound of each range; several bracket groups in one name multiply out.

    >>> expand_hostlist("tux[0-2,7,010-011],login")
    ['tux0', 'tux1', 'tux2', 'tux7', 'tux010', 'tux011', 'login']
    >>> expand_hostlist("r[1-2]n[0-1]")
    ['r1n0', 'r1n1', 'r2n0', 'r2n1']
    """
    names: dict[str, None] = {}
    for part in _split_top_level(expr.strip()):
        part = part.strip()
        if not part:
            if expr.strip():
                raise InputError(f"empty name in hostlist {expr!r}")
            continue
        pieces = re.split(r"(\[[^\]]*\])", part)
        combos = [""]
        for piece in pieces:
            if piece.startswith("["):
                numbers = _expand_ranges(piece[1:-1], expr)
                if len(combos) * len(numbers) + len(names) > MAX_HOSTS:
                    raise InputError(f"hostlist {_short(expr)} names more than {MAX_HOSTS} hosts (the limit)")
                combos = [c + n for c in combos for n in numbers]
            elif piece:
                if "]" in piece or "[" in piece:
                    raise InputError(f"unbalanced brackets in hostlist {expr!r}")
                combos = [c + piece for c in combos]
        for c in combos:
            names.setdefault(c, None)
        if len(names) > MAX_HOSTS:
            raise InputError(f"hostlist {_short(expr)} names more than {MAX_HOSTS} hosts (the limit)")
    return list(names)


def _short(expr: str) -> str:
    return repr(expr) if len(expr) <= 60 else repr(expr[:57] + "...")


_TRAILING_NUMBER = re.compile(r"^(.*?)(\d+)$")


def compress_hostlist(names: Iterable[str]) -> str:
    """The shortest-form hostlist expression (one bracket per prefix) naming exactly ``names``.

    Names are grouped by their text before the trailing number and by padding
    (numbers with a leading zero keep their width); groups and numbers come out
    sorted. ``expand_hostlist(compress_hostlist(s))`` gives back the set ``s``.

    >>> compress_hostlist(["tux3", "tux1", "tux2", "tux010", "tux011", "login"])
    'login,tux[1-3],tux[010-011]'
    """
    groups: dict[tuple[str, int], set[int]] = {}
    plain: set[str] = set()
    for name in names:
        if not name or any(ch in name for ch in "[],= \t"):
            raise InputError(f"cannot write host name {name!r} in a hostlist (it is empty or holds one of '[],= ')")
        m = _TRAILING_NUMBER.match(name)
        if not m:
            plain.add(name)
            continue
        prefix, digits = m.groups()
        width = len(digits) if digits.startswith("0") and len(digits) > 1 else 0
        groups.setdefault((prefix, width), set()).add(int(digits))
    # Numbers as wide as a padded group of the same prefix join it: node[00-69], not node[00-09],node[10-69].
    for (prefix, width) in [k for k in groups if k[1] > 0]:
        loose = groups.get((prefix, 0), set())
        fitting = {n for n in loose if len(str(n)) == width}
        if fitting:
            groups[(prefix, width)] |= fitting
            loose -= fitting
            if not loose:
                del groups[(prefix, 0)]
    parts = [(name, name) for name in plain]
    for (prefix, width), numbers in groups.items():
        ordered = sorted(numbers)
        runs: list[tuple[int, int]] = []
        for n in ordered:
            if runs and n == runs[-1][1] + 1:
                runs[-1] = (runs[-1][0], n)
            else:
                runs.append((n, n))

        def fmt(n: int, width: int = width) -> str:
            return str(n).zfill(width)

        if len(ordered) == 1 and width == 0:
            text = f"{prefix}{ordered[0]}"
        else:
            ranges = ",".join(fmt(a) if a == b else f"{fmt(a)}-{fmt(b)}" for a, b in runs)
            text = f"{prefix}[{ranges}]"
        parts.append((f"{prefix}\0{width:04d}", text))
    return ",".join(text for _, text in sorted(parts))


# --- the file --------------------------------------------------------------------------------

_KEYS = {"switchname": "SwitchName", "switches": "Switches", "nodes": "Nodes", "linkspeed": "LinkSpeed"}


@dataclass
class _Switch:
    name: str
    line: int
    switches: list[str] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    link_speed: str | None = None


def _logical_lines(text: str) -> Iterable[tuple[int, str]]:
    """``(first physical line number, text)`` with comments removed and ``\\`` continuations joined."""
    buf, start = "", None
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].rstrip()
        if start is None:
            start = number
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        if buf.strip():
            yield start, buf.strip()
        buf, start = "", None
    if buf.strip():
        yield start or 1, buf.strip()


def _read_switches(text: str, source: str | None) -> list[_Switch]:
    switches: list[_Switch] = []
    seen: dict[str, int] = {}
    hosts = 0
    for line, content in _logical_lines(text):
        fields: dict[str, str] = {}
        for token in content.split():
            key, eq, value = token.partition("=")
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
                value = value[1:-1]  # Slurm's parser accepts quoted values
            if not eq or not key:
                raise InputError(f"expected KEY=VALUE, got {token!r}", source=source, where=line)
            lower = key.lower()
            if lower in ("blockname", "blocksizes"):
                raise InputError(
                    f"{key}= belongs to the topology/block plugin; this importer reads topology/tree files (SwitchName=...)",
                    source=source, where=line,
                )
            if lower not in _KEYS:
                raise InputError(f"unknown key {key!r}; expected SwitchName, Switches, Nodes or LinkSpeed", source=source, where=line)
            if lower in fields:
                raise InputError(f"{_KEYS[lower]} given twice", source=source, where=line)
            if not value:
                raise InputError(f"{_KEYS[lower]}= has no value", source=source, where=line)
            fields[lower] = value
        if "switchname" not in fields:
            raise InputError("expected a line starting with SwitchName=<name>", source=source, where=line)
        name = check_name(fields["switchname"], what="switch name", source=source, where=line)
        if name in seen:
            raise InputError(f"switch {name!r} is defined twice (first on line {seen[name]})", source=source, where=line)
        seen[name] = line
        sw = _Switch(name, line, link_speed=fields.get("linkspeed"))
        try:
            if "switches" in fields:
                sw.switches = expand_hostlist(fields["switches"])
            if "nodes" in fields:
                sw.nodes = expand_hostlist(fields["nodes"])
        except InputError as exc:
            raise InputError(exc.message, source=source, where=line) from None
        for host in sw.nodes:
            check_name(host, what="node name", source=source, where=line)
        hosts += len(sw.nodes)
        if hosts > MAX_HOSTS:
            raise InputError(f"the file names more than {MAX_HOSTS} nodes (the limit)", source=source, where=line)
        if sw.switches and sw.nodes:
            raise InputError(f"switch {name!r} has both Nodes= and Switches=; Slurm's tree wants one or the other", source=source, where=line)
        if not sw.switches and not sw.nodes:
            raise InputError(f"switch {name!r} has neither Nodes= nor Switches=", source=source, where=line)
        switches.append(sw)
    if not switches:
        raise InputError("no SwitchName= lines; expected a Slurm topology/tree topology.conf", source=source)
    return switches


def _levels(switches: list[_Switch], source: str | None) -> dict[str, int]:
    """Height of each switch above the nodes (leaf = 0); rejects unknown children and cycles."""
    by_name = {s.name: s for s in switches}
    for s in switches:
        for child in s.switches:
            if child not in by_name:
                raise InputError(f"switch {s.name!r} lists unknown child switch {child!r}", source=source, where=s.line)
            if child == s.name:
                raise InputError(f"switch {s.name!r} lists itself as a child", source=source, where=s.line)
    level: dict[str, int] = {}
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done

    def visit(name: str) -> int:
        if state.get(name) == 2:
            return level[name]
        if state.get(name) == 1:
            raise InputError(f"switch {name!r} is its own ancestor (a cycle in Switches=)", source=source, where=by_name[name].line)
        state[name] = 1
        sw = by_name[name]
        level[name] = 1 + max(visit(c) for c in sw.switches) if sw.switches else 0
        state[name] = 2
        return level[name]

    for s in switches:
        visit(s.name)
    return level


def _tier(level: int) -> SwitchTier:
    return SwitchTier.LEAF if level == 0 else SwitchTier.SPINE if level == 1 else SwitchTier.CORE


def parse_slurm_topology(
    text: str,
    source: str | None = None,
    node: str | None = None,
    *,
    nic_gbps: float | None = None,
    oversubscription: float = 1.0,
    node_options: dict | None = None,
) -> Topology:
    """Read a topology/tree ``topology.conf`` into a :class:`Topology` (see the module docstring).

    ``node`` picks a server model for every Slurm node (``"dgx-h100"``...);
    without it each node is a host with one NIC of ``nic_gbps`` (default 400).

    >>> t = parse_slurm_topology("SwitchName=l0 Nodes=n[0-1]", node="dgx-h100")
    >>> len(t.gpus()), len(list(t.links("network"))) // 2
    (16, 16)
    """
    if oversubscription < 1:
        raise InputError(f"oversubscription must be >= 1, got {oversubscription}", source=source)
    text = text.lstrip("\ufeff")  # a byte-order mark from Windows editors
    line_rate = 400.0 if nic_gbps is None else nic_gbps
    hw.nic_bw(line_rate)  # checks the rate before any work
    switches = _read_switches(text, source)
    levels = _levels(switches, source)
    topo = Topology(source or "slurm-topology", imported={"format": "slurm", "source": source, "node": node})
    for s in switches:
        attrs = {"name": s.name, "level": levels[s.name]}
        if s.link_speed is not None:
            attrs["link_speed"] = s.link_speed
        topo.add_node(s.name, NodeKind.SWITCH, tier=_tier(levels[s.name]), **attrs)

    add_server = node_builder(node) if node else None
    options = dict(node_options or {})
    if nic_gbps is not None and add_server is not None:
        options.setdefault("nic_gbps", nic_gbps)
    host_nics: dict[str, list[str]] = {}
    down: dict[str, float] = {s.name: 0.0 for s in switches}
    for s in switches:
        for host in s.nodes:
            if host in topo.graph:
                raise InputError(f"node name {host!r} is also a switch name", source=source, where=s.line)
            if host not in host_nics:
                if add_server is not None:
                    host_nics[host] = list(add_server(topo, host, **options))
                    nics = host_nics[host]
                else:
                    host_nics[host] = []
                    nics = []
            else:
                nics = []
            if add_server is None:
                # One NIC per leaf a node sits under (normally exactly one).
                i = len(host_nics[host])
                nic = topo.add_node(f"{host}/nic{i}", NodeKind.NIC, host=host, index=i, speed_gbps=float(line_rate))
                host_nics[host].append(nic)
                nics = [nic]
            elif not nics:
                nics = host_nics[host]  # a server listed under a second leaf: cable its NICs there too
            for nic in nics:
                bw = hw.nic_bw(topo.graph.nodes[nic].get("speed_gbps", line_rate))
                topo.add_link(nic, s.name, LinkKind.NETWORK, bw, latency_us=hw.LATENCY_US["nic"])
                down[s.name] += bw

    parents: dict[str, list[str]] = {}
    for s in switches:
        for child in s.switches:
            parents.setdefault(child, []).append(s.name)
    # Uplink capacity flows bottom-up: a switch's downlinks are its children's uplinks.
    for s in sorted(switches, key=lambda s: levels[s.name]):
        ups = parents.get(s.name, [])
        if not ups:
            continue
        up_total = down[s.name] / oversubscription
        if not up_total > 0:
            raise TopologyError(f"switch {s.name!r} carries no traffic (no nodes below it)", source=source, where=s.line)
        for p in ups:
            topo.add_link(s.name, p, LinkKind.NETWORK, up_total / len(ups), latency_us=hw.LATENCY_US["switch"])
            down[p] += up_total / len(ups)
    return topo


# --- export ----------------------------------------------------------------------------------


def _switch_height(topo: Topology) -> dict[str, int]:
    rank = {SwitchTier.LEAF: 0, SwitchTier.SPINE: 1, SwitchTier.CORE: 2}
    out = {}
    for s in topo.switches():
        d = topo.graph.nodes[s]
        out[s] = int(d["level"]) if d.get("level") is not None else rank[SwitchTier(d["tier"])]
    return out


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, x: str) -> str:
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


def _slurm_name(topo: Topology, switch: str) -> str:
    name = topo.graph.nodes[switch].get("name") or switch
    return name.replace("/", "-")


def _group_name(topo: Topology, members: list[str], counter: dict[str, int]) -> str:
    if len(members) == 1:
        return _slurm_name(topo, members[0])
    g = topo.graph
    pods = {g.nodes[m].get("pod") for m in members}
    tiers = {str(g.nodes[m]["tier"]) for m in members}
    tier = next(iter(tiers)) if len(tiers) == 1 else "switch"
    if len(pods) == 1 and None not in pods and len(tiers) == 1:
        # All the switches of one tier of a scalable unit (pod): name the group after the unit.
        pod = next(iter(pods))
        whole = {s for s in topo.switches(tier) if g.nodes[s].get("pod") == pod}
        if whole == set(members):
            return f"su{pod}" if tier == "leaf" else f"su{pod}-{tier}"
    k = counter.get(tier, 0)
    counter[tier] = k + 1
    return f"{tier}group{k}"


def to_slurm_topology(topo: Topology) -> str:
    """Write ``topo`` as a Slurm topology/tree ``topology.conf`` (see the module docstring).

    >>> from topology import build_cluster
    >>> print(to_slurm_topology(build_cluster(4, hosts_per_su=2)), end="")
    SwitchName=su0 Nodes=node[0-1]
    SwitchName=su1 Nodes=node[2-3]
    SwitchName=spinegroup0 Switches=su[0-1]
    """
    switches = topo.switches()
    if not switches:
        raise TopologyError("cannot write a Slurm topology: the topology has no network switches")
    g = topo.graph
    height = _switch_height(topo)
    sw_set = set(switches)
    host_leaves: dict[str, set[str]] = {}
    for nic in topo.nodes(NodeKind.NIC):
        for _, v in g.out_edges(nic):
            if v in sw_set:
                host_leaves.setdefault(topo.host_of(nic), set()).add(v)
    up: dict[str, set[str]] = {s: set() for s in switches}
    for s in switches:
        for _, v in g.out_edges(s):
            if v in sw_set and v != s:
                if height[v] > height[s]:
                    up[s].add(v)
                elif height[v] == height[s]:
                    raise TopologyError(f"switches {s!r} and {v!r} are linked at the same level; Slurm's topology/tree needs a strict hierarchy")
    # Group switches: leaves that share a host (the rails of one scalable unit), then, until nothing
    # changes, all parents of one group's members (co-parents must be one Slurm switch).
    uf = _UnionFind()
    for s in switches:
        uf.find(s)
    for leaves in host_leaves.values():
        first = min(leaves)
        for leaf in leaves:
            uf.union(first, leaf)
    changed = True
    while changed:
        changed = False
        members: dict[str, list[str]] = {}
        for s in switches:
            members.setdefault(uf.find(s), []).append(s)
        for mem in members.values():
            parents = sorted({p for m in mem for p in up[m]} - set(mem))
            for p in parents[1:]:
                if uf.find(p) != uf.find(parents[0]):
                    uf.union(parents[0], p)
                    changed = True
    members = {}
    for s in switches:
        members.setdefault(uf.find(s), []).append(s)
    hosts_of: dict[str, list[str]] = {}
    for host, leaves in host_leaves.items():
        hosts_of.setdefault(uf.find(next(iter(leaves))), []).append(host)
    parent_of: dict[str, str] = {}
    for root, mem in members.items():
        parents = {uf.find(p) for m in mem for p in up[m]} - {root}
        if parents:
            parent_of[root] = parents.pop()
    children: dict[str, list[str]] = {}
    for child, parent in parent_of.items():
        children.setdefault(parent, []).append(child)
    # Keep groups that have hosts below them; Slurm wants every switch to have children.
    level: dict[str, int] = {}

    def settle(root: str) -> int | None:
        if root in level:
            return level[root]
        kids = [k for k in (settle(c) for c in children.get(root, [])) if k is not None]
        if hosts_of.get(root):
            if children.get(root) and kids:
                raise TopologyError(
                    f"switch {members[root][0]!r} has both hosts and child switches below it; Slurm's topology/tree wants one or the other"
                )
            level[root] = 0
        elif kids:
            level[root] = 1 + max(kids)
        else:
            return None
        return level[root]

    for root in members:
        settle(root)
    counter: dict[str, int] = {}
    used: set[str] = set()
    name: dict[str, str] = {}
    ordered = sorted(level, key=lambda r: (level[r], _sort_key(sorted(members[r], key=_sort_key)[0])))
    for root in ordered:
        name[root] = _unique(_group_name(topo, sorted(members[root], key=_sort_key), counter), used)
    lines = []
    for root in ordered:
        mem = sorted(members[root], key=_sort_key)
        if level[root] == 0:
            lines.append(f"SwitchName={name[root]} Nodes={compress_hostlist(hosts_of[root])}{_link_speed(topo, mem)}")
        else:
            kids = [name[c] for c in children[root] if c in level]
            lines.append(f"SwitchName={name[root]} Switches={compress_hostlist(kids)}{_link_speed(topo, mem)}")
    unconnected = [h for h in topo.hosts() if h not in host_leaves]
    if unconnected:
        lines.append(f"# not connected to any switch: {compress_hostlist(unconnected)}")
    return "\n".join(lines) + "\n"


def _link_speed(topo: Topology, members: list[str]) -> str:
    if len(members) == 1 and topo.graph.nodes[members[0]].get("link_speed") is not None:
        return f" LinkSpeed={topo.graph.nodes[members[0]]['link_speed']}"
    return ""


def _sort_key(name: str) -> tuple:
    """Natural order: ``leaf2`` before ``leaf10``."""
    return tuple((0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", name) if t)


def _unique(name: str, used: set[str]) -> str:
    base, k = name, 1
    while name in used:
        name = f"{base}_{k}"
        k += 1
    used.add(name)
    return name
