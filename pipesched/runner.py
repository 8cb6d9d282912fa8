"""Run a plan on a real model with real processes: torch.distributed.pipelining over gloo on CPU, or NCCL on a GPU.

:func:`run_pipeline` spawns one process per pipeline rank (``torch.multiprocessing``, start method
"spawn", a TCP rendezvous on localhost). Each process builds the same model from a factory
(``"module:function"`` + kwargs, fixed seed), wraps the layer span of every stage id it holds in a
``PipelineStage`` and runs either our schedule through ``_PipelineScheduleRuntime._load_csv`` (compute_only
CSV written by :mod:`pipesched.export`) or one of torch's built-in schedules (``"1F1B"``, ``"GPipe"``) as a
baseline. It measures:

- the iteration time (all ranks start after a barrier; the iteration ends when the last rank's ``step``
  returns), over ``iterations`` timed steps after ``warmup`` untimed ones;
- every F / B / I / W action's start and end on its rank (the stage's ``forward_one_chunk``,
  ``backward_one_chunk`` and ``backward_weight_one_chunk`` are timed);
- per rank and step, the wall time its schedule spent waiting on messages (torch's ``_wait_batch_p2p``, which
  both its built-in schedules and ``_PipelineScheduleRuntime`` call for every receive and send they wait for;
  with gloo the wait blocks the thread, with NCCL it only orders the streams, so on a GPU this is host time);
- per rank, the peak of live autograd-saved activation bytes during one extra step (``saved_tensors_hooks``
  counting each saved tensor once until autograd frees it, as the profiler does) and the peak RSS growth (Linux ``VmHWM`` after a reset);
- the point-to-point link between rank 0 and rank 1 (a ping-pong at two message sizes gives latency and
  bandwidth) so that the simulator can be fed the transport that was actually used;
- on request (``pre_profile``), each rank's CPU-time profile of the whole chain, all ranks at once, taken after
  the ping-pong and before the warm-up step: the input a prediction of this very run can use;
- on request (``interleave_profile``), one more such profile pass before every timed step, all ranks at once
  between two barriers, so that the profile samples the machine over the same seconds as the steps it
  predicts (on a shared virtual machine the same work's CPU time drifts by tens of percent within a run).

With ``device="cuda"`` every rank runs on GPU 0 over NCCL. The ranks share the one GPU: each gets its own
``NCCL_HOSTID``, so NCCL takes them for separate nodes (it refuses two ranks of one node on one GPU) and moves
the activations over its network transport on the loopback interface. Every clock reading of an action, a step
and the ping-pong waits for the GPU first (an action: its compute stream; a step and the ping-pong: the whole
device), so the times are the GPU's work, not its queueing; per rank, the peak of GPU memory allocated during
the memory step is recorded too. Several ranks on one GPU either time-slice it (one context at a time) or, with
the CUDA MPS daemon and ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, each get a share of its SMs.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .schedules import Action


@dataclass
class RunResult:
    iteration_s: list[float]
    actions: list[dict[str, Any]]            # last timed iteration: rank, stage, kind, mb, start, end (s from the step's start)
    action_medians: dict[str, float]         # "stage kind" -> median wall duration over all timed iterations
    peak_saved_bytes: list[float]            # per rank
    peak_rss_growth_bytes: list[float]       # per rank
    link_latency_s: float
    link_bandwidth_bps: float
    losses: list[float] = field(default_factory=list)
    action_cpu_medians: dict[str, float] = field(default_factory=dict)   # "stage kind" -> median CPU time of the action's thread
    rank_cpu_s: list[float] = field(default_factory=list)                # per rank: median CPU time of all its threads per step
    rank_main_cpu_s: list[float] = field(default_factory=list)           # per rank: the same for the thread running the schedule alone
    rank_wait_s: list[float] = field(default_factory=list)               # per rank: median wall time per step waiting on messages
    foreign_cores: float = 0.0    # cores other processes used during the timed iterations (machine busy - our ranks' CPU)
    pre_profiles: list[dict[str, Any]] = field(default_factory=list)   # per rank: its profile taken right before the run (JSON form)
    interleaved_profiles: list[dict[str, Any]] = field(default_factory=list)   # per rank: median of its passes between the steps
    interleaved_totals_s: list[list[float]] = field(default_factory=list)      # per rank: each pass's F + B total, step by step
    replay_cpu_medians: dict[str, float] = field(default_factory=dict)   # "stage kind" -> median CPU time in the replays between steps
    device: str = "cpu"
    device_peak_bytes: list[int] = field(default_factory=list)   # per rank, GPU runs: peak allocated memory during the memory step
    traces: list[list[dict[str, Any]]] = field(default_factory=list)   # per rank, with trace=True: every timed step (run_pipeline)

    @property
    def median_s(self) -> float:
        return statistics.median(self.iteration_s)

    def to_dict(self) -> dict[str, Any]:
        return {"iteration_s": self.iteration_s, "median_s": self.median_s, "action_medians": self.action_medians,
                "peak_saved_bytes": self.peak_saved_bytes, "peak_rss_growth_bytes": self.peak_rss_growth_bytes,
                "link_latency_s": self.link_latency_s, "link_bandwidth_bps": self.link_bandwidth_bps, "losses": self.losses,
                "action_cpu_medians": self.action_cpu_medians, "rank_cpu_s": self.rank_cpu_s,
                "rank_main_cpu_s": self.rank_main_cpu_s, "rank_wait_s": self.rank_wait_s, "foreign_cores": self.foreign_cores,
                "pre_profiles": self.pre_profiles, "interleaved_profiles": self.interleaved_profiles,
                "interleaved_totals_s": self.interleaved_totals_s, "replay_cpu_medians": self.replay_cpu_medians,
                "device": self.device, "device_peak_bytes": self.device_peak_bytes, "traces": self.traces}


def machine_busy_s() -> float:
    """CPU seconds all cores of this machine have spent busy since boot (``/proc/stat``; 0.0 where unavailable)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return 0.0
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def foreign_cores(busy_s: float, own_cpu_s: float, wall_s: float) -> float:
    """Cores that other processes kept busy during a window: machine busy time less our own CPU time, per second."""
    return max(0.0, busy_s - own_cpu_s) / wall_s if wall_s > 0 else 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _factory(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


class _SavedCounter:
    """Live bytes of autograd-saved tensors, each tensor (view) counted once while any saved reference lives.

    Parameters (``exclude``: their storages) are not activations and are not counted.
    """

    def __init__(self, exclude: set[int] | None = None):
        self.live = 0
        self.peak = 0
        self.refs: dict[tuple[int, int], list[int]] = {}
        self.exclude = exclude or set()

    def pack(self, t):
        if t.untyped_storage().data_ptr() in self.exclude:
            return _Held(t, None, self)
        key = (t.data_ptr(), t.numel() * t.element_size())
        entry = self.refs.get(key)
        if entry is None:
            self.refs[key] = [1, key[1]]
            self.live += key[1]
            self.peak = max(self.peak, self.live)
        else:
            entry[0] += 1
        return _Held(t, key, self)

    @staticmethod
    def unpack(held):
        return held.tensor


class _Held:
    __slots__ = ("counter", "ptr", "tensor")

    def __init__(self, tensor, ptr, counter):
        self.tensor, self.ptr, self.counter = tensor, ptr, counter

    def __del__(self):
        entry = self.counter.refs.get(self.ptr)
        if entry is not None:
            entry[0] -= 1
            if entry[0] == 0:
                self.counter.live -= entry[1]
                del self.counter.refs[self.ptr]


def _rss(field_name: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def half_round_trip_s(dist, buf: Any, rank: int, sync: Any = None) -> float:
    """One ping-pong of ``buf`` between ranks 0 and 1 (rank 0 sends first); half its wall time, the clock read after
    ``sync`` (a GPU's synchronisation) on both sides."""
    if sync:
        sync()
    t0 = time.perf_counter()
    if rank == 0:
        dist.send(buf, 1)
        dist.recv(buf, 1)
    else:
        dist.recv(buf, 0)
        dist.send(buf, 0)
    if sync:
        sync()
    return (time.perf_counter() - t0) / 2


def _ping_pong(torch, dist, rank: int, world: int, device: Any = "cpu", sync: Any = None) -> tuple[float, float]:
    """Latency and bandwidth between ranks 0 and 1 from round trips at two message sizes (``sync`` waits for a GPU)."""
    if world < 2:
        return 0.0, float("inf")
    if rank > 1:
        return 0.0, 0.0
    times = {}
    for nbytes, rounds in ((4, 30), (4 << 20, 10)):
        buf = torch.zeros(max(1, nbytes // 4), device=device)
        samples = [half_round_trip_s(dist, buf, rank, sync) for _ in range(rounds)]
        times[nbytes] = statistics.median(samples[1:])
    small, large = times[4], times[4 << 20]
    bandwidth = (4 << 20) / max(large - small, 1e-9)
    return small, bandwidth


def _build_schedule(torch: Any, ts: Any, layers: list[Any], spans: list[list[int]], stage_rank: list[int], rank: int, *, builtin: str | None,
                    csv: str | None, microbatches: int, dev: Any, records: list[list[Any]], stream_sync: Any = None,
                    event: Any = None) -> tuple[list[Any], Any]:
    """This rank's ``PipelineStage``s of one plan over ``layers`` (instrumented into ``records``) and its schedule.

    The schedule is torch's built-in ``builtin`` class, or our ``csv`` through torch's ``_PipelineScheduleRuntime``.
    """
    from torch.distributed.pipelining import PipelineStage

    stages = []
    for sid, (i, j) in enumerate(spans):
        if stage_rank[sid] == rank:
            stage = PipelineStage(torch.nn.Sequential(*layers[i:j]), sid, len(spans), dev)
            _instrument(stage, sid, records, stream_sync, event)
            stages.append(stage)
    loss_fn = torch.nn.functional.mse_loss
    if builtin:
        return stages, ts.get_schedule_class(builtin)(stages[0], n_microbatches=microbatches, loss_fn=loss_fn)
    sched = ts._PipelineScheduleRuntime(stages, n_microbatches=microbatches, loss_fn=loss_fn)
    sched._load_csv(csv, format="compute_only")
    return stages, sched


def _worker(rank: int, world: int, port: int, job: dict[str, Any], queue) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cuda = job.get("device") == "cuda"
    if cuda:   # all ranks on the one GPU: distinct host ids make NCCL treat them as nodes joined by its network transport
        os.environ["NCCL_HOSTID"] = f"pipesched-rank{rank}"
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules as ts

    torch.set_num_threads(job["threads"])
    if not cuda:
        from .profile import retain_freed_memory

        retain_freed_memory()   # as the profile does: torch's split backward allocates a fresh weight gradient per W
    try:
        dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
        sync = stream_sync = None
        if cuda:
            torch.cuda.set_device(dev)
            sync = torch.cuda.synchronize

            def stream_sync() -> None:
                # Only the compute stream: a device-wide sync would also wait for this rank's NCCL sends, which
                # finish only when the peer posts its receive, and so would chain the ranks' actions together.
                torch.cuda.current_stream().synchronize()
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        layers = [layer.to(dev) for layer in _factory(job["model"])(**job["model_kwargs"])]
        records: list[list[Any]] = []     # [stage, kind, mb, start, end, cpu, CUDA events or None] per action
        stages, sched = _build_schedule(torch, ts, layers, job["spans"], job["stage_rank"], rank, builtin=job["builtin"], csv=job["csv"],
                                        microbatches=job["microbatches"], dev=dev, records=records, stream_sync=stream_sync,
                                        event=torch.cuda.Event if cuda else None)
        waited = _time_message_waits(ts)
        # After every rank has built its model, so that the ping-pong does not compete with model construction.
        dist.barrier()
        latency, bandwidth = _ping_pong(torch, dist, rank, world, dev, sync)
        gen = torch.Generator().manual_seed(1)
        shape = tuple(job.get("input_shape") or (job["dim"],))
        x = torch.randn(job["batch"], *shape, generator=gen).to(dev)
        y = torch.randn(job["batch"], *shape, generator=gen).to(dev)
        pre_profile = None
        if job.get("pre_profile"):
            opts = job["pre_profile"]
            pre_profile = _profile_chain(torch, dist, layers, x, y, job, repeats=opts.get("repeats", 6), passes=opts.get("passes", 3),
                                         warmup=2, name="pre-run").to_dict()
        interleave = job.get("interleave_profile")
        interleaved = []
        replay_actions = (job.get("interleave_replay") or {}).get(str(rank))
        replayed: dict[str, list[float]] = {}
        first = any(s.is_first for s in stages)
        last = any(s.is_last for s in stages)
        inputs = (x,) if first else ()   # no positional input at all on other ranks (torch 2.11's schedules assert on a None)
        opt = torch.optim.SGD([p for s in stages for p in s.submod.parameters()], lr=1e-3)
        durations, cpu_s, main_cpu_s, wait_s, losses = [], [], [], [], []
        last_records: list[tuple[int, str, int, float, float, float]] = []
        trace: list[dict[str, Any]] = []   # every timed step: its start (perf_counter, one clock for all ranks) and actions
        per_action: dict[str, list[float]] = {}
        per_action_cpu: dict[str, list[float]] = {}
        window: dict[str, float] = {}
        for it in range(job["warmup"] + job["iterations"]):
            if interleave and it >= job["warmup"]:
                interleaved.append(_profile_chain(torch, dist, layers, x, y, job, repeats=interleave.get("repeats", 1), passes=1,
                                                  warmup=0, name=f"between steps {it - job['warmup']}"))
            if replay_actions is not None and it >= job["warmup"]:
                dist.barrier()
                for key, c in _replay(torch, stages, replay_actions, x, y, job).items():
                    replayed.setdefault(key, []).append(c)
                dist.barrier()
            dist.barrier()
            if it == job["warmup"]:
                window = {"cpu0": time.process_time(), "busy0": machine_busy_s(), "t0": time.perf_counter()}
            records.clear()
            waited[0] = 0.0
            t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
            step_losses: list = []
            sched.step(*inputs, target=y if last else None, losses=step_losses if last else None)
            if sync:
                sync()
            t1, c1, m1 = time.perf_counter(), time.process_time(), time.thread_time()
            opt.step()
            opt.zero_grad(set_to_none=True)
            for rec in records:   # the step is synchronised: every action's CUDA events have completed
                rec[6] = rec[6][0].elapsed_time(rec[6][1]) / 1e3 if rec[6] is not None else None
            if it >= job["warmup"]:
                if job.get("trace"):
                    trace.append({"t0": t0, "t1": t1, "wait_s": waited[0],
                                  "actions": [[s, k, mb, a - t0, b - t0, c, g] for s, k, mb, a, b, c, g in records]})
                durations.append(t1 - t0)
                cpu_s.append(c1 - c0)       # all of the rank's threads (gloo's included) during the step
                main_cpu_s.append(m1 - m0)  # the schedule's own thread: actions, the runtime's loop, posting and waiting
                wait_s.append(waited[0])
                last_records = [(s, k, mb, a - t0, b - t0, c) for s, k, mb, a, b, c, _ in records]
                for s, k, _, a, b, c, _ in records:
                    per_action.setdefault(f"{s} {k}", []).append(b - a)
                    per_action_cpu.setdefault(f"{s} {k}", []).append(c)
                if step_losses:
                    losses.append(float(sum(float(v.detach()) for v in step_losses) / len(step_losses)))
        dist.barrier()
        if window:
            window |= {"cpu": time.process_time() - window["cpu0"], "busy": machine_busy_s() - window["busy0"],
                       "wall": time.perf_counter() - window["t0"]}
        # Memory: one more step with saved-tensor accounting and a reset RSS high-water mark.
        counter = _SavedCounter({p.untyped_storage().data_ptr() for s in stages for p in s.submod.parameters()})
        dist.barrier()
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")
        rss0 = _rss("VmRSS")
        if cuda:
            sync()
            torch.cuda.reset_peak_memory_stats(dev)
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            sched.step(*inputs, target=y if last else None, losses=[] if last else None)
        rss_growth = max(0, _rss("VmHWM") - rss0)
        device_peak = int(torch.cuda.max_memory_allocated(dev)) if cuda else 0
        opt.zero_grad(set_to_none=True)
        inter = None
        if interleaved:
            from .profile import median_profile

            inter = {"median": median_profile(interleaved).to_dict(), "totals": [sum(lay.fwd_s + lay.bwd_s for lay in q.layers) for q in interleaved]}
        queue.put({"rank": rank, "durations": durations, "cpu_s": cpu_s, "main_cpu_s": main_cpu_s, "wait_s": wait_s, "actions": last_records,
                   "per_action": per_action, "per_action_cpu": per_action_cpu, "window": window, "peak_saved": counter.peak,
                   "rss_growth": rss_growth, "latency": latency, "bandwidth": bandwidth, "losses": losses, "pre_profile": pre_profile,
                   "interleaved": inter, "device_peak": device_peak, "replayed": replayed, "trace": trace})
        dist.barrier()
        dist.destroy_process_group()
    except Exception as exc:   # report, do not hang the parent
        import traceback

        queue.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"})


def _profile_chain(torch, dist, layers, x, y, job: dict[str, Any], *, repeats: int, passes: int, warmup: int, name: str):
    """This rank's profile of the whole chain on one micro-batch (CPU time; on a GPU, synchronised wall time), every
    rank profiling at once.

    Taken in the run's own processes, with the run's thread count and every rank busy (barriers on both sides):
    the layers are timed in the memory layout and under the process count they run with, seconds (or, between
    steps, milliseconds) from the steps they predict. :func:`pipesched.profile.measure_profile` restores the
    layers' ``.grad``, so the training is untouched.
    """
    from .profile import measure_profile

    mb = job["batch"] // job["microbatches"]
    target = y[:mb]
    dist.barrier()
    prof = measure_profile(layers, x[:mb], loss_fn=lambda out: torch.nn.functional.mse_loss(out, target), repeats=repeats,
                           warmup=warmup, threads=job["threads"], name=name, statistic="median",
                           clock="wall" if x.is_cuda else "cpu", passes=passes)
    dist.barrier()
    return prof


def _replay(torch, stages, actions: list[list[Any]], x, y, job: dict[str, Any]) -> dict[str, float]:
    """This rank's compute actions of one step, in the schedule's order and without messages: CPU time per action.

    Each stage runs its own layers (``stage.submod``) on the micro-batch it would get: the first stage a
    slice of the batch, the others a fresh tensor of the boundary's shape (as a receive would give); a
    backward gets a constant output gradient, the last stage's comes from its loss. The backwards are
    torch's own (``torch.distributed.pipelining._backward``: ``stage_backward`` for B, ``stage_backward_input``
    and ``stage_backward_weight`` for I and W, and for W on the first stage a full backward, as its runtime
    does), and each micro-batch's activations stay saved from its F to its backward, as in the step. The
    gradients they accumulate are dropped afterwards (a step starts from ``None``: the runner zeroes with
    ``set_to_none``), so training is untouched. Per "stage kind" the median over the step's micro-batches is
    returned (:data:`time.thread_time`, the clock the actions are timed with in the steps).
    """
    from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight

    mb = job["batch"] // job["microbatches"]
    by_id = {s.stage_index: s for s in stages}
    held: dict[tuple[int, int], list[Any]] = {}
    times: dict[str, list[float]] = {}
    for sid, kind, k in actions:
        stage = by_id[sid]
        module = stage.submod
        if kind == "F":
            inp = x[k * mb:(k + 1) * mb] if stage.is_first else torch.randn(mb, job["dim"]).requires_grad_(True)
            t = time.thread_time()
            out = module(inp)
            if stage.is_last:
                out = torch.nn.functional.mse_loss(out, y[k * mb:(k + 1) * mb])
            held[(sid, k)] = [inp, out, None]
        else:
            inp, out, groups = held[(sid, k)]
            grad = None if stage.is_last else torch.full_like(out, 1e-3)
            inputs = [inp] if inp.requires_grad else []
            t = time.thread_time()
            if kind == "B":   # the output as torch's runtime passes it: a bare tensor (a list with no gradients is skipped)
                stage_backward(out, grad, inputs)
                del held[(sid, k)]
            elif kind == "I":
                if inputs:   # the first stage has no input gradient: its W does the whole backward
                    held[(sid, k)][2] = stage_backward_input([out], None if grad is None else [grad], inputs, module.parameters())[1]
            else:
                if groups is None:
                    stage_backward(out, grad, inputs)
                else:
                    stage_backward_weight(module.parameters(), groups)
                del held[(sid, k)]
        times.setdefault(f"{sid} {kind}", []).append(time.thread_time() - t)
    for s in stages:
        for prm in s.submod.parameters():
            prm.grad = None
    return {key: statistics.median(v) for key, v in times.items()}


def _time_message_waits(ts) -> list[float]:
    """Time every message wait of torch's pipeline schedules in this process: returns a one-element list that
    accumulates the wall seconds spent in ``_wait_batch_p2p`` (the caller resets it before each step).

    Both the built-in schedules and ``_PipelineScheduleRuntime`` look the function up in their module at call
    time, so replacing the module attribute times all of them.
    """
    waited = [0.0]
    plain = ts._wait_batch_p2p

    def timed(work):
        t = time.perf_counter()
        try:
            return plain(work)
        finally:
            waited[0] += time.perf_counter() - t

    ts._wait_batch_p2p = timed
    return waited


def _instrument(stage, sid: int, records: list, sync: Any = None, event: Any = None) -> None:
    """Time the stage's F, B/I and W calls into ``records``; with ``event`` (``torch.cuda.Event``) also a CUDA event
    pair on the compute stream around each (elapsed time filled in by the caller once the step has synchronised)."""
    forward, backward, weight = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk

    cpu = time.thread_time
    if sync is None:
        clock = time.perf_counter
    else:
        def clock() -> float:   # a GPU action ends when its kernels have run, not when they are queued
            sync()
            return time.perf_counter()

    def begin():
        if event is None:
            return clock(), cpu(), None
        t, c = clock(), cpu()
        ev = (event(enable_timing=True), event(enable_timing=True))
        ev[0].record()
        return t, c, ev

    def end(kind: str, chunk_id: int, t: float, c: float, ev) -> None:
        if ev is not None:
            ev[1].record()
        records.append([sid, kind, chunk_id, t, clock(), cpu() - c, ev])

    def fwd(chunk_id, *args, **kwargs):
        t, c, ev = begin()
        out = forward(chunk_id, *args, **kwargs)
        end("F", chunk_id, t, c, ev)
        return out

    def bwd(chunk_id, loss=None, full_backward=True, last_backward=False):
        t, c, ev = begin()
        out = backward(chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)
        end("B" if full_backward else "I", chunk_id, t, c, ev)
        return out

    def wgt(chunk_id, last_backward=False):
        t, c, ev = begin()
        out = weight(chunk_id, last_backward=last_backward)
        end("W", chunk_id, t, c, ev)
        return out

    stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk = fwd, bwd, wgt


def gather_results(procs: list, queue: Any, world: int, timeout_s: float, *, what: str) -> dict[int, dict[str, Any]]:
    """Collect one message per rank from worker processes (``{"rank": r, ...}`` or ``{"rank": r, "error": ...}``),
    failing fast when a process dies or reports an error; joins the processes and terminates stragglers."""
    results: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{what} did not finish in {timeout_s:.0f} s")
            try:
                msg = queue.get(timeout=min(remaining, 5.0))
            except Exception:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"{what}: a rank process exited with code {dead[0].exitcode}") from None
                continue
            if "error" in msg:
                raise RuntimeError(f"{what}: rank {msg['rank']} failed: {msg['error']}")
            results[msg["rank"]] = msg
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    return results


def run_pipeline(spans: list[tuple[int, int]], stage_rank: list[int], *, microbatches: int, batch: int, dim: int,
                 model: str = "pipesched.models:mlp_chain", model_kwargs: dict[str, Any] | None = None, csv_text: str | None = None,
                 builtin: str | None = None, iterations: int = 3, warmup: int = 1, threads: int = 1, timeout_s: float = 300,
                 pre_profile: dict[str, int] | None = None, interleave_profile: dict[str, int] | None = None,
                 interleave_replay: dict[int, list[Action]] | None = None, device: str = "cpu", input_shape: tuple[int, ...] | None = None,
                 trace: bool = False) -> RunResult:
    """Run a pipeline in ``max(stage_rank) + 1`` processes (gloo on the CPU, or NCCL on GPU 0 with ``device="cuda"``)
    and measure it (see the module docstring).

    Exactly one of ``csv_text`` (our schedule, compute_only CSV) and ``builtin`` (torch's schedule name)
    is given. ``batch`` is the whole batch; torch splits it into ``microbatches`` along dimension 0.
    ``pre_profile`` (``{"repeats": n, "passes": k}``) has every rank profile the whole chain
    (:func:`pipesched.profile.measure_profile`, CPU time, one micro-batch) at the same time, right before the
    warm-up: ``RunResult.pre_profiles`` holds them, measured before the run's first step.
    ``interleave_profile`` (``{"repeats": n}``) has every rank profile the chain once more (``n`` repetitions
    per layer, no warm-up) before each timed step, all at once between barriers, outside the step's timing:
    ``RunResult.interleaved_profiles`` holds each rank's per-layer median over those passes and
    ``interleaved_totals_s`` each pass's F + B total, so the profile and the steps sample the same seconds.
    ``interleave_replay`` (rank -> its schedule's actions, e.g. ``Schedule.actions``) has every rank, before each
    timed step (after the profile pass, if any), run its own compute actions of one step in that order, without
    messages, all ranks at once between barriers and outside the step's timing (:func:`_replay`):
    ``RunResult.replay_cpu_medians`` holds the median CPU time per "stage kind".
    ``input_shape`` is one sample's shape (default ``(dim,)``; ``(seq, dim)`` for a transformer chain). With ``trace``
    every timed step of every rank is kept (``RunResult.traces``): the step's start and end on ``time.perf_counter``
    (one clock for all processes of this machine), its message-wait time, and per action its start, end and CPU time
    and, on a GPU, the elapsed time of a CUDA event pair recorded on the compute stream around it.
    """
    import torch.multiprocessing as mp

    if (csv_text is None) == (builtin is None):
        raise ValueError("give exactly one of csv_text and builtin")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    world = max(stage_rank) + 1
    if interleave_replay is not None:
        if device != "cpu":   # the replay's clock is the thread's CPU time: it says nothing about GPU kernels
            raise ValueError("interleave_replay times CPU work; it is not available with device='cuda'")
        known = {(s, k) for s in range(len(spans)) for k in ("F", "B", "I", "W")}
        for r in range(world):
            acts = interleave_replay.get(r)
            if acts is None or any((a.stage, a.kind) not in known or stage_rank[a.stage] != r for a in acts):
                own = [s for s in range(len(spans)) if stage_rank[s] == r]
                raise ValueError(f"interleave_replay must give rank {r} its own F/B/I/W actions (of stages {own})")
    with tempfile.TemporaryDirectory(prefix="pipesched-run-") as tmp:
        csv_path = None
        if csv_text is not None:
            csv_path = str(Path(tmp) / "schedule.csv")
            Path(csv_path).write_text(csv_text)
        job = {"spans": [list(s) for s in spans], "stage_rank": list(stage_rank), "microbatches": microbatches, "batch": batch, "dim": dim,
               "model": model, "model_kwargs": dict(model_kwargs or {}), "csv": csv_path, "builtin": builtin, "iterations": iterations,
               "warmup": warmup, "threads": threads, "pre_profile": dict(pre_profile) if pre_profile else None,
               "interleave_profile": dict(interleave_profile) if interleave_profile else None, "device": device,
               "input_shape": list(input_shape) if input_shape else None, "trace": trace,
               "interleave_replay": ({str(r): [[a.stage, a.kind, a.mb] for a in acts] for r, acts in interleave_replay.items()}
                                     if interleave_replay else None)}
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, world, port, job, queue), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        results = gather_results(procs, queue, world, timeout_s, what="pipeline run")
    iters = [max(results[r]["durations"][k] for r in range(world)) for k in range(iterations)]
    actions = [{"rank": r, "stage": s, "kind": k, "mb": mb, "start": a, "end": b, "cpu": c}
               for r in range(world) for s, k, mb, a, b, c in results[r]["actions"]]
    medians = {key: statistics.median(v) for r in range(world) for key, v in results[r]["per_action"].items()}
    cpu_medians = {key: statistics.median(v) for r in range(world) for key, v in results[r]["per_action_cpu"].items()}
    last_rank = stage_rank[-1]
    w0 = results[0]["window"]
    foreign = foreign_cores(w0["busy"], sum(results[r]["window"]["cpu"] for r in range(world)), w0["wall"]) if w0 else 0.0
    return RunResult(iters, actions, medians, [results[r]["peak_saved"] for r in range(world)],
                     [results[r]["rss_growth"] for r in range(world)], results[0]["latency"], results[0]["bandwidth"],
                     losses=results[last_rank]["losses"], action_cpu_medians=cpu_medians,
                     rank_cpu_s=[statistics.median(results[r]["cpu_s"]) for r in range(world)],
                     rank_main_cpu_s=[statistics.median(results[r]["main_cpu_s"]) for r in range(world)],
                     rank_wait_s=[statistics.median(results[r]["wait_s"]) for r in range(world)], foreign_cores=foreign,
                     pre_profiles=[results[r]["pre_profile"] for r in range(world) if results[r]["pre_profile"] is not None],
                     interleaved_profiles=[results[r]["interleaved"]["median"] for r in range(world) if results[r]["interleaved"]],
                     interleaved_totals_s=[results[r]["interleaved"]["totals"] for r in range(world) if results[r]["interleaved"]],
                     replay_cpu_medians={k: statistics.median(v) for r in range(world) for k, v in results[r]["replayed"].items()},
                     device=device, device_peak_bytes=[results[r]["device_peak"] for r in range(world)] if device == "cuda" else [],
                     traces=[results[r]["trace"] for r in range(world)] if trace else [])


def measured_timeline(run: RunResult, ranks: int):
    """The measured last iteration as a :class:`pipesched.simulate.SimResult` (for Gantt and trace overlays)."""
    from .simulate import SimResult, Span

    spans = [Span(a["rank"], Action(a["stage"], a["kind"], a["mb"]), a["start"], a["end"]) for a in run.actions]
    busy = [sum(s.end - s.start for s in spans if s.rank == r) for r in range(ranks)]
    makespan = max((s.end for s in spans), default=0.0)
    return SimResult(makespan, sorted(spans, key=lambda s: (s.rank, s.start)), [], busy, [0.0] * ranks, [[] for _ in range(ranks)], {}, ranks)


def _interleaved_worker(rank: int, world: int, port: int, job: dict[str, Any], queue) -> None:
    """One rank of :func:`run_interleaved`: every candidate's stages and schedule in this process, steps taken in turn."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules as ts

    from .profile import retain_freed_memory

    torch.set_num_threads(job["threads"])
    retained = retain_freed_memory()   # as the profile does: torch's split backward allocates a fresh weight gradient per W
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        layers = _factory(job["model"])(**job["model_kwargs"])   # one set of weights, wrapped by every candidate's stages
        params = [p for layer in layers for p in layer.parameters()]
        records: list[list[Any]] = []
        waited = _time_message_waits(ts)
        scheds, firsts, lasts, stage_lists = [], [], [], []
        for k, cand in enumerate(job["candidates"]):
            stages, sched = _build_schedule(torch, ts, layers, cand["spans"], cand["stage_rank"], rank, builtin=cand["builtin"], csv=job["csv"][k],
                                            microbatches=job["microbatches"], dev=torch.device("cpu"), records=records)
            scheds.append(sched)
            stage_lists.append(stages)
            firsts.append(any(s.is_first for s in stages))
            lasts.append(any(s.is_last for s in stages))
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(job["batch"], job["dim"], generator=gen)
        y = torch.randn(job["batch"], job["dim"], generator=gen)

        def step(k: int) -> tuple[float, float, list[list[Any]]]:
            dist.barrier()
            records.clear()
            waited[0] = 0.0
            t0 = time.perf_counter()
            scheds[k].step(*((x,) if firsts[k] else ()), target=y if lasts[k] else None, losses=[] if lasts[k] else None)
            t1 = time.perf_counter()
            for p in params:
                p.grad = None
            return t1 - t0, waited[0], [[s, kind, mb, a - t0, b - t0, c] for s, kind, mb, a, b, c, _ in records]

        for k in range(len(scheds)):
            for _ in range(job["warmup"]):
                step(k)
        replayed: list[dict[str, list[float]]] = [{} for _ in scheds]
        for rep in range(job["replays"]):   # each rank's own compute actions alone, every candidate in turn, before any timed step
            for k in (range(len(scheds)) if rep % 2 == 0 else reversed(range(len(scheds)))):
                dist.barrier()
                for key, c in _replay(torch, stage_lists[k], job["candidates"][k]["replay"][str(rank)], x, y, job).items():
                    replayed[k].setdefault(key, []).append(c)
        dist.barrier()
        busy0, cpu0, w0 = machine_busy_s(), time.process_time(), time.perf_counter()
        steps: list[dict[str, Any]] = []
        for block, passes in enumerate(job["plan"]):
            for order in passes:
                for k in order:
                    dur, wait, acts = step(k)
                    steps.append({"candidate": k, "block": block, "duration_s": dur, "wait_s": wait,
                                  "compute_s": sum(b - a for _, _, _, a, b, _ in acts), "compute_cpu_s": sum(c for *_, c in acts),
                                  "actions": acts})
        dist.barrier()
        window = {"busy": machine_busy_s() - busy0, "cpu": time.process_time() - cpu0, "wall": time.perf_counter() - w0}
        queue.put({"rank": rank, "steps": steps, "window": window, "threads": torch.get_num_threads(), "retain_freed_memory": retained,
                   "replayed": [{key: statistics.median(v) for key, v in r.items()} for r in replayed]})
        dist.barrier()
        dist.destroy_process_group()
    except Exception as exc:   # report, do not hang the parent
        import traceback

        queue.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"})


def interleaving_plan(candidates: int, blocks: int, steps: int) -> list[list[list[int]]]:
    """The order of :func:`run_interleaved`'s timed steps: ``blocks`` blocks of ``steps`` passes over the candidates,
    each pass the reverse of the one before (so no candidate always follows the same one, or always goes first).

    >>> interleaving_plan(3, 2, 2)
    [[[0, 1, 2], [2, 1, 0]], [[0, 1, 2], [2, 1, 0]]]
    """
    if candidates < 1 or blocks < 1 or steps < 1:
        raise ValueError(f"need at least one candidate, block and step, got {candidates}, {blocks}, {steps}")
    forward = list(range(candidates))
    return [[forward if s % 2 == 0 else forward[::-1] for s in range(steps)] for _ in range(blocks)]


def run_interleaved(candidates: list[dict[str, Any]], *, microbatches: int, batch: int, dim: int, model: str = "pipesched.models:mlp_chain",
                    model_kwargs: dict[str, Any] | None = None, blocks: int = 3, steps: int = 4, warmup: int = 1, threads: int = 1,
                    replays: int = 0, timeout_s: float = 900) -> dict[str, Any]:
    """Run several pipeline plans of one model in the same gloo processes, one step of each in turn (CPU only).

    Each candidate is ``{"spans", "stage_rank", "csv_text" | "builtin"}`` (the arguments of :func:`run_pipeline`'s
    plan); all must use the same ranks. Every process builds the model once and, for each candidate, the
    ``PipelineStage`` of each of its stages over those layers and the candidate's schedule (our CSV through torch's
    ``_PipelineScheduleRuntime``, or a built-in). After ``warmup`` untimed steps of each, the timed steps follow
    :func:`interleaving_plan`: one step of each candidate in turn, the order reversed every pass, ``steps`` passes
    per block. Taken in turn within a second or two, the candidates' steps see the same state of a shared machine,
    which drifts by tens of percent over minutes: a sequence of separate runs (:func:`run_pipeline` per candidate)
    measures that drift as much as the plans.

    Every rank keeps freed buffers for reuse (:func:`pipesched.profile.retain_freed_memory`, as the profile does) and
    reports the intra-op thread count it ran with. Returns ``{"candidates": [...], "foreign_cores": ..., "wall_s": ...,
    "threads": [per rank], "retain_freed_memory": [per rank]}``; per candidate ``step_s`` (each timed
    step: the slowest rank's ``step`` time; all ranks start it after a barrier), ``block_median_s`` (the median step
    of each block), ``median_s``, and per rank the median over steps of ``compute_s`` (wall time inside its F, B, I
    and W calls), ``compute_cpu_s`` (their CPU time), ``idle_s`` (step less compute) and ``wait_s`` (in torch's
    message waits), and ``actions`` (the last timed step's actions: rank, stage, kind, mb, start, end, cpu).

    With ``replays`` > 0 every candidate also gives ``"replay"`` (rank -> its actions, e.g. ``Schedule.actions``):
    after the warm-up and before the first timed step, ``replays`` times, each rank runs each candidate's compute
    actions of one step alone, in the schedule's order and without messages (:func:`_replay`), all ranks at once;
    per candidate ``replay_cpu_s`` holds the median CPU time per "stage kind". What an action costs in a step
    depends on what ran before it (a W runs on intermediate gradients that the F and I of other micro-batches
    have pushed out of the cache since), which a per-layer profile does not see and a replay does.
    """
    import torch.multiprocessing as mp

    if not candidates:
        raise ValueError("no candidate to run")
    worlds = {max(c["stage_rank"]) + 1 for c in candidates}
    if len(worlds) != 1:
        raise ValueError(f"every candidate must use the same ranks, got {sorted(worlds)}")
    for c in candidates:
        if ("csv_text" in c) == ("builtin" in c):
            raise ValueError("give each candidate exactly one of csv_text and builtin")
    world = worlds.pop()
    if replays and any("replay" not in c for c in candidates):
        raise ValueError("replays need every candidate's actions per rank ('replay')")
    order = interleaving_plan(len(candidates), blocks, steps)
    with tempfile.TemporaryDirectory(prefix="pipesched-interleaved-") as tmp:
        csvs = []
        for k, c in enumerate(candidates):
            path = None
            if "csv_text" in c:
                path = str(Path(tmp) / f"schedule{k}.csv")
                Path(path).write_text(c["csv_text"])
            csvs.append(path)
        job = {"candidates": [{"spans": [list(s) for s in c["spans"]], "stage_rank": list(c["stage_rank"]), "builtin": c.get("builtin"),
                               "replay": {str(r): [[a.stage, a.kind, a.mb] for a in acts] for r, acts in c.get("replay", {}).items()}}
                              for c in candidates],
               "csv": csvs, "microbatches": microbatches, "batch": batch, "dim": dim, "model": model, "model_kwargs": dict(model_kwargs or {}),
               "threads": threads, "warmup": warmup, "plan": order, "replays": replays}
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        port = _free_port()
        t0 = time.perf_counter()
        procs = [ctx.Process(target=_interleaved_worker, args=(r, world, port, job, queue), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        results = gather_results(procs, queue, world, timeout_s, what="interleaved pipeline run")
        wall = time.perf_counter() - t0
    per_rank = [results[r]["steps"] for r in range(world)]
    out = []
    for k in range(len(candidates)):
        idx = [n for n, s in enumerate(per_rank[0]) if s["candidate"] == k]
        step_s = [max(per_rank[r][n]["duration_s"] for r in range(world)) for n in idx]
        blocks_of = [per_rank[0][n]["block"] for n in idx]
        block_medians = [statistics.median(s for s, b in zip(step_s, blocks_of, strict=True) if b == blk) for blk in range(blocks)]

        def rank_median(r: int, key: str, idx=idx) -> float:
            return statistics.median(per_rank[r][n][key] for n in idx)

        last = idx[-1]
        out.append({"step_s": step_s, "block_median_s": block_medians, "median_s": statistics.median(step_s),
                    "compute_s": [rank_median(r, "compute_s") for r in range(world)],
                    "compute_cpu_s": [rank_median(r, "compute_cpu_s") for r in range(world)],
                    "idle_s": [statistics.median(step_s[q] - per_rank[r][n]["compute_s"] for q, n in enumerate(idx)) for r in range(world)],
                    "wait_s": [rank_median(r, "wait_s") for r in range(world)],
                    "replay_cpu_s": {key: v for r in range(world) for key, v in results[r]["replayed"][k].items()},
                    "actions": [[r, *a] for r in range(world) for a in per_rank[r][last]["actions"]]})
    w0 = results[0]["window"]
    foreign = foreign_cores(w0["busy"], sum(results[r]["window"]["cpu"] for r in range(world)), w0["wall"])
    return {"candidates": out, "foreign_cores": foreign, "wall_s": wall, "world": world, "blocks": blocks, "steps": steps,
            "threads": [results[r]["threads"] for r in range(world)],
            "retain_freed_memory": [results[r]["retain_freed_memory"] for r in range(world)]}
