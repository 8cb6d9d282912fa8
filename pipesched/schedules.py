"""Pipeline schedules as data: per-rank ordered action lists in torch.distributed.pipelining's vocabulary.

An :class:`Action` is ``(stage, kind, microbatch)`` with ``kind`` one of ``F`` (forward), ``B`` (full
backward), ``I`` (input-gradient backward), ``W`` (weight-gradient backward), the communication kinds
``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B`` and ``REDUCE_GRAD``; ``str(action)`` is torch's spelling
(``2F0``, ``3I5``, ``1SEND_B4``). A :class:`Schedule` holds the compute actions of every rank in execution
order plus the structure they run on: which rank holds each stage, and the *chains* of stages that
micro-batches flow through (one chain for ordinary pipelines, two for Chimera).

Generators: :func:`gpipe`, :func:`one_f_one_b`, :func:`interleaved_1f1b` (virtual stages, loop placement, as
Megatron-LM and torch's ``ScheduleInterleaved1F1B``), :func:`zb_h1` (Zero Bubble's handcrafted ZB-H1, the
v=1 case of torch's ``ScheduleInterleavedZeroBubble``), :func:`chimera` (two bidirectional pipelines).
:func:`validate` checks dependencies, deadlock freedom and (with costs) memory.

Chimera and its replicas: with ``D`` ranks, stage ids ``0..D-1`` form the *down* pipeline (stage i on rank
i) and ids ``D..2D-1`` the *up* pipeline (id ``D+i`` runs the same layers as stage i, on rank ``D-1-i``).
``stage_layers`` maps every id to its partition stage, so a rank holds two weight replicas. After its last
backward each replica runs ``REDUCE_GRAD``: the two-rank gradient all-reduce between rank i and rank D-1-i
that keeps the replicas equal. torch's runtime requires one rank per stage id and the same micro-batches on
every stage, so Chimera schedules are simulated and validated here but not exported (see ``export.py``).

>>> s = one_f_one_b(ranks=2, microbatches=3)
>>> [str(a) for a in s.actions[0]]
['0F0', '0F1', '0B0', '0F2', '0B1', '0B2']
>>> validate(s)
[]
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from topology.errors import InputError

COMPUTE_KINDS = ("F", "B", "I", "W")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
ALL_KINDS = COMPUTE_KINDS + COMM_KINDS + ("REDUCE_GRAD",)
_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|REDUCE_GRAD|F|B|I|W)(\d*)$")


class ScheduleError(InputError):
    """A schedule that breaks a dependency, deadlocks or does not fit in memory."""


@dataclass(frozen=True, order=True)
class Action:
    stage: int
    kind: str
    mb: int | None = None

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{'' if self.mb is None else self.mb}"

    @classmethod
    def parse(cls, text: str, *, source: str | None = None, where: str | None = None) -> Action:
        """Parse torch's spelling (``2F0``, ``1SEND_B3``, ``0REDUCE_GRAD``)."""
        m = _ACTION_RE.match(text.strip())
        if not m:
            raise ScheduleError(f"bad action {text!r}, expected [stage][F|B|I|W|SEND_F|RECV_F|SEND_B|RECV_B|REDUCE_GRAD][microbatch]",
                                source=source, where=where)
        return cls(int(m.group(1)), m.group(2), int(m.group(3)) if m.group(3) else None)


@dataclass
class Schedule:
    """Compute actions per rank plus the stage structure they run on."""

    name: str
    ranks: int
    microbatches: int
    stage_rank: tuple[int, ...]                    # rank of each stage id
    chains: tuple[tuple[int, ...], ...]            # stage ids in forward order, one tuple per pipeline
    chain_microbatches: tuple[tuple[int, ...], ...]
    actions: dict[int, list[Action]]
    stage_layers: tuple[int, ...] = ()             # partition stage each stage id runs (Chimera: replicas share)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if not self.stage_layers:
            self.stage_layers = tuple(range(len(self.stage_rank)))

    @property
    def num_stages(self) -> int:
        return len(self.stage_rank)

    @property
    def split_backward(self) -> bool:
        return any(a.kind in ("I", "W") for acts in self.actions.values() for a in acts)

    def neighbours(self, stage: int) -> tuple[int | None, int | None]:
        """(previous, next) stage id of ``stage`` in its chain."""
        for chain in self.chains:
            if stage in chain:
                k = chain.index(stage)
                return (chain[k - 1] if k > 0 else None, chain[k + 1] if k + 1 < len(chain) else None)
        raise ScheduleError(f"stage {stage} is in no chain")

    def incoming(self, a: Action) -> tuple[int, str, int | None] | None:
        """The cross-rank tensor ``a`` consumes, as (its stage, "act" or "grad", micro-batch): an F's input
        activation, a B's or I's output gradient; ``None`` when it comes from the same rank or nowhere."""
        prev, nxt = self.neighbours(a.stage)
        src = prev if a.kind == "F" else nxt if a.kind in ("B", "I") else None
        if src is None or self.stage_rank[src] == self.stage_rank[a.stage]:
            return None
        return (a.stage, "act" if a.kind == "F" else "grad", a.mb)

    def outgoing(self, a: Action) -> tuple[int, str, int | None] | None:
        """The cross-rank tensor ``a`` sends, keyed by where it goes (receiving stage, "act" or "grad", micro-batch)."""
        prev, nxt = self.neighbours(a.stage)
        dst = nxt if a.kind == "F" else prev if a.kind in ("B", "I") else None
        if dst is None or self.stage_rank[dst] == self.stage_rank[a.stage]:
            return None
        return (dst, "act" if a.kind == "F" else "grad", a.mb)

    def cross_rank_messages(self, a: Action) -> int:
        """How many cross-rank tensors ``a`` consumes or sends (0-2)."""
        return (self.incoming(a) is not None) + (self.outgoing(a) is not None)

    def microbatches_of(self, stage: int) -> tuple[int, ...]:
        for chain, mbs in zip(self.chains, self.chain_microbatches, strict=True):
            if stage in chain:
                return mbs
        raise ScheduleError(f"stage {stage} is in no chain")

    def rows(self) -> list[list[str]]:
        """One row of action strings per rank (torch's CSV layout)."""
        return [[str(a) for a in self.actions[r]] for r in range(self.ranks)]

    def with_comms(self) -> dict[int, list[Action]]:
        """Lower to explicit communication: SEND right after the producing compute, RECV right before the consumer.

        Same-rank neighbours (V placement, Chimera ends) exchange tensors locally without SEND/RECV, as in torch.
        """
        out: dict[int, list[Action]] = {r: [] for r in range(self.ranks)}
        for r in range(self.ranks):
            for a in self.actions[r]:
                prev, nxt = self.neighbours(a.stage) if a.kind != "REDUCE_GRAD" else (None, None)
                if a.kind == "F" and prev is not None and self.stage_rank[prev] != r:
                    out[r].append(Action(a.stage, "RECV_F", a.mb))
                if a.kind in ("B", "I") and nxt is not None and self.stage_rank[nxt] != r:
                    out[r].append(Action(a.stage, "RECV_B", a.mb))
                out[r].append(a)
                if a.kind == "F" and nxt is not None and self.stage_rank[nxt] != r:
                    out[r].append(Action(a.stage, "SEND_F", a.mb))
                if a.kind in ("B", "I") and prev is not None and self.stage_rank[prev] != r:
                    out[r].append(Action(a.stage, "SEND_B", a.mb))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ranks": self.ranks, "microbatches": self.microbatches, "stage_rank": list(self.stage_rank),
                "chains": [list(c) for c in self.chains], "chain_microbatches": [list(c) for c in self.chain_microbatches],
                "stage_layers": list(self.stage_layers), "actions": self.rows(), "meta": dict(self.meta)}

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str | None = None) -> Schedule:
        try:
            actions = {r: [Action.parse(x, source=source, where=f"actions[{r}][{k}]") for k, x in enumerate(row)]
                       for r, row in enumerate(data["actions"])}
            return cls(name=str(data["name"]), ranks=int(data["ranks"]), microbatches=int(data["microbatches"]),
                       stage_rank=tuple(data["stage_rank"]), chains=tuple(tuple(c) for c in data["chains"]),
                       chain_microbatches=tuple(tuple(c) for c in data["chain_microbatches"]), actions=actions,
                       stage_layers=tuple(data.get("stage_layers", ())), meta=dict(data.get("meta", {})))
        except (KeyError, TypeError, ValueError) as exc:
            raise ScheduleError(f"malformed schedule: {exc}", source=source) from None


def _single_chain(name: str, ranks: int, m: int, stage_rank: Sequence[int], actions: dict[int, list[Action]], **meta) -> Schedule:
    return Schedule(name, ranks, m, tuple(stage_rank), (tuple(range(len(stage_rank))),), (tuple(range(m)),), actions, meta=meta)


def _check(ranks: int, microbatches: int) -> None:
    if ranks < 1:
        raise ScheduleError("need at least one rank", where="ranks")
    if microbatches < 1:
        raise ScheduleError("need at least one micro-batch", where="--microbatches")


def gpipe(ranks: int, microbatches: int) -> Schedule:
    """GPipe: all forwards, then all backwards (micro-batch order, as torch's ``ScheduleGPipe``)."""
    _check(ranks, microbatches)
    acts = {r: [Action(r, "F", k) for k in range(microbatches)] + [Action(r, "B", k) for k in range(microbatches)] for r in range(ranks)}
    return _single_chain("gpipe", ranks, microbatches, range(ranks), acts)


def one_f_one_b(ranks: int, microbatches: int) -> Schedule:
    """1F1B (PipeDream-Flush / DAPPLE): ``p-1-r`` warm-up forwards on rank r, then alternate, then drain."""
    _check(ranks, microbatches)
    acts: dict[int, list[Action]] = {}
    for r in range(ranks):
        warm = min(ranks - 1 - r, microbatches)
        seq = [Action(r, "F", k) for k in range(warm)]
        for k in range(microbatches - warm):
            seq += [Action(r, "F", warm + k), Action(r, "B", k)]
        seq += [Action(r, "B", k) for k in range(microbatches - warm, microbatches)]
        acts[r] = seq
    return _single_chain("1f1b", ranks, microbatches, range(ranks), acts)


def zb_h1(ranks: int, microbatches: int) -> Schedule:
    """Zero Bubble ZB-H1 (Qi et al., ICLR 2024): 1F1B with the backward split into I and W.

    Rank r runs ``p-1-r`` warm-up forwards, then ``F, I`` pairs; it defers each W by ``r`` backward slots
    (rank 0 runs W right after I, the last rank holds up to ``p-1`` W's back), and W's fill the drain. Peak
    activations stay those of 1F1B; the bubble becomes ``(p-1)(F+I-W)``. Same construction as the v=1 case of
    torch's ``ScheduleInterleavedZeroBubble``.
    """
    _check(ranks, microbatches)
    acts: dict[int, list[Action]] = {}
    for r in range(ranks):
        warm = min(ranks - 1 - r, microbatches)
        seq = [Action(r, "F", k) for k in range(warm)]
        next_w = 0
        for b in range(microbatches):
            if warm + b < microbatches:
                seq.append(Action(r, "F", warm + b))
            seq.append(Action(r, "I", b))
            if b >= r:
                seq.append(Action(r, "W", next_w))
                next_w += 1
        seq += [Action(r, "W", k) for k in range(next_w, microbatches)]
        acts[r] = seq
    return _single_chain("zbh1", ranks, microbatches, range(ranks), acts)


def interleaved_1f1b(ranks: int, microbatches: int, chunks: int = 2) -> Schedule:
    """Interleaved 1F1B (Narayanan et al., SC'21): ``chunks`` virtual stages per rank, stage k on rank ``k % p``.

    Micro-batches go through the chunks in rounds of ``mpr`` (= p when ``m`` is a multiple of p); rank r runs
    ``(v-1)*mpr + 2*(p-1-r)`` warm-up forwards, then one forward and one backward per step (backwards visit
    the chunks in reverse), then drains. Requires ``m >= p`` and ``m`` divisible by the number of rounds.
    """
    _check(ranks, microbatches)
    p, v, m = ranks, chunks, microbatches
    if v < 1:
        raise ScheduleError("need at least one chunk per rank", where="--chunks")
    if m < p:
        raise ScheduleError(f"interleaved 1F1B needs at least as many micro-batches ({m}) as ranks ({p})", where="--microbatches")
    rounds = max(1, m // p)
    if m % rounds:
        raise ScheduleError(f"interleaved 1F1B needs the micro-batches ({m}) to divide into {rounds} rounds", where="--microbatches")
    mpr = m // rounds
    acts: dict[int, list[Action]] = {}
    for r in range(p):
        total = m * v
        warm = min((v - 1) * mpr + 2 * (p - 1 - r), total)
        f_next: dict[int, int] = {}
        b_next: dict[int, int] = {}

        def fwd(step: int, r=r, f_next=f_next) -> Action:
            stage = ((step // mpr) % v) * p + r
            k = f_next.get(stage, 0)
            f_next[stage] = k + 1
            return Action(stage, "F", k)

        def bwd(step: int, r=r, b_next=b_next, warm=warm) -> Action:
            stage = (v - 1 - ((step - warm) // mpr) % v) * p + r
            k = b_next.get(stage, 0)
            b_next[stage] = k + 1
            return Action(stage, "B", k)

        seq = [fwd(s) for s in range(warm)]
        for s in range(warm, total):
            seq += [fwd(s), bwd(s)]
        seq += [bwd(s) for s in range(total, total + warm)]
        acts[r] = seq
    return Schedule("interleaved", p, m, tuple(k % p for k in range(p * v)), (tuple(range(p * v)),), (tuple(range(m)),), acts,
                    meta={"chunks": v})


def chimera(ranks: int, microbatches: int) -> Schedule:
    """Chimera (Li & Hoefler, SC'21): a down and an up pipeline over the same ranks, merged per rank.

    Half of the micro-batches go down (stage i on rank i), half go up (the replica of stage i on rank
    D-1-i), so every rank holds two stages. The per-rank order comes from a list schedule of both pipelines
    on the shared ranks (see ``_chimera_order``). Deviation from the paper: instead of concatenating basic
    units of D micro-batches and repairing the seams with forward doubling / backward halving, the list
    schedule runs over all micro-batches at once; with forward = backward it reaches the paper's bubble
    ``(D-2)/(2N+D-2)`` whenever N is a multiple of D (``tests/test_pipe_schedules.py``). Each rank ends with a
    ``REDUCE_GRAD`` per replica it holds. Requires an even number of ranks and of micro-batches.
    """
    _check(ranks, microbatches)
    D, m = ranks, microbatches
    if D % 2 or D < 2:
        raise ScheduleError(f"Chimera needs an even number of ranks, got {D}", where="--stages")
    if m % 2:
        raise ScheduleError(f"Chimera needs an even number of micro-batches, got {m}", where="--microbatches")
    half = m // 2
    local = _chimera_order(D, half)
    acts: dict[int, list[Action]] = {}
    for r in range(D):
        acts[r] = [Action(a.stage, a.kind, a.mb + (0 if a.stage < D else half)) for a in local[r]]
        acts[r] += [Action(r, "REDUCE_GRAD"), Action(2 * D - 1 - r, "REDUCE_GRAD")]
    stage_rank = tuple(range(D)) + tuple(D - 1 - i for i in range(D))
    return Schedule("chimera", D, m, stage_rank, (tuple(range(D)), tuple(range(D, 2 * D))),
                    (tuple(range(half)), tuple(range(half, m))), acts, stage_layers=tuple(range(D)) + tuple(range(D)),
                    meta={"pipelines": 2})


def _chimera_order(D: int, half: int) -> dict[int, list[Action]]:
    """Per-rank order of both Chimera pipelines (local micro-batch ids 0..half-1 in each direction).

    A list schedule of both pipelines on the shared ranks in unit time slots (forward = backward = one slot,
    the setting of the paper's bubble analysis): whenever a rank is free it runs a ready backward before a
    ready forward, lowest micro-batch first. For even D and N = 2*half micro-batches this packs the run into
    ``2N + D - 2`` slots, the paper's ``(D-2)/(2N+D-2)`` bubble.
    """
    rank_of = {i: i for i in range(D)} | {D + i: D - 1 - i for i in range(D)}
    prev = {s: (None if s % D == 0 else s - 1) for s in range(2 * D)}
    nxt = {s: (None if s % D == D - 1 else s + 1) for s in range(2 * D)}
    pending = {r: [] for r in range(D)}
    for sid in range(2 * D):
        for k in range(half):
            pending[rank_of[sid]] += [Action(sid, "F", k), Action(sid, "B", k)]
    done_at: dict[tuple[int, str, int | None], int] = {}
    free = [0] * D
    order: dict[int, list[Action]] = {r: [] for r in range(D)}
    slot = 0
    never = 1 << 30
    while any(pending.values()):
        for r in range(D):
            if free[r] > slot:
                continue
            ready = []
            for a in pending[r]:
                if a.kind == "F":
                    ok = prev[a.stage] is None or done_at.get((prev[a.stage], "F", a.mb), never) <= slot
                else:
                    ok = done_at.get((a.stage, "F", a.mb), never) <= slot and (
                        nxt[a.stage] is None or done_at.get((nxt[a.stage], "B", a.mb), never) <= slot)
                if ok:
                    ready.append(a)
            if ready:
                a = min(ready, key=lambda a: (a.kind != "B", a.mb, a.stage))
                pending[r].remove(a)
                order[r].append(a)
                done_at[(a.stage, a.kind, a.mb)] = slot + 1
                free[r] = slot + 1
        slot += 1
    return order


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "zbh1": zb_h1, "interleaved": interleaved_1f1b, "chimera": chimera}


def make_schedule(family: str, ranks: int, microbatches: int, chunks: int = 2) -> Schedule:
    """Build a schedule by family name (``gpipe``, ``1f1b``, ``zbh1``, ``interleaved``, ``chimera``)."""
    if family not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {family!r}, expected one of {sorted(SCHEDULES)}", where="--schedule")
    if family == "interleaved":
        return interleaved_1f1b(ranks, microbatches, chunks)
    return SCHEDULES[family](ranks, microbatches)


# --------------------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------------------

def validate(schedule: Schedule, costs: dict[int, Any] | None = None, memory_limit: Sequence[float] | float | None = None,
             links: Any = None) -> list[str]:
    """Problems with ``schedule`` (empty list when valid).

    Structural: every action's stage is on the rank that runs it; each stage runs F, and either B or I and W,
    exactly once for each of its chain's micro-batches; on its rank F precedes the backward and I precedes W.
    Deadlock: a dependency-driven dry run (unit durations unless ``costs`` are given) must run every action.
    Memory: with ``costs`` and ``memory_limit`` (bytes per rank), the simulated per-rank peak must fit.
    """
    problems: list[str] = []
    if sorted(schedule.actions) != list(range(schedule.ranks)):
        problems.append(f"ranks {sorted(schedule.actions)} do not match 0..{schedule.ranks - 1}")
        return problems
    seen: dict[tuple[int, str], list[int]] = {}
    for r in range(schedule.ranks):
        done: set[tuple[int, str, int | None]] = set()
        for pos, a in enumerate(schedule.actions[r]):
            if a.kind not in COMPUTE_KINDS + ("REDUCE_GRAD",):
                problems.append(f"rank {r} step {pos}: {a} is not a compute action (schedules hold compute only; see with_comms)")
                continue
            if not 0 <= a.stage < schedule.num_stages:
                problems.append(f"rank {r} step {pos}: stage {a.stage} does not exist")
                continue
            if schedule.stage_rank[a.stage] != r:
                problems.append(f"rank {r} step {pos}: {a} belongs to rank {schedule.stage_rank[a.stage]}")
            if a.kind in ("B", "I") and (a.stage, "F", a.mb) not in done:
                problems.append(f"rank {r} step {pos}: {a} before its forward")
            if a.kind == "W" and (a.stage, "I", a.mb) not in done:
                problems.append(f"rank {r} step {pos}: {a} before its input backward")
            if a.kind != "REDUCE_GRAD":
                if (a.stage, a.kind, a.mb) in done:
                    problems.append(f"rank {r} step {pos}: {a} runs twice")
                seen.setdefault((a.stage, a.kind), []).append(a.mb)
            done.add((a.stage, a.kind, a.mb))
    for stage in range(schedule.num_stages):
        want = sorted(schedule.microbatches_of(stage))
        if sorted(seen.get((stage, "F"), [])) != want:
            problems.append(f"stage {stage}: forwards for micro-batches {sorted(seen.get((stage, 'F'), []))}, expected {want}")
        full = seen.get((stage, "B"), [])
        inputs = seen.get((stage, "I"), [])
        weights = seen.get((stage, "W"), [])
        if sorted(full + inputs) != want or sorted(inputs) != sorted(weights):
            problems.append(f"stage {stage}: backwards B={sorted(full)} I={sorted(inputs)} W={sorted(weights)}, expected each micro-batch once")
    if problems:
        return problems
    from .simulate import StageCost, simulate

    unit = {s: StageCost(f=1.0, b=2.0, i=1.0, w=1.0) for s in range(schedule.num_stages)}
    try:
        result = simulate(schedule, costs or unit, links=links)
    except ScheduleError as exc:
        return [str(exc)]
    if costs is not None and memory_limit is not None:
        limits = [memory_limit] * schedule.ranks if isinstance(memory_limit, int | float) else list(memory_limit)
        for r, peak in enumerate(result.peak_memory):
            if peak > limits[r]:
                problems.append(f"rank {r}: peak memory {peak / 2**30:.2f} GiB exceeds the limit {limits[r] / 2**30:.2f} GiB")
    return problems
