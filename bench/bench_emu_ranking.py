"""Benchmark: do the planners' candidate rankings hold in real runs? Kendall's tau between predicted and measured order.

1. Placement (:func:`placement.ranking.run_ranking`): the contended mix of
   :func:`placement.ranking.contended_mix` (10 two-GPU servers on 5 leaves, a
   running data-parallel job per leaf), the planner's candidates for a new
   2-GPU job ranked by CASSINI's score, each candidate's whole mix run in
   Mininet (real TCP, HTB-shaped 100 Mbit/s links, K = 1000, bytes / 100) and
   in the flow-level simulator; tau of the planner's score, CASSINI's
   iteration estimate and the simulator against the new job's measured
   iteration time (Mininet, median of ``--repeats``), and of the simulated
   against the measured mean over all jobs.
2. Pipeline (:func:`pipesched.ranking.schedule_ranking`): a tail-heavy MLP
   (12 blocks, the last 4 eight times wider) on as many gloo ranks as the
   machine has cores (2 here: more processes than cores measure the OS
   scheduler, not the plans), calibrated and profiled on that configuration.
   The planner's candidate list: every exportable family (1F1B, ZB-H1, GPipe,
   interleaved 1F1B) on its own partition and on the equal-layer split (ZB-H1,
   GPipe, 1F1B; interleaving an equal 2-stage split is 1F1B again), and the equal
   split run by torch's Schedule1F1B. Rule for which run, fixed before any run
   (``pipesched.ranking.choose_candidates``): sorted by predicted step (ties:
   fewer micro-batches in flight), the first, then each next one predicted at
   least G = 10 % slower than the last kept (G: the model's error on single
   plans, ``bench/results/pipesched_cpu_validation.md``), at most 6; while that
   keeps fewer than 4, the pool grows by the planner's runner-up plans (the
   other partitions its search tries per family: second-best of each family,
   then third-best, ...).
   Those run in the same processes, one step of each in turn, order reversed
   every pass, ``--rounds`` blocks of 6 passes; measured = median of the blocks'
   median steps, spread = (max - min) / median over the blocks, and per pair
   the ratio of its block medians (blocks that disagree on the order: within
   noise). Tau of the predicted against the measured step: the planner's
   prediction from the profile (a core per rank), and the same plans costed
   from each rank's actions replayed alone before the timed steps.

Predicted values within 2 % count as one tie class (``emu.ranking``). Needs root
and Mininet for part 1 (without, the placement rows are the simulator's only).
Run: ``sudo .venv/bin/python bench/bench_emu_ranking.py [--quick] [--only placement|pipeline]``;
``--quick`` should take about 5 minutes on a quiet 2-core machine (an estimate from the parts' run counts: on the
loaded machine, load average 10-20, placement with 3 repeats took 25 minutes); the pipeline part takes about 3 minutes.
``--render`` writes the .md again from the stored .json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import RESULTS, machine, markdown_table, write_results  # noqa: E402

GOAL_TAU = 0.8


def summary_row(experiment: str, predicted_by: str, measured: str, agreement: dict) -> dict:
    tau = agreement["tau"]
    return {"experiment": experiment, "predicted_by": predicted_by, "measured": measured, "n": agreement["n"], "tau": tau,
            "tau_untied": agreement["tau_untied"], "concordant": agreement["concordant"], "discordant": agreement["discordant"],
            "tied_predicted": agreement["tied_predicted"], "goal_met": bool(not math.isnan(tau) and tau >= GOAL_TAU)}


def bench_placement(quick: bool, repeats: int) -> tuple[list[dict], list[dict], dict]:
    from placement.ranking import contended_mix, run_ranking

    emulate = os.geteuid() == 0
    mix = contended_mix(leaves=5, iterations=6 if quick else 8, warmup=2)
    t0 = time.perf_counter()
    # CPU check off: /proc/stat counts every process on this shared machine; the busy fraction is reported per row
    rep = run_ranking(mix, candidates=6, repeats=repeats if emulate else 1, emulate=emulate, mininet_options={"cpu_limit": 1.01})
    wall = time.perf_counter() - t0
    cands = []
    for c in rep["candidates"]:
        row = {"rank": c["rank"], "gpus": " ".join(c["gpus"]), "shift_ms": c["shift_s"] * 1e3, "compat": c["compat"],
               "planner_cost_ms": c["planner_cost"] * 1e3, "cassini_iter_ms": c["cassini_iter_s"] * 1e3, "sim_iter_ms": c["sim_iter_s"] * 1e3}
        if emulate:
            row |= {"emu_iter_ms": c["emu_iter_s"] * 1e3, "emu_runs_ms": ", ".join(f"{x * 1e3:.1f}" for x in c["emu_iter_runs_s"]),
                    "emu_spread": c["emu_iter_spread"],
                    "emu/sim": c["emu_iter_s"] / c["sim_iter_s"], "sim_mix_ms": c["sim_mix_mean_s"] * 1e3, "emu_mix_ms": c["emu_mix_mean_s"] * 1e3,
                    "cpu_busy_max": c["cpu_busy_max"], "fidelity_ok": c["fidelity_ok"]}
        cands.append(row)
    target = "new job's iteration, Mininet" if emulate else "new job's iteration, simulator (no root: no Mininet)"
    names = {"planner_cost": "planner (CASSINI score)", "cassini_iter_s": "CASSINI iteration estimate", "sim_iter_s": "flow-level simulator",
             "sim_mix_mean_s": "simulator, mean of all jobs"}
    exp = f"placement, contended mix, {len(cands)} candidates"
    rows = []
    for key, a in rep["agreement"].items():
        pred, meas = key.split(" vs ")
        if pred == meas:
            continue
        rows.append(summary_row(exp, names[pred], "mean of all jobs, Mininet" if pred == "sim_mix_mean_s" else target, a))
    extra = {"mix": rep["mix"], "candidates": rep["candidates"], "agreement": rep["agreement"], "wall_s": wall,
             "pairs_within_noise": rep.get("pairs_within_noise", [])}
    return rows, cands, extra


def bench_pipeline(quick: bool, rounds: int) -> tuple[list[dict], list[dict], dict]:
    from bench.bench_pipesched import wait_for_quiet
    from pipesched.models import tail_heavy_widths
    from pipesched.ranking import schedule_ranking

    foreign, waited = wait_for_quiet(0.15, 30.0 if quick else 120.0)   # other users' load before the runs (cores), and how long we waited
    load_before = os.getloadavg()
    ranks = max(2, os.cpu_count() or 2)
    t0 = time.perf_counter()
    rep = schedule_ranking(tail_heavy_widths(12, 384, 3072), dim=384, batch=384, microbatches=8, stages=ranks, blocks=rounds,
                           steps=3 if quick else 6, warmup=1)
    wall = time.perf_counter() - t0
    load_after = os.getloadavg()

    def ms(values: list[float]) -> str:
        return ", ".join(f"{v * 1e3:.0f}" for v in values)

    cands = [{"candidate": c["name"], "spans": c["spans"], "in_flight": c["in_flight"], "predicted_ms": c["predicted_s"] * 1e3,
              "replay_ms": c.get("predicted_replay_s", math.nan) * 1e3, "shared_ms": c.get("predicted_calibrated_share_s", math.nan) * 1e3,
              "measured_ms": c["measured_s"] * 1e3, "blocks_ms": ms(c["runs_s"]),
              "spread": c["spread"], "error": c["error"], "busy_pred_ms": ms(c["predicted_busy_s"]), "compute_ms": ms(c["compute_s"]),
              "idle_pred_ms": ms(c["predicted_idle_s"]), "idle_ms": ms(c["idle_s"]), "wait_ms": ms(c["wait_s"])} for c in rep["candidates"]]
    rows = [summary_row(f"pipeline, {ranks} gloo ranks, {len(cands)} candidates", "planner (simulated step)",
                        f"median step, interleaved, {rounds} blocks", rep["agreement"])]
    for key, label in (("replay", "planner's simulator, actions replayed alone before the steps (replay_ms)"),
                       ("calibrated_share", "diagnostic: the calibrated CPU share (shared_ms)")):
        if key in rep["agreement"]:
            rows.append(summary_row(rows[0]["experiment"], label, rows[0]["measured"], rep["agreement"][key]))
    extra = {k: rep[k] for k in ("model", "candidates", "agreement", "noise", "planned")} | {
        "setup": rep["setup"], "wall_s": wall, "foreign_cores_before": foreign, "quiet_wait_s": waited, "ranks": ranks,
        "loadavg_before": list(load_before), "loadavg_after": list(load_after)}
    return rows, cands, extra


def section_notes(name: str, ex: dict) -> str:
    """The candidate table of one section, from its stored results."""
    if name == "placement":
        head = f"## Placement candidates ({ex['date']}, {ex['wall_s']:.0f} s)\n\n{markdown_table(ex['table'])}\n"
        if "pairs_within_noise" not in ex:   # results of a run before the spread was reported
            return head
        noisy = ex["pairs_within_noise"]
        return (f"{head}{len(noisy)} pair(s) of candidates (by rank) measured closer than their spread over runs (`emu_spread`, within "
                f"the machine's noise): {', '.join(f'{a} / {b}' for a, b in noisy) or 'none'}.\n")
    noisy = ex["noise"]["pairs_within_spread"]
    planned = ""
    if "planned" in ex:
        table = [{"candidate": c["name"], "predicted_ms": c["predicted_s"] * 1e3, "in_flight": c["in_flight"], "spans": c["spans"],
                  "ran": c["ran"]} for c in ex["planned"]]
        rule = f"G = {ex['model'].get('gap', 0.05):.0%}, runner-ups per family: {ex['model'].get('runner_up_depth', 0)}"
        planned = (f"\nThe pool of candidates (predicted before any run; `ran`: kept by the rule, {rule}):\n\n"
                   f"{markdown_table(table)}\n")
    gaps = sorted(c["predicted_ms"] for c in ex["table"])
    min_gap = min((b / a - 1 for a, b in zip(gaps, gaps[1:], strict=False)), default=math.nan)
    paired = ""
    if "paired" in ex["noise"]:
        pn = ex["noise"]["paired"]
        paired = (f" Paired within blocks (the candidates of a block share the machine's state): the ratio of a pair's block medians "
                  f"spreads {pn['median_ratio_spread']:.1%} (median over pairs, largest {max(p['ratio_spread'] for p in pn['pairs']):.1%}); "
                  f"{len(pn['unresolved'])} pair(s) whose blocks disagree on the order: "
                  f"{', '.join(f'{a} / {b}' for a, b in pn['unresolved']) or 'none'}.")
    load = ""
    if "loadavg_before" in ex:
        model = ex["model"]
        load = (f"; 1-minute load average {ex['loadavg_before'][0]:.2f} before, {ex['loadavg_after'][0]:.2f} after; torch intra-op threads: "
                f"profile {model['threads_profile']}, ranks {model['threads_ranks']}; freed memory retained in the ranks: "
                f"{model['retain_freed_memory']}")
    return (f"## Pipeline candidates ({ex['date']}, {ex['wall_s']:.0f} s; other users' load before the runs {ex['foreign_cores_before']:.2f} "
            f"cores, during the runs {ex['noise'].get('foreign_cores', math.nan):.2f}{load})\n\n{markdown_table(ex['table'])}\n"
            f"Median spread over blocks {ex['noise']['median_spread']:.1%}, largest {max(c['spread'] for c in ex['table']):.1%}; smallest gap "
            f"between predicted steps {min_gap:.1%}; {len(noisy)} pair(s) measured closer than their spread over blocks: "
            f"{', '.join(f'{a} / {b}' for a, b in noisy) or 'none'}.{paired}\n{planned}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one Mininet run per candidate, two pipeline rounds of 3 steps")
    parser.add_argument("--only", choices=("placement", "pipeline"), help="run one part; the other part's rows are kept from the last results")
    parser.add_argument("--repeats", type=int, default=3, help="Mininet runs per placement candidate (median); default 3, 1 with --quick")
    parser.add_argument("--rounds", type=int, default=4, help="pipeline blocks of interleaved steps (median of blocks); default 4, 2 with --quick")
    parser.add_argument("--render", action="store_true", help="measure nothing: write the .md again from the stored .json")
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    rounds = 2 if args.quick else args.rounds
    root = os.geteuid() == 0
    name = "emu_ranking" if root or args.only == "pipeline" else "emu_ranking_sim"
    sections: dict[str, tuple[list[dict], dict]] = {}
    if args.only is not None or args.render:   # keep the other part of the last results (every part with --render)
        try:
            old = json.loads((RESULTS / f"{name}.json").read_text())
        except (OSError, ValueError):
            old = {}
        for part in ("placement", "pipeline"):
            if (part != args.only or args.render) and part in old:
                sections[part] = ([r for r in old["rows"] if r["experiment"].startswith(part)], old[part])
    if args.render:
        write(name, sections)
        return
    today = machine()["date"]
    if args.only in (None, "placement"):
        r, cands, ex = bench_placement(args.quick, repeats)
        sections["placement"] = (r, ex | {"table": cands, "date": today, "quick": args.quick})
    if args.only in (None, "pipeline"):
        r, cands, ex = bench_pipeline(args.quick, rounds)
        sections["pipeline"] = (r, ex | {"table": cands, "date": today, "quick": args.quick})
    write(name, sections)


def write(name: str, sections: dict[str, tuple[list[dict], dict]]) -> None:
    """Write ``<name>.json`` and ``.md`` from the parts' summary rows and stored results."""
    rows = [row for part in ("placement", "pipeline") if part in sections for row in sections[part][0]]
    extra = {part: sections[part][1] for part in ("placement", "pipeline") if part in sections}
    notes = [section_notes(part, ex) for part, ex in extra.items()]
    notes.append(f"""
tau: Kendall's tau-b between predicted and measured order (emu.ranking.rank_agreement); predicted values within 2 % of
the smallest of their class count as tied (neither concordant nor discordant; tau-b's denominator leaves those pairs out on
the predicted side); `tau_untied` is the same on the raw predicted values. Goal: tau >= {GOAL_TAU}.
Placement: the planner's candidates (HiveD's list, ranked by CASSINI: alone iteration x (2 - compat), the new job time-shifted);
each candidate's mix (running jobs plus the new job with its shift) runs in Mininet (`emu_runs_ms`: one value per run, repeats
back to back over the candidates) and in the simulator; iteration times are workload milliseconds, warm-up iterations left out,
only while all jobs run. `cpu_busy_max`: the whole machine's busy fraction (other work included; the CPU check is off).
Wall times include waiting for other users' emulations (one Mininet network at a time on the machine).
Pipeline: predicted = the planner's simulated step from calibrations and a CPU-time profile taken before any run, on the ranks
the runs use; measured = median of each block's median step (`blocks_ms`), all candidates in the same processes, one step of each
in turn; `spread` = (max - min) / median over blocks; `busy_pred_ms` / `compute_ms`: per rank, simulated busy time and measured
wall time inside its F/B/I/W calls (median step); `idle_pred_ms` / `idle_ms`: the step less those; `wait_ms`: per rank, time in
torch's message waits. `predicted_ms`: planned and simulated for a core per rank (ranks = cores) from the profile;
`replay_ms`: the same plans simulated on the CPU time of each rank's actions replayed alone (schedule order, no messages) in the
run's processes before the timed steps; `shared_ms` (a diagnostic): the plans simulated on the calibrated CPU share and efficiency.""")
    write_results(name, rows, title="Planners' candidate ranking in real runs: Kendall's tau, predicted vs measured order",
                  notes="\n".join(notes), extra=extra)


if __name__ == "__main__":
    main()
