"""Iteration slowdowns of concurrent jobs that share network links: adapters from placement to emu.

A *slowdown model* is a callable ``model(jobs) -> {job: mean iteration time (s)}``
over :class:`PlacedJob` (a job's :class:`~placement.profiles.CommProfile` and
its absolute phase). The replay simulator (:mod:`placement.replay`) calls one
with every running job after each arrival or departure.

:class:`FluidSlowdown` (the default)
    emu's job-level fluid model, :class:`emu.fluid.PeriodicFluidModel`: each
    job alternates compute and a communication phase that, alone, lasts
    ``comm_s`` and loads each of its network links at its profile rate; while
    several jobs communicate, their progress is max-min fair under the link
    capacities (emu's solver with the per-link demands as coefficients), and
    the simulation is exact for that model. The profile is the whole
    adaptation: ``compute_s``, ``comm_s``, ``link_rates`` as demands, the phase
    as the start. Simplification: a collective's steps are merged into one
    phase of average rates (emu.sim runs them step by step).
:class:`EmuSlowdown`
    the full flow-level simulator :func:`emu.sim.simulate` (every ring step's
    point-to-point flows, routed) on the same jobs. Exact for emu's model but
    ~10^4 times slower; used to validate :class:`FluidSlowdown`
    (``bench/bench_placement.py`` reports their agreement).

>>> from placement.profiles import CommProfile
>>> e = ("a", "b", 0)
>>> j1 = PlacedJob(CommProfile("j1", (), 0.05, 0.05, {e: 10.0}, {e: 0.5}), 0.0)
>>> j2 = PlacedJob(CommProfile("j2", (), 0.05, 0.05, {e: 10.0}, {e: 0.5}), 0.0)
>>> m = FluidSlowdown({e: 10.0})
>>> {k: round(v, 4) for k, v in m([j1, j2]).items()}   # in phase: both communicate at half rate
{'j1': 0.15, 'j2': 0.15}
>>> {k: round(v, 4) for k, v in m([j1, PlacedJob(j2.profile, 0.05)]).items()}   # interleaved: no slowdown
{'j1': 0.1, 'j2': 0.1}
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from emu.fluid import PeriodicFluidModel, PeriodicJob, connected_groups
from topology.model import Topology

from .profiles import CommProfile, Edge


@dataclass(frozen=True)
class PlacedJob:
    """A running job: its profile and the absolute time (mod its period) at which its iterations start."""

    profile: CommProfile
    phase_s: float = 0.0

    @property
    def name(self) -> str:
        return self.profile.job


def link_components(jobs: Sequence[PlacedJob]) -> list[list[PlacedJob]]:
    """Group jobs that share a network link, directly or through other jobs (union-find)."""
    users: dict[Edge, list[int]] = {}
    for i, j in enumerate(jobs):
        if j.profile.comm_s > 0:
            for e in j.profile.link_rates:
                users.setdefault(e, []).append(i)
    return [[jobs[i] for i in group] for group in connected_groups(len(jobs), users.values())]


def link_capacities(topo: Topology) -> dict[Edge, float]:
    """Capacity (GB/s) of every directed link of ``topo``, keyed like profile links."""
    return {(u, v, k): float(d["bw"]) for u, v, k, d in topo.links()}


class FluidSlowdown:
    """Job-level fluid model of emu (:class:`emu.fluid.PeriodicFluidModel`) over placed jobs.

    ``phase_quantum``, ``radius`` and ``max_ball`` (with ``radius``: the most
    jobs one simulation holds) are the approximations of
    :class:`~emu.fluid.PeriodicFluidModel` (all off by default: every answer
    is exact for the model); ``bench/bench_placement.py`` measures the error
    of ``radius``, ``bench/bench_scale.py --section error`` that of ``max_ball``.
    ``engine`` chooses the model's bookkeeping (C or Python; the same answers).
    """

    def __init__(self, capacity: Mapping[Edge, float] | Topology, *, iterations: int = 4, phase_quantum: float = 0.0,
                 radius: int | None = None, max_ball: int | None = None, cache_limit: int = 200_000, engine: str = "auto"):
        self.capacity = link_capacities(capacity) if isinstance(capacity, Topology) else dict(capacity)
        self.model = PeriodicFluidModel(self.capacity, iterations=max(2, iterations), phase_quantum=phase_quantum, radius=radius,
                                        max_ball=max_ball, cache_limit=cache_limit, engine=engine)
        self._jobs: dict[int, tuple[CommProfile, float, PeriodicJob]] = {}
        self._current: dict[str, PeriodicJob] = {}  # the job set of the last call, by name

    @property
    def calls(self) -> int:
        """Multi-job components asked about."""
        return self.model.calls

    @property
    def hits(self) -> int:
        """Components answered from a cache."""
        return self.model.hits

    @property
    def simulations(self) -> int:
        return self.model.simulations

    def periodic_job(self, job: PlacedJob) -> PeriodicJob:
        """The emu job of ``job``; the same object while its profile and phase are the same (emu's identity cache uses it)."""
        p = job.profile
        hit = self._jobs.get(id(p))
        if hit is not None and hit[0] is p and hit[1] == job.phase_s:
            return hit[2]
        pj = PeriodicJob(p.job, p.compute_s, p.comm_s, p.link_rates, job.phase_s)
        if len(self._jobs) > 100_000:
            self._jobs.clear()
        self._jobs[id(p)] = (p, job.phase_s, pj)  # holding the profile keeps its id from being reused
        return pj

    def __call__(self, jobs: Sequence[PlacedJob]) -> dict[str, float]:
        pjs = [self.periodic_job(j) for j in jobs]
        self._current = {pj.name: pj for pj in pjs}
        return self.model(pjs)

    def update(self, changed: Mapping[str, PlacedJob | None], *, alongside: Callable[[], Any] | None = None) -> dict[str, float]:
        """The incremental form of a call: only the jobs started, stopped or re-placed since the last call.

        ``changed`` maps each such job's name to its placement now (``None``:
        it stopped), in the order of the changes (a job's last change counts);
        the iteration times the change refreshed come back, and every other job
        keeps its answer. The same answers as calling with the whole new set,
        listed in the order the jobs (re)started, at a cost that grows with the
        change instead of the number of running jobs. ``alongside``: the
        caller's work that runs while the model computes (see
        :meth:`emu.fluid.PeriodicFluidModel.update`).
        """
        added, removed = [], []
        for name, placed in changed.items():
            old = self._current.get(name)
            new = None if placed is None else self.periodic_job(placed)
            if new is old:
                continue
            if old is not None:
                removed.append(old)
                del self._current[name]
            if new is not None:
                added.append(new)
                self._current[name] = new
        return self.model.update(added, removed, alongside=alongside)


class EmuSlowdown:
    """Mean iteration times from :func:`emu.sim.simulate` (full flow level); slow, for validation."""

    def __init__(self, topo: Topology, specs: Mapping[str, Any], *, iterations: int = 4, routing: str = "rail"):
        self.topo, self.specs, self.iterations, self.routing = topo, specs, iterations, routing

    def __call__(self, jobs: Sequence[PlacedJob]) -> dict[str, float]:
        from emu.sim import simulate
        from emu.workload import CollectivePhase, ComputePhase, Job, Workload

        from .profiles import dp_groups

        out: dict[str, float] = {}
        wl = []
        for j in jobs:
            spec = self.specs[j.name]
            p = j.profile
            phases: list[Any] = [ComputePhase("compute", spec.compute_s)]
            if spec.grad_bytes > 0 and spec.dp > 1:
                for t, group in enumerate(dp_groups(list(p.gpus), spec.tp, spec.pp)):
                    phases.append(CollectivePhase(f"allreduce{t}", "all_reduce", spec.grad_bytes / (spec.tp * spec.pp), algorithm=spec.algorithm,
                                                  group=tuple(group), after=("compute",)))
            offset = (j.phase_s % p.period_s) if p.period_s > 0 else 0.0
            wl.append(Job(j.name, tuple(p.gpus), tuple(phases), iterations=self.iterations, start_offset=offset, routing=self.routing))
        res = simulate(self.topo, Workload("placement-check", wl), record_flows=False, track_links="none")
        for name, r in res.jobs.items():
            times = r.iteration_times()
            out[name] = float(np.mean(times[1:] or times))
        return out
