"""A real model's measured profile against the analytic profile of the same shape, per layer kind.

GPT-2 in the 124M checkpoint's shape (:mod:`pipesched.gpt2`: 12 blocks, h = 768, 12 heads, s = 1024, V = 50257,
tied head, explicit softmax attention with a mask argument, dropout 0.1) is split by torch's ``pipeline()`` at
every block and the final LayerNorm and measured on this CPU by :func:`pipesched.model_profile.profile_model`
(one micro-batch, FP32, one thread, the thread's CPU time). The analytic profile
(:func:`pipesched.profile.analytic_profile`) of the same shape is given this CPU as its device: the single-thread
FP32 matmul rate and copy bandwidth measured in the same run, at efficiency 1 (so a ratio says how far each
layer kind is from its roofline on this CPU). The table gives measured / analytic per layer kind (embedding,
block: the median over the blocks, head) for the times and the byte counts. Then both profiles are planned
(4 stages, 8 micro-batches, 1F1B) and the analytic plan's partition is costed with the measured profile: what
planning from the formulas instead of a measurement costs.

Run: ``.venv/bin/python bench/bench_pipesched_models.py [--layers 12] [--seq-len 1024] [--repeats 2] [--quick]``
(the 124M shape takes about 6 minutes of CPU time, 24 minutes of wall time on the loaded 2-CPU development
machine; ``--quick``: 2 blocks, s = 256, nothing written).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import write_results  # noqa: E402


def cpu_peaks(threads: int = 1, repeats: int = 7) -> dict[str, float]:
    """This CPU's FP32 matmul rate (FLOP/s, a GPT-2 MLP-shaped GEMM) and copy bandwidth (bytes/s), CPU time of one thread."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, w = torch.randn(1024, 768), torch.randn(768, 3072)
        src, dst = torch.randn(2**25), torch.empty(2**25)          # 128 MiB each: far beyond the caches
        a @ w
        dst.copy_(src)
        gemm, copy = [], []
        for _ in range(repeats):
            t0 = time.thread_time()
            a @ w
            gemm.append(time.thread_time() - t0)
            t0 = time.thread_time()
            dst.copy_(src)
            copy.append(time.thread_time() - t0)
    finally:
        torch.set_num_threads(old)
    return {"flops": 2 * 1024 * 768 * 3072 / statistics.median(gemm), "bytes_per_s": 2 * src.numel() * 4 / statistics.median(copy)}


def kind_rows(measured, analytic) -> list[dict]:
    def kinds(prof):
        blocks = prof.layers[1:-1]
        return {"embedding": [prof.layers[0]], "block": blocks, "head": [prof.layers[-1]]}

    fields = [("F", lambda x: x.fwd_s), ("I", lambda x: x.bwd_input_s), ("W", lambda x: x.bwd_weight_s), ("B (fused)", lambda x: x.bwd_s),
              ("recompute selective", lambda x: x.recompute_s["selective"]),
              ("param bytes", lambda x: x.param_bytes), ("output bytes", lambda x: x.output_bytes),
              ("saved none", lambda x: x.saved_bytes["none"]), ("saved selective", lambda x: x.saved_bytes["selective"]),
              ("saved full", lambda x: x.saved_bytes["full"]), ("weight-grad bytes", lambda x: x.weight_grad_bytes)]
    rows = []
    mk, ak = kinds(measured), kinds(analytic)
    for kind in ("embedding", "block", "head"):
        for label, get in fields:
            m = statistics.median(get(x) for x in mk[kind])
            a = statistics.median(get(x) for x in ak[kind])
            unit = "MiB" if "bytes" in label or label.startswith("saved") else "ms"
            scale = 1e3 if unit == "ms" else 1 / 2**20
            rows.append({"kind": kind, "quantity": label, "unit": unit, "measured": m * scale, "analytic": a * scale,
                         "measured/analytic": (m / a) if a else None})
    return rows


def plan_cost(measured, analytic, stages: int = 4, microbatches: int = 8) -> dict:
    """Plan both profiles on ``stages`` equal CPU ranks; cost the analytic plan's partition with the measured profile."""
    from pipesched.devices import Device, LinkModel
    from pipesched.partition import evaluate_partition
    from pipesched.plan import plan, plan_partition

    devices = [Device(f"cpu{r}", 1.0, 64 * 2**30) for r in range(stages)]
    links = LinkModel.uniform(stages, 10e9, 1e-5)
    ours = plan(measured, devices, links, microbatches=microbatches, schedule="1f1b")
    theirs = plan(analytic, devices, links, microbatches=microbatches, schedule="1f1b")
    spans = [s.layers for s in theirs.partition.stages]
    part = evaluate_partition(measured, spans, devices, links, microbatches=microbatches, family="1f1b", chunks=1)
    costed = plan_partition(measured, part, devices, links, family="1f1b", microbatches=microbatches, chunks=1)
    return {"measured_plan_spans": [list(s.layers) for s in ours.partition.stages], "analytic_plan_spans": [list(s) for s in spans],
            "measured_plan_s": ours.sim.makespan, "analytic_plan_on_measured_s": costed.sim.makespan,
            "analytic_plan_slowdown": costed.sim.makespan / ours.sim.makespan}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="2 blocks, s = 256, 2 repeats (a smoke run; results not written)")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.seq_len, args.repeats = 2, 256, 2

    from pipesched.gpt2 import gpt2
    from pipesched.model_profile import profile_model
    from pipesched.profile import GPTConfig, analytic_profile

    hidden, heads, vocab = 768, 12, 50257
    peaks = cpu_peaks()
    spec = gpt2(layers=args.layers, hidden=hidden, heads=heads, seq_len=args.seq_len, vocab=vocab, microbatch=1)
    t0 = time.perf_counter()
    measured = profile_model(spec["model"], spec["args"], split=spec["split"], loss_fn=spec["loss_fn"], repeats=args.repeats, warmup=1,
                             threads=1, clock="cpu", name=f"gpt2-L{args.layers}-s{args.seq_len}")
    profile_s = time.perf_counter() - t0
    peaks_after = cpu_peaks()
    cfg = GPTConfig(layers=args.layers, hidden=hidden, heads=heads, seq_len=args.seq_len, vocab=vocab, dtype="fp32",
                    tflops=peaks["flops"] / 1e12, hbm_gbs=peaks["bytes_per_s"] / 1e9, flops_efficiency=1.0, memory_efficiency=1.0)
    analytic = analytic_profile(cfg)
    rows = kind_rows(measured, analytic)
    planning = plan_cost(measured, analytic)
    extra = {"config": {"layers": args.layers, "hidden": hidden, "heads": heads, "seq_len": args.seq_len, "vocab": vocab, "microbatch": 1,
                        "dtype": "fp32", "threads": 1, "clock": "cpu", "repeats": args.repeats},
             "cpu_peaks_before": peaks, "cpu_peaks_after": peaks_after, "profile_wall_s": profile_s, "planning": planning,
             "measured_profile": measured.to_dict(), "analytic_profile": analytic.to_dict()}
    notes = f"""
GPT-2 {args.layers} blocks, h = {hidden}, {heads} heads, s = {args.seq_len}, V = {vocab}, micro-batch 1, FP32, one thread, CPU-time clock,
median of {args.repeats} repetitions per segment ({profile_s:.0f} s wall for the profile). Analytic device: this CPU's
single-thread FP32 GEMM rate {peaks['flops'] / 1e9:.1f} GFLOP/s and copy bandwidth {peaks['bytes_per_s'] / 1e9:.1f} GB/s
(measured before the profile; after it: {peaks_after['flops'] / 1e9:.1f} GFLOP/s, {peaks_after['bytes_per_s'] / 1e9:.1f} GB/s), efficiency 1.
"block" is the median over the blocks. Param bytes count the tied embedding/head weight in both (torch's Pipe
replicates it; the analytic profile counts it in both too); the head's measured params add the final LayerNorm's bias.
Saved bytes: "none" is what autograd saved (each storage once), "selective" the inputs plus the outputs of the
linear layers (the planner's selective policy), "full" the segment inputs (the block's include the [s, s] mask);
the analytic ones are Korthikanti et al.'s formulas at 4 bytes per element.

Planning (4 equal CPU ranks, 8 micro-batches, 1F1B): measured profile's plan {planning['measured_plan_spans']},
{planning['measured_plan_s']:.3f} s simulated; the analytic profile's plan {planning['analytic_plan_spans']} costed with the
measured profile {planning['analytic_plan_on_measured_s']:.3f} s ({planning['analytic_plan_slowdown']:.3f}x).
"""
    if args.quick:
        print(notes)
        for r in rows:
            print(r)
        return
    write_results("pipesched_model_profile", rows, title="Pipeline planner: GPT-2 (124M shape) measured on this CPU vs the analytic profile",
                  notes=notes, extra=extra, columns=["kind", "quantity", "unit", "measured", "analytic", "measured/analytic"])


if __name__ == "__main__":
    main()
