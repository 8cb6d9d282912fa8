"""Gradient scheduling inside one data-parallel job: plans and the model that scores them.

A :class:`CommPlan` is data: the ordered list of collective launches (each a
:class:`Transfer` of some layers' gradient bytes) that *every* rank issues in
the same order, plus whether the next forward pass waits for all of them
(``barrier``, as default DDP does before ``optimizer.step()``) or only for the
layers it needs (cross-barrier, as ByteScheduler and Prophet assume).

Plans:

- :func:`ddp_plan` — PyTorch DDP's default: buckets of ``bucket_cap`` bytes
  (first bucket 1 MiB) in gradient-ready order, FIFO, barrier.
- :func:`bytescheduler_plan` — ByteScheduler (SOSP 2019): tensors partitioned
  into ``partition`` bytes, a priority queue by layer (front layers first), at
  most ``credit`` bytes in flight; :func:`tune_bytescheduler` picks partition
  and credit.
- :func:`prophet_plan` — Prophet (ICPP 2021): gradients grouped into blocks
  sized to the compute gap before the next stage of gradients becomes ready
  (budget = bandwidth x gap), highest priority first.

:func:`simulate_iteration` is the model all three are scored with: one link of
``profile.bandwidth`` GB/s (``profile.bytes_per_s``); a launch costs ``profile.overhead`` seconds,
hidden behind the previous transfer when both fit in the credit (pipelined
launches); the next forward's layer *i* starts after layer *i-1*'s forward and
after the last transfer carrying layer *i*'s gradient.

Deviation from the papers: ByteScheduler's priority queue is dynamic at run
time; here we run that policy on the profile to produce a *static* issue order,
because collectives must be issued in the same order on every rank (ByteScheduler
needs Horovod's coordinator for that; a static order needs none).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from topology.errors import InputError

from .gradients import GradientProfile

MiB = 1024 * 1024


@dataclass(frozen=True)
class Transfer:
    """One collective launch: ``parts`` are ``(layer, bytes)`` pieces fused into one buffer."""

    parts: tuple[tuple[int, float], ...]

    @property
    def nbytes(self) -> float:
        return float(sum(b for _, b in self.parts))

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted({layer for layer, _ in self.parts}))


@dataclass
class CommPlan:
    """An in-job communication plan: the issue order of collectives, the credit, and the barrier."""

    policy: str
    transfers: list[Transfer]
    credit: float = 0.0  # bytes allowed in flight; 0 = one transfer at a time
    barrier: bool = False
    params: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "policy": self.policy,
            "credit": self.credit,
            "barrier": self.barrier,
            "params": self.params,
            "transfers": [[list(p) for p in t.parts] for t in self.transfers],
        }

    @classmethod
    def from_dict(cls, data: dict) -> CommPlan:
        return cls(data["policy"], [Transfer(tuple((int(a), float(b)) for a, b in t)) for t in data["transfers"]],
                   data.get("credit", 0.0), data.get("barrier", False), data.get("params", {}))

    def check_covers(self, profile: GradientProfile) -> None:
        """Raise unless the plan sends every layer's gradient exactly once."""
        sent = [0.0] * profile.layers
        for t in self.transfers:
            for layer, b in t.parts:
                sent[layer] += b
        for i, (s, want) in enumerate(zip(sent, profile.nbytes, strict=True)):
            if not math.isclose(s, want, rel_tol=1e-9, abs_tol=1e-6):
                raise InputError(f"plan {self.policy!r} sends {s} bytes of layer {i} ({profile.names[i]}), expected {want}")


@dataclass
class IterationTiming:
    iteration_time: float
    comm_end: float
    forward_end: float
    starts: list[float]
    ends: list[float]
    layer_done: list[float]

    @property
    def exposed_comm(self) -> float:
        return self.iteration_time


class _Link:
    """The link model shared by the simulator and the ByteScheduler replay.

    Transmissions are serialised at ``bandwidth``; a launch costs ``overhead``
    and may overlap the transfers already on the wire as long as the bytes in
    flight (launched, not finished) stay within ``credit`` (one transfer is
    always allowed).
    """

    def __init__(self, bandwidth: float, overhead: float, credit: float):
        self.bandwidth, self.overhead, self.credit = bandwidth, overhead, credit
        self.in_flight: list[tuple[float, float]] = []  # (end, bytes)
        self.link_free = 0.0

    def earliest_launch(self, nbytes: float, t: float) -> float:
        """The first time >= t when ``nbytes`` may be launched under the credit."""
        pending = sorted(e for e in self.in_flight if e[0] > t)
        while pending and sum(b for _, b in pending) + nbytes > self.credit:
            t = pending.pop(0)[0]
        return t

    def launch(self, nbytes: float, t: float) -> tuple[float, float]:
        self.in_flight = [e for e in self.in_flight if e[0] > t]
        start = max(t + self.overhead, self.link_free)
        end = start + nbytes / self.bandwidth
        self.link_free = end
        self.in_flight.append((end, nbytes))
        return start, end


def simulate_iteration(profile: GradientProfile, plan: CommPlan) -> IterationTiming:
    """Time of one steady-state iteration under ``plan`` (backward starts at 0).

    The iteration period is the end of the next forward pass measured from the
    start of this backward pass: backward, then whatever communication is not
    hidden, then forward.

    >>> from flowsched.gradients import analytic_gradient_profile
    >>> p = analytic_gradient_profile(["a", "b"], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0], bandwidth=1e-9)   # GB/s: 1 byte/s
    >>> simulate_iteration(p, ddp_plan(p, bucket_cap=10)).iteration_time  # 2 backward + 2 comm + 2 forward
    6.0
    """
    plan.check_covers(profile)
    link = _Link(profile.bytes_per_s, profile.overhead, plan.credit)
    starts, ends = [], []
    layer_done = [0.0] * profile.layers
    last_launch = 0.0
    for t in plan.transfers:
        ready = max(profile.ready[layer] for layer, _ in t.parts)
        launch = link.earliest_launch(t.nbytes, max(ready, last_launch))
        start, end = link.launch(t.nbytes, launch)
        starts.append(start)
        ends.append(end)
        for layer in t.layers:
            layer_done[layer] = max(layer_done[layer], end)
        last_launch = launch
    comm_end = max(ends, default=0.0)
    clock = max(profile.backward, comm_end) if plan.barrier else profile.backward
    for i in range(profile.layers):
        clock = max(clock, layer_done[i]) + profile.forward[i]
    return IterationTiming(clock, comm_end, clock, starts, ends, layer_done)


def _ready_order(profile: GradientProfile) -> list[int]:
    """Layers in the order their gradients become ready (ties: later layer first, as in backward)."""
    return sorted(range(profile.layers), key=lambda i: (profile.ready[i], -i))


def ddp_plan(profile: GradientProfile, *, bucket_cap: float = 25 * MiB, first_bucket: float = 1 * MiB) -> CommPlan:
    """Default DDP: buckets in gradient-ready order, capped at ``bucket_cap`` (the first at ``first_bucket``),
    launched FIFO, and ``optimizer.step()`` waits for all of them (barrier).

    >>> from flowsched.gradients import analytic_gradient_profile
    >>> p = analytic_gradient_profile(list("abc"), [3, 3, 3], [1, 1, 1], [1, 1, 1], bandwidth=1e-9)
    >>> [t.layers for t in ddp_plan(p, bucket_cap=6, first_bucket=6).transfers]
    [(1, 2), (0,)]
    """
    transfers, current, size, cap = [], [], 0.0, min(first_bucket, bucket_cap)
    for layer in _ready_order(profile):
        b = profile.nbytes[layer]
        if current and size + b > cap:
            transfers.append(Transfer(tuple(current)))
            current, size, cap = [], 0.0, bucket_cap
        current.append((layer, b))
        size += b
    if current:
        transfers.append(Transfer(tuple(current)))
    return CommPlan("ddp", transfers, credit=0.0, barrier=True, params={"bucket_cap": bucket_cap, "first_bucket": first_bucket})


def _partitions(profile: GradientProfile, partition: float) -> list[list[tuple[int, float]]]:
    out = []
    for layer, b in enumerate(profile.nbytes):
        pieces = max(1, math.ceil(b / partition)) if b > 0 else 1
        out.append([(layer, b / pieces)] * pieces)
    return out


def bytescheduler_plan(profile: GradientProfile, *, partition: float = 4 * MiB, credit: float = 16 * MiB) -> CommPlan:
    """ByteScheduler: partitions of at most ``partition`` bytes, most urgent (lowest layer) first,
    at most ``credit`` bytes in flight. The run-time priority queue is replayed on the profile to get
    a static issue order (see the module docstring).
    """
    if partition <= 0 or credit < 0:
        raise InputError("partition must be positive and credit non-negative")
    parts = _partitions(profile, partition)
    arrivals = sorted((profile.ready[layer], -layer, layer) for layer in range(profile.layers))
    link = _Link(profile.bytes_per_s, profile.overhead, credit)
    queue: list[tuple[int, int, float]] = []  # (layer, seq, bytes): lowest layer = most urgent
    seq, k, now = 0, 0, 0.0
    order: list[Transfer] = []
    while k < len(arrivals) or queue:
        while k < len(arrivals) and arrivals[k][0] <= now:
            layer = arrivals[k][2]
            for _, b in parts[layer]:
                heapq.heappush(queue, (layer, seq, b))
                seq += 1
            k += 1
        if not queue:
            now = arrivals[k][0]
            continue
        when = link.earliest_launch(queue[0][2], now)
        if k < len(arrivals) and arrivals[k][0] < when:
            now = arrivals[k][0]  # a more urgent gradient may arrive before credit frees up
            continue
        layer, _, b = heapq.heappop(queue)
        link.launch(b, when)
        order.append(Transfer(((layer, b),)))
        now = when
    return CommPlan("bytescheduler", order, credit=credit, barrier=False, params={"partition": partition, "credit": credit})


def tune_bytescheduler(
    profile: GradientProfile,
    partitions: tuple[float, ...] = tuple(2**k * MiB / 4 for k in range(0, 10)),
    credits: tuple[int, ...] = (1, 2, 3, 4, 6, 8),
) -> CommPlan:
    """Pick partition size and credit (in partitions) that minimise the modelled iteration time.

    ByteScheduler tunes with Bayesian optimisation over measured step times; the
    model is cheap enough here to search the grid exhaustively. Online re-tuning
    from measured times goes through the same function with a re-fitted profile.
    """
    return _fastest(profile, (bytescheduler_plan(profile, partition=part, credit=c * part) for part in partitions for c in credits))


def _fastest(profile: GradientProfile, plans: Iterable[CommPlan]) -> CommPlan:
    """The plan with the least modelled iteration time (the first one on ties)."""
    best, best_time = None, math.inf
    for plan in plans:
        t = simulate_iteration(profile, plan).iteration_time
        if t < best_time - 1e-12:
            best, best_time = plan, t
    if best is None:
        raise InputError("no candidate plans to choose from")
    best.params["modelled_iteration_time"] = best_time
    return best


def gradient_stages(profile: GradientProfile, gap_factor: float = 2.0) -> list[list[int]]:
    """Prophet's stages: runs of gradients (in ready order) separated by gaps larger than
    ``gap_factor`` x the mean inter-arrival gap. When no gap stands out (arrivals are not
    stepwise), every gradient is its own stage (our deviation; see the code).

    >>> from flowsched.gradients import GradientProfile
    >>> p = GradientProfile(list("abcd"), [1] * 4, [5.0, 4.9, 1.1, 1.0], [0] * 4, 5.0, 1e-9)
    >>> gradient_stages(p)
    [[3, 2], [1, 0]]
    """
    order = _ready_order(profile)
    if len(order) <= 1:
        return [order]
    gaps = [profile.ready[b] - profile.ready[a] for a, b in zip(order, order[1:], strict=False)]
    mean = sum(gaps) / len(gaps)
    stages, current = [], [order[0]]
    for layer, gap in zip(order[1:], gaps, strict=True):
        if gap > gap_factor * mean:
            stages.append(current)
            current = []
        current.append(layer)
    stages.append(current)
    if len(stages) == 1:
        # Not stepwise (e.g. uniform arrivals): Prophet would wait for the whole backward pass.
        # Deviation: fall back to one stage per gradient, so each compute gap still sizes a block.
        return [[layer] for layer in order]
    return stages


def prophet_plan(profile: GradientProfile, *, partition: float = 4 * MiB, gap_factor: float = 2.0, credit: float | None = None) -> CommPlan:
    """Prophet: when stage *k* is ready, push its partitions on a stack and send, as ONE block, the
    most urgent ones that fit in ``bandwidth x gap`` before stage *k+1* is ready; leftovers wait under
    the next stage's (more urgent) gradients. After the last stage, the rest goes in priority order,
    one partition per launch with pipelined launches (credit).
    """
    stages = gradient_stages(profile, gap_factor)
    parts = _partitions(profile, partition)
    stack: list[tuple[int, float]] = []
    order: list[Transfer] = []
    for k, stage in enumerate(stages):
        for layer in stage:  # stage is in ready order (back layers first): the last pushed is the most urgent
            stack.extend(parts[layer])
        if k + 1 < len(stages):
            # the block must be on the wire before the next (more urgent) stage is complete
            done_now = max(profile.ready[x] for x in stage)
            done_next = max(profile.ready[x] for x in stages[k + 1])
            budget = profile.bytes_per_s * max(0.0, done_next - done_now - profile.overhead)
            block = []
            stack.sort(key=lambda p: -p[0])  # most urgent (lowest layer) on top
            while stack and stack[-1][1] <= budget:
                piece = stack.pop()
                budget -= piece[1]
                block.append(piece)
            if block:
                order.append(Transfer(tuple(block)))
    stack.sort(key=lambda p: -p[0])
    while stack:
        order.append(Transfer((stack.pop(),)))
    credit = 2 * partition if credit is None else credit
    return CommPlan("prophet", order, credit=credit, barrier=False, params={"partition": partition, "gap_factor": gap_factor})


def tune_prophet(profile: GradientProfile, partitions: tuple[float, ...] = tuple(2**k * MiB / 4 for k in range(0, 10))) -> CommPlan:
    """Prophet with the partition size that minimises the modelled iteration time.

    Block sizes come from the gaps and the bandwidth; the partition size sets how
    finely a block can be filled (a partition larger than the gap's budget leaves
    the link idle), so it is chosen on the model, like ByteScheduler's.
    """
    return _fastest(profile, (prophet_plan(profile, partition=part) for part in partitions))
