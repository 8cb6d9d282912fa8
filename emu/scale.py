"""Choosing the Mininet emulation's byte scale from a short CPU calibration, and saying up front how long a run takes.

An emulated run is slowed down by the *time scale* K: it takes ``makespan * K``
wall-clock seconds. Inside that budget the *byte scale* M trades packets for
CPU: every flow carries ``nbytes / M`` bytes over links of ``rate / (K * M)``,
so every transfer still takes K times its real-fabric time while the kernel
moves M times fewer packets per second (in :func:`emu.mininet_backend.run_mininet`'s
terms: ``time_scale = K * M`` for the link rates, ``byte_scale = M``). A larger
M costs fidelity (each flow is M times fewer packets, so TCP slow start and
per-flow overheads weigh more), so the right M is the **smallest at which the
CPU is not the bottleneck**.

How ``--byte-scale auto`` finds it:

1. the simulator's result gives the workload's peak payload rate across the
   emulated network (:func:`peak_network_rate`: the largest sum of the rates of
   flows between servers in flight at one time);
2. :func:`measure_cpu_cost` builds the workload's emulated network (the same
   hosts, interfaces and HTB trees) at the smallest M that fits Mininet's link
   range, lets the traffic agents idle for a second, then drives every
   interface at its full rate for a couple of seconds (a ring per switch,
   through the same agents the workload uses) and measures the rate the switch
   ports received and the CPU the emulation itself used: the agents' CPU time
   plus the kernel's softirq time above its idle rate (``/proc``), as a fraction
   of all CPUs. Their ratio is the CPU cost of one Mbit/s of emulated traffic;
3. :func:`choose_byte_scale` takes the smallest M of the 1-2-5 ladder inside
   Mininet's link range at which ``cost * peak wire rate / M`` stays under a
   target (70 % of all CPUs by default, below the 95 % the fidelity check
   allows: headroom for per-flow overheads the model leaves out).

The model is linear in the packet rate: per-packet kernel work (veth, bridge,
HTB, TCP) dominates, and the number of flows started per second does not
depend on M (durations stay K times the real ones). It counts the emulation's
own CPU, not the whole machine's: the emulation runs at raised priority
(``EMULATION_NICE``) and takes the CPU it needs from other work, so other
work does not change the right M. It does decide the whole-machine CPU check
of the fidelity report; the choice says so when the machine's idle load
leaves less than the target.

>>> cal = CpuCalibration(own_busy=0.9, wire_mbit=3000.0, offered_mbit=12_800.0, idle_busy=0.1, busy=1.0, seconds=2.0, link_scale=1000.0, setup_s=4.0)
>>> choice = choose_byte_scale(1600.0, time_scale=1000, calibration=cal, bounds=(420.0, 4e5))   # 32 NICs of 50 GB/s at once
>>> choice.byte_scale, round(choice.predicted_busy, 3)
(10.0, 0.402)
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from topology import Topology
from topology.errors import InputError

#: Peak CPU busy fraction (all CPUs) the chosen byte scale aims for; the fidelity check fails runs above 95 % on average.
DEFAULT_CPU_TARGET = 0.70
#: The fidelity check's limit on the whole CPU's mean busy fraction (emu.mininet_backend.DEFAULT_CPU_LIMIT).
DEFAULT_CPU_LIMIT = 0.95
#: Ethernet frame bytes per TCP payload byte at MTU 1500 with timestamps (emu.net.WIRE_OVERHEAD, without importing Mininet code).
_WIRE_OVERHEAD = 1514 / 1448
#: Wall-clock seconds assumed for building and removing the network and starting the agents when nothing was measured.
DEFAULT_SETUP_S = 6.0


def parse_byte_scale(text: str, *, where: str = "--byte-scale") -> float | str:
    """``auto``, or a finite number >= 1; anything else is an :class:`~topology.errors.InputError` naming ``where``.

    >>> parse_byte_scale("auto"), parse_byte_scale("40")
    ('auto', 40.0)
    >>> parse_byte_scale("0.5")
    Traceback (most recent call last):
    ...
    topology.errors.InputError: --byte-scale: expected 'auto' or a number >= 1, got '0.5'
    """
    if str(text).strip().lower() == "auto":
        return "auto"
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 1 <= value <= 1e12):
        raise InputError(f"expected 'auto' or a number >= 1, got {text!r}", where=where)
    return value


def scale_ladder(lo: float, hi: float) -> list[float]:
    """The byte scales tried, smallest first: ``lo`` (at least 1), then the 1-2-5 series up to ``hi``.

    ``lo`` and ``hi`` are the byte scales between which every emulated link
    stays inside Mininet's rate range; ``lo`` itself comes first when it is
    not on the series, so that the smallest scale that fits is a candidate.

    >>> scale_ladder(1, 120)
    [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0]
    >>> scale_ladder(3.2, 30)
    [3.2, 5.0, 10.0, 20.0]
    >>> scale_ladder(4, 3)
    []
    """
    lo = max(1.0, float(lo))
    if not hi >= lo:
        return []
    out = [lo]
    decade = 1.0
    while decade <= hi:
        for step in (1.0, 2.0, 5.0):
            m = step * decade
            if lo < m <= hi * (1 + 1e-12):
                out.append(m)
        decade *= 10.0
    return out


def link_scale_bounds(topo: Topology, hosts: list[str] | None = None, *, nic_mode: str = "per-leaf") -> tuple[float, float]:
    """``(lo, hi)``: the link dilations ``K * M`` at which every emulated link of ``topo`` fits Mininet's rate range.

    Below ``lo`` the fastest link would carry more than ``emu.net.MAX_LINK_MBIT``
    on the wire; above ``hi`` the slowest would carry less than
    ``emu.net.MIN_LINK_MBIT``. Uses :func:`emu.net.plan_network`'s own mapping
    (NIC modes, per-leaf sums) at dilation 1.

    >>> from topology.fabrics import star
    >>> [round(x, 1) for x in link_scale_bounds(star(2))]     # 25 GB/s NICs: 200 Gb/s
    [209.1, 200000.0]
    """
    from .net import MAX_LINK_MBIT, MIN_LINK_MBIT, plan_network

    plan = plan_network(topo, time_scale=1.0, nic_mode=nic_mode, hosts=hosts, max_link_mbit=math.inf, prefix="nwbound")
    overhead = _WIRE_OVERHEAD if plan.payload_rates else 1.0
    rates = [r for i in plan.interfaces for r in (i.rate_mbit, i.rate_down_mbit)]
    return max(rates) * overhead / MAX_LINK_MBIT, min(rates) / MIN_LINK_MBIT


def peak_network_rate(result: Any, topo: Topology) -> float:
    """The workload's peak payload rate across the emulated network, in GB/s, from a result with per-flow records.

    Only flows between GPUs of different servers count (flows inside a server
    are modelled as timers by the emulator: no packets). Each flow counts at its
    mean rate ``nbytes / (end - start)`` while it is in flight; the peak is the
    largest sum over flows in flight at one time.

    >>> from emu.results import FlowRecord, RunResult
    >>> from topology.fabrics import star
    >>> flows = [FlowRecord("a", 0, "p", 0, "n0/gpu0", "n1/gpu0", 2e9, 0.0, 1.0),   # 2 GB/s over [0, 1)
    ...          FlowRecord("a", 0, "p", 0, "n1/gpu0", "n0/gpu0", 1e9, 0.5, 1.5),   # 1 GB/s over [0.5, 1.5)
    ...          FlowRecord("a", 0, "p", 0, "n0/gpu0", "n1/gpu0", 9e9, 2.0, 3.0)]   # 9 GB/s later
    >>> peak_network_rate(RunResult("sim", "w", "t", flows=flows[:2]), star(2)), peak_network_rate(RunResult("sim", "w", "t", flows=flows), star(2))
    (3.0, 9.0)
    """
    import numpy as np

    host_of: dict[str, str | None] = {}

    def host(gpu: str) -> str | None:
        if gpu not in host_of:
            host_of[gpu] = topo.host_of(gpu)
        return host_of[gpu]

    events = [(f.start, f.nbytes / (f.end - f.start) / 1e9, f.end) for f in result.flows
              if f.nbytes > 0 and f.end > f.start and host(f.src) != host(f.dst)]
    if not events:
        return 0.0
    times = np.array([t for s, _, e in events for t in (s, e)])
    deltas = np.array([d for _, r, _ in events for d in (r, -r)])
    order = np.lexsort((deltas, times))  # at equal times the ends (negative) come first: back-to-back flows do not add up
    return float(max(0.0, np.cumsum(deltas[order]).max()))


@dataclass(frozen=True)
class CpuCalibration:
    """What :func:`measure_cpu_cost` measured under a bulk transfer on the emulated network.

    ``own_busy`` is the fraction of all CPUs the emulation used (its agents'
    CPU time and the softirq time above idle), ``wire_mbit`` the rate the
    switch ports received (frames, summed over the sending interfaces),
    ``offered_mbit`` what the interfaces' configured rates would carry, at link
    dilation ``link_scale`` (``K * M``). ``idle_busy`` and ``busy`` are the whole
    machine's busy fractions before and during the transfer. ``setup_s`` is the
    wall-clock time to build the network and start the agents plus the time to
    remove them again.
    """

    own_busy: float
    wire_mbit: float
    offered_mbit: float
    idle_busy: float
    busy: float
    seconds: float
    link_scale: float
    setup_s: float
    cpus: int = 0

    @property
    def busy_per_mbit(self) -> float:
        """The fraction of all CPUs one Mbit/s of emulated traffic (on the wire) costs the emulation."""
        if self.wire_mbit <= 0:
            return math.inf
        return max(self.own_busy, 0.0) / self.wire_mbit

    @property
    def saturated(self) -> bool:
        """Whether the transfer was CPU-bound: it reached less than 90 % of the offered rate."""
        return self.wire_mbit < 0.9 * self.offered_mbit

    def predicted_busy(self, wire_mbit: float) -> float:
        """The fraction of all CPUs the emulation needs for ``wire_mbit`` of traffic (linear model; above 1: overload)."""
        return 0.0 if wire_mbit <= 0 else self.busy_per_mbit * wire_mbit

    def to_dict(self) -> dict[str, Any]:
        cost = self.busy_per_mbit
        return {**asdict(self), "busy_per_mbit": cost if math.isfinite(cost) else None, "saturated": self.saturated}


@dataclass(frozen=True)
class ScaleChoice:
    """The byte scale M a run uses and why: ``link_scale`` is ``K * M``, the dilation of the emulated link rates."""

    byte_scale: float
    time_scale: float
    reason: str
    auto: bool
    peak_gbs: float | None = None
    predicted_busy: float | None = None
    target: float | None = None
    candidates: list[float] = field(default_factory=list)
    calibration: CpuCalibration | None = None

    @property
    def link_scale(self) -> float:
        return self.time_scale * self.byte_scale

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "calibration"}
        d["link_scale"] = self.link_scale
        d["calibration"] = self.calibration.to_dict() if self.calibration is not None else None
        return d


def _wire_mbit(peak_gbs: float, link_scale: float) -> float:
    return peak_gbs * 8e3 * _WIRE_OVERHEAD / link_scale


def choose_byte_scale(peak_gbs: float, *, time_scale: float, calibration: CpuCalibration | None, bounds: tuple[float, float],
                      target: float = DEFAULT_CPU_TARGET) -> ScaleChoice:
    """The smallest byte scale M at which the calibrated CPU model keeps the workload's peak under ``target``.

    ``peak_gbs`` is the workload's peak payload rate across the emulated
    network in real-fabric GB/s (:func:`peak_network_rate`), ``time_scale`` K,
    ``bounds`` the link dilations that fit Mininet (:func:`link_scale_bounds`);
    M is taken from :func:`scale_ladder` over ``bounds / K``. When no M meets
    the target the largest that fits is taken and the reason says the CPU will
    still be the bottleneck. Raises :class:`~topology.errors.InputError` when no
    M >= 1 fits the time scale at all.

    The choice only grows with the cost per Mbit/s and the peak:

    >>> cal = CpuCalibration(0.5, 1000.0, 1000.0, 0.05, 0.55, 2.0, 1000.0, 3.0)    # 0.05 % of the CPU per Mbit/s
    >>> [choose_byte_scale(p, time_scale=1000, calibration=cal, bounds=(300.0, 1e5)).byte_scale for p in (100.0, 200.0, 800.0)]
    [1.0, 2.0, 5.0]
    >>> choose_byte_scale(4.0, time_scale=1000, calibration=None, bounds=(2500.0, 1e5)).reason
    'not calibrated: the smallest byte scale that fits; 2.5 is the smallest byte scale at which every link fits Mininet (<= 1000 Mbit/s)'
    """
    lo, hi = bounds[0] / time_scale, bounds[1] / time_scale
    ladder = scale_ladder(lo, hi)
    if not ladder:
        need = (f"a time scale of at most {bounds[1]:.4g}" if bounds[0] <= bounds[1] else
                f"K x M in {bounds[0]:.4g}..{bounds[1]:.4g}, an empty range: the links differ by more than Mininet's range")
        raise InputError(f"no byte scale >= 1 fits time scale {time_scale:g}: emulated links must carry 1..1000 Mbit/s, which needs {need}",
                         where="--time-scale")
    fits = "" if ladder[0] == 1.0 else f"; {ladder[0]:.4g} is the smallest byte scale at which every link fits Mininet (<= 1000 Mbit/s)"
    if peak_gbs <= 0 or calibration is None:
        why = "no flow crosses the emulated network: nothing to calibrate" if peak_gbs <= 0 else "not calibrated: the smallest byte scale that fits"
        return ScaleChoice(ladder[0], time_scale, why + fits, True, peak_gbs, None, target, ladder, calibration)
    predicted = {m: calibration.predicted_busy(_wire_mbit(peak_gbs, time_scale * m)) for m in ladder}
    cost = (f"the emulation measured {calibration.busy_per_mbit * 100:.3g}% of the CPU per emulated Mbit/s "
            f"({calibration.wire_mbit:.0f} Mbit/s took {calibration.own_busy:.0%})")
    ok = [m for m in ladder if predicted[m] <= target]
    m = ok[0] if ok else ladder[-1]
    peak = _wire_mbit(peak_gbs, time_scale * m)
    if ok:
        why = (f"the smallest byte scale at which the emulation needs at most {target:.0%} of the CPU at the workload's peak "
               f"({peak_gbs:.4g} GB/s, {peak:.0f} Mbit/s emulated): predicted {predicted[m]:.0%}")
        if m > ladder[0]:
            prev = ladder[ladder.index(m) - 1]
            why += f"; at {prev:g} it would be {predicted[prev]:.0%}"
        why += f"; {cost}{fits}"
    else:
        why = (f"no byte scale keeps the emulation under {target:.0%} of the CPU: at {m:g}, the largest that fits Mininet, it needs "
               f"{predicted[m]:.0%} at the workload's peak ({peak:.0f} Mbit/s emulated): the CPU will still be the bottleneck; {cost}")
    if calibration.idle_busy + predicted[m] > DEFAULT_CPU_LIMIT:
        why += (f"; the rest of the machine kept the CPU {calibration.idle_busy:.0%} busy before the calibration, so the fidelity check "
                f"of the whole CPU (<= {DEFAULT_CPU_LIMIT:.0%}) may fail whatever the byte scale")
    return ScaleChoice(m, time_scale, why, True, peak_gbs, predicted[m], target, ladder, calibration)


def given_byte_scale(byte_scale: float, *, time_scale: float, bounds: tuple[float, float], peak_gbs: float | None = None) -> ScaleChoice:
    """The choice for an explicit ``--byte-scale M``, refused (naming both flags) when the links it gives do not fit Mininet.

    >>> given_byte_scale(10, time_scale=1000, bounds=(300.0, 1e5)).link_scale
    10000.0
    >>> given_byte_scale(1, time_scale=100, bounds=(300.0, 1e5))
    Traceback (most recent call last):
    ...
    topology.errors.InputError: --byte-scale: time scale 100 x byte scale 1 = 100 makes the fastest emulated link carry more than 1000 Mbit/s; \
K x M must be 300..1e+05 (e.g. --byte-scale 3, or --byte-scale auto)
    """
    link = time_scale * byte_scale
    if not bounds[0] <= link * (1 + 1e-9) or not link <= bounds[1] * (1 + 1e-9):
        side = "more than 1000" if link < bounds[0] else "less than 1"
        hint = max(1.0, math.ceil(bounds[0] / time_scale)) if link < bounds[0] else None
        eg = f"--byte-scale {hint:g}, or --byte-scale auto" if hint is not None and hint * time_scale <= bounds[1] else "a smaller --time-scale"
        raise InputError(f"time scale {time_scale:g} x byte scale {byte_scale:g} = {link:g} makes the "
                         f"{'fastest' if link < bounds[0] else 'slowest'} emulated link carry {side} Mbit/s; K x M must be "
                         f"{bounds[0]:.4g}..{bounds[1]:.4g} (e.g. {eg})", where="--byte-scale")
    return ScaleChoice(float(byte_scale), time_scale, "given with --byte-scale", False, peak_gbs)


def checks_seconds(*, calibrate_seconds: float = 1.0, probe_dscp: bool = True) -> float:
    """Wall-clock seconds of :func:`~emu.mininet_backend.run_mininet`'s fidelity checks besides the workload (a model).

    Two iperf3 calibration flows (before and after: their whole seconds, one
    omitted second, 0.2 s to start the server) and the DSCP probe (one second to
    open the capture, then one short flow per priority).

    >>> checks_seconds(), checks_seconds(probe_dscp=False)
    (6.4, 4.4)
    """
    return round(2 * (max(1, round(calibrate_seconds)) + 1.2) + (2.0 if probe_dscp else 0.0), 6)


def run_estimate(sim_makespan_s: float, *, time_scale: float, setup_s: float | None = None, checks_s: float | None = None) -> dict[str, Any]:
    """How long an emulated run takes: the simulated makespan times K, plus setup and the fidelity checks.

    ``setup_s`` is the measured time to build and remove the network (from
    :func:`measure_cpu_cost`); without it :data:`DEFAULT_SETUP_S` is assumed
    (``setup_measured`` false).

    >>> e = run_estimate(0.012, time_scale=1000, setup_s=4.0)
    >>> e["traffic_s"], e["total_s"], e["setup_measured"]
    (12.0, 22.4, True)
    """
    traffic = sim_makespan_s * time_scale
    checks = checks_seconds() if checks_s is None else checks_s
    setup = DEFAULT_SETUP_S if setup_s is None else setup_s
    return {"traffic_s": traffic, "setup_s": setup, "checks_s": checks, "total_s": round(traffic + setup + checks, 6),
            "setup_measured": setup_s is not None}


def measure_cpu_cost(topo: Topology, hosts: list[str] | None, *, link_scale: float, nic_mode: str = "per-leaf", seconds: float = 2.0,
                     idle_s: float = 1.0, warmup_s: float = 0.5, prefix: str | None = None) -> CpuCalibration:
    """Measure the CPU cost of emulated traffic on this machine, on the workload's own emulated network (root, Mininet).

    Builds the network of ``topo`` restricted to ``hosts`` (as
    :func:`~emu.mininet_backend.run_mininet` would) with link rates divided by
    ``link_scale``, starts the traffic agents, samples the CPU for ``idle_s``
    seconds with nothing sent, then starts one flow out of every interface to
    the next host on the same switch (a ring per switch, priority 0, the
    agents' TCP path), skips ``warmup_s`` (slow start) and measures the CPU
    busy fraction and the bytes received by the switch ports over ``seconds``.
    The network is removed before returning (flows still in flight are cut).
    """
    from .htb import tos_for_priority
    from .mininet_backend import AgentSet
    from .net import EmulatedNetwork, EmulationError, plan_network

    t_start = time.monotonic()
    plan = plan_network(topo, time_scale=link_scale, nic_mode=nic_mode, hosts=hosts, prefix=prefix)
    pairs = []
    for s in plan.switches:
        ports = [i for i in plan.interfaces if i.switch == s.name]
        if len(ports) > 1:
            pairs += [(a, ports[(k + 1) % len(ports)]) for k, a in enumerate(ports)]
    if not pairs:
        raise InputError("the emulated network has no two hosts on one switch: there is no traffic to calibrate with", where="hosts")
    senders = [tx.switch_dev for tx, _ in pairs]
    with EmulatedNetwork(plan) as net:
        net.set_phase("calibrate")
        lock_wait = net.lock_wait_s
        with AgentSet(net) as agents:
            pids = [p.pid for p in agents.procs.values()]
            t_ready = time.monotonic()
            idle0 = _cpu_ticks(pids)
            time.sleep(idle_s)
            idle1 = _cpu_ticks(pids)
            for fid, (tx, rx) in enumerate(pairs, start=1):
                rate = min(tx.rate_mbit, rx.rate_down_mbit) * 1e6 / 8  # payload bytes/s
                nbytes = int(rate * (warmup_s + seconds) * 3) + 1  # still sending when the window closes
                agents.controller.send(tx.host, {"type": "send", "flow": fid, "nbytes": nbytes, "tos": tos_for_priority(0),
                                                 "src_ip": tx.ip, "dst_ip": rx.ip, "port": agents.port})
            time.sleep(warmup_s)
            load0, rx0, t_a = _cpu_ticks(pids), _rx_bytes(senders), time.monotonic()
            time.sleep(seconds)
            load1, rx1, t_b = _cpu_ticks(pids), _rx_bytes(senders), time.monotonic()
            for msg in agents.controller.poll(0):
                if msg.get("type") == "error":
                    raise EmulationError(f"calibration: agent {msg.get('agent')}: {msg.get('error')}")
    t_end = time.monotonic()
    idle = [b - a for a, b in zip(idle0, idle1, strict=True)]
    load = [b - a for a, b in zip(load0, load1, strict=True)]
    softirq_idle_rate = idle[2] / idle[1] if idle[1] > 0 else 0.0
    own = (load[3] + max(load[2] - softirq_idle_rate * load[1], 0.0)) / load[1] if load[1] > 0 else 1.0
    overhead = _WIRE_OVERHEAD if plan.payload_rates else 1.0
    return CpuCalibration(own_busy=own, wire_mbit=(rx1 - rx0) * 8 / 1e6 / (t_b - t_a),
                          offered_mbit=sum(min(tx.rate_mbit, rx.rate_down_mbit) * overhead for tx, rx in pairs),
                          idle_busy=idle[0] / idle[1] if idle[1] > 0 else 0.0, busy=load[0] / load[1] if load[1] > 0 else 1.0,
                          seconds=t_b - t_a, link_scale=link_scale, setup_s=(t_ready - t_start - lock_wait) + (t_end - t_b), cpus=os.cpu_count() or 0)


def _cpu_ticks(pids: list[int]) -> tuple[int, int, int, int]:
    """Clock ticks so far, over all CPUs: (busy, total, softirq) from ``/proc/stat``, and the user + system time of ``pids``."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    total = sum(fields[:8])
    busy = total - fields[3] - fields[4]
    own = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
        except OSError:  # exited: its time is lost to the measurement, not fatal
            continue
        own += int(stat[11]) + int(stat[12])  # utime, stime (fields 14 and 15 of proc(5))
    return busy, total, fields[6], own


def _rx_bytes(devs: list[str]) -> int:
    """Bytes received so far by these root-namespace interfaces (the switch ends of the veths)."""
    total = 0
    for dev in devs:
        with open(f"/sys/class/net/{dev}/statistics/rx_bytes") as f:
            total += int(f.read())
    return total


__all__ = [
    "DEFAULT_CPU_TARGET",
    "DEFAULT_SETUP_S",
    "CpuCalibration",
    "ScaleChoice",
    "checks_seconds",
    "choose_byte_scale",
    "given_byte_scale",
    "parse_byte_scale",
    "link_scale_bounds",
    "measure_cpu_cost",
    "peak_network_rate",
    "run_estimate",
    "scale_ladder",
]
