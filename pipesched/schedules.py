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

import functools
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


def bytes_text(nbytes: float) -> str:
    """A byte count for messages, in the largest binary unit that keeps it >= 1 (``150 B``, ``1.50 GiB``).

    >>> bytes_text(150), bytes_text(3 * 2**29), bytes_text(2**30 - 1)
    ('150 B', '1.50 GiB', '1024.00 MiB')
    """
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.4g} B"


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


def _rounds(p: int, m: int, family: str) -> int:
    """Micro-batches per round of a looped schedule (torch: ``m // max(1, m // p)``); ``m`` must split into whole rounds."""
    rounds = max(1, m // p)
    if m % rounds:
        raise ScheduleError(f"{family} needs the micro-batches ({m}) to divide into {rounds} rounds", where="--microbatches")
    return m // rounds


def _looped_order(p: int, m: int, v: int, r: int, zero_bubble: bool) -> list[Action]:
    """Rank r's actions in a looped (stage k on rank ``k % p``) one-forward-one-backward schedule.

    Forwards visit the rank's chunks in rounds of ``mpr`` micro-batches, backwards the chunks in reverse, after
    ``(v-1)*mpr + f*(p-1-r)`` warm-up forwards (f = 2 for interleaved 1F1B, 1 for interleaved zero bubble). With
    ``zero_bubble`` the backward is split into I and W, and rank r runs its W's ``r`` steps behind its I's (ZB-1P);
    the drain runs the W's left. This is the order torch's ``_get_1f1b_rank_ops`` builds, empty slots left out.
    """
    mpr = m if v == 1 and zero_bubble else _rounds(p, m, "a looped schedule")
    warm = min((v - 1) * mpr + (1 if zero_bubble else 2) * (p - 1 - r), m * v)
    total = m * v
    f_next: dict[int, int] = {}
    b_next: dict[int, int] = {}
    w_next: dict[int, int] = {}

    def stage_of(step: int, backward: bool) -> int:
        local = (v - 1 - ((step - warm) // mpr) % v) if backward else (step // mpr) % v
        return local * p + r

    def take(counter: dict[int, int], stage: int, kind: str) -> Action:
        k = counter.get(stage, 0)
        counter[stage] = k + 1
        return Action(stage, kind, k)

    seq = [take(f_next, stage_of(step, False), "F") for step in range(warm)]
    backward_steps: list[int] = []
    weights = 0
    for step in range(warm, total + warm):
        if step < total:
            seq.append(take(f_next, stage_of(step, False), "F"))
        seq.append(take(b_next, stage_of(step, True), "I" if zero_bubble else "B"))
        backward_steps.append(step)
        if zero_bubble and step - warm >= r:
            seq.append(take(w_next, stage_of(backward_steps[weights], True), "W"))
            weights += 1
    if zero_bubble:
        seq += [take(w_next, stage_of(step, True), "W") for step in backward_steps[weights:]]
    return seq


def interleaved_1f1b(ranks: int, microbatches: int, chunks: int = 2) -> Schedule:
    """Interleaved 1F1B (Narayanan et al., SC'21): ``chunks`` virtual stages per rank, stage k on rank ``k % p``.

    Micro-batches go through the chunks in rounds of ``mpr`` (= p when ``m`` is a multiple of p); rank r runs
    ``(v-1)*mpr + 2*(p-1-r)`` warm-up forwards, then one forward and one backward per step (backwards visit
    the chunks in reverse), then drains. Requires ``m >= p`` and ``m`` divisible by the number of rounds.
    torch: ``ScheduleInterleaved1F1B``.
    """
    _check(ranks, microbatches)
    p, v, m = ranks, chunks, microbatches
    if v < 1:
        raise ScheduleError("need at least one chunk per rank", where="--chunks")
    if m < p:
        raise ScheduleError(f"interleaved 1F1B needs at least as many micro-batches ({m}) as ranks ({p})", where="--microbatches")
    _rounds(p, m, "interleaved 1F1B")
    acts = {r: _looped_order(p, m, v, r, zero_bubble=False) for r in range(p)}
    return Schedule("interleaved", p, m, tuple(k % p for k in range(p * v)), (tuple(range(p * v)),), (tuple(range(m)),), acts,
                    meta={"chunks": v})


def interleaved_zb(ranks: int, microbatches: int, chunks: int = 2) -> Schedule:
    """Interleaved zero bubble (Qi et al., ICLR 2024, ZB-1P on v chunks), torch's ``ScheduleInterleavedZeroBubble``.

    The interleaved 1F1B order with the backward split into I and W: ``(v-1)*mpr + (p-1-r)`` warm-up forwards
    on rank r, then F, I per step with each W run ``r`` steps after its I, the W's left filling the drain. With
    ``chunks=1`` it is ZB-H1 (:func:`zb_h1`). Requires ``m`` divisible by its ``max(1, m // p)`` rounds.
    """
    _check(ranks, microbatches)
    p, v, m = ranks, chunks, microbatches
    if v < 1:
        raise ScheduleError("need at least one chunk per rank", where="--chunks")
    _rounds(p, m, "interleaved zero bubble")
    acts = {r: _looped_order(p, m, v, r, zero_bubble=True) for r in range(p)}
    return Schedule("interleaved_zb", p, m, tuple(k % p for k in range(p * v)), (tuple(range(p * v)),), (tuple(range(m)),), acts,
                    meta={"chunks": v})


def looped_bfs(ranks: int, microbatches: int, chunks: int = 2) -> Schedule:
    """Breadth-first looped pipeline (Lamy-Poirier, 2023), torch's ``ScheduleLoopedBFS``: stage k on rank ``k % p``.

    Each rank runs all micro-batches' forwards through its first chunk, then its next chunk, and so on, then the
    backwards chunk by chunk in reverse, last micro-batch first. Like GPipe it holds all ``m`` micro-batches of
    every chunk; its bubble is GPipe's ``(p-1)/(m+p-1)`` share when ``m >= p`` (each chunk's forwards of all
    micro-batches keep the ranks busy while the next chunk's inputs arrive).
    """
    _check(ranks, microbatches)
    p, v, m = ranks, chunks, microbatches
    if v < 1:
        raise ScheduleError("need at least one chunk per rank", where="--chunks")
    acts: dict[int, list[Action]] = {}
    for r in range(p):
        local = [c * p + r for c in range(v)]
        acts[r] = [Action(st, "F", k) for st in local for k in range(m)] + [Action(st, "B", k) for st in reversed(local)
                                                                             for k in reversed(range(m))]
    return Schedule("looped_bfs", p, m, tuple(k % p for k in range(p * v)), (tuple(range(p * v)),), (tuple(range(m)),), acts,
                    meta={"chunks": v})


def v_stage_rank(ranks: int) -> tuple[int, ...]:
    """V placement of ``2p`` stages (torch's ``generate_stage_to_rank_mapping(style="v")``): stage i and ``2p-1-i`` on rank i."""
    return tuple(range(ranks)) + tuple(reversed(range(ranks)))


def zbv(ranks: int, microbatches: int) -> Schedule:
    """ZB-V (Qi et al., ICLR 2024, section 6), torch's ``ScheduleZBVZeroBubble``: two chunks per rank in a V.

    Stage i and stage ``2p-1-i`` live on rank i, so the last stage is on rank 0 next to the first and the turn at
    the bottom of the V is local. Rank r: ``2(p-r)-1`` forwards of its first chunk, ``r`` pairs of second- and
    first-chunk forwards, ``p-r`` second-chunk F, I, W triples, then F, I, W on each chunk in turn, then the drain.
    With F = I = W it is bubble-free up to the ``(p-1)``-step fill; memory stays that of 1F1B (``2p`` chunk
    activations, i.e. ``p`` micro-batches of the whole model per rank at most).
    """
    _check(ranks, microbatches)
    p, m = ranks, microbatches
    n_micro = max(2 * p - 1, m)
    acts: dict[int, list[Action]] = {}
    for r in range(p):
        c0, c1 = r, 2 * p - 1 - r
        seq: list[Action] = []
        f0 = f1 = b0 = b1 = 0
        for _ in range(2 * (p - r) - 1):
            seq.append(Action(c0, "F", f0))
            f0 += 1
        for _ in range(r):
            seq += [Action(c1, "F", f1), Action(c0, "F", f0)]
            f1 += 1
            f0 += 1
        for _ in range(p - r):
            seq += [Action(c1, "F", f1), Action(c1, "I", b1), Action(c1, "W", b1)]
            f1 += 1
            b1 += 1
        while f1 < f0 or f0 < n_micro:
            if f0 < n_micro:
                seq.append(Action(c0, "F", f0))
                f0 += 1
            seq += [Action(c0, "I", b0), Action(c0, "W", b0), Action(c1, "F", f1), Action(c1, "I", b1), Action(c1, "W", b1)]
            b0 += 1
            f1 += 1
            b1 += 1
        w0, w1 = b0, b1
        for _ in range(r):
            seq += [Action(c0, "I", b0), Action(c1, "I", b1)]
            b0 += 1
            b1 += 1
        for _ in range(p - r):
            seq += [Action(c0, "I", b0), Action(c0, "W", w0)]
            b0 += 1
            w0 += 1
        seq += [Action(c1, "W", k) for k in range(w1, b1)] + [Action(c0, "W", k) for k in range(w0, b0)]
        acts[r] = [a for a in seq if a.mb < m]     # torch plans max(2p-1, m) micro-batches and drops the extra ones
    return Schedule("zbv", p, m, v_stage_rank(p), (tuple(range(2 * p)),), (tuple(range(m)),), acts, meta={"chunks": 2})


def dualpipev(ranks: int, microbatches: int) -> Schedule:
    """DualPipe-V (DeepSeek-V3's DualPipe folded into a V), torch's ``ScheduleDualPipeV``: two chunks per rank in a V.

    Rank r: ``2(p-r-1)`` first-chunk forwards, ``r+1`` forward pairs, ``p-r-1`` zero-bubble steps (second-chunk
    I, a pending W, F), then the main phase of overlapped forward/backward pairs (F of one chunk with the full
    backward of the other), the drain with full backwards turning into I's half way (W's deferred into the
    last steps). torch runs an overlapped pair as its two actions in order (F, then B), which is how they are
    listed here; torch's overlap of their communication with computation is not modelled. Requires
    ``m >= 2p``.
    """
    _check(ranks, microbatches)
    p, m = ranks, microbatches
    if m < 2 * p:
        raise ScheduleError(f"DualPipe-V needs at least as many micro-batches ({m}) as stages ({2 * p})", where="--microbatches")
    acts: dict[int, list[Action]] = {}
    for r in range(p):
        c0, c1 = r, 2 * p - 1 - r
        seq: list[Action] = []
        count: dict[tuple[int, str], int] = {}
        pending_w: list[tuple[int, int]] = []

        def add(stage: int, kind: str, seq=seq, count=count, pending_w=pending_w) -> None:
            key = (stage, "I" if kind == "B" else kind)
            k = count.get(key, 0)
            seq.append(Action(stage, kind, k))
            count[key] = k + 1
            if kind == "B":
                count[(stage, "W")] = count.get((stage, "W"), 0) + 1
            elif kind == "I":
                pending_w.append((stage, k))

        def weight(seq=seq, pending_w=pending_w) -> None:
            if pending_w:
                stage, k = pending_w.pop(0)
                seq.append(Action(stage, "W", k))

        for _ in range(2 * (p - r - 1)):
            add(c0, "F")
        for _ in range(r + 1):
            add(c0, "F")
            add(c1, "F")
        for _ in range(p - r - 1):
            add(c1, "I")
            weight()
            add(c1, "F")
        for _ in range(m - 2 * p + r + 1):
            add(c0, "F")
            add(c1, "B")
            add(c1, "F")
            add(c0, "B")
        for _ in range(p - r - 1):
            add(c1, "B")
            add(c1, "F")
            add(c0, "B")
        split = False
        for i in range(r + 1):
            if i == (r + 1) // 2 and r % 2 == 1:
                split = True
            add(c1, "I" if split else "B")
            if i == (r + 1) // 2 and r % 2 == 0:
                split = True
            add(c0, "I" if split else "B")
        for _ in range(p - r - 1):
            weight()
            add(c0, "I" if split else "B")
        for _ in range(r + 1):
            weight()
        acts[r] = seq
    return Schedule("dualpipev", p, m, v_stage_rank(p), (tuple(range(2 * p)),), (tuple(range(m)),), acts, meta={"chunks": 2})


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


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "zbh1": zb_h1, "interleaved": interleaved_1f1b, "chimera": chimera,
             "interleaved_zb": interleaved_zb, "looped_bfs": looped_bfs, "zbv": zbv, "dualpipev": dualpipev}
LOOPED = ("interleaved", "interleaved_zb", "looped_bfs")     # v chunks per rank, stage k on rank k % p
V_SHAPED = ("zbv", "dualpipev")                               # two chunks per rank, stage i and 2p-1-i on rank i


def make_schedule(family: str, ranks: int, microbatches: int, chunks: int = 2) -> Schedule:
    """Build a schedule by family name (:data:`SCHEDULES`); ``chunks`` is the looped families' chunks per rank."""
    if family not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {family!r}, expected one of {sorted(SCHEDULES)}", where="--schedule")
    if family in LOOPED:
        return SCHEDULES[family](ranks, microbatches, chunks)
    return SCHEDULES[family](ranks, microbatches)


def schedule_in_flight(schedule: Schedule) -> dict[int, int]:
    """Peak micro-batches each stage id holds, counted along its rank's order: +1 at F, -1 at B or W (a micro-batch's
    graph lives until its weight gradient). A rank runs its actions one at a time, so this is what the simulator's
    ``peak_in_flight`` reports for any costs.

    >>> schedule_in_flight(zb_h1(3, 6))
    {0: 3, 1: 3, 2: 3}
    """
    peak = {s: 0 for s in range(schedule.num_stages)}
    for acts in schedule.actions.values():
        level: dict[int, int] = {}
        for a in acts:
            if a.kind == "F":
                level[a.stage] = level.get(a.stage, 0) + 1
                peak[a.stage] = max(peak[a.stage], level[a.stage])
            elif a.kind in ("B", "W"):
                level[a.stage] = level.get(a.stage, 0) - 1
    return peak


@functools.lru_cache(maxsize=32)
def cached_schedule(family: str, ranks: int, microbatches: int, chunks: int = 2) -> Schedule:
    """:func:`make_schedule`, generated once per shape for the planner; shared, so callers must not modify it."""
    return make_schedule(family, ranks, microbatches, chunks=chunks)


# --------------------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------------------

MEMORY_REL_TOL = 1e-9


def fits_memory(need: float, limit: float) -> bool:
    """``need <= limit`` up to floating-point rounding (prefix sums of byte counts can land a few ulps over an exact fit)."""
    return need <= limit * (1 + MEMORY_REL_TOL) + 1e-9


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
            if not fits_memory(peak, limits[r]):
                problems.append(f"rank {r}: peak memory {bytes_text(peak)} exceeds the limit {bytes_text(limits[r])}")
    return problems
