"""Build a time-scaled Mininet network from a :class:`~topology.Topology`, with 8 priority classes per port.

What is emulated
    One Mininet host per server (its GPUs, NVLink and PCIe stay *modelled*:
    transfers between GPUs of one server are timed from the topology, never
    sent through the emulator), one Linux bridge per emulated switch, and one
    veth pair per (server, leaf) attachment. Fabric rates are divided by the
    time-scale factor ``K``: a 400 Gb/s NIC becomes a 400/K Gb/s emulated link
    (400 Mbit/s for K = 1000), and the traffic agents stretch every compute
    phase by the same ``K``, so emulated times divided by ``K`` are real-fabric
    times (time dilation, as in DieCast and time-warped emulation).

NIC modes
    ``"per-leaf"`` (default): a server gets one interface per leaf switch it is
    cabled to, at the summed rate of its NICs on that leaf; on rail-optimized
    fabrics that is one interface per NIC, i.e. the NICs are emulated
    faithfully, and each leaf (rail) is its own bridge and IP subnet. Spine
    switches are not emulated: a flow between two servers always uses a leaf
    both are cabled to (NCCL's rail-aligned rings and PXN make that the case
    on rail-optimized fabrics), so every pair of emulated servers must share a
    leaf; otherwise :class:`EmulationError` says which pair does not.
    ``"aggregate"``: a server gets ONE interface at the sum of its NIC rates on
    a single bridge that stands for the whole fabric, with one address per NIC
    (``10.<k+1>.x.y``) and, on both of its egress ports, an HTB subtree per
    NIC at that NIC's rate that the NIC's address selects
    (:func:`emu.htb.htb_tree_commands` ``nic_classes``). Flows are sent between
    the addresses of the NICs the simulator routes them through
    (:func:`flow_endpoints`), so per-NIC rates and contention are emulated
    with one veth per server. (Before the subtrees, one flow could use the
    whole aggregate: 8x its NIC's rate on a DGX.)
    Neither mode emulates spine oversubscription.

What cannot be emulated here
    Propagation delay, loss and ECN: the kernel has no ``netem``/``red``
    (Mininet only logs an error and runs without them), so emulated links
    have ~0.1 ms RTT whatever ``latency_us`` says. Link rates are bounded by
    :data:`MAX_LINK_MBIT` (Mininet's TCLink range; higher rates are CPU-bound).

Framing
    HTB counts Ethernet frames, while the simulator's ``bytes / bw`` counts
    payload. With ``payload_rates=True`` (default) each HTB tree is configured
    at ``rate * WIRE_OVERHEAD`` so that TCP payload flows at the scaled fabric
    rate (MSS 1448 B in 1514 B frames).

Mininet's Python module is installed by the Debian package into the system
Python's ``dist-packages``, not into the project's virtual environment;
:func:`import_mininet` appends that directory to ``sys.path`` lazily, only
while importing mininet, and removes it again.

>>> from topology import default_cluster
>>> plan = plan_network(default_cluster(), time_scale=1000)
>>> len(plan.hosts), len(plan.switches), len(plan.interfaces), plan.interfaces[0].rate_mbit
(4, 8, 32, 400.0)
>>> agg = plan_network(default_cluster(), time_scale=8000, nic_mode="aggregate")
>>> len(agg.switches), agg.interfaces[0].rate_mbit
(1, 400.0)
"""

from __future__ import annotations

import fcntl
import importlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import networkx as nx

from topology import LinkKind, NodeKind, Topology
from topology.errors import InputError

from .htb import HtbSpec, check_htb_tree, class_counters, htb_teardown_command, htb_tree_commands

log = logging.getLogger(__name__)

#: Highest emulated link rate (Mbit/s): Mininet's TCLink range, and about what 2 cores can push per link.
MAX_LINK_MBIT = 1000.0
MIN_LINK_MBIT = 1.0
#: Ethernet frame bytes per TCP payload byte at MTU 1500 with timestamps: 1514 / 1448.
WIRE_OVERHEAD = 1514 / 1448
MININET_DIST_PACKAGES = "/usr/lib/python3/dist-packages"
LOCK_PATH = Path(tempfile.gettempdir()) / "netweave-emu.lock"
NIC_MODES = ("per-leaf", "aggregate")


class EmulationError(RuntimeError):
    """The emulator cannot run here (not root, Mininet missing) or cannot emulate this topology."""


class FidelityError(RuntimeError):
    """The emulator ran but its results cannot be trusted (qdisc tree wrong, rate off, CPU saturated).

    ``report`` holds the fidelity report that failed.
    """

    def __init__(self, message: str, report: dict[str, Any] | None = None):
        super().__init__(message)
        self.report = report or {}


# -- the plan (pure) --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EmuInterface:
    """One emulated attachment: server ``host`` cabled to switch ``switch``."""

    host: str  # emulated host name (e.g. "nwh0")
    topo_host: str  # server in the topology
    dev: str  # host-side interface name
    switch: str  # emulated switch name
    switch_dev: str  # switch-side interface name
    ip: str  # address without prefix
    prefix: int
    rate_mbit: float  # payload rate host -> switch (Mbit/s, scaled)
    rate_down_mbit: float  # payload rate switch -> host
    nics: tuple[str, ...]  # topology NICs this interface stands for
    leaf: str | None  # topology leaf (None in aggregate mode)
    # aggregate mode: one address and one payload rate (Mbit/s, scaled) per NIC of ``nics``; the interface's HTB trees limit
    # the traffic from/to each address to its NIC's rate (emu.htb NIC subtrees)
    nic_ips: tuple[str, ...] = ()
    nic_rates_mbit: tuple[float, ...] = ()
    nic_rates_down_mbit: tuple[float, ...] = ()


@dataclass(frozen=True)
class EmuSwitch:
    name: str
    topo_switches: tuple[str, ...]


@dataclass
class NetworkPlan:
    """Everything needed to build the emulated network; pure data."""

    topology_name: str
    time_scale: float
    nic_mode: str
    hosts: dict[str, str]  # emulated name -> topology server
    switches: list[EmuSwitch]
    interfaces: list[EmuInterface]
    payload_rates: bool = True
    floor_fraction: float = 0.01
    queue_packets: int = 200
    gpu_leaf: dict[str, str | None] = field(default_factory=dict)  # GPU -> leaf of its nearest NIC
    ack_fraction: float = 0.05  # guaranteed share of the pure-ACK control leaf (see emu.htb); 0: ACKs follow their DSCP
    prefix: str = "nw"  # starts every host, switch and interface name: the run id (see emu.runs)

    def emu_host(self, topo_host: str) -> str:
        for name, h in self.hosts.items():
            if h == topo_host:
                return name
        raise EmulationError(f"server {topo_host!r} is not part of the emulated network")

    def interfaces_of(self, emu_host: str) -> list[EmuInterface]:
        return [i for i in self.interfaces if i.host == emu_host]

    def interface(self, emu_host: str, switch: str) -> EmuInterface:
        for i in self.interfaces:
            if i.host == emu_host and i.switch == switch:
                return i
        raise EmulationError(f"{emu_host} has no interface on {switch}")

    def htb_specs(self) -> list[tuple[str | None, HtbSpec]]:
        """``(emulated host or None for the root namespace, spec)`` for every egress port, both directions."""
        factor = WIRE_OVERHEAD if self.payload_rates else 1.0
        out: list[tuple[str | None, HtbSpec]] = []
        for i in self.interfaces:
            up = tuple((ip, r * factor) for ip, r in zip(i.nic_ips, i.nic_rates_mbit, strict=True))
            down = tuple((ip, r * factor) for ip, r in zip(i.nic_ips, i.nic_rates_down_mbit, strict=True))
            out.append((i.host, HtbSpec(i.dev, i.rate_mbit * factor, self.floor_fraction, self.queue_packets, ack_fraction=self.ack_fraction,
                                        nic_classes=up, nic_match="src")))
            out.append((None, HtbSpec(i.switch_dev, i.rate_down_mbit * factor, self.floor_fraction, self.queue_packets,
                                      ack_fraction=self.ack_fraction, nic_classes=down, nic_match="dst")))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "topology": self.topology_name, "time_scale": self.time_scale, "nic_mode": self.nic_mode, "hosts": dict(self.hosts),
            "switches": [asdict(s) for s in self.switches], "interfaces": [asdict(i) for i in self.interfaces],
            "payload_rates": self.payload_rates, "wire_overhead": WIRE_OVERHEAD if self.payload_rates else 1.0,
            "floor_fraction": self.floor_fraction, "queue_packets": self.queue_packets, "ack_fraction": self.ack_fraction,
            "prefix": self.prefix,
        }

    def root_links(self) -> list[str]:
        """The links this plan creates in the root namespace: bridges and the switch ends of the veths."""
        return [s.name for s in self.switches] + [i.switch_dev for i in self.interfaces]


def scaled_rate_mbit(bw_gbytes: float, time_scale: float) -> float:
    """Emulated rate in Mbit/s of a ``bw_gbytes`` GB/s fabric link under time scale ``K``.

    >>> scaled_rate_mbit(50.0, 1000)   # a 400 Gb/s NIC at K = 1000
    400.0
    """
    return bw_gbytes * 8e3 / time_scale


def _nearest_nic(topo: Topology, gpu: str, nics: list[str]) -> str | None:
    """The NIC with the fewest hops from ``gpu`` inside its server (ties: lowest index): NCCL's rail alignment."""
    if not nics:
        return None
    sub = nx.Graph(topo.graph.subgraph(topo.nodes(host=topo.host_of(gpu))))
    dist = nx.single_source_shortest_path_length(sub, gpu)
    return min(nics, key=lambda n: (dist.get(n, 1 << 30), topo.graph.nodes[n].get("index", 0), n))


#: The emulated TCP's convergence, as the simulator's join ramp (:class:`emu.sim.SimConfig` ``join_ramp_s``, ``join_weight``),
#: measured from the join events of the unshifted CASSINI pair in Mininet (docs/validation/emu.md, ``bench/bench_emu_phase.py``):
#: a flow joining an established one on a shaped NIC got 12-18 % of it for its first 0.5 ms of workload time (K = 16000,
#: M = 50, 400 Gb/s NICs) and reached its half share after about 0.6 ms, that is two drain times of the 200-packet pfifo
#: under each HTB leaf (0.29 ms of workload time there): slow start from its initial window, one doubling per round trip,
#: with the established flow's queue in every round trip.
TCP_JOIN_RAMP_QUEUE_DRAINS = 2.0
TCP_JOIN_WEIGHT = 0.17
#: Payload bytes of one queued packet (the MSS of a 1500-byte MTU).
TCP_MSS = 1448


def tcp_join_options(topo: Topology, *, byte_scale: float = 1.0, queue_packets: int = 200) -> dict[str, float]:
    """Simulator options that model the emulated TCP's convergence: ``{"join_ramp_s": ..., "join_weight": ...}`` for :func:`emu.sim.simulate`.

    A joining flow's ramp lasts :data:`TCP_JOIN_RAMP_QUEUE_DRAINS` drain
    times of an HTB leaf's queue (``queue_packets`` packets, as
    :func:`plan_network` shapes them) at the slowest NIC's rate. In workload
    time that drain time is ``queue_packets * MSS * M / rate``: the time
    scale K slows the link and the clock alike and cancels, the byte scale M
    makes every queued byte stand for M. So the ramp is the same at K and
    3K, and a real fabric (M = 1, deep rates, RDMA) has a negligible one.

    >>> from topology import default_cluster
    >>> o = tcp_join_options(default_cluster(), byte_scale=50)
    >>> round(o["join_ramp_s"] * 1e3, 3), o["join_weight"]   # 2 x 200 x 1448 B x 50 / 50 GB/s, in ms
    (0.579, 0.17)
    """
    rates = [float(d["bw"]) for u, _v, _k, d in topo.links(LinkKind.NETWORK) if topo.graph.nodes[u].get("kind") == NodeKind.NIC]
    if not rates:
        return {"join_ramp_s": 0.0, "join_weight": TCP_JOIN_WEIGHT}
    drain_s = queue_packets * TCP_MSS * byte_scale / (min(rates) * 1e9)
    return {"join_ramp_s": TCP_JOIN_RAMP_QUEUE_DRAINS * drain_s, "join_weight": TCP_JOIN_WEIGHT}


def plan_network(topo: Topology, *, time_scale: float, nic_mode: str = "per-leaf", hosts: list[str] | None = None,
                 payload_rates: bool = True, floor_fraction: float = 0.01, queue_packets: int = 200,
                 max_link_mbit: float = MAX_LINK_MBIT, prefix: str | None = None) -> NetworkPlan:
    """Decide the emulated hosts, switches, interfaces, addresses and scaled rates of ``topo``.

    ``hosts`` restricts the emulation to some servers (default: all servers
    with a network NIC). ``prefix`` starts every name (hosts ``<prefix>h<i>``,
    switches ``<prefix>s<j>``, interfaces ``...-eth<k>``); the default is a
    fresh run id (:func:`emu.runs.new_prefix`), so concurrent runs never share
    a name and a dead run's leftovers can be told apart. Raises :class:`~topology.errors.InputError` when a
    scaled rate falls outside ``[1, max_link_mbit]`` Mbit/s (the message gives
    the time scale that would fit) and :class:`EmulationError` when the fabric
    cannot be emulated in the chosen mode.
    """
    if nic_mode not in NIC_MODES:
        raise InputError(f"nic_mode must be one of {', '.join(NIC_MODES)}, got {nic_mode!r}", where="nic_mode")
    if not time_scale > 0:
        raise InputError(f"time_scale must be positive, got {time_scale!r}", where="time_scale")
    if prefix is None:
        from .runs import new_prefix

        prefix = new_prefix()
    if not re.fullmatch(r"[a-z][a-z0-9]{1,9}", prefix):
        raise InputError(f"prefix must be 2-10 lowercase letters or digits starting with a letter, got {prefix!r}", where="prefix")
    g = topo.graph
    # NIC -> [(leaf, up GB/s, down GB/s)] over network cables.
    attach: dict[str, dict[str, list[str]]] = {}  # server -> leaf -> [nics]
    up_bw: dict[tuple[str, str], float] = {}
    down_bw: dict[tuple[str, str], float] = {}
    for u, v, _k, d in topo.links(LinkKind.NETWORK):
        if g.nodes[u]["kind"] == NodeKind.NIC and g.nodes[v]["kind"] == NodeKind.SWITCH:
            server = g.nodes[u]["host"]
            attach.setdefault(server, {}).setdefault(v, [])
            if u not in attach[server][v]:
                attach[server][v].append(u)
            up_bw[(u, v)] = up_bw.get((u, v), 0.0) + d["bw"]
        elif g.nodes[u]["kind"] == NodeKind.SWITCH and g.nodes[v]["kind"] == NodeKind.NIC:
            down_bw[(v, u)] = down_bw.get((v, u), 0.0) + d["bw"]
    servers = [h for h in topo.hosts() if h in attach] if hosts is None else list(hosts)
    for h in servers:
        if h not in attach:
            raise InputError(f"server {h!r} has no NIC cabled to a network switch; it cannot be emulated", where="hosts")
    if len(servers) < 1:
        raise EmulationError(f"topology {topo.name!r} has no server cabled to a network switch; nothing to emulate")
    emu_names = {f"{prefix}h{i}": h for i, h in enumerate(servers)}
    name_of = {h: n for n, h in emu_names.items()}

    def check_rate(rate: float, what: str, bw: float) -> None:
        worst = rate * (WIRE_OVERHEAD if payload_rates else 1.0)
        if worst > max_link_mbit or rate < MIN_LINK_MBIT:
            need = bw * 8e3 * (WIRE_OVERHEAD if payload_rates else 1.0) / (max_link_mbit if worst > max_link_mbit else MIN_LINK_MBIT)
            bound = "at least" if worst > max_link_mbit else "at most"
            raise InputError(
                f"time_scale {time_scale:g} maps {what} ({bw * 8:g} Gb/s) to {rate:.4g} Mbit/s; emulated links must carry "
                f"{MIN_LINK_MBIT:g}..{max_link_mbit:g} Mbit/s on the wire, so use a time_scale of {bound} {need:.4g}",
                where="time_scale",
            )

    interfaces: list[EmuInterface] = []
    switches: list[EmuSwitch] = []
    if nic_mode == "per-leaf":
        leaves: list[str] = []
        for h in servers:
            for leaf in attach[h]:
                if leaf not in leaves:
                    leaves.append(leaf)
        for a_i, a in enumerate(servers):
            for b in servers[a_i + 1:]:
                if not set(attach[a]) & set(attach[b]):
                    raise EmulationError(
                        f"servers {a} and {b} share no leaf switch; per-leaf emulation carries traffic on shared leaves only "
                        f"(spines are not emulated). Use nic_mode='aggregate' or emulate servers of one scalable unit"
                    )
        sw_name = {leaf: f"{prefix}s{j}" for j, leaf in enumerate(leaves)}
        switches = [EmuSwitch(sw_name[leaf], (leaf,)) for leaf in leaves]
        port = dict.fromkeys(sw_name.values(), 0)
        for i, h in enumerate(servers):
            for k, (leaf, nics) in enumerate(attach[h].items()):
                up = sum(up_bw[(n, leaf)] for n in nics)
                down = sum(down_bw.get((n, leaf), up_bw[(n, leaf)]) for n in nics)
                rate_up, rate_down = scaled_rate_mbit(up, time_scale), scaled_rate_mbit(down, time_scale)
                check_rate(rate_up, f"{h} -> {leaf}", up)
                check_rate(rate_down, f"{leaf} -> {h}", down)
                s = sw_name[leaf]
                port[s] += 1
                j = leaves.index(leaf)
                interfaces.append(EmuInterface(
                    host=name_of[h], topo_host=h, dev=f"{name_of[h]}-eth{k}", switch=s, switch_dev=f"{s}-eth{port[s]}",
                    ip=f"10.{(j + 1) // 256}.{(j + 1) % 256}.{i + 1}" if len(servers) < 255 else f"10.{j + 1}.{(i + 1) // 256}.{(i + 1) % 256}",
                    prefix=24 if len(servers) < 255 else 16, rate_mbit=rate_up, rate_down_mbit=rate_down, nics=tuple(nics), leaf=leaf,
                ))
    else:
        s = f"{prefix}s0"
        switches = [EmuSwitch(s, tuple(topo.switches()))]
        for i, h in enumerate(servers):
            nics = [n for leaf in attach[h] for n in attach[h][leaf]]
            up = sum(up_bw[(n, leaf)] for leaf in attach[h] for n in attach[h][leaf])
            down = sum(down_bw.get((n, leaf), up_bw[(n, leaf)]) for leaf in attach[h] for n in attach[h][leaf])
            rate_up, rate_down = scaled_rate_mbit(up, time_scale), scaled_rate_mbit(down, time_scale)
            check_rate(rate_up, f"{h} (all NICs)", up)
            check_rate(rate_down, f"fabric -> {h}", down)
            if len(nics) > 254:
                raise EmulationError(f"server {h} has {len(nics)} NICs; aggregate mode gives each an address 10.<k>.x.y, at most 254")
            nic_up = [sum(up_bw[(n, leaf)] for leaf in attach[h] if n in attach[h][leaf]) for n in nics]
            nic_down = [sum(down_bw.get((n, leaf), up_bw[(n, leaf)]) for leaf in attach[h] if n in attach[h][leaf]) for n in nics]
            interfaces.append(EmuInterface(
                host=name_of[h], topo_host=h, dev=f"{name_of[h]}-eth0", switch=s, switch_dev=f"{s}-eth{i + 1}",
                ip=f"10.0.{(i + 1) // 256}.{(i + 1) % 256}", prefix=16, rate_mbit=rate_up, rate_down_mbit=rate_down,
                nics=tuple(nics), leaf=None, nic_ips=tuple(f"10.{k + 1}.{(i + 1) // 256}.{(i + 1) % 256}" for k in range(len(nics))),
                nic_rates_mbit=tuple(scaled_rate_mbit(b, time_scale) for b in nic_up),
                nic_rates_down_mbit=tuple(scaled_rate_mbit(b, time_scale) for b in nic_down),
            ))
    longest = max([i.dev for i in interfaces] + [i.switch_dev for i in interfaces], key=len)
    if len(longest) > 15:
        raise InputError(f"interface name {longest!r} is longer than Linux's 15 characters: too many servers or ports for the prefix "
                         f"{prefix!r}; emulate fewer servers or use a shorter prefix", where="hosts")
    gpu_leaf: dict[str, str | None] = {}
    for h in servers:
        nics = [n for leaf in attach[h] for n in attach[h][leaf]]
        leaf_of_nic = {n: leaf for leaf in attach[h] for n in attach[h][leaf]}
        for gpu in topo.gpus(h):
            nic = _nearest_nic(topo, gpu, nics)
            gpu_leaf[gpu] = leaf_of_nic.get(nic) if nic else None
    return NetworkPlan(
        topology_name=topo.name, time_scale=float(time_scale), nic_mode=nic_mode, hosts=emu_names, switches=switches,
        interfaces=interfaces, payload_rates=payload_rates, floor_fraction=floor_fraction, queue_packets=queue_packets, gpu_leaf=gpu_leaf,
        prefix=prefix,
    )


def route_flow(plan: NetworkPlan, topo: Topology, src_gpu: str, dst_gpu: str) -> tuple[EmuInterface, EmuInterface] | None:
    """The (sender, receiver) interfaces that carry a GPU-to-GPU flow, or None when both GPUs share a server.

    Per-leaf mode uses the leaf of the source GPU's nearest NIC when the
    destination server is cabled to it, otherwise the leaf of the destination
    GPU's nearest NIC (NCCL's PXN: the data first crosses NVLink to the GPU on
    the destination's rail), otherwise the first leaf both servers share.
    """
    a, b = topo.host_of(src_gpu), topo.host_of(dst_gpu)
    if a == b:
        return None
    ha, hb = plan.emu_host(a), plan.emu_host(b)
    if plan.nic_mode == "aggregate":
        return plan.interfaces_of(ha)[0], plan.interfaces_of(hb)[0]
    leaves_a = {i.leaf: i for i in plan.interfaces_of(ha)}
    leaves_b = {i.leaf: i for i in plan.interfaces_of(hb)}
    for leaf in (plan.gpu_leaf.get(src_gpu), plan.gpu_leaf.get(dst_gpu), *leaves_a):
        if leaf in leaves_a and leaf in leaves_b:
            return leaves_a[leaf], leaves_b[leaf]
    raise EmulationError(f"no shared leaf between {a} and {b}")


def route_nics(topo: Topology, src_gpu: str, dst_gpu: str, policy: str) -> tuple[str | None, str | None]:
    """The NIC a flow leaves its server through and the NIC it enters the other through, on the simulator's route.

    :func:`topology.routing.flow_paths` under ``policy`` (an ECMP split differs
    only above the NICs, so the first path's NICs are every path's).
    """
    from topology.routing import flow_paths

    paths = flow_paths(topo, src_gpu, dst_gpu, policy)
    if not paths:
        return None, None
    nodes = [paths[0][1][0][0]] + [v for _u, v, _k in paths[0][1]]
    nics = [n for n in nodes if topo.graph.nodes[n].get("kind") == NodeKind.NIC]
    return (nics[0], nics[-1]) if nics else (None, None)


def flow_endpoints(plan: NetworkPlan, topo: Topology, src_gpu: str, dst_gpu: str,
                   policy: str = "ecmp") -> tuple[EmuInterface, str, EmuInterface, str] | None:
    """``(sender interface, source address, receiver interface, destination address)`` of a GPU-to-GPU flow; None inside a server.

    The flow uses the NICs the simulator routes it through (:func:`topology.routing.flow_paths`
    under ``policy``, the job's ``routing``). Aggregate mode sends it from the
    address of its egress NIC to the address of its ingress NIC, so that each
    NIC's HTB subtree limits it to that NIC's rate, as the simulator does.
    Per-leaf mode sends it over the leaf of its egress NIC when the
    destination is cabled to it, else over the leaf of its ingress NIC (the
    two differ only for flows the simulator sends across a spine, which is
    not emulated), else as :func:`route_flow`.

    >>> from topology import default_cluster
    >>> t = default_cluster()
    >>> agg = plan_network(t, time_scale=8000, nic_mode="aggregate", prefix="nw")
    >>> tx, src_ip, rx, dst_ip = flow_endpoints(agg, t, "node0/gpu1", "node3/gpu6")
    >>> tx.dev, src_ip, rx.dev, dst_ip      # NIC 1 of node0 to NIC 6 of node3, as the simulator routes it
    ('nwh0-eth0', '10.2.0.1', 'nwh3-eth0', '10.7.0.4')
    >>> leaf = plan_network(t, time_scale=1000, prefix="nw")
    >>> [i.leaf for i in flow_endpoints(leaf, t, "node0/gpu1", "node3/gpu6", "rail")[::2]]   # rail: the destination's rail
    ['su0/leaf6', 'su0/leaf6']
    """
    a, b = topo.host_of(src_gpu), topo.host_of(dst_gpu)
    if a == b:
        return None
    out_nic, in_nic = route_nics(topo, src_gpu, dst_gpu, policy)
    ha, hb = plan.emu_host(a), plan.emu_host(b)
    if plan.nic_mode == "aggregate":
        tx, rx = plan.interfaces_of(ha)[0], plan.interfaces_of(hb)[0]
        src_ip = tx.nic_ips[tx.nics.index(out_nic)] if out_nic in tx.nics else tx.ip
        dst_ip = rx.nic_ips[rx.nics.index(in_nic)] if in_nic in rx.nics else rx.ip
        return tx, src_ip, rx, dst_ip
    leaves_a = {i.leaf: i for i in plan.interfaces_of(ha)}
    leaves_b = {i.leaf: i for i in plan.interfaces_of(hb)}
    leaf_of = {n: i.leaf for i in plan.interfaces for n in i.nics}
    for leaf in (leaf_of.get(out_nic), leaf_of.get(in_nic)):
        if leaf in leaves_a and leaf in leaves_b:
            return leaves_a[leaf], leaves_a[leaf].ip, leaves_b[leaf], leaves_b[leaf].ip
    route = route_flow(plan, topo, src_gpu, dst_gpu)
    assert route is not None
    return route[0], route[0].ip, route[1], route[1].ip


# -- Mininet ----------------------------------------------------------------------------------------------


def import_mininet() -> SimpleNamespace:
    """Import Mininet from the system Python's dist-packages (see the module docstring).

    Raises :class:`EmulationError` when not root or when Mininet is not installed.
    """
    if os.geteuid() != 0:
        raise EmulationError("Mininet emulation needs root (network namespaces, tc)")
    for tool in ("mnexec", "tc", "ip", "brctl", "iperf3"):
        if shutil.which(tool) is None:
            raise EmulationError(f"{tool!r} not found; install the Debian packages mininet bridge-utils iperf3 iproute2")
    added = MININET_DIST_PACKAGES not in sys.path
    if added:
        sys.path.append(MININET_DIST_PACKAGES)
    try:
        mods = {name: importlib.import_module(f"mininet.{name}") for name in ("net", "node", "nodelib", "link", "log")}
    except ImportError as exc:
        raise EmulationError(f"cannot import mininet from {MININET_DIST_PACKAGES}: {exc}") from exc
    finally:
        if added and MININET_DIST_PACKAGES in sys.path:
            sys.path.remove(MININET_DIST_PACKAGES)
    return SimpleNamespace(**mods)


def _run(cmd: list[str], *, check: bool = True) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise EmulationError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def _root_links() -> set[str]:
    out = _run(["ip", "-o", "link", "show"])
    return {m.group(1) for m in re.finditer(r"^\d+: ([^:@\s]+)[@:]", out, re.M)}


class CpuMonitor:
    """Samples /proc/stat in a thread; reports busy fraction (all CPUs) mean and peak over the run."""

    def __init__(self, interval_s: float = 0.25):
        self.interval_s = interval_s
        self.samples: list[float] = []
        self.stamps: list[float] = []  # monotonic end of each sample's interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._first: tuple[int, int] | None = None
        self._last: tuple[int, int] | None = None

    @staticmethod
    def read() -> tuple[int, int]:
        """(busy, total) jiffies over all CPUs; idle and iowait count as not busy."""
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        total = sum(fields[:8])
        return total - idle, total

    def _loop(self) -> None:
        prev = self.read()
        while not self._stop.wait(self.interval_s):
            cur = self.read()
            dt = cur[1] - prev[1]
            if dt > 0:
                self.samples.append((cur[0] - prev[0]) / dt)
                self.stamps.append(time.monotonic())
            prev = cur

    def __enter__(self) -> CpuMonitor:
        self._first = self.read()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()
        self._last = self.read()

    def report(self, window: tuple[float, float] | None = None) -> dict[str, Any]:
        """Busy fraction over the whole run, or over the samples inside ``window`` (monotonic start, end) if given."""
        busy = None
        samples = self.samples
        if window is not None:
            samples = [b for b, t in zip(self.samples, self.stamps, strict=True) if window[0] + self.interval_s <= t <= window[1]]
            busy = sum(samples) / len(samples) if samples else None
        elif self._first and self._last and self._last[1] > self._first[1]:
            busy = (self._last[0] - self._first[0]) / (self._last[1] - self._first[1])
        ordered = sorted(samples)
        p90 = ordered[int(0.9 * (len(ordered) - 1))] if ordered else None
        return {"busy_mean": busy, "busy_p90": p90, "busy_max": ordered[-1] if ordered else None, "samples": len(ordered),
                "cpus": os.cpu_count()}


class EmulatedNetwork:
    """A running Mininet network built from a :class:`NetworkPlan`; use as a context manager.

    On entry it removes what dead runs left (:func:`emu.runs.reap_dead_runs`),
    registers this run under the plan's prefix (:class:`emu.runs.EmuRun`: owner
    pid, every process started in the hosts, temporary files under the run's
    directory), builds the hosts, bridges and veths, installs the 8-class HTB
    tree on every egress port and checks it (raising :class:`FidelityError`);
    on exit (also after an exception, Ctrl-C or SIGTERM, which inside the
    block raises :class:`KeyboardInterrupt`) it stops Mininet, which deletes
    the namespaces' processes, veths and bridges, and removes the run's
    record. After SIGKILL the next run removes the leftovers. A file lock
    serialises emulations of this package across processes (one Mininet per
    kernel).

    ``disable_gso`` makes every skb one MTU packet (``gso_max_segs 1``), so
    that HTB, which is non-preemptive per skb, switches priorities at packet
    granularity; it costs CPU (2-3% less throughput on the loaded 2-core
    machine), so by default GSO stays on and a high-priority packet may wait
    behind one 64 kB super-packet (2.6 ms at 200 Mbit/s).
    """

    def __init__(self, plan: NetworkPlan, *, disable_gso: bool = False):
        self.plan = plan
        self.disable_gso = disable_gso
        self.net: Any = None
        self.nodes: dict[str, Any] = {}
        self._lock_file: Any = None
        self.lock_wait_s = 0.0  # time spent waiting for another emulation to finish
        self.run: Any = None  # emu.runs.EmuRun, once registered
        self.reaped: dict[str, int] = {}  # what start() removed of dead runs
        self.workdir = Path(tempfile.gettempdir())  # the run's work/ directory once started
        self._cmd_lock = threading.Lock()  # a node's shell serves one command at a time (the fidelity monitor runs in a thread)
        self._stopping = False
        self._sigterm: Any = None

    # -- lifecycle
    def __enter__(self) -> EmulatedNetwork:
        from .runs import sigterm_as_interrupt

        self._sigterm = sigterm_as_interrupt(lambda: self._stopping)
        self._sigterm.__enter__()
        try:
            self.start()
        except BaseException:
            self.stop()
            self._sigterm.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            if self._sigterm is not None:
                self._sigterm.__exit__(None, None, None)
                self._sigterm = None

    def start(self) -> None:
        mn = import_mininet()
        mn.log.setLogLevel("error")
        self._lock_file = open(LOCK_PATH, "w")  # noqa: SIM115 - held for the network's lifetime
        t_lock = time.monotonic()
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("waiting for another netweave emulation to finish (it holds %s)", LOCK_PATH)
            fcntl.flock(self._lock_file, fcntl.LOCK_EX)
        self.lock_wait_s = time.monotonic() - t_lock
        from .runs import EmuRun, reap_dead_runs

        self.reaped = reap_dead_runs()
        try:
            self.run = EmuRun.register(self.plan.prefix, self.plan.root_links())
        except RuntimeError as exc:
            raise EmulationError(str(exc)) from None
        self.workdir = self.run.work
        taken = sorted(set(_root_links()) & set(self.plan.root_links()))
        if taken:
            raise EmulationError(f"interfaces {taken[:4]} already exist and belong to no dead run of ours; choose another prefix")
        net = mn.net.Mininet(topo=None, switch=mn.nodelib.LinuxBridge, controller=None, link=mn.link.Link, build=False,
                             autoSetMacs=False, waitConnected=False)
        self.net = net
        for name in self.plan.hosts:
            first = self.plan.interfaces_of(name)[0]
            self.nodes[name] = net.addHost(name, ip=f"{first.ip}/{first.prefix}")
            self.run.record_pid(self.nodes[name].pid)  # the shell that holds the host's namespace
        for s in self.plan.switches:
            self.nodes[s.name] = net.addSwitch(s.name)
            self.run.record_pid(self.nodes[s.name].pid)
        for i in self.plan.interfaces:
            net.addLink(self.nodes[i.host], self.nodes[i.switch], intfName1=i.dev, intfName2=i.switch_dev,
                        params1={"ip": f"{i.ip}/{i.prefix}"})
        net.build()
        net.start()
        for i in self.plan.interfaces:  # aggregate mode: one address per NIC, each shaped at its NIC's rate
            if i.nic_ips:
                self.host_cmd(i.host, "; ".join(f"ip addr add {ip}/{i.prefix} dev {i.dev}" for ip in i.nic_ips))
        self._resolve_neighbours()
        if self.disable_gso:
            # One MTU packet per skb: HTB is non-preemptive per skb, and 64 kB GSO bursts would blur priorities.
            for i in self.plan.interfaces:
                self.host_cmd(i.host, f"ip link set dev {i.dev} gso_max_segs 1")
        self.apply_htb()

    def _resolve_neighbours(self) -> None:
        """Permanent ARP entries for every address a host can reach on each of its links.

        A fabric's addresses are resolved before training starts; without this
        the first flow between every pair of addresses waits for ARP, which made
        the first iteration of a run up to 50 % slower on a loaded machine.
        """
        macs: dict[str, str] = {}
        for host in self.plan.hosts:
            devs = [i.dev for i in self.plan.interfaces_of(host)]
            out = self.host_cmd(host, "; ".join(f"echo {d} $(cat /sys/class/net/{d}/address)" for d in devs))
            for line in out.splitlines():
                words = line.split()
                if len(words) == 2 and words[0] in devs:
                    macs[words[0]] = words[1]
        for host in self.plan.hosts:
            cmds = []
            for mine in self.plan.interfaces_of(host):
                for other in self.plan.interfaces:
                    if other.host != host and other.switch == mine.switch and other.dev in macs:
                        cmds += [f"ip neigh replace {ip} lladdr {macs[other.dev]} dev {mine.dev} nud permanent"
                                 for ip in (other.ip, *other.nic_ips)]
            if cmds:  # a script file: a shell line of the host's terminal holds at most 4095 characters
                script = self.workdir / f"neigh-{host}.sh"
                script.write_text("\n".join(cmds) + "\n")
                self.host_cmd(host, f"sh {script}")

    def stop(self) -> None:
        self._stopping = True  # a SIGTERM from now on must not cut the clean-up short
        try:
            if self.net is not None:
                if self.run is not None:
                    self.run.set_phase("stopping")
                self.net.stop()
        finally:
            self.net = None
            if self.run is not None:
                from .runs import reap_run

                reap_run(self.run.dir)  # whatever Mininet did not stop (processes started in hosts), then the record
                self.run = None
            if self._lock_file is not None:
                fcntl.flock(self._lock_file, fcntl.LOCK_UN)
                self._lock_file.close()
                self._lock_file = None
            self._stopping = False

    def set_phase(self, phase: str) -> None:
        """Record what the run is doing (``RUNS_DIR/<prefix>/phase``), for operators and tests."""
        if self.run is not None:
            self.run.set_phase(phase)

    # -- commands
    def host(self, name: str) -> Any:
        return self.nodes[name]

    def host_cmd(self, name: str, cmd: str) -> str:
        with self._cmd_lock:
            return self.nodes[name].cmd(cmd)

    def popen(self, name: str, args: list[str], **kwargs: Any) -> subprocess.Popen:
        """Start a process inside emulated host ``name`` (its network namespace); the run records it for clean-up."""
        proc = self.nodes[name].popen(args, **kwargs)
        if self.run is not None:
            self.run.record_pid(proc.pid)
        return proc

    def ip_of(self, emu_host: str, switch: str | None = None) -> str:
        ifaces = self.plan.interfaces_of(emu_host)
        return (ifaces[0] if switch is None else self.plan.interface(emu_host, switch)).ip

    # -- tc
    def _batch(self, where: str | None, lines: list[str]) -> None:
        path = self.workdir / f"tc-{where or 'root'}.batch"
        path.write_text("\n".join(lines) + "\n")
        if where is None:
            _run(["tc", "-batch", str(path)])
        else:
            out = self.host_cmd(where, f"tc -batch {path} 2>&1; echo rc=$?")
            if not out.strip().endswith("rc=0"):
                raise EmulationError(f"tc -batch in {where} failed: {out.strip()}")

    def apply_htb(self) -> None:
        by_ns: dict[str | None, list[str]] = {}
        for where, spec in self.plan.htb_specs():
            by_ns.setdefault(where, []).extend(htb_tree_commands(spec.dev, spec.rate_mbit, floor_fraction=spec.floor_fraction,
                                                                 queue_packets=spec.queue_packets, ack_fraction=spec.ack_fraction,
                                                                 nic_classes=spec.nic_classes, nic_match=spec.nic_match))
        for where, lines in by_ns.items():
            self._batch(where, lines)

    def remove_htb(self, dev: str) -> None:
        """Remove one interface's tree (used by tests to prove the check notices)."""
        where = next(w for w, s in self.plan.htb_specs() if s.dev == dev)
        self._batch(where, [htb_teardown_command(dev)])

    def tc_state(self) -> dict[str, dict[str, str]]:
        """``{dev: {"qdisc": ..., "class": ..., "filter": ...}}`` for every emulated egress port."""
        by_ns: dict[str | None, list[str]] = {}
        for where, spec in self.plan.htb_specs():
            by_ns.setdefault(where, []).append(spec.dev)
        out: dict[str, dict[str, str]] = {}
        for where, devs in by_ns.items():
            script = "; ".join(
                f"echo '@@dev {d}'; echo '@@qdisc'; tc qdisc show dev {d}; echo '@@class'; tc -s class show dev {d}; "
                f"echo '@@filter'; tc filter show dev {d}" for d in devs
            )
            text = _run(["sh", "-c", script]) if where is None else self.host_cmd(where, script)
            dev, part = None, None
            for line in text.splitlines():
                if line.startswith("@@dev "):
                    dev = line.split()[1]
                    out[dev] = {"qdisc": "", "class": "", "filter": ""}
                elif line.startswith("@@") and dev:
                    part = line[2:].strip()
                elif dev and part:
                    out[dev][part] += line + "\n"
        return out

    def verify_htb(self, *, raise_on_error: bool = True) -> dict[str, Any]:
        """Check every egress port's tree; returns the report, raises :class:`FidelityError` on problems (unless told not to)."""
        state = self.tc_state()
        problems: list[str] = []
        for _where, spec in self.plan.htb_specs():
            st = state.get(spec.dev)
            if st is None:
                problems.append(f"{spec.dev}: interface missing")
                continue
            problems += check_htb_tree(spec, st["qdisc"], st["class"], st["filter"])
        report = {"interfaces": len(state), "problems": problems, "ok": not problems}
        if problems and raise_on_error:
            raise FidelityError(f"qdisc tree check failed on {len(problems)} item(s): " + "; ".join(problems[:8]), {"htb": report})
        return report

    def class_counters(self) -> dict[str, dict[int, dict[str, Any]]]:
        """Per-interface, per-priority tc class counters (bytes, packets, drops)."""
        return {dev: class_counters(st["class"]) for dev, st in self.tc_state().items()}

    # -- calibration
    def calibrate(self, *, seconds: float = 1.0, tolerance: float = 0.10, port: int = 5299, raise_on_error: bool = True) -> dict[str, Any]:
        """Run one iperf3 TCP flow over the first emulated link and compare the receiver's goodput with the configured rate.

        The expected goodput is the interface's payload rate (``rate_mbit``);
        raises :class:`FidelityError` when off by more than ``tolerance``.
        """
        if len(self.plan.hosts) < 2:
            return {"skipped": "fewer than two emulated hosts", "ok": True}
        src = self.plan.interfaces[0]
        dst = next(i for i in self.plan.interfaces if i.switch == src.switch and i.host != src.host)
        expected = min(src.rate_mbit, dst.rate_down_mbit)
        if not self.plan.payload_rates:
            expected /= WIRE_OVERHEAD
        # iperf3 takes whole seconds (``-t 0.5`` would be read as 0 = run forever); every process gets a deadline.
        whole = max(1, round(seconds))
        omit = 1
        server = self.popen(dst.host, ["iperf3", "-s", "-1", "-p", str(port), "-B", dst.ip], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = None
        try:
            time.sleep(0.2)
            client = self.popen(src.host, ["iperf3", "-c", dst.ip, "-p", str(port), "-B", src.ip, "-t", str(whole), "-O", str(omit), "-J"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            try:
                raw, _ = client.communicate(timeout=whole + omit + 15)
            except subprocess.TimeoutExpired:
                raise FidelityError(f"calibration iperf3 {src.dev} -> {dst.dev} did not finish within {whole + omit + 15} s") from None
            out = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        finally:
            for proc in (client, server):
                if proc is None:
                    continue
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        import json

        try:
            data = json.loads(out)
            measured = data["end"]["sum_received"]["bits_per_second"] / 1e6
        except (ValueError, KeyError) as exc:
            raise FidelityError(f"calibration iperf3 gave no result: {out[-400:]}") from exc
        error = measured / expected - 1
        report = {"src": src.dev, "dst": dst.dev, "expected_mbit": expected, "measured_mbit": measured, "error": error,
                  "tolerance": tolerance, "seconds": whole, "ok": abs(error) <= tolerance}
        if not report["ok"]:
            report["problems"] = [f"calibration flow {src.dev} -> {dst.dev}: {measured:.1f} Mbit/s measured, {expected:.1f} configured "
                                  f"({error:+.1%}, tolerance {tolerance:.0%})"]
        if not report["ok"] and raise_on_error:
            raise FidelityError(f"calibration flow {src.dev} -> {dst.dev} reached {measured:.1f} Mbit/s, configured "
                                f"{expected:.1f} Mbit/s ({error:+.1%}, tolerance {tolerance:.0%})", {"calibration": report})
        return report


@contextmanager
def emulated_network(plan: NetworkPlan, **kwargs: Any) -> Iterator[EmulatedNetwork]:
    """``with emulated_network(plan) as net: ...``; see :class:`EmulatedNetwork`."""
    with EmulatedNetwork(plan, **kwargs) as net:
        yield net
