"""How torch's pipeline runtimes post their point-to-point messages, as :class:`~pipesched.simulate.Rendezvous` data.

gloo (and NCCL) move a tensor only once both its send and its receive are posted: a send waits for the
receiver's ready notice, and completes when the data has gone. So *when* a runtime posts its receives, and
whether it waits for its own sends, decides how much of the transport a pipeline step exposes. torch ships two
kinds of executors for the same action order, and they differ exactly there:

- ``_PipelineScheduleRuntime`` (what :mod:`pipesched.export` feeds): its lowering pass (``_add_send_recv``) walks
  the ranks round-robin and appends a receive to the receiving rank's list as soon as the sender's producing
  action is placed, so receives are posted early, and sends are only waited for at the end of the step.
  :func:`asap_lowering_rendezvous` reproduces that placement.
- the built-in ``Schedule1F1B``: each receive is posted right before the action that consumes it, and the
  rank blocks on its previous send at fixed points of the loop (a send is fused with the next receive and
  waited for together). :func:`builtin_1f1b_rendezvous` walks the same control flow.

Measured on this machine (2 gloo processes, the same 1F1B order and layers): torch's ``Schedule1F1B`` took
6-8 % longer per step than ``_PipelineScheduleRuntime`` with the same CPU work, its busy rank waiting for a
neighbour to post a receive; and a gloo send whose receive is posted 50 ms late completes 50 ms late.

>>> from pipesched.schedules import one_f_one_b
>>> rv = builtin_1f1b_rendezvous(one_f_one_b(2, 4))
>>> rv.recv_before[(1, "act", 1)]      # rank 1 posts the receive of micro-batch 1 right before its F1 (action 2)
(1, 2)
>>> rv.send_waits[(1, 2)]              # ... and first waits until its gradient of micro-batch 0 has gone
((0, 'grad', 0),)
"""

from __future__ import annotations

from dataclasses import replace

from .schedules import Action, Schedule, ScheduleError
from .simulate import MessageKey, Rendezvous

RUNTIMES = ("ideal", "torch-runtime", "torch-1f1b")
"""``ideal``: every receive posted in advance (the simulator's default); ``torch-runtime``: torch's
``_PipelineScheduleRuntime`` on our exported CSV; ``torch-1f1b``: torch's built-in ``Schedule1F1B``."""


def asap_lowering_rendezvous(schedule: Schedule) -> Rendezvous:
    """Receives where torch's ``_add_send_recv`` lowering puts them (``_PipelineScheduleRuntime``); no send waits.

    The lowering visits the ranks in order, round after round, and places each rank's next compute action once
    its input is there: the receive of a message is appended to the receiving rank's list when the sender's
    producing action is placed, i.e. before the first of the receiver's actions not yet placed at that moment.
    """
    queue = {r: list(acts) for r, acts in schedule.actions.items() if acts}
    placed = {r: 0 for r in schedule.actions}
    have: dict[int, set[tuple]] = {r: set() for r in schedule.actions}
    recv_before: dict[MessageKey, tuple[int, int]] = {}

    def ready(r: int, a: Action) -> bool:
        incoming = schedule.incoming(a)
        if incoming is None:
            return True
        return ("recv", incoming) in have[r]

    while queue:
        progress = False
        for r in sorted(queue):
            a = queue[r][0]
            if not ready(r, a):
                continue
            placed[r] += 1
            out = schedule.outgoing(a)
            if out is not None:
                dst = schedule.stage_rank[out[0]]
                recv_before[out] = (dst, placed[dst])
                have[dst].add(("recv", out))
            queue[r].pop(0)
            if not queue[r]:
                del queue[r]
            progress = True
        if not progress:
            raise ScheduleError("the lowering cannot place the schedule's messages (a rank waits for a receive never sent)")
    return Rendezvous(recv_before, {})


def builtin_1f1b_rendezvous(schedule: Schedule) -> Rendezvous:
    """Receives and send waits of torch's built-in ``Schedule1F1B`` running ``schedule`` (one stage per rank).

    Its loop per rank (stage ``s`` of ``S``, ``m`` micro-batches): ``min(m, S - s)`` warm-up forwards, each
    preceded by its receive (posted and waited for right there) and followed by a wait for the *previous*
    forward's send; then alternately a backward and a forward, each preceded by posting its receive together
    with the send produced by the action before, and waiting for both; then the remaining backwards, each
    preceded by its receive and followed by a wait for the previous backward's send. The schedule's action
    order must be that loop's order (``pipesched.schedules.one_f_one_b`` is).
    """
    if schedule.num_stages != schedule.ranks or list(schedule.stage_rank) != list(range(schedule.ranks)):
        raise ScheduleError("torch's Schedule1F1B runs one stage per rank, stage s on rank s")
    recv_before: dict[MessageKey, tuple[int, int]] = {}
    send_waits: dict[tuple[int, int], tuple[MessageKey, ...]] = {}
    for s in range(schedule.num_stages):
        expected, recvs, waits = _builtin_1f1b_rank(schedule, s)
        if [(a.stage, a.kind, a.mb) for a in schedule.actions[s]] != [(a.stage, a.kind, a.mb) for a in expected]:
            raise ScheduleError(f"rank {s}'s actions are not in torch Schedule1F1B's order")
        recv_before |= {key: (s, i) for key, i in recvs.items()}
        send_waits |= {(s, i): tuple(keys) for i, keys in waits.items() if i < len(expected)}   # the final wait ends the step
    return Rendezvous(recv_before, send_waits)


def _builtin_1f1b_rank(schedule: Schedule, s: int) -> tuple[list[Action], dict[MessageKey, int], dict[int, list[MessageKey]]]:
    """Stage ``s``'s walk through ``Schedule1F1B._step_microbatches``: its actions in order, where each receive is
    posted (the index of the action it precedes) and which sends are waited for before which action."""
    S, m = schedule.num_stages, schedule.microbatches
    expected: list[Action] = []
    recvs: dict[MessageKey, int] = {}
    waits: dict[int, list[MessageKey]] = {}

    def act(kind: str, mb: int) -> MessageKey | None:
        a = Action(s, kind, mb)
        incoming = schedule.incoming(a)
        if incoming is not None:
            recvs[incoming] = len(expected)
        expected.append(a)
        return schedule.outgoing(a)

    def wait_before_next(key: MessageKey | None) -> None:
        if key is not None:
            waits.setdefault(len(expected), []).append(key)

    fwd = bwd = 0
    last_send: MessageKey | None = None
    for _ in range(min(m, S - s)):
        sent = act("F", fwd)
        wait_before_next(last_send)             # _wait_batch_p2p(send_work): the previous forward's send
        last_send = sent
        fwd += 1
    held = last_send                            # the last warm-up send is fused with the first backward's receive
    while True:
        wait_before_next(held)
        held = act("B", bwd)
        bwd += 1
        if fwd == m:
            break
        wait_before_next(held)                  # the backward's send, fused with the next forward's receive
        held = act("F", fwd)
        fwd += 1
    last_send = held
    while bwd < m:
        sent = act("B", bwd)
        wait_before_next(last_send)             # the previous backward's send
        last_send = sent
        bwd += 1
    return expected, recvs, waits


def rendezvous_for(runtime: str, schedule: Schedule, handshake_s: float | None = None) -> Rendezvous | None:
    """The :class:`~pipesched.simulate.Rendezvous` of a named runtime (:data:`RUNTIMES`); ``None`` for ``"ideal"``.

    ``handshake_s``: what a receive posted after its send costs before the data moves (default: one link latency;
    :func:`pipesched.calibrate.calibrate_runtime` measures it).
    """
    if runtime == "ideal":
        return None
    if runtime == "torch-runtime":
        rv = asap_lowering_rendezvous(schedule)
    elif runtime == "torch-1f1b":
        rv = builtin_1f1b_rendezvous(schedule)
    else:
        raise ScheduleError(f"unknown runtime {runtime!r}, expected one of {', '.join(RUNTIMES)}")
    return replace(rv, handshake_s=handshake_s)
