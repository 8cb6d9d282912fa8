"""The emulation layer's part of ``netweave demo``: two data-parallel jobs sharing a cluster's fabric, simulated.

1. The two jobs on ``topo`` (the default cluster: non-blocking rail-optimised
   fabric), alone and together: with ECMP their all-reduce rings cross rails
   through the spines, and a non-blocking fabric absorbs both.
2. The same cluster with its leaf uplinks oversubscribed 4:1 (when ``topo`` is
   a built rail-optimised cluster): the jobs now slow each other down; a
   CASSINI-style time shift of the second job (found by a sweep) interleaves
   their all-reduces; strict priority protects one job; rail-aligned routing
   (NCCL's PXN) keeps the traffic off the spines altogether.

Timeline PNGs (link utilisation and job phases) are written under ``out``.
"""

from __future__ import annotations

import pathlib
import time
from typing import Any

from topology import build_cluster
from topology.clitools import render_table
from topology.errors import InputError
from topology.model import Topology

from .plots import plot_timeline
from .sim import simulate
from .sweep import LocalExecutor, sweep
from .workload import Job, Workload

COMPUTE_S = 0.010
GRADIENT_BYTES = 512e6
ITERATIONS = 6


def two_jobs(topo: Topology, *, shift: float = 0.0, priority_b: int = 0) -> Workload:
    """Job ``dp-a`` on four GPUs of each of the first two hosts, ``dp-b`` on four GPUs of the next two (or of the same two)."""
    hosts = [h for h in topo.hosts() if len(topo.gpus(h)) >= 2]
    if len(hosts) < 2:
        raise InputError("the emu demo needs at least two hosts with two GPUs each")
    per = min(4, min(len(topo.gpus(h)) for h in hosts[:4]) // (1 if len(hosts) >= 4 else 2))
    if len(hosts) >= 4:
        a = topo.gpus(hosts[0])[:per] + topo.gpus(hosts[1])[:per]
        b = topo.gpus(hosts[2])[:per] + topo.gpus(hosts[3])[:per]
    else:
        a = topo.gpus(hosts[0])[:per] + topo.gpus(hosts[1])[:per]
        b = topo.gpus(hosts[0])[per : 2 * per] + topo.gpus(hosts[1])[per : 2 * per]
    job_a = Job.data_parallel("dp-a", a, compute_s=COMPUTE_S, nbytes=GRADIENT_BYTES, iterations=ITERATIONS)
    job_b = Job.data_parallel("dp-b", b, compute_s=COMPUTE_S, nbytes=GRADIENT_BYTES, iterations=ITERATIONS, start_offset=shift,
                              priority=priority_b)
    return Workload("two-data-parallel-jobs", (job_a, job_b))


def _iters(result) -> dict[str, float]:
    return {name: job.mean_iteration_time() for name, job in result.jobs.items()}


def _oversubscribed(topo: Topology, ratio: float) -> Topology | None:
    builder = topo.meta.get("builder") or {}
    if builder.get("kind") != "cluster" or builder.get("fabric") != "rail-optimized":
        return None
    options = {k: v for k, v in builder.items() if k not in ("kind", "nodes", "node", "fabric", "node_options", "oversubscription")}
    return build_cluster(builder["nodes"], node=builder["node"], fabric="rail-optimized", node_options=builder.get("node_options") or None,
                         name=f"{topo.name}-oversub{ratio:g}", oversubscription=ratio, **options)


def demo(topo: Topology, out: pathlib.Path) -> tuple[dict[str, Any], str]:
    """Run the scenarios; write timelines under ``out``; return a JSON-able report and the text."""
    t0 = time.perf_counter()
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    w = two_jobs(topo)
    report: dict[str, Any] = {"workload": w.to_dict(), "scenarios": {}}
    lines = [f"Two data-parallel jobs ({len(w.jobs[0].gpus)} GPUs each, {COMPUTE_S * 1e3:g} ms compute + ring all-reduce of "
             f"{GRADIENT_BYTES / 1e6:g} MB per iteration), flow-level simulation with ECMP routing:"]
    rows: list[tuple[str, ...]] = []  # one per scenario: its label and each job's mean iteration

    def scenario(key: str, label: str, t: Topology, workload: Workload, png: str | None = None, **options: Any) -> dict[str, float]:
        r = simulate(t, workload, record_flows=False, **options)
        its = _iters(r)
        entry = {"label": label, "topology": t.name, "mean_iteration_s": its, "jct_s": {n: j.jct for n, j in r.jobs.items()},
                 "events": r.meta["events"]}
        if png:
            entry["timeline"] = str(plot_timeline(r, out / png, title=f"{label} ({t.name})"))
        report["scenarios"][key] = entry
        rows.append((label, *(f"{v * 1e3:.3f}" for v in its.values()), *[""] * (len(w.jobs) - len(its))))
        return its

    alone = scenario("alone", "dp-a alone", topo, Workload("alone", (w.jobs[0],)))
    scenario("together", "both jobs, non-blocking fabric", topo, w, "timeline-default.png")
    over = _oversubscribed(topo, 4.0)
    if over is not None:
        alone_over = scenario("alone_oversubscribed", "dp-a alone, 4:1 oversubscribed", over, Workload("alone", (w.jobs[0],)))
        together = scenario("together_oversubscribed", "both jobs, 4:1 oversubscribed", over, w, "timeline-oversubscribed.png")
        # CASSINI: shift dp-b by a fraction of an iteration so that the all-reduces interleave
        period = alone_over["dp-a"]
        shifts = [round(period * k / 8, 6) for k in range(8)]
        table = sweep(over, w, {"jobs.dp-b.start_offset": shifts}, executor=LocalExecutor(1))
        best_shift = table["best"]["point"]["jobs.dp-b.start_offset"]
        report["shift_sweep"] = [{"start_offset_s": r["point"]["jobs.dp-b.start_offset"], "mean_jct_s": r["mean_jct_s"]} for r in table["rows"]]
        shifted = scenario("shifted_oversubscribed", f"dp-b shifted by {best_shift * 1e3:.3f} ms (best of sweep)", over,
                           two_jobs(topo, shift=best_shift), "timeline-shifted.png")
        scenario("priority_oversubscribed", "dp-a in class 0, dp-b in class 1 (strict)", over, two_jobs(topo, priority_b=1))
        scenario("rail_oversubscribed", "both jobs, rail-aligned routing (PXN)", over, w, routing="rail")
        slow = together["dp-a"] / alone_over["dp-a"] - 1
        lines.append(f"On the oversubscribed fabric sharing slows dp-a by {slow * 100:.1f}%; the time shift brings it to "
                     f"{(shifted['dp-a'] / alone_over['dp-a'] - 1) * 100:.1f}% over running alone.")
        report["slowdown_oversubscribed"] = slow
    slow_default = report["scenarios"]["together"]["mean_iteration_s"]["dp-a"] / alone["dp-a"] - 1
    report["slowdown_default"] = slow_default
    lines.append(f"On the non-blocking default fabric the jobs do not interfere (dp-a {slow_default * 100:+.2f}% vs alone).")
    report["wall_s"] = time.perf_counter() - t0
    lines.insert(1, render_table(["scenario"] + [f"{j.name} iteration ms>" for j in w.jobs], rows, indent=2))
    lines.append(f"Timelines: {', '.join(sorted(str(p.name) for p in out.glob('timeline-*.png')))} in {out}")
    return report, "\n".join(lines)


__all__ = ["demo", "two_jobs"]
