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

Applying is transactional (:func:`apply_tc`): the new batch is first run on a
fresh *staging* device (an ``ifb`` created next to the port and deleted after),
so a tree that tc refuses (a bad rate, a duplicate class) never touches the
port, which keeps its previous tree. Only a batch that tc accepted there is
swapped in: one ``tc -batch`` removes the old root and installs the new tree
(traffic meets the kernel's default qdisc only while that one process runs).
Should the swap still fail, the previous batch is installed again and the
error says whether that worked. :func:`verify_tc` reads the device back
(``tc -j qdisc/filter show``; classes from text, which iproute2 6.1 prints
for htb even under ``-j``) and lists every difference from the batch.

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
import shlex
import socket
import struct
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from emu.htb import (
    NUM_PRIORITIES,
    PRIORITY_DSCP,
    HtbSpec,
    batch_state,
    class_counters,
    compare_states,
    htb_teardown_command,
    htb_tree_commands,
    kernel_state,
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
    check_dev_name(dev)
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


_DEV_NAME = re.compile(r"[A-Za-z0-9_.@:+-]{1,15}")


def check_dev_name(dev: str, where: str = "dev") -> str:
    """``dev`` if it is a valid interface name (1-15 of letters, digits and ``_.@:+-``), else :class:`EnforceError`.

    >>> check_dev_name("eth0")
    'eth0'
    """
    if not isinstance(dev, str) or not _DEV_NAME.fullmatch(dev):
        raise EnforceError(f"expected an interface name of 1-15 letters, digits or _.@:+-, got {dev!r}", where=where)
    return dev


class _Shell:
    """Runs ``tc``/``ip`` where the device lives: here, inside ``ip netns exec NETNS``, or in a Mininet node's shell."""

    def __init__(self, netns: str | None = None, node: Any = None):
        self.netns, self.node = netns, node

    def run(self, args: Sequence[str], stdin: str | None = None, *, merge_stderr: bool = True) -> tuple[int, str]:
        """``(exit status, stdout)``; stderr is appended to the output when ``merge_stderr`` (error messages)."""
        if self.node is None:
            prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
            res = subprocess.run([*prefix, *args], input=stdin, capture_output=True, text=True)
            return res.returncode, res.stdout + (res.stderr if merge_stderr else "")
        path = None
        try:
            if stdin is not None:  # the node's shell shares our file system
                fd, path = tempfile.mkstemp(prefix="netweave-tc-", suffix=".batch")
                with os.fdopen(fd, "w") as f:
                    f.write(stdin)
                args = [path if a == "-" else a for a in args]
            out = self.node.cmd(f"{shlex.join(args)} {'2>&1' if merge_stderr else '2>/dev/null'}; echo \"@@rc=$?\"")
        finally:
            if path is not None:
                os.unlink(path)
        body, _, rc = out.rstrip().rpartition("@@rc=")
        return (int(rc) if rc.strip().isdigit() else 1), body


def _one_line(text: str) -> str:
    """tc's (multi-line) message as one line."""
    return "; ".join(x.strip() for x in text.splitlines() if x.strip())[:500]


def _check_batch(lines: Sequence[str], dev: str) -> None:
    check_dev_name(dev)
    if not lines:
        raise EnforceError("empty tc batch", where=dev)
    for line in lines:
        if "\n" in line or "\r" in line:
            raise EnforceError("a tc batch line contains a newline", where=dev)
        if f" dev {dev} " not in f" {line} ":
            raise EnforceError(f"a batch line does not name the device {dev}: {line!r}", where=dev)


def _swap(lines: Sequence[str], dev: str, sh: _Shell) -> str | None:
    """Replace ``dev``'s tree by ``lines`` in one ``tc -batch``; None on success, else tc's message."""
    rc, out = sh.run(["tc", "-j", "qdisc", "show", "dev", dev], merge_stderr=False)
    if rc != 0:
        return f"cannot read the qdiscs of {dev} (exit {rc})"
    try:
        root = kernel_state(out, "", "[]").root
    except ValueError:
        return f"cannot parse the qdiscs of {dev}: {out[:200]!r}"
    teardown = [htb_teardown_command(dev)] if root and root[1] not in ("0:", "") else []  # the kernel's default root has handle 0:
    rc, out = sh.run(["tc", "-batch", "-"], "\n".join([*teardown, *lines]) + "\n")
    return None if rc == 0 else f"exit {rc}: {_one_line(out)}"


def _stage(lines: Sequence[str], dev: str, sh: _Shell) -> str | None:
    """Run the batch on a fresh ``ifb`` device beside ``dev``; None when tc accepted every line, else its message."""
    stage = f"nwstg{uuid.uuid4().hex[:8]}"
    rc, out = sh.run(["ip", "link", "add", stage, "type", "ifb"])
    if rc != 0:
        raise EnforceError(f"cannot create the staging device {stage} (ifb): {_one_line(out)}", where=dev)
    try:
        staged = [f" {line} ".replace(f" dev {dev} ", f" dev {stage} ").strip() for line in lines]
        rc, out = sh.run(["tc", "-batch", "-"], "\n".join(staged) + "\n")
        return None if rc == 0 else _one_line(out).replace(stage, dev)
    finally:
        sh.run(["ip", "link", "del", stage])


def apply_tc(lines: Sequence[str], dev: str, *, netns: str | None = None, node: Any = None, previous: Sequence[str] | None = None,
             stage: bool = True) -> None:
    """Install a batch on ``dev`` transactionally: check it on a staging device, then swap it in.

    ``netns``: run inside that network namespace (``ip netns exec``); ``node``:
    a Mininet node (its ``cmd``). When tc refuses the batch on the staging
    device, ``dev`` is not touched and :class:`EnforceError` says so. When the
    swap itself fails, ``previous`` (the batch that was in force) is installed
    again, or, without one, the half tree is removed; the error says which and
    whether it worked.
    """
    _check_batch(lines, dev)
    sh = _Shell(netns, node)
    if stage:
        refused = _stage(lines, dev, sh)
        if refused is not None:
            raise EnforceError(f"tc refused the new tree on a staging device ({refused}); {dev} keeps its previous tree", where=dev)
    failed = _swap(lines, dev, sh)
    if failed is None:
        return
    if previous:
        _check_batch(previous, dev)
        again = _swap(previous, dev, sh)
        outcome = "the previous tree is back" if again is None else f"restoring the previous tree failed too ({again}): {dev} is not shaped"
    else:
        sh.run(["tc", *htb_teardown_command(dev).split()])
        outcome = f"{dev} has no tree (there was no previous one to restore)"
    raise EnforceError(f"tc -batch failed ({failed}); {outcome}", where=dev)


def read_tc_state(dev: str, *, netns: str | None = None, node: Any = None) -> tuple[str, str, str]:
    """``(tc -j qdisc show, tc class show, tc -j filter show)`` of ``dev``."""
    check_dev_name(dev)
    sh = _Shell(netns, node)
    out = []
    for args in (["-j", "qdisc"], ["class"], ["-j", "filter"]):
        rc, text = sh.run(["tc", *args, "show", "dev", dev], merge_stderr=False)
        if rc != 0:
            raise EnforceError(f"tc {' '.join(args)} show dev {dev} failed (exit {rc})", where=dev)
        out.append(text)
    return out[0], out[1], out[2]


def verify_tc(lines: Sequence[str], dev: str, *, netns: str | None = None, node: Any = None) -> list[str]:
    """Differences between what ``lines`` install and what ``dev`` holds now (empty: the kernel has exactly that tree)."""
    try:
        have = kernel_state(*read_tc_state(dev, netns=netns, node=node))
    except ValueError as exc:  # unparsable tc output
        return [f"{dev}: cannot parse tc's output ({exc})"]
    except EnforceError as exc:
        return [str(exc)]
    return compare_states(batch_state(lines), have, dev=dev)


def tc_show(dev: str, what: str = "class", *, netns: str | None = None, stats: bool = True) -> str:
    """Output of ``tc [-s] {qdisc|class|filter} show dev DEV``."""
    cmd = ["tc", *(["-s"] if stats else []), what, "show", "dev", check_dev_name(dev)]
    rc, out = _Shell(netns).run(cmd, merge_stderr=False)
    if rc != 0:
        raise EnforceError(f"{' '.join(cmd)} failed (exit {rc})", where=dev)
    return out


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
    """Applier that installs the batch with :func:`apply_tc` (root, or inside ``netns`` / a Mininet ``node``).

    It remembers the last batch the kernel was seen to hold (applied, or
    verified by :meth:`verify`) and hands it to :func:`apply_tc` as the tree
    to restore should a swap fail.
    """

    def __init__(self, dev: str, rate_mbit: float | None = None, *, netns: str | None = None, node: Any = None, **kwargs: Any):
        super().__init__(check_dev_name(dev), rate_mbit, **kwargs)
        self.netns, self.node = netns, node
        self.in_force: list[str] | None = None

    def __call__(self, plan: FlowPlan, host: str) -> list[str]:
        lines = self.commands(plan, host)
        apply_tc(lines, self.dev, netns=self.netns, node=self.node, previous=self.in_force)
        self.in_force = lines
        self.applied.append((plan.epoch, lines))
        return lines

    def verify(self, plan: FlowPlan, host: str) -> list[str]:
        """Differences between ``plan``'s tree and the device's (empty: the kernel holds the plan)."""
        lines = self.commands(plan, host)
        problems = verify_tc(lines, self.dev, netns=self.netns, node=self.node)
        if not problems:
            self.in_force = lines
        return problems


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
    "ceiling_commands", "check_dev_name", "class_bytes", "class_ceilings", "dscp_filter_commands", "host_tc_commands", "mark_socket",
    "network_tc_commands", "pace_socket", "port_commands", "read_tc_state", "socket_marks", "tc_show", "verify_tc",
]
