"""Emulation benchmark of the flow scheduler (Mininet, needs root): one bandwidth-bound job, and jobs contending.

1. Intra-job (``flowsched_intrajob``): two emulated hosts, one torch (gloo) rank each, an MLP whose
   gradients dominate at the emulated link rate. Median iteration time of default
   DistributedDataParallel (the baseline, same process) vs GradientScheduler with a Prophet plan and
   with a ByteScheduler plan, against the overlap lower bound max(compute, communication), where
   compute = local forward + backward + optimizer step timed in the same rounds and communication =
   gradient bytes / measured all-reduce goodput on the emulated link.
2. Inter-job (``flowsched_contention``): three data-parallel jobs whose rings share the same host
   ports; average JCT under fair sharing (baseline), Sincronia order, Geryon bands (2 classes) and
   Parrot, in the flow-level simulator and in Mininet (DSCP per job, 8-class HTB at every port),
   repeated and interleaved; ratios vs fair sharing and the simulator's agreement with the emulator.

Every emulated network is named with the ``fv`` prefix; rates stay <= 200 Mbit/s. Run:
``sudo .venv/bin/python bench/bench_flowsched_emu.py [--quick] [--only intrajob,contention]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import RESULTS, write_results  # noqa: E402
from flowsched.validate import (  # noqa: E402
    POLICIES,
    IntrajobSetup,
    contention_scenario,
    emulate_policy,
    mean_jct,
    run_intrajob_emulation,
    simulate_policies,
)

METHODS = ("ddp", "prophet", "bytescheduler")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


DEFAULT_BALANCE = 0.6


def _intrajob_name(balance: float, layers: int = IntrajobSetup.layers) -> str:
    name = "flowsched_intrajob" if layers == IntrajobSetup.layers else f"flowsched_intrajob_l{layers}"
    return name if balance == DEFAULT_BALANCE else f"{name}_b{balance:g}"


def intrajob(quick: bool, repeats: int, balance: float = DEFAULT_BALANCE, **setup_options: float) -> None:
    setup = IntrajobSetup(iters=5 if quick else 6, rounds=1 if quick else 3, balance=balance, **setup_options)
    reports = []
    for rep in range(repeats):
        t0 = time.monotonic()
        r = run_intrajob_emulation(setup)
        reports.append(r)
        s = r["summary"]
        print(f"intrajob run {rep}: {time.monotonic() - t0:.0f} s wall; medians "
              + ", ".join(f"{m} {s['median_s'][m]:.3f}" for m in METHODS) + f"; bound {s['lower_bound_s']:.3f}", flush=True)
    report_intrajob(setup, reports)


def report_intrajob(setup: IntrajobSetup, reports: list[dict]) -> None:
    """Rows, notes and the plot from the runs' reports (also used to re-render a saved JSON with --from-json)."""
    repeats = len(reports)
    rows = []
    for rep, r in enumerate(reports):
        s = r["summary"]
        for m in METHODS:
            rows.append({"run": rep, "method": m, "median_iteration_s": s["median_s"][m], "modelled_s": r["modelled_s"][m],
                         "plan_comm_only_s": r.get("comm_only_s", {}).get(m),
                         "speedup_vs_ddp": s["speedup_vs_ddp"][m], "over_bound_pct": 100 * s["over_bound"][m],
                         "lower_bound_s": s["lower_bound_s"], "compute_s": s["compute_s"], "comm_s": s["comm_s"],
                         "cpu_busy": r["fidelity"]["cpu"]["busy_mean"], "link_ok": r["fidelity"]["link_ok"]})
    # pooled: all timed iterations of all runs
    pooled = {m: statistics.median([t for r in reports for t in r["iteration_s"][m]]) for m in (*METHODS, "compute")}
    bound = statistics.median([r["lower_bound_s"] for r in reports])
    for m in METHODS:
        rows.append({"run": "all", "method": m, "median_iteration_s": pooled[m], "modelled_s": None, "plan_comm_only_s": None,
                     "speedup_vs_ddp": pooled["ddp"] / pooled[m],
                     "over_bound_pct": 100 * (pooled[m] / bound - 1), "lower_bound_s": bound, "compute_s": pooled["compute"],
                     "comm_s": statistics.median([r["comm_s"] for r in reports]), "cpu_busy": None,
                     "link_ok": all(r["fidelity"]["link_ok"] for r in reports)})
    first = reports[0]
    probe = first["probe"]
    med = statistics.median
    comm_only = med([r["comm_only_s"]["bytescheduler"] for r in reports])
    comm = med([r["comm_s"] for r in reports])
    mod_bs, mod_ddp = med([r["modelled_s"]["bytescheduler"] for r in reports]), med([r["modelled_s"]["ddp"] for r in reports])
    mod_over, mod_speed = mod_bs / bound - 1, mod_ddp / mod_bs
    excess = pooled["bytescheduler"] - mod_bs
    pooled_speed, pooled_over = pooled["ddp"] / pooled["bytescheduler"], pooled["bytescheduler"] / bound - 1
    best_speed = max(r["summary"]["speedup_vs_ddp"]["bytescheduler"] for r in reports)
    reach = ": with this profile the 1.25x goal is out of reach even without noise" if mod_speed < 1.25 else ""
    status = "met" if pooled_speed >= 1.25 and pooled_over <= 0.15 else "not met"
    runs_met = sum(r["summary"]["speedup_vs_ddp"]["bytescheduler"] >= 1.25 and r["summary"]["over_bound"]["bytescheduler"] <= 0.15
                   for r in reports)
    notes = f"""
Setup: {setup.world} emulated hosts on one switch, {setup.rate_mbit:g} Mbit/s links (HTB, 8-class tree), one gloo rank per host
(GLOO_SOCKET_IFNAME = the host's interface, 1 torch thread), MLP of {setup.layers} x ({setup.width} x {setup.width}) linear layers
({setup.gradient_bytes / 1e6:.2f} MB of gradients); batch scaled by the ranks until compute ~= {setup.balance:g} x communication
(compute time follows the shared machine's load; batch per run: {', '.join(str(r['batch']) for r in reports)});
training threads {setup.compute_nice} nice levels below the communication threads (gloo's workers, the scheduler's thread),
for every method and for the compute-only rounds alike: on a GPU machine compute does not take the cores that drive
the network, here it would (flowsched.torchrun_job);
{setup.rounds} round(s) x {setup.iters} timed iterations per method,
methods interleaved; iteration time = period between iteration starts, max over ranks; {repeats} run(s).
All-reduce goodput measured on the link: {probe['goodput_bytes_per_s'] / 1e6:.2f} MB/s ({probe['bytes'] / 1e6:g} MB all-reduces),
tiny all-reduce {probe['tiny_allreduce_s'] * 1e3:.2f} ms.
Lower bound = max(compute, communication) = max({first['compute_s']:.3f}, {first['comm_s']:.3f}) s
in run 0. `modelled_s` is flowsched.intrajob.simulate_iteration on the profile measured in the job.
The pooled rows ("all") take the median over every timed iteration of every run.
cpu_busy is /proc/stat over the whole shared machine (other engineers' work included), so it does not isolate the emulator;
link_ok = HTB tree intact and iperf3 calibration within 10% before and after.
Where the time goes. `plan_comm_only_s` is the plan's all-reduces issued alone (no compute) the way the scheduler issues
them: {comm_only:.3f} s for the ByteScheduler plan (median over runs) against a communication term of {comm:.3f} s, so the
communication path itself runs at the measured goodput. `modelled_s` (flowsched.intrajob.simulate_iteration on the profile
measured in the job) puts ByteScheduler at {mod_bs:.3f} s, {mod_over:.0%} over the bound, because the first gradient is ready
only part-way into backward and the next forward's first layer needs the last-ready gradient (max(compute, comm) ignores
that dependency), and puts default DDP at {mod_ddp:.3f} s, i.e. a modelled speed-up of {mod_speed:.2f}x{reach}.
The model's distance to the bound shrinks with depth (the first gradient is ready after one layer's backward, the last
forward waits for one layer's all-reduce), which is why this benchmark uses {setup.layers} layers: with 5 layers the same
model gives ByteScheduler 12% over the bound and 1.25x over DDP at compute = 0.6 x comm.
The measured iterations exceed the model by a further
{excess:.3f} s (ByteScheduler): overlapped, the two ranks' compute threads, gloo's threads, the scheduler's communication
thread and the kernel's forwarding share 2 cores (with whatever else runs on the machine; see cpu_busy), so some
iterations' collectives run slower than alone (`comm_log` in the JSON has every iteration's issue and completion times).
Goal (>= 1.25x vs DDP and within 15% of the bound): {status};
pooled {pooled_speed:.2f}x vs DDP and {pooled_over:.1%} over the bound (best run {best_speed:.2f}x);
{runs_met} of {repeats} run(s) meet it on their own.
"""
    name = _intrajob_name(setup.balance, setup.layers)
    write_results(name, rows, title="Bandwidth-bound DP job in Mininet: default DDP vs Prophet vs ByteScheduler plans",
                  notes=notes, extra={"setup": setup.__dict__, "reports": reports})
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    vals = [pooled[m] for m in METHODS]
    ax.bar(["default DDP", "Prophet plan", "ByteScheduler plan"], vals, color=["#999999", "#4477aa", "#228833"])
    ax.axhline(bound, color="k", ls="--", label=f"lower bound max(compute, comm) = {bound:.3f} s")
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.3f} s\n{pooled['ddp'] / v:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("median iteration time (s)")
    ax.set_ylim(0, max(vals) * 1.3)
    ax.set_title(f"{setup.world} hosts, {setup.rate_mbit:g} Mbit/s, {setup.gradient_bytes / 1e6:.1f} MB gradients (gloo, Mininet)", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=120)
    plt.close(fig)


def contention(quick: bool, repeats: int) -> None:
    time_scale, byte_scale = 1000.0, 40.0
    topo, jobs = contention_scenario(3, iterations=3, base_bytes=200e6, compute_s=2e-3)
    sim = simulate_policies(topo, jobs)
    emu: dict[str, list[dict]] = {p: [] for p in POLICIES}
    for rep in range(repeats):
        rotated = POLICIES[rep % len(POLICIES):] + POLICIES[: rep % len(POLICIES)]  # interleave: no policy always runs first
        for policy in rotated:
            t0 = time.monotonic()
            result, fidelity = emulate_policy(topo, jobs, sim[policy]["plan"], time_scale=time_scale, byte_scale=byte_scale)
            emu[policy].append({"mean_jct_s": mean_jct(result), "jct_s": {n: j.jct for n, j in result.jobs.items()},
                                "fidelity_ok": fidelity.get("ok"), "problems": fidelity.get("problems", []),
                                "cpu_busy": fidelity.get("cpu", {}).get("busy_mean"),
                                "calibration": [fidelity.get(k, {}).get("error") for k in ("calibration_before", "calibration_after")]})
            print(f"contention {policy} run {rep}: mean JCT {mean_jct(result) * 1e3:.1f} ms (sim {sim[policy]['mean_jct_s'] * 1e3:.1f}); "
                  f"{time.monotonic() - t0:.0f} s wall; problems {fidelity.get('problems')}", flush=True)
    rows = []
    fair_sim = sim["fair"]["mean_jct_s"]
    fair_emu = statistics.median([r["mean_jct_s"] for r in emu["fair"]])
    for policy in POLICIES:
        e = statistics.median([r["mean_jct_s"] for r in emu[policy]])
        per_job = {n: statistics.median([r["jct_s"][n] for r in emu[policy]]) for n in sim[policy]["jct_s"]}
        rows.append({"policy": policy, "classes": json.dumps(sim[policy]["plan"]["priority"]), "sim_mean_jct_ms": sim[policy]["mean_jct_s"] * 1e3,
                     "emu_mean_jct_ms": e * 1e3, "emu_min_ms": min(r["mean_jct_s"] for r in emu[policy]) * 1e3,
                     "emu_max_ms": max(r["mean_jct_s"] for r in emu[policy]) * 1e3,
                     "sim_vs_fair": fair_sim / sim[policy]["mean_jct_s"], "emu_vs_fair": fair_emu / e,
                     "agreement_pct": (e - sim[policy]["mean_jct_s"]) / sim[policy]["mean_jct_s"] * 100,
                     "job_jct_err_pct": json.dumps({n: round((per_job[n] - s) / s * 100, 1) for n, s in sim[policy]["jct_s"].items()}),
                     "runs_fidelity_ok": sum(bool(r["fidelity_ok"]) for r in emu[policy])})
    notes = f"""
Three data-parallel jobs (ring all-reduce between GPU k of host0 and host1, so every job crosses the same two host ports),
{jobs[0].iterations} iterations each, compute {jobs[0].compute_s * 1e3:g} ms, all-reduce {', '.join(f'{j.nbytes / 1e6:g}' for j in jobs)} MB
on 100 Gb/s NICs; emulated at time scale {time_scale:g} and byte scale {byte_scale:g} (links 100 Mbit/s, times reported at fabric scale).
JCT ratios are fair-sharing mean JCT / policy mean JCT (higher is better); emulated values are medians over {repeats} run(s),
policies interleaved. agreement_pct = (emulated - simulated) / simulated mean JCT.
Parrot on one shared bottleneck: its LP optimum gives the SRPT job everything but the others' floors, so it is enforced as
classes with HTB's 1% guaranteed rate per class (re-decided at predicted job completions, at iteration granularity) and
coincides with Sincronia's order here. runs_fidelity_ok counts runs whose checks (HTB tree, calibration, DSCP probe, class
bytes) passed; the CPU check is reported, not enforced (/proc/stat counts the whole shared machine).
"""
    write_results("flowsched_contention", rows, title="Jobs contending on a bottleneck: fair vs Sincronia vs Geryon vs Parrot (sim and Mininet)",
                  notes=notes, extra={"emulated_runs": emu, "sim_plans": {p: sim[p]["plan"] for p in POLICIES},
                                      "sim_jct_s": {p: sim[p]["jct_s"] for p in POLICIES},
                                      "time_scale": time_scale, "byte_scale": byte_scale})
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    x = range(len(POLICIES))
    simv = [sim[p]["mean_jct_s"] * 1e3 for p in POLICIES]
    emuv = [r["emu_mean_jct_ms"] for r in rows]
    err = [[r["emu_mean_jct_ms"] - r["emu_min_ms"] for r in rows], [r["emu_max_ms"] - r["emu_mean_jct_ms"] for r in rows]]
    ax.bar([i - 0.2 for i in x], simv, 0.4, label="flow-level simulator", color="#4477aa")
    ax.bar([i + 0.2 for i in x], emuv, 0.4, yerr=err, label="Mininet (median, min-max)", color="#ee7733", capsize=3)
    ax.set_xticks(list(x), POLICIES)
    ax.set_ylabel("average JCT (ms, fabric time)")
    ax.set_title("3 jobs sharing host ports: average job completion time", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "flowsched_contention.png", dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default="intrajob,contention")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--balance", type=float, default=DEFAULT_BALANCE, help="intra-job: target compute / communication ratio")
    parser.add_argument("--layers", type=int, default=IntrajobSetup.layers, help="intra-job: MLP depth (512 x 512 layers)")
    parser.add_argument("--rate-mbit", type=float, default=IntrajobSetup.rate_mbit, help="intra-job: emulated link rate")
    parser.add_argument("--compute-nice", type=int, default=IntrajobSetup.compute_nice,
                        help="intra-job: training threads this many nice levels below communication (0: equal)")
    parser.add_argument("--from-json", action="store_true", help="re-render the intra-job results from their saved JSON (no emulation)")
    args = parser.parse_args()
    if args.from_json:
        saved = json.loads((RESULTS / f"{_intrajob_name(args.balance, args.layers)}.json").read_text())
        report_intrajob(IntrajobSetup(**saved["setup"]), saved["reports"])
        return
    if os.geteuid() != 0:
        sys.exit("bench_flowsched_emu needs root (Mininet)")
    parts = args.only.split(",")
    if "intrajob" in parts:
        intrajob(args.quick, args.repeats or (1 if args.quick else 3), args.balance,
                 layers=args.layers, rate_mbit=args.rate_mbit, compute_nice=args.compute_nice)
    if "contention" in parts:
        contention(args.quick, args.repeats or (1 if args.quick else 3))


if __name__ == "__main__":
    main()
