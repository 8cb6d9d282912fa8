"""Eight strict-priority classes on a Linux egress port, with HTB and u32 only.

The emulation kernel has ``htb``, ``tbf``, ``pfifo`` and the ``u32`` filter but
no ``prio``, ``fq``, ``sfq``, ``red`` or ``netem`` (see
``shared/research/emu.md`` section 0). Strict priority is therefore emulated
with HTB's ``prio`` parameter: every leaf class gets a small guaranteed
``rate`` and ``ceil`` = the link rate, so whatever bandwidth is left over goes to
the backlogged leaf with the lowest ``prio`` first (``sch_htb.c`` serves lower
``prio`` first among classes borrowing from the same parent). The guaranteed
floor (1% of the link by default) keeps low classes from starving, which makes
the discipline "strict priority with a 1% floor per class", not pure strict
priority; the floor is a parameter.

Packets are classified by their DSCP (the upper six bits of the IPv4 TOS byte)
with u32 filters; anything unmatched (non-IP frames, DSCP values outside the
table) goes to the *default leaf*, the lowest priority class.

Pure TCP acknowledgements (IPv4 TCP packets shorter than 128 bytes: ACKs,
SYNs) go to a ninth, *control* leaf ``1:20`` whatever their DSCP, with a
guaranteed rate of ``ack_fraction`` (5%) of the link and prio 0. HTB serves
classes within their guaranteed rate before any class that borrows, so ACKs
overtake queued data. Without it, a host that both sends and receives (every
rank of a ring) queues the ACKs of its incoming flow behind up to
``queue_packets`` data packets of its outgoing flow of the same class, which
inflates the RTT by the queue's drain time (24 ms for 200 packets at
100 Mbit/s) and slows TCP's ramp-up so much that ring steps took up to twice
their time in our measurements: an emulation artefact (hardware NICs and RDMA
transports do not have it). ACKs of a full-rate flow need ~2.2% of the link. The default must
be a leaf: an HTB default that names an inner or missing class sends packets
to the unshaped direct queue, silently defeating the shaping.

Everything here is pure: the tree is generated as ``tc -batch`` lines and
checked by parsing ``tc`` output, so it is tested without root.

>>> lines = htb_tree_commands("h0-eth0", 100.0)
>>> lines[0]
'qdisc replace dev h0-eth0 root handle 1: htb default 17 r2q 10'
>>> dscp_for_priority(0), tos_for_priority(0), priority_for_dscp(0)
(56, 224, 7)
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from topology.errors import InputError

#: Number of priority classes (commodity switches have 8 queues; Sincronia uses 8 IP precedences).
NUM_PRIORITIES = 8

#: DSCP of each priority (0 = most urgent): the class-selector code points CS7..CS0,
#: i.e. the IP precedence of RFC 791 read as "higher precedence, higher priority".
#: Unmarked traffic (DSCP 0 = CS0) is therefore the lowest priority, which is also the default leaf.
PRIORITY_DSCP: tuple[int, ...] = tuple(8 * (NUM_PRIORITIES - 1 - p) for p in range(NUM_PRIORITIES))

ROOT_HANDLE = 1
PARENT_MINOR = 0x1
LEAF_MINOR_BASE = 0x10  # leaf of priority p is class 1:(0x10 + p)
ACK_MINOR = 0x20  # the control leaf for pure TCP ACKs
ACK_CLASSID = f"{ROOT_HANDLE:x}:{ACK_MINOR:x}"
NIC_MINOR_STRIDE = 0x100  # NIC k's subtree is class 1:(k+1)00, its leaves 1:(k+1)10 .. 1:(k+1)17 and 1:(k+1)20
MAX_NIC_CLASSES = 0xFE
DEFAULT_PRIORITY = NUM_PRIORITIES - 1
#: Highest link rate a tree may be built for (Mbit/s): 8 Tb/s, ten times an 800 Gb/s NIC. The bound is tc's: a leaf's
#: burst (1 ms of the link, :attr:`HtbSpec.burst_bytes`) must fit the kernel's 32-bit byte count, which fails ("Illegal
#: burst") from about 34 Tb/s on.
MAX_RATE_MBIT = 8e6


class HtbError(InputError):
    """A qdisc tree that cannot be generated as asked (bad rate, bad priority)."""


def dscp_for_priority(priority: int) -> int:
    """DSCP code point of ``priority`` (0 highest ... 7 lowest)."""
    if not 0 <= int(priority) < NUM_PRIORITIES:
        raise HtbError(f"priority must be an integer in 0..{NUM_PRIORITIES - 1}, got {priority!r}")
    return PRIORITY_DSCP[int(priority)]


def tos_for_priority(priority: int) -> int:
    """The IPv4 TOS byte (DSCP << 2, ECN bits zero) to pass to ``setsockopt(IP_TOS)``."""
    return dscp_for_priority(priority) << 2


def priority_for_dscp(dscp: int) -> int:
    """The class a packet with ``dscp`` lands in: its priority, or the default leaf when unknown."""
    try:
        return PRIORITY_DSCP.index(int(dscp))
    except ValueError:
        return DEFAULT_PRIORITY


def leaf_classid(priority: int) -> str:
    """tc class id (hex minor) of the leaf that serves ``priority``: ``1:10`` ... ``1:17``."""
    dscp_for_priority(priority)
    return f"{ROOT_HANDLE:x}:{LEAF_MINOR_BASE + priority:x}"


@dataclass(frozen=True)
class HtbSpec:
    """What one egress interface must carry: its rate and the class parameters.

    ``rate_mbit`` is the emulated link rate; each leaf guarantees
    ``floor_fraction * rate_mbit`` and may borrow up to the link rate.
    ``queue_packets`` is the pfifo limit under each leaf (a per-class buffer).
    ``ack_fraction`` is the control leaf's guaranteed share (0: no control
    leaf; ACKs then follow their DSCP like data).
    ``nic_classes``: ``(IPv4 address, rate Mbit/s)`` of the NICs that one
    interface stands for (the emulator's aggregate NIC mode); each NIC gets its
    own rate-limited subtree of the same eight leaves, selected by the packet's
    source (``nic_match="src"``, a host's egress) or destination address
    (``"dst"``, the switch port towards the host). See :func:`htb_tree_commands`.
    """

    dev: str
    rate_mbit: float
    floor_fraction: float = 0.01
    queue_packets: int = 200
    mtu: int = 1514
    ack_fraction: float = 0.05
    nic_classes: tuple[tuple[str, float], ...] = ()
    nic_match: str = "src"

    def __post_init__(self) -> None:
        if not 0 <= self.ack_fraction <= 0.5:
            raise HtbError(f"interface {self.dev}: ack_fraction must be in [0, 0.5], got {self.ack_fraction!r}")
        if not 0 < self.rate_mbit <= MAX_RATE_MBIT:
            raise HtbError(f"interface {self.dev}: rate must be positive and at most {MAX_RATE_MBIT:g} Mbit/s (8 Tb/s), "
                           f"got {self.rate_mbit!r} Mbit/s")
        if not (self.floor_fraction > 0 and self.floor_fraction * NUM_PRIORITIES + self.ack_fraction <= 1):
            raise HtbError(f"interface {self.dev}: floor_fraction must be positive with {NUM_PRIORITIES} * floor_fraction + ack_fraction "
                           f"<= 1, got {self.floor_fraction!r} (ack_fraction {self.ack_fraction!r})")
        if self.queue_packets < 1:
            raise HtbError(f"interface {self.dev}: queue_packets must be >= 1, got {self.queue_packets!r}")
        if self.nic_match not in ("src", "dst"):
            raise HtbError(f"interface {self.dev}: nic_match must be 'src' or 'dst', got {self.nic_match!r}")
        if len(self.nic_classes) > MAX_NIC_CLASSES:
            raise HtbError(f"interface {self.dev}: at most {MAX_NIC_CLASSES} NIC classes, got {len(self.nic_classes)}")
        for addr, rate in self.nic_classes:
            if not re.fullmatch(r"(\d{1,3})\.(\d{1,3})\.(\d{1,3})\.(\d{1,3})", str(addr)) or any(int(x) > 255 for x in str(addr).split(".")):
                raise HtbError(f"interface {self.dev}: NIC class address must be an IPv4 address, got {addr!r}")
            if not 0 < rate <= self.rate_mbit * (1 + 1e-9):
                raise HtbError(f"interface {self.dev}: NIC class rate must be positive and at most the link's {self.rate_mbit:g} Mbit/s, "
                               f"got {rate!r} for {addr}")

    @property
    def rate_kbit(self) -> int:
        return max(8, round(self.rate_mbit * 1000))

    @property
    def floor_kbit(self) -> int:
        return max(8, round(self.rate_kbit * self.floor_fraction))

    @property
    def ack_kbit(self) -> int:
        return max(8, round(self.rate_kbit * self.ack_fraction))

    @property
    def burst_bytes(self) -> int:
        # 1 ms worth of the link, at least 2 MTU. Every level (leaf, parent) of every hop lets a flow start with a
        # full bucket, so a big burst is a head start that makes short flows finish early: Mininet's fixed 15 kB
        # gave 60 kB (7% of a 625 kB flow at 50 Mbit/s) over two hops. Mininet's PR #1252 warns that tiny bursts
        # starve TCP when the RTT is large; emulated RTTs here are ~0.1 ms (no netem).
        return max(2 * self.mtu, round(self.rate_kbit * 1000 / 8 * 0.001))


def nic_classid(nic: int, priority: int | None = None) -> str:
    """tc class id of NIC ``nic``'s subtree (``1:100``, ``1:200`` ...), or of its leaf for ``priority`` (``1:110`` ... ``1:117``).

    >>> nic_classid(0), nic_classid(0, 3), nic_classid(2, 7)
    ('1:100', '1:113', '1:317')
    """
    minor = NIC_MINOR_STRIDE * (nic + 1)
    if priority is not None:
        dscp_for_priority(priority)
        minor += LEAF_MINOR_BASE + priority
    return f"{ROOT_HANDLE:x}:{minor:x}"


def nic_ack_classid(nic: int) -> str:
    """tc class id of NIC ``nic``'s control leaf for pure ACKs (``1:120`` ...)."""
    return f"{ROOT_HANDLE:x}:{NIC_MINOR_STRIDE * (nic + 1) + ACK_MINOR:x}"


def _leaf_priority(classid: str) -> int | None:
    """The priority a leaf class serves (``1:13`` and ``1:213`` serve 3), None for inner and control classes."""
    minor = int(classid.split(":")[1], 16)
    low = minor % NIC_MINOR_STRIDE
    return low - LEAF_MINOR_BASE if LEAF_MINOR_BASE <= low < LEAF_MINOR_BASE + NUM_PRIORITIES else None


def htb_tree_commands(dev: str, rate_mbit: float, *, floor_fraction: float = 0.01, queue_packets: int = 200,
                      ack_fraction: float = 0.05, nic_classes: Sequence[tuple[str, float]] = (), nic_match: str = "src") -> list[str]:
    """``tc -batch`` lines (no leading ``tc``) that install the 8-class tree on ``dev``.

    Layout: root qdisc ``1:`` (htb, default leaf ``1:17``) -> class ``1:1``
    (rate = ceil = link) -> leaves ``1:10``..``1:17`` (prio 0..7, rate = floor,
    ceil = link), each with a pfifo; one u32 filter per priority matching the
    DSCP bits of the TOS byte (mask 0xfc ignores the ECN bits), preceded by
    the filter that sends pure ACKs to the control leaf ``1:20`` (omitted
    when ``ack_fraction`` is 0).

    ``nic_classes`` (one ``(address, rate Mbit/s)`` per NIC) adds, for NIC *k*,
    a class ``1:(k+1)00`` under ``1:1`` with rate = ceil = the NIC's rate and
    the same eight leaves and control leaf below it (``1:(k+1)10`` ...
    ``1:(k+1)17``, ``1:(k+1)20``), reached by filters that match the NIC's
    address (source or destination, ``nic_match``) as well as the DSCP, and
    that are tried before the plain DSCP filters. One interface then carries
    several NICs, each at its own rate and with its own eight classes; traffic
    from or to any other address uses the plain leaves at the link rate.

    >>> sub = htb_tree_commands("h0-eth0", 800, nic_classes=[("10.1.0.1", 400), ("10.2.0.1", 400)])
    >>> sum(c.startswith("class add") for c in sub), sum(c.startswith("filter add") for c in sub)
    (30, 27)
    >>> [c for c in sub if "flowid 1:110" in c][0]
    'filter add dev h0-eth0 parent 1: protocol ip prio 2 u32 match ip src 10.1.0.1/32 match ip tos 0xe0 0xfc flowid 1:110'

    >>> cmds = htb_tree_commands("s0-eth1", 400)
    >>> sum(c.startswith("class add") for c in cmds), sum(c.startswith("filter add") for c in cmds)
    (10, 9)
    >>> [c for c in cmds if "tos 0xe0" in c][0]
    'filter add dev s0-eth1 parent 1: protocol ip prio 2 u32 match ip tos 0xe0 0xfc flowid 1:10'
    """
    spec = HtbSpec(dev, rate_mbit, floor_fraction=floor_fraction, queue_packets=queue_packets, ack_fraction=ack_fraction,
                   nic_classes=tuple((str(a), float(r)) for a, r in nic_classes), nic_match=nic_match)
    rate, floor, burst = spec.rate_kbit, spec.floor_kbit, spec.burst_bytes
    default_minor = LEAF_MINOR_BASE + DEFAULT_PRIORITY
    shift = _nic_prefs(spec)  # the NIC subtrees' filters come first
    lines = [
        f"qdisc replace dev {dev} root handle {ROOT_HANDLE}: htb default {default_minor:x} r2q 10",
        f"class add dev {dev} parent {ROOT_HANDLE}: classid {ROOT_HANDLE}:{PARENT_MINOR:x} htb rate {rate}kbit ceil {rate}kbit "
        f"burst {burst} cburst {burst} quantum {spec.mtu}",
    ]
    for p in range(NUM_PRIORITIES):
        minor = LEAF_MINOR_BASE + p
        lines.append(
            f"class add dev {dev} parent {ROOT_HANDLE}:{PARENT_MINOR:x} classid {ROOT_HANDLE}:{minor:x} htb rate {floor}kbit "
            f"ceil {rate}kbit burst {burst} cburst {burst} prio {p} quantum {spec.mtu}"
        )
        lines.append(f"qdisc add dev {dev} parent {ROOT_HANDLE}:{minor:x} handle {minor:x}: pfifo limit {queue_packets}")
    filters = []
    if spec.ack_fraction > 0:
        lines.append(
            f"class add dev {dev} parent {ROOT_HANDLE}:{PARENT_MINOR:x} classid {ACK_CLASSID} htb rate {spec.ack_kbit}kbit "
            f"ceil {rate}kbit burst {burst} cburst {burst} prio 0 quantum {spec.mtu}"
        )
        lines.append(f"qdisc add dev {dev} parent {ACK_CLASSID} handle {ACK_MINOR:x}: pfifo limit {queue_packets}")
        filters.append(f"filter add dev {dev} parent {ROOT_HANDLE}: protocol ip prio {1 + shift} u32 match ip protocol 6 0xff "
                       f"match u16 0x0000 0xff80 at 2 flowid {ACK_CLASSID}")
    for p in range(NUM_PRIORITIES):
        filters.append(
            f"filter add dev {dev} parent {ROOT_HANDLE}: protocol ip prio {p + 2 + shift} u32 match ip tos {tos_for_priority(p):#04x} 0xfc "
            f"flowid {leaf_classid(p)}"
        )
    return lines + _nic_subtree_commands(spec) + filters


def _nic_prefs(spec: HtbSpec) -> int:
    """Filter preferences taken by the NIC subtrees' filters (they are tried first); the plain filters follow."""
    return len(spec.nic_classes) * (NUM_PRIORITIES + 1)


def _nic_subtree_commands(spec: HtbSpec) -> list[str]:
    """The ``class``/``qdisc``/``filter`` lines of ``spec``'s NIC subtrees (see :func:`htb_tree_commands`)."""
    dev, lines = spec.dev, []
    for k, (addr, nic_mbit) in enumerate(spec.nic_classes):
        nic = HtbSpec(dev, nic_mbit, spec.floor_fraction, spec.queue_packets, spec.mtu, spec.ack_fraction)
        rate, floor, burst = nic.rate_kbit, nic.floor_kbit, nic.burst_bytes
        top = nic_classid(k)
        lines.append(f"class add dev {dev} parent {ROOT_HANDLE}:{PARENT_MINOR:x} classid {top} htb rate {rate}kbit ceil {rate}kbit "
                     f"burst {burst} cburst {burst} quantum {spec.mtu}")
        for p in range(NUM_PRIORITIES):
            cid = nic_classid(k, p)
            lines.append(f"class add dev {dev} parent {top} classid {cid} htb rate {floor}kbit ceil {rate}kbit burst {burst} "
                         f"cburst {burst} prio {p} quantum {spec.mtu}")
            lines.append(f"qdisc add dev {dev} parent {cid} handle {cid.split(':')[1]}: pfifo limit {spec.queue_packets}")
        base = 1 + k * (NUM_PRIORITIES + 1)
        match = f"match ip {spec.nic_match} {addr}/32"
        if spec.ack_fraction > 0:
            ack = nic_ack_classid(k)
            lines.append(f"class add dev {dev} parent {top} classid {ack} htb rate {nic.ack_kbit}kbit ceil {rate}kbit burst {burst} "
                         f"cburst {burst} prio 0 quantum {spec.mtu}")
            lines.append(f"qdisc add dev {dev} parent {ack} handle {ack.split(':')[1]}: pfifo limit {spec.queue_packets}")
            lines.append(f"filter add dev {dev} parent {ROOT_HANDLE}: protocol ip prio {base} u32 {match} match ip protocol 6 0xff "
                         f"match u16 0x0000 0xff80 at 2 flowid {ack}")
        for p in range(NUM_PRIORITIES):
            lines.append(f"filter add dev {dev} parent {ROOT_HANDLE}: protocol ip prio {base + 1 + p} u32 {match} "
                         f"match ip tos {tos_for_priority(p):#04x} 0xfc flowid {nic_classid(k, p)}")
    return lines


#: u32 keys of the pure-ACK filter as ``tc filter show`` prints them: (value, mask, offset).
ACK_MATCHES = ((0x00060000, 0x00FF0000, 8), (0x00000000, 0x0000FF80, 0))


def htb_teardown_command(dev: str) -> str:
    """The batch line that removes the tree (the interface falls back to its default qdisc)."""
    return f"qdisc del dev {dev} root"


# -- parsing tc output -----------------------------------------------------------------------------------

_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12, "bps": 8.0, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}


def parse_rate(text: str) -> float:
    """A tc rate such as ``400Mbit``, ``3999Kbit`` or ``12bit`` in bit/s.

    >>> parse_rate("400Mbit"), parse_rate("3999Kbit"), parse_rate("1Gbit")
    (400000000.0, 3999000.0, 1000000000.0)
    """
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]+)", text.strip())
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a tc rate: {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2).lower()]


@dataclass
class TcClass:
    classid: str
    parent: str | None
    leaf_qdisc: str | None
    prio: int | None
    rate_bps: float
    ceil_bps: float
    sent_bytes: int = 0
    sent_packets: int = 0
    dropped: int = 0


@dataclass
class TcQdisc:
    kind: str
    handle: str
    parent: str | None  # None for the root
    options: dict[str, str] = field(default_factory=dict)


@dataclass
class TcFilter:
    pref: int
    flowid: str
    matches: list[tuple[int, int, int]]  # (value, mask, offset)


def parse_tc_classes(text: str) -> dict[str, TcClass]:
    """Parse ``tc -s class show dev X`` (htb classes) into ``{classid: TcClass}``."""
    out: dict[str, TcClass] = {}
    current: TcClass | None = None
    for line in text.splitlines():
        m = re.match(r"class htb (\S+) (root|parent (\S+))(.*)", line.strip())
        if m:
            rest = m.group(4)
            leaf = re.search(r"leaf (\S+)", rest)
            prio = re.search(r"\bprio (\d+)", rest)
            rate = re.search(r"\brate (\S+)", rest)
            ceil = re.search(r"\bceil (\S+)", rest)
            current = TcClass(
                classid=m.group(1), parent=m.group(3), leaf_qdisc=leaf.group(1) if leaf else None,
                prio=int(prio.group(1)) if prio else None,
                rate_bps=parse_rate(rate.group(1)) if rate else 0.0, ceil_bps=parse_rate(ceil.group(1)) if ceil else 0.0,
            )
            out[current.classid] = current
            continue
        m = re.match(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+)", line.strip())
        if m and current is not None:
            current.sent_bytes, current.sent_packets, current.dropped = (int(g) for g in m.groups())
    return out


def parse_tc_qdiscs(text: str) -> list[TcQdisc]:
    """Parse ``tc qdisc show dev X`` into a list of qdiscs."""
    out = []
    for line in text.splitlines():
        m = re.match(r"qdisc (\S+) (\S+) (root|parent (\S+))\s*(.*)", line.strip())
        if not m:
            continue
        words = m.group(5).split()
        options = {words[i]: words[i + 1] for i in range(0, len(words) - 1, 2)}
        out.append(TcQdisc(kind=m.group(1), handle=m.group(2), parent=m.group(4), options=options))
    return out


def parse_tc_filters(text: str) -> list[TcFilter]:
    """Parse ``tc filter show dev X`` (u32): one entry per key node with its flowid and matches."""
    out: list[TcFilter] = []
    current: TcFilter | None = None
    for line in text.splitlines():
        s = line.strip()
        m = re.match(r"filter parent \S+ protocol \S+ pref (\d+) u32 .*\bfh (\S+).*?flowid (\S+)", s)
        if m:
            current = TcFilter(pref=int(m.group(1)), flowid=m.group(3), matches=[])
            out.append(current)
            continue
        m = re.match(r"match ([0-9a-fA-F]{8})/([0-9a-fA-F]{8}) at (\d+)", s)
        if m and current is not None:
            current.matches.append((int(m.group(1), 16), int(m.group(2), 16), int(m.group(3))))
    return out


def check_htb_tree(spec: HtbSpec, qdisc_text: str, class_text: str, filter_text: str, *, rate_tolerance: float = 0.02) -> list[str]:
    """Compare an interface's live tc state with the tree :func:`htb_tree_commands` installs.

    Returns a list of problems (empty when the tree is intact): a missing or
    different root qdisc or default, a missing class, a wrong prio, rate or
    ceil, a leaf without its pfifo, or a DSCP filter that is missing or points
    elsewhere.
    """
    dev = spec.dev
    problems: list[str] = []
    qdiscs = parse_tc_qdiscs(qdisc_text)
    root = [q for q in qdiscs if q.parent is None]
    default_minor = LEAF_MINOR_BASE + DEFAULT_PRIORITY
    if not root or root[0].kind != "htb" or root[0].handle != f"{ROOT_HANDLE}:":
        problems.append(f"{dev}: root qdisc is {[(q.kind, q.handle) for q in root]}, expected htb {ROOT_HANDLE}:")
    elif int(root[0].options.get("default", "-1"), 16) != default_minor:
        problems.append(f"{dev}: htb default is {root[0].options.get('default')}, expected {default_minor:x}")
    pfifo_parents = {q.parent for q in qdiscs if q.kind == "pfifo"}
    classes = parse_tc_classes(class_text)

    def close(a: float, b: float) -> bool:
        return abs(a - b) <= rate_tolerance * max(b, 1.0)

    rate_bps, floor_bps = spec.rate_kbit * 1e3, spec.floor_kbit * 1e3
    parent = classes.get(f"{ROOT_HANDLE}:{PARENT_MINOR:x}")
    if parent is None:
        problems.append(f"{dev}: class {ROOT_HANDLE}:{PARENT_MINOR:x} missing")
    elif not (close(parent.rate_bps, rate_bps) and close(parent.ceil_bps, rate_bps)):
        problems.append(f"{dev}: class {parent.classid} rate/ceil {parent.rate_bps:.0f}/{parent.ceil_bps:.0f} bit/s, expected {rate_bps:.0f}")
    for p in range(NUM_PRIORITIES):
        cid = leaf_classid(p)
        c = classes.get(cid)
        if c is None:
            problems.append(f"{dev}: leaf class {cid} (priority {p}) missing")
            continue
        if c.prio != p:
            problems.append(f"{dev}: class {cid} has prio {c.prio}, expected {p}")
        if not close(c.ceil_bps, rate_bps):
            problems.append(f"{dev}: class {cid} ceil {c.ceil_bps:.0f} bit/s, expected {rate_bps:.0f}")
        if not close(c.rate_bps, floor_bps):
            problems.append(f"{dev}: class {cid} rate {c.rate_bps:.0f} bit/s, expected {floor_bps:.0f}")
        if c.parent != f"{ROOT_HANDLE}:{PARENT_MINOR:x}":
            problems.append(f"{dev}: class {cid} hangs under {c.parent}, expected {ROOT_HANDLE}:{PARENT_MINOR:x}")
        if cid not in pfifo_parents:
            problems.append(f"{dev}: class {cid} has no pfifo leaf qdisc")
    filters = parse_tc_filters(filter_text)
    for p in range(NUM_PRIORITIES):
        want = (tos_for_priority(p) << 16, 0x00FC0000, 0)
        if not any(f.flowid == leaf_classid(p) and want in f.matches for f in filters):
            problems.append(f"{dev}: no u32 filter sending TOS {tos_for_priority(p):#04x} (priority {p}) to {leaf_classid(p)}")
    if spec.ack_fraction > 0:
        c = classes.get(ACK_CLASSID)
        if c is None or c.prio != 0 or not close(c.rate_bps, spec.ack_kbit * 1e3) or ACK_CLASSID not in pfifo_parents:
            problems.append(f"{dev}: control leaf {ACK_CLASSID} missing or wrong (expected prio 0, rate {spec.ack_kbit} kbit, a pfifo)")
        if not any(f.flowid == ACK_CLASSID and all(m in f.matches for m in ACK_MATCHES) for f in filters):
            problems.append(f"{dev}: no u32 filter sending pure TCP ACKs to {ACK_CLASSID}")
    for k, (addr, nic_mbit) in enumerate(spec.nic_classes):
        nic = HtbSpec(dev, nic_mbit, spec.floor_fraction, spec.queue_packets, spec.mtu, spec.ack_fraction)
        nic_bps, nic_floor = nic.rate_kbit * 1e3, nic.floor_kbit * 1e3
        top = classes.get(nic_classid(k))
        if top is None or top.parent != f"{ROOT_HANDLE}:{PARENT_MINOR:x}" or not (close(top.rate_bps, nic_bps) and close(top.ceil_bps, nic_bps)):
            problems.append(f"{dev}: NIC class {nic_classid(k)} ({addr}) missing or wrong (expected rate = ceil = {nic_bps:.0f} bit/s "
                            f"under {ROOT_HANDLE}:{PARENT_MINOR:x})")
            continue
        addr_key = _address_key(addr, spec.nic_match)
        for p in range(NUM_PRIORITIES):
            cid = nic_classid(k, p)
            c = classes.get(cid)
            if c is None or c.parent != nic_classid(k) or c.prio != p or not close(c.ceil_bps, nic_bps) or not close(c.rate_bps, nic_floor) \
                    or cid not in pfifo_parents:
                problems.append(f"{dev}: NIC leaf {cid} ({addr}, priority {p}) missing or wrong (expected prio {p}, rate {nic_floor:.0f}, "
                                f"ceil {nic_bps:.0f} bit/s, a pfifo, under {nic_classid(k)})")
            want = (tos_for_priority(p) << 16, 0x00FC0000, 0)
            if not any(f.flowid == cid and want in f.matches and addr_key in f.matches for f in filters):
                problems.append(f"{dev}: no u32 filter sending {spec.nic_match} {addr} with TOS {tos_for_priority(p):#04x} to {cid}")
        if spec.ack_fraction > 0:
            ack = nic_ack_classid(k)
            c = classes.get(ack)
            if c is None or c.parent != nic_classid(k) or c.prio != 0 or ack not in pfifo_parents:
                problems.append(f"{dev}: NIC control leaf {ack} ({addr}) missing or wrong")
            if not any(f.flowid == ack and addr_key in f.matches and all(m in f.matches for m in ACK_MATCHES) for f in filters):
                problems.append(f"{dev}: no u32 filter sending pure TCP ACKs of {addr} to {ack}")
    return problems


def _address_key(addr: str, which: str) -> tuple[int, int, int]:
    """The u32 key ``(value, mask, offset)`` of ``match ip src|dst ADDR/32`` as ``tc filter show`` prints it."""
    value = int.from_bytes(bytes(int(x) for x in addr.split(".")), "big")
    return (value, 0xFFFFFFFF, 12 if which == "src" else 16)


def class_counters(class_text: str) -> dict[int, dict[str, Any]]:
    """Per-priority sent bytes/packets/drops from ``tc -s class show`` of one interface."""
    classes = parse_tc_classes(class_text)
    out: dict[int, dict[str, Any]] = {}
    for cid, c in classes.items():  # the plain leaves and those of NIC subtrees (1:13 and 1:213 both serve priority 3)
        p = _leaf_priority(cid)
        if p is None:
            continue
        row = out.setdefault(p, {"sent_bytes": 0, "sent_packets": 0, "dropped": 0})
        row["sent_bytes"] += c.sent_bytes
        row["sent_packets"] += c.sent_packets
        row["dropped"] += c.dropped
    return dict(sorted(out.items()))


# -- a batch's expected state, compared with what the kernel holds ------------------------------------------


@dataclass
class TreeState:
    """The state a tc batch of this module's grammar leaves on one device (or that the kernel reports).

    ``root``: (kind, handle, default minor) of the root qdisc; ``classes``:
    ``{classid: (parent, prio, rate bit/s, ceil bit/s)}`` (parent None under
    the root qdisc); ``leaves``: ``{parent classid: (kind, handle, limit)}``;
    ``filters``: ``{(pref, flowid): sorted u32 keys (value, mask, offset)}``.
    """

    root: tuple[str, str, int | None] | None = None
    classes: dict[str, tuple[str | None, int | None, float, float]] = field(default_factory=dict)
    leaves: dict[str, tuple[str, str, int | None]] = field(default_factory=dict)
    filters: dict[tuple[int, str], list[tuple[int, int, int]]] = field(default_factory=dict)


def _u32_keys(match: str) -> list[tuple[int, int, int]]:
    """u32 keys (32-bit aligned value, mask, offset) of the ``match ...`` clauses of a filter line, as the kernel stores them."""
    keys = []
    for m in re.finditer(r"match ip (src|dst) (\d+\.\d+\.\d+\.\d+)/(\d+)", match):
        bits = int(m.group(3))
        mask = (0xFFFFFFFF << (32 - bits)) & 0xFFFFFFFF
        keys.append((int.from_bytes(bytes(int(x) for x in m.group(2).split(".")), "big") & mask, mask, 12 if m.group(1) == "src" else 16))
    for m in re.finditer(r"match (ip (tos|protocol) (\S+) (\S+)|u(8|16|32) (\S+) (\S+) at (\d+))", match):
        if m.group(2):
            value, mask = int(m.group(3), 0), int(m.group(4), 0)
            width, at = 8, 1 if m.group(2) == "tos" else 9  # byte offsets in the IPv4 header
        else:
            width, value, mask, at = int(m.group(5)), int(m.group(6), 0), int(m.group(7), 0), int(m.group(8))
        word = at // 4 * 4
        shift = 32 - width - 8 * (at - word)
        keys.append(((value & mask) << shift, mask << shift, word))
    return sorted(keys)


def batch_state(lines: Sequence[str]) -> TreeState:
    """What ``lines`` (a batch from :func:`htb_tree_commands` plus ``class change`` / extra ``filter add`` lines) install.

    >>> st = batch_state(htb_tree_commands("d", 100))
    >>> st.root, st.classes["1:10"], st.leaves["1:17"], st.filters[(1, "1:20")]
    (('htb', '1:', 23), ('1:1', 0, 1000000.0, 100000000.0), ('pfifo', '17:', 200), [(0, 65408, 0), (393216, 16711680, 8)])
    >>> st.classes["1:1"][0] is None  # the parent class hangs under the root qdisc
    True
    """
    st = TreeState()
    for line in lines:
        w = line.split()
        opts = {w[i]: w[i + 1] for i in range(len(w) - 1)}
        if w[:1] == ["qdisc"] and "root" in w:
            default = opts.get("default")
            st.root = (w[w.index("root") + 3] if "handle" in w else w[w.index("root") + 1], opts.get("handle", ""),
                       int(default, 16) if default else None)
        elif w[:1] == ["qdisc"]:
            kind = w[w.index("handle") + 2]
            st.leaves[opts["parent"]] = (kind, opts["handle"], int(opts["limit"]) if "limit" in opts else None)
        elif w[:1] == ["class"]:
            parent = None if opts["parent"].endswith(":") else opts["parent"]
            st.classes[opts["classid"]] = (parent, int(opts["prio"]) if "prio" in opts else None, parse_rate(opts["rate"]),
                                           parse_rate(opts.get("ceil", opts["rate"])))
        elif w[:1] == ["filter"]:
            st.filters[(int(opts["prio"]), opts["flowid"])] = _u32_keys(line)
    return st


def _json_with_repeats(text: str) -> Any:
    """``json.loads`` that keeps repeated keys as a list (iproute2 prints one ``"match"`` key per u32 key)."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in items:
            out.setdefault(k, []).append(v)
        return {k: v if len(v) > 1 or k == "match" else v[0] for k, v in out.items()}

    return json.loads(text or "[]", object_pairs_hook=pairs)


def kernel_state(qdisc_json: str, class_text: str, filter_json: str) -> TreeState:
    """A device's state from ``tc -j qdisc show``, ``tc class show`` and ``tc -j filter show``.

    Classes are read from text: iproute2 6.1 prints no JSON for htb classes
    (``tc -j class show`` falls back to text); qdiscs and filters are JSON.
    """
    st = TreeState()
    for q in _json_with_repeats(qdisc_json):
        options = q.get("options", {})
        if q.get("root"):
            default = options.get("default")
            st.root = (q["kind"], q["handle"], int(str(default), 16) if default is not None else None)
        elif "parent" in q:
            st.leaves[q["parent"]] = (q["kind"], q["handle"], options.get("limit"))
    for cid, c in parse_tc_classes(class_text).items():
        st.classes[cid] = (c.parent, c.prio, c.rate_bps, c.ceil_bps)
    for f in _json_with_repeats(filter_json):
        options = f.get("options", {})
        if f.get("kind") != "u32" or "flowid" not in options:
            continue
        keys = sorted((int(m["value"], 16), int(m["mask"], 16), int(m["off"])) for m in options.get("match", []))
        st.filters[(int(f["pref"]), options["flowid"])] = keys
    return st


def compare_states(want: TreeState, have: TreeState, *, dev: str = "", rate_tolerance: float = 0.01) -> list[str]:
    """Differences between the state a batch asked for and the kernel's (empty: the kernel holds exactly that tree).

    Rates compare within ``rate_tolerance`` (tc prints them rounded); extra
    classes, leaf qdiscs or filters are differences too.

    >>> want = batch_state(htb_tree_commands("d", 100))
    >>> compare_states(want, want)
    []
    >>> have = batch_state(htb_tree_commands("d", 100)[:-1])  # the kernel lost the last DSCP filter
    >>> compare_states(want, have, dev="d")
    ['d: filter pref 9 -> 1:17 missing']
    """
    tag = f"{dev}: " if dev else ""
    problems = []
    if want.root != have.root:
        problems.append(f"{tag}root qdisc is {have.root}, expected {want.root}")

    def close(a: float, b: float) -> bool:
        return abs(a - b) <= rate_tolerance * max(abs(b), 1.0)

    for cid in sorted(set(want.classes) | set(have.classes)):
        w, h = want.classes.get(cid), have.classes.get(cid)
        if w is None or h is None:
            problems.append(f"{tag}class {cid} {'missing' if h is None else 'not asked for'}")
        elif w[:2] != h[:2] or not (close(h[2], w[2]) and close(h[3], w[3])):
            problems.append(f"{tag}class {cid} is parent/prio/rate/ceil {h[0]}/{h[1]}/{h[2]:.0f}/{h[3]:.0f}, "
                            f"expected {w[0]}/{w[1]}/{w[2]:.0f}/{w[3]:.0f}")
    for parent in sorted(set(want.leaves) | set(have.leaves)):
        if want.leaves.get(parent) != have.leaves.get(parent):
            problems.append(f"{tag}qdisc under {parent} is {have.leaves.get(parent)}, expected {want.leaves.get(parent)}")
    for key in sorted(set(want.filters) | set(have.filters)):
        w_keys, h_keys = want.filters.get(key), have.filters.get(key)
        if h_keys is None:
            problems.append(f"{tag}filter pref {key[0]} -> {key[1]} missing")
        elif w_keys is None:
            problems.append(f"{tag}filter pref {key[0]} -> {key[1]} not asked for")
        elif w_keys != h_keys:
            problems.append(f"{tag}filter pref {key[0]} -> {key[1]} matches {h_keys}, expected {w_keys}")
    return problems
