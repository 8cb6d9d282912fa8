"""Placement planner benchmarks: HiveD allocation speed, CASSINI time shifts, trace replay, model accuracy, figures.

Run: ``.venv/bin/python bench/bench_placement.py [--quick]``. Writes ``bench/results/placement_*.{json,md}`` and
``bench/results/placement_jct_*.png``.

Sections
1. HiveD allocate+free on a 4096-GPU cluster (512 DGX H100, rail-optimised), median per call, against a
   first-fit scan of the GPU list in the same process (target: < 1 ms).
2. CASSINI time shifts for 50 concurrent jobs sharing links (target: < 1 s), against the same algorithm with
   one affinity-graph node per link (no link classes).
3. Replay of 10,000 synthetic jobs on 1024 GPUs (target: < 120 s) under HiveD and HiveD + CASSINI; FIFO
   first-fit on a tenth of the trace for its wall time (its scattered placements create many contention sets).
4. Accuracy of the fluid contention model against emu's flow-level simulator on small job sets.
5. Figures: a network-bound job mix (HiveD + CASSINI vs contention-blind FIFO first-fit: average and p99 JCT
   ratios), and a Philly-like mix (fragmentation and queueing, HiveD buddy vs first-fit; LAS for reference).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import topology  # noqa: E402
from bench._common import RESULTS, write_results  # noqa: E402
from placement.cassini import time_shifts  # noqa: E402
from placement.cli import plot_jct  # noqa: E402
from placement.contention import EmuSlowdown, FluidSlowdown, PlacedJob  # noqa: E402
from placement.hived import HivedScheduler  # noqa: E402
from placement.planner import rank_order  # noqa: E402
from placement.profiles import JobSpec, comm_profile  # noqa: E402
from placement.replay import replay  # noqa: E402
from placement.traces import TraceJob, synthetic_trace  # noqa: E402


def bench_alloc() -> None:
    topo = topology.build_cluster(512)
    sched = HivedScheduler(topo, {"a": {"su": 6}, "b": {"su": 4, "host": 16}, "c": {"numa": 64}})
    rnd = random.Random(1)
    for i in range(300):  # background load: a third of the cluster busy with mixed jobs
        sched.allocate(f"bg{i}", rnd.choice([1, 2, 4, 8, 16]), vc=rnd.choice(["a", "b", None]))
    gpus = topo.gpus()
    busy = {g for j in sched.jobs for g in sched.job_gpus(j)}

    def first_fit(n: int) -> None:  # the baseline: scan for idle GPUs, take them, give them back
        free = [g for g in gpus if g not in busy][:n]
        busy.update(free)
        busy.difference_update(free)

    rows = []
    for size, vc in [(1, "c"), (4, None), (8, "a"), (16, "b"), (64, "b"), (256, "a")]:
        times = []
        for _ in range(300):
            t0 = time.perf_counter()
            r = sched.allocate("x", size, vc=vc, priority=1)
            sched.free("x")
            times.append(time.perf_counter() - t0)
            assert r.ok, r.reason
        base = []
        for _ in range(100):
            t0 = time.perf_counter()
            first_fit(size)
            base.append(time.perf_counter() - t0)
        med, bmed = statistics.median(times), statistics.median(base)
        rows.append({"gpus": size, "kind": f"guaranteed (VC {vc})" if vc else "opportunistic", "alloc_free_median_ms": med * 1e3,
                     "first_fit_scan_ms": bmed * 1e3, "ratio_vs_first_fit": med / bmed, "under_1ms": med < 1e-3})
    write_results("placement_alloc", rows, title="HiveD allocate+free on 4096 GPUs (512 DGX H100), median of 300",
                  notes="Background load: 300 mixed jobs. Baseline: a first-fit scan of the 4096-GPU list (no topology), same process.")


def _shared_jobs(topo: topology.Topology, n: int, seed: int = 0) -> dict:
    """``n`` jobs placed by HiveD with sizes that straddle hosts, so that their rail traffic shares NICs and uplinks."""
    sched = HivedScheduler(topo)
    rnd = random.Random(seed)
    profiles = {}
    for i in range(n):
        spec = JobSpec(f"j{i}", rnd.choice([4, 6, 12, 20, 28]), compute_s=rnd.choice([0.03, 0.06]), grad_bytes=rnd.choice([1e9, 3e9]))
        r = sched.allocate(spec.name, spec.gpus)
        if r.ok:
            profiles[spec.name] = comm_profile(topo, spec, rank_order(topo, r.gpus))
    return profiles


def bench_shifts() -> None:
    topo = topology.build_cluster(128)
    profiles = _shared_jobs(topo, 50)
    rows = []
    for label, kw in (("link classes", {}), ("one node per link", {"group_links": False})):
        times, res = [], None
        for _ in range(3):
            t0 = time.perf_counter()
            res = time_shifts(profiles, topo, **kw)
            times.append(time.perf_counter() - t0)
        rows.append({"variant": label, "jobs": len(profiles), "shared_links": len(res.link_scores), "affinity_cycles": res.cycles,
                     "min_score": min(res.link_scores.values(), default=1.0), "median_s": statistics.median(times)})
    for r in rows:
        r["ratio_vs_per_link"] = r["median_s"] / rows[1]["median_s"]
    write_results("placement_shifts", rows, title="CASSINI time shifts for 50 concurrent jobs on 1024 GPUs",
                  notes="Jobs of 4-28 GPUs placed by HiveD so that they straddle hosts and share NICs/uplinks; 360 arcs per circle.")


def bench_replay(quick: bool) -> None:
    topo = topology.build_cluster(128)
    n = 2000 if quick else 10_000
    trace = synthetic_trace(n, seed=3, arrival_rate=1 / 8, mean_duration_s=1200, network_heavy=0.2)
    rows = []
    for policy, jobs in (("hived", trace), ("hived+cassini", trace), ("fifo", trace[: n // 10])):
        t0 = time.perf_counter()
        r = replay(topo, jobs, policy)
        wall = time.perf_counter() - t0
        m = r.metrics
        rows.append({"policy": policy, "jobs": len(jobs), "wall_s": wall, "under_120s": wall < 120 if len(jobs) == 10_000 else "",
                     "avg_jct_s": m["avg_jct_s"], "p99_jct_s": m["p99_jct_s"], "avg_queue_s": m["avg_queue_s"],
                     "utilisation": m["gpu_utilisation"], "events": m["events"],
                     "contention_sets": m.get("slowdown_cache", {}).get("calls", 0),
                     "contention_cache_hits": m.get("slowdown_cache", {}).get("hits", 0)})
    write_results("placement_replay", rows, title=f"Trace replay on 1024 GPUs ({n} synthetic Philly-like jobs)",
                  notes="FIFO first-fit replays a tenth of the trace: its scattered placements create many distinct contention sets, "
                        "each a fluid simulation.")


def bench_accuracy() -> None:
    topo = topology.build_cluster(4, hosts_per_su=2, oversubscription=4)
    g = topo.gpus()
    cases = {
        "2 jobs, cross-SU, in phase": ([("a", g[0:8] + g[16:24]), ("b", g[8:16] + g[24:32])], [0.0, 0.0], 0.02, 1e9),
        "2 jobs, cross-SU, half-period apart": ([("a", g[0:8] + g[16:24]), ("b", g[8:16] + g[24:32])], [0.0, 0.5], 0.02, 1e9),
        "2 jobs sharing a host's NICs": ([("a", g[0:12]), ("b", g[12:24])], [0.0, 0.0], 0.03, 2e9),
    }
    rows = []
    for name, (jobs, phase_frac, compute, grad) in cases.items():
        specs = {n: JobSpec(n, len(gs), compute_s=compute, grad_bytes=grad) for n, gs in jobs}
        profs = {n: comm_profile(topo, specs[n], gs) for n, gs in jobs}
        placed = [PlacedJob(profs[n], f * profs[n].period_s) for (n, _), f in zip(jobs, phase_frac, strict=True)]
        t0 = time.perf_counter()
        fluid = FluidSlowdown(topo)(placed)
        tf = time.perf_counter() - t0
        t0 = time.perf_counter()
        emu = EmuSlowdown(topo, specs, iterations=4)(placed)
        te = time.perf_counter() - t0
        for n in specs:
            rows.append({"case": name, "job": n, "solo_ms": profs[n].period_s * 1e3, "fluid_ms": fluid[n] * 1e3, "emu_ms": emu[n] * 1e3,
                         "rel_error": fluid[n] / emu[n] - 1, "fluid_s": tf, "emu_s": te})
    write_results("placement_accuracy", rows, title="Fluid contention model vs emu's flow-level simulator (mean iteration time)",
                  notes="emu simulates every ring step's point-to-point flows (routed, max-min shared); the fluid model merges a "
                        "collective into one phase of average per-link rates.")


def _network_bound_trace(n: int, seed: int, interarrival: float) -> list[TraceJob]:
    rng = random.Random(seed)
    out, at = [], 0.0
    for i in range(n):
        at += rng.expovariate(1 / interarrival)
        out.append(TraceJob(f"j{i:03d}", round(at, 3), rng.choice([12, 12, 20, 4, 28, 6]), round(rng.uniform(100, 400), 1), 30.0, 3e9))
    return out


class _Pooled:
    """JCTs of several replays of one policy, for one CDF."""

    def __init__(self, results: list) -> None:
        self.results = results

    def jct(self):
        import numpy as np

        return np.concatenate([r.jct() for r in self.results])


def bench_figures(quick: bool) -> None:
    topo = topology.build_cluster(16)
    rows = []
    seeds = (0, 1) if quick else (0, 1, 2)
    pooled: dict[str, list] = {}
    for seed in seeds:
        trace = _network_bound_trace(150, seed, 60.0)
        res = {p: replay(topo, trace, p) for p in ("fifo", "hived", "hived+cassini")}
        base = res["fifo"].metrics
        for p, r in res.items():
            m = r.metrics
            rows.append({"mix": "network-bound", "seed": seed, "policy": p, "avg_jct_s": m["avg_jct_s"], "p99_jct_s": m["p99_jct_s"],
                         "avg_jct_ratio_vs_fifo": base["avg_jct_s"] / m["avg_jct_s"], "p99_jct_ratio_vs_fifo": base["p99_jct_s"] / m["p99_jct_s"],
                         "avg_queue_s": m["avg_queue_s"], "fragmentation": m["fragmentation"], "overloaded_link_s": m["overloaded_link_s"]})
            pooled.setdefault(p, []).append(r)
    plot_jct({p: _Pooled(rs) for p, rs in pooled.items()}, RESULTS / "placement_jct_network.png",
             title=f"network-bound mix, 150 jobs x {len(seeds)} seeds on 128 H100")
    # a Philly-like mix on 256 GPUs: fragmentation and queueing of the buddy allocator vs first-fit
    topo2 = topology.build_cluster(32)
    trace = synthetic_trace(600 if quick else 1200, seed=5, arrival_rate=1 / 35, mean_duration_s=1800)
    res2 = {p: replay(topo2, trace, p) for p in ("fifo", "las", "hived", "hived+cassini")}
    base = res2["fifo"].metrics
    for p, r in res2.items():
        m = r.metrics
        rows.append({"mix": "philly-like", "seed": 5, "policy": p, "avg_jct_s": m["avg_jct_s"], "p99_jct_s": m["p99_jct_s"],
                     "avg_jct_ratio_vs_fifo": base["avg_jct_s"] / m["avg_jct_s"], "p99_jct_ratio_vs_fifo": base["p99_jct_s"] / m["p99_jct_s"],
                     "avg_queue_s": m["avg_queue_s"], "fragmentation": m["fragmentation"], "overloaded_link_s": m["overloaded_link_s"]})
    plot_jct(res2, RESULTS / "placement_jct_philly.png", title=f"Philly-like mix, {len(trace)} jobs on 256 H100")
    write_results("placement_figures", rows, title="Replay figures: network-bound and Philly-like mixes",
                  notes="Ratios are FIFO first-fit (contention-blind) over the policy: > 1 means the policy is faster. "
                        "Network-bound mix: 150 data-parallel jobs of 4-28 GPUs (30 ms compute, 3 GB gradients per iteration), "
                        "Poisson arrivals every 60 s on 16 DGX H100 (rail routing, PXN): jobs that straddle hosts share NICs. "
                        "Slowdowns from the fluid contention model (section 4 compares it with emu). "
                        "Plots: placement_jct_network.png, placement_jct_philly.png.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller replays (2,000 jobs instead of 10,000)")
    ap.add_argument("--only", default=None, help="comma-separated sections: alloc, shifts, replay, accuracy, figures")
    args = ap.parse_args()
    sections = {"alloc": bench_alloc, "shifts": bench_shifts, "replay": lambda: bench_replay(args.quick), "accuracy": bench_accuracy,
                "figures": lambda: bench_figures(args.quick)}
    chosen = args.only.split(",") if args.only else list(sections)
    for name in chosen:
        t0 = time.perf_counter()
        sections[name]()
        print(f"[{name}: {time.perf_counter() - t0:.1f} s]", flush=True)


if __name__ == "__main__":
    main()
