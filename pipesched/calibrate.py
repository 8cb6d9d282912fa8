"""Predicted versus measured: profile a real model on this machine, plan it, run it with gloo, compare.

:func:`cpu_validation` is the validation protocol of the design notes on a CPU: (1) measure the per-layer
profile on this machine (same thread count as the run), (2) plan, (3) run the plan with real processes,
(4) feed the simulator the transport measured in the run (ping-pong latency and bandwidth) and the number
of CPU cores the ranks share, and (5) report iteration time, per-action duration and per-rank activation
memory errors. It also runs the usual default, a uniform split with torch's ``Schedule1F1B``, so that the
plan's measured gain is known.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

from .devices import Device, LinkModel
from .export import schedule_csv, spans_for_schedule
from .models import mlp_chain
from .plan import Plan, plan, plan_partition, uniform_plan
from .profile import ModelProfile, measure_profile
from .runner import RunResult, run_pipeline

EXPORTABLE = ("1f1b", "zbh1", "gpipe", "interleaved")


def profile_mlp(widths: list[int], dim: int, microbatch: int, threads: int = 1, repeats: int = 5, statistic: str = "median") -> ModelProfile:
    """Measured profile of :func:`pipesched.models.mlp_chain` with the MSE loss on the last layer."""
    import torch

    layers = mlp_chain(widths, dim)
    target = torch.randn(microbatch, dim)
    return measure_profile(layers, torch.randn(microbatch, dim), loss_fn=lambda out: torch.nn.functional.mse_loss(out, target),
                           repeats=repeats, threads=threads, name=f"mlp{len(widths)}x{dim}", statistic=statistic)


def compare(p: Plan, run: RunResult) -> dict[str, Any]:
    """Errors of a plan's prediction against a measured run."""
    predicted = p.sim.makespan
    measured = run.median_s
    per_action = []
    sim_by_key: dict[str, list[float]] = {}
    for s in p.sim.timeline:
        sim_by_key.setdefault(f"{s.action.stage} {s.action.kind}", []).append(s.end - s.start)
    for key, value in sorted(run.action_medians.items()):
        if key in sim_by_key:
            pred = statistics.median(sim_by_key[key])
            per_action.append({"action": key, "predicted_s": pred, "measured_s": value, "error": pred / value - 1 if value else 0.0})
    act_pred = [peak - sum(p.costs[s].state_bytes for s in range(p.schedule.num_stages) if p.schedule.stage_rank[s] == r)
                for r, peak in enumerate(p.sim.peak_memory)]
    return {
        "schedule": p.family, "predicted_s": predicted, "measured_s": measured, "measured_iterations_s": run.iteration_s,
        "error": predicted / measured - 1.0, "error_vs_fastest": predicted / min(run.iteration_s) - 1.0,
        "bubble_predicted": p.sim.bubble_fraction, "lower_bound_s": p.bound["bound_s"],
        "per_action": per_action,
        "per_action_mape": statistics.mean(abs(a["error"]) for a in per_action) if per_action else None,
        "activation_peak_predicted_bytes": act_pred, "activation_peak_measured_bytes": run.peak_saved_bytes,
        "rss_growth_bytes": run.peak_rss_growth_bytes,
    }


def cpu_validation(widths: list[int], *, dim: int, batch: int, microbatches: int, stages: int, threads: int = 1,
                   iterations: int = 3, warmup: int = 1, schedule: str = "auto", baseline: bool = True,
                   cores: float | None = None) -> dict[str, Any]:
    """Profile, plan, run and compare (see the module docstring); returns a JSON-able report."""
    cores = cores or os.cpu_count() or 1
    mb = batch // microbatches
    # Minima over 9 repeats: the undisturbed per-layer cost (this machine is shared); compared below with both the
    # median and the fastest measured iteration.
    prof = profile_mlp(widths, dim, mb, threads=threads, repeats=9, statistic="min")
    devices = [Device(f"cpu-rank{r}") for r in range(stages)]
    guess = LinkModel.uniform(stages, 1e9, 50e-6)      # planning guess; the run measures the real transport
    families = [f for f in EXPORTABLE if schedule in ("auto", f)]
    best = None
    for fam in families:
        try:
            cand = plan(prof, devices, guess, microbatches=microbatches, schedule=fam, cores=cores)
        except Exception:   # a family that does not apply to this shape (e.g. interleaving with too few layers)
            continue
        if best is None or cand.sim.makespan < best.sim.makespan:
            best = cand
    assert best is not None
    kwargs = {"widths": list(widths), "dim": dim}
    ours = run_pipeline(spans_for_schedule(best.schedule, best.partition), list(best.schedule.stage_rank), microbatches=microbatches,
                        batch=batch, dim=dim, model_kwargs=kwargs, csv_text=schedule_csv(best.schedule), iterations=iterations,
                        warmup=warmup, threads=threads)
    measured_link = LinkModel.uniform(stages, ours.link_bandwidth_bps, ours.link_latency_s)
    ours_pred = plan_partition(prof, best.partition, devices, measured_link, family=best.family, microbatches=microbatches,
                               chunks=best.chunks, cores=cores)
    report: dict[str, Any] = {
        "model": {"widths": list(widths), "dim": dim, "batch": batch, "microbatches": microbatches, "stages": stages, "threads": threads,
                  "cores": cores},
        "link": {"latency_s": ours.link_latency_s, "bandwidth_bytes_per_s": ours.link_bandwidth_bps},
        "plan": {"schedule": best.family, "spans": [list(s.layers) for s in best.partition.stages],
                 "recompute": [s.recompute for s in best.partition.stages]},
        "ours": compare(ours_pred, ours), "profile": prof.to_dict(),
    }
    if baseline:
        uni = uniform_plan(prof, devices, measured_link, microbatches=microbatches, family="1f1b", cores=cores)
        base = run_pipeline([s.layers for s in uni.partition.stages], list(range(stages)), microbatches=microbatches, batch=batch, dim=dim,
                            model_kwargs=kwargs, builtin="1F1B", iterations=iterations, warmup=warmup, threads=threads)
        report["uniform_torch_1f1b"] = compare(uni, base)
        report["uniform_torch_1f1b"]["spans"] = [list(s.layers) for s in uni.partition.stages]
        report["speedup_measured"] = base.median_s / ours.median_s
        report["speedup_predicted"] = uni.sim.makespan / ours_pred.sim.makespan
    report["_plan"] = ours_pred
    report["_run"] = ours
    return report
