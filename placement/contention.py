"""Iteration slowdowns of concurrent jobs that share network links.

A *slowdown model* is a callable ``model(jobs) -> {job: mean iteration time (s)}``
over :class:`PlacedJob` (a job's :class:`~placement.profiles.CommProfile` and
its absolute phase). The replay simulator (:mod:`placement.replay`) calls one
for every set of jobs linked by shared links, so any flow-level backend can
stand behind it.

:class:`FluidSlowdown` (the default)
    emu's fluid max-min sharing applied at job granularity: every job
    alternates compute (no traffic) and a communication phase that, alone,
    lasts ``comm_s`` and loads each of its network links at its profile rate;
    while several jobs communicate, their progress is the max-min fair
    allocation under the link capacities, found by progressive filling with
    the per-link demands as coefficients (:func:`progress_rates`; emu's solver
    :func:`emu.sim_maxmin.maxmin_rates` is the unit-coefficient case), each job
    capped at its isolated speed. Between events rates are constant, so the
    simulation is exact for this fluid model. It runs a few iterations from
    the jobs' phases and reports the mean iteration time after the first.
    Simplification: a collective's steps are merged into one phase of average
    rates (emu runs them step by step).
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

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

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
    parent = list(range(len(jobs)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[Edge, int] = {}
    for i, j in enumerate(jobs):
        if j.profile.comm_s <= 0:
            continue
        for e in j.profile.link_rates:
            if e in owner:
                a, b = find(i), find(owner[e])
                if a != b:
                    parent[a] = b
            else:
                owner[e] = i
    groups: dict[int, list[PlacedJob]] = {}
    for i, j in enumerate(jobs):
        groups.setdefault(find(i), []).append(j)
    return list(groups.values())


def _capacity(capacity: Mapping[Edge, float] | Topology, jobs: Sequence[PlacedJob]) -> dict[Edge, float]:
    if isinstance(capacity, Topology):
        g = capacity.graph
        return {e: float(g.edges[e]["bw"]) for j in jobs for e in j.profile.link_rates}
    return dict(capacity)


class FluidSlowdown:
    """Job-level fluid simulation with emu's max-min solver (see the module docstring)."""

    def __init__(self, capacity: Mapping[Edge, float] | Topology, *, iterations: int = 4, phase_quantum: float = 0.025,
                 cache_limit: int = 200_000):
        self.capacity = capacity
        self.iterations = max(2, iterations)
        self.phase_quantum = phase_quantum
        self.cache: dict[tuple, dict[str, float]] = {}
        self.cache_limit = cache_limit
        self.calls = self.hits = 0

    def __call__(self, jobs: Sequence[PlacedJob]) -> dict[str, float]:
        out: dict[str, float] = {}
        for comp in link_components(jobs):
            if len(comp) == 1:
                j = comp[0]
                out[j.name] = j.profile.period_s
                continue
            out.update(self._component(comp))
        return out

    def _key(self, comp: Sequence[PlacedJob]) -> tuple[tuple, list[str]]:
        """A name- and link-free key: the fluid simulation depends only on the jobs' timings, quantised phases and
        the distinct columns (per-link demands of every job, capacity) of the demand matrix."""
        bins = max(1, round(1 / self.phase_quantum))
        rows = []
        for j in comp:
            p = j.profile
            q = round((j.phase_s % p.period_s) / p.period_s * bins) % bins if p.period_s > 0 else 0
            rows.append((round(p.compute_s, 9), round(p.comm_s, 9), q, tuple(sorted(round(r, 6) for r in p.link_rates.values())), j.name))
        rows.sort()
        pos = {r[4]: i for i, r in enumerate(rows)}
        cap = _capacity(self.capacity, comp)
        users: dict[Edge, list[tuple[int, float]]] = {}
        for j in comp:
            for e, r in j.profile.link_rates.items():
                users.setdefault(e, []).append((pos[j.name], round(r, 6)))
        columns = frozenset((tuple(sorted(u)), round(cap[e], 6)) for e, u in users.items())
        return (tuple(r[:3] for r in rows), columns), [r[4] for r in rows]

    def _component(self, comp: Sequence[PlacedJob]) -> dict[str, float]:
        self.calls += 1
        key, order = self._key(comp)
        hit = self.cache.get(key)
        if hit is not None:
            self.hits += 1
            return {name: hit[i] for i, name in enumerate(order)}
        times = simulate_fluid(comp, _capacity(self.capacity, comp), iterations=self.iterations)
        if len(self.cache) > self.cache_limit:
            self.cache.clear()
        self.cache[key] = [times[name] for name in order]
        return times


def progress_rates(demand: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """Max-min fair progress ``x`` (0..1 of the isolated speed) of jobs with per-link demands ``demand[j, l]`` (GB/s).

    Progressive filling with coefficients: every unfrozen job's progress rises
    together until a link saturates (``sum_j demand[j, l] * x[j] = capacity[l]``)
    or it reaches its isolated speed (1); jobs on saturated links freeze.

    >>> progress_rates(np.array([[10.0, 1.0], [10.0, 0.0], [0.0, 4.0]]), np.array([10.0, 4.0])).tolist()
    [0.5, 0.5, 0.875]
    """
    n = demand.shape[0]
    x = np.zeros(n)
    active = demand.sum(axis=1) > 0
    x[~active] = 1.0
    while active.any():
        used = demand[~active].T @ x[~active] if (~active).any() else np.zeros(demand.shape[1])
        slope = demand[active].sum(axis=0)
        with np.errstate(divide="ignore", invalid="ignore"):
            level = np.where(slope > 0, (capacity - used) / slope, np.inf)
        t = min(1.0, float(level.min()))
        t = max(t, 0.0)
        x[active] = t
        if t >= 1.0:
            break
        saturated = level <= t * (1 + 1e-9) + 1e-12
        freeze = active & (demand[:, saturated] > 0).any(axis=1)
        active &= ~freeze
    return x


def simulate_fluid(comp: Sequence[PlacedJob], capacity: Mapping[Edge, float], *, iterations: int = 6) -> dict[str, float]:
    """Mean iteration time (iterations 2..n) of each job, alternating compute and max-min-shared communication."""
    n = len(comp)
    profiles = [j.profile for j in comp]
    links = sorted({e for p in profiles for e in p.link_rates}, key=lambda e: (str(e[0]), str(e[1]), str(e[2])))
    lidx = {e: i for i, e in enumerate(links)}
    cap_arr = np.array([capacity[e] for e in links], dtype=float)
    dem = np.zeros((n, len(links)))
    for i, p in enumerate(profiles):
        for e, r in p.link_rates.items():
            dem[i, lidx[e]] = r
    # links that carry the same jobs at the same demands and capacity constrain alike: keep one of each
    _, keep = np.unique(np.vstack([dem, cap_arr[None, :]]).T.round(9), axis=0, return_index=True)
    dem, cap_arr = dem[:, keep], cap_arr[keep]
    comm_len = np.array([p.comm_s for p in profiles])
    # state: 0 = before its first start, 1 = computing until t_end, 2 = communicating on shared links (remaining
    # isolated seconds), 3 = communicating on links no other job uses (until t_end)
    start = np.array([(j.phase_s % p.period_s) if p.period_s > 0 else 0.0 for j, p in zip(comp, profiles, strict=True)])
    mode = np.zeros(n, dtype=int)
    t_end = start.copy()
    remaining = np.zeros(n)
    done = np.zeros(n, dtype=int)
    iter_start = start.copy()
    durations: list[list[float]] = [[] for _ in range(n)]
    t = 0.0
    rate_cache: dict[bytes, np.ndarray] = {}  # the set of communicating jobs repeats from iteration to iteration
    eps = 1e-12
    for _guard in range(200_000):
        if (done >= iterations).all():
            break
        live = np.ones(n, dtype=bool)  # every job keeps running (and contending) until all have done their iterations
        comm = (mode == 2) & live
        x = np.zeros(n)
        if comm.any():
            k = comm.tobytes()
            sub = rate_cache.get(k)
            if sub is None:
                sub = rate_cache[k] = progress_rates(dem[comm], cap_arr)
            x[comm] = sub
        # next event: a compute/idle phase ending, or a communication finishing at the current rates
        waits = np.where(live & (mode != 2), t_end - t, np.inf)
        with np.errstate(divide="ignore", invalid="ignore"):
            fin = np.where(comm & (x > 0), remaining / x, np.inf)
        dt = float(min(waits.min(), fin.min()))
        if not math.isfinite(dt):
            break
        dt = max(dt, 0.0)
        t += dt
        remaining[comm] -= x[comm] * dt
        timer = live & (mode != 2) & (t_end - t <= eps)
        finished = comm & (remaining <= eps * np.maximum(1.0, comm_len))
        for i in np.flatnonzero(timer | finished):
            if mode[i] == 1 and comm_len[i] > 0:  # compute done: communicate
                if dem[i].any():
                    mode[i], remaining[i] = 2, comm_len[i]
                else:
                    mode[i], t_end[i] = 3, t + comm_len[i]  # on links no other job uses: its isolated time
                continue
            if mode[i] != 0:  # an iteration ends (communication done, or compute of a job that does not communicate)
                durations[i].append(t - iter_start[i])
                done[i] += 1
            mode[i], t_end[i], iter_start[i] = 1, t + profiles[i].compute_s, t
    out = {}
    for i, p in enumerate(profiles):
        d = durations[i][1:] or durations[i] or [p.period_s]
        out[p.job] = float(np.mean(d))
    return out


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
                for t, group in enumerate(dp_groups(list(p.gpus), spec.tp)):
                    phases.append(CollectivePhase(f"allreduce{t}", "all_reduce", spec.grad_bytes / spec.tp, algorithm=spec.algorithm,
                                                  group=tuple(group), after=("compute",)))
            offset = (j.phase_s % p.period_s) if p.period_s > 0 else 0.0
            wl.append(Job(j.name, tuple(p.gpus), tuple(phases), iterations=self.iterations, start_offset=offset, routing=self.routing))
        res = simulate(self.topo, Workload("placement-check", wl), record_flows=False, track_links="none")
        for name, r in res.jobs.items():
            times = r.iteration_times()
            out[name] = float(np.mean(times[1:] or times))
        return out
