"""Benchmark of the pipeline planner (netweave.pipesched).

1. Planning speed: a 1000-layer model into 64 stages (goal < 5 s), and a dense O(P n^2) implementation of the
   same PipeDream DP as the in-process baseline (same bottleneck required), at a size the dense one can do.
2. Predicted versus measured on this CPU: a tail-heavy MLP chain profiled here, planned, run by torch's
   _PipelineScheduleRuntime in 4 gloo processes, compared with the simulator's prediction; and our plan
   versus the uniform split with torch's Schedule1F1B, by measured iteration time.
3. Our plan versus the uniform split + 1F1B on a GPT-3 2.7B-class model on the default cluster (simulated).

Run: ``.venv/bin/python bench/bench_pipesched.py [--quick] [--cpu-only] [--max-foreign C] [--quiet-timeout S]`` (``--help``).
The CPU validation is a timing measurement: run it under the shared lock, either per case
(``--cpu-only --lock /tmp/netweave-measure.lock``: each case waits for a quiet machine, then takes the lock for
about a minute) or as a whole (``flock /tmp/netweave-measure.lock .venv/bin/python bench/bench_pipesched.py --cpu-only``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import timed, write_results  # noqa: E402


def dense_bottleneck(profile, devices, links, microbatches, family="1f1b"):
    """Reference: the textbook PipeDream DP over all (i, j) spans, O(P n^2), no recomputation choice, for timing."""
    from pipesched.partition import in_flight

    lays = profile.layers
    n, P = len(lays), len(devices)
    work = np.concatenate([[0.0], np.cumsum([lay.fwd_s + lay.bwd_s for lay in lays])])
    saved = np.concatenate([[0.0], np.cumsum([float(lay.saved_bytes["none"]) for lay in lays])])
    params = np.concatenate([[0.0], np.cumsum([float(lay.param_bytes) for lay in lays])])
    out = np.array([0.0] + [float(lay.output_bytes) for lay in lays])
    upper = np.tri(n + 1, n + 1, -1, dtype=bool).T
    A = np.full(n + 1, np.inf)
    A[0] = 0.0
    for d in range(P):
        t = (work[None, :] - work[:, None]) / devices[d].speed
        mem = (params[None, :] - params[:, None]) * profile.state_factor + in_flight(family, d, P, microbatches) * (
            saved[None, :] - saved[:, None])
        t = np.where(upper & (mem <= devices[d].memory_bytes), t, np.inf)
        comm = np.zeros(n + 1) if d == 0 else 2 * (links.link(d - 1, d)[1] + out / links.link(d - 1, d)[0])
        if d == 0:
            comm = np.where(np.arange(n + 1) == 0, 0.0, np.inf)
        A = np.min(np.maximum(np.maximum(A[:, None], comm[:, None]), t), axis=0)
    return float(A[n])


def perturbed_gpt(layers: int, seed: int = 0):
    from pipesched.profile import GPTConfig, analytic_profile

    prof = analytic_profile(GPTConfig(layers=layers, hidden=4096, heads=32, seq_len=2048, vocab=50257))
    rng = random.Random(seed)
    lays = tuple(dataclasses.replace(lay, fwd_s=lay.fwd_s * rng.uniform(0.7, 1.3)) for lay in prof.layers)
    return dataclasses.replace(prof, layers=lays)


def bench_plan_speed(rows: list, quick: bool) -> dict:
    from pipesched.devices import Device, LinkModel
    from pipesched.partition import partition

    extra = {}
    for n_blocks, P, dense in ((248, 16, True), (498, 32, True), (998, 64, not quick)):
        prof = perturbed_gpt(n_blocks)
        devs = [Device(f"g{i}") for i in range(P)]     # memory unconstrained: pure DP speed
        links = LinkModel.uniform(P, 100e9, 2e-6)
        ours_s, part = timed(lambda prof=prof, devs=devs, links=links: partition(prof, devs, links, microbatches=128, recompute=("none",)),
                             repeat=3)
        row = {"case": f"{len(prof.layers)} layers -> {P} stages", "ours_s": ours_s, "bottleneck_ms": part.bottleneck_s * 1e3}
        if dense:
            dense_s, ref = timed(lambda prof=prof, devs=devs, links=links: dense_bottleneck(prof, devs, links, 128), repeat=1)
            row |= {"dense_dp_s": dense_s, "speedup": dense_s / ours_s, "same_bottleneck": abs(ref - part.bottleneck_s) <= 1e-9 * ref}
        rows.append(row)
        extra[row["case"]] = row
    # the full planner (three recomputation options, schedule, simulation) on the 1000-layer model
    prof = perturbed_gpt(998)
    devs = [Device(f"g{i}", memory_bytes=80 * 2**30) for i in range(64)]
    links = LinkModel.uniform(64, 100e9, 2e-6)
    t0 = time.perf_counter()
    part = partition(prof, devs, links, microbatches=128)
    dp_s = time.perf_counter() - t0
    rows.append({"case": "1000 layers -> 64 stages, 3 recompute options", "ours_s": dp_s, "bottleneck_ms": part.bottleneck_s * 1e3,
                 "recompute": ",".join(sorted({s.recompute for s in part.stages}))})
    return extra


def wait_for_quiet(max_foreign: float, timeout_s: float, sample_s: float = 2.0) -> tuple[float, float]:
    """Wait (at most ``timeout_s``) until other processes use less than ``max_foreign`` cores; (last foreign load, waited s)."""
    from pipesched.runner import machine_busy_s

    t_start = time.perf_counter()
    while True:
        b0, t0 = machine_busy_s(), time.perf_counter()
        time.sleep(sample_s)
        foreign = (machine_busy_s() - b0) / (time.perf_counter() - t0)
        if foreign < max_foreign or time.perf_counter() - t_start > timeout_s:
            return foreign, time.perf_counter() - t_start


def posthoc_prediction(plan, report: dict, foreign: float) -> float:
    """The same plan simulated with the CPU share the ranks had in the run.

    The calibrated share plus what other users took during the calibration, less what they took during the
    run. Not a prediction (it uses a figure from the run); it separates the model's error from other users' load.
    """
    from pipesched.simulate import SharedCpu, simulate

    sh = report["shared_cpu"]
    cores = min(float(os.cpu_count() or 1), max(0.5, sh["cores"] + report["calibration"]["foreign_cores"] - foreign))
    return simulate(plan.schedule, plan.costs, plan.links, cores=SharedCpu(cores, sh["message_cpu_s"], sh["action_cpu_s"])).makespan


@contextlib.contextmanager
def measurement_lock(path: str | None):
    """Hold the shared measurement lock (``flock`` on ``path``) for the block; no-op for None."""
    if not path:
        yield
        return
    import fcntl

    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def bench_cpu_validation(quick: bool, max_foreign: float = 0.15, quiet_timeout_s: float = 90.0, lock: str | None = None) -> tuple[list, dict]:
    from pipesched.calibrate import cpu_validation
    from pipesched.models import tail_heavy_widths

    widths = tail_heavy_widths(12, 384, 3072)
    base_cfg = {"dim": 384, "batch": 384, "microbatches": 8, "iterations": 3 if quick else 10}
    rows, reports = [], {}
    # 4 ranks on this machine's cores (the required setting), and as many ranks as cores (where balance can show).
    for stages, schedule in ((4, "1f1b"), (4, "auto"), (2, "auto")):
        cfg = {**base_cfg, "stages": stages}
        # Wait for a quiet machine outside the lock (other engineers' measurements are not held up), then measure
        # the case (calibrations, profile, both runs: about a minute) holding it.
        foreign_before, waited = wait_for_quiet(max_foreign, quiet_timeout_s)
        with measurement_lock(lock):
            load0 = os.getloadavg()[0]
            rep = cpu_validation(widths, schedule=schedule, threads=1, baseline=True, **cfg)
            load1 = os.getloadavg()[0]
        ours_plan, uni_plan = rep.pop("_plan"), rep.pop("_uniform_plan")
        rep.pop("_run")
        o, u = rep["ours"], rep["uniform_torch_1f1b"]
        sh = rep["shared_cpu"]
        for name, r, pl in ((f"{stages} ranks: ours ({schedule} -> {o['schedule']})", o, ours_plan),
                            (f"{stages} ranks: uniform + torch Schedule1F1B", u, uni_plan)):
            posthoc = posthoc_prediction(pl, rep, r["foreign_cores"])
            rows.append({"run": name, "spans": str(rep["plan"]["spans"] if r is o else u["spans"]), "predicted_ms": r["predicted_s"] * 1e3,
                         "measured_median_ms": r["measured_s"] * 1e3, "measured_min_ms": min(r["measured_iterations_s"]) * 1e3,
                         "error": r["error"], "error_vs_min": r["error_vs_fastest"], "per_action_mape": r["per_action_mape"],
                         "cpu_work_error": sum(r["rank_work_predicted_s"]) / sum(r["rank_cpu_measured_s"]) - 1,
                         "cores_calibrated": sh["cores"], "foreign_cores_run": r["foreign_cores"],
                         "posthoc_ms": posthoc * 1e3, "posthoc_error": posthoc / r["measured_s"] - 1,
                         "loadavg": f"{load0:.1f}->{load1:.1f}"})
        rows[-2] |= {"speedup_measured_median": rep["speedup_measured"],
                     "speedup_measured_min": min(u["measured_iterations_s"]) / min(o["measured_iterations_s"]),
                     "speedup_predicted": rep["speedup_predicted"]}
        rep["quiet_wait"] = {"foreign_cores_before": foreign_before, "waited_s": waited}
        reports[f"{stages}-{schedule}"] = rep
    return rows, {"config": {"widths": widths, **base_cfg}, "reports": reports}


def bench_gpt_cluster() -> list:
    import topology
    from pipesched.demo import DEMO_MODEL
    from pipesched.devices import devices_from_topology
    from pipesched.plan import plan, uniform_plan
    from pipesched.profile import analytic_profile

    topo = topology.default_cluster()
    prof = analytic_profile(DEMO_MODEL)
    rows = []
    for stages, m in ((8, 32), (16, 64)):
        devs, links = devices_from_topology(topo, count=stages, reference_tflops=prof.reference.get("tflops"))
        t0 = time.perf_counter()
        best = plan(prof, devs, links, microbatches=m)
        plan_s = time.perf_counter() - t0
        base = uniform_plan(prof, devs, links, microbatches=m, family="1f1b")
        rows.append({"case": f"{prof.name}, {stages} stages, m={m}", "ours": best.family, "ours_ms": best.sim.makespan * 1e3,
                     "lower_bound_ms": best.bound["bound_s"] * 1e3, "uniform_1f1b_ms": base.sim.makespan * 1e3,
                     "speedup": base.sim.makespan / best.sim.makespan, "plan_s": plan_s})
    return rows


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Pipeline planner benchmarks (planning speed, simulated GPT plans, CPU predicted vs measured).")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (3 timed iterations per run, no dense DP at 1000 layers)")
    ap.add_argument("--cpu-only", action="store_true",
                    help="only the CPU validation (predicted vs measured with gloo processes); run it under the measurement lock")
    ap.add_argument("--max-foreign", type=float, default=0.15,
                    help="before each CPU case wait until other processes use fewer cores than this (default 0.15)")
    ap.add_argument("--quiet-timeout", type=float, default=90.0, help="give up waiting for a quiet machine after this many seconds")
    ap.add_argument("--lock", metavar="PATH", help="take this flock (e.g. /tmp/netweave-measure.lock) around each CPU case only, "
                                                     "after the quiet wait; without it, run the script under flock yourself")
    args = ap.parse_args()
    if args.cpu_only:
        cpu_rows, extra = bench_cpu_validation(args.quick, args.max_foreign, args.quiet_timeout, args.lock)
        write_cpu_results(cpu_rows, extra)
        return
    speed_rows: list = []
    bench_plan_speed(speed_rows, args.quick)
    write_results("pipesched_plan_speed", speed_rows, title="Pipeline planner: partitioning speed",
                  notes="ours: bisection + reachability DP with range-minimum second pass, O(P n log n); dense_dp: the same PipeDream "
                        "bottleneck DP over all spans, O(P n^2), same process. Goal: 1000 layers into 64 stages in < 5 s.")
    gpt_rows = bench_gpt_cluster()
    write_results("pipesched_gpt_cluster", gpt_rows, title="Pipeline planner: planned vs uniform split + 1F1B (simulated, default cluster)",
                  notes="Analytic GPT-3 2.7B-class profile (H100 roofline at 50% FLOP/s, 80% HBM); links from topology.paths.gpu_path.")
    cpu_rows, extra = bench_cpu_validation(args.quick, args.max_foreign, args.quiet_timeout, args.lock)
    write_cpu_results(cpu_rows, extra)


def write_cpu_results(cpu_rows: list, extra: dict) -> None:
    write_results("pipesched_cpu_validation", cpu_rows, title="Pipeline planner: predicted vs measured (gloo processes, this CPU)",
                  notes=f"""
{os.cpu_count()} CPUs shared with other engineers' jobs. Every input of 'predicted_ms' is measured before the run, by separate
micro-measurements (pipesched.calibrate): the per-layer profile in CPU time (medians of 15, backward accumulating into .grad,
the other core busy with the same model), the runtime's CPU cost per action and per gloo message (a pipeline of near-empty
blocks with the same activation size), the CPU share the ranks get together and the one-way message time (ping-pong while the
other ranks compute). The simulator shares that CPU among the computing ranks (processor sharing) and adds the message and
action CPU work to the actions. 'error' = predicted / measured median - 1; 'error_vs_min' against the fastest iteration.
'cpu_work_error': the model's CPU work summed over ranks (profile + runtime + messages) against the CPU time the ranks' threads
used in a step. 'foreign_cores_run': cores other users' processes kept busy during the timed iterations (/proc/stat less our
ranks' CPU time); 'nice' does not hold them back here, because the kernel groups each login session's processes (autogroup)
and shares the CPU between groups first. 'posthoc_ms' re-simulates the same plan with the CPU share the ranks really had
(calibrated share + other users' load at calibration - their load during the run): NOT a prediction, it separates the
model's error from the load other users added after the calibration. speedups: uniform + torch Schedule1F1B / our plan,
measured back to back.""",
                  extra=extra)


if __name__ == "__main__":
    main()
