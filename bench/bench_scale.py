"""Scale benchmark (issue #24): the flow simulator up to 16,384 GPUs and trace replay up to 100,000 jobs on 10,240 GPUs.

1. ``sim``: emu.sim on DGX H100 rail-optimised clusters of 1,024 to 16,384 GPUs (128 to 2,048 hosts), with
   ``GPUs / 16.384`` data-parallel jobs (62 to 1,000; sizes 2-32 GPUs, jobs of 8+ GPUs on whole hosts, smaller
   ones packed), ``SIM_ITERATIONS`` iterations each; per-flow records off, link utilisation on. Goal: the 16k-GPU
   case (setup included) under 120 s.
2. ``replay``: placement.replay on 10,240 GPUs (1,280 hosts) of 10k, 25k, 50k and 100k synthetic Philly-like jobs
   (arrival rate scaled with the cluster: the load of the 1,024-GPU benchmark), every policy, emu.fluid slowdowns
   with radius 1 (as ``bench_placement``). Goal: every 100k-job replay under 300 s.

Every case runs in its own child process, so that its peak RSS (``ru_maxrss``) is its own; wall time, CPU time
(``time.process_time`` of the child) and the 1-minute load average at its start are recorded. The machine is
shared: CPU time and the growth between sizes (``cpu_growth``: log CPU ratio over log size ratio to the previous
size; 1 is linear) are the figures that do not depend on the load.

Run: ``.venv/bin/python bench/bench_scale.py [--quick] [--section sim|replay] [--policies fifo,las] [--sizes 10000,25000]``
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
        slowdown = FluidSlowdown(topo, radius=1)
        gc.collect()
        gc.freeze()  # the static topology and cell trees: the collector need not walk them again (docs/placement.md)
        w1, c1 = time.perf_counter(), time.process_time()
        r = replay(topo, trace, spec["policy"], slowdown=slowdown)
        m = r.metrics
        extra = {"events": m["events"], "avg_jct_s": m["avg_jct_s"], "p99_jct_s": m["p99_jct_s"], "avg_queue_s": m["avg_queue_s"],
                 "utilisation": m["gpu_utilisation"], "finished": m["finished"]}
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
                out.append({"section": "replay", "gpus": REPLAY_GPUS, "jobs": jobs, "policy": policy, "iterations": None})
    return out


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
                           if prev and r["run_cpu_s"] > 0 and prev["run_cpu_s"] > 0 and size != prev["size"] else None)
        last[series] = {"size": size, "run_cpu_s": r["run_cpu_s"]}
        goal_size, goal_s = GOALS[r["section"]]
        r["under_goal"] = (r["wall_s"] < goal_s) if size == goal_size else ""
        r["cpu_under_goal"] = (r["cpu_s"] < goal_s) if size == goal_size else ""  # what a quiet machine's wall time would be near


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small sizes only")
    parser.add_argument("--section", choices=("sim", "replay", "all", "none"), default="all", help="none: rewrite the table from the kept rows")
    parser.add_argument("--policies", default=",".join(POLICIES), help="replay policies, comma-separated")
    parser.add_argument("--sizes", help="comma-separated GPU counts (sim) or job counts (replay) instead of the full series")
    parser.add_argument("--out", type=Path, help="results directory (default bench/results; --quick writes only here)")
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
    old = out_dir / "scale.json" if out_dir else None
    kept = {_key(r): r for r in json.loads(old.read_text()).get("rows", [])} if old and old.exists() else {}
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else None
    for spec in cases(args.section, args.quick, policies, sizes):
        proc = subprocess.run([sys.executable, __file__, "--case", json.dumps(spec)], capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            sys.exit(f"case {spec} failed:\n{proc.stderr[-2000:]}")
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        kept[_key(row)] = row
        print(f"{row['section']} {row['gpus']} GPUs {row['jobs']} jobs {row['policy']}: wall {row['wall_s']:.1f} s, cpu {row['cpu_s']:.1f} s, "
              f"peak {row['peak_rss_mb']:.0f} MB, load {row['load_1min']:.1f}", flush=True)
        _write(kept, out_dir)  # after every case: a long run cut short keeps what it measured
    _write(kept, out_dir, final=True)


def _write(kept: dict, out_dir: Path | None, final: bool = False) -> None:
    order = {"sim": 0, "replay": 1}
    rows = sorted(kept.values(), key=lambda r: (order[r["section"]], r["policy"], r["gpus"], r["jobs"]))
    _growth(rows)
    columns = ["section", "gpus", "jobs", "policy", "iterations", "setup_s", "run_wall_s", "wall_s", "cpu_s", "run_cpu_s", "cpu_growth",
               "peak_rss_mb", "load_1min", "events", "under_goal", "cpu_under_goal", "avg_jct_s", "sim_makespan_s"]
    notes = f"""
Each row is one child process: `setup_s` builds the topology and the workload or trace (and the fluid model); `run_wall_s` and
`run_cpu_s` are the simulation or replay alone; `wall_s` and `cpu_s` are both together; `peak_rss_mb` is the child's peak RSS.
`load_1min` is the machine's 1-minute load average at the start of the case (2 cores, shared): where it is above 2, wall time
is stretched by other work and CPU time is the figure to compare. `cpu_growth` is log(CPU ratio) / log(size ratio) against the
previous size of the same series (GPUs for sim, jobs for replay): 1 is linear. `under_goal`: the sim case at 16,384 GPUs (goal
{GOALS['sim'][1]:.0f} s) and the replays of 100,000 jobs (goal {GOALS['replay'][1]:.0f} s), by wall time including setup;
`cpu_under_goal` the same by CPU time (one thread: on a quiet machine the wall time is close to it, on a loaded one it is not).
Sim: {SIM_ITERATIONS} iterations per job, jobs = GPUs / 16.384, packed placement, link utilisation of every link on.
Replay: {REPLAY_GPUS} GPUs, emu.fluid slowdowns with radius 1, arrival rate GPUs / 1024 / 8 per second, mean duration 1200 s.
"""
    title = "Scale: flow simulator to 16,384 GPUs, trace replay to 100,000 jobs on 10,240 GPUs"
    if out_dir is None:
        if final:
            print(markdown_table(rows, columns))
        return
    write_results("scale", rows, title=title, notes=notes, columns=columns, out_dir=out_dir)


if __name__ == "__main__":
    main()
