"""Benchmark of the runtime (Mininet, needs root): the example transformer's iteration time through the runtime's
DDP hook vs plain DDP, on a bandwidth-bound emulated link, with the planner's prediction beside it.

Setup: two one-"GPU" servers on one leaf with 20 Mbit/s NICs (``star(2, nic_bw=0.0025)``), emulated at time scale 1
(HTB trees at 20 Mbit/s, so the plan's seconds are wall seconds). The job is ``examples/train_transformer.py`` with
``--width 64`` (about 110 k parameters, 0.44 MB of fp32 gradients: a 2-rank all-reduce needs ~0.18 s on the link,
several times the forward and backward). Variants, each run twice, interleaved:

- ``plain DDP``: torch's DistributedDataParallel with no hook (the baseline), the same model, data and loop;
- ``runtime ddp``, ``runtime prophet``, ``runtime bytescheduler``: the example started by the launch scripts of a
  ``netweave launch`` bundle whose jobs file asks for that policy (knobs tuned by the planner), i.e. the runtime's
  hook carrying the plan.

Each rank records the time from the start of an iteration to the end of its optimizer step; a job's iteration time is
the slower rank's, the first ``--warmup`` iterations are dropped, and the median over iterations and repeats is kept.
Ratios are against plain DDP measured in the same run. The prediction is the plan's ``period_s`` (the in-job plan's
modelled iteration, ``flowsched.intrajob``), from the planner's model of the CPU (``tflops: 0.004`` in the jobs file).

Run: ``sudo .venv/bin/python bench/bench_runtime.py [--iterations 8] [--repeats 2]`` (or ``netweave bench runtime``);
writes ``bench/results/runtime_emu.{json,md}``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import write_results  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "train_transformer.py"
NIC_GBS = 0.0025          # 20 Mbit/s
WIDTH = 64
PREFIX = "nwr"
POLICIES = ("ddp", "prophet", "bytescheduler")
MODEL = {"layers": 2, "hidden": WIDTH, "heads": 4, "seq_len": 16, "vocab": 64, "dtype": "fp32", "tflops": 0.004, "microbatch_size": 8}


def _example():
    spec = importlib.util.spec_from_file_location("train_transformer", EXAMPLE)
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    return ex


def plain_ddp_worker(args: argparse.Namespace) -> None:
    """One rank of the baseline under torchrun: the example's model, data and loop, in torch's DDP with no hook."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    ex = _example()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DistributedDataParallel(ex.build_model(width=args.width, depth=2, vocab=64, seq=16, seed=0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dist.barrier()
    times, losses = [], []
    for step in range(args.steps):
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        x, y = ex.batch(step, rows=8, seq=16, vocab=64, seed=0, rank=rank)
        loss = ex.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
    with open(args.out.format(rank=rank), "w") as f:
        json.dump({"rank": rank, "iteration_s": times, "losses": losses}, f)
    dist.destroy_process_group()


def jobs_yaml(policy: str, steps: int, out: Path, ip: dict[str, str], dev: dict[str, str]) -> str:
    """The jobs file of one variant: the example on both hosts, the emulated addresses and interfaces, ``policy``."""
    import yaml

    job = {"name": "lm", "gpus": 2, "backend": "gloo", "script": str(EXAMPLE),
           "args": ["--width", str(WIDTH), "--steps", str(steps), "--out", f"{out}/lm-{{rank}}.json"],
           "model": MODEL, "data_parallel": {"policy": policy}}
    return yaml.safe_dump({"addresses": ip, "interfaces": dev, "jobs": [job]}, sort_keys=False)


def job_iterations(results: list[dict], warmup: int) -> list[float]:
    """Per iteration the slower rank's time, after the warm-up."""
    per_rank = [r["iteration_s"][warmup:] for r in results]
    return [max(ts) for ts in zip(*per_rank, strict=True)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=8, help="timed iterations per run (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per run")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--width", type=int, default=WIDTH, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=10, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        plain_ddp_worker(args)
        return 0

    from emu.mininet_backend import stop_processes, wait_for_ranks
    from emu.net import CpuMonitor, EmulatedNetwork, plan_network
    from netweave.cli import main as netweave
    from netweave.runtime import plan as jp
    from topology.fabrics import star
    from topology.io import write_topology

    steps = args.warmup + args.iterations
    topo = star(2, nic_bw=NIC_GBS)
    net_plan = plan_network(topo, time_scale=1, prefix=PREFIX)
    ip = {i.topo_host: i.ip for i in net_plan.interfaces}
    dev = {i.topo_host: i.dev for i in net_plan.interfaces}
    emu = {i.topo_host: i.host for i in net_plan.interfaces}
    work = Path(tempfile.mkdtemp(prefix="netweave-bench-runtime-"))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("LD_PRELOAD", None)
    torchrun = str(Path(sys.executable).parent / "torchrun")
    try:
        write_topology(topo, work / "cluster.json")
        plans = {}
        for policy in POLICIES:
            (work / policy).mkdir()
            (work / f"{policy}.yaml").write_text(jobs_yaml(policy, steps, work / policy, ip, dev))
            with contextlib.redirect_stdout(sys.stderr):
                if netweave(["launch", "--topology", str(work / "cluster.json"), "--jobs", str(work / f"{policy}.yaml"),
                             "--out", str(work / f"bundle-{policy}")]) != 0:
                    return 1
            plans[policy] = jp.load(work / f"bundle-{policy}" / "lm" / "plan.json")
        variants = ["plain", *POLICIES]
        times: dict[str, list[float]] = {v: [] for v in variants}
        losses: dict[str, list[float]] = {}
        cpu: dict[str, list[float]] = {v: [] for v in variants}
        with EmulatedNetwork(net_plan) as net:
            net.verify_htb()
            calibration = net.calibrate(seconds=2.0, raise_on_error=False)
            for rep in range(args.repeats):
                for v in variants:
                    procs, logs = [], []
                    with contextlib.ExitStack() as files, CpuMonitor() as mon:
                        try:
                            for node_rank, host in enumerate(["n0", "n1"]):
                                logs.append(work / f"{v}-{rep}-{host}.log")
                                log = files.enter_context(open(logs[-1], "w"))
                                if v == "plain":
                                    cmd = [torchrun, "--nnodes=2", "--nproc-per-node=1", f"--node-rank={node_rank}", f"--master-addr={ip['n0']}",
                                           "--master-port=29400", str(Path(__file__).resolve()), "--worker", "--width", str(WIDTH),
                                           "--steps", str(steps), "--out", str(work / "plain-{rank}.json")]
                                    penv = {**env, "GLOO_SOCKET_IFNAME": dev[host]}
                                else:
                                    cmd, penv = ["bash", str(work / f"bundle-{v}" / "lm" / f"launch-{host}.sh")], env
                                procs.append(net.popen(emu[host], cmd, env=penv, stdout=log, stderr=subprocess.STDOUT))
                            wait_for_ranks(procs, logs, args.timeout, what=f"{v} (repeat {rep})")
                        finally:
                            stop_processes(procs)
                    out = work / ("plain-{rank}.json" if v == "plain" else f"{v}/lm-{{rank}}.json")
                    results = [json.loads(Path(str(out).format(rank=r)).read_text()) for r in range(2)]
                    times[v] += job_iterations(results, args.warmup)
                    losses[v] = results[0]["losses"]
                    cpu[v].append(mon.report()["busy_mean"])
                    print(f"{v} repeat {rep}: median {statistics.median(job_iterations(results, args.warmup)):.3f} s", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    base = statistics.median(times["plain"])
    grad_bytes = plans["ddp"].data_parallel.params.get("gradient_bytes")
    rows = []
    for v in variants:
        plan = plans["ddp" if v == "plain" else v]
        med = statistics.median(times[v])
        rows.append({"variant": "plain DDP" if v == "plain" else f"runtime {v}", "iteration_s": med, "ratio_vs_plain": med / base,
                     "min_s": min(times[v]), "max_s": max(times[v]), "samples": len(times[v]),
                     "predicted_s": plan.period_s, "measured/predicted": med / plan.period_s if plan.period_s else None,
                     "partition_bytes": plan.data_parallel.partition_bytes, "credit_bytes": plan.data_parallel.credit_bytes,
                     "loss_first_last": f"{losses[v][0]:.3f} -> {losses[v][-1]:.3f}",
                     "cpu_busy": statistics.mean(c for c in cpu[v] if c is not None) if any(c is not None for c in cpu[v]) else None})
    link = net_plan.interfaces[0].rate_mbit
    comm = grad_bytes / (link * 1e6 / 8) if grad_bytes else float("nan")   # a 2-rank ring moves S bytes each way
    notes = f"""
Two emulated hosts, {link:g} Mbit/s HTB-shaped links (time scale 1), one gloo rank each; the example transformer
(`--width {WIDTH}`, {grad_bytes or float('nan'):.0f} B of fp32 gradients by the planner's profile). A 2-rank all-reduce of those bytes
needs {comm:.3f} s on the link. {args.iterations} timed iterations (after {args.warmup} warm-up) x {args.repeats} repeats per
variant, interleaved; iteration = the slower rank's time from the iteration's start to the end of its optimizer step;
median. ratio_vs_plain: against plain DDP (torch's DDP, no hook) in the same run. predicted_s: the bundle's plan
`period_s` (plain DDP: the ddp bundle's). Calibration flow before the runs: {calibration.get('measured_mbit', float('nan')):.1f}
Mbit/s measured, {calibration.get('expected_mbit', float('nan')):.1f} configured. cpu_busy: the 2-core machine's busy fraction
during the variant's runs (shared with other work).
"""
    write_results("runtime_emu", rows, title="The runtime's DDP hook vs plain DDP in emulation (bandwidth-bound link)", notes=notes,
                  extra={"setup": {"nic_gbs": NIC_GBS, "link_mbit": link, "width": WIDTH, "iterations": args.iterations, "warmup": args.warmup,
                                   "repeats": args.repeats, "gradient_bytes": grad_bytes, "calibration": calibration},
                         "samples": times, "plans": {p: {"period_s": plans[p].period_s, "prediction": plans[p].prediction,
                                                         "data_parallel": {"policy": plans[p].data_parallel.policy,
                                                                           "partition_bytes": plans[p].data_parallel.partition_bytes,
                                                                           "credit_bytes": plans[p].data_parallel.credit_bytes}}
                                                     for p in POLICIES}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
