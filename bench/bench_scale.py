"""Scale benchmark (issue #24): the flow simulator up to 16,384 GPUs and trace replay up to 100,000 jobs on 10,240 GPUs.

1. ``sim``: emu.sim on DGX H100 rail-optimised clusters of 1,024 to 16,384 GPUs (128 to 2,048 hosts), with
   ``GPUs / 16.384`` data-parallel jobs (62 to 1,000; sizes 2-32 GPUs, jobs of 8+ GPUs on whole hosts, smaller
   ones packed), ``SIM_ITERATIONS`` iterations each; per-flow records off, link utilisation on. Goal: the 16k-GPU
   case (setup included) under 120 s.
2. ``replay``: placement.replay on 10,240 GPUs (1,280 hosts) of 10k, 25k, 50k and 100k synthetic Philly-like jobs
   (arrival rate scaled with the cluster: the load of the 1,024-GPU benchmark), every policy, emu.fluid slowdowns
   with radius 1 (as ``bench_placement``) and at most ``REPLAY_MAX_BALL`` jobs per simulation. Goal: every 100k-job
   replay under 300 s.
3. ``error`` (run only when asked): the error of that ``max_ball`` limit against the same model without it, on the
   FIFO and LAS replays of ``ERROR_JOBS`` jobs (where both run): the limited model drives the replay and the
   unlimited one answers the same calls (per-job iteration times), and a separate replay with the unlimited model
   (average and p99 JCT). Written to ``scale_error.json/.md``.

Every case runs in its own child process, so that its peak RSS (``ru_maxrss``) is its own; wall time, CPU time
(``time.process_time`` of the child) and the 1-minute load average at its start are recorded. The machine is
shared: CPU time and the growth between sizes (``cpu_growth``: log CPU ratio over log size ratio to the previous
size; 1 is linear) are the figures that do not depend on the load.

Run: ``.venv/bin/python bench/bench_scale.py [--quick] [--section sim|replay|error] [--policies fifo,las] [--sizes 10000,25000]``
(``--quick``: the small sizes only, a minute or two; its table is printed, and written only to ``--out DIR``). Rows of
cases not run now are kept from the last run.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import RESULTS, markdown_table, write_results  # noqa: E402

SIM_ITERATIONS = 3
SIM_GPUS = (1024, 2048, 4096, 8192, 16384)
REPLAY_GPUS = 10240
REPLAY_JOBS = (10_000, 25_000, 50_000, 100_000)
POLICIES = ("fifo", "las", "hived", "hived+cassini")
GOALS = {"sim": (16384, 120.0), "replay": (100_000, 300.0)}
REPLAY_MAX_BALL = 16  # jobs per fluid simulation in the replays (emu.fluid's max_ball), chosen by the error section
ERROR_JOBS = 10_000
ERROR_LIMITS = (8, 16)
# the data-parallel job sizes, 100 jobs of 1,300 GPUs in all (~80 % of the GPUs for GPUs / 16.384 jobs)
SIM_MIX = [32] * 20 + [16] * 30 + [8] * 30 + [4] * 10 + [2] * 10


def sim_workload(topo, jobs: int, iterations: int, seed: int = 0):
    """``jobs`` data-parallel jobs from :data:`SIM_MIX`, largest first: 8+ GPUs on whole consecutive hosts, smaller ones packed.

    >>> import topology
    >>> w = sim_workload(topology.build_cluster(8), 3, 1)
    >>> [len(j.gpus) for j in w.jobs]
    [32, 16, 8]
    """
    from emu.workload import Job, Workload, packed_gpu_groups

    rng = random.Random(seed)
    sizes = sorted((SIM_MIX[(k * 37) % len(SIM_MIX)] for k in range(jobs)), reverse=True)  # 37 is prime to 100: a spread of the mix
    out = [Job.data_parallel(f"job{k:04d}", gpus, compute_s=rng.uniform(0.005, 0.05), nbytes=rng.choice([50e6, 100e6, 250e6, 1e9]),
                             iterations=iterations, start_offset=rng.uniform(0, 0.01)) for k, gpus in enumerate(packed_gpu_groups(topo, sizes))]
    return Workload(f"{jobs}jobs-{iterations}it", out)


def replay_trace(jobs: int, gpus: int):
    """The replay benchmark's trace (``bench_placement``'s), arrivals scaled to keep the load of 1,024 GPUs."""
    from placement.traces import synthetic_trace

    return synthetic_trace(jobs, seed=3, arrival_rate=gpus / 1024 / 8, mean_duration_s=1200, network_heavy=0.2)


def run_case(spec: dict) -> dict:
    """One case, in this process (the child): its figures."""
    import topology

    load = os.getloadavg()[0]
    w0, c0 = time.perf_counter(), time.process_time()
    if spec["section"] == "sim":
        from emu.sim import simulate

        topo = topology.build_cluster(spec["gpus"] // 8)
        work = sim_workload(topo, spec["jobs"], spec["iterations"])
        w1, c1 = time.perf_counter(), time.process_time()
        r = simulate(topo, work, record_flows=False)
        extra = {"events": r.meta["events"], "rate_solves": r.meta["recomputes"] - r.meta["memo_hits"], "sim_makespan_s": r.makespan,
                 "largest_component_groups": r.meta["largest_component_groups"]}
    else:
        from placement.contention import FluidSlowdown
        from placement.replay import replay

        topo = topology.build_cluster(spec["gpus"] // 8)
        trace = replay_trace(spec["jobs"], spec["gpus"])
        slowdown = FluidSlowdown(topo, radius=1, max_ball=spec.get("max_ball", REPLAY_MAX_BALL))
        gc.collect()
        gc.freeze()  # the static topology and cell trees: the collector need not walk them again (docs/placement.md)
        w1, c1 = time.perf_counter(), time.process_time()
        r = replay(topo, trace, spec["policy"], slowdown=slowdown)
        m = r.metrics
        extra = {"events": m["events"], "avg_jct_s": m["avg_jct_s"], "p99_jct_s": m["p99_jct_s"], "avg_queue_s": m["avg_queue_s"],
                 "utilisation": m["gpu_utilisation"], "finished": m["finished"], "simulations": slowdown.simulations,
                 "capped_simulations": slowdown.model.capped}
    w2, c2 = time.perf_counter(), time.process_time()
    return {**spec, "setup_s": w1 - w0, "run_wall_s": w2 - w1, "wall_s": w2 - w0, "cpu_s": c2 - c0, "run_cpu_s": c2 - c1,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "load_1min": load, **extra}


def cases(section: str, quick: bool, policies: list[str], sizes: list[int] | None = None) -> list[dict]:
    out = []
    if section in ("sim", "all"):
        for gpus in sizes or (SIM_GPUS[:2] if quick else SIM_GPUS):
            out.append({"section": "sim", "gpus": gpus, "jobs": round(gpus * 1000 / 16384), "policy": "", "iterations": SIM_ITERATIONS})
    if section in ("replay", "all"):
        for jobs in sizes or ((1000, 2500) if quick else REPLAY_JOBS):
            for policy in policies:
                out.append({"section": "replay", "gpus": REPLAY_GPUS, "jobs": jobs, "policy": policy, "iterations": None,
                            "max_ball": REPLAY_MAX_BALL})
    return out


class _Shadow:
    """A slowdown model that drives a replay with the ``max_ball``-limited model and asks the unlimited one the same calls."""

    def __init__(self, topo, max_ball: int) -> None:
        from placement.contention import FluidSlowdown

        self.approx, self.exact = FluidSlowdown(topo, radius=1, max_ball=max_ball), FluidSlowdown(topo, radius=1)
        self.exact_now: dict[str, float] = {}  # the unlimited model's current answer per running job
        self.solo: dict[str, float] = {}
        self.errors: list[float] = []
        self.exact_cpu = 0.0

    def update(self, changed):
        answers = self.approx.update(changed)
        c0 = time.process_time()
        exact = self.exact.update(changed)
        self.exact_cpu += time.process_time() - c0
        for name, placed in changed.items():
            if placed is None:
                self.exact_now.pop(name, None)
                self.solo.pop(name, None)
            else:
                self.solo[name] = placed.profile.period_s
        self.exact_now.update(exact)
        for name, x in answers.items():
            e = self.exact_now.get(name)
            if e is not None and max(x, e) > self.solo[name] * (1 + 1e-9):  # slowed by contention in either model
                self.errors.append(x / e - 1)
        return answers


def bench_error(jobs: int, policies: list[str], limits: tuple[int, ...], out_dir: Path | None) -> None:
    """The ``max_ball`` limit against the model without it (radius 1 both): answers to the same calls, and whole replays."""
    import numpy as np

    import topology
    from placement.contention import FluidSlowdown
    from placement.replay import replay

    topo = topology.build_cluster(REPLAY_GPUS // 8)
    trace = replay_trace(jobs, REPLAY_GPUS)
    rows = []
    for policy in policies:
        c0 = time.process_time()
        ref = replay(topo, trace, policy, slowdown=FluidSlowdown(topo, radius=1))
        ref_cpu = time.process_time() - c0
        ref_jct = {x["name"]: x["jct_s"] for x in ref.jobs if x["jct_s"] is not None}
        for limit in limits:
            shadow = _Shadow(topo, limit)
            c0 = time.process_time()
            res = replay(topo, trace, policy, slowdown=shadow)
            cpu = time.process_time() - c0 - shadow.exact_cpu
            err = np.abs(np.array(shadow.errors)) if shadow.errors else np.zeros(1)
            jct = {x["name"]: x["jct_s"] for x in res.jobs if x["jct_s"] is not None}
            both = [n for n in ref_jct if n in jct]
            per_job = np.abs(np.array([jct[n] / ref_jct[n] - 1 for n in both])) if both else np.zeros(1)
            sims = shadow.approx.simulations
            rows.append({"policy": policy, "jobs": jobs, "max_ball": limit, "simulations": sims,
                         "capped_share": shadow.approx.model.capped / sims if sims else 0.0, "contended_answers": len(shadow.errors),
                         "iter_err_median": float(np.median(err)), "iter_err_p99": float(np.percentile(err, 99)), "iter_err_max": float(err.max()),
                         "iter_err_mean_signed": float(np.mean(shadow.errors)) if shadow.errors else 0.0,
                         "avg_jct_ref_s": ref.metrics["avg_jct_s"], "avg_jct_err": res.metrics["avg_jct_s"] / ref.metrics["avg_jct_s"] - 1,
                         "p99_jct_err": res.metrics["p99_jct_s"] / ref.metrics["p99_jct_s"] - 1,
                         "job_jct_err_median": float(np.median(per_job)), "cpu_ref_s": ref_cpu, "cpu_limited_s": cpu,
                         "cpu_ratio": ref_cpu / cpu if cpu > 0 else None})
            print(rows[-1], flush=True)
    notes = f"""
`max_ball` limits a fluid simulation of the replay's radius-1 model to that many jobs (emu.fluid.PeriodicFluidModel; each chunk of
changed jobs simulated with its nearest partners). The reference is the same model without the limit (radius 1 both). `iter_err_*`:
the limited model drives the replay and the unlimited one answers the same calls (same running jobs, same phases); relative error
|a/e - 1| of every answer slowed by contention in either model (`mean_signed` keeps the sign: < 0, the limited model is optimistic).
`capped_share`: the share of the limited model's simulations that were cut to `max_ball` jobs. `avg_jct_err`, `p99_jct_err`,
`job_jct_err_median` (per job, over the jobs both finished): the limited replay against a separate unlimited one (schedule
differences cascade, so these mix the model's error and its consequences). `cpu_*`: CPU seconds of each replay (the limited one
without the time its shadow spent), same process, {REPLAY_GPUS} GPUs, the replay section's trace.
"""
    title = f"max_ball limit of the replay's fluid model against the model without it ({jobs} jobs, {REPLAY_GPUS} GPUs)"
    columns = ["policy", "jobs", "max_ball", "simulations", "capped_share", "contended_answers", "iter_err_median", "iter_err_p99",
               "iter_err_max", "iter_err_mean_signed", "avg_jct_ref_s", "avg_jct_err", "p99_jct_err", "job_jct_err_median", "cpu_ref_s",
               "cpu_limited_s", "cpu_ratio"]
    if out_dir is None:
        print(markdown_table(rows, columns))
        return
    write_results("scale_error", rows, title=title, notes=notes, columns=columns, out_dir=out_dir)


def _key(row: dict) -> tuple:
    return (row["section"], row["gpus"], row["jobs"], row["policy"])


def _growth(rows: list[dict]) -> None:
    """``cpu_growth``: the exponent of CPU time in the size between consecutive sizes of one series (1: linear)."""
    last: dict[tuple, dict] = {}
    for r in rows:
        series = (r["section"], r["policy"])
        size = r["gpus"] if r["section"] == "sim" else r["jobs"]
        prev = last.get(series)
        r["cpu_growth"] = (math.log(r["run_cpu_s"] / prev["run_cpu_s"]) / math.log(size / prev["size"])
                           if prev and r.get("run_cpu_s") and prev["run_cpu_s"] and size != prev["size"] else None)
        last[series] = {"size": size, "run_cpu_s": r.get("run_cpu_s")}
        goal_size, goal_s = GOALS[r["section"]]
        unfinished = r.get("timed_out_s") is not None  # stopped past its limit (run it at least the goal)
        r["under_goal"] = ((False if unfinished else r["wall_s"] < goal_s) if size == goal_size else "")
        r["cpu_under_goal"] = ((False if unfinished else r["cpu_s"] < goal_s) if size == goal_size else "")  # near a quiet machine's wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small sizes only")
    parser.add_argument("--section", choices=("sim", "replay", "all", "none", "error"), default="all",
                        help="none: rewrite the table from the kept rows; error: the max_ball limit's error (not part of all)")
    parser.add_argument("--policies", default=",".join(POLICIES), help="replay policies, comma-separated")
    parser.add_argument("--sizes", help="comma-separated GPU counts (sim) or job counts (replay) instead of the full series")
    parser.add_argument("--out", type=Path, help="results directory (default bench/results; --quick writes only here)")
    parser.add_argument("--case-timeout", type=float, default=None, metavar="S",
                        help="stop a case after S seconds of wall time and record it as unfinished (timed_out_s)")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case (JSON) in this process and print its row
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(json.loads(args.case))), flush=True)
        return
    policies = [p for p in args.policies.split(",") if p]
    for p in policies:
        if p not in POLICIES:
            parser.error(f"unknown policy {p!r}; expected some of {', '.join(POLICIES)}")
    out_dir = args.out or (None if args.quick else RESULTS)
    if args.section == "error":
        sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else [1000 if args.quick else ERROR_JOBS]
        for jobs in sizes:
            bench_error(jobs, [p for p in policies if p in ("fifo", "las")], ERROR_LIMITS, out_dir)
        return
    old = out_dir / "scale.json" if out_dir else None
    kept = {_key(r): r for r in json.loads(old.read_text()).get("rows", [])} if old and old.exists() else {}
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    measured = {"measured": time.strftime("%Y-%m-%d", time.gmtime()), "commit": _commit(Path(__file__).resolve().parents[1])}
    sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else None
    for spec in cases(args.section, args.quick, policies, sizes):
        load = os.getloadavg()[0]
        try:
            proc = subprocess.run([sys.executable, __file__, "--case", json.dumps(spec)], capture_output=True, text=True, env=env,
                                  timeout=args.case_timeout)
        except subprocess.TimeoutExpired:  # a row that says so: no figures but the limit it ran past
            kept[_key(spec)] = {**spec, **measured, "timed_out_s": args.case_timeout, "load_1min": load, "run_cpu_s": None, "cpu_s": None,
                                "wall_s": None}
            print(f"{spec['section']} {spec['gpus']} GPUs {spec['jobs']} jobs {spec['policy']}: stopped after {args.case_timeout:.0f} s", flush=True)
            _write(kept, out_dir)
            continue
        if proc.returncode != 0:
            sys.exit(f"case {spec} failed:\n{proc.stderr[-2000:]}")
        row = {**json.loads(proc.stdout.strip().splitlines()[-1]), **measured}
        kept[_key(row)] = row
        print(f"{row['section']} {row['gpus']} GPUs {row['jobs']} jobs {row['policy']}: wall {row['wall_s']:.1f} s, cpu {row['cpu_s']:.1f} s, "
              f"peak {row['peak_rss_mb']:.0f} MB, load {row['load_1min']:.1f}", flush=True)
        _write(kept, out_dir)  # after every case: a long run cut short keeps what it measured
    _write(kept, out_dir, final=True)


def _commit(root: Path) -> str:
    """The checkout's commit, short, with ``+`` when its tracked code differs from it (rows say what code they measured;
    results and prose being written meanwhile do not count)."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)

    head = git("rev-parse", "--short", "HEAD")
    if head.returncode != 0:
        return ""
    dirty = git("diff", "--quiet", "HEAD", "--", ".", ":(exclude)bench/results", ":(exclude)*.md").returncode
    return head.stdout.strip() + ("+" if dirty else "")


def _write(kept: dict, out_dir: Path | None, final: bool = False) -> None:
    order = {"sim": 0, "replay": 1}
    rows = sorted(kept.values(), key=lambda r: (order[r["section"]], r["policy"], r["gpus"], r["jobs"]))
    _growth(rows)
    columns = ["section", "gpus", "jobs", "policy", "iterations", "setup_s", "run_wall_s", "wall_s", "cpu_s", "run_cpu_s", "cpu_growth",
               "peak_rss_mb", "load_1min", "events", "under_goal", "cpu_under_goal", "avg_jct_s", "sim_makespan_s", "max_ball",
               "capped_simulations", "timed_out_s", "measured", "commit"]
    notes = f"""
Each row is one child process: `setup_s` builds the topology and the workload or trace (and the fluid model); `run_wall_s` and
`run_cpu_s` are the simulation or replay alone; `wall_s` and `cpu_s` are both together; `peak_rss_mb` is the child's peak RSS.
`load_1min` is the machine's 1-minute load average at the start of the case (2 cores, shared): where it is above 2, wall time
is stretched by other work and CPU time is the figure to compare. `cpu_growth` is log(CPU ratio) / log(size ratio) against the
previous size of the same series (GPUs for sim, jobs for replay): 1 is linear. `under_goal`: the sim case at 16,384 GPUs (goal
{GOALS['sim'][1]:.0f} s) and the replays of 100,000 jobs (goal {GOALS['replay'][1]:.0f} s), by wall time including setup;
`cpu_under_goal` the same by CPU time (the simulator is one thread: on a quiet machine its wall time is close to it, on a
loaded one it is not; a replay also runs the fluid model's larger updates on a second thread, so its CPU time can exceed its wall time).
Sim: {SIM_ITERATIONS} iterations per job, jobs = GPUs / 16.384, packed placement, link utilisation of every link on.
Replay: {REPLAY_GPUS} GPUs, emu.fluid slowdowns with radius 1 and at most `max_ball` jobs per simulation (`capped_simulations`: the
simulations cut to that size; scale_error.md measures the limit's error), arrival rate GPUs / 1024 / 8 per second, mean duration 1200 s.
`timed_out_s`: the case was stopped after that many seconds of wall time (`--case-timeout`), unfinished.
Rows are kept between runs and replaced one case at a time: `measured` (UTC date) and `commit` (the checkout measured; `+` when
it had uncommitted changes) say which code each row timed (empty in rows measured before these columns, on 2026-11-26 or earlier);
the date at the top is the last write's.
"""
    title = "Scale: flow simulator to 16,384 GPUs, trace replay to 100,000 jobs on 10,240 GPUs"
    if out_dir is None:
        if final:
            print(markdown_table(rows, columns))
        return
    write_results("scale", rows, title=title, notes=notes, columns=columns, out_dir=out_dir)


if __name__ == "__main__":
    main()
