"""The pipeline planner's candidate ranking held against real runs on the CPU runner: Kendall's tau.

``schedule="auto"`` plans every exportable family (:data:`pipesched.calibrate.EXPORTABLE`: 1F1B, ZB-H1,
GPipe, interleaved 1F1B) on the model's profile and ranks the plans by their simulated iteration time.
:func:`schedule_ranking` takes that candidate list, with the usual hand-made default (equal layer counts
per stage run by torch's ``Schedule1F1B``) as one more candidate, runs every candidate for real in gloo
processes (:func:`pipesched.runner.run_pipeline`) and compares the predicted order with the measured one
(:func:`emu.ranking.rank_agreement`: Kendall's tau-b, predicted times within 2 % one tie class).

The prediction is the planner's, made once before any run, as a user plans: the calibrations and the
first CPU-time profile of :func:`pipesched.calibrate.cpu_validation` (steps 1-4 of its protocol: gloo message
cost and CPU share, the runtime's per-action and per-message CPU cost, its sharing efficiency and late-receive
cost, then the per-layer profile with co-runners), each family planned on it and simulated as torch's
``_PipelineScheduleRuntime`` runs it, the baseline as ``Schedule1F1B`` does (:mod:`pipesched.runtimes`).
Nothing measured in the runs enters a prediction.

The runs: ``rounds`` rounds, each running every candidate once (``iterations`` timed steps after ``warmup``),
the order reversed in odd rounds so that slow drift of the shared machine does not favour the first; a
candidate's measured time is the median over rounds of its runs' median step, and its spread (max - min over
rounds, relative to the median) is reported next to the gaps between predicted times. A pair of candidates
whose measured times differ by less than the spread is within the machine's noise; the report says how many.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import replace
from typing import Any

from emu.ranking import DEFAULT_TIE_TOLERANCE, pairs_within_noise, rank_agreement, spread

from .calibrate import EXPORTABLE, _ours_arm, _uniform_arm, calibrate_cpu, calibrate_runtime, profile_mlp
from .devices import Device, LinkModel
from .plan import Plan, plan, resimulate, uniform_plan, with_runtime
from .profile import ModelProfile
from .runner import run_pipeline
from .simulate import SharedCpu


def plan_candidates(profile: ModelProfile, devices: list[Device], link: LinkModel, *, microbatches: int, cores: SharedCpu,
                    handshake_s: float | None = None, baseline: bool = True) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """Every exportable family planned on ``profile`` (and the uniform baseline), best predicted first; and the families skipped.

    Each family is planned with :func:`pipesched.plan.plan` and simulated as torch's ``_PipelineScheduleRuntime``
    runs our CSV schedules; the baseline, equal layer counts per stage, as torch's ``Schedule1F1B`` runs it. Each
    candidate: ``name``, ``plan`` (a :class:`~pipesched.plan.Plan`), ``how`` (the ``run_pipeline`` arguments),
    ``predicted_s`` (the simulated iteration), ``spans``, ``recompute`` and ``in_flight``, and, a diagnostic,
    ``predicted_own_core_s``: the same plan simulated with a core per rank (``cores`` = ranks, efficiency 1), the
    model of a machine whose other users' processes take each rank's share away from it alone rather than from a
    pool our ranks share (then an idle rank's share goes to the other users, not to our busy ranks).
    """
    out: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []

    own_core = replace(cores, cores=float(len(devices)), efficiency=1.0)

    def add(name: str, p: Plan, how: dict[str, Any]) -> None:
        out.append({"name": name, "plan": p, "how": how, "predicted_s": p.sim.makespan, "spans": [list(s.layers) for s in p.partition.stages],
                    "recompute": [s.recompute for s in p.partition.stages], "in_flight": p.in_flight,
                    "predicted_own_core_s": resimulate(p, cores=own_core).makespan})

    for fam in EXPORTABLE:
        try:
            p = with_runtime(plan(profile, devices, link, microbatches=microbatches, schedule=fam, cores=cores), "torch-runtime", handshake_s)
        except Exception as exc:  # a family that does not apply to this shape (e.g. interleaving with too few layers)
            skipped.append({"schedule": fam, "error": str(exc)})
            continue
        add(fam, p, _ours_arm(p)[2])
    if baseline:
        uni = uniform_plan(profile, devices, link, microbatches=microbatches, family="1f1b", cores=cores, runtime="torch-1f1b",
                           handshake_s=handshake_s)
        add("uniform + torch 1F1B", uni, _uniform_arm(uni)[2])
    out.sort(key=lambda c: c["predicted_s"])
    return out, skipped


def schedule_candidates(widths: list[int], *, dim: int, batch: int, microbatches: int, stages: int, threads: int = 1, repeats: int = 15,
                        passes: int = 5, baseline: bool = True) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Calibrate and profile this machine (as :func:`pipesched.calibrate.cpu_validation` does), then :func:`plan_candidates`.

    The second value records the calibrations, the profile and the families that did not apply to this shape.
    """
    mb = batch // microbatches
    cal = calibrate_cpu(stages, mb * dim * 4, threads=threads)
    rt = calibrate_runtime(stages, dim=dim, batch=batch, microbatches=microbatches, threads=threads, load_width=4 * dim, cores=cal.cpu_share,
                           link=cal.link())
    shared = SharedCpu(cal.cpu_share, rt.message_cpu_s, rt.action_cpu_s, rt.efficiency)
    co_runners = min(stages, os.cpu_count() or 1) - 1
    profile = profile_mlp(widths, dim, mb, threads=threads, repeats=repeats, statistic="median", clock="cpu", warmup=2, co_runners=co_runners,
                          passes=passes)
    devices = [Device(f"cpu-rank{r}") for r in range(stages)]
    out, skipped = plan_candidates(profile, devices, cal.link(), microbatches=microbatches, cores=shared, handshake_s=rt.handshake_s,
                                   baseline=baseline)
    return out, {"calibration": cal.to_dict(), "runtime_calibration": rt.to_dict(), "shared_cpu": shared.to_dict(),
                 "profile": profile.to_dict(), "skipped": skipped}


def summarize_runs(cands: list[dict[str, Any]], runs: dict[str, list[dict[str, Any]]], tolerance: float = DEFAULT_TIE_TOLERANCE,
                   ) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """Per candidate the measured median over its runs and their spread; tau against the predicted order; the pairs within noise.

    ``runs[name]`` lists a candidate's runs (``median_s``: the run's median step, ``foreign_cores``). A pair is
    *within noise* when its measured gap, relative to the faster, is smaller than the larger of the two spreads
    ((max - min) / median over a candidate's runs).

    >>> cands = [{"name": "a", "predicted_s": 1.0}, {"name": "b", "predicted_s": 1.5}, {"name": "c", "predicted_s": 2.0}]
    >>> runs = {"a": [{"median_s": 1.1, "foreign_cores": 0.0}, {"median_s": 1.2, "foreign_cores": 0.1}],
    ...         "b": [{"median_s": 1.6, "foreign_cores": 0.0}], "c": [{"median_s": 1.55, "foreign_cores": 0.0}]}
    >>> rows, agree, noise = summarize_runs(cands, runs)
    >>> [round(r["measured_s"], 3) for r in rows], round(agree["tau"], 3), noise["pairs_within_spread"]
    ([1.15, 1.6, 1.55], 0.333, [])
    """
    rows = []
    for c in cands:
        meds = [x["median_s"] for x in runs[c["name"]]]
        measured = statistics.median(meds)
        rows.append({"name": c["name"], "predicted_s": c["predicted_s"], "measured_s": measured, "runs_s": meds, "spread": spread(meds),
                     "error": c["predicted_s"] / measured - 1.0, "spans": c.get("spans"),
                     "recompute": c.get("recompute"), "in_flight": c.get("in_flight"),
                     "foreign_cores_max": max(x["foreign_cores"] for x in runs[c["name"]])})
        if "predicted_own_core_s" in c:
            rows[-1]["predicted_own_core_s"] = c["predicted_own_core_s"]
    agree = rank_agreement([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows], tolerance=tolerance)
    if all("predicted_own_core_s" in r for r in rows):
        agree["own_core"] = rank_agreement([r["predicted_own_core_s"] for r in rows], [r["measured_s"] for r in rows], tolerance=tolerance)
    noisy = pairs_within_noise([r["name"] for r in rows], [r["measured_s"] for r in rows], [r["spread"] for r in rows])
    return rows, agree, {"pairs_within_spread": noisy, "median_spread": statistics.median(r["spread"] for r in rows)}


def schedule_ranking(widths: list[int], *, dim: int, batch: int, microbatches: int, stages: int, threads: int = 1, rounds: int = 2,
                     iterations: int = 5, warmup: int = 1, tolerance: float = DEFAULT_TIE_TOLERANCE, baseline: bool = True,
                     repeats: int = 15, passes: int = 5) -> dict[str, Any]:
    """Plan the candidates (:func:`schedule_candidates`), run each ``rounds`` times, and compare the orders (module docstring).

    Returns ``{"model", "candidates": [...], "agreement": rank_agreement(...), "noise": {...}, "setup": {...}}``; each
    candidate has ``predicted_s``, ``measured_s`` (median over rounds), ``runs_s`` (each round's median step),
    ``spread`` ((max - min) / median over rounds) and ``error`` (predicted / measured - 1).
    """
    if rounds < 1:
        raise ValueError(f"need at least one round, got {rounds}")
    cands, setup = schedule_candidates(widths, dim=dim, batch=batch, microbatches=microbatches, stages=stages, threads=threads, repeats=repeats,
                                       passes=passes, baseline=baseline)
    common = {"microbatches": microbatches, "batch": batch, "dim": dim, "model_kwargs": {"widths": list(widths), "dim": dim},
              "iterations": iterations, "warmup": warmup, "threads": threads}
    runs: dict[str, list[dict[str, Any]]] = {c["name"]: [] for c in cands}
    for r in range(rounds):
        for c in cands if r % 2 == 0 else cands[::-1]:
            res = run_pipeline(**c["how"], **common)
            runs[c["name"]].append({"round": r, "median_s": res.median_s, "iteration_s": res.iteration_s, "foreign_cores": res.foreign_cores})
    rows, agree, noise = summarize_runs(cands, runs, tolerance)
    return {"model": {"widths": list(widths), "dim": dim, "batch": batch, "microbatches": microbatches, "stages": stages, "threads": threads,
                      "rounds": rounds, "iterations": iterations, "warmup": warmup},
            "candidates": rows, "agreement": agree, "noise": noise, "setup": setup}


__all__ = ["plan_candidates", "schedule_candidates", "schedule_ranking", "summarize_runs"]
