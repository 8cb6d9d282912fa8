"""Enforce a flow plan: HTB trees with DSCP filters on egress ports, and marks/pacing on our own sockets.

Two planes (``shared/research/flowsched.md`` §0, §4):

- *Network*: every egress port (host NICs and, in Mininet, switch ports) gets the
  8-class strict-priority HTB tree of :mod:`emu.htb` (u32 filters on the DSCP
  bits). On top of it this module adds (a) a ceiling on the classes whose
  traffic the plan paces (Parrot's rates: ``class change ... ceil``) and
  (b) extra u32 filters for DSCP values the plan overrides. The tree itself is
  always :func:`emu.htb.htb_tree_commands`'s.
- *Host*: :func:`mark_socket` (``IP_TOS`` = DSCP << 2, then ``SO_PRIORITY``,
  because ``IP_TOS`` rewrites the socket priority) and :func:`pace_socket`
  (``SO_MAX_PACING_RATE``; TCP paces internally without the fq qdisc).

Applying is all-or-nothing as far as tc allows: the whole batch is generated and
checked first, the old root qdisc is removed, then one ``tc -batch`` installs the
tree; if tc fails midway the root is removed again (the port falls back to the
kernel default, unshaped) and :class:`EnforceError` is raised, so a port never
keeps half a tree.

>>> from flowsched.plan import FlowPlan, FlowRule, HostPlan
>>> p = FlowPlan({"h0": HostPlan([FlowRule("a", 0, rate=2.5e6), FlowRule("b", 3, dscp=46)], link_rate=12.5e6)})
>>> lines = host_tc_commands(p, "h0", "eth0")
>>> lines[0], lines[-2]  # doctest: +NORMALIZE_WHITESPACE
('qdisc replace dev eth0 root handle 1: htb default 17 r2q 10',
 'class change dev eth0 parent 1:1 classid 1:10 htb rate 1000kbit ceil 20000kbit burst 12500 cburst 12500 prio 0 quantum 1514')
>>> lines[-1].endswith('u32 match ip tos 0xb8 0xfc flowid 1:13')  # DSCP 46 (EF) overrides class 3's CS4
True
"""

from __future__ import annotations

import os
import re
import socket
import struct
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from emu.htb import (
    NUM_PRIORITIES,
    PRIORITY_DSCP,
    HtbSpec,
    class_counters,
    htb_teardown_command,
    htb_tree_commands,
    leaf_classid,
    parse_tc_classes,
)
from topology.errors import InputError

from .plan import FlowPlan, class_table, skb_priority, validate_plan

#: ``SO_MAX_PACING_RATE`` (``asm-generic/socket.h``); Python's socket module does not export it.
SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)
_FIRST_EXTRA_FILTER_PREF = NUM_PRIORITIES + 2  # emu.htb's filters use prefs 1 (pure ACKs) and 2..9 (DSCP)


class EnforceError(InputError):
    """A plan that cannot be enforced as asked, or a tc batch the kernel refused."""


# -- command generation (pure) ----------------------------------------------------------------------


def _kbit(bytes_per_s: float) -> float:
    return bytes_per_s * 8 / 1000


def ceiling_commands(spec: HtbSpec, ceilings_kbit: dict[int, float]) -> list[str]:
    """``class change`` lines lowering leaf ceilings of ``spec``'s tree (``{priority: kbit}``; clipped to [floor, link])."""
    out = []
    for p in sorted(ceilings_kbit):
        ceil = max(spec.floor_kbit, min(spec.rate_kbit, round(ceilings_kbit[p])))
        if ceil >= spec.rate_kbit:
            continue
        out.append(
            f"class change dev {spec.dev} parent 1:1 classid {leaf_classid(p)} htb rate {spec.floor_kbit}kbit ceil {ceil}kbit "
            f"burst {spec.burst_bytes} cburst {spec.burst_bytes} prio {p} quantum {spec.mtu}"
        )
    return out


def dscp_filter_commands(dev: str, dscp_priority: dict[int, int], *, first_pref: int = _FIRST_EXTRA_FILTER_PREF) -> list[str]:
    """u32 filters for DSCP values outside :data:`emu.htb.PRIORITY_DSCP` (the plan's overrides), prefs from ``first_pref`` on."""
    out = []
    for i, (dscp, p) in enumerate(sorted((d, p) for d, p in dscp_priority.items() if d not in PRIORITY_DSCP)):
        out.append(f"filter add dev {dev} parent 1: protocol ip prio {first_pref + i} u32 match ip tos {dscp << 2:#04x} 0xfc "
                   f"flowid {leaf_classid(p)}")
    return out


def _next_filter_pref(lines: Sequence[str]) -> int:
    """One above the highest filter pref of a tree (overrides are checked after the tree's own filters)."""
    prefs = [int(m.group(1)) for m in (re.search(r"^filter add .* prio (\d+) ", x) for x in lines) if m]
    return max(prefs, default=_FIRST_EXTRA_FILTER_PREF - 1) + 1


def port_commands(spec: HtbSpec, ceilings_kbit: dict[int, float], dscp_priority: dict[int, int]) -> list[str]:
    """The full batch for one port: the :mod:`emu.htb` tree, ceilings, extra DSCP filters."""
    extra = {"ack_fraction": spec.ack_fraction} if hasattr(spec, "ack_fraction") else {}  # emu.htb's control leaf, when it has one
    tree = htb_tree_commands(spec.dev, spec.rate_mbit, floor_fraction=spec.floor_fraction, queue_packets=spec.queue_packets, **extra)
    return tree + ceiling_commands(spec, ceilings_kbit) + dscp_filter_commands(spec.dev, dscp_priority, first_pref=_next_filter_pref(tree))


def host_tc_commands(plan: FlowPlan, host: str, dev: str, *, rate_mbit: float | None = None, floor_fraction: float = 0.01,
                     queue_packets: int = 200, time_scale: float = 1.0, wire_overhead: float = 1.0) -> list[str]:
    """``tc -batch`` lines for ``host``'s egress ``dev``.

    ``rate_mbit`` defaults to the plan's ``link_rate`` of the host. Rates in the
    plan are real bytes/s; ``time_scale`` divides them (emulation) and
    ``wire_overhead`` multiplies them (HTB counts frames, plans count payload).
    """
    validate_plan(plan)
    plan.rules(host)  # an unknown host is an error, not an empty tree
    if rate_mbit is None:
        link = plan.hosts[host].link_rate
        if link is None:
            raise EnforceError(f"no link rate for {host}: give rate_mbit or set hosts.{host}.link_rate in the plan", where="rate_mbit")
        rate_mbit = _kbit(link) / 1000 / time_scale * wire_overhead
    spec = HtbSpec(dev, rate_mbit, floor_fraction=floor_fraction, queue_packets=queue_packets)
    table = class_table(plan, host)
    ceilings = {p: _kbit(c.ceil) / time_scale * wire_overhead for p, c in table.items() if c.ceil is not None}
    return port_commands(spec, ceilings, plan.dscp_table())


@dataclass(frozen=True)
class PortBatch:
    """The batch of one emulated egress port; ``where`` is the Mininet host, None for the root namespace (switch ports)."""

    where: str | None
    dev: str
    lines: list[str] = field(hash=False)


def network_tc_commands(plan: FlowPlan, net_plan: Any) -> list[PortBatch]:
    """Batches for every egress port of an emulated network (:class:`emu.net.NetworkPlan`), both directions.

    Host ports: the host's class ceilings, split evenly over its interfaces (NCCL
    stripes rings over all rails). Switch ports toward server *h*: for a class
    whose every rule in the plan names a ``peer`` and a ``rate``, the sum of the
    rates of the rules with ``peer == h`` (split over *h*'s interfaces); other
    classes are not capped there. Rates are scaled by the network's time scale
    and wire overhead, exactly like its link rates.
    """
    validate_plan(plan)
    from emu.net import WIRE_OVERHEAD

    factor = (WIRE_OVERHEAD if net_plan.payload_rates else 1.0) / net_plan.time_scale
    dscp_priority = plan.dscp_table()
    specs = dict(((w, s.dev), s) for w, s in net_plan.htb_specs())
    n_ifaces: dict[str, int] = {}
    for i in net_plan.interfaces:
        n_ifaces[i.topo_host] = n_ifaces.get(i.topo_host, 0) + 1
    all_rules = [r for hp in plan.hosts.values() for r in hp.rules]
    peer_capped = {p for p in range(NUM_PRIORITIES)
                   if any(r.priority == p for r in all_rules) and all(r.peer and r.rate for r in all_rules if r.priority == p)}
    out = []
    for i in net_plan.interfaces:
        h = i.topo_host
        up: dict[int, float] = {}
        if h in plan.hosts:
            up = {p: _kbit(c.ceil) * factor / n_ifaces[h] for p, c in class_table(plan, h).items() if c.ceil is not None}
        down: dict[int, float] = {}
        for p in peer_capped:
            total = sum(r.rate for r in all_rules if r.priority == p and r.peer == h)  # type: ignore[misc]
            if total > 0:
                down[p] = _kbit(total) * factor / n_ifaces[h]
        out.append(PortBatch(i.host, i.dev, port_commands(specs[(i.host, i.dev)], up, dscp_priority)))
        out.append(PortBatch(None, i.switch_dev, port_commands(specs[(None, i.switch_dev)], down, dscp_priority)))
    return out


# -- applying ------------------------------------------------------------------------------------------


def _prefix(netns: str | None) -> list[str]:
    return ["ip", "netns", "exec", netns] if netns else []


def apply_tc(lines: Sequence[str], dev: str, *, netns: str | None = None, node: Any = None) -> None:
    """Install a batch on ``dev``: remove its root qdisc, then run the whole batch with one ``tc -batch``.

    ``netns``: run inside that network namespace (``ip netns exec``); ``node``: a
    Mininet node (its ``cmd``). On failure the root qdisc is removed again and
    :class:`EnforceError` is raised with tc's message.
    """
    if not lines:
        raise EnforceError("empty tc batch", where=dev)
    if any("\n" in line for line in lines):
        raise EnforceError("a tc batch line contains a newline", where=dev)
    text = "\n".join(lines) + "\n"
    teardown = htb_teardown_command(dev)
    if node is not None:
        fd, path = tempfile.mkstemp(prefix="netweave-tc-", suffix=".batch")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            node.cmd(f"tc {teardown} 2>/dev/null")
            out = node.cmd(f"tc -batch {path} 2>&1; echo rc=$?")
            if not out.strip().endswith("rc=0"):
                node.cmd(f"tc {teardown} 2>/dev/null")
                raise EnforceError(f"tc -batch failed: {out.strip()}", where=dev)
        finally:
            os.unlink(path)
        return
    subprocess.run([*_prefix(netns), "tc", *teardown.split()], capture_output=True, text=True)  # absent root: nothing to remove
    res = subprocess.run([*_prefix(netns), "tc", "-batch", "-"], input=text, capture_output=True, text=True)
    if res.returncode != 0:
        subprocess.run([*_prefix(netns), "tc", *teardown.split()], capture_output=True, text=True)
        raise EnforceError(f"tc -batch failed ({res.returncode}): {(res.stderr or res.stdout).strip()}", where=dev)


def tc_show(dev: str, what: str = "class", *, netns: str | None = None, stats: bool = True) -> str:
    """Output of ``tc [-s] {qdisc|class|filter} show dev DEV``."""
    cmd = [*_prefix(netns), "tc", *(["-s"] if stats else []), what, "show", "dev", dev]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise EnforceError(f"{' '.join(cmd)} failed: {res.stderr.strip()}", where=dev)
    return res.stdout


def class_bytes(dev: str, *, netns: str | None = None) -> dict[int, dict[str, Any]]:
    """Per-priority sent bytes/packets/drops of the tree on ``dev``."""
    return class_counters(tc_show(dev, "class", netns=netns))


def class_ceilings(dev: str, *, netns: str | None = None) -> dict[int, float]:
    """Per-priority HTB ceilings (bit/s) currently installed on ``dev``."""
    classes = parse_tc_classes(tc_show(dev, "class", netns=netns))
    return {p: classes[leaf_classid(p)].ceil_bps for p in range(NUM_PRIORITIES) if leaf_classid(p) in classes}


class DryRunApplier:
    """Applier that records the batches it would run (tests, ``--dry-run``)."""

    def __init__(self, dev: str = "eth0", rate_mbit: float | None = None, **kwargs: Any):
        self.dev, self.rate_mbit, self.kwargs = dev, rate_mbit, kwargs
        self.applied: list[tuple[int, list[str]]] = []

    def commands(self, plan: FlowPlan, host: str) -> list[str]:
        return host_tc_commands(plan, host, self.dev, rate_mbit=self.rate_mbit, **self.kwargs)

    def __call__(self, plan: FlowPlan, host: str) -> list[str]:
        lines = self.commands(plan, host)
        self.applied.append((plan.epoch, lines))
        return lines


class TcApplier(DryRunApplier):
    """Applier that installs the batch with :func:`apply_tc` (root, or inside ``netns`` / a Mininet ``node``)."""

    def __init__(self, dev: str, rate_mbit: float | None = None, *, netns: str | None = None, node: Any = None, **kwargs: Any):
        super().__init__(dev, rate_mbit, **kwargs)
        self.netns, self.node = netns, node

    def __call__(self, plan: FlowPlan, host: str) -> list[str]:
        lines = self.commands(plan, host)
        apply_tc(lines, self.dev, netns=self.netns, node=self.node)
        self.applied.append((plan.epoch, lines))
        return lines


Applier = Callable[[FlowPlan, str], list[str]]


# -- sockets we own -------------------------------------------------------------------------------------


def mark_socket(sock: socket.socket, dscp: int, priority: int | None = None) -> dict[str, int]:
    """Mark ``sock``: ``IP_TOS`` (or ``IPV6_TCLASS``) = ``dscp << 2``, then ``SO_PRIORITY`` = ``priority``.

    ``priority`` is the raw ``skb->priority``; :func:`flowsched.plan.skb_priority`
    gives the value that selects a class's HTB leaf on this host (values above 6
    need CAP_NET_ADMIN). Returns the values read back with ``getsockopt``.

    >>> s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    >>> mark_socket(s, 46, 5)
    {'tos': 184, 'priority': 5}
    >>> s.close()
    """
    if not isinstance(dscp, int) or not 0 <= dscp <= 63:
        raise EnforceError(f"dscp must be an integer 0..63, got {dscp!r}", where="dscp")
    tos = dscp << 2
    if sock.family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_TCLASS, tos)
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)  # v4-mapped traffic of a dual-stack socket
    else:
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
    if priority is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY, int(priority))  # after IP_TOS, which rewrites it
    return socket_marks(sock)


def socket_marks(sock: socket.socket) -> dict[str, int]:
    """``{"tos": ..., "priority": ...}`` as the kernel holds them for ``sock``."""
    if sock.family == socket.AF_INET6:
        tos = sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_TCLASS)
    else:
        tos = sock.getsockopt(socket.IPPROTO_IP, socket.IP_TOS)
    return {"tos": tos, "priority": sock.getsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY)}


def pace_socket(sock: socket.socket, bytes_per_s: float | None) -> int:
    """Cap ``sock``'s sending rate with ``SO_MAX_PACING_RATE`` (None or 0: unlimited); returns the value read back.

    >>> s = socket.socket(); pace_socket(s, 1.25e6); s.close()
    1250000
    """
    if bytes_per_s is not None and not bytes_per_s >= 0:
        raise EnforceError(f"pacing rate must be >= 0 bytes/s, got {bytes_per_s!r}", where="rate")
    value = 2**64 - 1 if not bytes_per_s else int(bytes_per_s)
    sock.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, struct.pack("=Q", value))
    return struct.unpack("=Q", sock.getsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, 8))[0]


def apply_rule_to_socket(sock: socket.socket, plan: FlowPlan, host: str, job: str, *, peer: str | None = None, tensor: str | None = None,
                         so_priority: bool = True) -> dict[str, int]:
    """Mark (and pace) a socket of ``job`` on ``host`` as the plan says: the most specific matching rule wins.

    Returns the marks read back, plus ``"pacing"`` when the rule has a rate.
    """
    rules = [r for r in plan.rules(host) if r.job == job and r.comm is None and r.port is None
             and r.peer in (None, peer) and r.tensor in (None, tensor)]
    if not rules:
        raise EnforceError(f"the plan has no rule for job {job!r} on {host}", where="job")
    rule = max(rules, key=lambda r: (r.peer is not None, r.tensor is not None))
    out = mark_socket(sock, rule.dscp, skb_priority(rule.priority) if so_priority else None)  # type: ignore[arg-type]
    if rule.rate is not None:
        out["pacing"] = pace_socket(sock, rule.rate)
    return out


__all__ = [
    "SO_MAX_PACING_RATE", "Applier", "DryRunApplier", "EnforceError", "PortBatch", "TcApplier", "apply_rule_to_socket", "apply_tc",
    "ceiling_commands", "class_bytes", "class_ceilings", "dscp_filter_commands", "host_tc_commands", "mark_socket", "network_tc_commands",
    "pace_socket", "port_commands", "socket_marks", "tc_show",
]
