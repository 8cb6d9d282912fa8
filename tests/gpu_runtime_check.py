"""GPU check of the runtime (netweave.runtime) with real NCCL: the DDP hook and the pipeline (a CUDA build of torch; not run in CI).

Two ranks run on GPU 0, each with its own ``NCCL_HOSTID``, so NCCL takes them for two nodes joined by its network
transport (as csrc/tests/gpu_nccl_check.py and pipesched's GPU runs do). The job plans have two hosts of one rank
each and traffic class 5. Scenarios:

* ``ddp``: the example's transformer (``examples/train_transformer.py``, ``--width``/``--depth``) trained
  ``--steps`` steps through the runtime's DDP hook for each policy (ddp, bytescheduler, prophet, with pieces
  small enough that buckets split) and through plain DDP from the same seed and data, in the same processes.
  Checks: every parameter equal within 1e-4 (relative 1e-3), every iteration issued the plan's transfers in
  order, the backend was NCCL and the job's traffic class reached the communicator (``traffic_route``).
  Reported: median iteration time of each policy and of plain DDP (ratios against plain DDP, same run).
* ``pipeline``: the example script itself under two torchrun agents (``--nnodes 2``, one per "host"), a
  2-stage 1F1B plan with full recomputation on stage 0 and selective on stage 1. Checks: both exit 0 with
  NCCL, and the loss of the last three steps is below 0.9x that of the first three.

Usage: python tests/gpu_runtime_check.py [--out-dir bench/results] [--steps 20] [--width 256] [--depth 4]
Writes runtime_gpu.json and runtime_gpu.md there. Exit status 0 only if every check passed; 2 when no CUDA
GPU is available (nothing written). ``--cpu-rehearsal`` runs everything with gloo on the CPU (the NCCL checks
then fail, exit 1): tests/test_runtime_gpu_rehearsal.py keeps the script working between GPU runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO), str(HERE)]

from runtime_helpers import EXAMPLE, example, free_port  # noqa: E402

from netweave.runtime import plan as jp  # noqa: E402

POLICIES = [("ddp", None, None, {"bucket_cap_bytes": 1 << 20, "first_bucket_bytes": 1 << 18}),
            ("bytescheduler", 1 << 18, 1 << 20, {}),
            ("prophet", 1 << 18, None, {})]
TRAFFIC_CLASS = 5


def two_host_plan(port: int, **kw) -> jp.JobPlan:
    """Two "hosts" (distinct NCCL_HOSTIDs on one machine), one rank each on its GPU 0."""
    pl = kw.pop("pipeline", None)
    base = jp.JobPlan(job="gpu-check", world_size=2, ranks=[jp.Rank(r, f"h{r}", 0, f"h{r}/gpu0") for r in range(2)],
                      hosts=[jp.Host(f"h{r}", r, 1, "0") for r in range(2)], rendezvous=jp.Rendezvous("127.0.0.1", port),
                      parallelism=jp.Parallelism(dp=1 if pl else 2, pp=2 if pl else 1), traffic=jp.Traffic(TRAFFIC_CLASS, 40, 1))
    return replace(base, pipeline=pl, **kw)


def rank_env(rank: int, rehearsal: bool) -> dict[str, str]:
    env = {"NCCL_HOSTID": f"netweave-runtime-h{rank}", "NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo",
           "NCCL_MULTI_RANK_GPU_ENABLE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    if rehearsal:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _ddp_worker(rank: int, port: int, plans: list[tuple[str, str]], args: dict, rehearsal: bool, out) -> None:
    os.environ.update(rank_env(rank, rehearsal), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    try:
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        import netweave.runtime as nw

        ex = example()
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

        def train(model, device) -> list[float]:
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            times = []
            for step in range(args["steps"]):
                x, y = ex.batch(step, rows=args["batch"], seq=16, vocab=64, seed=0, rank=rank)
                sync()
                t = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                ex.loss_fn(model(x.to(device)), y.to(device)).backward()
                opt.step()
                sync()
                times.append(time.perf_counter() - t)
            return times

        for policy, path in plans:
            job = nw.init(path)
            build = lambda: ex.build_model(width=args["width"], depth=args["depth"], heads=4, seed=0)  # noqa: E731
            ddp = job.data_parallel(build())
            hook_times = train(ddp, job.device)
            plain = DDP(build().to(job.device), device_ids=[job.device] if job.device.type == "cuda" else None)
            plain_times = train(plain, job.device)
            diff = max(float((a - b).abs().max() / (b.abs().max() + 1e-3)) for a, b in zip(ddp.module.parameters(), plain.module.parameters(),
                                                                                         strict=True))
            n = len(job.comm_plan.transfers)
            out.put({"rank": rank, "policy": policy, "backend": job.backend, "traffic_route": job.traffic_route,
                     "max_rel_diff": diff, "transfers": n, "in_order": all(it["order"] == list(range(n)) for it in job.hook.log),
                     "hook_median_s": statistics.median(hook_times[2:]), "plain_median_s": statistics.median(plain_times[2:])})
            job.hook.close()
        torch.distributed.destroy_process_group()
    except Exception as exc:
        import traceback

        out.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"})


def scenario_ddp(tmp: Path, args: argparse.Namespace, rehearsal: bool) -> dict:
    import torch.multiprocessing as mp

    port = free_port()
    plans = []
    for policy, part, credit, knobs in POLICIES:
        path = tmp / f"ddp-{policy}.json"
        path.write_text(jp.dumps(two_host_plan(port, data_parallel=jp.DataParallel(policy, part, credit, True, knobs))))
        plans.append((policy, str(path)))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    opts = {"steps": args.steps, "width": args.width, "depth": args.depth, "batch": args.batch}
    procs = [ctx.Process(target=_ddp_worker, args=(r, port, plans, opts, rehearsal, out)) for r in range(2)]
    for p in procs:
        p.start()
    rows = []
    try:
        for _ in range(2 * len(plans)):
            msg = out.get(timeout=600)
            if "error" in msg:
                return {"error": f"rank {msg['rank']}: {msg['error']}", "checks": {}}
            rows.append(msg)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
    checks = {"backend_is_nccl": all(r["backend"] == "nccl" for r in rows),
              "traffic_class_in_communicator": all(r["traffic_route"] is not None for r in rows)}
    per_policy = {}
    for policy, *_ in POLICIES:
        mine = [r for r in rows if r["policy"] == policy]
        checks[f"{policy}_equals_plain_ddp"] = all(r["max_rel_diff"] < 1e-3 for r in mine)
        checks[f"{policy}_plan_order"] = all(r["in_order"] for r in mine)
        hook, plain = max(r["hook_median_s"] for r in mine), max(r["plain_median_s"] for r in mine)
        per_policy[policy] = {"transfers": mine[0]["transfers"], "max_rel_diff": max(r["max_rel_diff"] for r in mine),
                              "hook_median_s": hook, "plain_ddp_median_s": plain, "ratio_vs_plain_ddp": hook / plain}
    return {"checks": checks, "policies": per_policy, "traffic_route": rows[0]["traffic_route"], "width": args.width,
            "depth": args.depth, "steps": args.steps}


def scenario_pipeline(tmp: Path, args: argparse.Namespace, rehearsal: bool) -> dict:
    stages = (jp.Stage(0, 0, (0, 1 + args.depth // 2), (), "full"), jp.Stage(1, 1, (1 + args.depth // 2, args.depth + 2), (), "selective"))
    port = free_port()
    path = tmp / "pipeline.json"
    path.write_text(jp.dumps(two_host_plan(port, pipeline=jp.Pipeline("1F1B", 4, stages, torch_class="Schedule1F1B"))))
    procs = []
    for node in range(2):
        env = {**os.environ, **rank_env(node, rehearsal), "NETWEAVE_JOB_PLAN": str(path)}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}", "--nproc-per-node=1",
               "--master-addr=127.0.0.1", f"--master-port={port}", str(EXAMPLE), "--steps", str(args.steps), "--width", str(args.width),
               "--depth", str(args.depth), "--lr", "0.2", "--out", str(tmp / "pipe-r{rank}.json")]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=600)[0] for p in procs]
    codes = [p.returncode for p in procs]
    if any(codes):
        return {"error": f"exit codes {codes}: {logs[codes.index(next(c for c in codes if c))][-3000:]}", "checks": {}}
    res = [json.loads((tmp / f"pipe-r{r}.json").read_text()) for r in range(2)]
    losses = res[1]["losses"]
    return {"checks": {"ranks_exited_0": True, "backend_is_nccl": all(r["backend"] == "nccl" for r in res),
                       "loss_decreases": sum(losses[-3:]) < 0.9 * sum(losses[:3])},
            "losses": losses, "median_iteration_s": statistics.median(res[1]["iteration_s"][2:]),
            "recompute": [s.recompute for s in stages]}


def markdown(report: dict) -> str:
    lines = ["# netweave.runtime on a GPU", "", f"{report['date']}, {report['device']}, torch {report['torch']}, NCCL {report['nccl']}.",
             f"Command: `{report['command']}`", ""]
    for name, sc in report["scenarios"].items():
        lines.append(f"## {name}")
        if "error" in sc:
            lines += ["", f"Error: `{sc['error'].splitlines()[0]}`", ""]
            continue
        lines += ["", "| check | result |", "|---|---|"] + [f"| {k} | {'pass' if v else 'FAIL'} |" for k, v in sc["checks"].items()]
        if name == "ddp":
            lines += ["", f"Transformer width {sc['width']}, depth {sc['depth']}, {sc['steps']} steps; traffic class route: "
                      f"{sc['traffic_route']}.", "", "| policy | transfers | max rel. diff vs plain DDP | iteration (ms) | vs plain DDP |",
                      "|---|---|---|---|---|"]
            for pol, r in sc["policies"].items():
                lines.append(f"| {pol} | {r['transfers']} | {r['max_rel_diff']:.1e} | {1e3 * r['hook_median_s']:.2f} | "
                             f"{r['ratio_vs_plain_ddp']:.2f} |")
        else:
            lines += ["", f"Losses {sc['losses'][0]:.3f} -> {sc['losses'][-1]:.3f}; median iteration {1e3 * sc['median_iteration_s']:.1f} ms; "
                      f"recompute {sc['recompute']}."]
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", choices=["all", "ddp", "pipeline"], default="all")
    ap.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--cpu-rehearsal", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    import torch

    rehearsal = args.cpu_rehearsal
    if not rehearsal and not torch.cuda.is_available():
        print("no CUDA GPU / CUDA build of torch: nothing to check", file=sys.stderr)
        return 2
    report: dict = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
                    "device": "CPU rehearsal (gloo, no NCCL)" if rehearsal else torch.cuda.get_device_name(0),
                    "nccl": "none" if rehearsal else ".".join(map(str, torch.cuda.nccl.version())),
                    "command": "python tests/gpu_runtime_check.py " + " ".join(sys.argv[1:]), "scenarios": {}}
    wanted = ["ddp", "pipeline"] if args.scenario == "all" else [args.scenario]
    with tempfile.TemporaryDirectory(prefix="netweave-runtime-gpu-") as d:
        report["scenarios"] = {name: run_scenario(name, Path(d), args, rehearsal) for name in wanted}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(report)
    (out / "runtime_gpu.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "runtime_gpu.md").write_text(text)
    print(text)
    failed = [f"{n}.{k}" for n, sc in report["scenarios"].items() for k, v in sc["checks"].items() if not v]
    failed += [n for n, sc in report["scenarios"].items() if "error" in sc or not sc["checks"]]
    return 1 if failed else 0


def run_scenario(name: str, tmp: Path, args: argparse.Namespace, rehearsal: bool) -> dict:
    """One scenario's result (its checks, or the error that stopped it), with PASS/FAIL lines on stdout."""
    print(f"[gpu_runtime_check] {name}", flush=True)
    started = time.monotonic()
    try:
        sc = {"ddp": scenario_ddp, "pipeline": scenario_pipeline}[name](tmp, args, rehearsal)
    except (RuntimeError, TimeoutError, OSError, subprocess.TimeoutExpired) as exc:
        sc = {"error": f"{type(exc).__name__}: {exc}", "checks": {}}
    sc["seconds"] = round(time.monotonic() - started, 1)
    print("\n".join([f"{'PASS' if ok else 'FAIL'} {name}.{k}" for k, ok in sc["checks"].items()]
                    + ([f"FAIL {name}: {sc['error']}"] if "error" in sc else [])), flush=True)
    return sc


if __name__ == "__main__":
    raise SystemExit(main())
