"""The ``Topology``: a typed view over a networkx ``MultiDiGraph``.

Nodes are hardware devices (GPUs, NVSwitches, PCIe switches, CPU/NUMA nodes,
NICs, network switches); edges are *directed* links with a per-direction
bandwidth, so a full-duplex cable is two edges. Parallel links between the same
pair (ECMP trunks, bonded NVLinks modelled separately) are distinct keys of the
multigraph.

Every planner, the simulator and the emulator read this one object. Its graph
is public (``topo.graph``) so that any networkx algorithm applies directly; the
helper methods only add the typing that networkx does not have.

Node attributes
    ``kind`` (:class:`NodeKind`), ``host`` (server name, ``None`` for fabric
    switches), and per kind: ``index`` (GPU/NIC/NVSwitch number inside the
    host), ``model``, ``memory_gib``, ``tflops``, ``numa``, ``rail``,
    ``tier`` (:class:`SwitchTier`), ``domain`` (NVLink domain), ``name``.
Link attributes
    ``kind`` (:class:`LinkKind`), ``bw`` (GB/s per direction), ``latency_us``,
    optional ``count`` (NVLink lanes), ``gen`` (PCIe), ``rail``.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterable, Iterator
from enum import StrEnum
from typing import Any

import networkx as nx

from .errors import TopologyError
from .inputs import check_name, check_node_id, check_number
from .limits import MAX_BANDWIDTH_GBS, MAX_HOSTS, MAX_NIC_GBPS, MAX_TFLOPS, MAX_TOPOLOGY_NODES
from .schema import load_schema, validate

FORMAT_NAME = "netweave-topology"
FORMAT_VERSION = 1


class NodeKind(StrEnum):
    GPU = "gpu"
    NVSWITCH = "nvswitch"
    PCIE_SWITCH = "pcie_switch"
    CPU = "cpu"
    NIC = "nic"
    SWITCH = "switch"  # a network switch; its ``tier`` says which


class SwitchTier(StrEnum):
    LEAF = "leaf"  # ToR / leaf / rail switch
    SPINE = "spine"
    CORE = "core"


class LinkKind(StrEnum):
    NVLINK = "nvlink"
    PCIE = "pcie"
    CPU = "cpu"  # SMP interconnect between sockets (QPI/UPI/xGMI)
    NETWORK = "network"  # InfiniBand or Ethernet cable


_ENUM_ATTRS = {"kind": None, "tier": SwitchTier}


class Topology:
    """A hardware topology: typed nodes and directed, bandwidth-annotated links.

    >>> t = Topology("two-gpus")
    >>> t.add_node("h0/gpu0", NodeKind.GPU, host="h0", index=0)
    'h0/gpu0'
    >>> t.add_node("h0/gpu1", NodeKind.GPU, host="h0", index=1)
    'h0/gpu1'
    >>> t.add_link("h0/gpu0", "h0/gpu1", LinkKind.NVLINK, bw=25.0)
    >>> t.gpus(), t.graph.number_of_edges()
    (['h0/gpu0', 'h0/gpu1'], 2)
    """

    def __init__(self, name: str = "topology", graph: nx.MultiDiGraph | None = None, **meta: Any):
        self.graph: nx.MultiDiGraph = graph if graph is not None else nx.MultiDiGraph()
        self.graph.graph.setdefault("name", name)
        self.graph.graph.update(meta)
        self.revision = 0  # bumped by every change made through this object; caches key on it

    # -- construction -----------------------------------------------------------
    @property
    def name(self) -> str:
        return self.graph.graph["name"]

    @property
    def meta(self) -> dict[str, Any]:
        return self.graph.graph

    def add_node(self, node: str, kind: NodeKind | str, **attrs: Any) -> str:
        """Add a typed node and return its id. ``host`` defaults to ``None``."""
        kind = NodeKind(kind)
        if kind is NodeKind.SWITCH:
            attrs["tier"] = SwitchTier(attrs.get("tier", SwitchTier.LEAF))
        attrs.setdefault("host", None)
        self.graph.add_node(node, kind=kind, **attrs)
        self.revision += 1
        return node

    def add_link(
        self,
        u: str,
        v: str,
        kind: LinkKind | str,
        bw: float,
        *,
        latency_us: float = 0.0,
        duplex: bool = True,
        **attrs: Any,
    ) -> None:
        """Add a link ``u -> v`` (and ``v -> u`` when ``duplex``) of ``bw`` GB/s per direction."""
        for end in (u, v):
            if end not in self.graph:
                raise TopologyError(f"link {u} -> {v}: unknown node {end!r}")
        if u == v:
            raise TopologyError(f"link {u} -> {v}: a link must join two different devices")
        check_number(bw, what="a bandwidth in GB/s", where=f"link {u} -> {v}", positive=True, maximum=MAX_BANDWIDTH_GBS, error=TopologyError)
        check_number(latency_us, what="a latency in us", where=f"link {u} -> {v}", minimum=0, maximum=1e9, error=TopologyError)
        kind = LinkKind(kind)
        self.revision += 1
        self.graph.add_edge(u, v, kind=kind, bw=float(bw), latency_us=float(latency_us), **attrs)
        if duplex:
            self.graph.add_edge(v, u, kind=kind, bw=float(bw), latency_us=float(latency_us), **attrs)

    def touch(self) -> None:
        """Declare an in-place edit of ``graph`` (e.g. a changed ``bw``) so cached paths are recomputed."""
        self.revision += 1

    # -- queries ----------------------------------------------------------------
    def kind(self, node: str) -> NodeKind:
        return self.graph.nodes[node]["kind"]

    def host_of(self, node: str) -> str | None:
        return self.graph.nodes[node].get("host")

    def nodes(self, kind: NodeKind | str | None = None, host: str | None = None) -> list[str]:
        """Node ids, optionally of one kind and/or one host, in insertion order."""
        out = []
        for n, d in self.graph.nodes(data=True):
            if kind is not None and d["kind"] != kind:
                continue
            if host is not None and d.get("host") != host:
                continue
            out.append(n)
        return out

    def gpus(self, host: str | None = None) -> list[str]:
        """GPU ids in canonical order: hosts in insertion order, then local index."""
        return self.nodes(NodeKind.GPU, host)

    def hosts(self) -> list[str]:
        """Server names in insertion order."""
        seen: dict[str, None] = {}
        for _, d in self.graph.nodes(data=True):
            h = d.get("host")
            if h is not None:
                seen.setdefault(h, None)
        return list(seen)

    def switches(self, tier: SwitchTier | str | None = None) -> list[str]:
        return [n for n in self.nodes(NodeKind.SWITCH) if tier is None or self.graph.nodes[n]["tier"] == tier]

    def links(self, kind: LinkKind | str | None = None) -> Iterator[tuple[str, str, int, dict[str, Any]]]:
        """Directed links as ``(u, v, key, data)``."""
        for u, v, k, d in self.graph.edges(keys=True, data=True):
            if kind is None or d["kind"] == kind:
                yield u, v, k, d

    def resolve_gpu(self, name: str | int) -> str:
        """Accept a GPU id (``node0/gpu3``) or a global GPU number (``11`` or ``"gpu11"``)."""
        if isinstance(name, str) and name in self.graph:
            if self.kind(name) is not NodeKind.GPU:
                raise TopologyError(f"{name!r} is a {self.kind(name)}, expected a GPU")
            return name
        text = str(name)
        number = text[3:] if text.startswith("gpu") else text
        if number.isdigit():
            gpus = self.gpus()
            if int(number) < len(gpus):
                return gpus[int(number)]
        raise TopologyError(f"unknown GPU {name!r}; expected an id such as {self.gpus()[:1] or ['host/gpu0']} or a number")

    def copy(self) -> Topology:
        return Topology(graph=self.graph.copy())

    def summary(self) -> dict[str, Any]:
        """Counts of nodes and links by kind, plus bandwidth totals."""
        nodes = Counter(str(d["kind"]) for _, d in self.graph.nodes(data=True))
        tiers = Counter(str(d["tier"]) for _, d in self.graph.nodes(data=True) if d["kind"] == NodeKind.SWITCH)
        links: dict[str, dict[str, float]] = {}
        for _, _, d in self.graph.edges(data=True):
            entry = links.setdefault(str(d["kind"]), {"directed_links": 0, "total_bw_gbs": 0.0})
            entry["directed_links"] += 1
            entry["total_bw_gbs"] += d["bw"]
        models = Counter(d.get("model", "?") for _, d in self.graph.nodes(data=True) if d["kind"] == NodeKind.GPU)
        return {
            "name": self.name,
            "hosts": len(self.hosts()),
            "gpus": nodes.get("gpu", 0),
            "gpu_models": dict(models),
            "nodes": dict(nodes),
            "switch_tiers": dict(tiers),
            "links": links,
        }

    def validate(self) -> None:
        """Raise :class:`TopologyError` on structural mistakes (missing attributes, asymmetric hosts)."""
        for n, d in self.graph.nodes(data=True):
            if "kind" not in d:
                raise TopologyError(f"node {n!r} has no kind")
            if d["kind"] in (NodeKind.GPU, NodeKind.NIC, NodeKind.PCIE_SWITCH, NodeKind.CPU) and not d.get("host"):
                raise TopologyError(f"node {n!r}: a {d['kind']} must belong to a host")
            # NVSwitches of a multi-node NVLink domain (NVL72) sit outside any host.
            if d["kind"] == NodeKind.NVSWITCH and not (d.get("host") or d.get("domain")):
                raise TopologyError(f"node {n!r}: an NVSwitch needs a host or an NVLink domain")
        for u, v, d in self.graph.edges(data=True):
            if not d.get("bw", 0) > 0:
                raise TopologyError(f"link {u} -> {v}: bandwidth must be positive")

    def __repr__(self) -> str:
        s = self.summary()
        return f"<Topology {self.name!r}: {s['hosts']} hosts, {s['gpus']} GPUs, {self.graph.number_of_edges()} directed links>"

    # -- serialisation (the JSON format; see topology.io for files) ---------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict that :meth:`from_dict` turns back into an equal topology."""
        nodes = [{"id": n, **_plain(d)} for n, d in self.graph.nodes(data=True)]
        links = [{"src": u, "dst": v, "key": k, **_plain(d)} for u, v, k, d in self.graph.edges(keys=True, data=True)]
        return {"format": FORMAT_NAME, "version": FORMAT_VERSION, "meta": _plain(self.graph.graph), "nodes": nodes, "links": links}

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str | None = None) -> Topology:
        """Inverse of :meth:`to_dict`; checks the schema and names the offending element of any error.

        Node ids are names joined by ``/`` and unique; every GPU, NIC, PCIe switch and CPU has a ``host`` (a
        name); bandwidths are finite, positive and at most :data:`~topology.limits.MAX_BANDWIDTH_GBS`;
        no link joins a device to itself; numeric attributes are finite numbers.

        The document is checked against ``topology/schemas/topology.schema.json`` first. Above
        :data:`SCHEMA_ITEMS_LIMIT` nodes and links the items are left to the checks below, which
        ``tests/test_schemas.py`` holds to the same verdicts: ``jsonschema`` spends about 0.25 ms per item,
        ten seconds on a 256-server cluster that this reader loads in under two; a single server is far below the limit.
        """
        large = isinstance(data, dict) and _items(data) > SCHEMA_ITEMS_LIMIT
        validate(data, _top_level_schema() if large else load_schema("topology", "topology"), source=source, error=TopologyError)
        if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
            raise TopologyError(f"expected a JSON object with \"format\": \"{FORMAT_NAME}\"", source=source)
        if data.get("version") != FORMAT_VERSION:
            raise TopologyError(f"unsupported version {data.get('version')!r}, expected {FORMAT_VERSION}", source=source, where="version")
        graph = nx.MultiDiGraph()
        meta = data.get("meta") or {}
        if not isinstance(meta, dict):
            raise TopologyError("expected an object", source=source, where="meta")
        if "name" in meta and not isinstance(meta["name"], str):
            raise TopologyError(f"expected a string, got {meta['name']!r}", source=source, where="meta.name")
        graph.graph.update(meta)
        topo = cls(graph=graph)
        nodes = _expect_list(data, "nodes", source)
        if len(nodes) > MAX_TOPOLOGY_NODES:
            raise TopologyError(f"{len(nodes)} nodes, more than {MAX_TOPOLOGY_NODES} (the limit)", source=source, where="nodes")
        hosts: set[str] = set()
        for i, item in enumerate(nodes):
            where = f"nodes[{i}]"
            if not isinstance(item, dict) or "id" not in item or "kind" not in item:
                raise TopologyError("expected an object with \"id\" and \"kind\"", source=source, where=where)
            attrs = dict(item)
            node = check_node_id(attrs.pop("id"), source=source, where=f"{where}.id", error=TopologyError)
            if node in graph:
                raise TopologyError(f"node id {node!r} is used twice", source=source, where=f"{where}.id")
            try:
                attrs["kind"] = NodeKind(attrs["kind"])
                if "tier" in attrs and attrs["tier"] is not None:
                    attrs["tier"] = SwitchTier(attrs["tier"])
            except (ValueError, TypeError) as exc:
                raise TopologyError(str(exc), source=source, where=where) from None
            if attrs["kind"] is NodeKind.SWITCH and attrs.get("tier") is None:
                attrs["tier"] = SwitchTier.LEAF
            host = attrs.setdefault("host", None)
            if host is not None:
                hosts.add(check_name(host, what="host name", source=source, where=f"{where}.host", error=TopologyError))
            elif attrs["kind"] in _HOSTED:
                raise TopologyError(f"a {attrs['kind']} must belong to a host", source=source, where=f"{where}.host")
            for key, value in attrs.items():
                if key in _NODE_NUMBERS and value is not None:
                    lo, hi, integer, positive = _NODE_NUMBERS[key]
                    check_number(value, what=f"a {key}", source=source, where=f"{where}.{key}", minimum=lo, maximum=hi,
                                 integer=integer, positive=positive, error=TopologyError)
            graph.add_node(node, **attrs)
        if len(hosts) > MAX_HOSTS:
            raise TopologyError(f"{len(hosts)} hosts, more than {MAX_HOSTS} (the limit)", source=source, where="nodes")
        for i, item in enumerate(_expect_list(data, "links", source)):
            where = f"links[{i}]"
            if not isinstance(item, dict) or not {"src", "dst", "kind", "bw"} <= item.keys():
                raise TopologyError("expected an object with \"src\", \"dst\", \"kind\" and \"bw\"", source=source, where=where)
            attrs = dict(item)
            u, v, key = attrs.pop("src"), attrs.pop("dst"), attrs.pop("key", None)
            for end in (u, v):
                if not isinstance(end, str) or end not in graph:
                    raise TopologyError(f"unknown node {end!r}", source=source, where=where)
            if u == v:
                raise TopologyError(f"a link must join two different devices, got {u!r} twice", source=source, where=where)
            if key is not None and (isinstance(key, bool) or not isinstance(key, int) or key < 0):
                raise TopologyError(f"expected a non-negative integer key, got {key!r}", source=source, where=f"{where}.key")
            if key is not None and graph.has_edge(u, v, key):
                raise TopologyError(f"link {u} -> {v} key {key} is given twice", source=source, where=f"{where}.key")
            try:
                attrs["kind"] = LinkKind(attrs["kind"])
            except (ValueError, TypeError) as exc:
                raise TopologyError(str(exc), source=source, where=where) from None
            check_number(attrs["bw"], what="a bandwidth in GB/s", source=source, where=f"{where}.bw", positive=True,
                         maximum=MAX_BANDWIDTH_GBS, error=TopologyError)
            attrs["bw"] = float(attrs["bw"])
            attrs["latency_us"] = float(check_number(attrs.get("latency_us", 0.0), what="a latency in us", source=source,
                                                     where=f"{where}.latency_us", minimum=0, maximum=1e9, error=TopologyError))
            graph.add_edge(u, v, key=key, **attrs)
        return topo

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Topology) and self.to_dict() == other.to_dict()

    __hash__ = None  # mutable


#: Documents with more nodes plus links than this are checked against the schema's top level only (see from_dict).
SCHEMA_ITEMS_LIMIT = 1000


def _items(data: dict[str, Any]) -> int:
    return sum(len(data[k]) for k in ("nodes", "links") if isinstance(data.get(k), list))


@functools.cache
def _top_level_schema() -> dict[str, Any]:
    """The topology schema without its rules for the items of ``nodes`` and ``links`` (built once)."""
    schema = load_schema("topology", "topology")
    nodes, links = ({k: v for k, v in schema["properties"][name].items() if k != "items"} for name in ("nodes", "links"))
    return {**schema, "properties": {**schema["properties"], "nodes": nodes, "links": links}}


# kinds of device that sit inside a server
_HOSTED = (NodeKind.GPU, NodeKind.NIC, NodeKind.PCIE_SWITCH, NodeKind.CPU)
# numeric node attributes of the JSON format: (minimum, maximum, integer, positive)
_NODE_NUMBERS = {"index": (0, 1_000_000, True, False), "numa": (0, 1_000_000, True, False), "rail": (0, 1_000_000, True, False),
                 "memory_gib": (0, 1e9, False, False), "tflops": (0, MAX_TFLOPS, False, True),
                 "speed_gbps": (0, MAX_NIC_GBPS, False, True), "level": (0, 1000, True, False)}


def _plain(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, StrEnum) else v) for k, v in d.items()}


def _expect_list(data: dict[str, Any], field: str, source: str | None) -> list[Any]:
    value = data.get(field)
    if not isinstance(value, list):
        raise TopologyError(f"expected a list of {field}", source=source, where=field)
    return value


def host_subgraph(topo: Topology, host: str) -> nx.MultiDiGraph:
    """The nodes and links inside one server, as a networkx view."""
    return topo.graph.subgraph(topo.nodes(host=host))


def iter_hosts_gpus(topo: Topology) -> Iterable[tuple[str, list[str]]]:
    """``(host, [gpu ids])`` for every host that has GPUs, in order."""
    by_host: dict[str, list[str]] = {}
    for g in topo.gpus():
        by_host.setdefault(topo.host_of(g), []).append(g)
    return by_host.items()
