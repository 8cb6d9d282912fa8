"""The pipeline planner's candidate ranking held against real runs on the CPU runner: Kendall's tau.

The candidates are the planner's list: every exportable family (:data:`pipesched.calibrate.EXPORTABLE`: 1F1B,
ZB-H1, GPipe, interleaved 1F1B) planned on the model's profile (each family partitioned for itself, as
``schedule="auto"`` does), the same families on the equal-layer split (the usual hand-made default), and that
split run by torch's own ``Schedule1F1B`` (:func:`plan_candidates`). Each is predicted once, before any run, as
a user plans: the calibrations and the CPU-time profile of :func:`pipesched.calibrate.cpu_validation` (steps
1-4 of its protocol: gloo message cost and CPU share, the runtime's per-action and per-message CPU cost, its
sharing efficiency and late-receive cost, then the per-layer profile with co-runners), each plan simulated as
torch's ``_PipelineScheduleRuntime`` runs it, the ``Schedule1F1B`` one as that executor does
(:mod:`pipesched.runtimes`). Nothing measured in the runs enters a prediction.

Which candidates run (:func:`choose_candidates`, a rule applied before any run): the planner's list sorted by
predicted time (ties by fewer micro-batches in flight); the first is kept, then each next one predicted at least
``gap`` (default 10 %) slower than the last kept, up to ``k`` of them: the top-k *distinct* predictions
(:func:`distinct_candidates`). 10 % is the model's error on single plans on this CPU
(``bench/results/pipesched_cpu_validation.md``: 5 or 6 of 6 runs within 10 %): candidates predicted closer are not
ranked by the planner in any useful sense, and measuring them would rank the machine's noise. When that keeps fewer
than ``least`` (4), the pool grows by the planner's own runner-up plans (:func:`runner_ups`: the other partitions
its search tries for each family, :func:`search_partitions`), the second-best of every family first, then the
third-best, and so on, until the rule keeps ``least`` or the search has no more.

The runs (:func:`pipesched.runner.run_interleaved`): all chosen candidates in the same gloo processes, as many
ranks as the machine has cores, one step of each in turn, the order reversed every pass, in ``blocks`` blocks of
``steps`` passes: on this shared virtual machine the speed of the same work drifts by tens of percent over
minutes, and candidates measured one after another in separate runs rank that drift (the earlier protocol: 4
ranks on 2 cores, spread over rounds 30 %). A candidate's measured time is the median of its blocks' median steps;
its spread, (max - min) / median over the blocks, is reported next to the gaps between predicted times. A pair of
candidates measured closer than their spread is within the machine's noise; the report says how many. The
comparison is :func:`emu.ranking.rank_agreement` (Kendall's tau-b, predicted times within 2 % one tie class).
"""

from __future__ import annotations

import itertools
import math
import os
import statistics
from dataclasses import replace
from typing import Any

from emu.ranking import DEFAULT_TIE_TOLERANCE, pairs_within_noise, rank_agreement, spread

from .calibrate import EXPORTABLE, _ours_arm, _uniform_arm, calibrate_cpu, calibrate_runtime, measured_costs, profile_mlp
from .devices import Device, LinkModel
from .partition import evaluate_partition
from .plan import Plan, plan, plan_partition, resimulate, uniform_plan, with_runtime
from .profile import ModelProfile
from .runner import run_interleaved
from .schedules import LOOPED
from .simulate import SharedCpu


def plan_candidates(profile: ModelProfile, devices: list[Device], link: LinkModel, *, microbatches: int, cores: SharedCpu,
                    handshake_s: float | None = None, baseline: bool = True,
                    uniform_families: bool = False, runners: bool = False) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """Every exportable family planned on ``profile`` (and the uniform baseline), best predicted first; and the families skipped.

    Each family is planned with :func:`pipesched.plan.plan` and simulated as torch's ``_PipelineScheduleRuntime``
    runs our CSV schedules; the baseline, equal layer counts per stage, as torch's ``Schedule1F1B`` runs it. With
    ``uniform_families`` every family with one stage per rank also on the equal-layer split (``"uniform + <family>"``,
    our CSV through torch's runtime; the interleaved families are left out: :func:`~pipesched.plan.uniform_plan`
    cuts one stage per rank, which interleaves as plain 1F1B). Each candidate: ``name``, ``plan`` (a :class:`~pipesched.plan.Plan`), ``how`` (the
    ``run_pipeline`` arguments),
    ``predicted_s`` (the simulated iteration), ``spans``, ``recompute`` and ``in_flight``, and, a diagnostic,
    ``predicted_own_core_s``: the same plan simulated with a core per rank (``cores`` = ranks, efficiency 1), the
    model of a machine whose other users' processes take each rank's share away from it alone rather than from a
    pool our ranks share (then an idle rank's share goes to the other users, not to our busy ranks). With ``runners``
    each family planned on its own partition also lists its runner-up plans (:func:`runner_ups`) in ``runner_ups``,
    as candidates named ``"<family> #2"``, ``"#3"``, ... best predicted first (for :func:`choose_candidates`).
    """
    out: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []

    own_core = replace(cores, cores=float(len(devices)), efficiency=1.0)

    def candidate(name: str, p: Plan, how: dict[str, Any]) -> dict[str, Any]:
        return {"name": name, "plan": p, "how": how, "predicted_s": p.sim.makespan, "spans": [list(s.layers) for s in p.partition.stages],
                "recompute": [s.recompute for s in p.partition.stages], "in_flight": p.in_flight,
                "predicted_own_core_s": resimulate(p, cores=own_core).makespan}

    def add(name: str, p: Plan, how: dict[str, Any]) -> None:
        out.append(candidate(name, p, how))

    for fam in EXPORTABLE:
        try:
            p = with_runtime(plan(profile, devices, link, microbatches=microbatches, schedule=fam, cores=cores), "torch-runtime", handshake_s)
        except Exception as exc:  # a family that does not apply to this shape (e.g. interleaving with too few layers)
            skipped.append({"schedule": fam, "error": str(exc)})
            continue
        add(fam, p, _ours_arm(p)[2])
        if runners:
            out[-1]["runner_ups"] = [candidate(f"{fam} #{k + 2}", q, _ours_arm(q)[2])
                                     for k, q in enumerate(runner_ups(profile, p, devices, link, cores=cores, handshake_s=handshake_s))]
        if uniform_families and fam not in LOOPED:   # an equal split interleaves only with one stage per rank: 1F1B again
            try:
                u = uniform_plan(profile, devices, link, microbatches=microbatches, family=fam, cores=cores, runtime="torch-runtime",
                                 handshake_s=handshake_s)
            except Exception as exc:
                skipped.append({"schedule": f"uniform + {fam}", "error": str(exc)})
                continue
            add(f"uniform + {fam}", u, _ours_arm(u)[2])
    if baseline:
        uni = uniform_plan(profile, devices, link, microbatches=microbatches, family="1f1b", cores=cores, runtime="torch-1f1b",
                           handshake_s=handshake_s)
        add("uniform + torch 1F1B", uni, _uniform_arm(uni)[2])
    out.sort(key=lambda c: (c["predicted_s"], c["in_flight"]))
    return out, skipped


def search_partitions(layers: int, spans: list[list[int]], budget: int = 40) -> list[list[tuple[int, int]]]:
    """The partitions :func:`pipesched.plan.refine` searches around ``spans`` (same stage count), ``spans`` itself left out.

    Every partition when there are at most ``budget`` of them (refine's exhaustive case); otherwise each one
    boundary moved by one layer (refine's hill-climb moves).

    >>> search_partitions(4, [[0, 2], [2, 4]])
    [[(0, 1), (1, 4)], [(0, 3), (3, 4)]]
    >>> search_partitions(6, [[0, 2], [2, 4], [4, 6]], budget=5)
    [[(0, 1), (1, 4), (4, 6)], [(0, 3), (3, 4), (4, 6)], [(0, 2), (2, 3), (3, 6)], [(0, 2), (2, 5), (5, 6)]]
    """
    own = [tuple(x) for x in spans]
    if math.comb(layers - 1, len(spans) - 1) <= budget:
        out = []
        for cuts in itertools.combinations(range(1, layers), len(spans) - 1):
            bounds = (0, *cuts, layers)
            out.append([(bounds[k], bounds[k + 1]) for k in range(len(spans))])
        return [x for x in out if x != own]
    out = []
    for k in range(1, len(spans)):
        for delta in (-1, 1):
            cut = spans[k][0] + delta
            if spans[k - 1][0] < cut < spans[k][1]:
                trial = list(own)
                trial[k - 1], trial[k] = (trial[k - 1][0], cut), (cut, trial[k][1])
                out.append(trial)
    return out


def runner_ups(profile: ModelProfile, best: Plan, devices: list[Device], link: LinkModel, *, cores: SharedCpu,
               handshake_s: float | None = None) -> list[Plan]:
    """The planner's runner-up plans of ``best``'s family: every partition of its search (:func:`search_partitions`)
    planned and simulated as ``best`` was (same schedule, CPU model and runtime), those that fit, best predicted first."""
    out = []
    m = best.schedule.microbatches
    for spans in search_partitions(len(profile.layers), [list(st.layers) for st in best.partition.stages]):
        part = evaluate_partition(profile, spans, devices, link, microbatches=m, family=best.family, chunks=best.chunks)
        if any(math.isinf(st.time_s) for st in part.stages):
            continue
        q = plan_partition(profile, part, devices, link, family=best.family, microbatches=m, chunks=best.chunks, cores=cores,
                           runtime="torch-runtime", handshake_s=handshake_s, schedule=best.schedule)
        if q.memory_ok:
            out.append(q)
    return sorted(out, key=lambda q: (q.sim.makespan, q.in_flight))


def distinct_candidates(cands: list[dict[str, Any]], *, gap: float = 0.05, k: int = 6) -> list[dict[str, Any]]:
    """The top-``k`` distinct predictions of a candidate list: best predicted first (ties: fewer in flight), then each next
    candidate predicted at least ``gap`` (relative) slower than the last one kept.

    >>> cands = [{"name": n, "predicted_s": t, "in_flight": 1} for n, t in (("a", 1.0), ("b", 1.03), ("c", 1.06), ("d", 1.2), ("e", 1.21))]
    >>> [c["name"] for c in distinct_candidates(cands)], [c["name"] for c in distinct_candidates(cands, k=2)]
    (['a', 'c', 'd'], ['a', 'c'])
    """
    if gap < 0 or k < 1:
        raise ValueError(f"need gap >= 0 and k >= 1, got {gap}, {k}")
    kept: list[dict[str, Any]] = []
    for c in sorted(cands, key=lambda c: (c["predicted_s"], c.get("in_flight", 0))):
        if len(kept) == k:
            break
        if not kept or c["predicted_s"] >= kept[-1]["predicted_s"] * (1 + gap):
            kept.append(c)
    return kept


def choose_candidates(cands: list[dict[str, Any]], *, gap: float = 0.10, k: int = 6, least: int = 4) -> tuple[list[dict[str, Any]], int]:
    """Which candidates run, by a rule fixed before any run: :func:`distinct_candidates` of the planner's list; while
    that keeps fewer than ``least``, the pool grows by the next runner-up plan of every family (``runner_ups`` of
    :func:`plan_candidates`: its second-best partitions, then its third-best, ...). Returns the chosen candidates
    and how many runner-ups per family the pool took (0: the planner's own list sufficed).

    >>> top = [{"name": "a", "predicted_s": 1.0, "runner_ups": [{"name": "a #2", "predicted_s": 1.04}, {"name": "a #3", "predicted_s": 1.3}]},
    ...        {"name": "b", "predicted_s": 1.15, "runner_ups": [{"name": "b #2", "predicted_s": 1.5}]}]
    >>> chosen, depth = choose_candidates(top, least=4)
    >>> [c["name"] for c in chosen], depth
    (['a', 'b', 'a #3', 'b #2'], 2)
    """
    chosen = distinct_candidates(cands, gap=gap, k=k)
    depth, deepest = 0, max((len(c.get("runner_ups", ())) for c in cands), default=0)
    while len(chosen) < least and depth < deepest:
        depth += 1
        pool = cands + [r for c in cands for r in c.get("runner_ups", ())[:depth]]
        chosen = distinct_candidates(pool, gap=gap, k=k)
    return chosen, depth


def schedule_candidates(widths: list[int], *, dim: int, batch: int, microbatches: int, stages: int, threads: int = 1, repeats: int = 15,
                        passes: int = 5, baseline: bool = True, uniform_families: bool = False,
                        runners: bool = False) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Calibrate and profile this machine (as :func:`pipesched.calibrate.cpu_validation` does), then :func:`plan_candidates`.

    The second value records the calibrations, the profile and the families that did not apply to this shape. With
    no more ranks than the machine's cores the candidates are planned for a core per rank (``SharedCpu`` with
    ``cores`` = ranks; the calibrated message and action costs kept); each also gets
    ``predicted_calibrated_share_s``, its plan simulated on the calibrated CPU share and efficiency (a diagnostic).
    """
    mb = batch // microbatches
    cal = calibrate_cpu(stages, mb * dim * 4, threads=threads)
    rt = calibrate_runtime(stages, dim=dim, batch=batch, microbatches=microbatches, threads=threads, load_width=4 * dim, cores=cal.cpu_share,
                           link=cal.link())
    shared = SharedCpu(cal.cpu_share, rt.message_cpu_s, rt.action_cpu_s, rt.efficiency)
    # With no more ranks than cores each rank has a core: plan for that. The calibrated share is a snapshot of other
    # users' load, which moved from 1.58 cores during the calibration to 0.01 during the runs in this benchmark's first
    # 2-rank attempt, where its efficiency (0.5, the bisection's floor) made the planner put 11 of 12 blocks on one rank.
    planning = replace(shared, cores=float(stages), efficiency=1.0) if stages <= (os.cpu_count() or 1) else shared
    co_runners = min(stages, os.cpu_count() or 1) - 1
    profile = profile_mlp(widths, dim, mb, threads=threads, repeats=repeats, statistic="median", clock="cpu", warmup=2, co_runners=co_runners,
                          passes=passes)
    devices = [Device(f"cpu-rank{r}") for r in range(stages)]
    out, skipped = plan_candidates(profile, devices, cal.link(), microbatches=microbatches, cores=planning, handshake_s=rt.handshake_s,
                                   baseline=baseline, uniform_families=uniform_families, runners=runners)
    for c in out + [r for top in out for r in top.get("runner_ups", ())]:
        c["predicted_calibrated_share_s"] = resimulate(c["plan"], cores=shared).makespan
    return out, {"calibration": cal.to_dict(), "runtime_calibration": rt.to_dict(), "shared_cpu": planning.to_dict(),
                 "calibrated_cpu": shared.to_dict(),
                 "profile": profile.to_dict(), "skipped": skipped}


DIAGNOSTICS = {"predicted_own_core_s": "own_core", "predicted_calibrated_share_s": "calibrated_share", "predicted_replay_s": "replay"}
"""Other predictions of a candidate that :func:`summarize_runs` also ranks against the measurement (key -> name in ``agreement``)."""


def paired_noise(names: list[str], blocks: list[list[float]]) -> dict[str, Any]:
    """How well interleaved runs resolve each pair of candidates: per pair the ratio of their medians in every block.

    The candidates of :func:`pipesched.runner.run_interleaved` share each block's machine state, so what decides
    their order is the ratio within a block, not each one's drift over blocks. A pair is *unresolved* when its
    blocks disagree on which is faster. ``ratio_spread`` is (max - min) / median of the pair's ratios.

    >>> out = paired_noise(["a", "b", "c"], [[1.0, 1.2, 0.9], [1.1, 1.3, 1.0], [1.05, 1.1, 0.95]])
    >>> out["unresolved"], round(out["pairs"][0]["ratio_spread"], 3)
    ([('a', 'c')], 0.025)
    """
    pairs, unresolved = [], []
    for a in range(len(names)):
        for b in range(a + 1, len(names)):
            ratios = [x / y for x, y in zip(blocks[b], blocks[a], strict=True)]
            pairs.append({"pair": (names[a], names[b]), "ratios": ratios, "ratio_spread": spread(ratios)})
            if min(ratios) < 1.0 < max(ratios):
                unresolved.append((names[a], names[b]))
    return {"pairs": pairs, "unresolved": unresolved, "median_ratio_spread": statistics.median(p["ratio_spread"] for p in pairs) if pairs else 0.0}


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
        for key in DIAGNOSTICS:
            if key in c:
                rows[-1][key] = c[key]
    agree = rank_agreement([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows], tolerance=tolerance)
    for key, name in DIAGNOSTICS.items():
        if all(key in r for r in rows):
            agree[name] = rank_agreement([r[key] for r in rows], [r["measured_s"] for r in rows], tolerance=tolerance)
    noisy = pairs_within_noise([r["name"] for r in rows], [r["measured_s"] for r in rows], [r["spread"] for r in rows])
    return rows, agree, {"pairs_within_spread": noisy, "median_spread": statistics.median(r["spread"] for r in rows)}


def schedule_ranking(widths: list[int], *, dim: int, batch: int, microbatches: int, stages: int, threads: int = 1, blocks: int = 3,
                     steps: int = 4, warmup: int = 1, tolerance: float = DEFAULT_TIE_TOLERANCE, baseline: bool = True, repeats: int = 15,
                     passes: int = 5, gap: float = 0.10, k: int = 6, uniform_families: bool = True, replays: int = 3,
                     least: int = 4) -> dict[str, Any]:
    """Plan the candidates (:func:`schedule_candidates`), choose the distinct ones (:func:`choose_candidates`), run them
    interleaved (:func:`pipesched.runner.run_interleaved`) and compare the orders (module docstring).

    Returns ``{"model", "candidates": [...], "agreement": rank_agreement(...), "noise": {...}, "setup": {...}, "planned": [...]}``;
    each candidate has ``predicted_s``, ``measured_s`` (median of its blocks' median steps), ``runs_s`` (those block
    medians), ``spread`` ((max - min) / median over blocks), ``error`` (predicted / measured - 1), and per rank the
    predicted busy and idle time (``predicted_busy_s``, ``predicted_idle_s``: the simulated makespan less busy) and the
    measured ones (``compute_s``: wall time in its actions, ``compute_cpu_s``, ``idle_s``, ``wait_s``). ``planned``
    lists every candidate of the planner with its prediction and whether it ran. With ``replays`` each run candidate is
    also predicted from its ranks' actions replayed alone before the timed steps (``predicted_replay_s``: the plan
    simulated on those CPU times, :func:`pipesched.calibrate.measured_costs`; none of the pipelined steps enters it),
    and ``noise["paired"]`` says which pairs the blocks resolve (:func:`paired_noise`).
    """
    cands, setup = schedule_candidates(widths, dim=dim, batch=batch, microbatches=microbatches, stages=stages, threads=threads, repeats=repeats,
                                       passes=passes, baseline=baseline, uniform_families=uniform_families, runners=True)
    chosen, depth = choose_candidates(cands, gap=gap, k=k, least=least)
    res = run_interleaved([c["how"] | {"replay": c["plan"].schedule.actions} for c in chosen], microbatches=microbatches, batch=batch,
                          dim=dim, model_kwargs={"widths": list(widths), "dim": dim}, blocks=blocks, steps=steps, warmup=warmup,
                          threads=threads, replays=replays)
    for c, r in zip(chosen, res["candidates"], strict=True):
        if r["replay_cpu_s"]:
            c["predicted_replay_s"] = resimulate(c["plan"], measured_costs(c["plan"], r["replay_cpu_s"])).makespan
    runs = {c["name"]: [{"median_s": m, "foreign_cores": res["foreign_cores"]} for m in r["block_median_s"]]
            for c, r in zip(chosen, res["candidates"], strict=True)}
    rows, agree, noise = summarize_runs(chosen, runs, tolerance)
    noise["paired"] = paired_noise([c["name"] for c in chosen], [r["block_median_s"] for r in res["candidates"]])
    for row, c, r in zip(rows, chosen, res["candidates"], strict=True):
        sim = c["plan"].sim
        row |= {"predicted_busy_s": list(sim.busy), "predicted_idle_s": [sim.makespan - b for b in sim.busy], "step_s": r["step_s"],
                **{key: r[key] for key in ("compute_s", "compute_cpu_s", "idle_s", "wait_s", "actions", "replay_cpu_s")}}
    ran = {c["name"] for c in chosen}
    pool = sorted(cands + [r for c in cands for r in c.get("runner_ups", ())[:depth]], key=lambda c: (c["predicted_s"], c["in_flight"]))
    planned = [{"name": c["name"], "predicted_s": c["predicted_s"], "in_flight": c["in_flight"], "spans": c["spans"], "ran": c["name"] in ran}
               for c in pool]
    return {"model": {"widths": list(widths), "dim": dim, "batch": batch, "microbatches": microbatches, "stages": stages, "threads": threads,
                      "blocks": blocks, "steps": steps, "warmup": warmup, "gap": gap, "k": k, "least": least, "runner_up_depth": depth,
                      "replays": replays, "threads_ranks": res["threads"], "threads_profile": setup["profile"]["reference"]["threads"],
                      "retain_freed_memory": res["retain_freed_memory"]},
            "candidates": rows, "agreement": agree, "noise": noise | {"foreign_cores": res["foreign_cores"], "run_wall_s": res["wall_s"]},
            "setup": setup, "planned": planned}


__all__ = ["choose_candidates", "distinct_candidates", "paired_noise", "plan_candidates", "runner_ups", "schedule_candidates", "schedule_ranking",
           "search_partitions", "summarize_runs"]
