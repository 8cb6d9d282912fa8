"""HiveD allocator benchmarks (issue #20): latency by occupancy with the time split by phase; preemptions and fragmentation.

Run: ``.venv/bin/python bench/bench_placement_hived.py [--quick] [--only latency,preemption]``. Writes
``bench/results/placement_latency.{json,md}`` and ``bench/results/placement_preemption.{json,md}``.

latency
    4096 GPUs (512 DGX H100), three VCs (``a: su x6``, ``b: su x4 + host x16``, ``c: numa x64``). For each occupancy
    target from idle to full, a seeded stream of allocations (Philly-like sizes, :data:`placement.traces.SIZE_MIX`;
    VC a, b, c or opportunistic; priority 0..3) and frees holds the cluster at the target: allocate while below it,
    free a random job while above it. Per operation: wall-clock and thread CPU time (the CPU time leaves out the
    time the process is descheduled, which on a shared machine dominates wall-clock outliers). A second pass of the
    same operations runs with the per-phase timer on (``HivedScheduler.phase_s``): candidate search, safety walk,
    binding, preemption, occupancy bookkeeping, release, other. Baseline in the same run: a first-fit scan of the
    GPU list on the same operations (no cells, no VCs). The static cell trees are frozen out of the garbage
    collector's reach (``gc.freeze()`` after construction), as a long-running scheduler process would.
preemption
    A fixed stream of guaranteed (three VCs, 69 % of the GPUs) and opportunistic jobs on 512 GPUs, run
    event by event (arrivals, completions; one FIFO queue per VC and one for opportunistic jobs; a preempted
    opportunistic job goes back to the head of its queue and keeps its progress). Counts opportunistic
    preemptions and time-averages fragmentation (idle GPUs outside fully idle hosts) and utilisation, for the HiveD
    allocator and for a first-fit allocator with the same quotas counted in GPUs (guaranteed jobs take the first
    idle GPUs and preempt the newest opportunistic jobs when idle GPUs run short).
"""

from __future__ import annotations

import argparse
import gc
import heapq
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import topology  # noqa: E402
from bench._common import write_results  # noqa: E402
from placement.hived import PHASES, HivedScheduler  # noqa: E402
from placement.traces import SIZE_MIX  # noqa: E402

LATENCY_VCS = {"a": {"su": 6}, "b": {"su": 4, "host": 16}, "c": {"numa": 64}}
OCCUPANCIES = (0.0, 0.25, 0.5, 0.75, 0.85, 0.9, 0.95, 1.0)


class FirstFit:
    """The baseline: GPUs in topology order, a job takes the first idle ones; VCs are GPU counts; opportunistic jobs are preempted newest first."""

    def __init__(self, topo: topology.Topology, quotas: dict[str, int] | None = None):
        self.gpus = topo.gpus()
        self.idle = [True] * len(self.gpus)
        self.n_idle = len(self.gpus)
        self.host = [topo.host_of(g) for g in self.gpus]
        self.quotas = dict(quotas or {})
        self.used = dict.fromkeys(self.quotas, 0)
        self.jobs: dict[str, tuple[str | None, list[int]]] = {}

    def allocate(self, job: str, n: int, vc: str | None = None) -> tuple[bool, list[str]]:
        """Place ``job``; returns (ok, the opportunistic jobs it preempted)."""
        if vc is not None and self.used[vc] + n > self.quotas[vc]:
            return False, []
        victims: list[str] = []
        if self.n_idle < n:
            if vc is None:
                return False, []
            for name in reversed([j for j, (v, _) in self.jobs.items() if v is None]):
                if self.n_idle >= n:
                    break
                self.free(name)
                victims.append(name)
            if self.n_idle < n:
                return False, victims
        out = []
        for i, free in enumerate(self.idle):
            if free:
                out.append(i)
                if len(out) == n:
                    break
        for i in out:
            self.idle[i] = False
        self.n_idle -= n
        self.jobs[job] = (vc, out)
        if vc is not None:
            self.used[vc] += n
        return True, victims

    def free(self, job: str) -> None:
        vc, idx = self.jobs.pop(job)
        for i in idx:
            self.idle[i] = True
        self.n_idle += len(idx)
        if vc is not None:
            self.used[vc] -= len(idx)

    def fragmentation(self) -> float:
        per_host: dict[str, list[int]] = {}
        for i, h in enumerate(self.host):
            c = per_host.setdefault(h, [0, 0])
            c[0] += 1
            c[1] += self.idle[i]
        whole = sum(idle for size, idle in per_host.values() if idle == size)
        return 0.0 if self.n_idle == 0 else 1.0 - whole / self.n_idle


def _stream(rnd: random.Random) -> tuple[int, str | None, int]:
    sizes, weights = zip(*SIZE_MIX, strict=True)
    return rnd.choices(sizes, weights)[0], rnd.choice(["a", "b", "c", None]), rnd.randint(0, 3)


def _latency_pass(topo: topology.Topology, target: float, ops: int, seed: int, phases: bool) -> dict:
    sched = HivedScheduler(topo, LATENCY_VCS)
    total = len(topo.gpus())
    rnd = random.Random(seed)
    n = 0
    while (total - sched.idle_gpus()) / total < target and n < 20 * total:  # warm up to the target
        n += 1
        size, vc, prio = _stream(rnd)
        sched.allocate(f"w{n}", size, vc=vc, priority=prio)
    gc.collect()
    gc.freeze()
    if phases:
        sched.phase_s = dict.fromkeys(PHASES, 0.0)
    wall, cpu, kinds, occ = [], [], [], []
    for i in range(ops):
        busy = total - sched.idle_gpus()
        occ.append(busy / total)
        if busy / total < target or not sched.jobs or (target == 0.0 and i % 2 == 0):
            size, vc, prio = _stream(rnd)
            t0, c0 = time.perf_counter(), time.thread_time()
            sched.allocate(f"j{i}", size, vc=vc, priority=prio)
            kinds.append("allocate")
        else:
            victim = rnd.choice(list(sched.jobs))
            t0, c0 = time.perf_counter(), time.thread_time()
            sched.free(victim)
            kinds.append("free")
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    gc.unfreeze()
    return {"wall": np.array(wall), "cpu": np.array(cpu), "kinds": kinds, "occupancy": float(np.mean(occ)), "phases": sched.phase_s}


def _first_fit_pass(topo: topology.Topology, target: float, ops: int, seed: int) -> np.ndarray:
    ff = FirstFit(topo)
    total = len(ff.gpus)
    rnd = random.Random(seed)
    n = 0
    while (total - ff.n_idle) / total < target and n < 20 * total:
        n += 1
        size, _, _ = _stream(rnd)
        ff.allocate(f"w{n}", size)
    times = []
    for i in range(ops):
        busy = total - ff.n_idle
        if busy / total < target or not ff.jobs or (target == 0.0 and i % 2 == 0):
            size, _, _ = _stream(rnd)
            t0 = time.thread_time()
            ff.allocate(f"j{i}", size)
        else:
            victim = rnd.choice(list(ff.jobs))
            t0 = time.thread_time()
            ff.free(victim)
        times.append(time.thread_time() - t0)
    return np.array(times)


def bench_latency(quick: bool) -> None:
    topo = topology.build_cluster(512)
    ops = 2_000 if quick else 12_500
    rows = []
    for k, target in enumerate(OCCUPANCIES):
        res = _latency_pass(topo, target, ops, seed=100 + k, phases=False)
        timed = _latency_pass(topo, target, ops, seed=100 + k, phases=True)
        ff = _first_fit_pass(topo, target, ops, seed=100 + k)
        cpu, wall = res["cpu"] * 1e3, res["wall"] * 1e3
        alloc = np.array([c for c, kind in zip(cpu, res["kinds"], strict=True) if kind == "allocate"])
        per_op_us = {p: t / ops * 1e6 for p, t in timed["phases"].items()}
        row = {"occupancy_target": target, "occupancy_mean": res["occupancy"], "ops": ops, "allocations": len(alloc),
               "cpu_p50_ms": float(np.median(cpu)), "cpu_p99_ms": float(np.percentile(cpu, 99)), "cpu_p999_ms": float(np.percentile(cpu, 99.9)),
               "cpu_max_ms": float(cpu.max()), "alloc_cpu_p99_ms": float(np.percentile(alloc, 99)) if len(alloc) else 0.0,
               "wall_p50_ms": float(np.median(wall)), "wall_p99_ms": float(np.percentile(wall, 99)), "wall_max_ms": float(wall.max()),
               "p99_under_1ms": bool(np.percentile(cpu, 99) < 1.0),
               "first_fit_cpu_p99_ms": float(np.percentile(ff * 1e3, 99)),
               "p99_ratio_vs_first_fit": float(np.percentile(cpu, 99) / np.percentile(ff * 1e3, 99))}
        row.update({f"{p}_us": v for p, v in per_op_us.items()})
        rows.append(row)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    write_results("placement_latency", rows,
                  title=f"HiveD allocate/free latency on 4096 GPUs by occupancy ({ops} operations per level, {ops * len(OCCUPANCIES)} in all)",
                  notes="cpu_*: thread CPU time per operation (allocate or free), ms; wall_*: wall-clock, which on this shared 2-core machine "
                        "also counts the time the process waits to be scheduled. alloc_cpu_p99_ms: allocations only. *_us columns: mean "
                        "time per operation in each phase (a second pass of the same operations with the phase timer on, which adds its "
                        "own overhead): search = candidate search (virtual and occupancy buddy choice), walk = safety walk, bind = binding "
                        "and unbinding, preempt = intra-VC and inter-VC preemption, occupy = marking cells busy, release = freeing a job, "
                        "other = request checks and bookkeeping. Baseline: first-fit scan of the GPU list on the same operations, same run "
                        "(its p99 in CPU time).")


# -- preemptions and fragmentation on a fixed stream -------------------------------------------------------
PREEMPT_VCS = {"a": {"hostx2": 8}, "b": {"host": 12, "numa": 8}, "c": {"numa": 24}}  # 128 + 128 + 96 = 352 of 512 GPUs


def _preempt_stream(n: int, seed: int) -> list[tuple[float, str, int, str | None, float]]:
    rnd = random.Random(seed)
    out, t = [], 0.0
    sizes = {"a": [8, 16, 16, 32], "b": [4, 8, 8, 16], "c": [1, 2, 4, 4, 8], None: [1, 1, 2, 4, 8, 16]}
    for i in range(n):
        t += rnd.expovariate(1 / 11.0)
        vc = rnd.choice(["a", "b", "c", None, None])
        out.append((t, f"j{i:05d}", rnd.choice(sizes[vc]), vc, rnd.lognormvariate(np.log(600.0), 1.0)))
    return out


def _run_stream(stream, alloc, free, frag, gpus: int) -> dict:
    """Event loop: FIFO per VC (and one for opportunistic jobs); a queue's head that does not fit blocks only its queue."""
    events = [(t, 0, name) for t, name, *_ in stream]
    heapq.heapify(events)
    info = {name: (n, vc, dur) for _, name, n, vc, dur in stream}
    remaining = {name: dur for name, (_, _, dur) in info.items()}
    queues: dict[str | None, list[str]] = {}
    running: dict[str, float] = {}  # job -> start time of its current run
    token: dict[str, int] = {}
    stats = {"opportunistic_preemptions": 0, "frag_integral": 0.0, "busy_integral": 0.0, "span": 0.0, "guaranteed_wait": 0.0,
             "opportunistic_wait": 0.0}
    arrived: dict[str, float] = {}
    started: set[str] = set()
    busy, now = 0, 0.0

    def try_queues() -> None:
        nonlocal busy
        progress = True
        while progress:
            progress = False
            for q in sorted(queues, key=lambda q: (q is None, q or "")):  # guaranteed queues first, as HiveD serves higher priorities first
                while queues[q]:
                    name = queues[q][0]
                    n, vc, _ = info[name]
                    ok, victims = alloc(name, n, vc)
                    for v in victims:  # opportunistic victims: stop, keep progress, back to the head of their queue
                        remaining[v] -= now - running.pop(v)
                        busy -= info[v][0]
                        token[v] = token.get(v, 0) + 1
                        queues.setdefault(None, []).insert(0, v)
                        stats["opportunistic_preemptions"] += 1
                    if not ok:
                        break
                    queues[q].pop(0)
                    if name not in started:
                        started.add(name)
                        stats["guaranteed_wait" if vc else "opportunistic_wait"] += now - arrived[name]
                    running[name] = now
                    busy += n
                    token[name] = token.get(name, 0) + 1
                    heapq.heappush(events, (now + remaining[name], 1, f"{name}#{token[name]}"))
                    progress = True

    while events:
        t, kind, name = heapq.heappop(events)
        dt = t - now
        stats["frag_integral"] += frag() * dt
        stats["busy_integral"] += busy * dt
        now = t
        if kind == 0:
            arrived[name] = now
            queues.setdefault(info[name][1], []).append(name)
        else:
            job, _, tok = name.partition("#")
            if job not in running or token[job] != int(tok):
                continue  # a completion event of a run that was preempted
            del running[job]
            busy -= info[job][0]
            free(job)
        try_queues()
    stats["span"] = now
    g = sum(1 for _, _, _, vc, _ in stream if vc)
    return {"opportunistic_preemptions": stats["opportunistic_preemptions"], "fragmentation": stats["frag_integral"] / now,
            "utilisation": stats["busy_integral"] / (now * gpus), "avg_guaranteed_wait_s": stats["guaranteed_wait"] / g,
            "avg_opportunistic_wait_s": stats["opportunistic_wait"] / (len(stream) - g), "jobs": len(stream), "makespan_s": now}


def bench_preemption(quick: bool) -> None:
    topo = topology.build_cluster(64)
    stream = _preempt_stream(1000 if quick else 4000, seed=20)
    sched = HivedScheduler(topo, PREEMPT_VCS)
    trees = sched.trees
    quota_gpus = {vc: sum(trees[c].levels[lv].size * k for c, q in sched.vcs[vc].items() for lv, k in q.quota.items()) for vc in sched.vcs}

    def run_hived(sched: HivedScheduler) -> dict:
        def alloc(name, n, vc):
            r = sched.allocate(name, n, vc=vc)
            return r.ok, list(r.preempted)

        t0 = time.perf_counter()
        out = _run_stream(stream, alloc, sched.free, sched.fragmentation, 512)
        return {**out, "wall_s": time.perf_counter() - t0}

    hived = run_hived(sched)
    hived_order = HivedScheduler(topo, PREEMPT_VCS)
    hived_order.spare_opportunistic = False  # HiveD's own binding order: a free cell of the level first, fewest opportunistic GPUs
    order = run_hived(hived_order)
    kept_out = HivedScheduler(topo, PREEMPT_VCS)
    kept_out.opportunistic_in_bound_cells = False  # opportunistic jobs wait rather than use idle GPUs of bound cells
    outside = run_hived(kept_out)
    ff = FirstFit(topo, quota_gpus)
    t0 = time.perf_counter()
    first = _run_stream(stream, ff.allocate, ff.free, ff.fragmentation, 512)
    first["wall_s"] = time.perf_counter() - t0
    rows = [{"allocator": "hived", **hived}, {"allocator": "hived, HiveD's binding order", **order},
            {"allocator": "hived, opportunistic jobs kept out of bound cells", **outside}, {"allocator": "first-fit (quotas in GPUs)", **first}]
    for r in rows:
        r["preemptions_vs_first_fit"] = r["opportunistic_preemptions"] / max(1, first["opportunistic_preemptions"])
        r["fragmentation_vs_first_fit"] = r["fragmentation"] / first["fragmentation"]
    for r in rows:
        print(r, flush=True)
    write_results("placement_preemption", rows, title=f"Opportunistic preemptions and fragmentation on a fixed stream ({len(stream)} jobs, 512 GPUs)",
                  notes=f"64 DGX H100; VCs {PREEMPT_VCS} ({sum(quota_gpus.values())} of 512 GPUs guaranteed); jobs arrive every 11 s "
                        "on average (Poisson), 3 in 5 guaranteed (VC a: 8-32 GPUs, b: 4-16, c: 1-8), 2 in 5 opportunistic (1-16 GPUs), "
                        "log-normal durations (median 600 s). One FIFO queue per VC and one for opportunistic jobs; preempted "
                        "opportunistic jobs keep their progress and go back to the head of their queue. fragmentation: time-averaged "
                        "share of idle GPUs outside fully idle hosts. *_vs_first_fit: ratio to the first-fit allocator on the same stream. "
                        "HiveD's binding order: spare_opportunistic=False (a free cell of the quota's level before splitting a "
                        "larger clean one). Kept out of bound cells: opportunistic_in_bound_cells=False (HiveD lets them use "
                        "idle GPUs of bound cells; kept out, they wait instead).")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer operations and jobs")
    ap.add_argument("--only", default=None, help="comma-separated sections: latency, preemption")
    args = ap.parse_args()
    sections = {"latency": lambda: bench_latency(args.quick), "preemption": lambda: bench_preemption(args.quick)}
    for name in (args.only.split(",") if args.only else list(sections)):
        t0 = time.perf_counter()
        sections[name]()
        print(f"[{name}: {time.perf_counter() - t0:.1f} s]", flush=True)


if __name__ == "__main__":
    main()
