"""Benchmark: CASSINI's time shift with real traffic (Mininet) against the flow-level simulator.

Two data-parallel jobs share one NIC cable (:func:`placement.validate.two_job_scenario`:
three servers on one leaf, 100 Gb/s NICs emulated at 100 Mbit/s, K = 1000, bytes / 100).
For each scenario and each shift of the second job (none, a quarter and a half of an
iteration, CASSINI's), the jobs' mean iteration time (warm-up skipped, only while both
run) is measured in the simulator and in Mininet (median of ``--repeats`` runs); the gain
of a shift is the unshifted time over the shifted one, measured against the unshifted
run of the same backend in the same process. The simulated gain is also checked against
the closed-form fluid iteration time, and CASSINI's own first-order estimate is listed.

Scenarios: ``compute = comm`` (50 ms compute, 625 MB; CASSINI's shift is half an iteration,
no slack) and ``compute > comm`` (60 ms, 500 MB; any shift between 40 and 60 ms removes the
overlap, CASSINI takes the first rotation that does).

Run (root, Mininet): ``sudo .venv/bin/python bench/bench_placement_emu.py [--repeats 3] [--quick]``.
Without root only the simulator runs and the rows go to ``placement_emu_sim``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import write_results  # noqa: E402
from placement.validate import format_report, two_job_scenario, validate_shift  # noqa: E402

SCENARIOS = {
    "compute=comm": {"compute_s": 0.05, "grad_bytes": 625e6},
    "compute>comm": {"compute_s": 0.06, "grad_bytes": 500e6},
}


def rows_of(label: str, report: dict, backends: list[str]) -> list[dict]:
    rows = []
    for name, cases in report["cases"].items():
        shift = max(report["settings"][name].values(), default=0.0)
        row = {"scenario": label, "setting": name, "shift_ms": shift * 1e3,
               "closed_form_ms": report["closed_form"].get(name, float("nan")) * 1e3,
               "cassini_estimate_ms": statistics.fmean(report["predicted"][name].values()) * 1e3}
        for b in backends:
            row[f"{b}_iter_ms"] = cases[b]["mean_s"] * 1e3
            row[f"{b}_gain"] = report["gains"][name][b]["gain"] if name in report["gains"] else 1.0
        if "mininet" in backends:
            runs = cases["mininet"]["runs"]
            row["mininet_runs_ms"] = ", ".join(f"{statistics.fmean(r['mean_iteration_s'].values()) * 1e3:.1f}" for r in runs)
            a = (report.get("agreement") or {}).get(name)
            row["rel_diff"] = a["relative_difference"] if a else 0.0
            row["agrees"] = a["agrees"] if a else "-"
            row["fidelity_ok"] = cases["mininet"]["fidelity_ok"]
            busy = [r["fidelity"]["cpu_busy_mean"] for r in runs if r["fidelity"]["cpu_busy_mean"] is not None]
            row["cpu_busy_max"] = max(busy) if busy else float("nan")
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="Mininet runs per case (median); default 3")
    parser.add_argument("--iterations", type=int, default=6, help="iterations per job; default 6 (1 warm-up)")
    parser.add_argument("--quick", action="store_true", help="one scenario, one repeat")
    args = parser.parse_args()
    root = os.geteuid() == 0
    backends = ["sim", "mininet"] if root else ["sim"]
    if not root:
        print("not root: Mininet cannot run here; simulator only (results in placement_emu_sim)")
    scenarios = dict(list(SCENARIOS.items())[:1]) if args.quick else SCENARIOS
    repeats = 1 if args.quick else args.repeats
    rows, reports = [], {}
    t0 = time.perf_counter()
    for label, params in scenarios.items():
        s = two_job_scenario(iterations=args.iterations, **params)
        fractions = [0.25] if label == "compute=comm" else [0.25, 0.5]
        # CPU check off: /proc/stat counts every process on this shared machine; the busy fraction is still reported per row
        report = validate_shift(s, fractions=fractions, backends=backends, repeats=repeats, mininet_options={"cpu_limit": 1.01})
        print(format_report(report))
        reports[label] = report
        rows += rows_of(label, report, backends)
    wall = time.perf_counter() - t0
    agree = [r["agrees"] for r in rows if r.get("agrees") in (True, False)]
    notes = f"""
Gain = mean iteration time unshifted / shifted, per backend (> 1: the shift helps). `rel_diff` = |gain_mininet - gain_sim| / gain_sim;
`agrees`: same direction and rel_diff <= 15%. Mininet: median of {repeats} run(s) (`mininet_runs_ms` lists each run's mean over both jobs);
`cpu_busy_max`: the highest whole-machine busy fraction during a run (other work included; the CPU check is off, the calibration flows
before and after each run are on and `fidelity_ok` includes them). `closed_form_ms`: C + M + max(0, M - circular distance of the shift)
for two identical jobs on one fairly shared link. `cassini_estimate_ms`: CASSINI's first-order fluid estimate (placement.cassini).
{sum(agree)}/{len(agree)} shifted settings agree. Wall time {wall:.0f} s (includes waiting for other emulations' lock).
"""
    extra = {"reports": {k: {kk: v[kk] for kk in ("scenario", "cassini", "settings", "gains", "predicted", "closed_form", "agreement")
                             if kk in v} for k, v in reports.items()}, "repeats": repeats, "wall_s": wall}
    write_results("placement_emu" if root else "placement_emu_sim", rows,
                  title="CASSINI time shift: Mininet (real TCP) vs flow-level simulator, two jobs on one bottleneck", notes=notes, extra=extra)


if __name__ == "__main__":
    main()
