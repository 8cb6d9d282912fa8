"""Data parallel: the in-job communication plan over a model's parameters, and the DDP hook that carries it out.

The plan (:func:`make_plan`, pure Python) is made once, on rank 0, from the model's trainable
parameters (names, element counts, element sizes) and the bundle's ``data_parallel`` knobs, and
broadcast; every rank then checks that its own parameters are rank 0's (a digest of names, shapes
and dtypes). A plan is a static sequence of *transfers*; a transfer fuses *pieces* (a parameter's
elements ``[start, start + count)``) into one all-reduce. Every rank issues the transfers in the
plan's order, so no coordinator is needed (ByteScheduler needs Horovod's for its dynamic queue).

Policies (``data_parallel.policy``):

- ``ddp``: whole parameters in gradient-ready order, fused up to ``params.bucket_cap_bytes``
  (default 25 MiB; the first transfer ``params.first_bucket_bytes``, default 1 MiB), no credit limit:
  what DDP's reducer does.
- ``bytescheduler`` (ByteScheduler, SOSP 2019): every parameter split into pieces of at most
  ``partition_bytes``, a priority queue with the front layers first, at most ``credit_bytes`` in
  flight. The queue is replayed on the gradient-ready model below to get a static order.
- ``prophet`` (Prophet, ICPP 2021): gradients grouped into stages at the compute gaps; when a stage is
  complete, the most urgent ready pieces that fit in ``bandwidth x gap`` go as one block; after the
  last stage the rest goes in priority order under ``credit_bytes`` (default two partitions).

The gradient-ready model (deviation from the papers, which profile a pre-run): gradients become
ready in reverse parameter order (DDP's assumption for its buckets), each after a share of the
backward pass ``params.backward_s`` (default 1.0) proportional to its bytes; the link carries
``params.bandwidth_Bps`` (default: all gradient bytes in one backward pass, i.e. communication as
long as the backward) with ``params.overhead_s`` (default 0) per launch. Only the ratio of compute to
bandwidth shapes the plan; the launch side can give measured numbers in ``params``.

:class:`PlannedAllReduce` is a real ``DDP.register_comm_hook`` hook: DDP hands it each bucket when the
bucket's gradients are ready (in the same bucket order on every rank); a communication thread issues
the plan's transfers in order, each as soon as its pieces' buckets are in and the credit allows,
and completes a bucket's future when all of its parameters' pieces are reduced. DDP's barrier stays
(backward returns after every bucket is done); cross-barrier scheduling is
``flowsched.ddp.GradientScheduler``'s.

>>> params = [("w0", 1000, 4), ("b0", 10, 4), ("w1", 1000, 4)]
>>> p = make_plan(params, "bytescheduler", partition_bytes=2000, credit_bytes=4000)
>>> [[(x.param, x.start, x.count) for x in t] for t in p.transfers][:3]   # w1 ready first: its first piece goes first
[[(2, 0, 500)], [(2, 500, 500)], [(1, 0, 10)]]
>>> sorted(covered(p, [n for _, n, _ in params]))
[0, 1, 2]
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .plan import PlanFormatError

MiB = 1 << 20
POLICIES = ("ddp", "bytescheduler", "prophet")


class ModelMismatchError(PlanFormatError):
    """The model in the training script does not fit the plan (or differs between ranks)."""


@dataclass(frozen=True)
class Piece:
    param: int        # index in the plan's parameter list
    start: int        # first element
    count: int        # elements


@dataclass
class CommPlan:
    """A static in-job communication plan over named parameters (see the module docstring)."""

    policy: str
    names: list[str]
    transfers: list[list[Piece]]
    credit_bytes: float | None          # None: no limit
    elem_bytes: list[int]
    knobs: dict[str, Any] = field(default_factory=dict)

    def transfer_bytes(self, k: int) -> int:
        return sum(p.count * self.elem_bytes[p.param] for p in self.transfers[k])

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "names": self.names, "credit_bytes": self.credit_bytes, "elem_bytes": self.elem_bytes,
                "knobs": self.knobs, "transfers": [[[p.param, p.start, p.count] for p in t] for t in self.transfers]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CommPlan:
        return cls(d["policy"], list(d["names"]), [[Piece(*x) for x in t] for t in d["transfers"]], d["credit_bytes"],
                   list(d["elem_bytes"]), dict(d["knobs"]))


def covered(plan: CommPlan, numels: Sequence[int]) -> dict[int, int]:
    """Parameter index -> elements the plan reduces; raises ``ValueError`` unless every element of every
    parameter is in exactly one piece (the invariant the hook relies on)."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for t in plan.transfers:
        for p in t:
            spans.setdefault(p.param, []).append((p.start, p.start + p.count))
    for i, n in enumerate(numels):
        s = sorted(spans.get(i, []))
        if not s or s[0][0] != 0 or s[-1][1] != n or any(a[1] != b[0] for a, b in zip(s, s[1:], strict=False)):
            raise ValueError(f"plan pieces of parameter {i} ({plan.names[i]}) cover {s}, expected [0, {n}) once")
    if set(spans) - set(range(len(numels))):
        raise ValueError(f"plan names parameters {sorted(set(spans) - set(range(len(numels))))} that the model does not have")
    return {i: numels[i] for i in range(len(numels))}


def _pieces(numel: int, elem: int, partition_bytes: float | None, param: int) -> list[Piece]:
    if not partition_bytes or numel * elem <= partition_bytes:
        return [Piece(param, 0, numel)]
    per = max(1, int(partition_bytes // elem))
    return [Piece(param, a, min(per, numel - a)) for a in range(0, numel, per)]


class _Link:
    """One link of ``bandwidth`` bytes/s, ``overhead`` s per launch, at most ``credit`` bytes in flight.

    The same model as ``flowsched.intrajob``'s, kept here because the runtime imports no planner package.
    """

    def __init__(self, bandwidth: float, overhead: float, credit: float | None):
        self.bandwidth, self.overhead, self.credit = bandwidth, overhead, math.inf if credit is None else credit
        self.in_flight: list[tuple[float, float]] = []   # (end, bytes)
        self.free_at = 0.0

    def earliest(self, nbytes: float, t: float) -> float:
        pending = sorted(e for e in self.in_flight if e[0] > t)
        while pending and sum(b for _, b in pending) + nbytes > self.credit:
            t = pending.pop(0)[0]
        return t

    def launch(self, nbytes: float, t: float) -> None:
        self.in_flight = [e for e in self.in_flight if e[0] > t]
        start = max(t + self.overhead, self.free_at)
        self.free_at = start + nbytes / self.bandwidth
        self.in_flight.append((self.free_at, nbytes))


def make_plan(params: Sequence[tuple[str, int, int]], policy: str, *, partition_bytes: float | None = None,
              credit_bytes: float | None = None, knobs: dict[str, Any] | None = None) -> CommPlan:
    """The plan for parameters ``(name, numel, element bytes)`` in model order (see the module docstring)."""
    knobs = dict(knobs or {})
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}, expected one of {', '.join(POLICIES)}")
    names = [n for n, _, _ in params]
    elem = [int(e) for _, _, e in params]
    nbytes = [float(n * e) for _, n, e in params]
    total = sum(nbytes) or 1.0
    backward = float(knobs.get("backward_s", 1.0))
    bandwidth = float(knobs.get("bandwidth_Bps") or total / backward)
    overhead = float(knobs.get("overhead_s", 0.0))
    order = list(range(len(params)))[::-1]               # gradient-ready order: last parameter first
    ready, t = [0.0] * len(params), 0.0
    for i in order:
        t += backward * nbytes[i] / total
        ready[i] = t
    if policy == "ddp":
        cap, first = float(knobs.get("bucket_cap_bytes", 25 * MiB)), float(knobs.get("first_bucket_bytes", MiB))
        transfers: list[list[Piece]] = []
        current: list[Piece] = []
        size, limit = 0.0, min(cap, first)
        for i in order:
            if current and size + nbytes[i] > limit:
                transfers.append(current)
                current, size, limit = [], 0.0, cap
            current.append(Piece(i, 0, params[i][1]))
            size += nbytes[i]
        if current:
            transfers.append(current)
        return CommPlan(policy, names, transfers, None, elem, knobs)
    partition = float(partition_bytes or 4 * MiB)
    pieces = {i: _pieces(params[i][1], elem[i], partition, i) for i in order}
    size = {i: float(pieces[i][0].count * elem[i]) for i in order}
    if policy == "bytescheduler":
        credit = float(credit_bytes if credit_bytes is not None else 4 * partition)
        return CommPlan(policy, names, _bytescheduler_order(order, ready, pieces, elem, _Link(bandwidth, overhead, credit)),
                        credit, elem, {**knobs, "partition_bytes": partition})
    credit = float(credit_bytes if credit_bytes is not None else 2 * partition)
    gap_factor = float(knobs.get("gap_factor", 2.0))
    return CommPlan(policy, names, _prophet_order(order, ready, pieces, elem, bandwidth, overhead, gap_factor), credit, elem,
                    {**knobs, "partition_bytes": partition, "largest_piece_bytes": max(size.values(), default=0.0)})


def _bytescheduler_order(order: list[int], ready: list[float], pieces: dict[int, list[Piece]], elem: list[int],
                         link: _Link) -> list[list[Piece]]:
    """ByteScheduler's priority queue (lowest parameter index first) replayed on the ready model."""
    arrivals = [(ready[i], i) for i in order]
    heap: list[tuple[int, int, Piece]] = []
    out: list[list[Piece]] = []
    k, now, seq = 0, 0.0, 0
    while k < len(arrivals) or heap:
        while k < len(arrivals) and arrivals[k][0] <= now:
            for piece in pieces[arrivals[k][1]]:
                heapq.heappush(heap, (piece.param, seq, piece))
                seq += 1
            k += 1
        if not heap:
            now = arrivals[k][0]
            continue
        top = heap[0][2]
        when = link.earliest(top.count * elem[top.param], now)
        if k < len(arrivals) and arrivals[k][0] < when:
            now = arrivals[k][0]          # a more urgent gradient may arrive before the credit frees up
            continue
        piece = heapq.heappop(heap)[2]
        link.launch(piece.count * elem[piece.param], when)
        out.append([piece])
        now = when
    return out


def _prophet_order(order: list[int], ready: list[float], pieces: dict[int, list[Piece]], elem: list[int], bandwidth: float,
                   overhead: float, gap_factor: float) -> list[list[Piece]]:
    """Prophet's blocks: stages at gaps > gap_factor x the mean gap (one per gradient when none stands out)."""
    gaps = [ready[b] - ready[a] for a, b in zip(order, order[1:], strict=False)]
    mean = sum(gaps) / len(gaps) if gaps else 0.0
    stages: list[list[int]] = [[order[0]]] if order else []
    for i, gap in zip(order[1:], gaps, strict=True):
        if gap > gap_factor * mean:
            stages.append([])
        stages[-1].append(i)
    if len(stages) == 1:
        stages = [[i] for i in order]
    stack: list[Piece] = []
    out: list[list[Piece]] = []
    for k, stage in enumerate(stages):
        for i in stage:
            stack.extend(pieces[i])
        if k + 1 < len(stages):
            budget = bandwidth * max(0.0, max(ready[i] for i in stages[k + 1]) - max(ready[i] for i in stage) - overhead)
            stack.sort(key=lambda p: (-p.param, -p.start))   # most urgent (lowest parameter, first piece) on top
            block = []
            while stack and stack[-1].count * elem[stack[-1].param] <= budget:
                piece = stack.pop()
                budget -= piece.count * elem[piece.param]
                block.append(piece)
            if block:
                out.append(block)
    stack.sort(key=lambda p: (-p.param, -p.start))
    out.extend([p] for p in reversed(stack))
    return out


def digest(summary: Sequence[tuple[str, tuple[int, ...], str]]) -> str:
    """A digest of a model's trainable parameters (name, shape, dtype), for the cross-rank check."""
    return hashlib.sha256(json.dumps([[n, list(s), d] for n, s, d in summary]).encode()).hexdigest()


def first_difference(mine: Sequence[tuple[str, tuple[int, ...], str]], ref: Sequence[tuple[str, tuple[int, ...], str]],
                     ref_name: str = "rank 0") -> str | None:
    """Where a model's parameter list first differs from the reference's (``ref_name``'s), in words (None: equal)."""
    for k, (a, b) in enumerate(zip(mine, ref, strict=False)):
        if a[0] != b[0]:
            return f"parameter {k} is {a[0]!r} here, {b[0]!r} on {ref_name}"
        if tuple(a[1]) != tuple(b[1]) or a[2] != b[2]:
            return f"parameter {a[0]!r} is {a[2]} {tuple(a[1])} here, {b[2]} {tuple(b[1])} on {ref_name}"
    if len(mine) != len(ref):
        extra = mine[len(ref)][0] if len(mine) > len(ref) else ref[len(mine)][0]
        return f"{len(mine)} trainable parameters here, {len(ref)} on {ref_name} (first unmatched: {extra!r})"
    return None


def trainable_parameters(module: Any, ignore: set[str] | frozenset[str] = frozenset()) -> list[tuple[str, Any]]:
    """``(name, parameter)`` of every trainable parameter of ``module``, each once, in DDP's order.

    As DDP's reducer collects them: every module (each once), its own parameters, those that
    require a gradient and are not in ``ignore``; a shared parameter counts once, under its first
    name. Parameters of non-leaf modules (``nn.MultiheadAttention.in_proj_weight``) are included.
    """
    out, seen = [], set()
    for mname, m in module.named_modules():
        for pname, p in m.named_parameters(recurse=False):
            name = f"{mname}.{pname}" if mname else pname
            if p.requires_grad and name not in ignore and id(p) not in seen:
                seen.add(id(p))
                out.append((name, p))
    return out


def agree_on_plan(named: Sequence[tuple[str, Any]], dp: Any, *, group: Any = None, device: Any = None, source: str = "<plan>") -> CommPlan:
    """The group's first rank makes the plan from its parameters and ``dp`` (a ``DataParallel``, or None: ddp) and
    broadcasts it with its parameter list; every rank compares its own, and the ranks gather their first
    differences, so a model that differs anywhere raises the same :class:`ModelMismatchError` on every rank."""
    import torch.distributed as dist

    summary = [(n, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in named]
    first = dist.get_global_rank(group, 0) if group is not None else 0
    box: list[Any] = [None]
    if dist.get_rank() == first:
        policy, part, credit, knobs = ("ddp", None, None, {}) if dp is None else (dp.policy, dp.partition_bytes, dp.credit_bytes, dp.params)
        plan = make_plan([(n, p.numel(), p.element_size()) for n, p in named], policy, partition_bytes=part, credit_bytes=credit,
                         knobs=knobs)
        box[0] = {"summary": summary, "digest": digest(summary), "plan": plan.to_dict()}
    dist.broadcast_object_list(box, src=first, group=group, device=device)
    ref = box[0]
    mine = None
    if digest(summary) != ref["digest"]:
        mine = first_difference(summary, [(n, tuple(s), d) for n, s, d in ref["summary"]], f"rank {first}") or "the parameter lists differ"
    diffs: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(diffs, (dist.get_rank(), mine), group=group)
    bad = [(r, d) for r, d in diffs if d is not None]
    if bad:
        r, d = bad[0]
        more = f" (and {len(bad) - 1} more ranks)" if len(bad) > 1 else ""
        raise ModelMismatchError(f"rank {r}'s model differs from rank {first}'s: {d}{more}",
                                 source=source, where="data_parallel")
    return CommPlan.from_dict(ref["plan"])


def planned_ddp(module: Any, dp: Any, *, device: Any, backend: str, group: Any = None, source: str = "<plan>",
                **ddp_kwargs: Any) -> tuple[Any, CommPlan, PlannedAllReduce]:
    """``module`` (on ``device``) in ``DistributedDataParallel`` over ``group`` with the plan's hook registered:
    ``(ddp, plan, hook)``. The plan comes from :func:`agree_on_plan`."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    named = trainable_parameters(module, set(getattr(module, "_ddp_params_and_buffers_to_ignore", ())))
    plan = agree_on_plan(named, dp, group=group, device=device if backend == "nccl" else None, source=source)
    if plan.transfers and "bucket_cap_mb" not in ddp_kwargs and "bucket_cap_mb_list" not in ddp_kwargs:
        # DDP hands the hook whole buckets (25 MiB by default: a small model is one bucket, ready only when the backward
        # pass ends, and no plan could overlap anything); buckets no larger than the plan's smallest transfer let each
        # transfer start as soon as the backward pass has produced its gradients (bench/results/runtime_emu.md)
        ddp_kwargs["bucket_cap_mb"] = min(plan.transfer_bytes(k) for k in range(len(plan.transfers))) / MiB
    ddp = DDP(module, device_ids=[device] if device.type == "cuda" else None, process_group=group, **ddp_kwargs)
    reduced = {id(p) for p in getattr(ddp, "_module_parameters", []) if p.requires_grad}
    if reduced and reduced != {id(p) for _, p in named}:
        raise ModelMismatchError("DDP's parameters are not the plan's (parameters_to_ignore?)", source=source, where="data_parallel")
    hook = PlannedAllReduce(plan, [p for _, p in named], group=group)
    ddp.register_comm_hook(None, hook.hook)
    return ddp, plan, hook


@dataclass
class _Bucket:
    future: Any
    buffer: Any
    remaining: int


class PlannedAllReduce:
    """The DDP communication hook that carries out a :class:`CommPlan` (see the module docstring).

    ``params`` are the model's trainable parameters in the plan's order. Register with
    ``ddp.register_comm_hook(None, hook.hook)``; :attr:`log` holds, per iteration, the transfer indices in
    issue order and each transfer's issue and completion time (s from the iteration's first bucket).
    """

    def __init__(self, plan: CommPlan, params: Sequence[Any], group: Any = None):
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.plan, self.group = plan, group
        self.params = list(params)
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.world = dist.get_world_size(group)
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.pieces_of = [0] * len(self.params)
        for t in plan.transfers:
            for p in t:
                self.pieces_of[p.param] += 1
        self.log: list[dict[str, list[float] | list[int]]] = []
        self._inbox: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="netweave-ddp-hook", daemon=True)
        self._thread.start()

    def hook(self, state, bucket):   # no annotations: DDP checks them against dist.GradBucket
        torch = self.torch
        fut = torch.futures.Future(devices=[self.device]) if self.device.type == "cuda" else torch.futures.Future()
        members = []
        for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True):
            i = self.index.get(id(p))
            if i is None:
                fut.set_exception(ModelMismatchError("DDP reduces a parameter that is not in the plan (is the hook registered on the "
                                                     "model the plan was made for?)", where="data_parallel"))
                return fut
            members.append((i, g))
        self._inbox.put((_Bucket(fut, bucket.buffer(), len(members)), members))
        return fut

    def close(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.set_device(self.device)
        while True:
            try:
                if not self._iteration():
                    return
            except BaseException as exc:   # surfaced through the buckets' futures: DDP raises it in backward
                self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        for bucket in getattr(self, "_open", []):
            if not bucket.future.done():
                bucket.future.set_exception(exc)
        self._open = []

    def _iteration(self) -> bool:
        grads: dict[int, Any] = {}
        owner: dict[int, _Bucket] = {}
        self._open: list[_Bucket] = []
        left = list(self.pieces_of)
        issue, done, order = [], [], []
        t0 = None

        def take() -> bool:
            nonlocal t0
            item = self._inbox.get()
            if item is None:
                return False
            bucket, members = item
            t0 = time.perf_counter() if t0 is None else t0
            self._open.append(bucket)
            for i, g in members:
                grads[i], owner[i] = g.view(-1), bucket
            return True

        in_flight: list[tuple[Any, Any, int, list[Piece]]] = []
        flying = [0.0]   # bytes in flight

        def complete_oldest() -> None:
            work, buf, k, pieces = in_flight.pop(0)
            work.wait()
            if self.device.type == "cuda":   # on a GPU wait() only orders the streams: the credit counts bytes really in flight
                while not work.is_completed():
                    time.sleep(20e-6)
            flying[0] -= self.plan.transfer_bytes(k)
            if len(pieces) > 1:
                pos = 0
                for p in pieces:
                    grads[p.param][p.start:p.start + p.count].copy_(buf[pos:pos + p.count])
                    pos += p.count
            for p in pieces:
                left[p.param] -= 1
                if left[p.param] == 0:
                    b = owner[p.param]
                    b.remaining -= 1
                    if b.remaining == 0:
                        b.future.set_result(b.buffer)
            done.append(time.perf_counter() - t0)

        credit = math.inf if self.plan.credit_bytes is None else self.plan.credit_bytes
        for k, pieces in enumerate(self.plan.transfers):
            while any(p.param not in grads for p in pieces):
                if not take():
                    return False
            nbytes = self.plan.transfer_bytes(k)
            while in_flight and flying[0] + nbytes > credit:
                complete_oldest()
            views = [grads[p.param][p.start:p.start + p.count] for p in pieces]
            buf = views[0] if len(views) == 1 else self.torch.cat(views)
            buf.div_(self.world)           # as DDP's allreduce_hook: average first, then sum
            work = self.dist.all_reduce(buf, group=self.group, async_op=True)
            issue.append(time.perf_counter() - t0)
            order.append(k)
            in_flight.append((work, buf, k, pieces))
            flying[0] += nbytes
        while in_flight:
            complete_oldest()
        self.log.append({"order": order, "issue_s": issue, "done_s": done})
        self._open = []
        return True
