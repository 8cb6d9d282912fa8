"""Benchmark of the runtime's DDP hook overhead on the CPU: iteration time through :class:`PlannedAllReduce` vs plain DDP.

Setup: two gloo ranks on loopback (one process each, one torch thread each), the example transformer
(``examples/train_transformer.py``, depth 2) at several widths. Per width, variants run interleaved in the same
processes, ``--repeats`` times ``--iterations`` timed iterations after ``--warmup``:

- ``plain DDP``: torch's DistributedDataParallel with no hook, default buckets (the baseline);
- ``plain DDP, tiny buckets``: the same with ``bucket_cap_mb`` as ``planned_ddp`` forces it for the bytescheduler plan
  (the plan's smallest transfer): what the many small DDP buckets cost without any hook;
- ``hook ddp``, ``hook bytescheduler``, ``hook prophet``: ``netweave.runtime.ddp.planned_ddp`` with that policy. Plans:
  ddp fused up to ``bucket_cap_bytes`` = total/4 (first transfer total/16); bytescheduler and prophet with
  ``partition_bytes`` = total/32 and their default credit, so each iteration has many small transfers and the
  per-transfer overhead shows (no link limit: loopback).

Iteration = the slower rank's time from zero_grad to the end of the optimizer step; median. Ratios are against plain
DDP measured in the same processes, same width. The machine is shared: compare ratios, not seconds.

Run: ``python bench/bench_runtime_overhead.py [--widths 32 64 128] [--before old.json --before-label COMMIT]``; writes
``bench/results/runtime_overhead.{json,md}``. ``--before`` takes the JSON a run of this script on an older commit wrote
(``--out-dir`` elsewhere) and puts its ratios beside this run's (``ratio_before``). ``--parts`` only prints what the
hook's parts cost, measured apart in one process (docs/validation/runtime.md).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import write_results  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
POLICIES = ("ddp", "bytescheduler", "prophet")


def _example():
    sys.path.insert(0, str(REPO / "tests"))
    from runtime_helpers import example

    return example()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dp(policy: str, total: int):
    from netweave.runtime import plan as jp

    if policy == "ddp":
        return jp.DataParallel("ddp", None, None, True, {"bucket_cap_bytes": total // 4, "first_bucket_bytes": total // 16})
    return jp.DataParallel(policy, total // 32, None, True, {})


def _worker(rank: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from netweave.runtime.ddp import MiB, planned_ddp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ex = _example()
    results: dict[str, dict[str, list[float]]] = {}
    for width in args.widths:
        def model(width=width):
            return ex.build_model(width=width, depth=2, vocab=64, seq=16, seed=0)

        total = sum(p.numel() * p.element_size() for p in model().parameters())
        variants: dict[str, tuple] = {"plain DDP": (DDP(model()), None)}
        hooks = []
        for policy in POLICIES:
            ddp, plan, hook = planned_ddp(model(), _dp(policy, total), device=torch.device("cpu"), backend="gloo")
            variants[f"hook {policy}"] = (ddp, plan)
            hooks.append(hook)
            if policy == "bytescheduler":
                tiny = min(plan.transfer_bytes(k) for k in range(len(plan.transfers))) / MiB
                variants["plain DDP, tiny buckets"] = (DDP(model(), bucket_cap_mb=tiny), None)
        times: dict[str, list[float]] = {v: [] for v in variants}
        cpu: dict[str, list[float]] = {v: [] for v in variants}
        transfers = {v: len(p.transfers) for v, (_, p) in variants.items() if p is not None}
        for _ in range(args.repeats):
            for v, (m, _) in variants.items():
                opt = torch.optim.SGD(m.parameters(), lr=0.01)
                for step in range(args.warmup + args.iterations):
                    x, y = ex.batch(step, rows=args.rows, seq=16, vocab=64, seed=0, rank=rank)
                    dist.barrier()
                    t, c = time.perf_counter(), time.process_time()
                    opt.zero_grad(set_to_none=True)
                    ex.loss_fn(m(x), y).backward()
                    opt.step()
                    dt = torch.tensor([time.perf_counter() - t, time.process_time() - c], dtype=torch.float64)
                    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                    if step >= args.warmup:
                        times[v].append(float(dt[0]))
                        cpu[v].append(float(dt[1]))
        # the plans' all-reduces alone (same sizes, order and credit, no model): what the transfers cost by themselves
        collectives: dict[str, list[float]] = {}
        for v, (_, plan) in variants.items():
            if plan is None:
                continue
            bufs = [torch.zeros(sum(p.count for p in t)) for t in plan.transfers]
            credit = plan.credit_bytes or float("inf")
            collectives[v] = []
            for step in range(args.warmup + args.iterations):
                dist.barrier()
                t = time.perf_counter()
                flying: list[tuple[object, int]] = []
                for k, b in enumerate(bufs):
                    while flying and sum(n for _, n in flying) + plan.transfer_bytes(k) > credit:
                        flying.pop(0)[0].wait()
                    flying.append((dist.all_reduce(b, async_op=True), plan.transfer_bytes(k)))
                for w, _ in flying:
                    w.wait()
                dt = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                if step >= args.warmup:
                    collectives[v].append(float(dt))
        for h in hooks:
            h.close()
        results[str(width)] = {"times": times, "cpu": cpu, "collectives": collectives, "transfers": transfers, "gradient_bytes": total}
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))
    dist.destroy_process_group()


def hook_parts(widths: list[int], rows: int) -> None:
    """Print what the parts of the hook cost per iteration, measured apart in this process (no communication): the
    forward and backward alone, the slicing / ``torch.cat`` / ``div_`` / copy-back of each plan's transfers, a future
    per bucket, and a thread hand-off through a ``queue.Queue`` (ping-pong, half the round trip)."""
    import queue
    import threading

    import torch

    from netweave.runtime.ddp import make_plan

    torch.set_num_threads(1)
    ex = _example()
    for width in widths:
        model = ex.build_model(width=width, depth=2, vocab=64, seq=16, seed=0)
        params = list(model.parameters())
        total = sum(p.numel() * p.element_size() for p in params)
        x, y = ex.batch(0, rows=rows, seq=16, vocab=64, seed=0, rank=0)

        def step(model=model, x=x, y=y):
            model.zero_grad()
            ex.loss_fn(model(x), y).backward()

        def per_call_s(fn, n):
            fn()
            t = time.perf_counter()
            for _ in range(n):
                fn()
            return (time.perf_counter() - t) / n

        out = {"forward+backward_ms": per_call_s(step, 20) * 1e3, "buckets (one per parameter)": len(params)}
        grads = [p.grad.view(-1) for p in params]
        for policy in POLICIES:
            dp = _dp(policy, total)
            plan = make_plan([(str(i), p.numel(), p.element_size()) for i, p in enumerate(params)], policy,
                             partition_bytes=dp.partition_bytes, knobs=dp.params)

            def pieces_work(plan=plan, grads=grads):
                for t in plan.transfers:
                    views = [grads[p.param][p.start:p.start + p.count] for p in t]
                    buf = views[0] if len(views) == 1 else torch.cat(views)
                    buf.div_(2)
                    if len(views) > 1:
                        pos = 0
                        for p, v in zip(t, views, strict=True):
                            v.copy_(buf[pos:pos + p.count])
                            pos += p.count

            out[f"{policy}: slice+cat+div+copy_ms ({len(plan.transfers)} transfers)"] = per_call_s(pieces_work, 50) * 1e3

        def future():
            f = torch.futures.Future()
            f.set_result(1)
            f.wait()

        out["future create+set+wait_us"] = per_call_s(future, 2000) * 1e6
        there, back = queue.Queue(), queue.Queue()

        def echo(there=there, back=back):
            while (v := there.get()) is not None:
                back.put(v)

        th = threading.Thread(target=echo)
        th.start()
        one_way = []
        for _ in range(500):
            t = time.perf_counter()
            there.put(1)
            back.get()
            one_way.append((time.perf_counter() - t) / 2)
        there.put(None)
        th.join()
        out["queue hand-off one-way_us (median)"] = statistics.median(one_way) * 1e6
        print(f"width {width} ({total} B of gradients): " + ", ".join(f"{k} {v:.3g}" for k, v in out.items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", type=int, default=4, help="batch rows per rank (small: the hook's overhead shows)")
    ap.add_argument("--before", type=Path, help="JSON of a run on an older commit: its ratios go beside this run's")
    ap.add_argument("--before-label", help="what --before measured, for the notes (e.g. the commit)")
    ap.add_argument("--parts", action="store_true", help="only print what the hook's parts cost, measured apart (no results file)")
    ap.add_argument("--out-dir", type=Path, help="where to write runtime_overhead.{json,md} (default bench/results)")
    args = ap.parse_args(argv)
    if args.parts:
        hook_parts(args.widths, args.rows)
        return 0

    import torch.multiprocessing as mp

    load_before = os.getloadavg()[0]
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="netweave-overhead-") as tmp:
        out_path = str(Path(tmp) / "r.json")
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, port, args, out_path)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=600)
        if any(p.exitcode != 0 for p in procs):
            print(f"a rank failed: exit codes {[p.exitcode for p in procs]}", file=sys.stderr)
            return 1
        results = json.loads(Path(out_path).read_text())
    before = {}
    if args.before:
        for row in json.loads(args.before.read_text())["rows"]:
            before[(row["width"], row["variant"])] = (row["ratio_vs_plain"], row.get("cpu_ratio_vs_plain"))
    rows = []
    for width, res in results.items():
        base = statistics.median(res["times"]["plain DDP"])
        base_cpu = statistics.median(res["cpu"]["plain DDP"])
        for v, ts in res["times"].items():
            med = statistics.median(ts)
            coll = res["collectives"].get(v)
            row = {"width": int(width), "gradient_bytes": res["gradient_bytes"], "variant": v, "transfers": res["transfers"].get(v),
                   "iteration_s": med, "ratio_vs_plain": med / base, "min_s": min(ts),
                   "cpu_ratio_vs_plain": statistics.median(res["cpu"][v]) / base_cpu,
                   "collectives_only_s": statistics.median(coll) if coll else None, "samples": len(ts)}
            if args.before:
                row["ratio_before"], row["cpu_ratio_before"] = before.get((int(width), v), (None, None))
            rows.append(row)
    notes = f"""
Two gloo ranks on loopback, one torch thread each, the example transformer (depth 2, {args.rows} rows x 16 tokens per rank)
at widths {', '.join(map(str, args.widths))}. {args.iterations} timed iterations (after {args.warmup} warm-up) x {args.repeats}
repeats per variant, interleaved in the same processes; iteration = the slower rank's zero_grad..optimizer step; median.
ratio_vs_plain: against plain DDP (no hook, default buckets) in the same run. transfers: the plan's all-reduces per
iteration. cpu_ratio_vs_plain: the slower rank's process CPU time (all threads) per iteration against plain DDP's, less
sensitive to the shared machine than wall time. collectives_only_s: the plan's all-reduces alone (same sizes, order and credit,
no model, no hook) per iteration. Plans: ddp fused to total/4 (first total/16); bytescheduler, prophet: partition total/32, default credit.
The {os.cpu_count()}-core machine was shared with other work (1-minute load average {load_before:.1f} at the start,
{os.getloadavg()[0]:.1f} at the end): on the 2-core machine at load 5-13 the same ratio varied by up to a factor of 2
between runs minutes apart; read differences smaller than that as noise.
"""
    if args.before:
        notes += (f"ratio_before, cpu_ratio_before: the same benchmark run minutes earlier on {args.before_label or args.before.name} "
                  "(same machine, not the same processes).\n")
    write_results("runtime_overhead", rows, title="The runtime's DDP hook overhead vs plain DDP on the CPU (gloo, loopback)", notes=notes,
                  extra={"setup": vars(args) | {"before": str(args.before) if args.before else None,
                                                "out_dir": str(args.out_dir) if args.out_dir else None}, "results": results},
                  out_dir=args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
