"""Placement planner benchmarks: HiveD allocation speed, CASSINI time shifts, trace replay, model accuracy, figures.

Run: ``.venv/bin/python bench/bench_placement.py [--quick]``. Writes ``bench/results/placement_*.{json,md}`` and
``bench/results/placement_jct_*.png``.

Sections
1. HiveD allocate+free on a 4096-GPU cluster (512 DGX H100, rail-optimised), median per call, against a
   first-fit scan of the GPU list in the same process (target: < 1 ms).
2. CASSINI time shifts for 50 concurrent jobs sharing links (target: < 1 s), against the same algorithm with
   one affinity-graph node per link (no link classes).
3. Replay of 10,000 synthetic jobs on 1024 GPUs (target: < 120 s) under every policy (FIFO first-fit, LAS, HiveD,
   HiveD + CASSINI), with emu.fluid limited to REPLAY_RADIUS binding-link hops around each change; replay_error:
   the error of that limit against the exact model on the first 1,000 jobs of the same trace.
   Fluid: emu.fluid's event loops (Python, C) against the dense reference on one large group of jobs.
4. Accuracy of the fluid contention model against emu's flow-level simulator on small job sets.
5. Figures: a network-bound job mix (HiveD + CASSINI vs contention-blind FIFO first-fit: average and p99 JCT
   ratios), and a Philly-like mix (fragmentation and queueing, HiveD buddy vs first-fit; LAS for reference).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import topology  # noqa: E402
from bench._common import RESULTS, write_results  # noqa: E402
from emu.fluid import PeriodicJob, binding_links, fluid_engine, simulate_periodic, simulate_periodic_reference  # noqa: E402
from placement.cassini import time_shifts  # noqa: E402
from placement.cli import plot_jct  # noqa: E402
from placement.contention import EmuSlowdown, FluidSlowdown, PlacedJob  # noqa: E402
from placement.hived import HivedScheduler  # noqa: E402
from placement.planner import rank_order  # noqa: E402
from placement.profiles import JobSpec, comm_profile  # noqa: E402
from placement.replay import replay  # noqa: E402
from placement.traces import MODEL_MIX, TraceJob, synthetic_trace  # noqa: E402


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


REPLAY_RADIUS = 1  # binding-link hops re-simulated around a change in the 10,000-job replays (emu.fluid's radius option)


def _replay_trace(n: int) -> list[TraceJob]:
    return synthetic_trace(n, seed=3, arrival_rate=1 / 8, mean_duration_s=1200, network_heavy=0.2)


def _replay_row(policy: str, jobs: list, r, wall: float, sd: FluidSlowdown, model: str) -> dict:
    m = r.metrics
    return {"policy": policy, "jobs": len(jobs), "model": model, "engine": fluid_engine(), "wall_s": wall,
            "under_120s": wall < 120 if len(jobs) == 10_000 else "",
            "avg_jct_s": m["avg_jct_s"], "p99_jct_s": m["p99_jct_s"], "avg_queue_s": m["avg_queue_s"], "utilisation": m["gpu_utilisation"],
            "events": m["events"], "groups_simulated": sd.simulations, "fluid_events": sd.model.events, "group_cache_hits": sd.hits}


def bench_replay(quick: bool, policies: list[str]) -> None:
    """Every policy on the full trace with the radius-limited fluid model (rows of policies not run now are kept from the last run)."""
    topo = topology.build_cluster(128)
    n = 2000 if quick else 10_000
    trace = _replay_trace(n)
    order = ["fifo", "las", "hived", "hived+cassini"]
    old = RESULTS / "placement_replay.json"
    kept = {}
    if old.exists():
        kept = {r["policy"]: r for r in json.loads(old.read_text()).get("rows", []) if r.get("jobs") == n and r["policy"] not in policies}
    rows = []
    for policy in policies:
        sd = FluidSlowdown(topo, radius=REPLAY_RADIUS)
        t0 = time.perf_counter()
        r = replay(topo, trace, policy, slowdown=sd)
        rows.append(_replay_row(policy, trace, r, time.perf_counter() - t0, sd, f"fluid, radius {REPLAY_RADIUS}"))
        print(rows[-1], flush=True)
    rows = sorted([*rows, *kept.values()], key=lambda r: order.index(r["policy"]))
    write_results("placement_replay", rows, title=f"Trace replay on 1024 GPUs ({n} synthetic Philly-like jobs), every policy",
                  notes="Slowdowns from emu.fluid (job-level fluid max-min model on emu's solver, per-link demands as coefficients), "
                        f"re-simulating only the jobs within {REPLAY_RADIUS} binding-link hop(s) of each change "
                        f"(emu.fluid.PeriodicFluidModel radius={REPLAY_RADIUS}); placement_replay_error.md measures the error of that "
                        "limit against the exact model. groups_simulated: fluid simulations run; fluid_events: their events in all.")


class _Shadow:
    """Drives a replay with the radius-limited model and asks the exact model the same questions, to compare answers."""

    def __init__(self, topo: topology.Topology, radius: int) -> None:
        self.approx, self.exact = FluidSlowdown(topo, radius=radius), FluidSlowdown(topo)
        self.errors: list[float] = []
        self.t_approx = self.t_exact = 0.0

    def __call__(self, jobs):
        t0 = time.perf_counter()
        a = self.approx(jobs)
        t1 = time.perf_counter()
        e = self.exact(jobs)
        self.t_approx, self.t_exact = self.t_approx + t1 - t0, self.t_exact + time.perf_counter() - t1
        for j in jobs:  # jobs slowed by contention in either model
            solo = j.profile.period_s
            if max(a[j.name], e[j.name]) > solo * (1 + 1e-9):
                self.errors.append(a[j.name] / e[j.name] - 1)
        return a


def bench_replay_error(quick: bool) -> None:
    """The radius approximation against the exact model: the same questions (shadow) and whole replays (JCTs)."""
    topo = topology.build_cluster(128)
    m = 300 if quick else 1000
    trace = _replay_trace(m)
    rows = []
    for policy in ("fifo", "las", "hived", "hived+cassini"):
        shadow = _Shadow(topo, REPLAY_RADIUS)
        replay(topo, trace, policy, slowdown=shadow)
        err = np.abs(np.array(shadow.errors)) if shadow.errors else np.zeros(1)
        runs = {}
        for label, kw in (("exact", {}), ("radius", {"radius": REPLAY_RADIUS})):
            t0 = time.perf_counter()
            runs[label] = (replay(topo, trace, policy, slowdown=FluidSlowdown(topo, **kw)), time.perf_counter() - t0)
        (ex, t_ex), (ap, t_ap) = runs["exact"], runs["radius"]
        rows.append({"policy": policy, "jobs": m, "contended_answers": len(shadow.errors),
                     "iter_time_err_median": float(np.median(err)), "iter_time_err_p99": float(np.percentile(err, 99)),
                     "iter_time_err_max": float(err.max()), "iter_time_err_mean_signed": float(np.mean(shadow.errors)) if shadow.errors else 0.0,
                     "avg_jct_exact_s": ex.metrics["avg_jct_s"], "avg_jct_err": ap.metrics["avg_jct_s"] / ex.metrics["avg_jct_s"] - 1,
                     "p99_jct_err": ap.metrics["p99_jct_s"] / ex.metrics["p99_jct_s"] - 1,
                     "replay_exact_s": t_ex, "replay_radius_s": t_ap, "speedup": t_ex / t_ap})
        print(rows[-1], flush=True)
    write_results("placement_replay_error", rows, title=f"Radius-{REPLAY_RADIUS} fluid model vs the exact model (first {m} jobs of the replay trace)",
                  notes="iter_time_err_*: the radius-limited model drives the replay and the exact model answers the same calls "
                        "(same running jobs, same phases); relative error of the mean iteration time of every job slowed by contention, "
                        "over all calls (|a/e - 1|; mean_signed keeps the sign: < 0 means the radius model is optimistic). "
                        "avg/p99_jct_err: two separate replays, exact vs radius (schedule differences cascade, so these mix model error "
                        "and its consequences). Wall times of the two replays in the same process.")


def bench_fluid(quick: bool) -> None:
    """emu.fluid on one large group: the event-driven simulation with local re-solves vs the dense reference."""
    rng = random.Random(11)
    links = [f"l{k}" for k in range(120)]
    capacity = dict.fromkeys(links, 50.0)
    rows = []
    for n_jobs in ((20, 40) if quick else (20, 40, 80)):
        jobs = []
        for i in range(n_jobs):
            _, compute_ms, _ = rng.choice(MODEL_MIX)
            comm = compute_ms / 1e3 * rng.uniform(0.1, 1.5)
            # a chain of jobs sharing NIC-like links with their neighbours, as first-fit placements make them
            own = links[(3 * i) % len(links): (3 * i) % len(links) + 4]
            jobs.append(PeriodicJob(f"j{i}", compute_ms / 1e3, comm, {e: rng.uniform(25, 50) for e in own}, rng.uniform(0, 1)))
        t0 = time.perf_counter()
        fast = simulate_periodic(jobs, capacity, engine="python")
        tf = time.perf_counter() - t0
        t0 = time.perf_counter()
        in_c = simulate_periodic(jobs, capacity, engine="c")
        tc = time.perf_counter() - t0
        t0 = time.perf_counter()
        ref = simulate_periodic_reference(jobs, capacity)
        tr = time.perf_counter() - t0
        a, b, c = fast.mean_iteration_s(), ref.mean_iteration_s(), in_c.mean_iteration_s()
        rows.append({"jobs": n_jobs, "binding_links": len(binding_links(jobs, capacity)), "events": fast.events, "solves": fast.solves,
                     "memo_hits": fast.memo_hits, "python_s": tf, "c_s": tc, "reference_s": tr, "python_vs_reference": tr / tf,
                     "c_vs_python": tf / tc, "max_rel_diff": max(abs(a[k] / b[k] - 1) for k in a),
                     "c_max_rel_diff": max(abs(c[k] / a[k] - 1) for k in a)})
    write_results("placement_fluid", rows, title="emu.fluid: event loops (Python with local re-solves, C) vs the dense reference",
                  notes="One group of jobs chained by shared links (4 links each, 2 shared with each neighbour; demands 25-50 of 50 GB/s; "
                        "compute from the trace model mix). Reference: every event re-solves all communicating jobs on all links "
                        "(the placement planner's former job-level simulation, on emu's solver). python: simulate_periodic's Python loop "
                        "(components, memoised rates); c: the same loop in csrc/fluid.c. All run until every job has done 4 iterations. "
                        "max_rel_diff: Python loop vs reference; c_max_rel_diff: C vs Python loop.")


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
                        "Slowdowns from emu.fluid, exact (section 4 compares it with emu.sim). "
                        "Plots: placement_jct_network.png, placement_jct_philly.png.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller replays (2,000 jobs instead of 10,000)")
    ap.add_argument("--only", default=None, help="comma-separated sections: alloc, shifts, replay, replay_error, fluid, accuracy, figures")
    ap.add_argument("--policies", default="fifo,las,hived,hived+cassini", help="policies of the replay section")
    args = ap.parse_args()
    sections = {"alloc": bench_alloc, "shifts": bench_shifts, "replay": lambda: bench_replay(args.quick, args.policies.split(",")),
                "replay_error": lambda: bench_replay_error(args.quick), "fluid": lambda: bench_fluid(args.quick),
                "accuracy": bench_accuracy, "figures": lambda: bench_figures(args.quick)}
    chosen = args.only.split(",") if args.only else list(sections)
    for name in chosen:
        t0 = time.perf_counter()
        sections[name]()
        print(f"[{name}: {time.perf_counter() - t0:.1f} s]", flush=True)


if __name__ == "__main__":
    main()
