"""Carry out in-job communication plans on a real model with real all-reduces.

Two paths:

- :class:`GradientScheduler`, the per-parameter path. DDP's reducer launches its
  buckets strictly in bucket order and makes ``optimizer.step()`` wait for all of
  them, which is exactly what priority scheduling needs to change. The scheduler
  bypasses DDP: it learns when each layer's gradient is ready from
  ``register_post_accumulate_grad_hook``, issues the plan's collectives from one
  communication thread *in the plan's static order* (so every rank issues the
  same sequence), keeps at most ``plan.credit`` bytes in flight, and — without a
  barrier — lets the next forward pass start layer by layer: a forward pre-hook
  waits only for that layer's reduced gradient and runs that layer's optimizer
  step (cross-barrier, as in ByteScheduler and BytePS).
- :func:`ddp_bucket_caps` and :func:`timed_comm_hook` for users who keep DDP:
  the first turns a plan's blocks into DDP's ``bucket_cap_mb_list`` (variable
  block sizes, Prophet-style), the second wraps any DDP communication hook —
  including the compression hooks ``fp16_compress_hook``/``bf16_compress_hook``
  — and records each bucket's issue and completion times.

Compression composes with the scheduler too: ``compress="fp16"|"bf16"`` casts
each fused buffer before the all-reduce and back after, as DDP's compression
hooks do.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from topology.errors import InputError

from .gradients import layer_parameters
from .intrajob import CommPlan, MiB


@dataclass
class _Piece:
    layer: int
    start: int  # element offset in the layer's flattened gradient
    count: int


@dataclass
class _Launch:
    index: int
    pieces: list[_Piece]
    nbytes: float


@dataclass
class IterationLog:
    """What the communication thread did in one iteration (seconds since backward start)."""

    issue: list[float] = field(default_factory=list)
    done: list[float] = field(default_factory=list)
    order: list[int] = field(default_factory=list)


class GradientScheduler:
    """Execute a :class:`~flowsched.intrajob.CommPlan` on ``layers`` of a model.

    ``layers`` are the modules whose gradients the plan's layer indices refer
    to, in forward order (:func:`flowsched.gradients.gradient_layers` finds them,
    parameters of non-leaf modules such as ``nn.MultiheadAttention.in_proj_weight``
    included). Each trainable parameter under a layer belongs to the first layer
    that has it (:func:`~flowsched.gradients.layer_parameters`). With ``model``,
    every trainable parameter of the model must be in some layer: a parameter
    that would never be reduced or stepped is an :class:`InputError`, not a silent
    skip. With ``optimizer_factory`` (called once per layer with that layer's
    parameters) each layer's parameters are updated right before its next
    forward; otherwise call :meth:`synchronize` and step your optimizer.

    Usage (each rank)::

        sched = GradientScheduler(gradient_layers(model), plan, model=model,
                                  optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.1))
        for x, y in data:
            loss = loss_fn(model(x), y)      # waits per layer for last iteration's reduced gradients
            sched.begin_iteration()
            loss.backward()                  # collectives go out in plan order as gradients become ready
        sched.synchronize(step=True)         # drain the last iteration
    """

    def __init__(
        self,
        layers: Sequence[Any],
        plan: CommPlan,
        *,
        group: Any = None,
        optimizer_factory: Callable[[list[Any]], Any] | None = None,
        compress: str | None = None,
        model: Any = None,
    ):
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            raise InputError("torch.distributed is not initialised: call init_process_group first")
        self._torch, self._dist = torch, dist
        self.layers = list(layers)
        self.plan = plan
        self.group = group
        self.world = dist.get_world_size(group)
        self.params = layer_parameters(self.layers)
        if model is not None:
            have = {id(p) for ps in self.params for p in ps}
            missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in have]
            if missing:
                raise InputError(f"{len(missing)} trainable parameters are in none of the layers, first {missing[0]!r}; "
                                 "use flowsched.gradients.gradient_layers(model)")
        self.elements = [sum(p.numel() for p in ps) for ps in self.params]
        self.dtype_bytes = [ps[0].element_size() if ps else 4 for ps in self.params]
        self.compress = {None: None, "fp16": torch.float16, "bf16": torch.bfloat16}[compress]
        self.launches = self._layout(plan)
        self.optimizers = [optimizer_factory(ps) if optimizer_factory and ps else None for ps in self.params]
        self._layer_ready = [threading.Event() for _ in self.layers]
        self._layer_done = [threading.Event() for _ in self.layers]
        for ev in self._layer_done:
            ev.set()
        self._pending = [0] * len(self.layers)
        self._accumulated = [0] * len(self.layers)
        self._lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._t0 = 0.0
        self.logs: list[IterationLog] = []
        self._running = False
        self._handles = []
        for i, ps in enumerate(self.params):
            for p in ps:
                self._handles.append(p.register_post_accumulate_grad_hook(lambda p, i=i: self._on_grad(i)))
            self._handles.append(self.layers[i].register_forward_pre_hook(lambda m, a, i=i: self._before_forward(i)))
        self._thread = threading.Thread(target=self._comm_loop, name="netweave-comm", daemon=True)
        self._thread.start()

    # -- plan layout ----------------------------------------------------------------
    def _layout(self, plan: CommPlan) -> list[_Launch]:
        offset = [0] * len(self.layers)
        sent = [0.0] * len(self.layers)
        launches = []
        for k, t in enumerate(plan.transfers):
            pieces = []
            for layer, nbytes in t.parts:
                if not 0 <= layer < len(self.layers):
                    raise InputError(f"plan transfer {k}: layer {layer} does not exist (model has {len(self.layers)} layers)")
                # cut at whole elements, rounding cumulative bytes so the pieces tile the layer exactly
                sent[layer] += nbytes
                end = round(sent[layer] / self.dtype_bytes[layer])
                pieces.append(_Piece(layer, offset[layer], end - offset[layer]))
                offset[layer] = end
            launches.append(_Launch(k, pieces, t.nbytes))
        for i, (got, want) in enumerate(zip(offset, self.elements, strict=True)):
            if got != want:
                raise InputError(f"plan covers {got} gradient elements of layer {i}, the model has {want}")
        return launches

    # -- hooks -------------------------------------------------------------------------
    def _on_grad(self, layer: int) -> None:
        with self._lock:
            self._accumulated[layer] += 1
            if self._accumulated[layer] == len(self.params[layer]):
                self._layer_ready[layer].set()

    def _before_forward(self, layer: int) -> None:
        self._layer_done[layer].wait()
        if self._error:
            raise RuntimeError("communication thread failed") from self._error
        opt = self.optimizers[layer]
        if opt is not None and self._running:
            opt.step()
            opt.zero_grad(set_to_none=True)

    # -- per iteration -------------------------------------------------------------------
    def begin_iteration(self) -> None:
        """Call right before ``loss.backward()``."""
        if self._running:
            self._wait_all()
        self._t0 = time.perf_counter()
        for i in range(len(self.layers)):
            self._accumulated[i] = 0
            self._layer_ready[i].clear()
            self._layer_done[i].clear()
            self._pending[i] = sum(1 for launch in self.launches for piece in launch.pieces if piece.layer == i)
        self._running = True
        self._jobs.put(IterationLog())

    def _wait_all(self) -> None:
        for ev in self._layer_done:
            ev.wait()
        if self._error:
            raise RuntimeError("communication thread failed") from self._error

    def synchronize(self, step: bool = False) -> None:
        """Wait for every reduced gradient of the current iteration (the barrier); optionally step."""
        self._wait_all()
        if step:
            for opt in self.optimizers:
                if opt is not None:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
        self._running = False

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)
        for h in self._handles:
            h.remove()

    # -- the communication thread -------------------------------------------------------------
    def _flat(self, layer: int):
        grads = [p.grad.reshape(-1) for p in self.params[layer]]
        return grads[0] if len(grads) == 1 else self._torch.cat(grads)

    def _scatter_back(self, layer: int, start: int, values) -> None:
        pos = 0
        for p in self.params[layer]:
            n = p.numel()
            lo, hi = max(start, pos), min(start + values.numel(), pos + n)
            if lo < hi:
                p.grad.view(-1)[lo - pos : hi - pos].copy_(values[lo - start : hi - start])
            pos += n

    def _complete_oldest(self, in_flight: list, log: IterationLog) -> None:
        """Wait for the oldest collective, average it and write it back into the gradients."""
        work, buf, launch, _ = in_flight.pop(0)
        work.wait()
        values = buf.to(self.params[launch.pieces[0].layer][0].dtype) if self.compress else buf
        values = values / self.world
        pos = 0
        for piece in launch.pieces:
            self._scatter_back(piece.layer, piece.start, values[pos : pos + piece.count])
            pos += piece.count
            with self._lock:
                self._pending[piece.layer] -= 1
                if self._pending[piece.layer] == 0:
                    self._layer_done[piece.layer].set()
        log.done.append(time.perf_counter() - self._t0)

    def _comm_loop(self) -> None:
        torch, dist = self._torch, self._dist
        while True:
            log = self._jobs.get()
            if log is None:
                return
            self.logs.append(log)
            try:
                in_flight: list[tuple[Any, Any, _Launch, float]] = []

                for launch in self.launches:
                    for layer in {p.layer for p in launch.pieces}:
                        self._layer_ready[layer].wait()
                    while in_flight and sum(x[3] for x in in_flight) + launch.nbytes > max(self.plan.credit, 0.0):
                        self._complete_oldest(in_flight, log)
                    flats = {layer: self._flat(layer) for layer in {p.layer for p in launch.pieces}}
                    buf = torch.cat([flats[p.layer][p.start : p.start + p.count] for p in launch.pieces])
                    if self.compress is not None:
                        buf = buf.to(self.compress)
                    work = dist.all_reduce(buf, group=self.group, async_op=True)
                    log.issue.append(time.perf_counter() - self._t0)
                    log.order.append(launch.index)
                    in_flight.append((work, buf, launch, launch.nbytes))
                while in_flight:
                    self._complete_oldest(in_flight, log)
            except BaseException as exc:  # surfaced to the training loop by the waits
                self._error = exc
                for ev in self._layer_done:
                    ev.set()


def ddp_bucket_caps(plan: CommPlan, group: Any = None) -> list[int]:
    """DDP's ``bucket_cap_mb_list`` that reproduces a plan's block sizes (in MiB, rounded up), the same on every rank.

    DDP needs identical bucket caps on all ranks (different caps give different buckets, and DDP dies),
    but each rank's measured profile, and so its plan, differs. When torch.distributed is initialised,
    rank 0's caps are therefore broadcast to the group and every rank returns those. DDP fills buckets
    in gradient-ready order, so this matches plans whose blocks are contiguous in that order (DDP and
    Prophet plans). ``netweave.runtime``'s hook partitions inside buckets instead and needs no caps.
    """
    caps = [max(1, -(-int(t.nbytes) // MiB)) for t in plan.transfers]
    try:
        import torch.distributed as dist
    except ImportError:
        return caps
    if dist.is_available() and dist.is_initialized():
        box: list[Any] = [caps]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        caps = list(box[0])
    return caps


def timed_comm_hook(inner: Callable[[Any, Any], Any] | None = None, log: list | None = None) -> tuple[Callable[[Any, Any], Any], list]:
    """Wrap a DDP communication hook (default: plain all-reduce) to record per-bucket timings.

    Returns ``(hook, log)``; register with ``ddp.register_comm_hook(state, hook)``.
    Each log entry is ``(bucket index, bytes, issue time, completion time)`` in
    ``time.perf_counter()`` seconds. Composes with DDP's compression hooks:
    ``timed_comm_hook(default_hooks.fp16_compress_hook)``.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    inner = inner or default_hooks.allreduce_hook
    log = [] if log is None else log

    def hook(state, bucket):   # no annotations: DDP accepts only dist.GradBucket / Future[Tensor] ones
        issued = time.perf_counter()
        index, nbytes = bucket.index(), bucket.buffer().numel() * bucket.buffer().element_size()
        fut = inner(state, bucket)

        def record(f):
            log.append((index, nbytes, issued, time.perf_counter()))
            return f.value()

        return fut.then(record)

    return hook, log
