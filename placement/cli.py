"""``netweave place``: plan job placements, inspect HiveD cells and quotas, generate and replay traces.

Actions::

    netweave place --topology T --jobs J [--policy P] --out plan.json     (same as `place plan`)
    netweave place plan --topology T --jobs J [--policy P] --out plan.json [--hostfiles DIR] [--state FILE]
    netweave place release --topology T --state FILE JOB [JOB...]          free jobs held in a planner state file
    netweave place cells --topology T                                      HiveD cell levels derived from T
    netweave place check --topology T --jobs J                             VC quota safety check and guarantees
    netweave place trace --synthetic N --seed S --out trace.csv            (or --philly FILE / --pai FILE)
    netweave place replay --topology T --trace trace.csv --policy P[,P...] --out result.json [--plot jct.png] [--fluid-radius R [--fluid-max-ball K]]
    netweave place import-hived hivedscheduler.yaml [--topology T] [--out FILE]   HiveD's own configuration: cells, quotas, pinned cells
    netweave place export-hived --topology T [--jobs J] --out hivedscheduler.yaml  derived cells and quotas as HiveD's configuration

``--topology`` takes a topology file or ``default`` (4 DGX H100, rail-optimised).
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any

from topology.clitools import CommaList, add_json_flag, add_output, emit, eta_progress, progress, render_table
from topology.errors import InputError
from topology.inputs import check_number
from topology.io import atomic_write_text
from topology.limits import MAX_JOBS


def _topology(arg: str):
    import topology
    from topology.io import read_topology

    return topology.default_cluster() if arg == "default" else read_topology(arg)


def _plan_args(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--topology", required=required, help="topology file, or 'default'")
    p.add_argument("--jobs", required=required, help="jobs file (YAML or JSON; see docs/placement.md)")
    p.add_argument("--policy", default="hived+cassini", choices=["hived+cassini", "hived", "first-fit"],
                   help="HiveD cells with CASSINI ranking and time shifts, HiveD alone, or first-fit (default hived+cassini)")
    p.add_argument("--routing", default="rail", choices=["rail", "ecmp", "shortest"], help="routing of collectives (default rail)")
    p.add_argument("--candidates", type=int, default=4, help="buddy candidates CASSINI ranks per job (default 4)")
    p.add_argument("--script", default="train.py",
                   help="training script and its arguments for the torchrun lines, e.g. 'train.py --lr 3e-4' (a job's own script: wins)")
    p.add_argument("--base-port", type=int, default=29500, help="first master port; every job gets its own (default 29500)")
    add_output(p, "--out", default=None, help="write the plan (JSON) here")
    add_output(p, "--hostfiles", default=None, help="write one Slurm hostfile per job into this directory", directory=True)
    add_output(p, "--state", default=None, help="planner state file: place next to the jobs it holds, then add the new ones (locked)")
    p.add_argument("--fail", action=CommaList, default=[], metavar="GPU|HOST[,...]", help="bad hardware to plan around (repeatable)")
    add_json_flag(p)


def register(sub: argparse._SubParsersAction) -> None:
    place = sub.add_parser("place", help="placement planner: HiveD cells and quotas, CASSINI time shifts, launch lines, trace replay")
    _plan_args(place, required=False)
    place.set_defaults(func=cmd_plan)
    psub = place.add_subparsers(dest="place_command", metavar="ACTION")

    p = psub.add_parser("plan", help="place the jobs of a jobs file; per job hosts, GPUs, rank order, shift, torchrun lines")
    _plan_args(p, required=True)
    p.set_defaults(func=cmd_plan)

    p = psub.add_parser("release", help="free jobs held in a planner state file (place plan --state)")
    p.add_argument("jobs", nargs="+", metavar="JOB", help="job names to free")
    p.add_argument("--topology", required=True, help="topology file, or 'default'")
    add_output(p, "--state", required=True, help="planner state file")
    add_json_flag(p)
    p.set_defaults(func=cmd_release)

    p = psub.add_parser("cells", help="the HiveD cell hierarchy derived from a topology")
    p.add_argument("--topology", required=True, help="topology file, or 'default'")
    p.add_argument("--no-forge", action="store_true", help="do not add forged binary levels")
    add_json_flag(p)
    p.set_defaults(func=cmd_cells)

    p = psub.add_parser("check", help="check the virtual-cluster quotas of a jobs file against the topology (HiveD safety)")
    p.add_argument("--topology", required=True, help="topology file, or 'default'")
    p.add_argument("--jobs", required=True, help="jobs file (YAML or JSON; see docs/placement.md)")
    p.add_argument("--fail", action=CommaList, default=[], metavar="GPU|HOST[,...]", help="mark hardware bad before checking (repeatable)")
    add_json_flag(p)
    p.set_defaults(func=cmd_check)

    p = psub.add_parser("trace", help="write a trace in netweave's CSV format: synthetic, or imported from Philly / PAI")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--synthetic", type=int, metavar="N", help="N seeded synthetic jobs")
    src.add_argument("--philly", metavar="FILE", help="a Philly cluster_job_log (JSON)")
    src.add_argument("--pai", metavar="FILE", help="an Alibaba PAI pai_task_table (CSV)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the synthetic trace and of the model mix drawn for Philly/PAI (default 0)")
    p.add_argument("--limit", type=int, default=None, help="keep the first N jobs")
    p.add_argument("--arrival-rate", type=float, default=1 / 60, help="synthetic: jobs per second (default 1/60)")
    p.add_argument("--network-heavy", type=float, default=0.0, help="synthetic: share of jobs with 4x gradients, 0..1 (default 0)")
    add_output(p, "--out", required=True, help="trace file to write (netweave CSV)")
    add_json_flag(p)
    p.set_defaults(func=cmd_trace)

    p = psub.add_parser("replay", help="replay a trace under placement policies; JCT, queueing, fragmentation, link overload")
    p.add_argument("--topology", required=True, help="topology file, or 'default'")
    p.add_argument("--trace", required=True, help="trace file (netweave CSV/JSON)")
    p.add_argument("--policy", default="fifo,hived,hived+cassini", help="comma-separated: fifo, las, hived, hived+cassini")
    p.add_argument("--routing", default="rail", choices=["rail", "ecmp", "shortest"], help="routing of collectives (default rail)")
    add_output(p, "--out", default=None, help="write per-policy metrics and per-job times (JSON)")
    add_output(p, "--plot", default=None, help="write a JCT distribution plot (PNG)")
    p.add_argument("--fluid-radius", type=int, default=None, metavar="R",
                   help="re-simulate only jobs within R shared-link hops of each change (faster, approximate; default: exact)")
    p.add_argument("--fluid-max-ball", type=int, default=None, metavar="K",
                   help="with --fluid-radius: simulate at most K jobs together, the changed ones with their nearest partners "
                        "(for overloaded first-fit replays at scale; 16 errs 4.7 %% p99 on iteration times, bench/results/scale_error.md)")
    p.add_argument("--executor", choices=["auto", "local", "ray"], default="auto",
                   help="run the policies' replays in local processes or as Ray tasks (auto: Ray when --address or $RAY_ADDRESS is set)")
    p.add_argument("--address", default=None, metavar="HOST:PORT", help="a Ray cluster's head; without it --executor ray starts Ray here")
    p.add_argument("--workers", type=int, default=1, help="local processes (default 1), or CPUs of a Ray instance started here")
    add_json_flag(p)
    p.set_defaults(func=cmd_replay)

    from .hived_cli import register_hived  # HiveD's configuration file in and out (placement/hived_cli.py)

    register_hived(psub)


def cmd_plan(args: argparse.Namespace) -> int:
    from .planner import dumps_plan, load_jobs, plan_jobs, plan_text

    if not args.topology or not args.jobs:
        raise InputError("place: --topology and --jobs are required (or use an action: plan, release, cells, check, trace, replay)")
    check_number(args.candidates, what="a candidate count", where="--candidates", integer=True, minimum=1, maximum=1024)
    try:
        script, *script_args = shlex.split(args.script)
    except ValueError as exc:
        raise InputError(f"cannot split {args.script!r} into words ({exc})", where="--script") from None
    if not 1024 <= args.base_port <= 65535:
        raise InputError(f"expected a port in 1024..65535, got {args.base_port}", where="--base-port")
    topo = _topology(args.topology)
    jobs, vcs = load_jobs(args.jobs)
    launch = {"script": script, "script_args": script_args, "base_port": args.base_port, "failed": args.fail}
    if args.state:
        from .state import locked_scheduler

        with locked_scheduler(args.state, topo, vcs) as sched:
            for i, j in enumerate(jobs):
                if j.name in sched.jobs:
                    raise InputError(f"job {j.name!r} already holds GPUs in the state {args.state}; release it first",
                                     source=args.jobs, where=f"jobs[{i}].name")
            plan = plan_jobs(topo, jobs, virtual_clusters=vcs, policy=args.policy, candidates=args.candidates, routing=args.routing,
                             scheduler=sched, **launch)
            plan["state"] = {"file": args.state, "running_jobs": sorted(sched.jobs)}
    else:
        plan = plan_jobs(topo, jobs, virtual_clusters=vcs, policy=args.policy, candidates=args.candidates, routing=args.routing, **launch)
    if args.out:
        atomic_write_text(args.out, dumps_plan(plan))
    if args.hostfiles:
        d = Path(args.hostfiles)
        for j in plan["jobs"]:
            if j["placed"]:
                atomic_write_text(d / f"{j['name']}.hostfile", j["launch"]["slurm_hostfile"])
    emit(args, plan, plan_text(plan))
    return 0 if plan["unplaced"] == 0 else 1


def cmd_release(args: argparse.Namespace) -> int:
    from .state import locked_scheduler

    topo = _topology(args.topology)
    with locked_scheduler(args.state, topo, must_exist=True) as sched:
        for name in args.jobs:
            if name not in sched.jobs:
                raise InputError(f"job {name!r} holds no GPUs; the state holds {', '.join(sorted(sched.jobs)) or 'no jobs'}",
                                 source=args.state)
        freed = {name: sched.free(name) for name in args.jobs}
        running = sorted(sched.jobs)
    emit(args, {"released": freed, "running_jobs": running},
         "\n".join([f"released {n}: {len(g)} GPUs" for n, g in freed.items()] + [f"still running: {', '.join(running) or '(none)'}"]))
    return 0


def cmd_cells(args: argparse.Namespace) -> int:
    from .cells import cell_hierarchy

    trees = cell_hierarchy(_topology(args.topology), forge=not args.no_forge)
    data = {chain: t.describe() for chain, t in trees.items()}
    lines = []
    for chain, d in data.items():
        lines.append(f"chain {chain}: {d['gpus']} GPUs")
        rows = [(lv["name"], lv["size"], lv["cells"], lv["fanout"], "forged" if lv["forged"] else ("node level" if lv["node_level"] else ""))
                for lv in reversed(d["levels"])]
        lines.append(render_table(["level", "GPUs per cell>", "cells>", "fan-out>", "note"], rows, indent=2))
    emit(args, data, "\n".join(lines))
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from .hived import HivedScheduler
    from .planner import load_jobs

    topo = _topology(args.topology)
    jobs, vcs = load_jobs(args.jobs)
    sched = HivedScheduler(topo, vcs)  # raises QuotaError (an InputError) when infeasible
    check_jobs_fit(sched, jobs, source=args.jobs)
    report = sched.fail(args.fail)["guarantees"] if args.fail else sched.guarantee_report()
    lines = [f"virtual clusters: {', '.join(vcs) or '(none)'}: quotas feasible on {topo.name}"]
    for chain, c in report["chains"].items():
        for d in c["deficits"]:
            lines.append(f"  DEGRADED chain {chain} level {d['level']}: {d['missing']} cell(s) missing "
                         f"(demand {d['demand']}, healthy {d['available']})")
    lines.append("guarantees hold" if report["ok"] else "guarantees degraded by bad hardware")
    emit(args, report, "\n".join(lines))
    return 0 if report["ok"] else 1


def check_jobs_fit(sched: Any, jobs: list[Any], *, source: str | None = None) -> None:
    """Raise :class:`InputError` for a job that can never be placed: more GPUs than its chain, or than its VC's quota, holds."""
    for i, j in enumerate(jobs):
        chains = {n: t for n, t in sched.trees.items() if j.gpu_model in (None, n)}
        if j.vc is not None:
            quota = sum(n * sched.trees[c].levels[lv].size for c, vch in sched.vcs[j.vc].items() if c in chains for lv, n in vch.quota.items())
            if j.gpus > quota:
                raise InputError(f"job {j.name!r} asks for {j.gpus} GPUs; its virtual cluster {j.vc!r} has a quota of {quota}",
                                 source=source, where=f"jobs[{i}].gpus")
        most = max((len(t.leaves) for t in chains.values()), default=0)
        if j.gpus > most:
            raise InputError(f"job {j.name!r} asks for {j.gpus} GPUs; the cluster has {most}{' of ' + j.gpu_model if j.gpu_model else ''}",
                             source=source, where=f"jobs[{i}].gpus")


def cmd_trace(args: argparse.Namespace) -> int:
    from .traces import dumps_trace, read_pai, read_philly, synthetic_trace

    if args.limit is not None:
        check_number(args.limit, what="a job count", where="--limit", integer=True, minimum=1, maximum=MAX_JOBS)
    if args.synthetic is not None:
        check_number(args.synthetic, what="a job count", where="--synthetic", integer=True, minimum=1, maximum=MAX_JOBS)
        check_number(args.arrival_rate, what="an arrival rate", where="--arrival-rate", positive=True, maximum=1e6)
        check_number(args.network_heavy, what="a share", where="--network-heavy", minimum=0, maximum=1)
        jobs = synthetic_trace(args.synthetic, seed=args.seed, arrival_rate=args.arrival_rate, network_heavy=args.network_heavy)
    elif args.philly:
        jobs = read_philly(args.philly, seed=args.seed, limit=args.limit)
    else:
        jobs = read_pai(args.pai, seed=args.seed, limit=args.limit)
    if args.limit is not None:
        jobs = jobs[: args.limit]
    atomic_write_text(args.out, dumps_trace(jobs, "json" if args.out.endswith(".json") else "csv"))
    gpus = [j.gpus for j in jobs]
    data = {"jobs": len(jobs), "out": args.out, "max_gpus": max(gpus, default=0), "span_s": jobs[-1].arrival_s if jobs else 0}
    emit(args, data, f"wrote {len(jobs)} jobs to {args.out} (largest {data['max_gpus']} GPUs, arrivals over {data['span_s']:.0f} s)")
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from .replay import POLICIES
    from .traces import read_trace

    topo = _topology(args.topology)
    trace = read_trace(args.trace)
    total = len(topo.gpus())
    for j in trace:
        if j.gpus > total:
            raise InputError(f"job {j.name!r} asks for {j.gpus} GPUs; the cluster has {total}, so it could never run", source=args.trace)
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    for p in policies:
        if p not in POLICIES:
            raise InputError(f"unknown policy {p!r}; expected one of {', '.join(POLICIES)}", where="--policy")
    if args.fluid_radius is not None and args.fluid_radius < 1:
        raise InputError(f"expected a radius >= 1, got {args.fluid_radius}", where="--fluid-radius")
    if args.fluid_max_ball is not None and args.fluid_radius is None:
        raise InputError("needs --fluid-radius (the limit applies to the radius model's simulations)", where="--fluid-max-ball")
    if args.fluid_max_ball is not None and args.fluid_max_ball < 2:
        raise InputError(f"expected at least 2 jobs, got {args.fluid_max_ball}", where="--fluid-max-ball")
    from emu.sweep import RayExecutor, get_executor

    from .replay_set import replay_many

    executor = get_executor(args.executor, max_workers=args.workers, address=args.address)
    if isinstance(executor, RayExecutor):
        executor.check()
    progress(f"replaying {len(trace)} jobs under {', '.join(policies)} on the {executor.name} executor")
    done = replay_many(topo, {"trace": trace}, policies, executor=executor, fluid_radius=args.fluid_radius,
                       fluid_max_ball=args.fluid_max_ball, routing=args.routing,
                       progress=eta_progress("place replay"))
    results: dict[str, Any] = {p: done["trace", p] for p in policies}
    from emu.fluid import fluid_engine

    data = {"topology": topo.name, "jobs": len(trace), "fluid_engine": fluid_engine(), "fluid_radius": args.fluid_radius,
            "fluid_max_ball": args.fluid_max_ball,
            "metrics": {p: r.metrics for p, r in results.items()}}
    if args.out:
        atomic_write_text(args.out, json.dumps({**data, "per_job": {p: r.jobs for p, r in results.items()}}, indent=1, default=str) + "\n")
    if args.plot:
        plot_jct(results, args.plot, title=f"{len(trace)} jobs on {topo.name}")
    rows = [(p, _f(m["avg_jct_s"]), _f(m["p99_jct_s"]), _f(m["avg_queue_s"]), f"{m['fragmentation']:.3f}", f"{m['gpu_utilisation']:.3f}",
             f"{m['overloaded_link_s']:.1f}") for p, m in ((p, r.metrics) for p, r in results.items())]
    emit(args, data, render_table(["policy", "avg JCT s>", "p99 JCT s>", "avg queue s>", "frag>", "util>", "overload link-s>"], rows))
    return 0


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def plot_jct(results: dict[str, Any], path: str | Path, *, title: str = "") -> None:
    """CDF of job completion times, one line per policy (PNG)."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in results.items():
        j = np.sort(r.jct())
        if len(j):
            ax.plot(j, np.arange(1, len(j) + 1) / len(j), label=f"{name} (avg {j.mean():.0f} s)")
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("job completion time (s)")
    ax.set_ylabel("fraction of jobs")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
