"""Benchmark of the Mininet backend: simulator-vs-emulation agreement, gloo all-reduce vs its bound, build cost.

1. Agreement (``emu_agreement``): each workload runs in the flow-level
   simulator (:func:`emu.sim.simulate`) and in Mininet (:func:`emu.mininet_backend.run_mininet`);
   the table gives both mean iteration times, the per-job error and the MAPE,
   with the emulation's fidelity figures (CPU busy, calibration error, DSCP
   capture). The simulator is the baseline of each ratio.
2. Real collectives (``emu_torch``): torch.distributed (gloo) ring all-reduce
   of S bytes on 4 emulated servers against ``2(n-1)/n * S / B``, and a DDP
   training loop's step time.
3. Build cost (``emu_build``): wall time to build, shape and check the
   default cluster (4 DGX H100) per NIC (32 veths, 64 HTB trees) and
   aggregated (4 veths), the aggregate build as the baseline.

Needs root and Mininet (``make sysdeps``). Run: ``sudo .venv/bin/python bench/bench_emu.py [--quick] [--cpu-limit 0.95]``.
On a machine shared with other work, ``--cpu-limit 1.01`` records runs whose CPU check failed instead of aborting them;
the CPU figure is in every row.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import RESULTS, write_results  # noqa: E402
from emu import mixes  # noqa: E402
from emu.mininet_backend import run_mininet, run_torch_job  # noqa: E402
from emu.net import EmulatedNetwork, EmulationError, FidelityError, plan_network, tcp_join_options  # noqa: E402
from emu.results import RunResult, compare_results  # noqa: E402
from emu.sim import simulate  # noqa: E402
from emu.workload import ComputePhase, Job, P2PPhase, Transfer, Workload, example_workload  # noqa: E402
from topology import Topology, default_cluster  # noqa: E402
from topology.fabrics import star  # noqa: E402


def two_jobs(prio_a: int, prio_b: int, compute_b: float, *, iterations: int = 3, bytes_b: float = 2.5e6) -> Workload:
    g = [f"n{i}/gpu0" for i in range(3)]

    def job(name: str, src: str, compute: float, prio: int, nbytes: float) -> Job:
        phases = (ComputePhase("compute", compute), P2PPhase("send", (Transfer(src, g[2], nbytes),), after=("compute",)))
        return Job(name, (src, g[2]), phases, iterations=iterations, priority=prio)

    return Workload(f"two-jobs-p{prio_a}{prio_b}", [job("a", g[0], 5e-5, prio_a, 2.5e6), job("b", g[1], compute_b, prio_b, bytes_b)])


@dataclass
class Case:
    """One agreement case: a workload on a topology, run in the simulator and in Mininet in each of ``modes``.

    ``unshifted``: for a CASSINI case, the same jobs without their time shift, run as well; the rows say whether the simulator
    and the emulation agree on which of the two is faster.
    """

    name: str
    topo: Topology
    workload: Workload
    opts: dict
    modes: tuple[str, ...] = ("per-leaf",)
    unshifted: Workload | None = None


#: Run options of the default-cluster mixes: 400 Gb/s NICs become 25 Mbit/s (K = 16000), bytes / 50, so K/M = 320. The smallest ring step
#: (12.5 MB) is then a 250 kB flow of 80 ms, long enough that the emulator's per-step control latency (1-3 ms: a report to the driver,
#: an order to the agents, a TCP handshake) weighs little, and 20 concurrent flows stay at 0.5 Gbit/s of emulated traffic
#: (docs/validation/emu.md: at K = 8000, M = 100 the dp-sizes mix was CPU-bound on the loaded 2-core machine).
CLUSTER_OPTS = {"time_scale": 16000, "byte_scale": 50}
#: Factor on the time scale of a repeated run (see CPU_SATURATED).
REPEAT_SCALE = 3
BOTH_MODES = ("aggregate", "per-leaf")
MAPE_GOAL = 10.0
#: A run whose CPU was busier than this on average (all processes of the machine) and missed the goal is repeated at REPEAT_SCALE times
#: the time scale (same bytes): a third of the packet rate, so of the emulator's CPU per second, and of the weight of its control latency.
CPU_SATURATED = 0.9


def cassini_shifts(topo: Topology, workload: Workload) -> dict[str, float]:
    """CASSINI's start offsets for the data-parallel jobs of ``workload``: the planner's path (per-job profiles, then time shifts)."""
    from placement.cassini import time_shifts
    from placement.profiles import JobSpec, comm_profile

    profiles = {}
    for job in workload.jobs:
        compute = sum(p.duration for p in job.phases if isinstance(p, ComputePhase))
        grad = sum(p.nbytes for p in job.phases if not isinstance(p, ComputePhase))
        spec = JobSpec(job.name, gpus=len(job.gpus), compute_s=compute, grad_bytes=grad)
        profiles[job.name] = comm_profile(topo, spec, list(job.gpus), policy=job.routing or "rail")
    return dict(time_shifts(profiles, topo).shifts)


def agreement_cases(quick: bool) -> list[Case]:
    k = {"time_scale": 2000}
    cases = [
        Case("ring all-reduce, 4 servers, 1 job", star(4), Workload("dp", [Job.data_parallel("a", [f"n{i}/gpu0" for i in range(4)],
                                                                                           compute_s=5e-5, nbytes=10e6, iterations=3)]), k),
        Case("2 jobs share a downlink, equal class", star(3), two_jobs(0, 0, 1.5e-4), k),
        Case("2 jobs share a downlink, strict priority", star(3), two_jobs(0, 1, 5e-5), k),
    ]
    if quick:
        return cases
    topo = default_cluster()
    shifted = mixes.cassini_pair(cassini_shifts(topo, mixes.cassini_pair()))
    return cases + [
        Case("2 jobs share a downlink, equal class, 1 iteration", star(3), two_jobs(0, 0, 5e-5, iterations=1, bytes_b=5e6), k),
        Case("2 jobs share a downlink, strict priority, low first", star(3), two_jobs(1, 0, 5e-5), k),
        Case("default cluster, example workload (2 DP + pipeline)", topo, example_workload(topo), CLUSTER_OPTS, BOTH_MODES),
        Case("DP jobs of 16, 8, 4 GPUs on shared leaves and spines", topo, mixes.dp_sizes(), CLUSTER_OPTS, BOTH_MODES),
        Case("pipeline x DP job (sends beside all-reduces on one NIC) + DP job", topo, mixes.pipeline_beside_dp(), CLUSTER_OPTS, BOTH_MODES),
        Case("MoE all-to-all (direct, 4 flows per NIC) + DP job", topo, mixes.moe_beside_dp(), CLUSTER_OPTS, BOTH_MODES),
        Case("3 jobs in classes 0/1/2 on one rail (PXN)", topo, mixes.three_classes(), CLUSTER_OPTS, BOTH_MODES),
        Case("CASSINI-shifted pair on one rail", topo, shifted, CLUSTER_OPTS, BOTH_MODES, unshifted=mixes.cassini_pair()),
    ]


def sim_options(case: Case) -> dict[str, float]:
    """The simulator's options for a case: the emulated TCP's join ramp at the case's byte scale (the same for every case and mode)."""
    return tcp_join_options(case.topo, byte_scale=case.opts.get("byte_scale", 1.0))


def _emulate(case: Case, workload: Workload, mode: str, cpu_limit: float, scale: float) -> tuple[RunResult, float]:
    opts = dict(case.opts)
    opts["time_scale"] = opts["time_scale"] * scale
    t0 = time.perf_counter()
    emu = run_mininet(case.topo, workload, nic_mode=mode, cpu_limit=cpu_limit, raise_on_fidelity=False, **opts)
    return emu, time.perf_counter() - t0


def _bottleneck(case: Case, workload: Workload, sim: RunResult, emu: RunResult) -> str:
    """The simulator's busiest NIC direction and its mean utilisation in both runs (from their flow records)."""
    u_sim, u_emu = mixes.nic_utilisation(case.topo, workload, sim), mixes.nic_utilisation(case.topo, workload, emu)
    if not u_sim:
        return "-"
    nic = max(u_sim, key=u_sim.get)
    return f"{nic} {u_sim[nic]:.0%}/{u_emu.get(nic, 0.0):.0%}"


def _rows(case: Case, label: str, mode: str, sim: RunResult, emu: RunResult, wall: float, scale: float, load: float,
          ranking: str, bottleneck: str) -> list[dict]:
    cmp = compare_results(sim, emu)
    fid = emu.meta["fidelity"]
    cal = fid["calibration_before"].get("error")
    status = "ok" if fid["ok"] else "fidelity: " + "; ".join(fid["problems"])[:100]
    goal = "met" if cmp["mape"] <= MAPE_GOAL else "MISS"
    return [{
        "case": label, "nic_mode": mode, "job": r["job"], "sim_iter_ms": r["sim_iteration_s"] * 1e3, "emu_iter_ms": r["mininet_iteration_s"] * 1e3,
        "error_pct": r["error_pct"], "case_mape_pct": cmp["mape"], "goal": goal, "ranking": ranking, "busiest_nic_sim/emu": bottleneck,
        "cpu_busy": fid["cpu"]["busy_mean"], "load_1m": load, "calib_err_pct": None if cal is None else 100 * cal,
        "K": case.opts["time_scale"] * scale, "M": case.opts.get("byte_scale", 1.0), "wall_s": wall, "status": status,
    } for r in cmp["rows"]]


def _means(result: RunResult) -> dict[str, float]:
    return {name: job.mean_iteration_time() for name, job in result.jobs.items()}


def run_case(case: Case, mode: str, cpu_limit: float) -> list[dict]:
    """The rows of one case in one NIC mode; repeated at REPEAT_SCALE times the time scale when a CPU-saturated run missed the goal."""
    variants = [(case.name, case.workload)] + ([(case.name + " (unshifted)", case.unshifted)] if case.unshifted is not None else [])
    sims = {label: simulate(case.topo, w, **sim_options(case)) for label, w in variants}
    scale, rows = 1.0, []
    while True:
        load = os.getloadavg()[0]
        emus = {label: _emulate(case, w, mode, cpu_limit, scale) for label, w in variants}
        shift = ""
        if case.unshifted is not None:
            shifted, plain = (label for label, _w in variants)
            faster_sim = sum(_means(sims[shifted]).values()) < sum(_means(sims[plain]).values())
            faster_emu = sum(_means(emus[shifted][0]).values()) < sum(_means(emus[plain][0]).values())
            shift = f"; shifted faster: sim {'yes' if faster_sim else 'no'}, emu {'yes' if faster_emu else 'no'}"
        batch = []
        for label, w in variants:
            emu, wall = emus[label]
            agree = mixes.ranking_agrees(_means(sims[label]), _means(emu), interchangeable=mixes.interchangeable(w))
            ranking = ("same" if agree else "DIFFERENT") + shift
            batch += _rows(case, label + (f" [repeat, K x{scale:g}]" if scale > 1 else ""), mode, sims[label], emu, wall, scale, load, ranking,
                           _bottleneck(case, w, sims[label], emu))
        rows += batch
        saturated = max(r["cpu_busy"] or 0.0 for r in batch) > CPU_SATURATED
        missed = any(r["goal"] == "MISS" for r in batch)
        if not (saturated and missed) or scale > 1:
            return rows
        scale = REPEAT_SCALE


def run_agreement(quick: bool, cpu_limit: float, only: str | None = None) -> list[dict]:
    rows = []
    for case in agreement_cases(quick):
        if only and only not in case.name:
            continue
        for mode in case.modes:
            try:
                rows += run_case(case, mode, cpu_limit)
            except (FidelityError, EmulationError) as exc:  # stopped early (a qdisc tree changed under the run), or did not finish
                print(f"{case.name}: {exc}", file=sys.stderr)
                rows.append({"case": case.name, "nic_mode": mode, "job": "-", "status": f"stopped: {str(exc)[:120]}"})
            print(f"{case.name} [{mode}]: {rows[-1].get('case_mape_pct')}", file=sys.stderr)
    return rows


_REPEAT = re.compile(r" \[repeat, K x([0-9.]+)\]$")


def _parse_label(label: str) -> tuple[str, str, str]:
    """A row's case label as (case name, variant label without the repeat mark, repeat factor or "")."""
    m = _REPEAT.search(label)
    variant = label[:m.start()] if m else label
    return variant.removesuffix(" (unshifted)"), variant, m.group(1) if m else ""


def resimulate(rows: list[dict]) -> list[dict]:
    """``rows`` of ``emu_agreement`` with the simulator's side recomputed by the current model (:func:`sim_options`); the emulated side kept.

    Rebuilds every row's sim_iter_ms, error, case MAPE, goal, ranking and the simulator's half of the busiest-NIC figure, per
    (case, mode, variant) group of rows, so that a model change is carried into the table without re-emulating.
    """
    cases = {c.name: c for c in agreement_cases(quick=False)}
    out, groups = [], {}
    for r in rows:
        groups.setdefault((r["case"], r["nic_mode"]), []).append(r)
    means: dict[tuple[str, str, str], tuple[dict, dict]] = {}  # (case name, mode, repeat) -> label -> (sim means, emu means)
    for (label, mode), group in groups.items():
        name, base, repeat = _parse_label(label)
        case = cases.get(name)
        if case is None or any(r.get("job") in (None, "-") for r in group):
            out += group
            continue
        workload = case.unshifted if base != name else case.workload
        sim = simulate(case.topo, workload, **sim_options(case))
        sim_ms = {n: j.mean_iteration_time() * 1e3 for n, j in sim.jobs.items()}
        emu_ms = {r["job"]: r["emu_iter_ms"] for r in group}
        errors = {n: 100 * (emu_ms[n] - sim_ms[n]) / sim_ms[n] for n in emu_ms}
        mape = sum(abs(e) for e in errors.values()) / len(errors)
        u_sim = mixes.nic_utilisation(case.topo, workload, sim)
        means.setdefault((name, mode, repeat), {})[base] = (sim_ms, emu_ms)
        for r in group:
            nic, _, figures = r["busiest_nic_sim/emu"].rpartition(" ")  # "node0/nic0 out 67%/75%"
            busiest = f"{nic} {u_sim.get(nic, 0.0):.0%}/{figures.rsplit('/', 1)[-1]}" if nic else r["busiest_nic_sim/emu"]
            ranking = "same" if mixes.ranking_agrees(sim_ms, emu_ms, interchangeable=mixes.interchangeable(workload)) else "DIFFERENT"
            out.append({**r, "sim_iter_ms": sim_ms[r["job"]], "error_pct": errors[r["job"]], "case_mape_pct": mape,
                        "goal": "met" if mape <= MAPE_GOAL else "MISS", "ranking": ranking, "busiest_nic_sim/emu": busiest})
    # the shifted-vs-unshifted verdict of the CASSINI rows, from the recomputed means
    for r in out:
        name, _base, repeat = _parse_label(r["case"])
        pair = means.get((name, r["nic_mode"], repeat), {})
        if len(pair) == 2 and name in pair:
            (s_sh, e_sh), (s_un, e_un) = pair[name], pair[name + " (unshifted)"]
            faster_sim, faster_emu = sum(s_sh.values()) < sum(s_un.values()), sum(e_sh.values()) < sum(e_un.values())
            r["ranking"] += f"; shifted faster: sim {'yes' if faster_sim else 'no'}, emu {'yes' if faster_emu else 'no'}"
    return out


def run_torch(quick: bool, cpu_limit: float) -> list[dict]:
    rows = []
    sizes = [8e6] if quick else [4e6, 8e6, 16e6]
    for nbytes in sizes:
        try:
            r = run_torch_job(star(4), "allreduce", time_scale=2000, nbytes=nbytes, iterations=3, warmup=1, cpu_limit=cpu_limit)
        except FidelityError as exc:
            rows.append({"job": f"gloo all-reduce {nbytes / 1e6:g} MB", "status": f"fidelity failed: {exc.report.get('problems')}"})
            continue
        mean = sum(r["iteration_s_emulated"]) / len(r["iteration_s_emulated"])
        rows.append({"job": f"gloo all-reduce {nbytes / 1e6:g} MB", "ranks": r["world"], "link_mbit": r["link_mbit_emulated"],
                     "bound_s": r["bound_s_emulated"], "measured_s": mean, "measured/bound": r["ratio_to_bound"],
                     "busbw_real_gbs": r["busbw_gbs"], "link_real_gbs": r["link_gbs"], "cpu_busy": r["fidelity"]["cpu"]["busy_mean"],
                     "status": "ok" if r["correct"] else "WRONG SUM"})
    if not quick:
        try:
            r = run_torch_job(star(4), "ddp", time_scale=2000, iterations=5, warmup=1, width=512, cpu_limit=cpu_limit)
            grad = r["report"]["grad_bytes"]
            bound = 2 * 3 / 4 * grad / (r["link_mbit_emulated"] * 1e6 / 8)
            mean = sum(r["iteration_s_emulated"]) / len(r["iteration_s_emulated"])
            losses = r["report"]["loss"]
            rows.append({"job": f"DDP MLP ({grad / 1e6:.2f} MB grads)", "ranks": r["world"], "link_mbit": r["link_mbit_emulated"],
                         "bound_s": bound, "measured_s": mean, "measured/bound": mean / bound, "cpu_busy": r["fidelity"]["cpu"]["busy_mean"],
                         "status": f"ok, loss {losses[0]:.3g} -> {losses[-1]:.3g}"})
        except FidelityError as exc:
            rows.append({"job": "DDP MLP", "status": f"fidelity failed: {exc.report.get('problems')}"})
    return rows


def run_build() -> list[dict]:
    rows = []
    base = None
    for mode, k in (("aggregate", 8000), ("per-leaf", 1000)):
        plan = plan_network(default_cluster(), time_scale=k, nic_mode=mode)
        t0 = time.perf_counter()
        with EmulatedNetwork(plan) as net:
            t1 = time.perf_counter()
            net.verify_htb()
            t2 = time.perf_counter()
        t3 = time.perf_counter()
        t0 += net.lock_wait_s  # another emulation may have held the machine
        total = t3 - t0
        base = base or total
        rows.append({"nic_mode": mode, "interfaces": len(plan.interfaces), "htb_trees": len(plan.htb_specs()), "build_s": t1 - t0,
                     "verify_s": t2 - t1, "teardown_s": t3 - t2, "total_s": total, "total/aggregate": total / base})
    return rows


def merge_partial(rows: list[dict], partial: list[dict]) -> list[dict]:
    """``rows`` with the rows of every case that ``partial`` (a ``--case`` run) measured replaced by its rows, in place of the old ones."""
    redone = {_parse_label(r["case"])[0] for r in partial}
    out, placed = [], False
    for r in rows:
        if _parse_label(r["case"])[0] in redone:
            if not placed:
                out += partial
                placed = True
            continue
        out.append(r)
    return out if placed else out + partial


def agreement_notes(load: str, note_cpu: str) -> str:
    return ("Emulated times are divided by K/M (time scale / byte scale) into workload seconds. Star cases: 200 Gb/s NICs "
            "at K=2000 (100 Mbit/s emulated). Default cluster (4 DGX H100, 400 Gb/s rails): K=16000 (25 Mbit/s per NIC), "
            "M=50, in both NIC modes (aggregate: one veth per server with an HTB subtree per NIC; per-leaf: one veth per "
            "rail). The simulator models the emulated TCP's convergence (emu.net.tcp_join_options: a flow joining a busy NIC "
            "runs at weight 0.17 for two drain times of its HTB queue, 0.58 ms of workload time at M=50), the same for every case. "
            "error_pct = (emu - sim) / sim; case_mape_pct = mean |error| over the case's jobs (goal <= 10 %); "
            "ranking: does the simulator order the jobs (and shifted vs unshifted) as the emulation does (jobs within 2 % "
            "in the simulator may go either way, and so may interchangeable jobs: the same job on as many GPUs, started together); "
            "busiest_nic: the simulator's most utilised NIC direction and its mean utilisation "
            "over the run in both backends (from their flow records). "
            "cpu_busy is the whole machine's (other users included) during the run; "
            f"load_1m the 1-minute load average at its start (at the end of the benchmark: {load}). A run that missed the goal with "
            f"cpu_busy > {CPU_SATURATED} is repeated at {REPEAT_SCALE}K (a third of the packet rate, three times the duration) and marked "
            f"[repeat, K x{REPEAT_SCALE}]. " + note_cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer cases")
    parser.add_argument("--cpu-limit", type=float, default=0.95, help="CPU busy fraction above which a run fails its fidelity check")
    parser.add_argument("--only", choices=("agreement", "torch", "build"))
    parser.add_argument("--case", help="agreement: run only the cases whose name contains this text (results go to emu_agreement_partial)")
    parser.add_argument("--resim", action="store_true",
                        help="no emulation: recompute the simulator's side of emu_agreement with the current model (needs no root)")
    parser.add_argument("--merge-partial", action="store_true", help="with --resim: first replace the rows of the cases in emu_agreement_partial")
    args = parser.parse_args()
    note_cpu = (f"Runs used cpu_limit={args.cpu_limit}: " + ("the CPU check was relaxed because the 2-core machine was shared with other "
                "work; cpu_busy shows how saturated it was." if args.cpu_limit > 1 else "a saturated CPU fails the run."))
    title = "Simulator vs Mininet emulation: mean iteration time per job, single patterns and multi-job mixes"
    if args.resim:
        kept = json.loads((RESULTS / "emu_agreement.json").read_text())
        rows = kept["rows"]
        if args.merge_partial:
            rows = merge_partial(rows, json.loads((RESULTS / "emu_agreement_partial.json").read_text())["rows"])
        md = (RESULTS / "emu_agreement.md").read_text()
        load = re.search(r"at the end of the benchmark: ([0-9. ]+)\)", md)
        cpu = re.search(r"(Runs used cpu_limit=.*)$", md.strip())
        write_results("emu_agreement", resimulate(rows), title=title,
                      notes=agreement_notes(load.group(1) if load else "not recorded", cpu.group(1) if cpu else note_cpu))
        return
    if os.geteuid() != 0:
        print("bench_emu needs root (Mininet); nothing measured", file=sys.stderr)
        raise SystemExit(2)
    if args.only in (None, "build"):
        write_results("emu_build", run_build(), title="Mininet build + HTB + check of the default cluster (4 DGX H100)",
                      notes="per-leaf = one veth per NIC (8 rails), aggregate = one veth per server; both directions shaped.")
    if args.only in (None, "agreement"):
        rows = run_agreement(args.quick, args.cpu_limit, args.case)
        load = os.getloadavg()
        write_results("emu_agreement" + ("_partial" if args.case else ""), rows, title=title,
                      notes=agreement_notes(f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", note_cpu))
    if args.only in (None, "torch"):
        write_results("emu_torch", run_torch(args.quick, args.cpu_limit), title="torch.distributed (gloo) in Mininet vs the bandwidth bound",
                      notes="bound = 2(n-1)/n * S / B with B the emulated link payload rate; busbw in real-fabric GB/s (x K). " + note_cpu)


if __name__ == "__main__":
    main()
