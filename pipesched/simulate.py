"""Event-driven simulation of a pipeline schedule: durations, transfers, memory over time, lower bounds.

Each rank runs its actions in order; an action starts when the rank is free and its inputs are there:
a forward needs the previous stage's activation, a backward (``B`` or ``I``) the next stage's gradient (or,
on the last stage, its own forward), ``W`` its ``I``, and Chimera's ``REDUCE_GRAD`` the other replica's last
backward. Activations and gradients travel over the link between the two ranks (``LinkModel``: latency +
bytes / bandwidth), one message at a time per direction, overlapped with compute as torch's runtime does
with asynchronous sends. With ``cores=c`` the ranks share ``c`` processors (processor sharing: with more
than ``c`` ranks computing, each runs at ``c / active`` speed), which is how a CPU run with more processes
than cores behaves. ``cores`` may also be a :class:`SharedCpu`, which adds the CPU cost of every
point-to-point message on both of its ranks (see there) and may say that an oversubscribed CPU delivers less
than its cores (``efficiency``).

A ``rendezvous`` (:class:`Rendezvous`, from :mod:`pipesched.runtimes`) describes a transport whose messages move
only once both sides have posted them (gloo's and NCCL's send/recv) and the runtime's program around the
computations: where each receive is posted and which of its own sends a rank waits for. Without it every
receive counts as posted in advance, the ideal an asynchronous runtime approaches.

Memory per rank: model states of its stages, plus per micro-batch the saved activations from F until the
backward frees them (all at B; at I except what W still needs, the rest at W), plus, during a backward,
the activations recomputation re-materialises.

>>> from pipesched.schedules import one_f_one_b
>>> res = simulate(one_f_one_b(4, 8), {s: StageCost(f=1.0, b=2.0) for s in range(4)})
>>> res.makespan, round(res.bubble_fraction, 4), 3 / 11
(33.0, 0.2727, 0.2727272727272727)
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .schedules import Action, Schedule, ScheduleError


@dataclass(frozen=True)
class StageCost:
    """Per-micro-batch costs of one stage id on its rank (seconds, bytes)."""

    f: float
    b: float                      # fused backward (recomputation included)
    i: float | None = None        # input-gradient backward (recomputation included); default b/2
    w: float | None = None        # weight-gradient backward; default b - i
    out_bytes: float = 0.0        # activation sent to the next stage (its gradient comes back the same size)
    saved_bytes: float = 0.0      # activations held from F to the backward
    wgrad_bytes: float = 0.0      # part of saved_bytes still needed by W after I
    transient_bytes: float = 0.0  # re-materialised by recomputation during a backward
    state_bytes: float = 0.0      # weights, gradients and optimizer state
    reduce_s: float = 0.0         # REDUCE_GRAD duration (Chimera replica all-reduce)

    @property
    def i_s(self) -> float:
        return self.b / 2 if self.i is None else self.i

    @property
    def w_s(self) -> float:
        return self.b - self.i_s if self.w is None else self.w

    def duration(self, kind: str) -> float:
        if kind == "F":
            return self.f
        if kind == "B":
            return self.b
        if kind == "I":
            return self.i_s
        if kind == "W":
            return self.w_s
        if kind == "REDUCE_GRAD":
            return self.reduce_s
        raise KeyError(kind)


@dataclass(frozen=True)
class SharedCpu:
    """Ranks that are processes sharing ``cores`` CPU cores, with a CPU cost per point-to-point message.

    ``message_cpu_s`` is the CPU time one message costs each of its two ranks (gloo over TCP: the copy, the
    socket calls and the wake-ups of the communication threads), measured by
    :func:`pipesched.calibrate.calibrate_cpu` as process CPU time per message in a ping-pong. The simulator
    adds it to the work of the action that sends (after F, the activation; after B/I, the gradient) and of
    the action that consumes a received tensor, once per message that crosses ranks: torch's runtime posts the
    sends right after the producing action and waits for the receive right before the consuming one, on the
    same thread. That work runs under processor sharing like the compute, so on an oversubscribed CPU a
    message also slows the other ranks. The link's latency stays the wait for the message (the one-way
    time of the ping-pong less this CPU work). ``action_cpu_s`` is the runtime's fixed CPU work per compute
    action (its Python bookkeeping around the layer calls), added to every F, B, I and W.

    ``efficiency`` is the share of ``cores`` that the ranks get while more of them are computing than there are
    cores: each then runs at ``cores * efficiency / active`` speed. Ideal processor sharing has 1. A real
    kernel falls short with pipeline ranks that block and wake every few milliseconds: each core has its own
    run queue, so a core whose rank blocks can stay idle while the other still holds two runnable ranks, and
    a rank alone on a core races ahead while its neighbours share the other. Measured timelines on this
    machine look like that: the busiest rank ran at full speed, then waited for neighbours that got a third
    of a core. :func:`pipesched.calibrate.calibrate_runtime` measures the value on a balanced pipeline of
    equal blocks; the model stays fluid, only its total rate is scaled.
    """

    cores: float
    message_cpu_s: float = 0.0
    action_cpu_s: float = 0.0     # the runtime's own CPU work per compute action (F, B, I, W), on top of the profile
    efficiency: float = 1.0       # share of the cores delivered while more ranks compute than there are cores

    def __post_init__(self) -> None:
        if not 0.0 < self.efficiency <= 1.0:
            raise ValueError(f"SharedCpu.efficiency must be in (0, 1], got {self.efficiency}")

    def to_dict(self) -> dict[str, float]:
        return {"cores": self.cores, "message_cpu_s": self.message_cpu_s, "action_cpu_s": self.action_cpu_s,
                "efficiency": self.efficiency}


MessageKey = tuple[int, str, "int | None"]
"""A cross-rank tensor by where it goes: (receiving stage, "act" or "grad", micro-batch)."""


@dataclass(frozen=True)
class Rendezvous:
    """When a runtime posts each receive and which sends it waits for, for a transport that moves a message only
    once both its send and its receive are posted (gloo's TCP pairs wait for the receiver's ready notice; a send
    completes when the data has gone).

    ``recv_before[key] = (rank, i)``: the rank posts that receive right before its ``i``-th action (index into
    ``Schedule.actions[rank]``), i.e. when its action ``i - 1`` ends (at 0 for ``i = 0``). ``send_waits[(rank, i)]``:
    messages this rank sent that must have been delivered before its ``i``-th action may start (torch's built-in
    schedules wait on their sends). A message then moves at ``max(send posted, receive posted)``; a receive
    posted after its send costs one more link latency (the ready notice travelling to the sender). Messages
    missing from ``recv_before`` count as posted in advance.

    ``handshake_s`` replaces that latency for a late receive whose sender is blocked waiting for that very send
    (a message in ``send_waits``): the exchange releases the sender, and the receiver's data arrives only once
    the threads that move it get a core back from the two computing ranks. On this 2-core machine such waits
    averaged 2.4-2.7 ms per message under torch's ``Schedule1F1B`` (run to run they move by up to 2 ms, within
    one 4 ms scheduler tick), while a late receive whose sender was idle cost ~0.5 ms
    (``pipesched.calibrate.calibrate_runtime`` measures ``handshake_s``).
    """

    recv_before: Mapping[MessageKey, tuple[int, int]] = field(default_factory=dict)
    send_waits: Mapping[tuple[int, int], tuple[MessageKey, ...]] = field(default_factory=dict)
    handshake_s: float | None = None   # a late receive's extra delay before the data moves (default: the link's latency)

    def posts_at(self) -> dict[tuple[int, int], list[MessageKey]]:
        """(rank, action index) -> the receives posted right before that action."""
        out: dict[tuple[int, int], list[MessageKey]] = {}
        for key, where in self.recv_before.items():
            out.setdefault(where, []).append(key)
        return out


@dataclass(frozen=True)
class Span:
    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Transfer:
    src: int
    dst: int
    what: str          # "act 2F5" / "grad 3B5"
    nbytes: float
    start: float
    end: float


@dataclass
class SimResult:
    makespan: float
    timeline: list[Span]
    transfers: list[Transfer]
    busy: list[float]
    peak_memory: list[float]
    memory_trace: list[list[tuple[float, float]]]
    peak_in_flight: dict[int, int]
    ranks: int
    names: list[str] = field(default_factory=list)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the ranks' time: ``1 - sum(busy) / (ranks * makespan)``."""
        return 1.0 - sum(self.busy) / (self.ranks * self.makespan) if self.makespan > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        return {"makespan_s": self.makespan, "bubble_fraction": self.bubble_fraction, "busy_s": self.busy,
                "peak_memory_bytes": self.peak_memory, "peak_in_flight": {str(k): v for k, v in self.peak_in_flight.items()},
                "transfers": len(self.transfers)}


def _partner_stages(schedule: Schedule) -> dict[int, list[int]]:
    """Stage ids that are replicas of the same partition stage (Chimera), for REDUCE_GRAD."""
    groups: dict[int, list[int]] = {}
    for sid, layer_stage in enumerate(schedule.stage_layers):
        groups.setdefault(layer_stage, []).append(sid)
    return {sid: [o for o in groups[schedule.stage_layers[sid]] if o != sid] for sid in range(schedule.num_stages)}


def simulate(schedule: Schedule, costs: Mapping[int, StageCost], links: Any = None, *, cores: float | SharedCpu | None = None,
             rendezvous: Rendezvous | None = None, engine: str = "direct") -> SimResult:
    """Run ``schedule`` with per-stage ``costs`` over ``links`` (a ``LinkModel``; None = free transfers), optionally
    with a ``rendezvous`` transport and the runtime's receive posts and send waits (module docstring).

    ``engine``: ``"direct"`` (default) lets each rank run ahead until an input is missing when neither ``cores`` nor a
    ``rendezvous`` is given (an action then starts at the later of its rank's last end and its inputs' arrival, so no
    event queue is needed); ``"events"`` always uses the event loop, which processor sharing and rendezvous need. The
    two give identical results (``tests/test_pipe_schedules.py``).
    """
    if engine not in ("direct", "events"):
        raise ValueError(f"engine must be 'direct' or 'events', got {engine!r}")
    # A simulation allocates a few objects per action (spans, transfers, events) and frees none of them before it returns:
    # the cyclic collector's passes over them, and over everything else the caller holds, would find nothing to free, and
    # in a process that keeps a few plans they cost more than the simulation itself. Paused while it runs.
    with gc_paused():
        return _simulate(schedule, costs, links, cores, rendezvous, engine)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for an allocation-heavy step that creates no garbage cycles (restored after)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def _simulate(schedule: Schedule, costs: Mapping[int, StageCost], links: Any, cores: float | SharedCpu | None,
              rendezvous: Rendezvous | None, engine: str) -> SimResult:
    message_cpu = action_cpu = 0.0
    efficiency = 1.0
    if isinstance(cores, SharedCpu):
        message_cpu, action_cpu, efficiency, cores = cores.message_cpu_s, cores.action_cpu_s, cores.efficiency, cores.cores
    R = schedule.ranks
    acts = schedule.actions
    neighbours = {s: schedule.neighbours(s) for s in range(schedule.num_stages)}
    partners = _partner_stages(schedule)
    backward_total = {s: len(schedule.microbatches_of(s)) for s in range(schedule.num_stages)}
    backward_count: dict[int, int] = {s: 0 for s in range(schedule.num_stages)}
    last_backward: dict[int, float] = {}
    finish: dict[tuple[int, str, int | None], float] = {}
    arrive: dict[tuple[int, str, int | None], float] = {}   # (stage, "act"|"grad", mb) -> time its input is on the rank
    link_free: dict[tuple[int, int], float] = {}
    transfers: list[Transfer] = []
    timeline: list[Span] = []
    mem_events: list[list[tuple[float, float]]] = [[] for _ in range(R)]
    flight_events: dict[int, list[tuple[float, int]]] = {s: [] for s in range(schedule.num_stages)}
    busy = [0.0] * R
    ptr = [0] * R
    running: dict[int, list[Any]] = {}     # rank -> [action, remaining work, start, duration, start order]
    dirty: set[int] = set()                # ranks whose next action may have become ready
    wakes: list[tuple[float, int]] = []    # (time, rank): a rank's next action becomes ready then (a heap)
    now = 0.0
    posts_at = rendezvous.posts_at() if rendezvous is not None else {}
    send_waits = rendezvous.send_waits if rendezvous is not None else {}
    waited = {k for keys in send_waits.values() for k in keys}
    placed_recvs = rendezvous.recv_before if rendezvous is not None else {}
    n_messages = {(sid, kind): schedule.cross_rank_messages(Action(sid, kind, 0))
                  for sid in range(schedule.num_stages) for kind in ("F", "B", "I", "W", "REDUCE_GRAD")}
    sent: dict[MessageKey, tuple[float, int, int, float, str]] = {}   # posted sends: key -> (time, src, dst, bytes, label)
    recv_posted: dict[MessageKey, float] = {}

    def cost(stage: int) -> StageCost:
        try:
            return costs[stage]
        except KeyError:
            raise ScheduleError(f"no cost for stage {stage}") from None

    stage_rank = schedule.stage_rank

    def send(src_stage: int, dst_stage: int, kind: str, mb: int | None, t: float, nbytes: float, label: str) -> None:
        a, b = stage_rank[src_stage], stage_rank[dst_stage]
        key = (dst_stage, kind, mb)
        if a == b or (links is None and rendezvous is None):   # free transfers; a rendezvous still waits for its receive
            arrive[key] = t
            dirty.add(b)
            return
        sent[key] = (t, a, b, nbytes, label)
        move(key)

    def move(key: MessageKey) -> None:
        """Deliver a posted send once its receive is posted too (at once without a rendezvous)."""
        if key not in sent or key in arrive:
            return
        t, a, b, nbytes, label = sent[key]
        posted = recv_posted.get(key) if key in placed_recvs else 0.0   # receives the runtime does not place: in advance
        if posted is None:
            return
        bw, lat = links.link(a, b) if links is not None else (float("inf"), 0.0)
        start = max(t, posted, link_free.get((a, b), 0.0))
        if posted > t:      # the sender learns of the receive one latency later (a blocked sender: the handshake)
            late = rendezvous.handshake_s if rendezvous.handshake_s is not None and key in waited else lat
            start = max(start, posted + late)
        serial = nbytes / bw if nbytes > 0 else 0.0
        link_free[(a, b)] = start + serial
        end = start + serial + lat
        arrive[key] = end
        dirty.update((a, b))      # the receiver's input, and the sender's wait on its send
        transfers.append(Transfer(a, b, label, nbytes, start, end))

    def reach(r: int, t: float) -> None:
        """Rank ``r`` is now at action ``ptr[r]``: post the receives its runtime posts there."""
        for key in posts_at.get((r, ptr[r]), ()):
            recv_posted[key] = t
            move(key)

    def ready_at(a: Action, r: int) -> float | None:
        waits = send_waits.get((r, ptr[r]))
        if waits:
            if any(k not in arrive for k in waits):
                return None
            data = ready_data(a)
            return None if data is None else max([data, *(arrive[k] for k in waits)])
        return ready_data(a)

    def ready_data(a: Action) -> float | None:
        prev, nxt = neighbours[a.stage]
        if a.kind == "F":
            return 0.0 if prev is None else arrive.get((a.stage, "act", a.mb))
        if a.kind in ("B", "I"):
            own = finish.get((a.stage, "F", a.mb))
            if own is None:
                return None
            if nxt is None:
                return own
            g = arrive.get((a.stage, "grad", a.mb))
            return None if g is None else max(own, g)
        if a.kind == "W":
            return finish.get((a.stage, "I", a.mb))
        if a.kind == "REDUCE_GRAD":
            times = []
            for s in [a.stage, *partners[a.stage]]:
                if backward_count[s] < backward_total[s]:
                    return None
                times.append(last_backward.get(s, 0.0))
            return max(times)
        raise ScheduleError(f"cannot simulate action {a}")

    effects_of: dict[tuple[int, str], tuple] = {}

    def effects(stage: int, kind: str) -> tuple:
        """What an action of this stage and kind does, shared by both engines: (duration, bytes allocated at its start or
        None, bytes freed at its end or None, the tensor it sends as (receiving stage, "act"|"grad", bytes) or None,
        whether it ends a micro-batch's backward)."""
        key = (stage, kind)
        if key not in effects_of:
            c = cost(stage)
            prev, nxt = neighbours[stage]
            alloc = c.saved_bytes if kind == "F" else c.transient_bytes if kind in ("B", "I") else None
            freed = {"B": -(c.transient_bytes + c.saved_bytes), "I": -(c.transient_bytes + c.saved_bytes - c.wgrad_bytes),
                     "W": -c.wgrad_bytes}.get(kind)
            message = ((nxt, "act", c.out_bytes) if kind == "F" and nxt is not None
                       else (prev, "grad", cost(prev).out_bytes) if kind in ("B", "I") and prev is not None else None)
            effects_of[key] = (c.duration(kind), alloc, freed, message, kind in ("B", "W"))
        return effects_of[key]

    def start(r: int, a: Action, order: int) -> None:
        dur, alloc, _, _, _ = effects(a.stage, a.kind)
        dur += message_cpu * n_messages[(a.stage, a.kind)] if message_cpu and links is not None else 0.0
        if action_cpu and a.kind in ("F", "B", "I", "W"):
            dur += action_cpu
        running[r] = [a, dur, now, dur, order]
        if alloc is not None:
            mem_events[r].append((now, alloc))
        if a.kind == "F":
            flight_events[a.stage].append((now, 1))

    def complete(r: int, t: float) -> None:
        a, _, t0, _, _ = running.pop(r)
        dirty.add(r)
        _, _, freed, message, ends_backward = effects(a.stage, a.kind)
        ptr[r] += 1
        reach(r, t)
        finish[(a.stage, a.kind, a.mb)] = t
        busy[r] += t - t0
        timeline.append(Span(r, a, t0, t))
        if message is not None:
            send(a.stage, message[0], message[1], a.mb, t, message[2], f"{message[1]} {a}")
        if freed is not None:
            mem_events[r].append((t, freed))
        if ends_backward:
            backward_count[a.stage] += 1
            last_backward[a.stage] = t
            if partners[a.stage]:
                dirty.update(schedule.stage_rank[s] for s in partners[a.stage])   # their REDUCE_GRAD waits for this one
            flight_events[a.stage].append((t, -1))

    total = sum(len(v) for v in acts.values())
    done = 0
    seq = 0                                   # start order: completions at one instant are handled in it
    ends: list[tuple[float, int, int]] = []   # without processor sharing: (end, start order, rank), a heap
    lanes: list[list[Span]] = []              # the run-ahead engine's timeline, per rank
    for r in range(R):
        reach(r, 0.0)
    dirty.update(range(R))
    if cores is None and rendezvous is None and engine == "direct":
        # Without processor sharing or a rendezvous an action starts at max(its rank free, its inputs there) and every
        # link carries its sender's messages in that rank's order, so each rank can run ahead until an input is missing.
        # The loop below is the hot path of a plan (tens of thousands of actions per simulation): what an action of a
        # stage and kind needs and does is looked up once per (stage, kind) (``step``), and the inputs of F, B, I and W
        # are read inline; the arithmetic is the event loop's, so both engines give identical floats.
        free = [0.0] * R
        lanes = [[] for _ in range(R)]    # each rank's spans, in its order
        step: dict[tuple[int, str], tuple] = {}
        ready_reduce = ready_data            # REDUCE_GRAD (Chimera) only: the general rule
        progress = True
        while done < total and progress:
            progress = False
            for r in range(R):
                row, k, end, events, lane, busy_r = acts[r], ptr[r], free[r], mem_events[r], lanes[r], busy[r]
                n_row = len(row)
                while k < n_row:
                    a = row[k]
                    stage, kind, mb = a.stage, a.kind, a.mb
                    how = step.get((stage, kind))
                    if how is None:
                        if kind not in ("F", "B", "I", "W"):
                            ready_data(a)            # REDUCE_GRAD, or the event loop's error for a kind it cannot run
                        dur, alloc, freed, message, ends_backward = effects(stage, kind)
                        prev, nxt = neighbours[stage]
                        route = None
                        if message is not None:
                            dst_stage, what, nbytes = message
                            src, dst = stage_rank[stage], stage_rank[dst_stage]
                            if src == dst or links is None:
                                route = (dst_stage, what, None)
                            else:
                                bw, lat = links.link(src, dst)
                                route = (dst_stage, what, (src, dst, nbytes, nbytes / bw if nbytes > 0 else 0.0, lat))
                        how = step[(stage, kind)] = (dur, alloc, freed, route, ends_backward, prev, nxt)
                    dur, alloc, freed, route, ends_backward, prev, nxt = how
                    if kind == "F":
                        if prev is None:
                            t = 0.0
                        else:
                            t = arrive.get((stage, "act", mb))
                            if t is None:
                                break
                        flight_events[stage].append((end if end >= t else t, 1))
                    elif kind == "B" or kind == "I":
                        t = finish.get((stage, "F", mb))
                        if t is None:
                            break
                        if nxt is not None:
                            g = arrive.get((stage, "grad", mb))
                            if g is None:
                                break
                            if g > t:
                                t = g
                    elif kind == "W":
                        t = finish.get((stage, "I", mb))
                        if t is None:
                            break
                    else:
                        t = ready_reduce(a)
                        if t is None:
                            break
                    begin = end if end >= t else t
                    end = begin + dur
                    if alloc is not None:
                        events.append((begin, alloc))
                    if kind == "F" or kind == "I":     # the only finishes an input waits for (B/I on F, W on I)
                        finish[(stage, kind, mb)] = end
                    busy_r += end - begin
                    lane.append(Span(r, a, begin, end))
                    if route is not None:     # as send() and move() without a rendezvous
                        dst_stage, what, hop = route
                        if hop is None:
                            arrive[(dst_stage, what, mb)] = end
                        else:
                            src, dst, nbytes, serial, lat = hop
                            go = max(end, 0.0, link_free.get((src, dst), 0.0))
                            link_free[(src, dst)] = go + serial
                            arrive[(dst_stage, what, mb)] = go + serial + lat
                            label = f"{what} {stage}{kind}{'' if mb is None else mb}"     # f"{what} {a}" without a call
                            transfers.append(Transfer(src, dst, label, nbytes, go, go + serial + lat))
                    if freed is not None:
                        events.append((end, freed))
                    if ends_backward:
                        backward_count[stage] += 1
                        last_backward[stage] = end
                        flight_events[stage].append((end, -1))
                    k += 1
                    done += 1
                    progress = True
                ptr[r], free[r], busy[r] = k, end, busy_r
        if done < total:
            waiting = [f"rank {r} at {acts[r][ptr[r]]}" for r in range(R) if ptr[r] < len(acts[r])]
            raise ScheduleError("deadlock: " + ", ".join(waiting))
    while done < total:
        # Start every idle rank whose next action is ready now. Only ranks whose inputs changed (dirty) or whose
        # known ready time has come (wakes) can start: a ready time, once known, never changes.
        while wakes and wakes[0][0] <= now:
            dirty.add(heapq.heappop(wakes)[1])
        for r in sorted(dirty):
            if r in running or ptr[r] >= len(acts[r]):
                continue
            t = ready_at(acts[r][ptr[r]], r)
            if t is None:
                continue
            if t <= now:
                start(r, acts[r][ptr[r]], seq)
                if cores is None:
                    heapq.heappush(ends, (running[r][2] + running[r][3], seq, r))
                seq += 1
            else:
                heapq.heappush(wakes, (t, r))
        dirty.clear()
        if not running and not wakes:
            waiting = [f"rank {r} at {acts[r][ptr[r]]}" for r in range(R) if ptr[r] < len(acts[r])]
            raise ScheduleError("deadlock: " + ", ".join(waiting))
        if cores is None:
            t_next = min(ends[0][0] if ends else math.inf, wakes[0][0] if wakes else math.inf)
            now = t_next
            finished = []
            while ends and ends[0][0] <= now:
                _, order, r = heapq.heappop(ends)
                finished.append((order, r))
            finished.sort()
        else:
            rate = 1.0 if len(running) <= cores else cores * efficiency / len(running)
            until = {r: now + v[1] / rate for r, v in running.items()}
            t_next = min([*until.values(), *([wakes[0][0]] if wakes else [])])
            for v in running.values():
                v[1] -= (t_next - now) * rate
            now = t_next
            finished = [(running[r][4], r) for r, e in until.items() if e <= now]
        for _, r in finished:
            complete(r, now)
            done += 1
    makespan = max((s.end for lane in (lanes or [timeline]) for s in lane), default=0.0)
    peaks, traces = [], []
    for r in range(R):
        base = sum(cost(s).state_bytes for s in range(schedule.num_stages) if schedule.stage_rank[s] == r)
        level, peak, trace = base, base, [(0.0, base)]
        for t, delta in sorted(mem_events[r]):   # by time, frees (negative) before allocations at equal times
            level += delta
            peak = max(peak, level)
            trace.append((t, level))
        peaks.append(peak)
        traces.append(trace)
    flights = {}
    for s, events in flight_events.items():
        level = best = 0
        for _, delta in sorted(events):
            level += delta
            best = max(best, level)
        flights[s] = best
    # The run-ahead engine's lanes are each in its rank's order, which is start order: their concatenation is the sorted timeline.
    timeline = [span for lane in lanes for span in lane] if lanes else sorted(timeline, key=lambda x: (x.rank, x.start))
    return SimResult(makespan, timeline, transfers, busy, peaks, traces, flights, R,
                     names=list(getattr(links, "names", []) or []))


# --------------------------------------------------------------------------------------------------------------
# Lower bounds
# --------------------------------------------------------------------------------------------------------------

def lower_bound(schedule: Schedule, costs: Mapping[int, StageCost], links: Any = None) -> dict[str, Any]:
    """A makespan no schedule with this placement and backward style can beat.

    For each rank: it cannot start before the first micro-batch's forward reaches its earliest stage
    (``head``: forwards and transfers of the stages before it in the chain), it must do all its work, and
    after its last backward the gradient must still go back through the stages before it (``tail``). Without
    a B/W split this is ``head + work + tail``; with it, W's may trail, so the bound is the larger of
    ``head + work`` and ``head + forwards + input backwards + tail`` where the tail ends with the first
    stage's W. For uniform stages and free links it is GPipe's/1F1B's ``(m + p - 1)(F + B)``, interleaved
    ``m(F+B) + (p-1)(F+B)/v``, ZB-H1 ``m(F+I+W) + (p-1)(F+I-W)`` when it binds, and Chimera's
    ``(D-2)/(2N+D-2)`` bubble with F = B. ``work_bound`` is the busiest rank's work alone.
    """
    split = schedule.split_backward

    def hop(a: int, b: int, nbytes: float) -> float:
        if links is None:
            return 0.0
        ra, rb = schedule.stage_rank[a], schedule.stage_rank[b]
        return 0.0 if ra == rb else links.time(ra, rb, nbytes)

    head: dict[int, float] = {}
    tail: dict[int, float] = {}
    for chain in schedule.chains:
        acc = 0.0
        for k, s in enumerate(chain):
            head[s] = acc
            acc += costs[s].f + (hop(s, chain[k + 1], costs[s].out_bytes) if k + 1 < len(chain) else 0.0)
        acc = costs[chain[0]].w_s if split else 0.0
        for k, s in enumerate(chain):
            tail[s] = acc
            back = costs[s].i_s if split else costs[s].b
            acc += back + (hop(s, chain[k - 1], costs[chain[k - 1]].out_bytes) if k > 0 else 0.0)
    per_rank = []
    work_bound = 0.0
    for r in range(schedule.ranks):
        stages = sorted({a.stage for a in schedule.actions[r] if a.kind != "REDUCE_GRAD"})
        counts = {s: len(schedule.microbatches_of(s)) for s in stages}
        work = sum(costs[a.stage].duration(a.kind) for a in schedule.actions[r])
        h = min(head[s] for s in stages)
        t = min(tail[s] for s in stages)
        if split:
            fi = sum(counts[s] * (costs[s].f + costs[s].i_s) for s in stages)
            bound = max(h + work, h + fi + t)
        else:
            reduce = sum(costs[a.stage].reduce_s for a in schedule.actions[r] if a.kind == "REDUCE_GRAD")
            bound = h + (work - reduce) + t + reduce
        per_rank.append(bound)
        work_bound = max(work_bound, work)
    return {"bound_s": max(per_rank), "per_rank_s": per_rank, "work_bound_s": work_bound,
            "family": schedule.name, "split_backward": split}


# --------------------------------------------------------------------------------------------------------------
# Pictures and traces
# --------------------------------------------------------------------------------------------------------------

COLOURS = {"F": "#4c78a8", "B": "#e45756", "I": "#f58518", "W": "#54a24b", "REDUCE_GRAD": "#9d755d"}


def gantt_png(result: SimResult, path: str | Path, *, title: str = "", max_actions: int = 20000) -> Path:
    """Draw the simulated timeline (one row per rank, colour per action kind, labels when they fit)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    R = result.ranks
    fig, ax = plt.subplots(figsize=(12, 0.45 * R + 1.6))
    scale, unit = (1e3, "ms") if result.makespan < 10 else (1.0, "s")
    spans = result.timeline[:max_actions]
    for kind, colour in COLOURS.items():
        for r in range(R):
            bars = [((s.start) * scale, (s.end - s.start) * scale) for s in spans if s.rank == r and s.action.kind == kind]
            if bars:
                ax.broken_barh(bars, (r - 0.4, 0.8), facecolors=colour, edgecolors="white", linewidth=0.3)
    if len(spans) <= 400:
        for s in spans:
            width = (s.end - s.start) * scale
            if width > result.makespan * scale / 60:
                ax.text((s.start * scale) + width / 2, s.rank, f"{s.action.stage}{s.action.kind}{'' if s.action.mb is None else s.action.mb}",
                        ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(R))
    ax.set_yticklabels([result.names[r] if r < len(result.names) else f"rank {r}" for r in range(R)], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title or f"makespan {result.makespan * scale:.3g} {unit}, bubble {result.bubble_fraction:.1%}")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()], loc="upper right", fontsize=7, ncol=5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def chrome_trace(result: SimResult, *, label: str = "predicted", pid_offset: int = 0) -> list[dict[str, Any]]:
    """Chrome/Perfetto trace events: one process per rank, compute on thread 0, outgoing transfers on thread 1."""
    events: list[dict[str, Any]] = []
    for r in range(result.ranks):
        name = result.names[r] if r < len(result.names) else f"rank {r}"
        events.append({"ph": "M", "name": "process_name", "pid": pid_offset + r, "args": {"name": f"{label} {name}"}})
        events.append({"ph": "M", "name": "thread_name", "pid": pid_offset + r, "tid": 0, "args": {"name": "compute"}})
        events.append({"ph": "M", "name": "thread_name", "pid": pid_offset + r, "tid": 1, "args": {"name": "send"}})
    for s in result.timeline:
        events.append({"ph": "X", "name": str(s.action), "cat": s.action.kind, "pid": pid_offset + s.rank, "tid": 0,
                       "ts": s.start * 1e6, "dur": (s.end - s.start) * 1e6})
    for t in result.transfers:
        events.append({"ph": "X", "name": t.what, "cat": "p2p", "pid": pid_offset + t.src, "tid": 1, "ts": t.start * 1e6,
                       "dur": (t.end - t.start) * 1e6, "args": {"bytes": t.nbytes, "dst": t.dst}})
    for r, trace in enumerate(result.memory_trace):
        for t, level in trace:
            events.append({"ph": "C", "name": "memory", "pid": pid_offset + r, "ts": t * 1e6, "args": {"bytes": level}})
    return events


def write_chrome_trace(path: str | Path, *results: tuple[str, SimResult]) -> Path:
    """Write one or more labelled timelines (e.g. predicted and measured) into one trace file."""
    from topology.io import atomic_write_text

    events: list[dict[str, Any]] = []
    offset = 0
    for label, result in results:
        events += chrome_trace(result, label=label, pid_offset=offset)
        offset += result.ranks
    atomic_write_text(path, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return Path(path)


def uniform_costs(stages: int, f: float, b: float, i: float | None = None, w: float | None = None) -> dict[int, StageCost]:
    """Identical costs for ``stages`` stage ids (closed-form checks)."""
    return {s: StageCost(f=f, b=b, i=i, w=w) for s in range(stages)}


def closed_form_bubble(family: str, ranks: int, microbatches: int, chunks: int = 1) -> float:
    """Textbook bubble fraction at balanced stages and free links, in the cost setting each formula is stated for.

    GPipe/1F1B ``(p-1)/(m+p-1)`` and interleaved 1F1B / looped BFS ``(p-1)/(vm+p-1)`` for any F and B; Chimera
    ``(D-2)/(2N+D-2)`` with F = B (its paper's unit slots; with B = 2F the bubble differs); the zero-bubble families at
    F = I = W: ZB-H1 ``(p-1)/(3m+p-1)``, interleaved zero bubble ``(p-1)/(3vm+p-1)`` (m >= p, a multiple of p), ZB-V
    and DualPipe-V ``(p-1)/(6m+p-1)`` (two chunks of F + I + W per micro-batch; m >= 2p).
    """
    p, m = ranks, microbatches
    if family in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if family in ("interleaved", "looped_bfs"):
        return (p - 1) / (chunks * m + p - 1)
    if family == "chimera":
        return (p - 2) / (2 * m + p - 2)
    if family == "zbh1":
        return (p - 1) / (3 * m + p - 1)
    if family == "interleaved_zb":
        return (p - 1) / (3 * chunks * m + p - 1)
    if family in ("zbv", "dualpipev"):
        return (p - 1) / (6 * m + p - 1)
    raise ValueError(family)
