"""Partitioning a layer chain into pipeline stages: PipeDream's DP with AdaPipe's per-stage recomputation.

The dynamic program is PipeDream's (Narayanan et al., SOSP 2019, section 3.1): ``A(j, d)`` is the best
bottleneck ("time of the slowest stage") over layers ``0..j-1`` on the first ``d`` pipeline devices, and

    A(j, d) = min over i < j, r in 1..R of  max( A(i, d - r),  C(i, d - r),  T(i..j, devices d-r..d-1) )

where ``T`` is the per-micro-batch time of a stage spanning layers ``i..j-1`` replicated ``r``-way
(round-robin micro-batches: its work divided by the replicas' summed speed, plus the replicas' gradient
all-reduce ``4(r-1)|w|/(r*B)`` amortised over the ``m`` micro-batches of an iteration, as PipeDream's code
does) and ``C`` is the time to move the boundary activation forward and its gradient back over the actual link
between the two stages' devices (``LinkModel``; from the Topology this is ``gpu_path``). Unlike PipeDream's
released code, which only counts transfers with ``--activation_compression_ratio``, the link term is always on.

Per-stage recomputation is AdaPipe's idea (Sun et al., ASPLOS 2024): each candidate stage picks the cheapest
recomputation option (``none`` < ``selective`` < ``full`` in time) whose memory fits the device:

    states(i..j) + in_flight(stage) * saved_opt(i..j) + max over layers l in i..j of (saved_none - saved_opt)(l) <= memory

where ``in_flight`` comes from the schedule family and the stage's position (1F1B: ``min(m, p - s)``; GPipe:
``m``; see :func:`in_flight`) and the last term is the transient re-materialisation of one layer during the backward
(layers are checkpointed one at a time, as Megatron does).
Deviation from AdaPipe: the option is chosen per stage among three whole-layer policies, not per tensor by a
knapsack over sub-layer units.

Heterogeneous devices enter through ``Device.speed`` and ``Device.memory_bytes`` of each position.

A second pass (after Alpa's stage-construction objective ``sum t_s + (m-1) max t_s``) picks, among the
partitions that reach the optimal bottleneck ``t*``, one with the smallest sum of stage times, which shortens
the pipeline fill and drain. Both passes are exact (see ``tests/test_pipe_partition.py``: brute force on random
instances). See :func:`partition` for how the DP is evaluated in O(P * n log n) rather than O(P * n^2).

``objective="flush"`` replaces both passes by the exact minimisation of the GPipe/1F1B lower bound
``max_s (H_s + m * t_s)`` (fill and drain before stage s plus its m micro-batches), which the planner uses for
flush schedules: the bottleneck alone does not say where the slack should sit.

>>> from pipesched.profile import GPTConfig, analytic_profile
>>> from pipesched.devices import Device, LinkModel
>>> prof = analytic_profile(GPTConfig(layers=8, hidden=1024, heads=16, seq_len=1024, vocab=50000))
>>> part = partition(prof, [Device(f"g{i}", memory_bytes=80 * 2**30) for i in range(4)], LinkModel.uniform(4, 100e9, 1e-6), microbatches=8)
>>> [s.layers for s in part.stages][0][0], [s.layers for s in part.stages][-1][1]
(0, 10)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from topology.errors import InputError

from .devices import Device, LinkModel
from .profile import RECOMPUTE_OPTIONS, ModelProfile
from .schedules import LOOPED, MEMORY_REL_TOL, V_SHAPED, ScheduleError, bytes_text, cached_schedule, fits_memory, schedule_in_flight, v_stage_rank

FAMILIES = ("gpipe", "1f1b", "interleaved", "zbh1", "chimera", "interleaved_zb", "looped_bfs", "zbv", "dualpipev")
SPLIT_BACKWARD = {"zbh1", "interleaved_zb", "zbv", "dualpipev"}
MULTI_STAGE = LOOPED + V_SHAPED + ("chimera",)     # families with several stage ids per rank


class PlanError(InputError):
    """A planning request that cannot be satisfied (too many stages, a layer larger than memory, ...)."""


def positions_on_devices(family: str, devices: int, chunks: int = 1, stages: int | None = None) -> list[int]:
    """The device of every pipeline position (stage id) of ``family``: loop placement ``k % p`` for the looped families,
    the V (stage i and ``2p-1-i`` on device i) for ZB-V and DualPipe-V, one position per device otherwise."""
    if family in LOOPED:
        return [k % devices for k in range(stages or chunks * devices)]
    if family in V_SHAPED:
        return list(v_stage_rank(devices))
    return list(range(stages or devices))


def memory_share(family: str, chunks: int = 1) -> int:
    """How many stage ids share a device: each gets this fraction of its memory in the partitioner's model."""
    return chunks if family in LOOPED else 2 if family in V_SHAPED + ("chimera",) else 1


@functools.lru_cache(maxsize=128)
def _schedule_flights(family: str, ranks: int, microbatches: int, chunks: int) -> tuple[int, ...]:
    sched = cached_schedule(family, ranks, microbatches, chunks)
    peaks = schedule_in_flight(sched)
    if family == "chimera":      # a partition stage runs as two replicas (down and up pipeline): the larger count
        return tuple(max(peaks[sid] for sid in range(sched.num_stages) if sched.stage_layers[sid] == k) for k in range(ranks))
    return tuple(peaks[sid] for sid in range(sched.num_stages))


def in_flight(family: str, position: int, positions: int, microbatches: int, *, ranks: int | None = None, chunks: int = 1) -> int:
    """Micro-batches whose activations a stage holds at once: the peak, over its rank's action order, of forwards
    run less backwards done (a B, or a W: the simulator and torch's runtime keep a micro-batch's graph until its W).

    ``position`` is the stage's index among ``positions`` pipeline positions (stage ids; for Chimera, partition
    stages, each the larger of its two replicas). Closed forms: GPipe and looped BFS ``m``; 1F1B ``min(m, p - s)``;
    ZB-H1 ``min(m, p)`` (rank s defers its W's by s slots, so every stage holds p); with stage replication
    (positions > stages) these stay upper bounds. The other families (interleaved 1F1B and zero bubble, ZB-V,
    DualPipe-V, Chimera) count their generated order, which is exact by construction, including interleaved
    schedules whose ``m`` is not a multiple of ``p`` (rounds of ``m // max(1, m // p)`` micro-batches).

    >>> [in_flight("1f1b", s, 4, 8) for s in range(4)], [in_flight("zbh1", s, 4, 8) for s in range(4)]
    ([4, 3, 2, 1], [4, 4, 4, 4])
    >>> [in_flight("interleaved", s, 8, 6, ranks=4, chunks=2) for s in range(8)]
    [6, 6, 6, 6, 6, 5, 3, 1]
    """
    m = microbatches
    if family in ("gpipe", "looped_bfs"):
        return m
    if family == "1f1b":
        return max(1, min(m, positions - position))
    if family == "zbh1":
        return max(1, min(m, positions))
    if family in FAMILIES:
        p = ranks or (positions if family == "chimera" else positions // memory_share(family, chunks))
        v = chunks if family in LOOPED else 1
        try:
            return _schedule_flights(family, p, m, v)[position]
        except ScheduleError as exc:
            raise PlanError(str(exc), where="--microbatches") from None
    raise PlanError(f"unknown schedule family {family!r}, expected one of {list(FAMILIES)}", where="schedule")


@dataclass(frozen=True)
class StageAssignment:
    """One pipeline stage: layers ``[start, end)``, the device positions that run it, and its costs."""

    layers: tuple[int, int]
    devices: tuple[int, ...]
    recompute: str
    time_s: float              # per micro-batch, F + backward + recompute, after replication
    comm_s: float              # activation in + gradient out over the link from the previous stage
    memory_bytes: float        # predicted peak on each of its devices (states + in-flight activations)
    in_flight: int

    def to_dict(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "devices": list(self.devices), "recompute": self.recompute, "time_s": self.time_s,
                "comm_s": self.comm_s, "memory_bytes": self.memory_bytes, "in_flight": self.in_flight}


@dataclass(frozen=True)
class Partition:
    stages: tuple[StageAssignment, ...]
    bottleneck_s: float
    sum_s: float
    family: str
    microbatches: int
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def boundaries(self) -> list[int]:
        return [s.layers[0] for s in self.stages] + [self.stages[-1].layers[1]]

    def estimate_s(self) -> float:
        """Alpa's/AdaPipe's 1F1B-class iteration estimate ``sum t_s + (m-1) * max t_s`` (comm included)."""
        return self.sum_s + (self.microbatches - 1) * self.bottleneck_s

    def to_dict(self) -> dict[str, Any]:
        return {"family": self.family, "microbatches": self.microbatches, "bottleneck_s": self.bottleneck_s, "sum_s": self.sum_s,
                "estimate_s": self.estimate_s(), "stages": [s.to_dict() for s in self.stages], **self.meta}


class _Prefix:
    """Prefix sums of the profile, so a span's totals are two lookups."""

    def __init__(self, profile: ModelProfile, split_backward: bool):
        lays = profile.layers
        bwd = [lay.bwd_input_s + lay.bwd_weight_s if split_backward else lay.bwd_s for lay in lays]
        self.n = len(lays)
        self.work = np.concatenate([[0.0], np.cumsum([lay.fwd_s + b for lay, b in zip(lays, bwd, strict=True)])])
        self.recompute = {o: np.concatenate([[0.0], np.cumsum([lay.recompute_s[o] for lay in lays])]) for o in RECOMPUTE_OPTIONS}
        self.saved = {o: np.concatenate([[0.0], np.cumsum([float(lay.saved_bytes[o]) for lay in lays])]) for o in RECOMPUTE_OPTIONS}
        self.params = np.concatenate([[0.0], np.cumsum([float(lay.param_bytes) for lay in lays])])
        self.out = np.array([0.0] + [float(lay.output_bytes) for lay in lays])   # out[i] = bytes crossing a cut before layer i
        self.state_factor = profile.state_factor
        # Re-materialisation of one layer during its backward (layers are checkpointed one at a time).
        self.gap = {o: _SparseMax(np.array([float(lay.saved_bytes["none"] - lay.saved_bytes[o]) for lay in lays])) for o in RECOMPUTE_OPTIONS}


def _floor_log2(length: np.ndarray) -> np.ndarray:
    """floor(log2(x)) for positive integer arrays (0 where x <= 0)."""
    out = np.zeros(np.shape(length), dtype=np.int64)
    ok = length > 0
    out[ok] = np.frexp(length[ok].astype(float))[1] - 1
    return out


class _SparseMax:
    """Range maximum over ``values[i:j]`` in O(1) per query (vectorised), 0 for empty ranges."""

    def __init__(self, values: np.ndarray):
        values = np.asarray(values, dtype=float)
        n = len(values)
        levels = [values]
        k = 1
        while 2 * k <= n:
            prev = levels[-1]
            levels.append(np.maximum(prev[:-k], prev[k:]))
            k *= 2
        # One padded table, so a query is two gathers whatever the mix of lengths.
        self.table = np.zeros((len(levels), max(n, 1)))
        for lvl, row in enumerate(levels):
            self.table[lvl, : len(row)] = row

    def query(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        i, j = np.broadcast_arrays(np.asarray(i, dtype=np.int64), np.asarray(j, dtype=np.int64))
        length = j - i
        ok = length > 0
        lvl = _floor_log2(length)
        lo = np.where(ok, i, 0)
        hi = np.where(ok, j - (1 << lvl), 0)
        return np.where(ok, np.maximum(self.table[lvl, lo], self.table[lvl, hi]), 0.0)


class _SparseMin:
    """Range minimum and its position over ``values[i:j]`` (inf, -1 for empty ranges), vectorised."""

    def __init__(self, values: np.ndarray):
        values = np.asarray(values, dtype=float)
        n = len(values)
        levels = [(values, np.arange(n))]
        k = 1
        while 2 * k <= n:
            v, a = levels[-1]
            take_right = v[k:] < v[:-k]
            levels.append((np.where(take_right, v[k:], v[:-k]), np.where(take_right, a[k:], a[:-k])))
            k *= 2
        self.val = np.full((len(levels), max(n, 1)), np.inf)
        self.arg = np.full((len(levels), max(n, 1)), -1, dtype=np.int64)
        for lvl, (v, a) in enumerate(levels):
            self.val[lvl, : len(v)] = v
            self.arg[lvl, : len(a)] = a

    def query(self, i: np.ndarray, j: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        i, j = np.asarray(i, dtype=np.int64), np.asarray(j, dtype=np.int64)
        length = j - i
        ok = length > 0
        lvl = _floor_log2(length)
        lo = np.where(ok, i, 0)
        hi = np.where(ok, j - (1 << lvl), 0)
        vlo, vhi = self.val[lvl, lo], self.val[lvl, hi]
        right = vhi < vlo
        val = np.where(ok, np.where(right, vhi, vlo), np.inf)
        arg = np.where(ok, np.where(right, self.arg[lvl, hi], self.arg[lvl, lo]), -1)
        return val, arg


def _interval_min(lo: np.ndarray, hi: np.ndarray, vals: np.ndarray, args: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """For every position x < size: the smallest ``vals[k]`` over intervals ``lo[k] <= x <= hi[k]`` and its ``args[k]``.

    Each interval is covered by two power-of-two blocks (a sparse table filled in reverse), then the blocks
    are pushed down level by level: O((size + k) log size), vectorised.
    """
    best_v = np.full(size, np.inf)
    best_a = np.full(size, -1, dtype=np.int64)
    if len(lo) == 0:
        return best_v, best_a
    lvl = np.floor(np.log2(hi - lo + 1)).astype(np.int64)
    top = int(lvl.max())
    tv = [np.full(size, np.inf) for _ in range(top + 1)]
    ta = [np.full(size, -1, dtype=np.int64) for _ in range(top + 1)]
    for level in np.unique(lvl):
        sel = lvl == level
        v, a = vals[sel], args[sel]
        for pos in (lo[sel], hi[sel] - (1 << int(level)) + 1):
            np.minimum.at(tv[level], pos, v)
            hit = v == tv[level][pos]           # an interval that achieves its block's minimum names it
            ta[level][pos[hit]] = a[hit]
    for level in range(top, 0, -1):
        half = 1 << (level - 1)
        for shift in (0, half):
            src_v, src_a = tv[level][: size - shift], ta[level][: size - shift]
            dst_v, dst_a = tv[level - 1][shift:], ta[level - 1][shift:]
            upd = src_v < dst_v
            dst_v[upd] = src_v[upd]
            dst_a[upd] = src_a[upd]
    return tv[0], ta[0]


class _StageModel:
    """Cost of a stage at one pipeline position (device speed, memory, in-flight count, replicas) for any span.

    Per option o the time of span (i, j) is ``X_o[j] - X_o[i]`` (linear in prefix sums, replica sync
    included) and the memory ``Y_o[j] - Y_o[i] + max gap_o over the span``; both grow with j, so the ends that
    fit the memory from each start form a prefix, found once by a vectorised binary search (``jmax_mem``).
    """

    def __init__(self, px: _Prefix, speed: float, memory: float, flight: int, replicas: int, allreduce_bw: float,
                 microbatches: int, options: Sequence[str], time_cache: dict | None = None):
        self.px, self.options, self.memory = px, list(options), memory
        self.memory_tol = memory * (1 + MEMORY_REL_TOL) + 1e-9     # an exact fit may come out a few ulps over
        self.flight = flight
        per_replica = self.per_replica = math.ceil(flight / replicas)
        sync = 4.0 * (replicas - 1) / (replicas * allreduce_bw) / microbatches if replicas > 1 else 0.0
        # Stage times do not depend on the memory budget: models of one speed share their time-limited ends.
        self._time_key = (speed, sync)
        self._time_cache = {} if time_cache is None else time_cache
        self.X = {o: (px.work + px.recompute[o]) / speed + sync * px.params for o in options}
        self.Y = {o: px.params * px.state_factor + per_replica * px.saved[o] for o in options}
        self._jmax_mem: dict[str, np.ndarray] = {}
        self._useful: list[str] | None = None

    @property
    def useful(self) -> list[str]:
        """The options worth trying: a slower option only helps where every faster one runs out of memory."""
        if self._useful is not None:
            return self._useful
        out = []
        for k, o in enumerate(self.options):
            out.append(o)
            slower_rest = all(bool((np.diff(self.X[later]) >= np.diff(self.X[o])).all()) for later in self.options[k + 1:])
            if slower_rest and bool((self.jmax_mem(o) == self.px.n).all()):
                break
        self._useful = out
        return out

    def jmax_mem(self, o: str) -> np.ndarray:
        """Largest end per start that fits the memory (vectorised binary search; computed on first use)."""
        if o not in self._jmax_mem:
            n = self.px.n
            starts = np.arange(n + 1)
            lo, hi = starts.copy(), np.full(n + 1, n)
            while (hi > lo).any():
                mid = (lo + hi + 1) // 2
                ok = self.Y[o][mid] - self.Y[o][starts] + self.px.gap[o].query(starts, mid) <= self.memory_tol
                lo = np.where(ok, mid, lo)
                hi = np.where(ok, hi, mid - 1)
            self._jmax_mem[o] = lo
        return self._jmax_mem[o]

    def jmax(self, option: str, limit: float) -> np.ndarray:
        """Largest end j per start i with time <= limit and memory within the device (nondecreasing in i)."""
        X = self.X[option]
        if math.isinf(limit):
            return self.jmax_mem(option)
        key = (self._time_key, option, limit)
        jt = self._time_cache.get(key)
        if jt is None:
            if len(self._time_cache) > 4096:
                self._time_cache.clear()
            jt = self._time_cache[key] = np.searchsorted(X, X + limit, side="right") - 1
        return np.minimum(jt, self.jmax_mem(option))

    def at(self, i: int, j: int) -> tuple[float, str, float]:
        """(time, option, memory) of span (i, j): the fastest option that fits; (inf, first option, inf) if none does."""
        for o in sorted(self.options, key=lambda o: (self.X[o][j] - self.X[o][i], RECOMPUTE_OPTIONS.index(o))):
            mem = self.Y[o][j] - self.Y[o][i] + float(self.px.gap[o].query(np.array([i]), np.array([j]))[0])
            if mem <= self.memory_tol:
                return float(self.X[o][j] - self.X[o][i]), o, float(mem)
        return math.inf, self.options[0], math.inf


def _fill_jmax_mem(models: Sequence[_StageModel], px: _Prefix, shared: dict | None = None) -> None:
    """Every model's :meth:`_StageModel.jmax_mem` for every option, as one vectorised binary search over all (model, option)
    rows instead of one per row (a 64-device plan has up to a few hundred): the same comparisons, so the same ends. A row
    that has converged stays put (its ``lo`` always fits), so searching it longer with the others changes nothing.

    ``shared``: ends already found for this profile, by (memory limit, micro-batches held per replica, option), the only
    inputs of the memory test besides the profile; filled with the new ones (plan() shares it between families)."""
    shared = {} if shared is None else shared
    rows = []
    for model in models:
        for o in model.options:
            if o in model._jmax_mem:
                continue
            known = shared.get((model.memory_tol, model.per_replica, o))
            if known is not None:
                model._jmax_mem[o] = known
            else:
                rows.append((model, o))
    if not rows:
        return
    n = px.n
    Y = np.stack([model.Y[o] for model, o in rows])
    tol = np.array([model.memory_tol for model, _ in rows])[:, None]
    by_option = {o: np.array([k for k, (_, q) in enumerate(rows) if q == o]) for o in {o for _, o in rows}}
    starts = np.arange(n + 1)
    at = np.arange(len(rows))[:, None]
    lo, hi = np.tile(starts, (len(rows), 1)), np.full(Y.shape, n)
    gap = np.empty(Y.shape)
    while (hi > lo).any():
        mid = (lo + hi + 1) // 2
        for o, ks in by_option.items():
            gap[ks] = px.gap[o].query(starts[None, :], mid[ks])
        ok = Y[at, mid] - Y[at, starts[None, :]] + gap <= tol
        lo = np.where(ok, mid, lo)
        hi = np.where(ok, hi, mid - 1)
    for k, (model, o) in enumerate(rows):
        model._jmax_mem[o] = shared[(model.memory_tol, model.per_replica, o)] = lo[k].copy()


def partition(profile: ModelProfile, devices: Sequence[Device], links: LinkModel, *, microbatches: int,
              family: str = "1f1b", stages: int | None = None, chunks: int = 1, max_replicas: int = 1,
              recompute: Sequence[str] = RECOMPUTE_OPTIONS, rel_tol: float = 1e-12, objective: str = "bottleneck",
              cache: dict | None = None) -> Partition:
    """Optimal contiguous partition of ``profile`` over ``devices`` (see the module docstring).

    ``stages``: number of pipeline positions (default: one per device, or ``chunks * len(devices)`` logical
    stages for ``family="interleaved"``, placed loop-style: stage k on device ``k % p``). With
    ``max_replicas > 1`` a stage may take several consecutive devices (PipeDream's replication); the number
    of stages then follows from the DP. ``recompute`` restricts the options the planner may pick.

    ``objective="bottleneck"`` is PipeDream's (slowest stage or cut, then least total time).
    ``objective="flush"`` minimises instead the flush-schedule bound ``max_s (H_s + m * t_s)`` with
    ``H_s = sum_{k<s} (t_k + c_k) + c_s`` (fill and drain of the stages before s, cuts in both directions):
    the makespan no GPipe/1F1B schedule on that partition can beat (:func:`pipesched.simulate.lower_bound`).
    It prefers the bottleneck stages early, where they delay the fewest others. Exact as well: bisection on
    T with a DP that keeps, per (position, cut), the least ``H`` among feasible prefixes (a smaller H never
    hurts later stages), each step an interval minimum.

    Algorithm: the DP's bottleneck ``A(n, P)`` is found by bisection on a threshold T (to ``rel_tol``) with an
    exact feasibility DP over reachable cut points (for every start, the feasible ends form a prefix because
    time and memory grow with the span); the second pass is the min-sum DP restricted to stages and cuts
    within the found bottleneck, whose inner minimum over starts is a range minimum (sparse table). Both are
    O(P * R * n log n), which is what makes 1000 layers into 64 stages fast.

    ``cache``: a dict to share between calls on the same ``profile`` (and only that profile): the memory-fit ends per
    (memory, in-flight count, option) found by one call serve the next (:func:`pipesched.plan.plan` partitions every
    family ``auto`` ranks with one). Results are the same with or without it.
    """
    n = len(profile.layers)
    p = len(devices)
    if family not in FAMILIES:
        raise PlanError(f"unknown schedule family {family!r}, expected one of {list(FAMILIES)}", where="schedule")
    for o in recompute:
        if o not in RECOMPUTE_OPTIONS:
            raise PlanError(f"unknown recomputation option {o!r}, expected some of {list(RECOMPUTE_OPTIONS)}", where="recompute")
    options = [o for o in RECOMPUTE_OPTIONS if o in recompute]
    positions_devices = positions_on_devices(family, p, chunks, stages)
    if family not in MULTI_STAGE and len(positions_devices) > p:
        raise PlanError(f"{len(positions_devices)} stages need {len(positions_devices)} devices, only {p} given", where="--stages")
    positions = len(positions_devices)
    if family in LOOPED and positions != chunks * p:
        raise PlanError(f"{family} runs {chunks} chunks on each of {p} devices: {chunks * p} stages, not {positions}", where="--stages")
    if max_replicas > 1 and family in MULTI_STAGE:
        raise PlanError("stage replication is only modelled for gpipe, 1f1b and zbh1", where="--replicate")
    if positions > n:
        raise PlanError(f"{positions} stages but the model has only {n} layers; use at most {n} stages", where="--stages")
    px = _Prefix(profile, family in SPLIT_BACKWARD)
    mem_div = memory_share(family, chunks)
    roomiest = max(d.memory_bytes for d in devices) / mem_div
    for i, lay in enumerate(profile.layers):
        least = lay.param_bytes * profile.state_factor + lay.saved_bytes["none"]   # its backward re-materialises everything
        if not fits_memory(least, roomiest):
            raise PlanError(f"layer {i} ({lay.name}) needs {bytes_text(least)} (states + one micro-batch) but the largest device "
                            f"budget is {bytes_text(roomiest)}", where="--memory")

    replica_choices = [r for r in range(1, max_replicas + 1)]
    models: dict[tuple, _StageModel] = {}
    stage_model: dict[tuple[int, int], _StageModel] = {}
    time_cache: dict = {}
    for d in range(positions):              # a stage on positions d-r+1..d
        for r in replica_choices:
            if r > d + 1:
                continue
            first = d - r + 1
            devs = [devices[positions_devices[k]] for k in range(first, d + 1)]
            speed = sum(x.speed for x in devs)
            memory = min(x.memory_bytes for x in devs) / mem_div
            flight = in_flight(family, first, positions, microbatches, ranks=p, chunks=chunks)
            ar_bw = min((links.bandwidth(positions_devices[a], positions_devices[a + 1]) for a in range(first, d)), default=math.inf)
            key = (speed, memory, flight, r, ar_bw)
            if key not in models:
                models[key] = _StageModel(px, speed, memory, flight, r, ar_bw, microbatches, options, time_cache)
            stage_model[(d, r)] = models[key]

    _fill_jmax_mem(list(models.values()), px, None if cache is None else cache.setdefault("jmax_mem", {}))

    def comm_vector(first: int) -> np.ndarray:
        """Time to move the activation forward and its gradient back across a cut before position ``first``, per cut layer."""
        if first == 0:
            return np.where(np.arange(n + 1) == 0, 0.0, np.inf)      # the first stage starts at layer 0
        a, b = positions_devices[first - 1], positions_devices[first]
        if a == b:
            return np.zeros(n + 1)
        bw, lat = links.link(a, b)
        return 2.0 * (lat + px.out / bw)

    comm = [comm_vector(first) for first in range(positions)]
    ends = np.arange(n + 1)

    def feasible(limit: float) -> bool:
        return bool(reachable(limit)[positions][n])

    def reachable(limit: float) -> list[np.ndarray]:
        """Per position count d, the cut points a prefix of d positions can end at with every stage and cut within ``limit``."""
        reach = [np.zeros(n + 1, dtype=bool) for _ in range(positions + 1)]
        reach[0][0] = True
        fars: dict[int, np.ndarray] = {}    # positions that share a stage model share its reach at this limit
        for d in range(1, positions + 1):
            for r in replica_choices:
                if r > d:
                    continue
                starts = reach[d - r] & (comm[d - r] <= limit)
                if not starts.any():
                    continue
                model = stage_model[(d - 1, r)]
                far = fars.get(id(model))
                if far is None:
                    far = fars[id(model)] = np.max([model.jmax(o, limit) for o in model.useful], axis=0)
                # union of [i+1, far(i)] over the starts: x is covered iff some start i < x reaches far(i) >= x
                reach_from = np.full(n + 1, -1, dtype=np.int64)
                reach_from[1:] = np.where(starts[:-1], far[:-1], -1)
                reach[d] |= np.maximum.accumulate(reach_from) >= ends
        return reach

    def some_bottleneck(limit: float) -> float:
        """The bottleneck of one partition within ``limit`` (which must be feasible), traced back through the reachable cuts."""
        reach = reachable(limit)
        d, j, worst = positions, n, 0.0
        while d > 0:
            for r in replica_choices:
                if r > d:
                    continue
                model = stage_model[(d - 1, r)]
                far = np.max([model.jmax(o, limit) for o in model.useful], axis=0)
                ok = reach[d - r] & (comm[d - r] <= limit) & (ends < j) & (far >= j)
                if ok.any():
                    i = int(np.nonzero(ok)[0][-1])
                    worst = max(worst, model.at(i, j)[0], float(comm[d - r][i]))
                    d, j = d - r, i
                    break
            else:
                raise AssertionError("a feasible limit has a partition")
        return worst

    if not feasible(math.inf):
        raise PlanError(f"no partition of {n} layers into {positions} stages fits in device memory, even with recomputation "
                        f"{options}; use more stages, fewer micro-batches in flight or a larger --memory", where="--memory")
    if objective == "flush":
        return _flush_partition(n, positions, positions_devices, replica_choices, options, stage_model, comm, microbatches, family, chunks,
                                max_replicas, rel_tol)
    if objective != "bottleneck":
        raise PlanError(f"unknown objective {objective!r}, expected 'bottleneck' or 'flush'")
    hi = max(float(np.max(np.where(np.isfinite(c), c, 0))) for c in comm) + max(
        float(m.X[o][-1]) for m in stage_model.values() for o in options)

    def min_sum(limit: float) -> list[StageAssignment]:
        """Pass 2: least total time (stages + cuts) among partitions whose stages and cuts all stay within ``limit``."""
        S = np.full((positions + 1, n + 1), np.inf)
        S[0, 0] = 0.0
        back_r = np.zeros((positions + 1, n + 1), dtype=np.int64)
        back_i = np.zeros((positions + 1, n + 1), dtype=np.int64)
        for d in range(1, positions + 1):
            for r in replica_choices:
                if r > d:
                    continue
                prev = S[d - r]
                c = comm[d - r]
                model = stage_model[(d - 1, r)]
                for o in model.useful:
                    X = model.X[o]
                    key = np.where(np.isfinite(prev) & (c <= limit), prev + c - X, np.inf)
                    if not np.isfinite(key).any():
                        continue
                    jm = model.jmax(o, limit)
                    first_start = np.searchsorted(jm, ends, side="left")     # smallest i whose span can reach j
                    val, arg = _SparseMin(key).query(first_start, ends)
                    val = val + X
                    better = val < S[d]
                    back_r[d] = np.where(better, r, back_r[d])
                    back_i[d] = np.where(better, arg, back_i[d])
                    S[d] = np.where(better, val, S[d])
        out: list[StageAssignment] = []
        d, j = positions, n
        while d > 0:
            r, i = int(back_r[d, j]), int(back_i[d, j])
            model = stage_model[(d - 1, r)]
            t, option, mem = model.at(i, j)
            first = d - r
            out.append(StageAssignment(
                layers=(i, j), devices=tuple(positions_devices[k] for k in range(first, d)), recompute=option, time_s=t,
                comm_s=float(comm[first][i]), memory_bytes=mem, in_flight=model.flight,
            ))
            d, j = first, i
        out.reverse()
        return out

    # Bisection on the bottleneck, coarse first: the partition found at the coarse limit names a bottleneck T'; if nothing
    # fits under T' (one more check), T' is the optimum, else the bisection goes on to rel_tol below it. The bracket starts
    # at the balanced share (no stage can be faster than the whole model's work over all positions' speed) and doubles.
    lo = float(px.work[-1]) / sum(devices[k].speed for k in positions_devices)
    top = hi
    hi = 2 * lo
    while hi < top and not feasible(hi):
        lo, hi = hi, 2 * hi
    hi = min(hi, top)

    def bisect(lo: float, hi: float, tol: float) -> tuple[float, float]:
        """Narrow (lo infeasible or below the optimum, hi feasible] to a relative ``tol``."""
        while hi - lo > tol * hi:
            mid = (lo + hi) / 2
            if feasible(mid):
                hi = mid
            else:
                lo = mid
        return lo, hi

    lo, hi = bisect(lo, hi, max(rel_tol, 1e-6))
    reached = some_bottleneck(hi)
    below = reached * (1 - rel_tol)
    if below > lo and feasible(below):
        lo, hi = bisect(lo, below, rel_tol)
        out = min_sum(hi)
    else:
        out = min_sum(reached)      # the least sum among the partitions at the optimal bottleneck itself
    bottleneck = max(max(s.time_s, s.comm_s) for s in out)
    return Partition(stages=tuple(out), bottleneck_s=bottleneck, sum_s=float(sum(s.time_s + s.comm_s for s in out)), family=family,
                     microbatches=microbatches, meta={"chunks": chunks, "max_replicas": max_replicas})


def _flush_partition(n, positions, positions_devices, replica_choices, options, stage_model, comm, m, family, chunks, max_replicas,
                     rel_tol) -> Partition:
    """Minimise ``max_s (H_s + m * t_s)`` (see :func:`partition`, ``objective="flush"``)."""
    starts_all = np.arange(n + 1)

    def run(limit: float, keep: bool):
        H = [np.full(n + 1, np.inf) for _ in range(positions + 1)]
        H[0][0] = 0.0
        back: dict[tuple[int, int], tuple[int, int]] = {}
        for d in range(1, positions + 1):
            for r in replica_choices:
                if r > d:
                    continue
                head = H[d - r] + comm[d - r]
                valid = np.isfinite(head)
                if not valid.any():
                    continue
                model = stage_model[(d - 1, r)]
                for o in model.useful:
                    X = model.X[o]
                    allow = np.where(valid, (limit - head) / m, -1.0)
                    with np.errstate(invalid="ignore"):
                        jt = np.where(allow >= 0, np.searchsorted(X, X + np.maximum(allow, 0), side="right") - 1, starts_all)
                    jend = np.minimum(jt, model.jmax_mem(o))
                    ok = valid & (jend > starts_all)
                    idx = np.nonzero(ok)[0]
                    if not len(idx):
                        continue
                    val, arg = _interval_min(idx + 1, jend[idx], (head - X)[idx], idx, n + 1)
                    cand = val + X
                    better = cand < H[d]
                    if keep:
                        for j in np.nonzero(better)[0]:
                            back[(d, int(j))] = (r, int(arg[j]))
                    H[d] = np.where(better, cand, H[d])
        return bool(np.isfinite(H[positions][n])), back

    hi = (m + 1) * max(float(mod.X[o][-1]) for mod in stage_model.values() for o in options) + sum(
        float(np.max(np.where(np.isfinite(c), c, 0))) for c in comm)
    hi *= 1.0 + 1e-9
    if not run(hi, False)[0]:
        raise PlanError("no partition fits in device memory", where="--memory")
    lo = 0.0
    while hi - lo > rel_tol * hi:
        mid = (lo + hi) / 2
        if run(mid, False)[0]:
            hi = mid
        else:
            lo = mid
    _, back = run(hi, True)
    out: list[StageAssignment] = []
    d, j = positions, n
    while d > 0:
        r, i = back[(d, j)]
        model = stage_model[(d - 1, r)]
        t, option, mem = model.at(i, j)
        first = d - r
        out.append(StageAssignment(layers=(i, j), devices=tuple(positions_devices[k] for k in range(first, d)), recompute=option,
                                   time_s=t, comm_s=float(comm[first][i]), memory_bytes=mem, in_flight=model.flight))
        d, j = first, i
    out.reverse()
    head, bound = 0.0, 0.0
    for st in out:
        head += st.comm_s
        bound = max(bound, head + m * st.time_s)
        head += st.time_s
    return Partition(stages=tuple(out), bottleneck_s=max(max(s.time_s, s.comm_s) for s in out),
                     sum_s=float(sum(s.time_s + s.comm_s for s in out)), family=family, microbatches=m,
                     meta={"chunks": chunks, "max_replicas": max_replicas, "objective": "flush", "flush_bound_s": bound})


def uniform_partition(profile: ModelProfile, stages: int) -> list[tuple[int, int]]:
    """Equal layer counts per stage (the earlier stages take the remainder): the usual default split."""
    n = len(profile.layers)
    if stages > n:
        raise PlanError(f"{stages} stages but the model has only {n} layers", where="--stages")
    base, extra = divmod(n, stages)
    spans, start = [], 0
    for s in range(stages):
        size = base + (1 if s < extra else 0)
        spans.append((start, start + size))
        start += size
    return spans


def evaluate_partition(profile: ModelProfile, spans: Sequence[tuple[int, int]], devices: Sequence[Device], links: LinkModel, *,
                       microbatches: int, family: str = "1f1b", chunks: int = 1, recompute: str | None = None,
                       options: Sequence[str] = RECOMPUTE_OPTIONS) -> Partition:
    """Cost a given partition (one position per span, loop placement for interleaved) the way the DP does.

    ``recompute`` forces one option on every stage (e.g. Megatron-style uniform recomputation); otherwise each
    stage takes its cheapest feasible option. A stage that does not fit gets ``time_s = inf``.
    """
    p = len(devices)
    px = _Prefix(profile, family in SPLIT_BACKWARD)
    positions = len(spans)
    mem_div = memory_share(family, chunks)
    placed = positions_on_devices(family, p, chunks, positions)
    out = []
    for k, (i, j) in enumerate(spans):
        dev_index = placed[k]
        dev = devices[dev_index]
        flight = in_flight(family, k, positions, microbatches, ranks=p, chunks=chunks)
        model = _StageModel(px, dev.speed, dev.memory_bytes / mem_div, flight, 1, math.inf, microbatches, [recompute] if recompute else options)
        t, chosen, mem = model.at(i, j)
        comm = 0.0
        if k > 0:
            a = placed[k - 1]
            comm = 0.0 if a == dev_index else 2.0 * links.time(a, dev_index, px.out[i])
        out.append(StageAssignment((i, j), (dev_index,), chosen, t, comm, mem, flight))
    bottleneck = max(max(s.time_s, s.comm_s) for s in out)
    return Partition(tuple(out), bottleneck, sum(s.time_s + s.comm_s for s in out), family, microbatches, meta={"chunks": chunks})
