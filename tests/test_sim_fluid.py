"""emu.fluid (job-level periodic fluid simulation) and the coefficient option of emu.sim_maxmin."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emu.fluid import (
    PeriodicFluidModel,
    PeriodicJob,
    binding_components,
    iteration_times,
    simulate_periodic,
    simulate_periodic_reference,
)
from emu.sim_maxmin import check_maxmin, maxmin_rates, maxmin_rates_coo, maxmin_rates_reference

# -- the solver with coefficients ------------------------------------------------------------------------------


@st.composite
def coef_instances(draw):
    n_links = draw(st.integers(1, 5))
    n_flows = draw(st.integers(1, 7))
    capacity = draw(st.lists(st.integers(1, 20).map(float), min_size=n_links, max_size=n_links))
    paths = [sorted(draw(st.sets(st.integers(0, n_links - 1), min_size=1, max_size=n_links))) for _ in range(n_flows)]
    coef = [[draw(st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0, 7.0])) for _ in p] for p in paths]
    weight = draw(st.lists(st.sampled_from([1.0, 2.0]), min_size=n_flows, max_size=n_flows))
    cap = draw(st.lists(st.one_of(st.just(math.inf), st.sampled_from([0.5, 1.0, 3.0])), min_size=n_flows, max_size=n_flows))
    prio = draw(st.lists(st.integers(0, 1), min_size=n_flows, max_size=n_flows))
    sharing = draw(st.sampled_from(["strict", "weighted"]))
    return paths, coef, capacity, weight, cap, prio, sharing


@settings(max_examples=150, deadline=None)
@given(coef_instances())
def test_coefficient_solver_matches_reference_and_is_maxmin_fair(inst):
    paths, coef, capacity, weight, cap, prio, sharing = inst
    indptr = np.cumsum([0] + [len(p) for p in paths])
    links = np.asarray([link for p in paths for link in p], dtype=np.intp)
    flat = np.asarray([k for c in coef for k in c])
    fast = maxmin_rates(indptr, links, np.asarray(capacity), weight=np.asarray(weight), cap=np.asarray(cap), prio=np.asarray(prio),
                        sharing=sharing, coef=flat)
    ref = maxmin_rates_reference(paths, capacity, weight=weight, cap=cap, prio=prio, sharing=sharing, coef=coef)
    assert fast.tolist() == pytest.approx(ref, rel=1e-9, abs=1e-9)
    assert check_maxmin(paths, capacity, fast.tolist(), weight=weight, cap=cap, prio=prio, sharing=sharing, coef=coef) == []


@settings(max_examples=60, deadline=None)
@given(coef_instances())
def test_unit_coefficients_are_the_classic_solver_bit_for_bit(inst):
    paths, _, capacity, weight, cap, prio, sharing = inst
    ef = np.repeat(np.arange(len(paths)), [len(p) for p in paths])
    el = np.asarray([link for p in paths for link in p], dtype=np.intp)
    kw = {"weight": np.asarray(weight), "cap": np.asarray(cap), "prio": np.asarray(prio), "sharing": sharing}
    plain = maxmin_rates_coo(ef, el, len(paths), np.asarray(capacity), **kw)
    unit = maxmin_rates_coo(ef, el, len(paths), np.asarray(capacity), coef=np.ones(len(ef)), **kw)
    assert np.array_equal(plain, unit)


def test_coefficient_closed_form_and_checker():
    # one link of 12: flow 0 loads it 1x, flow 1 3x; equal rates r with r + 3r = 12
    assert maxmin_rates_coo(np.array([0, 1]), np.array([0, 0]), 2, np.array([12.0]), coef=np.array([1.0, 3.0])).tolist() == [3.0, 3.0]
    assert check_maxmin([[0], [0]], [12.0], [3.0, 3.0], coef=[[1.0], [3.0]]) == []
    assert check_maxmin([[0], [0]], [12.0], [6.0, 2.0], coef=[[1.0], [3.0]])  # flow 1 below flow 0 on its bottleneck
    with pytest.raises(ValueError):
        maxmin_rates_coo(np.array([0]), np.array([0]), 1, np.array([1.0]), coef=np.array([-1.0]))


# -- the periodic fluid simulation: closed forms -------------------------------------------------------------


def _job(name, compute, comm, demand, phase=0.0):
    return PeriodicJob(name, compute, comm, demand, phase)


@pytest.mark.parametrize("n", [2, 3, 5])
def test_identical_jobs_in_phase_share_the_link(n):
    jobs = [_job(f"j{i}", 0.08, 0.02, {"l": 10.0}) for i in range(n)]
    # all communicate together at 1/n of the link: comm takes n x as long, and they stay in phase
    assert iteration_times(jobs, {"l": 10.0}) == pytest.approx({f"j{i}": 0.08 + n * 0.02 for i in range(n)})


def test_interleaved_jobs_see_no_slowdown_and_partial_overlap_is_closed_form():
    a = _job("a", 0.05, 0.05, {"l": 10.0})
    assert iteration_times([a, _job("b", 0.05, 0.05, {"l": 10.0}, 0.05)], {"l": 10.0}) == pytest.approx({"a": 0.1, "b": 0.1})
    # a shift s < comm: the steady state is compute + comm + (comm - s) when both move in lockstep; check with the reference
    b = _job("b", 0.05, 0.05, {"l": 10.0}, 0.02)
    fast = simulate_periodic([a, b], {"l": 10.0}, iterations=12)
    ref = simulate_periodic_reference([a, b], {"l": 10.0}, iterations=12)
    for i in range(2):
        assert fast.ends[i] == pytest.approx(ref.ends[i], rel=1e-9)


def test_links_that_cannot_saturate_do_not_slow_anyone():
    # demands sum to the capacity: the link never limits progress
    jobs = [_job("a", 0.03, 0.07, {"l": 4.0}), _job("b", 0.01, 0.05, {"l": 6.0})]
    assert iteration_times(jobs, {"l": 10.0}) == pytest.approx({"a": 0.1, "b": 0.06})
    assert binding_components(jobs, {"l": 10.0}) == [[0], [1]]


def test_a_link_slower_than_the_demand_stretches_communication():
    # alone on a link of 5 GB/s with a demand of 10: progress 0.5, comm twice as long
    assert iteration_times([_job("a", 0.1, 0.2, {"l": 10.0})], {"l": 5.0}) == pytest.approx({"a": 0.5})


def test_progress_shares_with_coefficients():
    # a (demand 10 on l) and b (demand 10 on l, 1 on m) and c (4 on m): a and b get 1/2, c alone on m with 4 - 0.5... fits
    jobs = [_job("a", 0.0, 0.1, {"l": 10.0}), _job("b", 0.0, 0.1, {"l": 10.0, "m": 1.0}), _job("c", 0.0, 0.1, {"m": 4.0})]
    out = iteration_times(jobs, {"l": 10.0, "m": 4.0})
    assert out["a"] == pytest.approx(0.2) and out["b"] == pytest.approx(0.2)
    # c progresses at 0.875 while b communicates (4 - 0.5 = 3.5 of 4), then at 1: strictly between 0.1 and 0.1/0.875
    assert 0.1 < out["c"] < 0.1 / 0.875 + 1e-9


def test_compute_only_jobs_and_validation():
    assert iteration_times([_job("a", 0.2, 0.0, {"l": 10.0})], {"l": 1.0}) == pytest.approx({"a": 0.2})
    with pytest.raises(ValueError):
        iteration_times([_job("a", 0.1, 0.1, {"l": 1.0})], {})
    with pytest.raises(ValueError):
        iteration_times([_job("a", 0.1, 0.1, {"l": 1.0}), _job("a", 0.1, 0.1, {})], {"l": 1.0})
    with pytest.raises(ValueError):
        iteration_times([_job("a", 0.1, 0.1, {"l": 1.0})], {"l": 1.0}, iterations=0)


# -- the fast simulation against the dense reference ---------------------------------------------------------


@st.composite
def fluid_instances(draw):
    n_links = draw(st.integers(1, 4))
    n_jobs = draw(st.integers(1, 6))
    capacity = {f"l{k}": float(draw(st.integers(2, 20))) for k in range(n_links)}
    jobs = []
    for i in range(n_jobs):
        period = draw(st.sampled_from([0.05, 0.1, 0.15, 0.2, 0.3]))
        share = draw(st.sampled_from([0.0, 0.2, 0.5, 0.8, 1.0]))
        links = draw(st.sets(st.sampled_from(sorted(capacity)), min_size=0, max_size=n_links))
        demand = {link: float(draw(st.integers(1, 20))) for link in sorted(links)}
        phase = draw(st.floats(0, 0.5, allow_nan=False))
        jobs.append(_job(f"j{i}", period * (1 - share), period * share, demand, phase))
    return jobs, capacity


@pytest.fixture(scope="module")
def c_engine():
    """Build csrc/ (emu's fluid library included) and load it afresh."""
    from emu import fluid
    from flowsched import ncclhook

    ncclhook.build()
    fluid._lib_state.clear()
    assert fluid.fluid_engine() == "c"
    return "c"


@pytest.fixture(scope="module", params=["python", "c"])
def engine(request):
    return request.getfixturevalue("c_engine") if request.param == "c" else "python"


@settings(max_examples=120, deadline=None)
@given(inst=fluid_instances(), iterations=st.integers(1, 6))
def test_fast_simulation_equals_the_dense_reference(engine, inst, iterations):
    jobs, capacity = inst
    fast = simulate_periodic(jobs, capacity, iterations=iterations, engine=engine)
    assert fast.engine == (engine if any(j.comm_s > 0 for j in jobs) else "")
    ref = simulate_periodic_reference(jobs, capacity, iterations=iterations)
    for i, j in enumerate(jobs):
        k = min(len(fast.ends[i]), len(ref.ends[i]))
        assert k >= iterations
        assert fast.ends[i][:k] == pytest.approx(ref.ends[i][:k], rel=1e-7, abs=1e-9), j.name
        # the two may stop one iteration apart for a job whose iteration ends within rounding of the last job's end
        assert abs(len(fast.ends[i]) - len(ref.ends[i])) <= 1


@settings(max_examples=60, deadline=None)
@given(fluid_instances())
def test_no_job_beats_its_isolated_period_and_the_model_splits_exactly(inst):
    jobs, capacity = inst
    model = PeriodicFluidModel(capacity)
    out = model(jobs)
    for j in jobs:
        solo = iteration_times([j], capacity)[j.name]
        assert out[j.name] >= solo * (1 - 1e-9)
    # independent components: the model's answer is each component simulated alone
    for comp in binding_components(jobs, capacity):
        part = iteration_times([jobs[i] for i in comp], capacity)
        assert {jobs[i].name: out[jobs[i].name] for i in comp} == pytest.approx(part, rel=1e-9)
    # asking again (same objects; renamed copies) hits the caches and answers the same
    assert model(jobs) == out
    renamed = [PeriodicJob("x" + j.name, j.compute_s, j.comm_s, j.demand, j.phase_s) for j in jobs]
    assert model(renamed) == pytest.approx({"x" + k: v for k, v in out.items()}, rel=1e-9)


def test_large_random_component_fast_equals_reference(engine):
    rng = random.Random(7)
    links = [f"l{k}" for k in range(30)]
    capacity = dict.fromkeys(links, 50.0)
    jobs = []
    for i in range(25):
        period = rng.choice([0.1, 0.2, 0.35])
        comm = period * rng.uniform(0.2, 0.6)
        jobs.append(_job(f"j{i}", period - comm, comm, {link: rng.uniform(20, 50) for link in rng.sample(links, 4)}, rng.uniform(0, 1)))
    fast = simulate_periodic(jobs, capacity, iterations=4, engine=engine)
    ref = simulate_periodic_reference(jobs, capacity, iterations=4)
    assert fast.mean_iteration_s() == pytest.approx(ref.mean_iteration_s(), rel=1e-7)
    assert fast.events == ref.events


@settings(max_examples=150, deadline=None)
@given(inst=fluid_instances(), watch=st.sets(st.integers(0, 5)), iterations=st.integers(1, 5))
def test_c_event_loop_runs_the_python_loop_event_for_event(c_engine, inst, watch, iterations):
    jobs, capacity = inst
    watch = sorted(w for w in watch if w < len(jobs)) or None
    py = simulate_periodic(jobs, capacity, iterations=iterations, watch=watch, engine="python")
    c = simulate_periodic(jobs, capacity, iterations=iterations, watch=watch, engine="c")
    assert c.events == py.events
    for i in range(len(jobs)):
        assert len(c.ends[i]) == len(py.ends[i])
        assert c.ends[i] == pytest.approx(py.ends[i], rel=1e-12, abs=1e-15)


def test_c_event_loop_grows_its_buffer_when_a_fast_job_outruns_the_guess(c_engine):
    # a hog slows the watched job 10x on link m; the fast job, barely slowed on link l, then finishes far more
    # iterations than the period ratio says
    capacity = {"l": 10.0, "m": 10.0}
    slow = _job("slow", 0.05, 0.95, {"l": 1.0, "m": 10.0})
    fast = _job("fast", 0.009, 0.001, {"l": 10.0})
    hog = _job("hog", 0.0, 0.5, {"m": 90.0})
    jobs = [slow, fast, hog]
    py = simulate_periodic(jobs, capacity, iterations=3, watch=[0], engine="python")
    c = simulate_periodic(jobs, capacity, iterations=3, watch=[0], engine="c")
    guess = 3 * (2 + math.ceil(slow.period_s / fast.period_s)) + 2
    assert len(py.ends[1]) > guess
    assert c.events == py.events
    for i in range(3):
        assert c.ends[i] == pytest.approx(py.ends[i], rel=1e-12)


def _means_only_equal_the_means_of_the_ends(jobs, capacity, iterations, watch):
    from emu.fluid import _coupling, _mean_after_first, _simulate

    full = _simulate(jobs, _coupling(jobs, capacity), iterations=iterations, watch=watch, engine="c")
    means = _simulate(jobs, _coupling(jobs, capacity), iterations=iterations, watch=watch, engine="c", means_only=True)
    want = [_mean_after_first(full.starts[i], full.ends[i]) for i in range(len(jobs))]
    got = list(means.mean_iteration_s().values())
    assert [math.isnan(v) for v in got] == [math.isnan(v) for v in want]
    assert [v for v in got if not math.isnan(v)] == [v for v in want if not math.isnan(v)]  # bit for bit
    assert means.events == full.events
    return full


@settings(max_examples=150, deadline=None)
@given(inst=fluid_instances(), watch=st.sets(st.integers(0, 5)), iterations=st.integers(1, 5))
def test_c_means_only_are_the_means_of_the_c_loops_ends(c_engine, inst, watch, iterations):
    """The C loop's own means (numpy's pairwise sum) are _mean_after_first of its iteration ends, bit for bit."""
    jobs, capacity = inst
    _means_only_equal_the_means_of_the_ends(jobs, capacity, iterations, sorted(w for w in watch if w < len(jobs)) or None)


@pytest.mark.parametrize("fast_period", [0.05, 0.011, 0.0021])  # the fast job's durations: < 8, 8..128, > 128 (halved sums)
def test_c_means_only_grow_their_buffer_and_sum_long_runs_like_numpy(c_engine, fast_period):
    capacity = {"l": 10.0, "m": 10.0}
    slow = _job("slow", 0.05, 0.95, {"l": 1.0, "m": 10.0})
    fast = _job("fast", fast_period * 0.9, fast_period * 0.1, {"l": 10.0}, 0.0003)
    hog = _job("hog", 0.0, 0.5, {"m": 90.0})
    full = _means_only_equal_the_means_of_the_ends([slow, fast, hog], capacity, 3, [0])
    assert len(full.ends[1]) > {0.05: 8, 0.011: 130, 0.0021: 700}[fast_period]


def test_engine_choice_and_a_missing_library(monkeypatch, tmp_path):
    from emu import fluid

    jobs = [_job("a", 0.05, 0.05, {"l": 10.0}), _job("b", 0.05, 0.05, {"l": 10.0})]
    with pytest.raises(ValueError, match="engine must be one of"):
        simulate_periodic(jobs, {"l": 10.0}, engine="fortran")
    monkeypatch.setenv("NETWEAVE_FLUID_LIB", str(tmp_path / "missing.so"))
    monkeypatch.setattr(fluid, "_lib_state", {})
    assert fluid.fluid_engine().startswith("python (") and "missing.so not built" in fluid.fluid_engine()
    with pytest.raises(RuntimeError, match="C fluid engine is not available"):
        simulate_periodic(jobs, {"l": 10.0}, engine="c")
    run = simulate_periodic(jobs, {"l": 10.0})  # auto falls back to the Python loop
    assert run.engine == "python" and run.mean_iteration_s() == pytest.approx({"a": 0.15, "b": 0.15})


# -- against the flow-level simulator -----------------------------------------------------------------------------


def test_single_flow_jobs_agree_with_emu_sim():
    """Jobs of one point-to-point flow each, equal NICs: per-job progress fairness is emu's per-flow fairness."""
    from emu.sim import simulate
    from emu.workload import ComputePhase, Job, P2PPhase, Transfer, Workload
    from topology.fabrics import star

    topo = star(4, gpus_per_host=2, nic_bw=10.0)
    g = topo.graph
    specs = {"a": ("n0/gpu0", "n1/gpu0", 0.020, 0.25e9, 0.0), "b": ("n0/gpu1", "n2/gpu0", 0.035, 0.4e9, 0.013),
             "c": ("n3/gpu0", "n1/gpu1", 0.010, 0.15e9, 0.004)}
    iters = 8
    wl = Workload("fluid-check", [Job(n, (s, d), (ComputePhase("c", comp), P2PPhase("x", (Transfer(s, d, nbytes),), after=("c",))),
                                      iterations=iters, start_offset=off) for n, (s, d, comp, nbytes, off) in specs.items()])
    res = simulate(topo, wl, routing="shortest", latency=False, record_flows=False, track_links="none")
    path = {"a": ["n0/gpu0", "n0/nic0", "leaf", "n1/nic0", "n1/gpu0"], "b": ["n0/gpu1", "n0/nic0", "leaf", "n2/nic0", "n2/gpu0"],
            "c": ["n3/gpu0", "n3/nic0", "leaf", "n1/nic0", "n1/gpu1"]}
    capacity, jobs = {}, []
    for n, (_, _, comp, nbytes, off) in specs.items():
        hops = [(u, v, 0) for u, v in zip(path[n], path[n][1:], strict=False)]
        for e in hops:
            capacity[e] = float(g.edges[e]["bw"])
        rate = min(capacity[e] for e in hops)  # GB/s alone: the NIC
        jobs.append(_job(n, comp, nbytes / 1e9 / rate, dict.fromkeys(hops, rate), off))
    fluid = simulate_periodic(jobs, capacity, iterations=iters)
    # compare while every emu job still runs (after one stops, emu has less contention than the fluid model)
    stop = min(r.iteration_ends[-1] for r in res.jobs.values())
    compared = 0
    for i, j in enumerate(jobs):
        emu_ends = [t for t in res.jobs[j.name].iteration_ends if t <= stop]
        assert fluid.ends[i][: len(emu_ends)] == pytest.approx(emu_ends, rel=1e-9, abs=1e-12)
        compared += len(emu_ends)
    assert compared >= 12
    assert len(binding_components(jobs, capacity)) == 1  # all three really interact


@settings(max_examples=40, deadline=None)
@given(fluid_instances(), st.lists(st.sets(st.integers(0, 5)), min_size=1, max_size=6))
def test_incremental_model_answers_like_a_fresh_one(inst, subsets):
    """Jobs come and go (same objects while they stay): the incremental answers equal a fresh model's."""
    jobs, capacity = inst
    model = PeriodicFluidModel(capacity)
    for subset in subsets:
        now = [jobs[i] for i in sorted(subset) if i < len(jobs)]
        assert model(now) == pytest.approx(PeriodicFluidModel(capacity)(now), rel=1e-12)


@settings(max_examples=100, deadline=None)
@given(coef_instances())
def test_small_plain_python_filling_equals_the_numpy_solver(inst):
    from emu.fluid import _fill_progress

    paths, coef, capacity, _, cap, _, _ = inst
    own = [min(c, 1.0) for c in cap]
    links = [[(k, d) for k, d in zip(p, c, strict=True) if d > 0] for p, c in zip(paths, coef, strict=True)]
    ef = np.repeat(np.arange(len(paths)), [len(p) for p in paths])
    el = np.asarray([k for p in paths for k in p], dtype=np.intp)
    fast = maxmin_rates_coo(ef, el, len(paths), np.asarray(capacity), cap=np.asarray(own), coef=np.asarray([d for c in coef for d in c]))
    assert _fill_progress(links, capacity, own) == pytest.approx(fast.tolist(), rel=1e-9, abs=1e-12)


def test_radius_model_is_exact_when_the_ball_holds_the_group_and_local_otherwise():
    # a chain j0 - j1 - ... - j5: link k is shared by j_k and j_k+1 and binding (8 + 8 > 10)
    capacity = {f"l{k}": 10.0 for k in range(6)}
    jobs = [_job(f"j{i}", 0.03 + 0.01 * i, 0.02, {**({f"l{i - 1}": 8.0} if i else {}), f"l{i}": 8.0}, 0.003 * i) for i in range(6)]
    assert len(binding_components(jobs, capacity)) == 1
    exact = PeriodicFluidModel(capacity)(jobs)
    assert PeriodicFluidModel(capacity, radius=10)(jobs) == pytest.approx(exact, rel=1e-12)
    local = PeriodicFluidModel(capacity, radius=1)
    before = local(jobs[:5])
    after = local(jobs)  # j5 arrives next to j4: only j5 is refreshed (j4 is on the ball's edge)
    assert {k: after[k] for k in before} == before
    # j5's answer is that of the ball {j4, j5} simulated until j5 has done its iterations
    ball = simulate_periodic([jobs[4], jobs[5]], capacity, iterations=4, watch=[1]).mean_iteration_s()
    assert after["j5"] == pytest.approx(ball["j5"], rel=1e-9) and after["j5"] > jobs[5].period_s
    with pytest.raises(ValueError):
        PeriodicFluidModel(capacity, radius=0)


def test_max_ball_simulates_each_changed_job_with_its_strongest_partners():
    # a star: the hub shares one binding link with each of six spokes; spoke k loads it at 4 + k (hub 8, capacity 10)
    capacity = {f"l{k}": 10.0 for k in range(6)}
    spokes = [_job(f"s{k}", 0.03 + 0.004 * k, 0.02, {f"l{k}": 4.0 + k}, 0.002 * k) for k in range(6)]
    hub = _job("hub", 0.035, 0.025, dict.fromkeys(capacity, 8.0), 0.001)
    unlimited, limited = PeriodicFluidModel(capacity, radius=1), PeriodicFluidModel(capacity, radius=1, max_ball=3)
    assert limited(spokes) == unlimited(spokes)  # no binding link yet: every spoke alone
    got = limited([*spokes, hub])
    assert limited.capped == 1
    # the hub with the two spokes of the largest demand/capacity on its links (s5, s4), simulated until the hub is done
    ball = simulate_periodic([spokes[4], spokes[5], hub], capacity, iterations=4, watch=[2]).mean_iteration_s()
    assert got["hub"] == pytest.approx(ball["hub"], rel=1e-9)
    exact = unlimited([*spokes, hub])["hub"]
    assert hub.period_s < got["hub"] < exact  # fewer partners: slowed, but less than by all six
    # a ball within the limit is simulated as without it
    small = PeriodicFluidModel(capacity, radius=1, max_ball=7)
    assert small([*spokes, hub]) == pytest.approx(unlimited([*spokes, hub]), rel=1e-12) and small.capped == 0
    for bad in ({"max_ball": 3}, {"radius": 1, "max_ball": 1}):
        with pytest.raises(ValueError):
            PeriodicFluidModel(capacity, **bad)


# demands whose float sums land on or next to the capacities (0.1 + 0.2 + 0.3 > 0.6 but 0.3 + 0.2 + 0.1 == 0.6): the binding
# test must sum them in joining order as _can_saturate does, whatever its running sums say
_TIE_DEMANDS = [0.1, 0.2, 0.3, 0.4, 1 / 3, 0.7, 2.0**-60, 1e-9]
_TIE_CAPACITY = {"a": 0.6, "b": 1.0, "c": 0.3, "d": 1 / 3 + 1 / 3}


@given(ops=st.lists(st.one_of(st.dictionaries(st.sampled_from(sorted(_TIE_CAPACITY)), st.sampled_from(_TIE_DEMANDS), min_size=1),
                              st.integers(0, 7)), min_size=1, max_size=40))
@settings(max_examples=300, deadline=None)
def test_incremental_binding_state_is_a_fresh_can_saturate_after_any_joins_and_leaves(ops):
    """The model's binding flags (kept with running sums) equal _can_saturate of each link's users now, in joining order."""
    from emu.fluid import _can_saturate

    model = PeriodicFluidModel(_TIE_CAPACITY, iterations=1, radius=1, max_ball=4, engine="python")  # its state is Python's
    live: list[PeriodicJob] = []
    for step, op in enumerate(ops):
        if isinstance(op, dict):
            job = _job(f"j{step}", 0.01, 0.01, op, 0.001 * step)
            live.append(job)
            model.update([job], [])
        elif live:
            model.update([], [live.pop(op % len(live))])
        for link, lid in model._link_number.items():
            users = model._users[lid]
            demands = [d for j in live for name, d in j.demand.items() if name == link]
            assert list(users.values()) == demands  # joining order
            assert model._binding[lid] == _can_saturate(demands, _TIE_CAPACITY[link])
        for j in live:
            i = id(j)
            assert model._bind_links[i] == {lid: d for lid, d in model._links[i] if model._binding[lid]}



SANITIZED_RUN = """
import random
import emu.fluid as F
assert F.fluid_engine() == "c", F.fluid_engine()
rng = random.Random(3)
for trial in range(300):
    links = [f"l{k}" for k in range(rng.randint(1, 6))]
    cap = {l: rng.uniform(5, 20) for l in links}
    jobs = [F.PeriodicJob(f"j{i}", rng.choice([0.0, rng.uniform(0.01, 0.2)]), rng.choice([0.0, rng.uniform(0.01, 0.2)]),
                          {l: rng.uniform(1, 15) for l in rng.sample(links, rng.randint(0, len(links)))}, rng.uniform(0, 1))
            for i in range(rng.randint(1, 14))]
    watch = sorted(rng.sample(range(len(jobs)), rng.randint(1, len(jobs)))) if rng.random() < 0.5 else None
    iterations = rng.randint(1, 5)
    F.simulate_periodic(jobs, cap, iterations=iterations, watch=watch, engine="c")
    F._simulate(jobs, F._coupling(jobs, cap), iterations=iterations, watch=watch, engine="c", means_only=True)
    # the incremental model's C core (csrc/fluid_model.c): joins, leaves and returns, balls capped, caches emptied
    model = F.PeriodicFluidModel(cap, iterations=iterations, radius=1, max_ball=rng.randint(2, 5), cache_limit=rng.choice([1, 4, 100]),
                                 engine="c")
    live, left = [], []
    for step, job in enumerate(jobs * 3):
        job = F.PeriodicJob(f"{job.name}.{step}", job.compute_s, job.comm_s, job.demand, job.phase_s)
        removed = [live.pop(rng.randrange(len(live))) for _ in range(min(len(live), rng.randint(0, 2)))]
        added = [job] + ([left.pop(0)] if left and rng.random() < 0.3 else [])
        model.update(added, removed)
        live += added
        left += removed
    del model
print("clean", trial + 1)
"""


def test_c_event_loop_is_clean_under_asan_and_ubsan():
    """The sanitizer build of csrc/fluid.c, preloaded into Python, on random instances (compute-only jobs, no links, watch sets)."""
    import os
    import shutil
    import subprocess
    import sys

    from flowsched import ncclhook

    build = ncclhook.build(sanitize=True)
    runtimes = [subprocess.run([shutil.which("gcc") or "gcc", f"-print-file-name={lib}"], capture_output=True, text=True).stdout.strip()
                for lib in ("libasan.so", "libubsan.so")]
    env = {**os.environ, "LD_PRELOAD": " ".join(runtimes), "ASAN_OPTIONS": "detect_leaks=0",
           "NETWEAVE_FLUID_LIB": str(build / "libnetweave-fluid.so")}
    res = subprocess.run([sys.executable, "-c", SANITIZED_RUN], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "clean 300" in res.stdout


@given(start=st.floats(0, 10), steps=st.lists(st.floats(1e-6, 5.0), min_size=0, max_size=20))
@settings(max_examples=200, deadline=None)
def test_mean_after_first_is_numpys_mean_of_the_durations(start, steps):
    """The model's mean iteration time has np.mean's floats (the replay's schedules hang on the last bit)."""
    from emu.fluid import _mean_after_first

    ends = list(np.cumsum([start, *steps])[1:])
    durations = [b - a for a, b in zip([start, *ends], ends, strict=False)]
    want = float(np.mean(durations[1:] or durations)) if durations else math.nan
    got = _mean_after_first(start, ends)
    assert (math.isnan(got) and math.isnan(want)) or got == want
