"""torch.distributed (gloo) jobs that run inside emulated hosts: an all-reduce benchmark and a small DDP loop.

Each rank is one process in one Mininet host. ``GLOO_SOCKET_IFNAME`` pins
gloo to the host's emulated interface and rank 0's address on that interface
is the rendezvous (``tcp://MASTER_ADDR:PORT``), so every byte of the
collectives crosses the shaped links. Rank 0 writes a JSON report with the
per-iteration wall times (emulated time; :func:`emu.mininet_backend.run_torch_job`
divides by the time scale).

Modes
    ``allreduce``: ``--iters`` all-reduces of a float32 tensor of ``--bytes``
    bytes after ``--warmup`` untimed ones; each timed iteration starts after a
    barrier and ends when the all-reduce returns on this rank; rank 0 reports
    the max over ranks (the collective's completion).
    ``ddp``: a small MLP wrapped in DistributedDataParallel (gloo, CPU) trained
    with SGD on synthetic data for ``--iters`` steps; reports step times, the
    gradient bytes per step and the loss trajectory (each rank's shard is a
    fixed batch of a linear teacher, so the averaged full-batch descent lowers it).

Run as ``python -m emu.torchjob allreduce --rank 0 --world 4 --master-addr 10.0.1.1 --ifname nwh0-eth0 --out r.json``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import time
from pathlib import Path


def add_rank_arguments(parser: argparse.ArgumentParser, *, master_port: int, timeout_s: float) -> None:
    """The options every rank script run inside an emulated host takes: who it is and where the rendezvous is.

    ``--rank``, ``--world``, ``--master-addr`` (rank 0's address on the emulated network), ``--master-port``,
    ``--ifname`` (the host's emulated interface, for ``GLOO_SOCKET_IFNAME``), ``--timeout`` (seconds, the
    process group's) and ``--out`` (where rank 0 writes its JSON report).

    >>> p = argparse.ArgumentParser(); add_rank_arguments(p, master_port=29500, timeout_s=300)
    >>> a = p.parse_args(["--rank", "1", "--world", "2", "--master-addr", "10.0.0.1", "--ifname", "h1-eth0"])
    >>> a.rank, a.world, a.master_port, a.timeout, a.out
    (1, 2, 29500, 300, None)
    """
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--master-addr", required=True)
    parser.add_argument("--master-port", type=int, default=master_port)
    parser.add_argument("--ifname", required=True)
    parser.add_argument("--timeout", type=float, default=timeout_s)
    parser.add_argument("--out")


def init_gloo(args: argparse.Namespace, threads: int = 1):
    """Join the gloo process group over the host's emulated interface; returns the ``torch`` and ``torch.distributed`` modules.

    ``threads`` intra-op threads (default 1: the machine's cores are shared by every emulated host and the
    kernel's forwarding).
    """
    os.environ["GLOO_SOCKET_IFNAME"] = args.ifname
    os.environ["MASTER_ADDR"] = args.master_addr
    os.environ["MASTER_PORT"] = str(args.master_port)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master_addr}:{args.master_port}", rank=args.rank,
                            world_size=args.world, timeout=datetime.timedelta(seconds=args.timeout))
    return torch, dist


def write_report(args: argparse.Namespace, report: dict) -> None:
    """Rank 0 writes the job's JSON report to ``--out`` (other ranks, and runs without ``--out``, write nothing)."""
    if args.rank == 0 and args.out:
        Path(args.out).write_text(json.dumps(report) + "\n")


def run_allreduce(args: argparse.Namespace) -> dict:
    torch, dist = init_gloo(args)
    n = max(1, int(args.bytes) // 4)
    x = torch.ones(n, dtype=torch.float32)
    for _ in range(args.warmup):
        dist.all_reduce(x)
    times = []
    window_start = time.monotonic()
    for _ in range(args.iters):
        x.fill_(1.0)
        dist.barrier()
        t0 = time.monotonic()
        dist.all_reduce(x)
        times.append(time.monotonic() - t0)
    window_end = time.monotonic()
    ok = bool(torch.all(x == float(args.world)))
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    dist.destroy_process_group()
    return {"mode": "allreduce", "world": args.world, "bytes": n * 4, "iteration_s": t.tolist(), "correct": ok,
            "window": [window_start, window_end]}


def run_ddp(args: argparse.Namespace) -> dict:
    torch, dist = init_gloo(args)
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)  # same initial weights everywhere (DDP broadcasts rank 0's anyway)
    width = args.width
    model = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.02)
    # Each rank's shard is one fixed batch of a linear teacher: full-batch gradient descent, so the loss falls step by step.
    w_true = torch.randn(64, 1, generator=torch.Generator().manual_seed(7))
    xb = torch.randn(128, 64, generator=torch.Generator().manual_seed(1 + args.rank))
    yb = xb @ w_true
    losses, times = [], []
    window_start = 0.0
    for step in range(args.warmup + args.iters):
        if step == args.warmup:
            window_start = time.monotonic()
        dist.barrier()
        t0 = time.monotonic()
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(xb), yb)
        loss.backward()  # DDP all-reduces the gradient buckets here
        opt.step()
        if step >= args.warmup:
            times.append(time.monotonic() - t0)
            losses.append(float(loss))
    window_end = time.monotonic()
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    # DDP's reducer holds the process group: drop it first, or its destructor may run against a destroyed group at
    # exit and abort the process ("terminate called without an active exception", seen once in CI).
    del opt, ddp
    gc.collect()
    dist.destroy_process_group()
    return {"mode": "ddp", "world": args.world, "grad_bytes": grad_bytes, "iteration_s": t.tolist(), "loss": losses,
            "window": [window_start, window_end]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="torch.distributed job for one emulated host")
    parser.add_argument("mode", choices=("allreduce", "ddp"))
    add_rank_arguments(parser, master_port=29500, timeout_s=300)
    parser.add_argument("--bytes", type=float, default=8e6)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args(argv)
    write_report(args, run_allreduce(args) if args.mode == "allreduce" else run_ddp(args))


if __name__ == "__main__":
    main()
