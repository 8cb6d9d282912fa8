"""Predicted versus measured: profile a real model on this machine, plan it, run it with gloo, compare.

:func:`cpu_validation` is the validation protocol on a CPU. Every input of the prediction is a separate
micro-measurement: of the machine and the runtime before the run, and of the layers and the ranks' own actions
alone, between the run's steps (step 5); none is taken from the pipelined steps it predicts:

1. the per-layer profile (:func:`profile_mlp`): the run's thread count, CPU time of the measuring thread
   (``clock="cpu"``: what a rank must compute, independent of who else runs), medians of 15, the fused
   backward accumulating into ``.grad`` as a pipelined step does, and the machine's other cores kept busy by
   processes training the same model (``min(ranks, cores) - 1`` co-runners: during the run they are busy with
   the other ranks, which costs a rank shared cache and memory bandwidth);
2. the runtime's own costs (:func:`calibrate_runtime`): a pipeline of near-empty blocks with the same
   activation size run by torch's runtime in ``ranks`` processes gives the CPU time per compute action beyond
   the layers, and a pipeline of equal ``4 * dim`` blocks (ranks that compute between their messages, as a
   real pipeline's do) the CPU time per point-to-point message (posting, copying, waking gloo's threads) and
   the share of step 3's cores its ranks really got while they outnumbered them (``efficiency``), and the same
   blocks with a 4x wider last one, run by torch's ``Schedule1F1B``, the cost of a receive posted late to a
   sender blocked on it (``handshake_s``, :mod:`pipesched.runtimes`);
3. the shared CPU (:func:`calibrate_cpu`), with as many processes as the run has ranks: the CPU share they
   get together while all compute (``cpu_share``: less than the cores when other users' processes run), and
   the one-way time of a gloo message of the run's activation size between two processes while the other
   ``ranks - 2`` compute (its wait part is the link latency);
4. the plan (for ``schedule="auto"``: every exportable family, chosen by :func:`pipesched.plan.choose_robust`, which
   treats simulated times within :data:`AUTO_TIE_MARGIN` as tied and then prefers fewer micro-batches in flight)
   and its prediction (simulator with processor sharing over ``cpu_share`` at that efficiency, the per-action and per-message CPU
   costs, :class:`pipesched.simulate.SharedCpu`; link latency = the measured one-way time less its CPU work; each arm's
   executor's message posting, :func:`pipesched.runtimes.rendezvous_for`, with that handshake);
5. the runs (torch's ``_PipelineScheduleRuntime`` in gloo processes), in ``rounds`` rounds of our plan and the
   usual default, a uniform split with torch's ``Schedule1F1B``, alternating which goes first. The prediction of
   a run comes from profiles taken *in the run's own processes, interleaved with its steps*
   (``run_pipeline(interleave_profile=...)``): before every timed step, between two barriers and outside the
   step's timing, every rank profiles the whole chain once, in CPU time, and the plan is simulated on the
   per-layer median of all those passes. This virtual machine's CPU speed for the same work moves by tens of
   percent within seconds, also within one run (10 steps of one run ranged over 352-414 ms), so a profile taken
   earlier, even seconds before the first step (``pre_profile``, kept as ``error_pre_run``), predicts a run only
   as well as the machine held still; the interleaved passes sample the same seconds as the steps and see the
   processes' memory layout and contention. By default each rank then also *replays its own compute actions of a
   step* (``run_pipeline(interleave_replay=...)``: its stages' forwards and backwards in the schedule's order,
   without messages, all ranks at once), and the run is predicted from those CPU times (:func:`replayed_plan`),
   which see what the per-layer passes miss: a backward inside a step costs more than the same layers timed one
   by one next to other ranks doing the same (the per-layer prediction is kept as ``error_interleaved``). The
   plan itself is chosen from the earlier profile (as a user would plan), and the earlier profiles, pooled by
   median, give another prediction kept for comparison (``error_pooled``).
   Compared on iteration time, per-action durations and CPU times, per-rank CPU time and activation memory; the
   plan's gain is the baseline's measured time over ours within each round (:func:`summarize_rounds`). A CPU
   speed probe (:func:`speed_probe`, the model's own chain) is read around every profile and run and recorded
   with the prediction it would give (:func:`rescaled_plan`), but not used: on this machine it did not track
   the runs' speed (``bench_pipesched.py --drift``).
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from .devices import Device, LinkModel
from .export import schedule_csv, spans_for_schedule
from .models import mlp_chain
from .plan import Plan, choose_robust, plan, plan_partition, resimulate, uniform_plan, with_runtime
from .profile import ModelProfile, measure_profile, median_profile, profile_from_dict, retain_freed_memory
from .runner import RunResult, foreign_cores, gather_results, machine_busy_s, run_pipeline
from .runtimes import rendezvous_for
from .schedules import Schedule, make_schedule
from .simulate import Rendezvous, SharedCpu, StageCost, lower_bound, simulate

EXPORTABLE = ("1f1b", "zbh1", "gpipe", "interleaved")


def profile_mlp(widths: list[int], dim: int, microbatch: int, threads: int = 1, repeats: int = 5, statistic: str = "median",
                clock: str = "wall", warmup: int = 1, co_runners: int = 0, passes: int = 1) -> ModelProfile:
    """Measured profile of :func:`pipesched.models.mlp_chain` with the MSE loss on the last layer.

    ``co_runners`` other processes train the same model (forward + backward of the whole chain, same
    micro-batch, same threads) while the layers are profiled, so that the profile is taken under the run's
    concurrency: with ``ranks`` processes on a few cores, a rank's layers share the caches and memory bandwidth
    with the others and lose their cache contents at every time slice. With ``clock="cpu"`` the profile then
    holds the CPU time a layer costs in those conditions; the time-slicing itself is left to the simulator.
    """
    import torch

    layers = mlp_chain(widths, dim)
    target = torch.randn(microbatch, dim)
    with _co_running(co_runners, {"widths": list(widths), "dim": dim, "microbatch": microbatch, "threads": threads}):
        prof = measure_profile(layers, torch.randn(microbatch, dim), loss_fn=lambda out: torch.nn.functional.mse_loss(out, target),
                               repeats=repeats, warmup=warmup, threads=threads, name=f"mlp{len(widths)}x{dim}", statistic=statistic,
                               clock=clock, passes=passes)
    if co_runners:
        prof = replace(prof, reference={**prof.reference, "co_runners": co_runners})
    return prof


@dataclass(frozen=True)
class SpeedProbe:
    """One reading of :func:`speed_probe`: how long a fixed workload took on this CPU just now (seconds)."""

    cpu_s: float          # median CPU time of the measuring thread per repetition
    wall_s: float         # median wall time per repetition
    at: float             # time.time() when it ended
    samples_cpu_s: tuple[float, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"cpu_s": self.cpu_s, "wall_s": self.wall_s, "at": self.at, "samples_cpu_s": list(self.samples_cpu_s)}


def speed_probe(widths: list[int], dim: int, microbatch: int, *, threads: int = 1, repeats: int = 7, warmup: int = 2,
                seed: int = 0) -> SpeedProbe:
    """The CPU's current speed on the model's own kernels: one forward + backward of the whole chain, timed.

    A fixed workload (the :func:`pipesched.models.mlp_chain` of ``widths`` on one micro-batch, MSE loss, the
    backward accumulating into ``.grad`` as in training), run ``repeats`` times in the calling thread after
    ``warmup`` untimed repetitions; medians of the thread's CPU time and of the wall time. Taken at profile time
    and again right before a run, the ratio of the two readings is how much slower or faster the same work has
    become (this virtual machine's CPU speed drifts by tens of percent within minutes), so the profile can be
    rescaled to the CPU the run will get without looking at the run (:func:`probe_scale`).

    >>> p = speed_probe([16, 64], 8, 4, repeats=3, warmup=1)
    >>> p.cpu_s > 0 and p.wall_s > 0 and len(p.samples_cpu_s) == 3
    True
    """
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = torch.nn.Sequential(*mlp_chain(widths, dim, seed=seed))
        gen = torch.Generator().manual_seed(seed + 1)
        x, y = torch.randn(microbatch, dim, generator=gen), torch.randn(microbatch, dim, generator=gen)
        cpu, wall = [], []
        for k in range(warmup + repeats):
            c0, t0 = time.thread_time(), time.perf_counter()
            torch.nn.functional.mse_loss(model(x), y).backward()
            c1, t1 = time.thread_time(), time.perf_counter()
            if k >= warmup:
                cpu.append(c1 - c0)
                wall.append(t1 - t0)
    finally:
        torch.set_num_threads(old)
    return SpeedProbe(statistics.median(cpu), statistics.median(wall), time.time(), tuple(cpu))


def probe_scale(at_profile: SpeedProbe | float, now: SpeedProbe | float) -> float:
    """Factor by which CPU work measured at ``at_profile`` is expected to take longer ``now``: the ratio of two probes.

    >>> probe_scale(0.080, 0.092)
    1.15
    """
    a = at_profile.cpu_s if isinstance(at_profile, SpeedProbe) else float(at_profile)
    b = now.cpu_s if isinstance(now, SpeedProbe) else float(now)
    if not (a > 0 and b > 0):
        raise ValueError(f"probe readings must be positive, got {a} and {b}")
    return round(b / a, 12)


def _co_runner(job: dict[str, Any], ready, stop) -> None:
    import torch

    torch.set_num_threads(job["threads"])
    retain_freed_memory()   # the co-runner stands for a rank, which runs so
    model = torch.nn.Sequential(*mlp_chain(job["widths"], job["dim"]))
    x = torch.randn(job["microbatch"], job["dim"])
    for _ in range(2):
        model(x).square().mean().backward()
    ready.set()
    while not stop.is_set():
        model(x).square().mean().backward()


@contextlib.contextmanager
def _co_running(count: int, job: dict[str, Any]):
    """``count`` processes training the model in a loop for the duration of the block (none for 0)."""
    if count <= 0:
        yield
        return
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    readies = [ctx.Event() for _ in range(count)]
    procs = [ctx.Process(target=_co_runner, args=(job, ready, stop), daemon=True) for ready in readies]
    for p in procs:
        p.start()
    try:
        for ready, p in zip(readies, procs, strict=True):
            while not ready.wait(timeout=1.0):
                if p.exitcode is not None:
                    raise RuntimeError(f"co-runner process exited with code {p.exitcode}")
        yield
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)


# --------------------------------------------------------------------------------------------------------------
# The shared CPU: compute throughput of several processes, and the cost of a gloo message among them
# --------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CpuCalibration:
    """What :func:`calibrate_cpu` measured (seconds, bytes); ``shared_cpu()`` and ``link()`` feed the simulator."""

    ranks: int
    cores: float                  # compute the ranks get together, in single-process units: cpu_share / slowdown
    message_bytes: int
    one_way_s: float              # mean one-way time of a message (ping-pong / 2) while ranks - 2 others compute
    message_cpu_s: float          # CPU time (all threads of the process) one message costs each of its two ranks
    solo_rate: float              # matmul loop iterations per second, one process alone
    all_rate: float               # the same summed over `ranks` processes running together
    foreign_cores: float = 0.0    # cores other processes kept busy meanwhile (machine busy - ours), for the record
    cpu_share: float = 0.0        # CPU seconds our processes got per second while all computed
    slowdown: float = 1.0         # CPU time per loop iteration with all computing / alone

    @property
    def latency_s(self) -> float:
        """The wait part of a message: one-way time less the CPU work at both ends (that work is simulated as compute)."""
        return max(0.0, self.one_way_s - 2 * self.message_cpu_s)

    def shared_cpu(self) -> SharedCpu:
        return SharedCpu(self.cores, self.message_cpu_s)

    def link(self) -> LinkModel:
        """Every rank pair: latency = :attr:`latency_s` at the calibrated size (bandwidth term folded in: all cuts carry it)."""
        return LinkModel.uniform(self.ranks, math.inf, self.latency_s)

    def to_dict(self) -> dict[str, Any]:
        return {"ranks": self.ranks, "cores": self.cores, "message_bytes": self.message_bytes, "one_way_s": self.one_way_s,
                "message_cpu_s": self.message_cpu_s, "latency_s": self.latency_s, "solo_rate": self.solo_rate, "all_rate": self.all_rate,
                "foreign_cores": self.foreign_cores, "cpu_share": self.cpu_share, "slowdown": self.slowdown}


def _spin(torch, seconds: float) -> int:
    """Single-threaded matmul loop of the validation model's shape (a wide block's first linear); iterations done."""
    a, b = torch.randn(48, 384), torch.randn(384, 3072)
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ b
        n += 1
    return n


def _calibration_worker(rank: int, world: int, port: int, job: dict[str, Any], queue, stop) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(job["threads"])
    retain_freed_memory()   # as the ranks it stands for
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        window = job["window_s"]
        _spin(torch, 0.2)                                 # warm the caches and the allocator
        solo = together = 0
        solo_cpu = cpu = busy = wall = 0.0
        for _ in range(job["alternations"]):
            dist.barrier()
            c0 = time.process_time()
            solo += _spin(torch, window) if rank == 0 else 0   # phase 1: one process alone
            solo_cpu += time.process_time() - c0
            if rank != 0:
                time.sleep(window)
            dist.barrier()
            c0, b0, t0 = time.process_time(), machine_busy_s(), time.perf_counter()
            together += _spin(torch, window)                   # phase 2: all of them at once
            cpu, busy, wall = cpu + time.process_time() - c0, busy + machine_busy_s() - b0, wall + time.perf_counter() - t0
        dist.barrier()
        result: dict[str, Any] = {"rank": rank, "solo": solo, "solo_cpu": solo_cpu, "together": together, "cpu": cpu, "busy": busy,
                                  "wall": wall}
        # Phase 3: ranks 0 and 1 ping-pong messages of the run's size while the others compute.
        if rank <= 1 and world >= 2:
            buf = torch.zeros(max(1, job["message_bytes"] // 4))
            peer = 1 - rank

            def ping_pong(rounds: int) -> None:
                for _ in range(rounds):
                    if rank == 0:
                        dist.send(buf, peer)
                        dist.recv(buf, peer)
                    else:
                        dist.recv(buf, peer)
                        dist.send(buf, peer)

            ping_pong(5)  # connection set-up and warm caches
            c0, t0 = time.process_time(), time.perf_counter()
            ping_pong(job["rounds"])
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            result |= {"one_way": wall / (2 * job["rounds"]), "cpu_per_message": cpu / (2 * job["rounds"])}
            if rank == 0:
                stop.set()
        else:
            while not stop.is_set():
                _spin(torch, 0.05)
        queue.put(result)
        dist.barrier()
        dist.destroy_process_group()
    except Exception as exc:   # report, do not hang the parent
        queue.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})


def calibrate_cpu(ranks: int, message_bytes: int, *, threads: int = 1, window_s: float = 1.0, alternations: int = 2, rounds: int = 300,
                  timeout_s: float = 120) -> CpuCalibration:
    """Measure, with ``ranks`` processes, the compute throughput they share and the cost of a gloo message.

    Phase 1 and 2 (alternated ``alternations`` times, ``window_s`` each): a single-threaded matmul loop run by
    one process, then by all ``ranks`` at once. ``cores`` = the CPU seconds per second our processes got while
    all ran (``cpu_share``: at most the machine's cores, less what other processes took; on this machine other
    users' ``nice`` jobs sit in other autogroups and still take up to a core) divided by ``slowdown``, the CPU
    time per loop iteration with all running relative to alone (time-slicing's cost in caches and switches).
    That is the compute rate the ranks share in the simulator's processor sharing, in units of the profile
    (also CPU time). Phase 3: ranks 0 and 1
    exchange ``message_bytes`` tensors with blocking gloo send/recv, ``rounds`` round trips, while the other
    ``ranks - 2`` processes keep computing (the run's condition: a pipeline neighbour pair talks while the
    others work); the mean one-way time (means, not medians: a critical path adds them up) and the CPU time
    of both processes per message (process CPU time, so gloo's own threads are included). For ``ranks = 1``
    no message is measured.
    """
    import torch.multiprocessing as mp

    world = max(ranks, 2) if ranks > 1 else 1
    ctx = mp.get_context("spawn")
    queue, stop = ctx.Queue(), ctx.Event()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    job = {"threads": threads, "window_s": window_s, "message_bytes": int(message_bytes), "rounds": rounds, "alternations": alternations}
    procs = [ctx.Process(target=_calibration_worker, args=(r, world, port, job, queue, stop), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results = gather_results(procs, queue, world, timeout_s, what="CPU calibration")
    solo = results[0]["solo"] / (window_s * alternations)
    together = sum(results[r]["together"] for r in range(world)) / (window_s * alternations)
    own_cpu = sum(results[r]["cpu"] for r in range(world))
    foreign = foreign_cores(results[0]["busy"], own_cpu, results[0]["wall"])
    share = own_cpu / results[0]["wall"] if results[0]["wall"] > 0 else float(world)
    # CPU time per loop iteration together / alone: what time-slicing costs beyond the share (caches, switches)
    slowdown = (own_cpu / together / (window_s * alternations)) / (results[0]["solo_cpu"] / results[0]["solo"]) if solo and together else 1.0
    one_way = statistics.mean(results[r]["one_way"] for r in (0, 1)) if world >= 2 else 0.0
    cpu = statistics.mean(results[r]["cpu_per_message"] for r in (0, 1)) if world >= 2 else 0.0
    return CpuCalibration(ranks, share / slowdown, int(message_bytes), one_way, cpu, solo, together, foreign, share, slowdown)


@dataclass(frozen=True)
class RuntimeCalibration:
    """Fixed CPU costs of torch's pipeline runtime over gloo, from :func:`calibrate_runtime` (seconds)."""

    action_cpu_s: float        # per compute action: CPU time of the action's thread beyond the layers' own work
    message_cpu_s: float       # per cross-rank message and rank: the rank's CPU time outside its actions, per message
    tiny_iteration_s: float    # iteration time of the near-empty pipeline (for the record)
    idle_message_cpu_s: float | None = None   # the same per message in the near-empty pipeline (when message_cpu_s is the loaded one)
    loaded_iteration_s: float | None = None   # iteration time of the loaded pipeline (for the record)
    efficiency: float = 1.0    # SharedCpu.efficiency that reproduces the loaded pipeline's iteration time (1 when not measured)
    loaded_fluid_s: float | None = None       # the loaded pipeline simulated with efficiency 1 on its own action CPU times
    handshake_s: float | None = None          # a late receive's cost (Rendezvous.handshake_s) that reproduces the late-receive chain
    late_iteration_s: float | None = None     # the late-receive chain's measured iteration time (torch's Schedule1F1B)
    late_latency_s: float | None = None       # the same simulated with one link latency per late receive

    def to_dict(self) -> dict[str, float | None]:
        return {"action_cpu_s": self.action_cpu_s, "message_cpu_s": self.message_cpu_s, "tiny_iteration_s": self.tiny_iteration_s,
                "idle_message_cpu_s": self.idle_message_cpu_s, "loaded_iteration_s": self.loaded_iteration_s,
                "efficiency": self.efficiency, "loaded_fluid_s": self.loaded_fluid_s, "handshake_s": self.handshake_s,
                "late_iteration_s": self.late_iteration_s, "late_latency_s": self.late_latency_s}


def solve_efficiency(schedule: Schedule, costs: Mapping[int, StageCost], links: LinkModel | None, shared: SharedCpu,
                     measured_s: float, *, low: float = 0.5, tolerance: float = 1e-4, rendezvous: Rendezvous | None = None) -> float:
    """The ``efficiency`` of ``shared`` at which ``schedule`` simulated on ``costs`` over ``links`` takes ``measured_s``.

    The simulated iteration time only grows as the efficiency falls, so a bisection on ``[low, 1]`` finds it.
    The result is clamped to that range: 1 when even ideal sharing is slower than the measurement (or the
    ranks never outnumber the cores, where the efficiency changes nothing), ``low`` when the measurement is
    slower than any efficiency down to ``low`` explains.

    >>> from pipesched.schedules import one_f_one_b
    >>> sched, costs = one_f_one_b(4, 8), {s: StageCost(f=1.0, b=2.0) for s in range(4)}
    >>> measured = simulate(sched, costs, cores=SharedCpu(2.0, efficiency=0.8)).makespan
    >>> round(solve_efficiency(sched, costs, None, SharedCpu(2.0), measured), 3)
    0.8
    """
    def makespan(eff: float) -> float:
        return simulate(schedule, costs, links, cores=replace(shared, efficiency=eff), rendezvous=rendezvous).makespan

    return _solve_monotone(makespan, measured_s, fast=1.0, slow=low, tolerance=tolerance)


def _solve_monotone(makespan, measured_s: float, *, fast: float, slow: float, tolerance: float) -> float:
    """Bisection for the x between ``fast`` and ``slow`` at which ``makespan(x)`` (monotone: shortest at ``fast``,
    longest at ``slow``) equals ``measured_s``; ``fast`` when even it is too slow, ``slow`` when even it is too fast."""
    if makespan(fast) >= measured_s:
        return fast
    if makespan(slow) <= measured_s:
        return slow
    while abs(slow - fast) > tolerance:
        mid = (fast + slow) / 2
        if makespan(mid) > measured_s:
            slow = mid
        else:
            fast = mid
    return (fast + slow) / 2


@dataclass(frozen=True)
class _RuntimeRun:
    action_cpu_s: float
    message_cpu_s: float
    iteration_s: float
    profile: ModelProfile
    run: RunResult


def _runtime_costs(stages: int, width: int, *, dim: int, batch: int, microbatches: int, threads: int,
                   iterations: int, runtime: str = "torch-1f1b", last_width: int | None = None) -> _RuntimeRun:
    """Per-action extra CPU (median), per-message CPU and iteration time of a 1F1B pipeline of ``stages`` blocks of
    ``width`` (one per rank; the last one ``last_width`` wide if given), against their profile taken here the
    validation's way. ``runtime``: torch's built-in ``Schedule1F1B`` (``"torch-1f1b"``) or our exported 1F1B
    through ``_PipelineScheduleRuntime`` (``"torch-runtime"``)."""
    widths = [width] * (stages - 1) + [last_width or width]
    mb = batch // microbatches
    prof = profile_mlp(widths, dim, mb, threads=threads, repeats=15, statistic="median", clock="cpu", warmup=2, passes=PROFILE_PASSES)
    how: dict[str, Any] = ({"builtin": "1F1B"} if runtime == "torch-1f1b" else
                           {"csv_text": schedule_csv(make_schedule("1f1b", stages, microbatches))})
    run = run_pipeline([(s, s + 1) for s in range(stages)], list(range(stages)), microbatches=microbatches, batch=batch, dim=dim,
                       model_kwargs={"widths": widths, "dim": dim}, iterations=iterations, warmup=1, threads=threads, **how)
    extra = []
    for key, cpu in run.action_cpu_medians.items():
        stage, kind = key.split()
        lay = prof.layers[int(stage)]
        extra.append(cpu - (lay.fwd_s if kind == "F" else lay.bwd_s))
    outside = messages = 0.0
    for r in range(stages):
        inside = microbatches * (run.action_cpu_medians.get(f"{r} F", 0.0) + run.action_cpu_medians.get(f"{r} B", 0.0))
        outside += max(0.0, run.rank_cpu_s[r] - inside)
        messages += 2 * microbatches * ((r > 0) + (r < stages - 1))
    return _RuntimeRun(max(0.0, statistics.median(extra)) if extra else 0.0, outside / messages if messages else 0.0, run.median_s,
                       prof, run)


LATE_RECEIVE_FACTOR = 4
"""How much wider the last block of :func:`calibrate_runtime`'s late-receive chain is than the others: a busy last
rank whose forward inputs torch's ``Schedule1F1B`` asks for only once its previous backward is done."""


def solve_handshake(schedule: Schedule, costs: Mapping[int, StageCost], links: LinkModel | None, shared: SharedCpu,
                    rendezvous: Rendezvous, measured_s: float, *, high: float = 0.05, tolerance: float = 1e-6) -> float:
    """The late-receive cost (``Rendezvous.handshake_s``) at which ``schedule`` takes ``measured_s``.

    Simulated on ``costs`` over ``links`` and ``shared``, with the runtime's receive posts and send waits of
    ``rendezvous``; a later handshake delays every receive posted after its send, so the iteration time only
    grows with it and a bisection on ``[0, high]`` finds it (clamped to that range).

    >>> from pipesched.runtimes import builtin_1f1b_rendezvous
    >>> from pipesched.schedules import one_f_one_b
    >>> sched = one_f_one_b(2, 6)
    >>> costs = {0: StageCost(f=0.1, b=0.2, out_bytes=1.0), 1: StageCost(f=1.0, b=2.0, out_bytes=1.0)}
    >>> rv = builtin_1f1b_rendezvous(sched)
    >>> measured = simulate(sched, costs, None, cores=SharedCpu(2.0), rendezvous=replace(rv, handshake_s=0.3)).makespan
    >>> round(solve_handshake(sched, costs, None, SharedCpu(2.0), rv, measured, high=1.0), 4)
    0.3
    """
    def makespan(h: float) -> float:
        return simulate(schedule, costs, links, cores=shared, rendezvous=replace(rendezvous, handshake_s=h)).makespan

    return _solve_monotone(makespan, measured_s, fast=0.0, slow=high, tolerance=tolerance)


def calibrate_runtime(stages: int, *, dim: int, batch: int, microbatches: int, threads: int = 1, iterations: int = 5,
                      load_width: int | None = None, cores: float | None = None, link: LinkModel | None = None) -> RuntimeCalibration:
    """The runtime's own CPU cost per action and per message, measured on pipelines of equal one-block stages.

    A chain of ``stages`` blocks of hidden width 8 (same ``dim``, so the same activation bytes cross the same
    boundaries as in the real run) is run by torch's ``Schedule1F1B`` in ``stages`` gloo processes. Its layers
    are profiled the same way as the real model (CPU time, medians). Per action: measured thread CPU time less
    the layers' profiled work -> median over actions = ``action_cpu_s`` (near-empty blocks make that difference
    exact to a few microseconds). Per rank: CPU time of all threads during a step less the CPU time of its
    actions = the cost of its messages (posting, copying, waiting, waking gloo's threads) and of the schedule
    loop; summed over ranks and divided by the messages they handle = the per-message cost.

    With ``load_width`` the per-message cost (``message_cpu_s``) is taken instead from a second chain whose
    blocks have that hidden width, run as our plans are (our exported 1F1B through torch's
    ``_PipelineScheduleRuntime``), so that the ranks compute between their messages as a real pipeline's do:
    in the three committed validation runs a message cost 0.44-0.82 ms of CPU among computing ranks against
    0.30-0.48 ms among near-idle ones (the near-empty pipeline's figure stays in ``idle_message_cpu_s``). ``cpu_validation`` uses ``4 * dim``, a
    transformer MLP's ratio, not the validated model's widths.

    With ``load_width`` and ``cores`` (the CPU share of :func:`calibrate_cpu`) it also measures two constants of
    the simulator, each on a synthetic chain, never on the model being validated:

    - the :class:`~pipesched.simulate.SharedCpu` ``efficiency``: the loaded chain is a balanced pipeline, every
      rank computing between its messages, so its ranks outnumber the cores most of the time. Simulated on the
      CPU time each of its actions measured inside the steps, with these per-action and per-message costs and
      its runtime's message posting (:func:`pipesched.runtimes.asap_lowering_rendezvous`), over ``link``
      (default: free transfers), it comes out faster than measured; the efficiency is the value at which it
      takes the measured iteration time (:func:`solve_efficiency`). The loaded chain runs twice ``iterations``
      timed steps.
    - the cost of a *late receive* (``handshake_s``): gloo moves a message only once its receive is posted, and
      torch's built-in ``Schedule1F1B`` posts each receive right before the action that needs it. A chain of the
      same blocks whose last one is :data:`LATE_RECEIVE_FACTOR` times wider (a busy last rank asking its idle
      neighbour for each forward's input only after its backward) is run by that schedule, and the value at
      which its simulation with the built-in's posting (:func:`pipesched.runtimes.builtin_1f1b_rendezvous`) at
      the efficiency above takes the measured time is the handshake (:func:`solve_handshake`): on this machine
      the validated 2-rank baseline's busy rank waited 2.4-2.7 ms on average before each such forward, where a
      gloo ping-pong takes 0.06 ms, and the calibrations gave 1.7-3.6 ms.
    """
    common = {"dim": dim, "batch": batch, "microbatches": microbatches, "threads": threads, "iterations": iterations}
    tiny = _runtime_costs(stages, 8, **common)
    if load_width is None:
        return RuntimeCalibration(tiny.action_cpu_s, tiny.message_cpu_s, tiny.iteration_s)
    loaded = _runtime_costs(stages, load_width, **{**common, "iterations": 2 * iterations}, runtime="torch-runtime")
    efficiency, fluid_s, handshake, late_s, late_posted_s = 1.0, None, None, None, None
    if cores is not None:
        shared = SharedCpu(cores, loaded.message_cpu_s, tiny.action_cpu_s)
        devices = [Device(f"cpu-rank{r}") for r in range(stages)]
        chain = uniform_plan(loaded.profile, devices, link, microbatches=microbatches, family="1f1b", cores=shared, runtime="torch-runtime")
        costs = measured_costs(chain, loaded.run.action_cpu_medians, tiny.action_cpu_s)
        rv = rendezvous_for("torch-runtime", chain.schedule)
        fluid_s = simulate(chain.schedule, costs, link, cores=shared, rendezvous=rv).makespan
        efficiency = solve_efficiency(chain.schedule, costs, link, shared, loaded.iteration_s, rendezvous=rv)
        late = _runtime_costs(stages, load_width, **{**common, "iterations": 2 * iterations}, runtime="torch-1f1b",
                              last_width=LATE_RECEIVE_FACTOR * load_width)
        late_chain = uniform_plan(late.profile, devices, link, microbatches=microbatches, family="1f1b", cores=shared)
        late_costs = measured_costs(late_chain, late.run.action_cpu_medians, tiny.action_cpu_s)
        late_rv = rendezvous_for("torch-1f1b", late_chain.schedule)
        at_efficiency = replace(shared, efficiency=efficiency)
        late_s = late.iteration_s
        late_posted_s = simulate(late_chain.schedule, late_costs, link, cores=at_efficiency, rendezvous=late_rv).makespan
        handshake = solve_handshake(late_chain.schedule, late_costs, link, at_efficiency, late_rv, late_s)
    return RuntimeCalibration(tiny.action_cpu_s, loaded.message_cpu_s, tiny.iteration_s, idle_message_cpu_s=tiny.message_cpu_s,
                              loaded_iteration_s=loaded.iteration_s, efficiency=efficiency, loaded_fluid_s=fluid_s,
                              handshake_s=handshake, late_iteration_s=late_s, late_latency_s=late_posted_s)


def compare(p: Plan, run: RunResult) -> dict[str, Any]:
    """Errors of a plan's prediction against a measured run.

    Per action ("stage kind"): the simulated duration (median over micro-batches; it includes processor
    sharing and the per-message CPU work) against the measured wall median, and the action's CPU work in the
    model (profile + the runtime's per-action cost) against the CPU time its thread measured. Per rank: the
    modelled work (those plus the message CPU) against the CPU time of all the rank's threads during a step, and
    the time the simulator has it idle (the makespan less its actions) against the wall time it spent waiting on
    messages (``RunResult.rank_wait_s``; empty for runs recorded before it was measured).
    """
    predicted = p.sim.makespan
    measured = run.median_s
    per_action = []
    sim_by_key: dict[str, list[float]] = {}
    for s in p.sim.timeline:
        sim_by_key.setdefault(f"{s.action.stage} {s.action.kind}", []).append(s.end - s.start)
    message_cpu = p.shared_cpu.message_cpu_s if p.shared_cpu is not None else 0.0
    action_cpu = p.shared_cpu.action_cpu_s if p.shared_cpu is not None else 0.0
    work_by_key = {}     # the action's CPU work in the model inside the timed call: profile + the runtime's per-action cost
    for acts in p.schedule.actions.values():
        for a in acts:
            work_by_key[f"{a.stage} {a.kind}"] = p.costs[a.stage].duration(a.kind) + action_cpu
    for key, value in sorted(run.action_medians.items()):
        if key in sim_by_key:
            pred = statistics.median(sim_by_key[key])
            row = {"action": key, "predicted_s": pred, "measured_s": value, "error": pred / value - 1 if value else 0.0}
            cpu = run.action_cpu_medians.get(key)
            if cpu:
                row |= {"work_predicted_s": work_by_key[key], "cpu_measured_s": cpu, "work_error": work_by_key[key] / cpu - 1}
            per_action.append(row)
    act_pred = [peak - sum(p.costs[s].state_bytes for s in range(p.schedule.num_stages) if p.schedule.stage_rank[s] == r)
                for r, peak in enumerate(p.sim.peak_memory)]
    rank_work = [sum(work_by_key[f"{a.stage} {a.kind}"] + message_cpu * p.schedule.cross_rank_messages(a) for a in p.schedule.actions[r])
                 for r in range(p.schedule.ranks)]
    return {
        "schedule": p.family, "predicted_s": predicted, "measured_s": measured, "measured_iterations_s": run.iteration_s,
        "error": predicted / measured - 1.0, "error_vs_fastest": predicted / min(run.iteration_s) - 1.0,
        "bubble_predicted": p.sim.bubble_fraction, "lower_bound_s": p.bound["bound_s"],
        "per_action": per_action,
        "per_action_mape": statistics.mean(abs(a["error"]) for a in per_action) if per_action else None,
        "work_mape": statistics.mean(abs(a["work_error"]) for a in per_action if "work_error" in a) if per_action else None,
        "rank_work_predicted_s": rank_work, "rank_cpu_measured_s": run.rank_cpu_s, "foreign_cores": run.foreign_cores,
        "rank_idle_predicted_s": [predicted - b for b in p.sim.busy], "rank_wait_measured_s": run.rank_wait_s,
        "activation_peak_predicted_bytes": act_pred, "activation_peak_measured_bytes": run.peak_saved_bytes,
        "rss_growth_bytes": run.peak_rss_growth_bytes,
    }


def run_action_costs(p: Plan, run: RunResult) -> dict[int, StageCost]:
    """``p``'s stage costs with every action's CPU work replaced by the median CPU time its thread measured in ``run``.

    A diagnostic, not a prediction (it uses the run): simulating the plan on these costs shows how much of a
    prediction's error comes from the action costs (profile against what the actions cost inside the steps) and
    how much from the rest of the model (dependencies, processor sharing, messages). The runtime's per-action
    CPU cost, which the simulator adds to every action, is taken off the measured time.
    """
    extra = p.shared_cpu.action_cpu_s if p.shared_cpu is not None else 0.0
    return measured_costs(p, run.action_cpu_medians, extra)


def measured_costs(p: Plan, medians: dict[str, float], extra: float = 0.0) -> dict[int, StageCost]:
    """``p``'s stage costs with each action found in ``medians`` ("stage kind" -> CPU seconds) set to that time less ``extra``."""
    def measured(sid: int, kind: str) -> float | None:
        v = medians.get(f"{sid} {kind}")
        return None if v is None else max(0.0, v - extra)

    out = {}
    for sid, cost in p.costs.items():
        f, b, i, w = (measured(sid, k) for k in ("F", "B", "I", "W"))
        if b is None:   # a split backward (I then W) was measured: the fused one costs their sum
            b = i + w if i is not None and w is not None else cost.b
        out[sid] = replace(cost, f=cost.f if f is None else f, b=b, i=cost.i if i is None else i, w=cost.w if w is None else w)
    return out


def replayed_plan(p: Plan, run: RunResult) -> Plan | None:
    """``p`` predicted from the CPU times of the run's replays (``run_pipeline(interleave_replay=...)``); ``None`` without them.

    Every compute action costs what its replay between the steps measured (each rank's own actions of a step,
    in the schedule's order, without messages); the simulator adds the runtime's per-action and per-message
    CPU work, the links and the processor sharing as for any other prediction.
    """
    if not run.replay_cpu_medians:
        return None
    costs = measured_costs(p, run.replay_cpu_medians)
    return replace(p, costs=costs, sim=resimulate(p, costs), bound=lower_bound(p.schedule, costs, p.links))


def _ranks_prediction(chosen: Plan, profiles: list[dict[str, Any]], source: str) -> tuple[ModelProfile | None, Plan | None]:
    """The per-layer median of the ranks' profiles (JSON form) and ``chosen`` predicted from it; ``(None, None)`` without profiles."""
    if not profiles:
        return None, None
    prof = median_profile([profile_from_dict(d, source=source) for d in profiles])
    return prof, rescaled_plan(chosen, prof, 1.0)


def _source_fields(name: str, prof: ModelProfile | None, predicted: Plan | None, run: RunResult) -> dict[str, float | None]:
    """``predicted_<name>_s``, ``error_<name>`` and ``<name>_profile_total_s`` (F + B of all layers) of one prediction source."""
    if prof is None or predicted is None:
        return {f"predicted_{name}_s": None, f"error_{name}": None, f"{name}_profile_total_s": None}
    return {f"predicted_{name}_s": predicted.sim.makespan, f"error_{name}": predicted.sim.makespan / run.median_s - 1.0,
            f"{name}_profile_total_s": sum(lay.fwd_s + lay.bwd_s for lay in prof.layers)}


PROFILE_PASSES = 5
"""Passes over the chain the CPU profiles spread their repetitions over (:func:`pipesched.profile.measure_profile`)."""

PRE_RUN_REPEATS = 6
PRE_RUN_PASSES = 3
"""Repetitions per layer (spread over passes of the chain) of the profile each rank takes right before a validation run."""

INTERLEAVE_REPEATS = 1
"""Repetitions per layer of the profile pass each rank takes before every timed step of a validation run: with
4 ranks and 10 steps, 40 samples per layer over the run's own seconds, at about one step's cost per pass."""

PREDICTION_SOURCES = ("interleaved", "replay", "pre-run", "pooled", "probe-scaled")

AUTO_TIE_MARGIN = 0.05
"""Simulated iteration times closer than this (a fraction) count as tied when ``cpu_validation`` picks a schedule
(:func:`pipesched.plan.choose_robust`): the median absolute error of the CPU predictions committed before this rule
(quiet machine, six runs: 9.8, 2.6, 1.5, 27.5, 0.3, 6.2 %) was 4.4 %, so a smaller gap is not a ranking."""


def rescaled_plan(p: Plan, profile: ModelProfile, scale: float) -> Plan:
    """``p`` (same partition, schedule, devices and links) predicted with every CPU work ``scale`` times longer.

    The profile's times and the :class:`~pipesched.simulate.SharedCpu`'s per-action and per-message CPU work are
    multiplied by ``scale`` (a :func:`probe_scale` ratio: the machine got that much slower since the profile);
    the CPU share and the link's wait are not CPU work and stay. ``scale = 1`` reproduces ``p``'s simulation.
    """
    if p.shared_cpu is None:
        raise ValueError("rescaled_plan needs a plan simulated with a SharedCpu")
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    cores = replace(p.shared_cpu, message_cpu_s=p.shared_cpu.message_cpu_s * scale, action_cpu_s=p.shared_cpu.action_cpu_s * scale)
    return plan_partition(profile.scaled(scale), p.partition, p.devices, p.links, family=p.family, microbatches=p.schedule.microbatches,
                          chunks=p.chunks, cores=cores, runtime=p.runtime, handshake_s=p.handshake_s)


def summarize_rounds(rounds: list[dict[str, Any]], arms: tuple[str, ...] = ("ours", "uniform_torch_1f1b"), tolerance: float = 0.10,
                     ) -> dict[str, Any]:
    """Aggregate per-round runs: per arm the errors, how many are within ``tolerance``, their median; the paired speed-ups.

    Each round is ``{arm: {"predicted_s", "measured_s", "error", ...}, ...}``; the speed-up of a round is the baseline's
    measured median over ours (the two runs of a round are back to back, so slow drift cancels in the ratio).

    >>> r = [{"ours": {"error": 0.02, "measured_s": 1.0}, "uniform_torch_1f1b": {"error": -0.12, "measured_s": 1.3}},
    ...      {"ours": {"error": -0.05, "measured_s": 1.1}, "uniform_torch_1f1b": {"error": 0.04, "measured_s": 1.32}}]
    >>> s = summarize_rounds(r)
    >>> s["runs"], s["within"], s["ours"]["within"], round(s["speedup_median"], 3)
    (4, 3, 2, 1.25)
    """
    out: dict[str, Any] = {"tolerance": tolerance, "rounds": len(rounds)}
    runs = within = 0
    for arm in arms:
        errors = [r[arm]["error"] for r in rounds if arm in r]
        if not errors:
            continue
        ok = sum(abs(e) <= tolerance for e in errors)
        out[arm] = {"errors": errors, "within": ok, "median_error": statistics.median(errors),
                    "median_abs_error": statistics.median(abs(e) for e in errors), "max_abs_error": max(abs(e) for e in errors)}
        runs, within = runs + len(errors), within + ok
    out["runs"], out["within"] = runs, within
    if len(arms) == 2:
        pairs = [r[arms[1]]["measured_s"] / r[arms[0]]["measured_s"] for r in rounds if arms[0] in r and arms[1] in r]
        if pairs:
            out |= {"speedups": pairs, "speedup_median": statistics.median(pairs), "speedup_min": min(pairs), "speedup_max": max(pairs),
                    "rounds_won": sum(x > 1 for x in pairs)}
    return out


def _plan_candidates(profile: ModelProfile, devices: list[Device], link: LinkModel, *, microbatches: int, schedule: str,
                     cores: SharedCpu | None, tie_margin: float, runtime: str = "ideal",
                     handshake_s: float | None = None) -> tuple[Plan, list[dict[str, Any]]]:
    """Every exportable family (or just ``schedule``) planned on ``profile`` and simulated as ``runtime`` runs it; the
    robust pick and a record of each try."""
    candidates, alternatives = [], []
    for fam in [f for f in EXPORTABLE if schedule in ("auto", f)]:
        try:
            cand = with_runtime(plan(profile, devices, link, microbatches=microbatches, schedule=fam, cores=cores), runtime, handshake_s)
        except Exception as exc:   # a family that does not apply to this shape (e.g. interleaving with too few layers)
            alternatives.append({"schedule": fam, "error": str(exc)})
            continue
        candidates.append(cand)
        alternatives.append({"schedule": fam, "predicted_s": cand.sim.makespan, "in_flight": cand.in_flight,
                             "spans": [list(s.layers) for s in cand.partition.stages]})
    return choose_robust(candidates, tie_margin), alternatives


def _ours_arm(best: Plan) -> tuple[str, Plan, dict[str, Any]]:
    """``run_pipeline`` arguments of our plan (its CSV through torch's schedule runtime)."""
    return ("ours", best, {"spans": spans_for_schedule(best.schedule, best.partition), "stage_rank": list(best.schedule.stage_rank),
                           "csv_text": schedule_csv(best.schedule)})


def _uniform_arm(uni: Plan) -> tuple[str, Plan, dict[str, Any]]:
    """``run_pipeline`` arguments of the baseline: the uniform split with torch's own ``Schedule1F1B``."""
    return ("uniform_torch_1f1b", uni, {"spans": [s.layers for s in uni.partition.stages], "stage_rank": list(range(len(uni.partition.stages))),
                                        "builtin": "1F1B"})


def cpu_validation(widths: list[int], *, dim: int, batch: int, microbatches: int, stages: int, threads: int = 1,
                   iterations: int = 3, warmup: int = 1, schedule: str = "auto", baseline: bool = True,
                   cores: float | None = None, repeats: int = 15, rounds: int = 1, probe: bool = True,
                   tie_margin: float = AUTO_TIE_MARGIN, passes: int = PROFILE_PASSES, predict_from: str = "replay",
                   pre_run_repeats: int = PRE_RUN_REPEATS, interleave_repeats: int = INTERLEAVE_REPEATS,
                   replay: bool | None = None) -> dict[str, Any]:
    """Calibrate, profile, plan, then ``rounds`` rounds of predicted runs; returns a JSON-able report.

    Before the runs (module docstring, steps 1-4): the CPU and runtime calibrations (the latter with the CPU's
    sharing efficiency, :func:`calibrate_runtime`; ``error_ideal_sharing`` records each prediction without it), a first profile (spread over
    ``passes`` passes of the chain) and the plan: for ``schedule="auto"`` every exportable family is planned on it
    and :func:`pipesched.plan.choose_robust` picks among them with ``tie_margin``. Each round then takes one more
    profile (from the second round on) and runs our plan and (``baseline``) the uniform split with torch's
    ``Schedule1F1B``, alternating which goes first (ours first in even rounds). ``predict_from`` says what a run
    is predicted from: ``"replay"`` (default) the CPU times of each rank's own compute actions of a step, replayed
    without messages by all ranks at once before each timed step, after the interleaved pass
    (``run_pipeline(interleave_replay=...)``, :func:`replayed_plan`; the replays run when ``replay`` is true, by
    default when it is the source); ``"interleaved"`` the per-layer median of the profile passes the run's ranks take
    together before each of its timed steps (``interleave_repeats`` repetitions per layer and pass, outside the
    steps' timing: the profile samples the same seconds of this drifting machine as the steps); ``"pre-run"`` the
    per-layer median of the profiles the ranks take together right before the first step (``pre_run_repeats``
    repetitions per layer over :data:`PRE_RUN_PASSES` passes); ``"pooled"`` the per-layer median of this case's
    profiles so far (:func:`pipesched.profile.median_profile`); ``"probe-scaled"`` that pooled prediction rescaled
    by the :func:`speed_probe` read before the run over the probes read around the profiles. All are recorded for
    every run (``error_replay`` when replayed, ``error_interleaved``, ``error_pre_run``, ``error_pooled``,
    ``error_probe_scaled``), with the
    prediction from the first profile alone and ``posthoc_s`` (the plan simulated with the CPU share less what
    other users took during the run: uses the run's load, so not a prediction). Every input of a prediction is a
    measurement of the layers or the ranks' actions alone (profiles, replays) or of the machine (calibrations); none is taken from the
    pipelined steps, and nothing is adjusted afterwards. ``probe=False`` skips the probe readings;
    ``pre_run_repeats=0`` and ``interleave_repeats=0`` skip the ranks' profiles (then ``predict_from`` must be
    another source). ``cores`` overrides the measured compute share.
    ``report["rounds"]`` holds every run; ``report["ours"]`` and ``report["uniform_torch_1f1b"]`` are round 0's,
    ``report["summary"]`` the aggregate (:func:`summarize_rounds`) and ``report["speedup_measured"]`` its median
    of the rounds' paired speed-ups.
    """
    if rounds < 1:
        raise ValueError(f"need at least one round, got {rounds}")
    if predict_from not in PREDICTION_SOURCES:
        raise ValueError(f"predict_from must be one of {', '.join(PREDICTION_SOURCES)}, got {predict_from!r}")
    if predict_from == "probe-scaled" and not probe:
        raise ValueError("predict_from='probe-scaled' needs probe=True")
    if predict_from == "pre-run" and pre_run_repeats < 1:
        raise ValueError(f"predict_from='pre-run' needs pre_run_repeats >= 1, got {pre_run_repeats}")
    replay = predict_from == "replay" if replay is None else replay
    if predict_from == "replay" and not replay:
        raise ValueError("predict_from='replay' needs replay=True")
    if predict_from == "interleaved" and interleave_repeats < 1:
        raise ValueError(f"predict_from='interleaved' needs interleave_repeats >= 1, got {interleave_repeats}")
    pre_run = {"repeats": pre_run_repeats, "passes": PRE_RUN_PASSES} if pre_run_repeats > 0 else None
    interleave = {"repeats": interleave_repeats} if interleave_repeats > 0 else None
    mb = batch // microbatches
    cal = calibrate_cpu(stages, mb * dim * 4, threads=threads)
    rt = calibrate_runtime(stages, dim=dim, batch=batch, microbatches=microbatches, threads=threads, load_width=4 * dim,
                           cores=cores or cal.cpu_share, link=cal.link())
    # The profile is taken while the other cores are busy with the same model (min(ranks, cores) - 1 co-runners: in
    # the run the other cores are mostly busy with other ranks), in CPU time; the time-slicing among more ranks than
    # cores is the simulator's processor sharing over cal.cpu_share, the CPU our processes got when all ran.
    machine_cores = os.cpu_count() or 1
    shared = SharedCpu(cores or cal.cpu_share, rt.message_cpu_s, rt.action_cpu_s, rt.efficiency)

    def read_probe() -> SpeedProbe | None:
        return speed_probe(widths, dim, mb, threads=threads) if probe else None

    co_runners = min(stages, machine_cores) - 1

    def take_profile() -> tuple[ModelProfile, list[SpeedProbe]]:
        before = read_probe()
        one = profile_mlp(widths, dim, mb, threads=threads, repeats=repeats, statistic="median", clock="cpu", warmup=2,
                          co_runners=co_runners, passes=passes)
        return one, [q for q in (before, read_probe()) if q is not None]

    first_profile, probes = take_profile()
    profiles = [first_profile]
    devices = [Device(f"cpu-rank{r}") for r in range(stages)]
    link = cal.link()
    # Each arm is simulated as its executor posts messages: ours through torch's _PipelineScheduleRuntime (receives
    # posted early), the baseline by torch's Schedule1F1B (receives posted late, sends waited for); see runtimes.
    best, alternatives = _plan_candidates(first_profile, devices, link, microbatches=microbatches, schedule=schedule, cores=shared,
                                          tie_margin=tie_margin, runtime="torch-runtime", handshake_s=rt.handshake_s)
    kwargs = {"widths": list(widths), "dim": dim}
    common = {"microbatches": microbatches, "batch": batch, "dim": dim, "model_kwargs": kwargs, "iterations": iterations, "warmup": warmup,
              "threads": threads}
    arms = [_ours_arm(best)]
    uni = None
    if baseline:
        uni = uniform_plan(first_profile, devices, link, microbatches=microbatches, family="1f1b", cores=shared, runtime="torch-1f1b",
                           handshake_s=rt.handshake_s)
        arms.append(_uniform_arm(uni))
    round_reports: list[dict[str, Any]] = []
    first: dict[str, Any] = {}
    for r in range(rounds):
        if r > 0:   # a fresh profile each round, pooled with the earlier ones: all of it measured before this round's runs
            more, more_probes = take_profile()
            profiles.append(more)
            probes += more_probes
        prof = median_profile(profiles)
        reference = statistics.mean(q.cpu_s for q in probes) if probes else None
        rec: dict[str, Any] = {"round": r, "profiles_pooled": len(profiles),
                               "profile_total_s": sum(lay.fwd_s + lay.bwd_s for lay in profiles[-1].layers),
                               "pooled_profile_total_s": sum(lay.fwd_s + lay.bwd_s for lay in prof.layers)}
        order = arms if r % 2 == 0 else arms[::-1]
        rec["order"] = [name for name, _, _ in order]
        for name, chosen, how in order:
            p = rescaled_plan(chosen, prof, 1.0)     # the chosen plan, predicted from the pooled profile
            before = read_probe()
            scale = probe_scale(reference, before) if before is not None and reference else 1.0
            scaled = rescaled_plan(chosen, prof, scale)
            run = run_pipeline(**how, **common, pre_profile=pre_run, interleave_profile=interleave,
                               interleave_replay=chosen.schedule.actions if replay else None)
            after = read_probe()
            # The ranks' own profiles, taken in the run's processes: right before its first step, and between its
            # steps (per layer, the median over ranks of each rank's median over its passes).
            pre, p_pre = _ranks_prediction(chosen, run.pre_profiles, "pre-run profile")
            inter, p_inter = _ranks_prediction(chosen, run.interleaved_profiles, "interleaved profile")
            p_replay = replayed_plan(p_inter or p, run)
            predicted = {"interleaved": p_inter, "replay": p_replay, "pre-run": p_pre, "pooled": p, "probe-scaled": scaled}[predict_from]
            c = compare(predicted, run)
            posthoc_cores = min(float(machine_cores), max(0.5, shared.cores + cal.foreign_cores - run.foreign_cores))
            posthoc = resimulate(predicted, cores=replace(predicted.shared_cpu, cores=posthoc_cores)).makespan
            replay = resimulate(predicted, run_action_costs(predicted, run)).makespan
            ideal = resimulate(predicted, cores=replace(predicted.shared_cpu, efficiency=1.0)).makespan
            # every receive posted in advance (the simulator's default transport): what the executor's posting adds
            ideal_posting = simulate(predicted.schedule, predicted.costs, predicted.links, cores=predicted.shared_cpu).makespan
            c |= {"probe_scale": scale,
                  "predicted_from": predict_from,
                  "predicted_pooled_s": p.sim.makespan, "error_pooled": p.sim.makespan / run.median_s - 1.0,
                  **_source_fields("pre_run", pre, p_pre, run), **_source_fields("interleaved", inter, p_inter, run),
                  "predicted_replay_s": p_replay.sim.makespan if p_replay else None,
                  "error_replay": p_replay.sim.makespan / run.median_s - 1.0 if p_replay else None,
                  # per step: the median over ranks of the F + B total of the pass taken right before it
                  "interleaved_totals_s": ([statistics.median(col) for col in zip(*run.interleaved_totals_s, strict=True)]
                                           if run.interleaved_totals_s else None),
                  "predicted_probe_scaled_s": scaled.sim.makespan, "error_probe_scaled": scaled.sim.makespan / run.median_s - 1.0,
                  "predicted_first_profile_s": rescaled_plan(chosen, first_profile, 1.0).sim.makespan if r else chosen.sim.makespan,
                  "probe_before_s": before.cpu_s if before else None, "probe_after_s": after.cpu_s if after else None,
                  "probe_after_scale": probe_scale(reference, after) if after is not None and reference else None,
                  "posthoc_s": posthoc, "posthoc_error": posthoc / run.median_s - 1.0,
                  "run_costs_s": replay, "run_costs_error": replay / run.median_s - 1.0,
                  "predicted_ideal_sharing_s": ideal, "error_ideal_sharing": ideal / run.median_s - 1.0,
                  "runtime": predicted.runtime, "handshake_s": predicted.handshake_s,
                  "predicted_ideal_posting_s": ideal_posting, "error_ideal_posting": ideal_posting / run.median_s - 1.0,
                  "spans": [list(s.layers) for s in chosen.partition.stages]}
            c["error_first_profile"] = c["predicted_first_profile_s"] / run.median_s - 1.0
            rec[name] = c
            if r == 0:
                first[name] = (predicted, run)
        if baseline:
            rec["speedup_measured"] = rec["uniform_torch_1f1b"]["measured_s"] / rec["ours"]["measured_s"]
        round_reports.append(rec)
    report: dict[str, Any] = {
        "model": {"widths": list(widths), "dim": dim, "batch": batch, "microbatches": microbatches, "stages": stages, "threads": threads},
        "calibration": cal.to_dict(), "runtime_calibration": rt.to_dict(), "shared_cpu": shared.to_dict(),
        "probe": {"at_profiles": [q.to_dict() for q in probes]},
        "profiles": [x.to_dict() for x in profiles],
        "link_in_run": {"latency_s": first["ours"][1].link_latency_s, "bandwidth_bytes_per_s": first["ours"][1].link_bandwidth_bps},
        "plan": {"schedule": best.family, "spans": [list(s.layers) for s in best.partition.stages],
                 "recompute": [s.recompute for s in best.partition.stages], "tie_margin": tie_margin, "candidates": alternatives},
        "ours": round_reports[0]["ours"], "rounds": round_reports, "profile": median_profile(profiles).to_dict(),
        "summary": summarize_rounds(round_reports, tuple(name for name, _, _ in arms)),
    }
    if uni is not None:
        report["uniform_torch_1f1b"] = round_reports[0]["uniform_torch_1f1b"]
        report["speedup_measured"] = report["summary"]["speedup_median"]
        report["speedup_predicted"] = uni.sim.makespan / best.sim.makespan
    report["_plan"], report["_run"] = first["ours"]
    return report


GPU_SHARING = ("mps", "time-slice")


def gpu_validation(widths: list[int], *, dim: int, batch: int, microbatches: int, stages: int, iterations: int = 10, warmup: int = 3,
                   rounds: int = 2, repeats: int = 15, schedule: str = "auto", tie_margin: float = AUTO_TIE_MARGIN,
                   sharing: str = "time-slice") -> dict[str, Any]:
    """Profile, plan and run the MLP chain on the one CUDA GPU of this machine with NCCL; predicted against measured.

    1. The profile: :func:`pipesched.profile.measure_profile` of the chain on the GPU, one process alone on it,
       every clock reading after ``torch.cuda.synchronize`` (kernels and launches), medians of ``repeats`` over 3 passes.
    2. The plan, from that profile alone: every exportable family (or ``schedule``), picked by
       :func:`pipesched.plan.choose_robust`; the uniform split with torch's ``Schedule1F1B`` as the baseline. How the
       ranks share the GPU is ``sharing``: ``"mps"`` (the CUDA MPS daemon runs and ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``
       gives every process, the profiling one included, the same share of the SMs) models each rank as a device of
       its own at the profile's speed; ``"time-slice"`` (no MPS: the GPU time-slices between the ranks' contexts) as
       processes sharing one device (the simulator's processor sharing with ``cores=1``). Both predictions are recorded
       for every run (``predicted_dedicated_s``, ``predicted_processor_shared_s``); ``predicted_s`` is the one ``sharing`` names.
    3. The runs: ``rounds`` rounds of both, alternating which goes first, with :func:`run_pipeline` (``device="cuda"``:
       NCCL, every rank on GPU 0 with its own ``NCCL_HOSTID``). Each run is predicted from the profile and the link
       its ranks measured before their steps (ping-pong latency and bandwidth of NCCL's transport between two ranks);
       nothing is taken from the steps.
    """
    import torch

    from .models import mlp_chain

    if not torch.cuda.is_available():
        raise RuntimeError("gpu_validation needs a CUDA GPU")
    if rounds < 1:
        raise ValueError(f"need at least one round, got {rounds}")
    if sharing not in GPU_SHARING:
        raise ValueError(f"sharing must be one of {', '.join(GPU_SHARING)}, got {sharing!r}")
    mb = batch // microbatches
    dev = torch.device("cuda", 0)
    layers = [layer.to(dev) for layer in mlp_chain(widths, dim)]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(mb, dim, generator=gen).to(dev)
    target = torch.randn(mb, dim, generator=gen).to(dev)
    profile = measure_profile(layers, x, loss_fn=lambda out: torch.nn.functional.mse_loss(out, target), repeats=repeats, warmup=3,
                              name="gpu", statistic="median", clock="wall", passes=3)
    del layers, x
    torch.cuda.empty_cache()
    shared = SharedCpu(1.0) if sharing == "time-slice" else None
    devices = [Device(f"gpu0-rank{r}") for r in range(stages)]
    no_link = LinkModel.uniform(stages, math.inf, 0.0)
    best, alternatives = _plan_candidates(profile, devices, no_link, microbatches=microbatches, schedule=schedule, cores=shared,
                                          tie_margin=tie_margin)
    uni = uniform_plan(profile, devices, no_link, microbatches=microbatches, family="1f1b", cores=shared)
    common = {"microbatches": microbatches, "batch": batch, "dim": dim, "model_kwargs": {"widths": list(widths), "dim": dim},
              "iterations": iterations, "warmup": warmup, "device": "cuda"}
    arms = [_ours_arm(best), _uniform_arm(uni)]
    round_reports = []
    for r in range(rounds):
        rec: dict[str, Any] = {"round": r}
        order = arms if r % 2 == 0 else arms[::-1]
        rec["order"] = [name for name, _, _ in order]
        for name, chosen, how in order:
            run = run_pipeline(**how, **common)
            link = LinkModel.uniform(chosen.schedule.ranks, run.link_bandwidth_bps, run.link_latency_s)
            variants = {model: plan_partition(profile, chosen.partition, chosen.devices, link, family=chosen.family,
                                              microbatches=microbatches, chunks=chosen.chunks, cores=cores)
                        for model, cores in (("dedicated", None), ("processor_shared", SharedCpu(1.0)))}
            c = compare(variants["dedicated" if sharing == "mps" else "processor_shared"], run)
            for model, v in variants.items():
                c |= {f"predicted_{model}_s": v.sim.makespan, f"error_{model}": v.sim.makespan / run.median_s - 1.0}
            c |= {"sharing": sharing,
                  "link_latency_s": run.link_latency_s, "link_bandwidth_bytes_per_s": run.link_bandwidth_bps,
                  "device_peak_bytes": run.device_peak_bytes, "spans": [list(s.layers) for s in chosen.partition.stages]}
            rec[name] = c
        rec["speedup_measured"] = rec["uniform_torch_1f1b"]["measured_s"] / rec["ours"]["measured_s"]
        round_reports.append(rec)
    return {
        "device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "sharing": sharing, "mps_active_thread_percentage": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
        "model": {"widths": list(widths), "dim": dim, "batch": batch, "microbatches": microbatches, "stages": stages},
        "profile": profile.to_dict(), "profile_total_s": sum(lay.fwd_s + lay.bwd_s for lay in profile.layers),
        "plan": {"schedule": best.family, "spans": [list(s.layers) for s in best.partition.stages], "candidates": alternatives},
        "rounds": round_reports, "summary": summarize_rounds(round_reports),
    }
