"""CASSINI: interleave the communication phases of jobs that share links by shifting their start times.

A re-implementation of the mechanism of CASSINI (Rajasekaran, Ghobadi, Akella,
"CASSINI: Network-Aware Job Scheduling in Machine Learning Clusters", NSDI
2024), on the :class:`~placement.profiles.CommProfile` of each job.

Geometric abstraction
    A job's iteration (compute, then communication) is wrapped on a circle
    whose perimeter is its iteration time ``T``; rotating the circle by an
    angle is delaying the job's start by a time shift. Jobs with different
    iteration times share a *unified circle* whose perimeter is the least
    common multiple of their iteration times: :func:`unified_perimeter`
    takes the smallest multiple of the longest ``T`` that every ``T`` divides
    to within 2 %, up to ``max_periods`` (default 8) times the longest; each
    job's period on the circle is then the perimeter over its whole number of
    iterations around it (:func:`effective_period`, off by at most the
    tolerance; beyond the cap by more, which is the price of a bounded circle).
    The circle is cut into ``buckets`` equal arcs (default 360).
Compatibility score (per link of capacity ``C``)
    ``score = 1 - mean_over_arcs(max(0, sum_j demand_j(arc) - C)) / C``;
    1 means the jobs never over-subscribe the link (:func:`compatibility_score`).
Per-link shifts
    The paper searches the rotations that maximise a link's score. Here a
    link's jobs are placed greedily, heaviest first, each at the rotation
    (a multiple of the arc) that minimises the link's excess given those
    already placed; jobs whose shift is fixed (already running) are placed
    first at their shift. Ties (several rotations without excess are common)
    go to the least overlap with the load placed so far, so that two jobs are
    not lined up where a third then finds no room. Exhaustive for two jobs,
    greedy beyond.
Affinity graph and global shifts
    A bipartite graph of jobs and shared links; edge ``(j, l)`` carries job
    ``j``'s shift in link ``l``'s solution. A BFS from a reference job (shift
    0), or from the fixed jobs, assigns ``t_k = (t_j - w(j,l) + w(l,k)) mod
    T_k`` (CASSINI's Algorithm 1). Loops: the BFS keeps a spanning tree; each
    non-tree edge is checked and the disagreement (circular distance between
    the shift it implies and the one assigned) is reported in
    :attr:`ShiftResult.loops`. CASSINI discards candidates whose affinity graph
    has loops; :func:`rank_candidates` ranks candidates with an *inconsistent*
    loop after all others instead, and every score it reports is recomputed
    with the final shifts, so a loop never hides a conflict.

>>> import topology
>>> from placement.profiles import CommProfile
>>> e = ("a", "b", 0)
>>> p1 = CommProfile("j1", (), 0.05, 0.05, {e: 10.0}, {e: 0.5})
>>> p2 = CommProfile("j2", (), 0.05, 0.05, {e: 10.0}, {e: 0.5})
>>> r = time_shifts({p.job: p for p in (p1, p2)}, {e: 10.0})
>>> round(r.shifts["j2"] - r.shifts["j1"], 3) % 0.1, r.link_scores[e]
(0.05, 1.0)
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from topology.model import Topology

from .profiles import CommProfile, Edge

DEFAULT_BUCKETS = 360


def unified_perimeter(periods: Sequence[float], *, tolerance: float = 0.02, max_periods: int = 8) -> float:
    """The unified circle's perimeter: the least common multiple of the periods, within ``tolerance``, capped.

    The perimeter is the smallest ``m`` times the longest period (``m <=
    max_periods``) that every period divides to within ``tolerance`` (relative);
    without one, ``max_periods`` times the longest.

    >>> unified_perimeter([0.2, 0.3]), unified_perimeter([0.25, 0.5]), unified_perimeter([1.0, 0.37]), unified_perimeter([1.0, 0.77])
    (0.6, 0.5, 3.0, 7.0)
    """
    periods = [p for p in periods if p > 0]
    if not periods:
        return 0.0
    longest = max(periods)
    for m in range(1, max_periods + 1):
        perimeter = m * longest
        if all(abs(p - effective_period(p, perimeter)) <= tolerance * p for p in periods):
            return perimeter
    return max_periods * longest


def effective_period(period: float, perimeter: float) -> float:
    """The period a job has on the unified circle: the perimeter over its (rounded) number of iterations around it."""
    return perimeter / max(1, round(perimeter / period))


def _up_matrix(period: float | np.ndarray, comm_start: float | np.ndarray, perimeter: float, buckets: int, shifts: np.ndarray) -> np.ndarray:
    """``M[s, b] = 1`` when arc ``b`` falls in the communication phase of the job shifted by ``shifts[s]`` (``period`` and
    ``comm_start`` may also be arrays, one per row: each row a job of its own)."""
    width = perimeter / buckets
    t = (np.arange(buckets) + 0.5) * width
    phase = np.mod(t[None, :] - shifts[:, None], np.reshape(period, (-1, 1)))
    return (phase >= np.reshape(comm_start, (-1, 1))).astype(np.float64)


def _rows(profile: CommProfile, perimeter: float, buckets: int, shifts: np.ndarray) -> np.ndarray:
    """The job's communication indicator on the unified circle for each shift (its period rounded to the circle)."""
    per = effective_period(profile.period_s, perimeter)
    return _up_matrix(per, profile.compute_s * per / profile.period_s, perimeter, buckets, shifts)


def demand(profile: CommProfile, link: Edge, shift: float, perimeter: float, buckets: int = DEFAULT_BUCKETS) -> np.ndarray:
    """Job demand (GB/s) on ``link`` in each arc of the unified circle when it starts ``shift`` seconds late."""
    rate = profile.link_rates.get(link, 0.0)
    if rate == 0 or profile.comm_s == 0:
        return np.zeros(buckets)
    return rate * _rows(profile, perimeter, buckets, np.array([shift]))[0]


def summed_demand(profiles: Sequence[CommProfile], shifts: Sequence[float], link: Edge, perimeter: float,
                  buckets: int = DEFAULT_BUCKETS) -> np.ndarray:
    """The jobs' demands (GB/s) on ``link`` in each arc of the unified circle, summed: ``sum(demand(p, link, s, perimeter))``
    over the jobs, to the last bit (one matrix of indicators; its rows are added in the jobs' order, as that sum adds them).
    Every job must load ``link``.

    >>> from placement.profiles import CommProfile
    >>> a = CommProfile("a", (), 0.5, 0.5, {"l": 10.0}, {})
    >>> summed_demand([a, a], [0.0, 0.5], "l", 1.0, buckets=4).tolist()
    [10.0, 10.0, 10.0, 10.0]
    """
    return demand_sum([p.period_s for p in profiles], [p.compute_s for p in profiles], shifts, [p.link_rates[link] for p in profiles],
                      perimeter, buckets)


def demand_sum(period_s: Sequence[float], compute_s: Sequence[float], shifts: Sequence[float], rates: Sequence[float], perimeter: float,
               buckets: int = DEFAULT_BUCKETS) -> np.ndarray:
    """:func:`summed_demand` of jobs given by numbers: job ``j`` computes ``compute_s[j]`` of each ``period_s[j]``, then
    communicates at ``rates[j]`` GB/s, and starts ``shifts[j]`` late (the replay's overloaded-link metric keeps only these).

    >>> demand_sum([1.0, 1.0], [0.5, 0.5], [0.0, 0.5], [10.0, 10.0], 1.0, buckets=4).tolist()
    [10.0, 10.0, 10.0, 10.0]
    """
    period = np.array([effective_period(p, perimeter) for p in period_s])
    comm_start = np.array(compute_s, dtype=np.float64) * period / np.array(period_s, dtype=np.float64)
    up = _up_matrix(period, comm_start, perimeter, buckets, np.asarray(shifts, dtype=np.float64))
    # cumsum adds the rows one after another whatever the shape; sum(axis=0) does too, except on a circle of one arc, where
    # the column is contiguous and numpy adds it pairwise (another rounding than the sum of the demands)
    return np.cumsum(np.array(rates, dtype=np.float64)[:, None] * up, axis=0)[-1]


def compatibility_score(demands: np.ndarray, capacity: float) -> float:
    """CASSINI's score of one link: ``1 - mean(max(0, sum of demands - C)) / C`` (1.0 = never over-subscribed).

    >>> compatibility_score(np.array([[10.0, 0.0], [0.0, 10.0]]), 10.0), compatibility_score(np.array([[10.0, 0.0], [10.0, 0.0]]), 10.0)
    (1.0, 0.5)
    """
    total = demands.sum(axis=0) if demands.ndim == 2 else demands
    return float(1.0 - np.maximum(total - capacity, 0.0).mean() / capacity)


@dataclass
class ShiftResult:
    """Time shifts (s) per job, scores per shared link, and the loops met while traversing the affinity graph."""

    shifts: dict[str, float]
    link_scores: dict[Edge, float]
    perimeter_s: float
    buckets: int
    loops: list[dict[str, Any]] = field(default_factory=list)  # non-tree affinity edges whose implied shift disagrees
    affinity_edges: int = 0
    cycles: int = 0  # independent cycles of the affinity graph (edges off the BFS spanning forest)

    @property
    def inconsistent_loops(self) -> int:
        return sum(1 for lp in self.loops if not lp["consistent"])

    def min_score(self, jobs: Sequence[str] | None = None, profiles: Mapping[str, CommProfile] | None = None) -> float:
        if jobs is None or profiles is None:
            return min(self.link_scores.values(), default=1.0)
        links = {e for j in jobs for e in profiles[j].link_rates}
        return min((s for e, s in self.link_scores.items() if e in links), default=1.0)

    def to_dict(self) -> dict[str, Any]:
        return {"shifts_s": self.shifts, "perimeter_s": self.perimeter_s, "buckets": self.buckets,
                "link_scores": {f"{u}->{v}": s for (u, v, _), s in self.link_scores.items()},
                "loops": self.loops, "affinity_edges": self.affinity_edges, "cycles": self.cycles}


def shared_links(profiles: Mapping[str, CommProfile]) -> dict[Edge, list[str]]:
    """Links used by two or more jobs, with those jobs (the link side of the affinity graph)."""
    users: dict[Edge, list[str]] = {}
    for name, p in profiles.items():
        if p.comm_s <= 0:
            continue
        for e in p.link_rates:
            users.setdefault(e, []).append(name)
    return {e: js for e, js in users.items() if len(js) > 1}


def link_classes(profiles: Mapping[str, CommProfile], links: Mapping[Edge, list[str]], cap: Mapping[Edge, float]) -> dict[Edge, list[Edge]]:
    """Shared links grouped by (jobs, their demands, capacity): links of one class behave identically on the circle.

    A ring over several rails loads many parallel links alike; one affinity-graph
    node per class keeps the graph (and its cycle count) to what is distinct.
    """
    groups: dict[tuple, list[Edge]] = {}
    for e, js in links.items():
        key = (tuple(sorted((j, round(profiles[j].link_rates[e], 9)) for j in js)), round(cap[e], 9))
        groups.setdefault(key, []).append(e)
    return {members[0]: members for members in groups.values()}


def time_shifts(profiles: Mapping[str, CommProfile], capacity: Mapping[Edge, float] | Topology, *,
                fixed: Mapping[str, float] | None = None, buckets: int = DEFAULT_BUCKETS, max_periods: int = 8,
                group_links: bool = True) -> ShiftResult:
    """CASSINI's time shifts for ``profiles`` sharing links of the given capacities (GB/s, or a Topology).

    ``fixed`` pins the shifts of jobs already running; the others are found by
    per-link optimisation and a BFS over the affinity graph (links that carry
    the same jobs at the same demands form one node, see :func:`link_classes`;
    ``group_links=False`` keeps one node per link, the benchmark's baseline).
    """
    fixed = dict(fixed or {})
    cap = _capacities(capacity, profiles)
    all_links = shared_links(profiles)
    classes = link_classes(profiles, all_links, cap) if group_links else {e: [e] for e in all_links}
    links = {e: all_links[e] for e in classes}
    shifts: dict[str, float] = {name: fixed.get(name, 0.0) for name in profiles}
    perimeter = unified_perimeter([profiles[j].period_s for js in links.values() for j in js], max_periods=max_periods)
    if not links or perimeter <= 0:
        return ShiftResult(shifts, {}, perimeter, buckets)
    width = perimeter / buckets
    # per-job matrices of every rotation (multiples of one arc, up to the job's own period)
    up: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for j in {j for js in links.values() for j in js}:
        p = profiles[j]
        n = max(1, min(buckets, math.ceil(effective_period(p.period_s, perimeter) / width - 1e-9)))
        rot = np.arange(n) * width
        up[j] = (rot, _rows(p, perimeter, buckets, rot))
    # 1. per-link optimisation: w[(job, link)] = the job's shift in that link's solution
    w: dict[tuple[str, Edge], float] = {}
    for e, js in links.items():
        base = np.zeros(buckets)
        order = sorted(js, key=lambda j: (j not in fixed, -profiles[j].link_rates[e] * profiles[j].comm_s, j))
        for j in order:
            rate = profiles[j].link_rates[e]
            rot, mat = up[j]
            if j in fixed:
                s = fixed[j]
                row = _rows(profiles[j], perimeter, buckets, np.array([s]))[0]
            elif not base.any():
                s, row = 0.0, mat[0]
            else:
                excess = np.maximum(base[None, :] + rate * mat - cap[e], 0.0).sum(axis=1)
                # ties (several rotations without excess are common) go to the least overlap with the load placed so far:
                # lining two jobs up costs nothing now but leaves no room for the next one
                overlap = mat @ base
                best = excess.min()
                k = int(np.argmin(np.where(excess <= best + 1e-9 * max(1.0, cap[e]), overlap, np.inf)))
                s, row = float(rot[k]), mat[k]
            w[(j, e)] = s
            base += rate * row
    # 2. BFS over the bipartite affinity graph (jobs <-> shared links)
    job_links: dict[str, list[Edge]] = {}
    for e, js in links.items():
        for j in js:
            job_links.setdefault(j, []).append(e)
    per = {j: effective_period(profiles[j].period_s, perimeter) for j in job_links}
    assigned: dict[str, float] = {}
    link_off: dict[Edge, float] = {}
    loops: list[dict[str, Any]] = []
    roots = sorted(j for j in job_links if j in fixed)
    remaining = sorted(job_links, key=lambda j: (-len(job_links[j]), j))
    tree_edges = 0
    queue: deque[tuple[str, str | Edge]] = deque()
    for j in roots:
        assigned[j] = fixed[j]
        queue.append(("job", j))
    while True:
        while queue:
            kind, node = queue.popleft()
            if kind == "job":
                j = node
                for e in job_links[j]:
                    off = assigned[j] - w[(j, e)]
                    if e not in link_off:
                        link_off[e] = off
                        tree_edges += 1
                        queue.append(("link", e))
            else:
                e = node
                for k in links[e]:
                    want = (link_off[e] + w[(k, e)]) % per[k]
                    if k not in assigned:
                        assigned[k] = want
                        tree_edges += 1
                        queue.append(("job", k))
        nxt = next((j for j in remaining if j not in assigned), None)
        if nxt is None:
            break
        assigned[nxt] = 0.0  # a new component: its reference job starts unshifted
        queue.append(("job", nxt))
    n_edges = sum(len(js) for js in links.values())
    # every affinity edge off the spanning tree closes a loop: check whether the shifts agree around it
    for e, js in links.items():
        for k in js:
            want = (link_off[e] + w[(k, e)]) % per[k]
            gap = abs(want - assigned[k] % per[k])
            gap = min(gap, per[k] - gap)
            if gap > 1e-9 and len(loops) < 1000:
                loops.append({"job": k, "link": f"{e[0]}->{e[1]}", "disagreement_s": gap, "consistent": gap <= width / 2})
    loop_count = n_edges - tree_edges
    for j in profiles:
        if j in assigned:
            shifts[j] = fixed.get(j, assigned[j])
    scores = {}
    for e, js in links.items():
        rows = [profiles[j].link_rates[e] * _rows(profiles[j], perimeter, buckets, np.array([shifts[j]]))[0] for j in js]
        score = compatibility_score(np.array(rows), cap[e])
        for member in classes[e]:
            scores[member] = score
    return ShiftResult(shifts, scores, perimeter, buckets, loops, n_edges, loop_count)


def _capacities(capacity: Mapping[Edge, float] | Topology, profiles: Mapping[str, CommProfile]) -> dict[Edge, float]:
    """The capacities of the links the profiles use (not a copy of the whole fabric's: the replay asks per placement)."""
    if isinstance(capacity, Topology):
        g = capacity.graph
        return {e: float(g.edges[e]["bw"]) for p in profiles.values() for e in p.link_rates}
    return {e: capacity[e] for p in profiles.values() for e in p.link_rates if e in capacity}


def predicted_iteration_times(profiles: Mapping[str, CommProfile], shifts: Mapping[str, float], capacity: Mapping[Edge, float] | Topology,
                              *, buckets: int = DEFAULT_BUCKETS, max_periods: int = 8) -> dict[str, float]:
    """A first-order fluid estimate of each job's iteration time when the jobs run with ``shifts``.

    On every shared link, in every arc where the demand ``D`` exceeds the
    capacity ``C``, the jobs communicating there progress at ``C/D`` of their
    rate; a job's communication phase stretches by the worst of its links.
    Used to rank candidates; the replay's slowdowns come from the flow-level
    simulator (:mod:`placement.contention`).
    """
    cap = _capacities(capacity, profiles)
    all_links = shared_links(profiles)
    links = {e: all_links[e] for e in link_classes(profiles, all_links, cap)}
    out = {j: p.period_s for j, p in profiles.items()}
    if not links:
        return out
    perimeter = unified_perimeter([profiles[j].period_s for js in links.values() for j in js], max_periods=max_periods)
    width = perimeter / buckets
    extra: dict[str, float] = {}
    for e, js in links.items():
        rows = {j: _rows(profiles[j], perimeter, buckets, np.array([shifts.get(j, 0.0)]))[0] for j in js}
        total = sum(profiles[j].link_rates[e] * rows[j] for j in js)
        over = np.maximum(total / cap[e] - 1.0, 0.0)
        for j in js:
            reps = round(perimeter / effective_period(profiles[j].period_s, perimeter))
            extra[j] = max(extra.get(j, 0.0), float((rows[j] * over).sum() * width / reps))
    for j, x in extra.items():
        out[j] += x
    return out


@dataclass
class RankedCandidate:
    """A candidate placement of a new job with its CASSINI evaluation."""

    index: int
    profile: CommProfile
    shifts: ShiftResult
    compat: float
    cost: float
    inconsistent_loops: int
    shared: int = 0  # links it shares with running jobs

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "compat": self.compat, "cost": self.cost, "comm_s": self.profile.comm_s,
                "period_s": self.profile.period_s, "shift_s": self.shifts.shifts.get(self.profile.job, 0.0),
                "inconsistent_loops": self.inconsistent_loops}


def rank_candidates(capacity: Mapping[Edge, float] | Topology, running: Mapping[str, tuple[CommProfile, float]],
                    candidates: Sequence[CommProfile], *, buckets: int = DEFAULT_BUCKETS, tie: float = 0.01) -> list[RankedCandidate]:
    """Rank candidate placements of one new job against the running jobs (profile, fixed shift), best first.

    A candidate's cost is its alpha-beta iteration time (compute + collective
    time on that placement) times ``2 - compat``, ``compat`` being the lowest
    compatibility score, after time-shifting, among the links it shares (1 when
    it shares none). Candidates with an inconsistent affinity loop go last;
    among costs within ``tie`` (1 %) of the best, fewer shared links win, then
    the allocator's own order (its packing choice): a shift makes sharing
    tolerable on the circle, but periods that are not commensurate drift.
    """
    profiles = {name: p for name, (p, _) in running.items()}
    fixed = {name: s for name, (_, s) in running.items()}
    out = []
    for i, cand in enumerate(candidates):
        allp = {**profiles, cand.job: cand}
        res = time_shifts(allp, capacity, fixed=fixed, buckets=buckets)
        compat = res.min_score([cand.job], allp)
        cost = cand.period_s * (2.0 - compat)
        shared = sum(1 for e in res.link_scores if e in cand.link_rates)
        out.append(RankedCandidate(i, cand, res, compat, cost, res.inconsistent_loops, shared))
    # costs within ``tie`` of the best count as equal: then the allocator's own order (its packing choice) decides
    best = min((r.cost for r in out), default=0.0)
    out.sort(key=lambda r: (r.inconsistent_loops > 0, True, r.cost, 0, r.index) if r.cost > best * (1 + tie)
             else (r.inconsistent_loops > 0, False, 0.0, r.shared, r.index))
    return out
