"""One rank of the bandwidth-bound training job of :func:`flowsched.validate.run_intrajob_emulation`.

Runs inside an emulated host (one rank per host, gloo over the host's emulated
interface, ``GLOO_SOCKET_IFNAME``). Steps, all ranks in lockstep:

1. measure the all-reduce goodput on the emulated link (median time of
   all-reduces of ``--probe-bytes``; bandwidth = bytes / time, the algorithm
   bandwidth the plans' model uses) and the fixed cost of a tiny all-reduce;
   With ``--balance B`` the batch is then scaled (at most three times) until
   a local training step takes about B x the gradients' all-reduce time, so
   that the job's regime does not drift with the shared machine's load;
2. measure the gradient profile of the model on this rank
   (:func:`~flowsched.gradients.measure_gradient_profile`, no communication)
   and the optimizer step time; rank 0's profile is broadcast so that every
   rank builds the same plans;
3. build the plans (:func:`~flowsched.intrajob.tune_prophet`,
   :func:`~flowsched.intrajob.tune_bytescheduler`) and, for ``--rounds``
   rounds, train ``--iters`` iterations with each method: default
   ``DistributedDataParallel``, then :class:`~flowsched.ddp.GradientScheduler`
   with each plan. Iteration time = period between consecutive iteration
   starts (steady state, the first ``--warmup`` of every block dropped).

``--compute-nice N`` runs the training thread N nice levels below the
communication threads (gloo's workers, the scheduler's thread) while it
trains. On a GPU machine the model's kernels run on the GPU and leave the
cores that drive the NIC alone; here compute is emulated on the same 2 CPU
cores as the emulated network, and without this the compute of both ranks
takes both cores while gloo's threads wait to be scheduled, which slows
every overlapped transfer (measured in ``bench/results/flowsched_intrajob*``).

Rank 0 writes the JSON report (``--out``). Run as
``python -m flowsched.torchrun_job --rank 0 --world 2 --master-addr 10.0.1.1 --ifname fvh0-eth0 --out r.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import threading
import time
from typing import Any

METHODS = ("ddp", "prophet", "bytescheduler")
#: Local forward + backward + optimizer step with no communication, timed in the same rounds: the compute term of the bound.
COMPUTE_ONLY = "compute"


def build_model(layers: int, width: int, seed: int = 0) -> Any:
    """An MLP of ``layers`` square ``width`` x ``width`` linear layers with ReLUs (4 * width^2 bytes of gradient each)."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    mods: list[Any] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods[:-1])


@contextlib.contextmanager
def _compute_priority(delta: int):
    """Lower this (the training) thread's CPU priority by ``delta`` nice levels for the block; threads created
    before it keep theirs. Restoring needs CAP_SYS_NICE (the ranks run as root inside Mininet hosts)."""
    if delta <= 0:
        yield
        return
    tid = threading.get_native_id()
    base = os.getpriority(os.PRIO_PROCESS, tid)
    os.setpriority(os.PRIO_PROCESS, tid, min(19, base + delta))
    try:
        yield
    finally:
        os.setpriority(os.PRIO_PROCESS, tid, base)


def _time_allreduce(dist: Any, torch: Any, nbytes: int, repeats: int) -> float:
    x = torch.ones(max(1, nbytes // 4))
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def run(args: argparse.Namespace) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    from emu.torchjob import init_gloo

    from .ddp import GradientScheduler
    from .gradients import GradientProfile, gradient_layers, measure_gradient_profile
    from .intrajob import ddp_plan, simulate_iteration, tune_bytescheduler, tune_prophet

    torch, dist = init_gloo(args, threads=args.threads)
    gen = torch.Generator().manual_seed(100 + args.rank)
    x = torch.randn(args.batch, args.width, generator=gen)
    y = torch.randn(args.batch, args.width, generator=gen)
    loss_fn = torch.nn.functional.mse_loss

    # 1. the network as gloo sees it
    _time_allreduce(dist, torch, args.probe_bytes, 1)  # connection set-up
    probe_s = _time_allreduce(dist, torch, args.probe_bytes, args.probe_repeats)
    tiny_s = _time_allreduce(dist, torch, 4, 5)
    bandwidth = args.probe_bytes / max(probe_s - tiny_s, 1e-9)

    # 1b. the regime: compute time tracks the machine's load (2 shared cores), so instead of a fixed batch the batch is
    # scaled until compute ~= balance x communication, timed with every rank computing at once as in training.
    balance_log = []
    if args.balance > 0:
        model = build_model(args.layers, args.width)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        comm_est = args.layers * (args.width * args.width + args.width) * 4 / bandwidth
        for _ in range(3):
            times = []
            for _it in range(4):
                dist.barrier()
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                loss_fn(model(x), y).backward()
                opt.step()
                times.append(time.perf_counter() - t0)
            t = torch.tensor([statistics.median(times[1:])], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            compute_est = float(t.item())
            want = max(8, round(x.shape[0] * args.balance * comm_est / compute_est))
            balance_log.append({"batch": x.shape[0], "compute_s": compute_est, "comm_s": comm_est, "next_batch": want})
            if abs(want - x.shape[0]) <= 0.1 * x.shape[0]:
                break
            x = torch.randn(want, args.width, generator=gen)
            y = torch.randn(want, args.width, generator=gen)

    # 2. the gradient profile (no communication) and the optimizer step
    model = build_model(args.layers, args.width)
    profile = measure_gradient_profile(model, lambda: (x, y), loss_fn, bandwidth=bandwidth / 1e9, overhead=tiny_s, warmup=2,
                                       iterations=args.profile_iters, layers=gradient_layers(model))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    steps = []
    for _ in range(5):
        t0 = time.perf_counter()
        opt.step()
        steps.append(time.perf_counter() - t0)
    step_s = statistics.median(steps)
    shared = [profile.to_dict(), step_s]
    dist.broadcast_object_list(shared, src=0)
    profile = GradientProfile.from_dict(shared[0])
    step_s = float(shared[1])
    plans = {"ddp": ddp_plan(profile), "prophet": tune_prophet(profile), "bytescheduler": tune_bytescheduler(profile)}

    # 3. train with every method, interleaved over rounds (machine noise hits all methods alike)
    runs = (COMPUTE_ONLY, *METHODS)
    times: dict[str, list[float]] = {m: [] for m in runs}
    comm: dict[str, list[float]] = {m: [] for m in runs}
    comm_log: dict[str, list[dict[str, Any]]] = {}
    losses: dict[str, list[float]] = {m: [] for m in runs}
    for _ in range(args.rounds):
        for method in runs:
            model = build_model(args.layers, args.width)
            starts: list[float] = []
            starts_bwd: list[float] = []
            if method in (COMPUTE_ONLY, "ddp"):
                # the same loop; DDP's own hooks all-reduce the gradients during backward, compute-only has none
                net = DistributedDataParallel(model) if method == "ddp" else model
                opt = torch.optim.SGD(net.parameters(), lr=1e-3)
                dist.barrier()
                with _compute_priority(args.compute_nice):
                    for _it in range(args.warmup + args.iters + 1):
                        starts.append(time.perf_counter())
                        opt.zero_grad(set_to_none=True)
                        loss = loss_fn(net(x), y)
                        loss.backward()
                        opt.step()
                        losses[method].append(float(loss.detach()))
                del net
            else:
                # the scheduler's thread starts here, before the training thread's priority is lowered
                sched = GradientScheduler(gradient_layers(model), plans[method], optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=1e-3),
                                          model=model)
                dist.barrier()
                with _compute_priority(args.compute_nice):
                    for _it in range(args.warmup + args.iters + 1):
                        starts.append(time.perf_counter())
                        loss = loss_fn(model(x), y)
                        starts_bwd.append(time.perf_counter())
                        sched.begin_iteration()
                        loss.backward()
                        losses[method].append(float(loss.detach()))
                    sched.synchronize(step=True)
                comm[method] += [log.done[-1] for log in sched.logs[args.warmup:] if log.done]
                # every steady-state iteration's collectives (issue / completion, seconds since backward start) and the time
                # from iteration start to backward start (forward, including its waits for reduced gradients): where the time goes
                comm_log.setdefault(method, []).extend(
                    {"issue": log.issue, "done": log.done, "forward_s": b - a}
                    for log, a, b in list(zip(sched.logs, starts, starts_bwd, strict=False))[args.warmup:])
                sched.close()
            periods = [b - a for a, b in zip(starts, starts[1:], strict=False)][args.warmup:]
            t = torch.tensor(periods, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # an iteration is as slow as the slowest rank
            times[method] += t.tolist()
    # The plans' collectives alone (no compute), issued as the scheduler issues them (credit-limited async all-reduces):
    # separates the communication path's own cost from the CPU contention between compute and communication.
    comm_only = {}
    for method in ("prophet", "bytescheduler"):
        plan = plans[method]
        bufs = [torch.ones(max(1, int(t.nbytes) // 4)) for t in plan.transfers]
        reps = []
        for _ in range(3):
            dist.barrier()
            t0 = time.perf_counter()
            in_flight: list[tuple[Any, float]] = []
            for buf, tr in zip(bufs, plan.transfers, strict=True):
                while in_flight and sum(b for _, b in in_flight) + tr.nbytes > max(plan.credit, 0.0):
                    in_flight.pop(0)[0].wait()
                in_flight.append((dist.all_reduce(buf, async_op=True), tr.nbytes))
            for work, _ in in_flight:
                work.wait()
            reps.append(time.perf_counter() - t0)
        t = torch.tensor([statistics.median(reps)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        comm_only[method] = float(t.item())
    dist.destroy_process_group()
    modelled = {m: simulate_iteration(profile, p).iteration_time for m, p in plans.items()}
    # The bound's compute term is the compute-only iterations timed in the same rounds (same machine load), not the
    # profile's (measured once, before training): on a shared machine the two differ by tens of percent.
    compute = statistics.median(times[COMPUTE_ONLY])
    comm_s = profile.total_bytes / profile.bytes_per_s
    return {
        "world": args.world, "compute_nice": args.compute_nice,
        "layers": args.layers, "width": args.width, "batch": int(x.shape[0]), "balance": args.balance,
        "balance_log": balance_log, "rounds": args.rounds, "iters": args.iters,
        "probe": {"bytes": args.probe_bytes, "seconds": probe_s, "tiny_allreduce_s": tiny_s, "goodput_bytes_per_s": bandwidth},
        "profile": profile.to_dict(), "optimizer_step_s": step_s, "compute_s": compute, "comm_s": comm_s,
        "profile_compute_s": profile.compute_time + step_s, "lower_bound_s": max(compute, comm_s),
        "plans": {m: p.to_dict() for m, p in plans.items()}, "modelled_s": modelled,
        "iteration_s": times,
        "comm_done_s": comm, "comm_log": comm_log, "comm_only_s": comm_only, "median_s": {m: statistics.median(v) for m, v in times.items()},
        "loss_first_last": {m: [v[0], v[-1]] for m, v in losses.items() if v},
    }


def main(argv: list[str] | None = None) -> None:
    from emu.torchjob import add_rank_arguments, write_report

    p = argparse.ArgumentParser(description="one rank of the flowsched intra-job validation (runs inside an emulated host)")
    add_rank_arguments(p, master_port=29611, timeout_s=600)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--balance", type=float, default=0.0, help="scale the batch until compute ~= BALANCE x communication (0: keep --batch)")
    p.add_argument("--compute-nice", type=int, default=0,
                   help="train N nice levels below the communication threads (stands in for GPU compute; 0: off)")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--profile-iters", type=int, default=5)
    p.add_argument("--probe-bytes", type=int, default=4_000_000)
    p.add_argument("--probe-repeats", type=int, default=3)
    args = p.parse_args(argv)
    write_report(args, run(args))
    # The process group is destroyed and the report written. Skip the interpreter's teardown: torch's C++ static
    # destructors occasionally meet a still-joinable gloo worker thread and std::terminate (seen about once in ten
    # loopback runs in CI), which would turn a finished run into a failed one.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
