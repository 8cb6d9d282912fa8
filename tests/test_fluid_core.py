"""The C core of emu.fluid.PeriodicFluidModel (csrc/fluid_model.c) against the Python bookkeeping it replaces, bit for bit."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emu.fluid import _BESIDE_FROM, PeriodicFluidModel, PeriodicJob, _c_engine

pytestmark = pytest.mark.skipif(_c_engine() is None, reason="the C fluid library is not built (make -C csrc)")

# capacities and demands whose float sums land on or next to each other (ties in the binding test, the weights of the
# nearest jobs and the signature's rows), few links (jobs share them), timings from a few values (signature hits)
_CAPACITY = {"a": 0.6, "b": 1.0, "c": 0.3, "d": 1 / 3 + 1 / 3, "e": 2.0, "f": 0.5}  # 0.1 + 0.2 + 0.3 - 0.1 > 0.5 == 0.2 + 0.3
_DEMANDS = [0.1, 0.2, 0.3, 0.4, 1 / 3, 0.7, 1.0, 2.0**-60]
_TIMES = [0.0, 0.01, 0.02, 0.03 + 1e-12]

_join = st.tuples(st.dictionaries(st.sampled_from(sorted(_CAPACITY)), st.sampled_from(_DEMANDS), max_size=4),
                  st.sampled_from(_TIMES), st.sampled_from(_TIMES), st.sampled_from([0.0, 0.005, 0.01, 0.0125]))
_op = st.one_of(st.tuples(st.just("join"), st.lists(_join, min_size=1, max_size=3)),  # jobs joining together
                st.tuples(st.just("leave"), st.lists(st.integers(0, 63), min_size=1, max_size=3)),  # live jobs leaving together
                st.tuples(st.just("rejoin"), st.integers(0, 63)))  # a job object that left comes back (the identity cache)


def _counters(m: PeriodicFluidModel) -> tuple[int, ...]:
    return m.calls, m.hits, m.simulations, m.events, m.capped


@given(ops=st.lists(_op, min_size=1, max_size=30), max_ball=st.integers(2, 5), cache_limit=st.sampled_from([1, 2, 5, 10_000]),
       iterations=st.integers(1, 4))
@settings(max_examples=300, deadline=None)
def test_c_core_gives_the_python_models_answers_and_counters_after_every_update(ops, max_ball, cache_limit, iterations):
    """Random joins, leaves and returns: the same refreshed answers (floats equal), counters and whole-set answers as the
    Python path at every step, with balls capped to max_ball and caches emptied at cache_limit."""
    options = {"iterations": iterations, "radius": 1, "max_ball": max_ball, "cache_limit": cache_limit}
    core, ref = PeriodicFluidModel(_CAPACITY, engine="c", **options), PeriodicFluidModel(_CAPACITY, engine="python", **options)
    beside = PeriodicFluidModel(_CAPACITY, engine="c", **options)  # its updates on the core's thread while the caller works
    assert core._core is not None and ref._core is None
    work: list[int] = []
    live: list[PeriodicJob] = []
    left: list[PeriodicJob] = []
    for step, (kind, arg) in enumerate(ops):
        added, removed = [], []
        if kind == "join":
            added = [PeriodicJob(f"j{step}.{q}", compute, comm, demand, phase) for q, (demand, compute, comm, phase) in enumerate(arg)]
        elif kind == "leave":
            for k in arg:
                if live:
                    removed.append(live.pop(k % len(live)))
        elif left:
            added = [left.pop(arg % len(left))]
        live += added
        left += removed
        got, want = core.update(added, removed), ref.update(added, removed)
        assert got == want
        assert beside.update(added, removed, alongside=lambda: work.append(sum(range(2000)))) == want
        assert len(work) == step + 1
        assert _counters(core) == _counters(ref) == _counters(beside)
        assert core(live) == ref(live) == beside(live)


def test_c_core_serves_only_its_configuration():
    cap = {"l": 1.0}
    assert PeriodicFluidModel(cap, radius=1, max_ball=4)._core is not None  # auto: the replay's configuration
    for options in ({}, {"radius": 2, "max_ball": 4}, {"radius": 1}, {"radius": 1, "max_ball": 4, "phase_quantum": 0.1}):
        assert PeriodicFluidModel(cap, **options)._core is None
        with pytest.raises(ValueError):
            PeriodicFluidModel(cap, engine="c", **options)
    with pytest.raises(ValueError):
        PeriodicFluidModel(cap, radius=1, max_ball=4, engine="rust")


def test_c_core_refuses_bad_arguments_with_its_error_codes():
    lib = _c_engine()
    assert not lib.nw_fm_new(0, 4, 10) and not lib.nw_fm_new(4, 1, 10)
    h = lib.nw_fm_new(2, 4, 10)
    try:
        assert lib.nw_fm_add_link(h, 0.0) == -1 and lib.nw_fm_add_link(h, float("nan")) == -1 and lib.nw_fm_add_link(None, 1.0) == -1
        assert lib.nw_fm_add_link(h, 1.0) == 0 and lib.nw_fm_add_link(h, 2.0) == 1

        out_s, out_t, out_n, counts = np.zeros(4, dtype=np.int64), np.zeros(4), np.zeros(1, dtype=np.int64), np.zeros(6, dtype=np.int64)

        def update(gone, idents, floats, ptr, lids, out_size=4):
            ints = np.array([*gone, *idents, *ptr, *lids], dtype=np.int64)
            f = np.array(floats, dtype=np.float64)
            ia, fa, n, g = ints.ctypes.data, f.ctypes.data, len(idents), len(gone)
            return lib.nw_fm_update(h, g, ia, n, ia + 8 * g, fa, fa + 8 * n, fa + 16 * n, ia + 8 * (g + n), ia + 8 * (g + 2 * n + 1),
                                    fa + 24 * n, out_size, out_s.ctypes.data, out_t.ctypes.data, out_n.ctypes.data, counts.ctypes.data)

        # two jobs on link 0 (capacity 1) at demand 1 each: coupled, simulated once
        assert update([], [11, 12], [0.01, 0.01, 0.01, 0.01, 0.0, 0.0, 1.0, 1.0], [0, 1, 2], [0, 0]) == 0
        assert int(out_n[0]) == 2 and sorted(out_s[:2].tolist()) == [0, 1] and out_t[0] == out_t[1] == pytest.approx(0.03)
        assert counts[:3].tolist() == [1, 0, 1]
        assert update([], [13], [0.01, 0.01, 0.0, 1.0], [0, 1], [2]) == -1  # link 2 is not registered
        assert update([], [13], [0.01, 0.01, 0.0, 0.0], [0, 1], [0]) == -1  # demand 0 (Python keeps only positive ones)
        assert update([], [13], [-1.0, 0.01, 0.0, 1.0], [0, 1], [0]) == -1  # negative compute
        assert update([], [13], [0.01, 0.01, 0.0, 1.0], [0, 1], [0], out_size=2) == -1  # three jobs, room for two answers
        assert update([5], [], [], [0], []) == -1  # no job 5
        assert update([1, 0], [], [], [0], []) == -1  # gone serials in increasing order only
        assert update([0], [], [], [0], []) == 0 and int(out_n[0]) == 1 and out_s[0] == 1 and out_t[0] == pytest.approx(0.02)
        assert update([0], [], [], [0], []) == -1  # gone already
        assert lib.nw_fm_update(None, 0, None, 0, None, None, None, None, None, None, None, 0, None, None, out_n.ctypes.data,
                                counts.ctypes.data) == -1
        assert lib.nw_fm_counters(h, counts.ctypes.data) == 0 and lib.nw_fm_counters(None, counts.ctypes.data) == -1
    finally:
        lib.nw_fm_free(ctypes.c_void_p(h))


def test_a_replay_through_the_c_core_is_the_python_models_replay():
    """The user's path: LAS's replay with FluidSlowdown(radius=1, max_ball=16) gives every job the same start and finish, and
    the same metrics, whichever bookkeeping serves the model."""
    import topology
    from placement.contention import FluidSlowdown
    from placement.replay import replay
    from placement.traces import synthetic_trace

    topo = topology.build_cluster(32)
    trace = synthetic_trace(300, seed=3, arrival_rate=256 / 1024 / 8, mean_duration_s=1200, network_heavy=0.2)
    results = []
    for engine in ("c", "python"):
        slowdown = FluidSlowdown(topo, radius=1, max_ball=16, engine=engine)
        assert (slowdown.model._core is not None) == (engine == "c")
        res = replay(topo, trace, "las", slowdown=slowdown)
        assert bool(slowdown.model._worker) == (engine == "c" and _BESIDE_FROM == 2)  # updates ran beside the metric
        results.append(([(j["name"], j["start_s"], j["finish_s"]) for j in res.jobs],
                        {k: v for k, v in res.metrics.items() if k != "wall_s"}, _counters(slowdown.model)))
    assert results[0][2][2] > 0  # it simulated
    assert results[0] == results[1]


def test_c_core_sums_a_links_demands_afresh_near_its_capacity():
    """0.1 + 0.2 + 0.3 - 0.1 (the running sum after a leave) is above 0.5 but 0.2 + 0.3 is not: b and c no longer couple,
    and each runs alone again (no group simulated), as on the Python path."""
    jobs = [PeriodicJob(name, 0.01, 0.01, {"f": d}) for name, d in (("a", 0.1), ("b", 0.2), ("c", 0.3))]
    models = [PeriodicFluidModel({"f": 0.5}, radius=1, max_ball=4, engine=engine) for engine in ("c", "python")]
    for m in models:
        for j in jobs:
            m.update([j], [])
        assert m.calls == 1  # {a, b, c} (a and b fit)
        assert m.update([], [jobs[0]]) == {"b": 0.02, "c": 0.02} and m.calls == 1
    assert _counters(models[0]) == _counters(models[1])


def _four_jobs() -> list[PeriodicJob]:
    return [PeriodicJob(f"j{k}", 0.01, 0.01 * (1 + k % 2), {"a": 0.4, "b": 0.3 + 0.1 * k}, 0.002 * k) for k in range(4)]


def test_an_update_beside_the_callers_work_uses_the_cores_thread_and_matches():
    """Two or more jobs joining or leaving: the update runs on the worker thread (made once) while ``alongside`` runs here."""
    jobs = _four_jobs()
    ref = PeriodicFluidModel(_CAPACITY, radius=1, max_ball=3, engine="python")
    m = PeriodicFluidModel(_CAPACITY, radius=1, max_ball=3, engine="c")
    order: list[str] = []
    assert m.update(jobs[:1], [], alongside=lambda: order.append("one")) == ref.update(jobs[:1], [])
    assert m._worker is None  # a lone job: updated inline, then the caller's work
    assert m.update(jobs[1:], [], alongside=lambda: order.append("three")) == ref.update(jobs[1:], [])
    worker = m._worker
    assert bool(worker) == (_BESIDE_FROM == 2) and order == ["one", "three"]  # inline on a machine of one core
    assert m.update([], jobs[:2], alongside=lambda: order.append("two")) == ref.update([], jobs[:2])
    assert m._worker == worker and _counters(m) == _counters(ref)


@pytest.mark.parametrize("engine", ["c", "python"])
def test_an_error_in_the_callers_work_comes_back_once_the_update_is_taken_in(engine):
    jobs = _four_jobs()
    ref = PeriodicFluidModel(_CAPACITY, radius=1, max_ball=3, engine="python")
    m = PeriodicFluidModel(_CAPACITY, radius=1, max_ball=3, engine=engine)
    want = ref.update(jobs, [])
    with pytest.raises(ZeroDivisionError):
        m.update(jobs, [], alongside=lambda: 1 / 0)
    assert m(jobs) == ref(jobs) == {**want}  # the update was applied whole
    assert m.update([], jobs[1:3], alongside=lambda: None) == ref.update([], jobs[1:3])


def test_a_forked_child_updates_without_its_parents_thread():
    """The worker's thread exists in the process that made it only: a forked child's updates run inline (no hang)."""
    import multiprocessing

    jobs = _four_jobs()
    m = PeriodicFluidModel(_CAPACITY, radius=1, max_ball=3, engine="c")
    m.update(jobs[:2], [], alongside=lambda: None)
    assert bool(m._worker) == (_BESIDE_FROM == 2)
    ref = PeriodicFluidModel(_CAPACITY, radius=1, max_ball=3, engine="python")
    ref.update(jobs[:2], [])
    want = ref.update(jobs[2:], [])
    ctx = multiprocessing.get_context("fork")
    answers = ctx.Queue()
    child = ctx.Process(target=lambda: answers.put(m.update(jobs[2:], [], alongside=lambda: None)))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert answers.get(timeout=5) == want


def test_the_workers_error_codes():
    lib = _c_engine()
    assert lib.nw_fw_update_wait(None) == -1
    w, h = lib.nw_fw_new(), lib.nw_fm_new(2, 4, 10)
    try:
        assert lib.nw_fw_update_wait(w) == -1  # nothing handed over
        out_n, counts = np.zeros(1, dtype=np.int64), np.zeros(6, dtype=np.int64)
        args = (h, 0, None, 0, None, None, None, None, None, None, None, 0, None, None, out_n.ctypes.data, counts.ctypes.data)
        assert lib.nw_fw_update_start(None, *args) == -1
        assert lib.nw_fw_update_start(w, *args) == 0
        assert lib.nw_fw_update_start(w, *args) == -1  # one call at a time
        assert lib.nw_fw_update_wait(w) == 0 and counts[0] == 0  # an empty update
        bad = (None, *args[1:])
        assert lib.nw_fw_update_start(w, *bad) == 0 and lib.nw_fw_update_wait(w) == -1  # nw_fm_update's own code comes back
    finally:
        lib.nw_fw_free(ctypes.c_void_p(w))
        lib.nw_fm_free(ctypes.c_void_p(h))
