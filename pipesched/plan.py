"""Planning end to end: partition (per family) -> schedule -> simulation -> lower bound -> best plan.

>>> import topology
>>> from pipesched.profile import GPTConfig, analytic_profile
>>> prof = analytic_profile(GPTConfig(layers=16, hidden=2048, heads=16, seq_len=2048, vocab=50257))
>>> devs, links = devices_from_topology(topology.default_cluster(), count=4)
>>> p = plan(prof, devs, links, microbatches=8, schedule="1f1b")
>>> p.family, len(p.partition.stages), p.sim.makespan >= p.bound["bound_s"]
('1f1b', 4, True)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from topology.clitools import render_table

from .devices import Device, LinkModel, devices_from_topology
from .export import TORCH_CLASSES, exportable
from .partition import (
    MULTI_STAGE,
    SPLIT_BACKWARD,
    Partition,
    PlanError,
    evaluate_partition,
    in_flight,
    memory_share,
    partition,
    positions_on_devices,
)
from .profile import RECOMPUTE_OPTIONS, ModelProfile
from .runtimes import rendezvous_for
from .schedules import LOOPED, Schedule, ScheduleError, bytes_text, cached_schedule, fits_memory, validate
from .simulate import SharedCpu, SimResult, StageCost, gc_paused, lower_bound, simulate

__all__ = ["Plan", "check_plan", "choose_robust", "devices_from_topology", "plan", "plan_partition", "resimulate", "stage_costs",
           "uniform_plan", "with_runtime"]

# The families ``auto`` ranks: those torch's runtime can run (pipesched.export.TORCH_CLASSES). Chimera is planned only on request.
AUTO_FAMILIES = ("1f1b", "zbh1", "interleaved", "gpipe", "interleaved_zb", "zbv", "dualpipev", "looped_bfs")
# Above this many (layers x stages) the planner uses the faster bottleneck objective instead of the flush bound.
FLUSH_OBJECTIVE_MAX = 16_000
# Above this many (layers x devices) plan() does not refine: a one-layer move is then a small share of a stage, each trial
# a simulation of thousands of actions, and at 1000 layers on 64 devices 40 trials (97 % of a 50 s plan) found nothing.
REFINE_MAX_SIZE = FLUSH_OBJECTIVE_MAX
NOT_EXPORTABLE = {"chimera": "two replicas of every stage on two ranks; torch needs one rank per stage id"}


@dataclass
class Plan:
    """A partition, a schedule over it, its simulated run and the lower bound for its family."""

    family: str
    partition: Partition
    schedule: Schedule
    costs: dict[int, StageCost]
    sim: SimResult
    bound: dict[str, Any]
    devices: list[Device]
    profile_name: str
    chunks: int = 1
    memory_ok: bool = True
    problems: list[str] = field(default_factory=list)
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    links: LinkModel | None = None
    shared_cpu: SharedCpu | None = None     # the CPU model the simulation used (CPU runs), if any
    runtime: str = "ideal"                  # whose message posting the simulation followed (pipesched.runtimes.RUNTIMES)
    handshake_s: float | None = None        # a late receive's cost in that simulation (None: one link latency)

    @property
    def torch_class(self) -> str | None:
        """torch's public schedule class that runs this plan's family (:data:`pipesched.export.TORCH_CLASSES`)."""
        return TORCH_CLASSES.get(self.family)

    @property
    def export_problem(self) -> str | None:
        """Why torch's runtime cannot run this plan (None when it can)."""
        return exportable(self.schedule)

    @property
    def in_flight(self) -> int:
        """Micro-batches whose activations the plan holds at once, summed over stage ids (each stage's simulated peak)."""
        return sum(self.sim.peak_in_flight.values())

    @property
    def gap(self) -> float:
        """How far the simulated iteration is above the lower bound (0 = provably optimal for its family)."""
        return self.sim.makespan / self.bound["bound_s"] - 1.0 if self.bound["bound_s"] > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "profile": self.profile_name, "schedule": self.family, "chunks": self.chunks, "microbatches": self.schedule.microbatches,
            "devices": [d.to_dict() for d in self.devices], "partition": self.partition.to_dict(),
            "predicted": self.sim.summary(), "lower_bound": self.bound, "gap": self.gap, "memory_ok": self.memory_ok,
            "problems": self.problems, "alternatives": self.alternatives, "actions": self.schedule.rows(),
            "runtime": self.runtime, "handshake_s": self.handshake_s, "torch_class": self.torch_class,
            "exportable": self.export_problem is None, "export_problem": self.export_problem,
        }

    def text(self) -> str:
        unit, scale = ("ms", 1e3) if self.sim.makespan < 10 else ("s", 1.0)
        lines = [f"pipeline plan for {self.profile_name}: schedule {self.family}"
                 + (f" (v={self.chunks})" if self.family in LOOPED else "")
                 + f", {len(self.partition.stages)} stages on {len(self.devices)} devices, {self.schedule.microbatches} micro-batches"]
        rows = [(k, f"{st.layers[0]}-{st.layers[1] - 1}", ",".join(self.devices[d].name for d in st.devices), st.recompute,
                 f"{st.time_s * scale:.4g}", st.in_flight, f"{st.memory_bytes / 2**30:.2f}") for k, st in enumerate(self.partition.stages)]
        lines.append(render_table(["stage>", "layers>", "device", "recompute", f"t/mb {unit}>", "in-flight>", "mem GiB>"], rows))
        lines.append(f"predicted iteration {self.sim.makespan * scale:.4g} {unit}, bubble {self.sim.bubble_fraction:.1%}, "
                     f"peak memory {bytes_text(max(self.sim.peak_memory))}")
        lines.append(f"lower bound ({self.family}, this partition) {self.bound['bound_s'] * scale:.4g} {unit}: gap {self.gap:.1%}; "
                     f"busiest rank's work alone {self.bound['work_bound_s'] * scale:.4g} {unit}")
        if self.alternatives:
            alts = ", ".join([f"{a['schedule']} {a['makespan_s'] * scale:.4g} {unit} (bound {a['bound_s'] * scale:.4g})"
                              + ("" if a["memory_ok"] else " over memory") for a in self.alternatives if "makespan_s" in a]
                             + [f"{a['schedule']} bound {a['bound_s'] * scale:.4g} {unit} (not simulated)"
                                for a in self.alternatives if "skipped" in a])
            lines.append(f"candidates: {alts}")
        if self.problems:
            lines.append("problems: " + "; ".join(self.problems))
        if self.export_problem:
            lines.append(f"cannot run in torch.distributed.pipelining: {self.export_problem}")
        return "\n".join(lines)


def stage_costs(profile: ModelProfile, part: Partition, schedule: Schedule, devices: Sequence[Device],
                links: LinkModel | None, *, keep_graph_until_w: bool = True) -> dict[int, StageCost]:
    """Per-stage-id costs for the simulator from the profile, the partition and the device each stage runs on.

    A stage runs at the speed of its rank's device (for a replicated PipeDream stage the rank is a pseudo
    device standing for the replica group, with the group's summed speed). Chimera's ``REDUCE_GRAD`` costs a
    two-rank all-reduce of the stage's gradients (one gradient's bytes over the link plus two latencies).
    With a split backward (I and W), the stage holding layer 0 costs as torch's runtime runs it: W the fused
    backward, I only the recomputation, if any (its input needs no gradient, so torch does the whole backward in W).
    """
    split = schedule.split_backward
    lays = profile.layers
    costs: dict[int, StageCost] = {}
    for sid in range(schedule.num_stages):
        st = part.stages[schedule.stage_layers[sid]]
        speed = devices[schedule.stage_rank[sid]].speed
        i, j = st.layers
        o = st.recompute
        span = lays[i:j]
        f = sum(lay.fwd_s for lay in span) / speed
        rec = sum(lay.recompute_s[o] for lay in span) / speed
        bi = sum(lay.bwd_input_s for lay in span) / speed + rec
        bw = sum(lay.bwd_weight_s for lay in span) / speed
        if split and i == 0:
            # torch's runtime computes no input gradient on the stage that holds layer 0: its I is empty and its W
            # runs the whole fused backward (PipelineStage.backward_weight_one_chunk on stage 0). The recomputation
            # stays on I, where the simulator's memory model holds its transient activations (same total, same peak).
            bi, bw = rec, sum(lay.bwd_s for lay in span) / speed
        b = bi + bw if split else sum(lay.bwd_s for lay in span) / speed + rec
        saved = float(sum(lay.saved_bytes[o] for lay in span))
        params = float(sum(lay.param_bytes for lay in span))
        reduce_s = 0.0
        partners = [x for x in range(schedule.num_stages) if x != sid and schedule.stage_layers[x] == schedule.stage_layers[sid]]
        if partners and links is not None:
            a, c = schedule.stage_rank[sid], schedule.stage_rank[partners[0]]
            if a != c:
                bw_link, lat = links.link(a, c)
                reduce_s = 2 * lat + params / bw_link
        costs[sid] = StageCost(
            f=f, b=b, i=bi, w=bw, out_bytes=float(span[-1].output_bytes), saved_bytes=saved,
            # torch's runtime keeps the whole graph from I to W (stage_backward_input retains it); the Zero Bubble
            # paper's runtime frees all but the weight-gradient inputs (weight_grad_bytes).
            wgrad_bytes=saved if keep_graph_until_w else min(saved, float(sum(lay.weight_grad_bytes for lay in span))),
            transient_bytes=float(max(lay.saved_bytes["none"] - lay.saved_bytes[o] for lay in span)),
            state_bytes=params * profile.state_factor, reduce_s=reduce_s,
        )
    return costs


def _schedule_for(family: str, ranks: int, microbatches: int, chunks: int) -> Schedule:
    """The family's schedule for this shape; generated once per shape (a copy each call: callers may edit theirs)."""
    base = cached_schedule(family, ranks, microbatches, chunks if family in LOOPED else 1)
    return replace(base, actions={r: list(acts) for r, acts in base.actions.items()}, meta=dict(base.meta))



def plan_partition(profile: ModelProfile, part: Partition, devices: Sequence[Device], links: LinkModel | None, *, family: str,
                   microbatches: int, chunks: int = 1, cores: float | SharedCpu | None = None, runtime: str = "ideal",
                   handshake_s: float | None = None, schedule: Schedule | None = None) -> Plan:
    """Schedule, simulate and bound a given partition (e.g. a uniform split, for comparison).

    ``runtime`` names the executor whose message posting the simulation follows, with ``handshake_s`` the cost of a
    late receive (:func:`pipesched.runtimes.rendezvous_for`). ``schedule``: the family's schedule for this shape when
    the caller has it already (it does not depend on the partition).
    """
    ranks = len(devices) if family in MULTI_STAGE else len(part.stages)
    if family == "chimera" and len(part.stages) != ranks:
        raise PlanError("Chimera needs one partition stage per device", where="--schedule")
    sched = schedule if schedule is not None else _schedule_for(family, ranks, microbatches, chunks)
    costs = stage_costs(profile, part, sched, devices, links)
    sim = simulate(sched, costs, links, cores=cores, rendezvous=rendezvous_for(runtime, sched, handshake_s))
    if not sim.names:
        sim.names = [devices[r].name for r in range(ranks)]
    bound = lower_bound(sched, costs, links)
    limits = [devices[r].memory_bytes for r in range(ranks)]
    problems = [f"rank {r} ({devices[r].name}): peak {bytes_text(peak)} over {bytes_text(limits[r])}"
                for r, peak in enumerate(sim.peak_memory) if not fits_memory(peak, limits[r])]
    return Plan(family, part, sched, costs, sim, bound, list(devices), profile.name, chunks=chunks if family in LOOPED else 1,
                memory_ok=not problems, problems=problems, links=links, shared_cpu=cores if isinstance(cores, SharedCpu) else None,
                runtime=runtime, handshake_s=handshake_s)


def with_runtime(p: Plan, runtime: str, handshake_s: float | None = None) -> Plan:
    """``p`` simulated again as executed by ``runtime`` (:data:`pipesched.runtimes.RUNTIMES`) with that late-receive cost."""
    q = replace(p, runtime=runtime, handshake_s=handshake_s)
    return replace(q, sim=resimulate(q))


def resimulate(p: Plan, costs: dict[int, StageCost] | None = None, *, cores: float | SharedCpu | None = None) -> SimResult:
    """``p``'s schedule simulated again over its links and runtime, on ``costs`` (default its own) and ``cores``
    (default its own :class:`~pipesched.simulate.SharedCpu`)."""
    return simulate(p.schedule, p.costs if costs is None else costs, p.links, cores=p.shared_cpu if cores is None else cores,
                    rendezvous=rendezvous_for(p.runtime, p.schedule, p.handshake_s))


def choose_robust(candidates: Sequence[Plan], margin: float = 0.0) -> Plan:
    """The fastest simulated plan, unless the simulation cannot tell it from others: then the one holding the fewest micro-batches.

    Plans whose simulated iteration is within ``margin`` (a fraction) of the fastest count as tied: a prediction
    with that much error cannot rank them. Among the tied, the plan with the fewest micro-batches in flight
    (:attr:`Plan.in_flight`: less activation memory, a smaller working set, and fewer forwards run ahead of their
    backwards, so a slow stage delays less queued work) wins, ties broken by the simulated time. ``margin = 0``
    is plain "fastest".

    >>> from types import SimpleNamespace as NS
    >>> fast = NS(sim=NS(makespan=1.00), in_flight=32)
    >>> close = NS(sim=NS(makespan=1.02), in_flight=10)
    >>> choose_robust([fast, close]) is fast, choose_robust([fast, close], margin=0.05) is close
    (True, True)
    """
    if not candidates:
        raise PlanError("no plan to choose from")
    if margin < 0:
        raise ValueError(f"margin must be >= 0, got {margin}")
    fastest = min(c.sim.makespan for c in candidates)
    tied = [c for c in candidates if c.sim.makespan <= fastest * (1 + margin)]
    return min(tied, key=lambda c: (c.in_flight, c.sim.makespan))


def plan(profile: ModelProfile, devices: Sequence[Device], links: LinkModel | None, *, microbatches: int, schedule: str = "auto",
         chunks: int = 2, recompute: Sequence[str] = RECOMPUTE_OPTIONS, max_replicas: int = 1, cores: float | SharedCpu | None = None,
         refine_budget: int = 40, tie_margin: float = 0.0) -> Plan:
    """The best plan over the requested schedule family (or all of them with ``schedule="auto"``).

    For each family: the DP partition under that family's in-flight memory model, its schedule, a simulated
    run (per-rank memory checked against each device) and the family's lower bound. ``auto`` returns the
    fastest simulated plan that fits in memory (with ``tie_margin`` > 0: :func:`choose_robust` among the plans
    within that fraction of the fastest); every candidate is listed in ``alternatives``. The winner's
    boundaries are then refined on the simulated makespan (:func:`refine`, ``refine_budget`` simulations;
    0 turns it off and returns the DP's partition as is).
    """
    if microbatches < 1:
        raise PlanError("need at least one micro-batch", where="--microbatches")
    with gc_paused():      # schedules and simulations allocate many small objects and free none in the plan's course
        return _plan(profile, devices, links, microbatches, schedule, chunks, recompute, max_replicas, cores, refine_budget, tie_margin)


def _plan(profile: ModelProfile, devices: Sequence[Device], links: LinkModel | None, microbatches: int, schedule: str, chunks: int,
          recompute: Sequence[str], max_replicas: int, cores: float | SharedCpu | None, refine_budget: int, tie_margin: float) -> Plan:
    p = len(devices)
    links = links if links is not None else LinkModel.uniform(p, math.inf, 0.0)
    families = list(AUTO_FAMILIES) if schedule == "auto" else [schedule]
    candidates: list[Plan] = []
    alternatives: list[dict[str, Any]] = []
    last_error: Exception | None = None
    # First every family's partition, schedule and lower bound; then the simulations, most promising bound first. A family
    # whose bound is above the best simulated iteration that fits (by more than tie_margin) cannot win: not simulated.
    prepared: list[tuple[str, Partition, list[Device], LinkModel, Schedule, float]] = []
    partitions: dict[tuple, Partition] = {}
    partition_cache: dict = {}      # what the partitions of one profile share (partition()'s cache)
    for fam in families:
        try:
            if fam == "chimera" and (p % 2 or microbatches % 2):
                raise PlanError("Chimera needs an even number of stages and of micro-batches", where="--schedule")
            stage_ids = len(positions_on_devices(fam, p, chunks))
            if fam in MULTI_STAGE and len(profile.layers) < stage_ids:
                raise PlanError(f"{fam} runs {stage_ids} stages on {p} devices, the model has only {len(profile.layers)} layers",
                                where="--stages")
            # Flush schedules: minimise their own lower bound; interleaved/Chimera put several stages on a rank, where the
            # per-stage bound does not decompose, so they keep PipeDream's bottleneck objective.
            fam_chunks = chunks if fam in LOOPED else 1
            objective = _objective(fam, len(profile.layers) * p)
            # Families with the same placement, in-flight counts, backward style and objective get the same partition
            # (ZB-V and DualPipe-V): computed once.
            placed = positions_on_devices(fam, p, fam_chunks)
            same = (tuple(placed), tuple(in_flight(fam, k, len(placed), microbatches, ranks=p, chunks=fam_chunks) for k in range(len(placed))),
                    fam in SPLIT_BACKWARD, memory_share(fam, fam_chunks), objective, max_replicas if fam not in MULTI_STAGE else 1)
            if same in partitions:
                part = replace(partitions[same], family=fam)
            else:
                part = partitions[same] = partition(profile, devices, links, microbatches=microbatches, family=fam, chunks=fam_chunks,
                                                    max_replicas=same[-1], recompute=recompute, objective=objective,
                                                    cache=partition_cache)
            # A replicated stage runs on one rank standing for its replica group.
            replicated = any(len(st.devices) > 1 for st in part.stages)
            devs = _group_devices(devices, part) if replicated else list(devices)
            lks = _group_links(links, part) if replicated else links
            ranks = len(devs) if fam in MULTI_STAGE else len(part.stages)
            sched = _schedule_for(fam, ranks, microbatches, chunks)
            bound = lower_bound(sched, stage_costs(profile, part, sched, devs, lks), lks)["bound_s"]
            prepared.append((fam, part, devs, lks, sched, bound))
        except (PlanError, ScheduleError) as exc:
            if schedule != "auto":
                raise
            last_error = exc
            alternatives.append({"schedule": fam, "error": str(exc)})
    fastest = math.inf
    for fam, part, devs, lks, sched, bound in sorted(prepared, key=lambda x: x[5]):
        if bound > fastest * (1 + tie_margin) * (1 + 1e-9):
            alternatives.append({"schedule": fam, "bound_s": bound, "skipped": "not simulated: its lower bound is above the best "
                                 f"simulated iteration that fits ({fastest:.6g} s)"})
            continue
        cand = plan_partition(profile, part, devs, lks, family=fam, microbatches=microbatches, chunks=chunks, cores=cores, schedule=sched)
        candidates.append(cand)
        alternatives.append(_summary(cand))
        if cand.memory_ok:
            fastest = min(fastest, cand.sim.makespan)
    order = {fam: k for k, fam in enumerate(families)}
    alternatives.sort(key=lambda a: order.get(a["schedule"], len(order)))
    if schedule == "auto":
        alternatives += [{"schedule": fam, "error": f"not ranked by auto: torch's runtime cannot run it ({why})"}
                         for fam, why in NOT_EXPORTABLE.items()]
    fitting = [c for c in candidates if c.memory_ok]
    if not fitting:
        if candidates:
            raise PlanError("no schedule fits in device memory: " + "; ".join(candidates[0].problems), where="--memory")
        raise last_error or PlanError("no plan found")
    best = choose_robust(fitting, tie_margin)
    if refine_budget and all(len(st.devices) == 1 for st in best.partition.stages) and len(profile.layers) * p <= REFINE_MAX_SIZE:
        refined = refine(profile, best, devices, links, budget=refine_budget, cores=cores, recompute=recompute)
        if refined is not best:    # the candidate list shows the plan returned, with what the DP's partition gave
            entry = next(a for a in alternatives if a.get("schedule") == best.family and "makespan_s" in a)
            entry.update(_summary(refined), refined_from_s=best.sim.makespan)
            best = refined
    best.alternatives = alternatives
    return best


def _summary(cand: Plan) -> dict[str, Any]:
    return {"schedule": cand.family, "makespan_s": cand.sim.makespan, "bound_s": cand.bound["bound_s"],
            "bubble_fraction": cand.sim.bubble_fraction, "peak_memory_bytes": max(cand.sim.peak_memory), "in_flight": cand.in_flight,
            "memory_ok": cand.memory_ok}


def refine(profile: ModelProfile, start: Plan, devices: Sequence[Device], links: LinkModel, *, budget: int = 60,
           cores: float | SharedCpu | None = None, recompute: Sequence[str] = RECOMPUTE_OPTIONS) -> Plan:
    """Hill-climb the stage boundaries on the simulated iteration time, one layer at a time.

    The DP is exact for its objective (the bottleneck stage, then the sum of stage times), but with unequal
    stages the real schedule's makespan also depends on where the slack sits; this moves single boundaries by
    one layer while that lowers the simulated makespan and the plan still fits, for at most ``budget``
    simulations. When there are at most ``budget`` partitions in all, it tries every one instead (exact on the
    simulated makespan). A move whose lower bound (:func:`pipesched.simulate.lower_bound`, same schedule) is not below the
    current makespan cannot help and is not simulated. The result is recorded in ``partition.meta["refined_from_s"]``.
    """
    current = start
    spans = [list(st.layers) for st in start.partition.stages]
    m = start.schedule.microbatches
    n = len(profile.layers)

    def trial_plan(trial: Sequence[Sequence[int]], than: Plan) -> Plan | None:
        """The plan on these spans if it may beat ``than`` (not when a stage cannot fit or its lower bound is no better)."""
        part = evaluate_partition(profile, [tuple(x) for x in trial], devices, links, microbatches=m, family=start.family,
                                  chunks=start.chunks, options=recompute)
        if any(math.isinf(st.time_s) for st in part.stages):
            return None
        costs = stage_costs(profile, part, start.schedule, devices, links)
        if lower_bound(start.schedule, costs, links)["bound_s"] >= than.sim.makespan * (1 - 1e-9):
            return None
        return plan_partition(profile, part, devices, links, family=start.family, microbatches=m, chunks=start.chunks, cores=cores,
                              schedule=start.schedule)

    if math.comb(n - 1, len(spans) - 1) <= budget:
        # Few enough partitions to try them all: the exact optimum on the simulated makespan (each stage with its fastest
        # option that fits, which a shorter action can only help).
        sims = 0
        for cuts in itertools.combinations(range(1, n), len(spans) - 1):
            bounds = (0, *cuts, n)
            cand = trial_plan([(bounds[k], bounds[k + 1]) for k in range(len(spans))], current)
            if cand is None:
                continue
            sims += 1
            if cand.memory_ok and cand.sim.makespan < current.sim.makespan * (1 - 1e-9):
                current = cand
        if current is not start:
            current.partition.meta.update(refined_from_s=start.sim.makespan, refine_simulations=sims, refine="exhaustive")
        return current
    sims = 0
    improved = True
    while improved and sims < budget:
        improved = False
        for k in range(1, len(spans)):
            for delta in (-1, 1):
                cut = spans[k][0] + delta
                if not spans[k - 1][0] < cut < spans[k][1] or sims >= budget:
                    continue
                trial = [list(x) for x in spans]
                trial[k - 1][1] = trial[k][0] = cut
                cand = trial_plan(trial, current)
                if cand is None:
                    continue
                sims += 1
                if cand.memory_ok and cand.sim.makespan < current.sim.makespan * (1 - 1e-9):
                    current, spans, improved = cand, trial, True
                    break
    if current is not start:
        current.partition.meta["refined_from_s"] = start.sim.makespan
        current.partition.meta["refine_simulations"] = sims
    return current


def _objective(family: str, size: int) -> str:
    return "flush" if family in ("gpipe", "1f1b", "zbh1") and size <= FLUSH_OBJECTIVE_MAX else "bottleneck"


def _group_devices(devices: Sequence[Device], part: Partition) -> list[Device]:
    """One pseudo-device per replicated stage: summed speed, the smallest memory of its replicas."""
    return [Device("+".join(devices[d].name for d in st.devices), speed=sum(devices[d].speed for d in st.devices),
                   memory_bytes=min(devices[d].memory_bytes for d in st.devices)) for st in part.stages]


def _group_links(links: LinkModel, part: Partition) -> LinkModel:
    """Links between replica groups: forward from a group's last device to the next group's first, back the other way."""
    firsts = [st.devices[0] for st in part.stages]
    lasts = [st.devices[-1] for st in part.stages]

    def resolve(a: int, b: int) -> tuple[float, float]:
        return links.link(lasts[a], firsts[b]) if a < b else links.link(firsts[a], lasts[b])

    return LinkModel(len(part.stages), resolve)


def uniform_plan(profile: ModelProfile, devices: Sequence[Device], links: LinkModel | None, *, microbatches: int,
                 family: str = "1f1b", cores: float | SharedCpu | None = None, runtime: str = "ideal",
                 handshake_s: float | None = None) -> Plan:
    """Equal layer counts per stage with ``family``'s schedule: the usual hand-made default, as a baseline."""
    from .partition import uniform_partition

    spans = uniform_partition(profile, len(devices))
    links = links if links is not None else LinkModel.uniform(len(devices), math.inf, 0.0)
    part = evaluate_partition(profile, spans, devices, links, microbatches=microbatches, family=family)
    return plan_partition(profile, part, devices, links, family=family, microbatches=microbatches, cores=cores, runtime=runtime,
                          handshake_s=handshake_s)


def check_plan(p: Plan) -> list[str]:
    """The validator on the plan's schedule with its costs, links and each device's memory."""
    return validate(p.schedule, p.costs, [d.memory_bytes for d in p.devices[: p.schedule.ranks]], p.links)
