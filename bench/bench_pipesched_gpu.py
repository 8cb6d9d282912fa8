"""The pipeline planner on a GPU: profile, plan and run an MLP chain with NCCL, predicted against measured.

Needs a CUDA GPU (exits 2 without one). All pipeline ranks share GPU 0 (each with its own NCCL_HOSTID, so NCCL
moves the activations over its network transport on the loopback interface); see
:func:`pipesched.calibrate.gpu_validation` for the protocol. Writes ``bench/results/pipesched_gpu_validation.{json,md}``
(or under ``--out-dir``) with the date and the device.

Run: ``python bench/bench_pipesched_gpu.py [--stages 4] [--rounds 2] [--dim 4096] [--batch 2048] [--microbatches 8]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import write_results  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=8, help="MLP blocks; the last quarter are 4x wider (unequal layers)")
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--sharing", choices=("mps", "time-slice"), default=None,
                    help="how the ranks share the GPU (default: mps when CUDA_MPS_ACTIVE_THREAD_PERCENTAGE is set, else time-slice)")
    ap.add_argument("--name", default="pipesched_gpu_validation", help="result file name under bench/results/")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    import os

    import torch

    sharing = args.sharing or ("mps" if os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") else "time-slice")
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to measure", file=sys.stderr)
        return 2
    from pipesched.calibrate import gpu_validation
    from pipesched.models import tail_heavy_widths

    widths = tail_heavy_widths(args.blocks, args.dim, 4 * args.dim, heavy=max(1, args.blocks // 4))
    rep = gpu_validation(widths, dim=args.dim, batch=args.batch, microbatches=args.microbatches, stages=args.stages,
                         iterations=args.iterations, rounds=args.rounds, sharing=sharing)
    rows = []
    for rnd in rep["rounds"]:
        for arm in rnd["order"]:
            c = rnd[arm]
            rows.append({"round": rnd["round"], "arm": arm, "schedule": c["schedule"], "spans": " ".join(f"{a}-{b}" for a, b in c["spans"]),
                         "measured_ms": round(1e3 * c["measured_s"], 2), "predicted_ms": round(1e3 * c["predicted_s"], 2),
                         "error": f"{100 * c['error']:+.1f} %", "dedicated_ms": round(1e3 * c["predicted_dedicated_s"], 2),
                         "processor_shared_ms": round(1e3 * c["predicted_processor_shared_s"], 2),
                         "per_action_mape": f"{100 * c['per_action_mape']:.1f} %" if c["per_action_mape"] is not None else "-",
                         "peak_gpu_mib": max(c["device_peak_bytes"]) // 2**20 if c["device_peak_bytes"] else "-"})
    s = rep["summary"]
    # time-sliced ranks take turns on the whole GPU, so how the layers are split matters less than with MPS shares
    time_slice_remark = " (time-sliced: the ranks take turns on the whole GPU, so the split matters less)" if sharing == "time-slice" else ""
    notes = f"""
Device: {rep['device']}, torch {rep['torch']}, NCCL {rep['nccl']}. Model: {len(widths)} MLP blocks of width
{widths} on dim {args.dim}, batch {args.batch} in {args.microbatches} micro-batches, {args.stages} pipeline ranks, all on
the one GPU (each rank its own NCCL_HOSTID; activations over NCCL's socket transport on loopback).
Sharing: {sharing} (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={rep['mps_active_thread_percentage']}). Profile (one process
alone on the GPU, under the same MPS share if any, synchronised clocks): F + B of the chain per micro-batch
{1e3 * rep['profile_total_s']:.2f} ms. Predictions, from that profile and the link each run measured before its
steps: "dedicated" = each rank a device of its own at the profile's speed (the model for MPS), "processor_shared" =
the ranks sharing one device (processor sharing, cores = 1: the model for time-slicing); "predicted" and "error"
are the one the sharing names. Our plan: {rep['plan']['schedule']} with spans {rep['plan']['spans']}.
Within 10 %: {s['within']} of {s['runs']} runs; our plan / uniform + torch 1F1B measured speed-up, median
{s.get('speedup_median', float('nan')):.3f}{time_slice_remark}.
"""
    write_results(args.name, rows, title="Pipeline planner on a GPU: predicted vs measured (NCCL)",
                  notes=notes, extra={"report": rep}, out_dir=Path(args.out_dir) if args.out_dir else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
