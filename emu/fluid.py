"""Job-level fluid simulation of periodic training jobs that share network links.

The model (the one CASSINI's circles describe, made dynamic):

- job ``j`` repeats iterations of ``compute_s`` seconds of compute (no
  traffic) followed by a communication phase that, alone, lasts ``comm_s``
  seconds and loads every link ``l`` it uses at ``demand[j][l]`` (capacity
  units, e.g. GB/s);
- while communicating, a job advances at a *progress rate* ``x_j`` in
  ``[0, 1]`` (the fraction of its isolated speed) and loads link ``l`` at
  ``demand[j][l] * x_j``; the phase ends when ``x_j`` integrated over time
  reaches ``comm_s``;
- the progress rates of the jobs communicating at any moment are the max-min
  fair allocation under ``sum_j demand[j][l] * x_j <= capacity[l]`` and
  ``x_j <= 1``: progressive filling with per-entry coefficients,
  :func:`emu.sim_maxmin.maxmin_rates_coo` with ``coef=demand``;
- job ``j`` starts its first iteration at ``phase_s mod period_s`` (its time
  shift); every job keeps iterating, and contending, until every job has
  finished ``iterations`` iterations. The result per job is the mean duration
  of its iterations after the first.

Between events (a compute phase ending, a communication phase ending) the rates
are constant, so the simulation is exact for this fluid model: no time step.

Fairness is per job progress, not per byte: two jobs that load a shared link
with different demands get equal *progress*, where :func:`emu.sim.simulate`
(which shares every link per flow) gives their flows equal bytes per second.
The two agree when the jobs' flows on their shared bottlenecks carry equal
demands (``tests/test_sim_fluid.py`` checks them against each other). A
collective is one phase of average per-link rates here; emu.sim runs it step
by step.

Speed (:func:`simulate_periodic`; all exact, the result is the same as the
dense :func:`simulate_periodic_reference` up to rounding):

- a link whose users' demands sum to at most its capacity can never saturate
  (``x <= 1``) and is dropped; a link with one user becomes a cap on that
  user's progress (as does any link whose capacity is below one user's demand);
  of several links with the same users, demands and capacity one is kept;
- the max-min allocation decomposes over the connected components of the
  communicating jobs linked by the remaining (*binding*) links that their
  current users overload (a link whose communicating users' demands fit
  cannot saturate), so an event re-solves only the component of the job that
  started or stopped communicating;
- a component's rates depend only on which jobs are in it: they are memoised
  for the run (a periodic schedule brings the same sets back every iteration);
- the event loop also exists in C (``csrc/fluid.c``, ``engine="auto"`` uses it
  when built): same events, same order, same tolerances, 4-34x faster.

:class:`PeriodicFluidModel` adds the split of a job set into independent
groups (jobs linked by binding links, :func:`binding_components`) and a cache
of group results, for callers such as the placement replay that ask about the
same groups again and again.

>>> e = "uplink"
>>> a = PeriodicJob("a", compute_s=0.05, comm_s=0.05, demand={e: 10.0})
>>> b = PeriodicJob("b", compute_s=0.05, comm_s=0.05, demand={e: 10.0})
>>> {k: round(v, 6) for k, v in iteration_times([a, b], {e: 10.0}).items()}   # in phase: both at half speed
{'a': 0.15, 'b': 0.15}
>>> b_shifted = PeriodicJob("b", compute_s=0.05, comm_s=0.05, demand={e: 10.0}, phase_s=0.05)
>>> {k: round(v, 6) for k, v in iteration_times([a, b_shifted], {e: 10.0}).items()}   # interleaved: no slowdown
{'a': 0.1, 'b': 0.1}
"""

from __future__ import annotations

import ctypes
import heapq
import math
import os
import weakref
from array import array
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Any

import numpy as np

from topology.clib import library_path, load_library

from .sim_maxmin import maxmin_rates_coo

Link = Hashable


@dataclass(frozen=True)
class PeriodicJob:
    """A job that alternates ``compute_s`` of compute and a communication phase (``comm_s`` alone, loading ``demand``).

    ``demand`` maps each link to the load (capacity units) of the communication
    phase at isolated speed. ``phase_s``: when (mod the period) its iterations start.
    """

    name: str
    compute_s: float
    comm_s: float
    demand: Mapping[Link, float] = field(default_factory=dict)
    phase_s: float = 0.0

    @property
    def period_s(self) -> float:
        return self.compute_s + self.comm_s

    def start_s(self) -> float:
        """The first iteration's start: the phase folded into ``[0, period)``."""
        return (self.phase_s % self.period_s) if self.period_s > 0 else 0.0


@dataclass
class PeriodicRun:
    """The outcome of :func:`simulate_periodic`: per job the end time of every finished iteration, and counters.

    ``means``: each job's mean iteration time, set instead of the communicating
    jobs' ``ends`` when the C loop was asked for means only (the incremental
    model's simulations; ``_simulate(..., means_only=True)``).
    """

    names: list[str]
    starts: list[float]
    ends: list[list[float]]
    events: int = 0
    solves: int = 0
    memo_hits: int = 0
    engine: str = ""  # "python" or "c": which event loop ran (empty when no job communicates)
    means: list[float] | None = None

    def iteration_durations(self, i: int) -> list[float]:
        marks = [self.starts[i], *self.ends[i]]
        return [b - a for a, b in zip(marks, marks[1:], strict=False)]

    def mean_iteration_s(self) -> dict[str, float]:
        """Mean duration of each job's iterations after the first (all of them if it finished only one)."""
        if self.means is not None:
            return dict(zip(self.names, self.means, strict=True))
        return {name: _mean_after_first(self.starts[i], self.ends[i]) for i, name in enumerate(self.names)}


def _mean_after_first(start: float, ends: Sequence[float]) -> float:
    """The mean duration of the iterations after the first that end at ``ends`` (the first one's if it is the only one),
    with the floats of ``np.mean`` over the durations: below eight terms numpy adds them one by one, as ``sum`` does."""
    marks = ends if len(ends) > 1 else [start, *ends]
    d = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    if not d:
        return math.nan
    return sum(d) / len(d) if len(d) < 8 else float(np.mean(d))


def _validate(jobs: Sequence[PeriodicJob], capacity: Mapping[Link, float], iterations: int) -> None:
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    names = [j.name for j in jobs]
    if len(set(names)) != len(names):
        raise ValueError("job names must be unique")
    for j in jobs:
        _check_timings(j)
        for link, d in j.demand.items():
            if not 0.0 <= d < math.inf:
                raise _demand_error(j, link, d)
            if d > 0:
                _check_capacity(j, link, capacity)


def _check_timings(j: PeriodicJob) -> None:
    if not (0.0 <= j.compute_s < math.inf and 0.0 <= j.comm_s < math.inf):
        raise ValueError(f"job {j.name}: compute_s and comm_s must be finite and >= 0")


def _demand_error(j: PeriodicJob, link: Link, d: float) -> ValueError:
    return ValueError(f"job {j.name}: demand on {link!r} must be finite and >= 0, got {d}")


def _check_capacity(j: PeriodicJob, link: Link, capacity: Mapping[Link, float]) -> None:
    """That ``link``, loaded by ``j``, has a positive capacity."""
    if link not in capacity:
        raise ValueError(f"job {j.name}: link {link!r} has no capacity")
    if not capacity[link] > 0:
        raise ValueError(f"job {j.name}: link {link!r} has capacity {capacity[link]}, expected > 0")


def _users(jobs: Sequence[PeriodicJob]) -> dict[Link, list[tuple[int, float]]]:
    users: dict[Link, list[tuple[int, float]]] = {}
    for i, j in enumerate(jobs):
        if j.comm_s <= 0:
            continue
        for link, d in j.demand.items():
            if d > 0:
                users.setdefault(link, []).append((i, float(d)))
    return users


_SMALL = 12  # below this many communicating jobs, plain-Python filling beats numpy's per-call overhead


def _fill_progress(links: list[list[tuple[int, float]]], capacity: Sequence[float], own: list[float]) -> list[float]:
    """Max-min progress of a few jobs: ``links[p]`` = (link, demand) pairs of job ``p``, progress capped at ``own[p]``.

    Progressive filling with coefficients in plain Python (all weights 1, so
    every unfrozen job sits at the same level); the same allocation as
    :func:`emu.sim_maxmin.maxmin_rates_coo` with ``coef`` and ``cap=own``,
    with its tolerances.
    """
    m = len(links)
    x = [0.0] * m
    residual = {k: capacity[k] for ls in links for k, _ in ls}
    active = [p for p in range(m) if links[p]]
    for p in range(m):
        if not links[p]:
            x[p] = own[p]
    level = 0.0
    while active:
        load: dict[int, float] = {}
        for p in active:
            for k, d in links[p]:
                load[k] = load.get(k, 0.0) + d
        step = min(own[p] - level for p in active)
        for k, w in load.items():
            step = min(step, residual[k] / w)
        step = max(step, 0.0)
        level += step
        saturated = set()
        for k, w in load.items():
            residual[k] -= step * w
            if residual[k] <= 1e-9 * capacity[k]:
                residual[k] = 0.0
                saturated.add(k)
        still = []
        for p in active:
            if own[p] - level <= 1e-9 * abs(own[p]) or any(k in saturated for k, _ in links[p]):
                x[p] = level
            else:
                still.append(p)
        active = still
    return x


def _own_caps(n: int, users: Mapping[Link, list[tuple[int, float]]], capacity: Mapping[Link, float]) -> list[float]:
    """Each job's progress limit alone on its links: ``min(1, capacity / demand)`` over them."""
    own = [1.0] * n
    for link, us in users.items():
        c = capacity[link]
        for i, d in us:
            if d > c:
                own[i] = min(own[i], c / d)
    return own


def binding_links(jobs: Sequence[PeriodicJob], capacity: Mapping[Link, float]) -> dict[Link, list[tuple[int, float]]]:
    """Links shared by several communicating jobs whose demands sum above the capacity: the only ones that can couple jobs.

    Returns ``{link: [(job index, demand), ...]}``. A link left out never
    saturates while its users communicate at most at their isolated speed.
    """
    return {link: us for link, us in _users(jobs).items() if _can_saturate([d for _, d in us], capacity[link])}


def binding_components(jobs: Sequence[PeriodicJob], capacity: Mapping[Link, float]) -> list[list[int]]:
    """Indices of ``jobs`` grouped by binding links (directly or through other jobs); each group evolves independently.

    >>> a = PeriodicJob("a", 0.1, 0.1, {"l": 6.0})
    >>> b = PeriodicJob("b", 0.1, 0.1, {"l": 6.0, "m": 1.0})
    >>> c = PeriodicJob("c", 0.1, 0.1, {"m": 1.0})
    >>> binding_components([a, b, c], {"l": 10.0, "m": 10.0})   # m can never saturate
    [[0, 1], [2]]
    """
    return connected_groups(len(jobs), ([i for i, _ in us] for us in binding_links(jobs, capacity).values()))


def connected_groups(n: int, shared: Iterable[Sequence[int]]) -> list[list[int]]:
    """Indices ``0..n-1`` grouped so that the members of every set in ``shared`` end up together (union-find),
    each group in increasing order, groups in order of their smallest member.

    >>> connected_groups(5, [[0, 3], [3, 4]])
    [[0, 3, 4], [1], [2]]
    """
    parent = list(range(n))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for members in shared:
        members = list(members)
        if not members:
            continue
        root = find(members[0])
        for i in members[1:]:
            r = find(i)
            if r != root:
                parent[r] = root
    groups: dict[int, list[int]] = {}
    for i in range(n):
        groups.setdefault(find(i), []).append(i)
    return list(groups.values())


def _can_saturate(demands: Sequence[float], capacity: float) -> bool:
    """Whether a link with these users' demands can saturate: several users whose demands sum above its capacity
    (a job alone is capped by its own links instead, and demands that fit never saturate it since ``x <= 1``)."""
    if len(demands) < 2:
        return False
    total = 0.0  # summed left to right (Python 3.12's sum() of floats is compensated; the C core adds plainly)
    for d in demands:
        total += d
    return total > capacity


@dataclass
class _Coupling:
    """The links that can couple jobs, numbered: the input of both event loops."""

    own_cap: list[float]                   # per job: its progress limit alone on its links
    cap_list: list[float]                  # per binding link: capacity
    job_links: list[list[tuple[int, float]]]  # per job: (binding link, demand)
    link_users: list[list[int]]            # per binding link: its jobs

    @classmethod
    def of(cls, own_cap: list[float], links: Iterable[tuple[float, list[tuple[int, float]]]]) -> _Coupling:
        """From candidate links, each ``(capacity, [(job, demand), ...])``: the binding ones, numbered; links that carry
        the same jobs at the same demands and have the same capacity constrain alike, so one of each is kept (a ring
        over eight rails loads eight such links)."""
        distinct: dict[tuple, tuple[float, list[tuple[int, float]]]] = {}
        for cap, us in links:
            if _can_saturate([d for _, d in us], cap):
                us = sorted(us)
                distinct.setdefault((tuple(us), cap), (float(cap), us))
        job_links: list[list[tuple[int, float]]] = [[] for _ in own_cap]
        for k, (_, us) in enumerate(distinct.values()):
            for i, d in us:
                job_links[i].append((k, d))
        return cls(own_cap, [cap for cap, _ in distinct.values()], job_links, [[i for i, _ in us] for _, us in distinct.values()])


def _coupling(jobs: Sequence[PeriodicJob], capacity: Mapping[Link, float]) -> _Coupling:
    users = _users(jobs)
    return _Coupling.of(_own_caps(len(jobs), users, capacity), ((capacity[link], us) for link, us in users.items()))


ENGINES = ("auto", "python", "c")


def simulate_periodic(jobs: Sequence[PeriodicJob], capacity: Mapping[Link, float], *, iterations: int = 4,
                      rate_memo: dict[tuple, list[float]] | None = None, job_keys: Sequence[Hashable] | None = None,
                      watch: Sequence[int] | None = None, engine: str = "auto") -> PeriodicRun:
    """Event-driven simulation of the fluid model (see the module docstring) until every job has done ``iterations``.

    Jobs without communication (``comm_s == 0``) are not simulated: their
    iterations are their compute time. ``watch`` (indices; default all
    jobs): the run ends once these jobs have done ``iterations`` (the others'
    answers then average fewer iterations).

    ``engine``: ``"python"`` (the reference loop), ``"c"`` (the same loop in
    ``csrc/fluid.c``, built by ``make``; same events and tolerances, rounding
    aside), or ``"auto"`` (C when its library is built, else Python;
    :func:`fluid_engine` says which). ``rate_memo`` (with ``job_keys``, one
    sortable key per job that names its demands for good), Python loop only:
    the progress rates of sets of communicating jobs, shared between runs; the
    max-min rates of a set depend only on its jobs' demands and the
    capacities, so a later run over some of the same jobs reuses them. The C
    loop solves every set afresh (microseconds each).
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    _validate(jobs, capacity, iterations)
    return _simulate(jobs, _coupling(jobs, capacity), iterations=iterations, rate_memo=rate_memo, job_keys=job_keys, watch=watch,
                     engine=engine)


def _simulate(jobs: Sequence[PeriodicJob], coupling: _Coupling, *, iterations: int, rate_memo: dict[tuple, list[float]] | None = None,
              job_keys: Sequence[Hashable] | None = None, watch: Sequence[int] | None = None, engine: str = "auto",
              means_only: bool = False) -> PeriodicRun:
    """:func:`simulate_periodic` of validated jobs whose coupling is already known; ``means_only``: when the C loop runs,
    it returns the mean iteration times (``run.means``) instead of the iteration ends."""
    n = len(jobs)
    starts = [j.start_s() for j in jobs]
    run = PeriodicRun([j.name for j in jobs], starts, [[] for _ in range(n)])
    sim = [i for i, j in enumerate(jobs) if j.comm_s > 0]
    for i, j in enumerate(jobs):
        if j.comm_s <= 0:
            run.ends[i] = [starts[i] + j.compute_s * (k + 1) for k in range(iterations)]
    if not sim:
        return run
    use_c = engine == "c" or (engine == "auto" and _c_engine() is not None)
    if watch is not None and not any(jobs[i].comm_s > 0 for i in watch):
        return run  # the watched jobs do not communicate: their compute-only iterations are known already
    if use_c:
        _simulate_c(jobs, coupling, starts, iterations, watch, run, means_only)
        return run
    run.engine = "python"
    compute = [j.compute_s for j in jobs]
    comm = [j.comm_s for j in jobs]
    own_cap, cap_list, job_links, link_users = coupling.own_cap, coupling.cap_list, coupling.job_links, coupling.link_users
    cap_arr = np.array(cap_list)
    nbrs: list[set[int]] = [set() for _ in range(n)]
    for members in link_users:
        for i in members:
            nbrs[i].update(members)
    for i in range(n):
        nbrs[i].discard(i)
    # demand of the jobs communicating right now, per binding link: a link whose current users' demands fit its
    # capacity cannot saturate (x <= 1), so it couples nobody at this moment
    comm_load = [0.0] * len(cap_list)

    comm_set: set[int] = set()
    x = [0.0] * n
    rem = [0.0] * n
    last = [0.0] * n
    ver = [0] * n
    state = [0] * n  # 0 before the first start, 1 computing, 2 communicating
    iter_start = list(starts)
    memo: dict[tuple, list[float]] = {} if rate_memo is None else rate_memo
    keys: Sequence[Hashable] = range(n) if job_keys is None else job_keys
    heap: list[tuple[float, int, int, int]] = []
    seq = 0
    for i in sim:
        heap.append((starts[i], seq, i, 0))
        seq += 1
    heapq.heapify(heap)
    watched = [False] * n
    for i in (sim if watch is None else watch):
        watched[i] = jobs[i].comm_s > 0
    remaining_jobs = sum(watched)
    counts = [0] * n

    def component(seed: int) -> list[int]:
        """The communicating jobs coupled to ``seed`` through links that their current demands overload."""
        comp, stack = {seed}, [seed]
        while stack:
            for k, _ in job_links[stack.pop()]:
                if comm_load[k] > cap_list[k]:
                    for q in link_users[k]:
                        if q not in comp and q in comm_set:
                            comp.add(q)
                            stack.append(q)
        return sorted(comp)

    def rates(comp: list[int]) -> list[float]:
        """Max-min progress rates of the communicating component ``comp`` (sorted indices), aligned with it."""
        if len(comp) == 1:
            return [own_cap[comp[0]]]
        if job_keys is None:
            ordered, key = comp, tuple(comp)
        else:  # in key order: the same set of jobs may carry other indices in another run
            ordered = sorted(comp, key=keys.__getitem__)
            key = tuple(keys[i] for i in ordered)
        hit = memo.get(key)
        if hit is None:
            run.solves += 1
            # the component's overloaded links only: the rates of a set of jobs depend on that set alone
            active = [[(k, d) for k, d in job_links[i] if comm_load[k] > cap_list[k]] for i in ordered]
            ef, el, co = [], [], []
            if len(ordered) > _SMALL:
                for pos, ls in enumerate(active):
                    for k, d in ls:
                        ef.append(pos)
                        el.append(k)
                        co.append(d)
            if len(ordered) <= _SMALL:
                hit = _fill_progress(active, cap_list, [own_cap[i] for i in ordered])
            else:
                uniq, local = np.unique(np.asarray(el, dtype=np.intp), return_inverse=True)
                hit = maxmin_rates_coo(np.asarray(ef, dtype=np.intp), local, len(ordered), cap_arr[uniq],
                                       cap=np.array([own_cap[i] for i in ordered]), coef=np.asarray(co)).tolist()
            memo[key] = hit
        else:
            run.memo_hits += 1
        if ordered is comp:
            return hit
        by = dict(zip(ordered, hit, strict=True))
        return [by[i] for i in comp]

    def resolve(seeds: Sequence[int], t: float, new: int = -1) -> None:
        """Re-solve the components of ``seeds`` among the communicating jobs; reschedule the jobs whose rate changed."""
        nonlocal seq
        done: set[int] = set()
        for s in seeds:
            if s in done or s not in comm_set:
                continue
            comp = component(s)
            done.update(comp)
            for i, r in zip(comp, rates(comp), strict=True):
                if r == x[i] and i != new:
                    continue  # its pending completion stays valid
                rem[i] = max(rem[i] - x[i] * (t - last[i]), 0.0)
                last[i] = t
                x[i] = r
                ver[i] += 1
                if r > 0:
                    heapq.heappush(heap, (t + rem[i] / r, seq, i, ver[i]))
                    seq += 1

    stop = math.inf  # once every job is done: finish the events of that same instant, then stop
    while heap:
        t, _, i, v = heapq.heappop(heap)
        if t > stop:
            break
        if v != ver[i]:
            continue
        run.events += 1
        if state[i] == 2:  # communication done: the iteration ends, the next compute starts
            comm_set.discard(i)
            for k, d in job_links[i]:
                comm_load[k] -= d
            x[i] = 0.0
            run.ends[i].append(t)
            counts[i] += 1
            if counts[i] == iterations and watched[i]:
                remaining_jobs -= 1
                if not remaining_jobs:
                    stop = t + 1e-12
            iter_start[i] = t
            state[i] = 1
            ver[i] += 1
            heapq.heappush(heap, (t + compute[i], seq, i, ver[i]))
            seq += 1
            resolve(sorted(nbrs[i] & comm_set), t)
        elif state[i] == 1:  # compute done: communicate
            state[i] = 2
            comm_set.add(i)
            for k, d in job_links[i]:
                comm_load[k] += d
            rem[i], last[i], x[i] = comm[i], t, 0.0
            resolve([i], t, new=i)
        else:  # first start
            state[i] = 1
            ver[i] += 1
            heapq.heappush(heap, (t + compute[i], seq, i, ver[i]))
            seq += 1
    return run


def simulate_periodic_reference(jobs: Sequence[PeriodicJob], capacity: Mapping[Link, float], *, iterations: int = 4) -> PeriodicRun:
    """The same model simulated densely, without the shortcuts of :func:`simulate_periodic`.

    Every event re-solves the progress of *all* communicating jobs on *all*
    their links, and all jobs advance together to the next event (the
    placement planner's original job-level simulation). Slow on large job
    sets; it is the oracle of the tests and the baseline of the benchmark.
    """
    _validate(jobs, capacity, iterations)
    n = len(jobs)
    starts = [j.start_s() for j in jobs]
    run = PeriodicRun([j.name for j in jobs], starts, [[] for _ in range(n)])
    for i, j in enumerate(jobs):
        if j.comm_s <= 0:
            run.ends[i] = [starts[i] + j.compute_s * (k + 1) for k in range(iterations)]
    sim = np.array([j.comm_s > 0 for j in jobs])
    if not sim.any():
        return run
    links = list(dict.fromkeys(link for j in jobs for link, d in j.demand.items() if d > 0))
    lidx = {link: k for k, link in enumerate(links)}
    cap_arr = np.array([float(capacity[link]) for link in links])
    dem = np.zeros((n, len(links)))
    for i, j in enumerate(jobs):
        for link, d in j.demand.items():
            if d > 0:
                dem[i, lidx[link]] = d
    compute = np.array([j.compute_s for j in jobs])
    comm_len = np.array([j.comm_s for j in jobs])
    mode = np.zeros(n, dtype=int)  # 0 before the first start, 1 computing until t_end, 2 communicating
    t_end = np.array(starts, dtype=float)
    remaining = np.zeros(n)
    counts = np.where(sim, 0, iterations)
    t, eps = 0.0, 1e-12
    while (counts < iterations).any():
        comm = (mode == 2) & sim
        x = np.zeros(n)
        if comm.any():
            sub = dem[comm]
            ef, el = np.nonzero(sub)
            x[comm] = maxmin_rates_coo(ef, el, int(comm.sum()), cap_arr, cap=np.ones(int(comm.sum())), coef=sub[ef, el])
            run.solves += 1
        waits = np.where(sim & (mode != 2), t_end - t, np.inf)
        with np.errstate(divide="ignore", invalid="ignore"):
            fin = np.where(comm & (x > 0), remaining / x, np.inf)
        dt = max(float(min(waits.min(), fin.min())), 0.0)
        if not math.isfinite(dt):
            raise RuntimeError("fluid simulation stalled: a communicating job gets no capacity")
        t += dt
        remaining[comm] -= x[comm] * dt
        timer = sim & (mode != 2) & (t_end - t <= eps)
        finished = comm & (remaining <= eps * np.maximum(1.0, comm_len))
        for i in np.flatnonzero(timer | finished):
            run.events += 1
            if mode[i] == 1:  # compute done: communicate
                mode[i], remaining[i] = 2, comm_len[i]
                continue
            if mode[i] == 2:  # communication done: the iteration ends
                run.ends[i].append(t)
                counts[i] += 1
            mode[i], t_end[i] = 1, t + compute[i]
    return run


# ------------------------------------------------------------------ the C event loop (csrc/fluid.c) --
# the fewest jobs joining and leaving for which an update runs on the worker thread beside ``alongside``: a lone job's update
# is mostly a cache hit of microseconds, less than handing it over costs (the thread's wake-up); never with one core to run on
_BESIDE_FROM = 2 if len(os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)) > 1 else math.inf
FLUID_ABI = 4  # the nw_fluid_version() this module speaks
_LIB_NAME = "libnetweave-fluid.so"
_lib_state: dict[str, Any] = {}


def fluid_library_path() -> Path:
    """Where the C event loop is looked for: ``$NETWEAVE_FLUID_LIB``, else ``csrc/build/`` of this checkout."""
    return library_path(_LIB_NAME, "NETWEAVE_FLUID_LIB")


def _c_engine() -> Any:
    """The loaded C library, or None when it is not built (or speaks another ABI); loaded once."""
    if "lib" not in _lib_state:
        lib, why = load_library(fluid_library_path(), "nw_fluid_version", FLUID_ABI)
        if lib is not None:  # pointers as addresses into numpy arrays (C-contiguous, of the C types; see _simulate_c)
            ptr, c_int = ctypes.c_void_p, ctypes.c_int
            lib.nw_fluid_simulate.restype = c_int
            lib.nw_fluid_simulate.argtypes = [c_int, ptr, ptr, ptr, ptr, ptr, c_int, c_int, ptr, ptr, ptr, ptr, ptr, ptr, c_int, ptr, ptr, ptr]
            lib.nw_fluid_simulate_means.restype = c_int
            lib.nw_fluid_simulate_means.argtypes = [c_int, ptr, ptr, ptr, ptr, ptr, c_int, c_int, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr]
            i64 = ctypes.c_int64
            lib.nw_fm_new.restype, lib.nw_fm_new.argtypes = ptr, [c_int, c_int, i64]
            lib.nw_fm_free.restype, lib.nw_fm_free.argtypes = None, [ptr]
            lib.nw_fm_add_link.restype, lib.nw_fm_add_link.argtypes = c_int, [ptr, ctypes.c_double]
            lib.nw_fm_counters.restype, lib.nw_fm_counters.argtypes = c_int, [ptr, ptr]
            lib.nw_fm_update.restype = c_int
            lib.nw_fm_update.argtypes = [ptr, c_int, ptr, c_int, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr]
            lib.nw_fw_new.restype, lib.nw_fw_new.argtypes = ptr, []
            lib.nw_fw_free.restype, lib.nw_fw_free.argtypes = None, [ptr]
            lib.nw_fw_update_start.restype = c_int
            lib.nw_fw_update_start.argtypes = [ptr, *lib.nw_fm_update.argtypes]
            lib.nw_fw_update_wait.restype, lib.nw_fw_update_wait.argtypes = c_int, [ptr]
        _lib_state["lib"], _lib_state["why"] = lib, why
    return _lib_state["lib"]


def fluid_engine() -> str:
    """Which loop ``engine="auto"`` runs: ``"c"``, or ``"python"`` with the reason the C library is not used.

    >>> fluid_engine().split(" ")[0] in ("c", "python")
    True
    """
    return "c" if _c_engine() is not None else f"python ({_lib_state['why']})"


def _run_beside(work: Callable[[], Any] | None) -> BaseException | None:
    """Run ``work`` (``PeriodicFluidModel.update``'s ``alongside``) and return what it raised, for the update to re-raise once
    its answers are taken in (the model stays whole)."""
    if work is None:
        return None
    try:
        work()
    except BaseException as e:  # noqa: BLE001 -- handed back, re-raised by the caller
        return e
    return None


def _csr(rows: Iterable[Iterable[tuple[int, float]]]) -> tuple[list[int], list[int], list[float]]:
    """Rows of ``(index, value)`` pairs as a CSR table: where each row starts (and the end), the indices, the values.

    >>> _csr([[(0, 1.5), (2, 0.5)], [], [(1, 2.0)]])
    ([0, 2, 2, 3], [0, 2, 1], [1.5, 0.5, 2.0])
    """
    ptr, idx, vals = [0], [], []
    for row in rows:
        for k, v in row:
            idx.append(k)
            vals.append(v)
        ptr.append(len(idx))
    return ptr, idx, vals


def _simulate_c(jobs: Sequence[PeriodicJob], coupling: _Coupling, starts: list[float], iterations: int,
                watch: Sequence[int] | None, run: PeriodicRun, means_only: bool = False) -> None:
    lib = _c_engine()
    if lib is None:
        raise RuntimeError(f"the C fluid engine is not available: {_lib_state['why']}")
    n = len(jobs)
    # the inputs laid end to end in one float64 and one int32 array (two conversions per call, not one per argument):
    # per job compute, comm, start and own cap, per link its capacity, per (job, link) the demand; the index arrays
    link_users, nl = coupling.link_users, len(coupling.cap_list)
    jl_ptr, jl_link, jl_dem = _csr(coupling.job_links)
    lu_ptr, lu_job = [0], []
    for us in link_users:
        lu_job.extend(us)
        lu_ptr.append(len(lu_job))
    floats = np.array([*(j.compute_s for j in jobs), *(j.comm_s for j in jobs), *starts, *coupling.own_cap, *coupling.cap_list, *jl_dem],
                      dtype=np.float64)
    ints = np.array([*jl_ptr, *jl_link, *lu_ptr, *lu_job], dtype=np.int32)
    fa, ia = floats.ctypes.data, ints.ctypes.data
    f_at = [fa + 8 * k for k in (0, n, 2 * n, 3 * n, 4 * n, 4 * n + nl)]  # compute, comm, start, own, cap, jl_dem
    i_at = [ia + 4 * k for k in (0, n + 1, n + 1 + len(jl_link), n + 1 + len(jl_link) + nl + 1)]  # jl_ptr, jl_link, lu_ptr, lu_job
    watched = np.zeros(n, dtype=np.uint8)
    for i in (range(n) if watch is None else watch):
        watched[i] = jobs[i].comm_s > 0
    count = np.zeros(n, dtype=np.int32)
    stats = np.zeros(2, dtype=np.int64)
    if means_only:  # the loop keeps every iteration end (growing its buffer) and hands back the means
        means = np.empty(n, dtype=np.float64)
        rc = lib.nw_fluid_simulate_means(n, f_at[0], f_at[1], f_at[2], f_at[3], watched.ctypes.data, iterations, nl, f_at[4], i_at[0],
                                         i_at[1], f_at[5], i_at[2], i_at[3], means.ctypes.data, count.ctypes.data, stats.ctypes.data)
        if rc != 0:
            raise RuntimeError(f"nw_fluid_simulate_means failed with code {rc} ({'out of memory' if rc == -2 else 'invalid arguments'})")
        run.means = means.tolist()
        for i, j in enumerate(jobs):
            if j.comm_s <= 0:  # not simulated: its compute-only iterations
                run.means[i] = _mean_after_first(starts[i], run.ends[i])
        run.events, run.solves, run.engine = int(stats[0]), int(stats[1]), "c"
        return
    periods = [j.period_s for j in jobs if j.comm_s > 0]
    # iterations a fast job finishes while a slow one does its own: a first guess, retried larger when short
    ends_cap = iterations * (2 + math.ceil(max(periods) / max(min(periods), 1e-300) if periods else 1)) + 2
    while True:
        ends = np.zeros(max(n * ends_cap, 1), dtype=np.float64)
        rc = lib.nw_fluid_simulate(n, f_at[0], f_at[1], f_at[2], f_at[3], watched.ctypes.data, iterations, nl, f_at[4], i_at[0], i_at[1],
                                   f_at[5], i_at[2], i_at[3], ends_cap, ends.ctypes.data, count.ctypes.data, stats.ctypes.data)
        if rc != 0:
            raise RuntimeError(f"nw_fluid_simulate failed with code {rc} ({'out of memory' if rc == -2 else 'invalid arguments'})")
        most = int(count.max())
        if most <= ends_cap:
            break
        ends_cap = most
    table = ends.reshape(n, ends_cap)
    for i, j in enumerate(jobs):
        if j.comm_s > 0:
            run.ends[i] = table[i, :count[i]].tolist()
    run.events, run.solves, run.engine = int(stats[0]), int(stats[1]), "c"


def iteration_times(jobs: Sequence[PeriodicJob], capacity: Mapping[Link, float], *, iterations: int = 4) -> dict[str, float]:
    """Mean iteration time of each job (its iterations after the first) under the fluid model; see the module docstring."""
    return simulate_periodic(jobs, capacity, iterations=iterations).mean_iteration_s()


class PeriodicFluidModel:
    """Mean iteration times of a changing set of jobs: independent groups, simulated only when they change.

    ``model(jobs) -> {name: mean iteration time}`` (names unique). Jobs are
    grouped by binding links (:func:`binding_components`); a group evolves
    independently of the others, so its answer is :func:`simulate_periodic`
    of the group alone, and a job alone in its group runs at its isolated
    speed capped by its own links (``period_s`` when its demands fit).

    The model is incremental: it remembers the job set of the previous call
    (by object identity) and re-simulates only the groups that contain an
    added job or a binding-link neighbour of a removed one; every other group
    is unchanged, and so is its answer. Callers that keep passing the same
    :class:`PeriodicJob` objects for unchanged jobs (the placement replay does)
    pay only for what changed. On top, two caches of group answers:

    - by identity: a group made of the very same job objects as before;
    - by signature: the simulation depends only on each job's timings, start
      and own cap and on the binding links' users, demands and capacity, not
      on names or link identities; values enter it rounded to 9 significant
      digits (relative change of the inputs <= 1e-9).

    and the progress rates of every set of communicating jobs met so far
    (``rate_memo``), shared by all simulations: a group re-simulated after a
    change re-solves only the sets that involve the new or changed jobs.

    All of this is exact. Two options trade exactness for speed; both are off
    by default, and callers should measure their error:

    - ``phase_quantum`` (fraction of a period) coarsens the starts in the
      signature so that groups that differ only by small phase offsets share
      one simulation (the answer is the one of the first group simulated in
      that bin);
    - ``radius`` (binding-link hops): when the group of a changed job reaches
      further than ``radius`` hops from it, only the ball of the jobs within
      ``radius`` hops of the changed jobs near it (within ``radius + 1`` hops)
      is simulated and only the answers of the jobs strictly inside it (fewer
      than ``radius`` hops away) are refreshed; the others keep their previous
      answers. The ball's simulation ends once its interior jobs have done
      ``iterations``. The search stops at the ball (and the changed jobs' own
      neighbours), so a large group is never walked whole. Two errors: the jobs on the ball's edge
      lose their outer partners (they contend less than they would), and a
      change's effect on farther jobs (which decays with distance) is ignored
      until a change near them.
    - ``max_ball`` (jobs; with ``radius`` only): the most jobs one simulation
      on the radius path holds. A simulation's cost grows faster than its size
      (every event re-solves the max-min rates of a component that grows with
      the set, and the set's events grow with it too), and where jobs are
      scattered over many hosts and leaves (first-fit under load) one job's
      radius-1 ball holds hundreds. A group is simulated whole only when it
      lies within the ball and fits the limit. A set above the limit is split: the
      changed jobs it was for (its centres) in chunks of at most
      ``max_ball // 2`` (in the order they joined), each simulated with the
      ``max_ball - chunk`` jobs of its ball nearest to it: fewest hops, then
      the largest coupling weight (the sum, over the binding links they share
      with the chunk, of their demand over the link's capacity), then the
      order they joined. Only the chunk's answers are refreshed. The error:
      a centre loses its weakest partners (it contends less than it would);
      ``bench/results/scale_error.md`` measures it against the model without
      the limit.

    ``engine``: the configuration the placement replay uses (``radius=1`` with
    ``max_ball``, no ``phase_quantum``) has its bookkeeping in C as well
    (``csrc/fluid_model.c``, in the fluid library): ``"auto"`` uses it there
    when the library is built, ``"c"`` insists, ``"python"`` keeps this
    class's own code, the reference. Both give the same answers and
    counters, bit for bit; the per-link and per-job state (``_users``,
    ``_bind_links``, ...) exists on the Python path only.

    >>> m = PeriodicFluidModel({"l": 10.0})
    >>> a, b = PeriodicJob("a", 0.05, 0.05, {"l": 10.0}), PeriodicJob("b", 0.05, 0.05, {"l": 10.0})
    >>> {k: round(v, 6) for k, v in m([a, b]).items()}
    {'a': 0.15, 'b': 0.15}
    >>> {k: round(v, 6) for k, v in m([a]).items()}, m.simulations   # b left: a is alone again
    ({'a': 0.1}, 1)
    """

    def __init__(self, capacity: Mapping[Link, float], *, iterations: int = 4, phase_quantum: float = 0.0, radius: int | None = None,
                 max_ball: int | None = None, cache_limit: int = 200_000, engine: str = "auto"):
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
        if iterations < 1:
            raise ValueError(f"iterations must be >= 1, got {iterations}")
        if radius is not None and radius < 1:
            raise ValueError(f"radius must be >= 1 or None, got {radius}")
        if max_ball is not None and (radius is None or max_ball < 2):
            raise ValueError(f"max_ball must be None, or >= 2 with a radius; got max_ball={max_ball}, radius={radius}")
        self.radius = radius
        self.max_ball = max_ball
        self.capacity = capacity
        self.iterations = iterations
        self.phase_quantum = phase_quantum
        self.cache_limit = cache_limit
        # answers are kept as tuples of floats: the garbage collector stops tracking those, and full collections walk every
        # tracked object (hundreds of thousands of cached answers late in a long replay)
        self.by_signature: dict[tuple, tuple[float, ...]] = {}
        self.by_identity: dict[tuple, tuple[tuple[PeriodicJob, ...], tuple[float, ...]]] = {}
        self.calls = self.hits = self.simulations = self.events = 0
        self.capped = 0  # sets cut to max_ball jobs (chunks of centres with their nearest)
        # the job set of the previous call, by id (the dicts hold the objects, so ids stay unique)
        self._jobs: dict[int, PeriodicJob] = {}
        self._links: dict[int, list[tuple[int, float]]] = {}  # per job: (link number, demand) of its links
        self._own: dict[int, float] = {}
        self._times: dict[int, float] = {}
        self._serial: dict[int, int] = {}  # a number per job object, never reused: names its demands in the rate memo
        self._next_serial = 0
        self.rate_memo: dict[tuple, list[float]] = {}
        # per link, by a number given at its first use (small ints hash and compare faster than link tuples; the numbers
        # follow the joining order, so they are the same in every process): capacity, users (job -> demand, in joining
        # order), whether it is binding (several users whose demands sum above the capacity), and a running sum of the
        # users' demands with a bound on its rounding error (see _saturates)
        self._link_number: dict[Link, int] = {}
        self._cap: list[float] = []
        self._users: list[dict[int, float]] = []
        self._binding: list[bool] = []
        self._sum: list[float] = []
        self._sum_err: list[float] = []
        self._bind_links: dict[int, dict[int, float]] = {}  # per job: its binding links and its demand on each
        # the signature's rounded values: per job its row (timings, start, own cap), and demands and capacities (all > 0)
        self._rows: dict[int, tuple[float, float, float, float]] = {}
        self._r9: dict[float, float] = {}
        self._worker: int | None = None  # the thread that runs the C core's updates beside the caller's work (made on first use)
        self._core = self._new_core(engine)

    def _new_core(self, engine: str) -> int | None:
        """The C core's handle when it serves this configuration (see ``engine``), else None."""
        served = self.radius == 1 and self.max_ball is not None and self.phase_quantum == 0
        if engine == "python" or (engine == "auto" and not served):
            return None
        if not served:
            raise ValueError("engine='c' serves radius=1 with max_ball and phase_quantum=0 only")
        lib = _c_engine()
        if lib is None:
            if engine == "c":
                raise RuntimeError(f"the C fluid engine is not available: {_lib_state['why']}")
            return None
        handle = lib.nw_fm_new(self.iterations, self.max_ball, self.cache_limit)
        if not handle:
            raise MemoryError("nw_fm_new: out of memory")
        weakref.finalize(self, lib.nw_fm_free, handle)
        self._c_update = lib.nw_fm_update
        # refreshed jobs, then calls, hits, simulations, events, capped, identity cache clearings
        self._counts = array("q", bytes(56))
        self._out_serial, self._out_time = array("q"), array("d")
        self._by_serial: dict[int, int] = {}  # serial -> id of the job
        # the jobs whose ids key the core's identity cache: held (their ids stay unique) until it is emptied
        self._held: dict[int, PeriodicJob] = {}
        self._clears = 0
        return handle

    def __call__(self, jobs: Sequence[PeriodicJob]) -> dict[str, float]:
        current = {id(j): j for j in jobs}
        self.update([j for i, j in current.items() if i not in self._jobs], [j for i, j in self._jobs.items() if i not in current])
        return {j.name: self._times[i] for i, j in current.items()}

    def update(self, added: Sequence[PeriodicJob], removed: Sequence[PeriodicJob], *,
               alongside: Callable[[], Any] | None = None) -> dict[str, float]:
        """Apply a change of the job set (``added`` jobs joined, ``removed`` ones, by identity, left) and return the answers it refreshed.

        The incremental form of calling the model with the whole new set: its
        cost grows with the change, not with the number of jobs in the set.
        Every job not in the returned ``{name: mean iteration time}`` keeps its
        previous answer. The same answers as ``model(new set)`` when ``added``
        is in the order the full set lists them.

        ``alongside``: work of the caller's that does not touch this model, run
        on the calling thread while the C core computes on a thread of its own
        (``csrc/fluid_worker.c``, which never takes the GIL), so that the two
        use two cores; with the Python engine it simply runs first. An
        exception it raises comes back once the update is complete.

        >>> m = PeriodicFluidModel({"l": 10.0})
        >>> a, b = PeriodicJob("a", 0.05, 0.05, {"l": 10.0}), PeriodicJob("b", 0.05, 0.05, {"l": 10.0})
        >>> {k: round(v, 6) for k, v in m.update([a, b], []).items()}
        {'a': 0.15, 'b': 0.15}
        >>> {k: round(v, 6) for k, v in m.update([], [b]).items()}
        {'a': 0.1}
        """
        gone = sorted((id(j) for j in removed if id(j) in self._jobs), key=self._serial.__getitem__)  # the order the set listed them
        new = [id(j) for j in added if id(j) not in self._jobs]
        current = {id(j): j for j in added}
        if len({current[i].name for i in new}) != len(new):
            raise ValueError("job names must be unique")
        if self._core is not None:  # validated before any change (numbering a link is none)
            return self._update_core(gone, new, current, [self._checked_columns(current[i]) for i in new], alongside)
        new_links = [self._checked_links(current[i]) for i in new]
        error = _run_beside(alongside)
        refreshed: set[int] = set()
        seeds: list[int] = list(new)
        users, binding, sums, errs = self._users, self._binding, self._sum, self._sum_err
        for i in gone:
            for lid, d in self._links[i]:
                us = users[lid]
                bound = binding[lid]
                if bound:  # its partners there may now be freer (i itself is dropped with the jobs that left, below)
                    seeds.extend(us)
                del us[i]
                if not us:
                    sums[lid] = errs[lid] = 0.0
                    continue
                sums[lid] = left = sums[lid] - d
                errs[lid] += abs(left) * _EPS
                if bound:  # a link that could not saturate still cannot after a leave
                    self._update_binding(lid)
            for store in (self._jobs, self._links, self._own, self._times, self._serial, self._bind_links):
                del store[i]
            self._rows.pop(i, None)
        cap = self._cap
        for i, links in zip(new, new_links, strict=True):
            self._jobs[i], self._links[i] = current[i], links
            self._serial[i] = self._next_serial
            self._next_serial += 1
            bind = self._bind_links[i] = {}
            own = 1.0
            for lid, d in links:
                us = users[lid]
                us[i] = d
                sums[lid] = total = sums[lid] + d
                errs[lid] += total * _EPS
                if len(us) > 1:  # with one user it caps the job but couples nobody
                    if binding[lid]:  # a link that could saturate still can after a join
                        bind[lid] = d
                    else:
                        self._update_binding(lid, joined=i)
                own = min(own, cap[lid] / d)
            self._own[i] = own
        done: set[int] = set()
        live = [s for s in dict.fromkeys(seeds) if s in self._jobs]
        for s in live:
            if s in done:
                continue
            if self.radius is None:
                comp = self._group(s)
                done.update(comp)
                refreshed.update(comp)
                self._times.update(zip(comp, self._answer(comp), strict=True))
                continue
            limit = self.max_ball
            # the ball around s, and whether a job in it has a partner outside (the walk stops at the first): whether the
            # group ends inside it, without walking a large group
            near = self._distances([s], self.radius)
            if (limit is None or len(near) <= limit) and not self._beyond(near):  # the whole group lies within the ball: exact
                comp = self._ordered(near)
                done.update(comp)
                refreshed.update(comp)
                self._times.update(zip(comp, self._answer(comp), strict=True))
                continue
            # the group reaches beyond: simulate the ball around the changed jobs near s (within radius + 1 hops: in the
            # ball, or next to it), refresh its interior
            centres = [k for k in live if k not in done and (k in near or self._touches(k, near))]
            done.update(centres)
            dist = self._distances(centres, self.radius, limit)
            if dist is None:  # too many to simulate together: each chunk of centres with its nearest
                centres = self._ordered(centres)
                step = max(1, limit // 2)
                for c in range(0, len(centres), step):
                    chunk = centres[c : c + step]
                    ball = self._nearest(chunk, limit)
                    self.capped += 1
                    inside = set(chunk)
                    answer = self._answer(ball, watch=[p for p, k in enumerate(ball) if k in inside])
                    for k, a in zip(ball, answer, strict=True):
                        if k in inside:
                            self._times[k] = a
                            refreshed.add(k)
                continue
            ball = self._ordered(dist)
            interior = [p for p, k in enumerate(ball) if dist[k] < self.radius]
            for k, a in zip(ball, self._answer(ball, watch=interior), strict=True):
                if dist[k] < self.radius or k not in self._times:
                    self._times[k] = a
                    refreshed.add(k)
        if error is not None:
            raise error
        return {self._jobs[i].name: self._times[i] for i in refreshed}

    def _checked_links(self, j: PeriodicJob) -> list[tuple[int, float]]:
        """``j``'s links (numbers) and demands where it communicates; raises ValueError on inputs that ``_validate`` refuses."""
        _check_timings(j)
        numbers, demand = self._link_number, j.demand
        lids = list(map(numbers.get, demand))
        if None not in lids:  # every link numbered already (nearly always): validate the demands, keep the positive ones
            vals = list(demand.values())
            # all positive and finite (a NaN fails the sum), checked at C speed: nothing to drop (nearly always)
            if vals and min(vals) > 0 and sum(vals) < math.inf:
                return list(zip(lids, map(float, vals), strict=True)) if j.comm_s > 0 else []
            if all(0.0 <= d < math.inf for d in vals):
                if j.comm_s <= 0:
                    return []
                return [(lid, float(d)) for lid, d in zip(lids, vals, strict=True) if d > 0]
        links = []
        for link, d in demand.items():
            if not 0.0 <= d < math.inf:
                raise _demand_error(j, link, d)
            if d > 0:
                lid = numbers.get(link)
                if lid is None:  # a link seen for the first time: checked once
                    _check_capacity(j, link, self.capacity)
                    lid = numbers[link] = len(self._cap)
                    self._cap.append(self.capacity[link])
                    if self._core is None:
                        self._users.append({})
                        self._binding.append(False)
                        self._sum.append(0.0)
                        self._sum_err.append(0.0)
                    elif _c_engine().nw_fm_add_link(self._core, float(self.capacity[link])) != lid:
                        raise MemoryError("nw_fm_add_link: out of memory")
                links.append((lid, float(d)))
        return links if j.comm_s > 0 else []

    def _checked_columns(self, j: PeriodicJob) -> tuple[list[int], list[float]]:
        """:meth:`_checked_links` as two lists, the link numbers and the demands: what the C core takes (no pair per link)."""
        _check_timings(j)
        lids = list(map(self._link_number.get, j.demand))
        if None not in lids:  # as in _checked_links (the float conversion is the C array's)
            vals = list(j.demand.values())
            if vals and min(vals) > 0 and sum(vals) < math.inf:
                return (lids, vals) if j.comm_s > 0 else ([], [])
        links = self._checked_links(j)
        return [lid for lid, _ in links], [d for _, d in links]

    def _update_core(self, gone: list[int], new: list[int], current: dict[int, PeriodicJob],
                     new_links: list[tuple[list[int], list[float]]], alongside: Callable[[], Any] | None = None) -> dict[str, float]:
        """``update`` through the C core: the same steps on its state (csrc/fluid_model.c); here only ids, serials and names."""
        serial, by_serial, jobs, times = self._serial, self._by_serial, self._jobs, self._times
        gone_serials = [serial[i] for i in gone]
        for i in gone:
            del by_serial[serial[i]], serial[i], jobs[i]
            times.pop(i, None)
        added = [current[i] for i in new]
        n_gone, n_new = len(gone), len(new)
        # the inputs end to end in one int64 and one float64 array (array.array: cheaper than numpy's for a few values): the
        # jobs' links as CSR (where each job's start, the link numbers, the demands)
        ints = array("q", [*gone_serials, *new, *accumulate([len(lids) for lids, _ in new_links], initial=0)])
        floats = array("d", [*(j.compute_s for j in added), *(j.comm_s for j in added), *(j.start_s() for j in added)])
        for lids, dems in new_links:
            ints.extend(lids)
            floats.extend(dems)
        for i, j in zip(new, added, strict=True):
            jobs[i] = self._held[i] = j
            serial[i] = self._next_serial
            by_serial[self._next_serial] = i
            self._next_serial += 1
        out_serial, out_time, counts = self._out_serial, self._out_time, self._counts
        if len(out_serial) < len(jobs):
            out_serial = self._out_serial = array("q", bytes(16 * len(jobs)))
            out_time = self._out_time = array("d", bytes(16 * len(jobs)))
        ia, fa = ints.buffer_info()[0], floats.buffer_info()[0]
        args = (self._core, n_gone, ia, n_new, ia + 8 * n_gone, fa, fa + 8 * n_new, fa + 16 * n_new, ia + 8 * (n_gone + n_new),
                ia + 8 * (n_gone + 2 * n_new + 1), fa + 24 * n_new, len(out_serial), out_serial.buffer_info()[0],
                out_time.buffer_info()[0], counts.buffer_info()[0], counts.buffer_info()[0] + 8)
        if alongside is None or n_gone + n_new < _BESIDE_FROM:
            rc = self._c_update(*args)
            error = _run_beside(alongside)
        else:  # the update on the core's own thread (csrc/fluid_worker.c); ints, floats and the outputs live here until it is done
            lib = _c_engine()
            if self._worker is None:
                self._worker = lib.nw_fw_new()
                if not self._worker:
                    raise MemoryError("nw_fw_new: out of memory or no thread")
                weakref.finalize(self, lib.nw_fw_free, self._worker)
            rc = lib.nw_fw_update_start(self._worker, *args)
            error = None
            if rc == 0:
                error = _run_beside(alongside)
                rc = lib.nw_fw_update_wait(self._worker)
        if rc != 0:
            if rc == -2:
                raise MemoryError("nw_fm_update: out of memory")
            raise RuntimeError(f"nw_fm_update refused its arguments (code {rc})")
        n, self.calls, self.hits, self.simulations, self.events, self.capped, clears = counts
        if clears != self._clears:  # the identity cache was emptied: its new entries hold current jobs only
            self._clears, self._held = clears, dict(jobs)
        out = {}
        for s, t in zip(out_serial[:n], out_time[:n], strict=True):
            i = by_serial[s]
            times[i] = t
            out[jobs[i].name] = t
        if error is not None:
            raise error
        return out

    def _update_binding(self, lid: int, joined: int | None = None) -> None:
        """Re-evaluate whether link ``lid`` can saturate after a user joined or left; keep the users' binding-link sets in step."""
        us = self._users[lid]
        before = self._binding[lid]
        # a sum of non-negative demands in joining order only grows when one joins (it is added last) and only shrinks when
        # one leaves: a link that could saturate still can after a join, one that could not still cannot after a leave
        now = before if (joined is not None) == before else self._saturates(lid)
        self._binding[lid] = now
        if now and not before:
            for k, d in us.items():
                self._bind_links[k][lid] = d
        elif before and not now:
            for k in us:
                self._bind_links[k].pop(lid, None)
        elif now and joined is not None:
            self._bind_links[joined][lid] = us[joined]

    def _saturates(self, lid: int) -> bool:
        """``_can_saturate`` of link ``lid``'s users' demands (summed in joining order), exactly, without the sum when it can.

        The running sum differs from the exact sum of the demands by at most ``_sum_err`` (each addition or subtraction
        rounds by at most ``_EPS`` times its result), and ``_can_saturate``'s sum of ``n`` non-negative terms differs from
        the exact one by at most ``(n - 1) * _EPS / 2`` times it: when the running sum is further from the capacity than
        both bounds (with a margin of 8), both sums lie on the same side of it. Nearer, the demands are summed afresh.
        """
        us = self._users[lid]
        n = len(us)
        if n < 2:
            return False
        total, cap = self._sum[lid], self._cap[lid]
        tol = 2.0 * self._sum_err[lid] + (n + 2) * 8.0 * _EPS * (total + cap)
        if total - cap > tol:
            return True
        if cap - total > tol:
            return False
        total = 0.0  # left to right, as _can_saturate and the C core
        for d in us.values():
            total += d
        self._sum[lid], self._sum_err[lid] = total, n * _EPS * total
        return total > cap

    def _distances(self, seeds: Sequence[int], radius: int, limit: int | None = None) -> dict[int, int] | None:
        """Binding-link hops from the nearest seed, for the jobs at most ``radius`` hops away; None once they are more than
        ``limit`` (the walk stops there)."""
        dist = dict.fromkeys(seeds, 0)
        if limit is not None and len(dist) > limit:
            return None
        frontier = list(seeds)
        for d in range(1, radius + 1):
            nxt = []
            for i in frontier:
                for lid in self._bind_links[i]:
                    for k in self._users[lid]:
                        if k not in dist:
                            dist[k] = d
                            nxt.append(k)
                if limit is not None and len(dist) > limit:
                    return None
            frontier = nxt
        return dist

    def _touches(self, job: int, ball: Mapping[int, int]) -> bool:
        """Whether ``job`` has a binding-link partner in ``ball``."""
        users = self._users
        for lid in self._bind_links[job]:
            for k in users[lid]:
                if k in ball:
                    return True
        return False

    def _beyond(self, ball: Mapping[int, int]) -> bool:
        """Whether a job of ``ball`` has a binding-link partner outside it."""
        for i in ball:
            for lid in self._bind_links[i]:
                for k in self._users[lid]:
                    if k not in ball:
                        return True
        return False

    def _nearest(self, chunk: list[int], limit: int) -> list[int]:
        """``chunk`` and the ``limit - len(chunk)`` jobs within ``radius`` hops nearest to it (see ``max_ball``), in joining order."""
        weight: dict[int, float] = {}
        get, bind, caps, users = weight.get, self._bind_links, self._cap, self._users
        for i in chunk:
            for lid in bind[i]:
                cap = caps[lid]
                for k, d in users[lid].items():
                    weight[k] = get(k, 0.0) + d / cap
        serial = self._serial
        if self.radius == 1:  # the jobs one hop away are the users of the chunk's binding links: those weighed
            inside = set(chunk)
            ranked = [(-w, serial[k], k) for k, w in weight.items() if k not in inside]
        else:
            dist = self._distances(chunk, self.radius)
            ranked = [(dist[k], -weight.get(k, 0.0), serial[k], k) for k in dist if dist[k] > 0]
        return self._ordered([*chunk, *(r[-1] for r in heapq.nsmallest(limit - len(chunk), ranked))])

    def _group(self, seed: int) -> list[int]:
        """The jobs linked to ``seed`` through binding links (in the current set)."""
        comp, stack = {seed}, [seed]
        while stack:
            for lid in self._bind_links[stack.pop()]:
                for k in self._users[lid]:
                    if k not in comp:
                        comp.add(k)
                        stack.append(k)
        return self._ordered(comp)

    def _ordered(self, ids: Iterable[int]) -> list[int]:
        """Jobs in the order they joined: the same order in every process (ids are addresses; the order of
        simultaneous events depends on it, and the replay's decisions on those)."""
        return sorted(ids, key=self._serial.__getitem__)

    def _coupling(self, comp: list[int]) -> _Coupling:
        """The coupling of the jobs ``comp`` on their own (a ball may hold only some users of a link), from the kept state."""
        # each binding link's users among comp, from the jobs' side (a link of a scattered job may have many users outside a
        # small ball), in first-seen order; comp is in joining order, which is the order of every link's users (the order
        # _Coupling.of sums their demands in). A link with one user in comp couples nobody here and is left out
        bind = self._bind_links
        seen: set[int] = set()
        shared: set[int] = set()  # the links of several jobs of comp (most links of a scattered job have one user here)
        for k in comp:
            links = bind[k]
            shared.update(seen.intersection(links))
            seen.update(links)
        users: dict[int, list[tuple[int, float]]] = {}
        for p, k in enumerate(comp):
            links = bind[k]
            for lid in [lid for lid in links if lid in shared]:
                us = users.get(lid)
                if us is None:
                    users[lid] = [(p, links[lid])]
                else:
                    us.append((p, links[lid]))
        cap = self._cap
        return _Coupling.of([self._own[k] for k in comp], ((cap[lid], us) for lid, us in users.items()))

    def _answer(self, comp: list[int], watch: list[int] | None = None) -> Sequence[float]:
        if len(comp) == 1:
            j = self._jobs[comp[0]]
            return (j.compute_s + j.comm_s / self._own[comp[0]],)
        self.calls += 1
        members = tuple(self._jobs[i] for i in comp)
        ident = (tuple(comp), None if watch is None else tuple(watch))
        hit = self.by_identity.get(ident)
        if hit is not None and all(a is b for a, b in zip(hit[0], members, strict=True)):
            self.hits += 1
            return hit[1]
        coupling = self._coupling(comp)
        key, order = self._signature(comp, coupling)
        if watch is not None:
            key = (key, tuple(sorted(order.index(p) for p in watch)))
        cached = self.by_signature.get(key)
        if cached is not None:
            self.hits += 1
            unsorted = [0.0] * len(comp)
            for r, p in enumerate(order):
                unsorted[p] = cached[r]
            answer = tuple(unsorted)
        else:
            if len(self.rate_memo) >= 5 * self.cache_limit:
                self.rate_memo.clear()
            run = _simulate(members, coupling, iterations=self.iterations, rate_memo=self.rate_memo,
                            job_keys=[self._serial[i] for i in comp], watch=watch, means_only=True)
            self.simulations += 1
            self.events += run.events
            answer = tuple(run.means if run.means is not None else map(_mean_after_first, run.starts, run.ends))
            if len(self.by_signature) >= self.cache_limit:
                self.by_signature.clear()
            self.by_signature[key] = tuple(answer[p] for p in order)
        if len(self.by_identity) >= self.cache_limit:
            self.by_identity.clear()
        self.by_identity[ident] = (members, answer)  # holding the jobs keeps their ids from being reused
        return answer

    def _signature(self, comp: list[int], coupling: _Coupling) -> tuple[tuple, list[int]]:
        """A name- and link-free key of the group's simulation, and the group positions in key order."""
        q, cached = self.phase_quantum, self._rows
        rows = []
        for p, i in enumerate(comp):
            row = cached.get(i)
            if row is None:  # a job's row is fixed while it runs: rounded once
                j = self._jobs[i]
                start = j.start_s()
                if q > 0 and j.period_s > 0:
                    bins = max(1, round(1 / q))
                    start = (round(start / j.period_s * bins) % bins) / bins * j.period_s
                row = cached[i] = (_r9(j.compute_s), _r9(j.comm_s), _r9(start), _r9(self._own[i]))
            rows.append((*row, p))
        rows.sort()
        order = [r[4] for r in rows]
        rank = [0] * len(comp)
        for r, p in enumerate(order):
            rank[p] = r
        r9 = self._r9
        if len(r9) > self.cache_limit:
            r9.clear()
        per_link: list[list[tuple[int, float]]] = [[] for _ in coupling.cap_list]
        for p, ls in enumerate(coupling.job_links):
            for c, d in ls:
                rd = r9.get(d)
                if rd is None:
                    rd = r9[d] = _r9(d)
                per_link[c].append((rank[p], rd))
        columns = []
        for us, cap in zip(per_link, coupling.cap_list, strict=True):
            rc = r9.get(cap)
            if rc is None:
                rc = r9[cap] = _r9(cap)
            columns.append((tuple(sorted(us)), rc))
        return (tuple(r[:4] for r in rows), tuple(sorted(columns))), order


_EPS = 2.0**-52  # twice the unit roundoff of a float64: a bound on the relative rounding error of one addition


def _r9(v: float) -> float:
    return float(f"{v:.9g}")


__all__ = ["ENGINES", "PeriodicFluidModel", "PeriodicJob", "PeriodicRun", "binding_components", "binding_links", "fluid_engine",
           "fluid_library_path", "iteration_times", "simulate_periodic", "simulate_periodic_reference"]
