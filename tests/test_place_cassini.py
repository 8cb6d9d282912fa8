"""CASSINI circles, compatibility scores, affinity-graph shifts; profiles; the fluid slowdown model."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import topology
from placement.cassini import (
    compatibility_score,
    demand,
    effective_period,
    predicted_iteration_times,
    rank_candidates,
    shared_links,
    summed_demand,
    time_shifts,
    unified_perimeter,
)
from placement.contention import EmuSlowdown, FluidSlowdown, PlacedJob, link_components
from placement.profiles import CommProfile, JobSpec, comm_profile, dp_groups


def prof(name, compute, comm, links, rate=10.0):
    return CommProfile(name, (), compute, comm, {e: rate for e in links}, {e: rate * comm for e in links})


def test_perimeter_is_lcm_within_tolerance():
    assert unified_perimeter([0.1, 0.1]) == pytest.approx(0.1)
    assert unified_perimeter([0.2, 0.3]) == pytest.approx(0.6)
    assert unified_perimeter([0.3, 0.2, 0.1]) == pytest.approx(0.6)
    assert unified_perimeter([1.0, 0.77], max_periods=3) == pytest.approx(3.0)
    for p in (0.2, 0.3):
        assert 0.6 / effective_period(p, 0.6) == pytest.approx(round(0.6 / p))


def test_score_matches_formula_on_random_demands():
    rng = np.random.default_rng(1)
    for _ in range(20):
        d = rng.uniform(0, 10, size=(3, 50))
        cap = rng.uniform(5, 20)
        excess = [max(0.0, sum(d[:, b]) - cap) for b in range(50)]
        assert compatibility_score(d, cap) == pytest.approx(1 - np.mean(excess) / cap)


def test_demand_is_the_up_arc():
    e = ("x", "y", 0)
    p = prof("a", 0.075, 0.025, [e], rate=4.0)
    d = demand(p, e, 0.0, 0.1, buckets=4)
    assert d.tolist() == [0.0, 0.0, 0.0, 4.0]
    assert demand(p, e, 0.025, 0.1, buckets=4).tolist() == [4.0, 0.0, 0.0, 0.0]


@settings(max_examples=150, deadline=None)
@given(jobs=st.lists(st.tuples(st.floats(1e-4, 2.0), st.floats(1e-4, 2.0), st.floats(1e-3, 400.0), st.floats(0.0, 1e4)), min_size=1, max_size=12),
       buckets=st.integers(1, 400))
def test_summed_demand_is_the_sum_of_demands_bit_for_bit(jobs, buckets):
    """The replay's overloaded-link metric counts arcs above capacity from summed_demand: it must be the sum of the
    per-job demands to the last bit, or a sum at the capacity would count differently."""
    e = ("x", "y", 0)
    profiles = [prof(f"j{i}", compute, comm, [e], rate=rate) for i, (compute, comm, rate, _) in enumerate(jobs)]
    shifts = [shift for *_, shift in jobs]
    per = unified_perimeter([p.period_s for p in profiles])
    want = sum(demand(p, e, s, per, buckets) for p, s in zip(profiles, shifts, strict=True))
    assert summed_demand(profiles, shifts, e, per, buckets).tolist() == want.tolist()


def _brute_best_score(profiles, e, cap, buckets):
    """Exhaustive search over the second job's rotation (first fixed at 0)."""
    names = list(profiles)
    per = unified_perimeter([p.period_s for p in profiles.values()])
    width = per / buckets
    best = -1.0
    n = round(effective_period(profiles[names[1]].period_s, per) / width)
    for k in range(n):
        rows = [demand(profiles[names[0]], e, 0.0, per, buckets), demand(profiles[names[1]], e, k * width, per, buckets)]
        best = max(best, compatibility_score(np.array(rows), cap))
    return best


@pytest.mark.parametrize("seed", range(8))
def test_two_job_link_shift_is_the_brute_force_optimum(seed):
    rnd = random.Random(seed)
    e = ("l", "m", 0)
    periods = rnd.choice([(0.1, 0.1), (0.1, 0.2), (0.2, 0.3)])
    ps = {f"j{i}": prof(f"j{i}", T * rnd.uniform(0.3, 0.8), 0, [e]) for i, T in enumerate(periods)}
    ps = {k: CommProfile(k, (), p.compute_s, T - p.compute_s, {e: rnd.uniform(4, 10)}, {}) for (k, p), T in zip(ps.items(), periods, strict=True)}
    cap = 10.0
    res = time_shifts(ps, {e: cap}, buckets=120)
    assert res.link_scores[e] == pytest.approx(_brute_best_score(ps, e, cap, 120), abs=1e-9)


def test_complementary_jobs_interleave_perfectly():
    e = ("l", "m", 0)
    ps = {n: prof(n, 0.05, 0.05, [e], rate=10.0) for n in ("a", "b")}
    res = time_shifts(ps, {e: 10.0})
    assert res.link_scores[e] == pytest.approx(1.0)
    assert abs(res.shifts["a"] - res.shifts["b"]) % 0.1 == pytest.approx(0.05)
    # and the fluid model agrees that there is no slowdown with these shifts, but there is without them
    fluid = FluidSlowdown({e: 10.0})
    shifted = fluid([PlacedJob(ps[n], res.shifts[n]) for n in ps])
    assert shifted == pytest.approx({"a": 0.1, "b": 0.1})
    assert fluid([PlacedJob(ps[n], 0.0) for n in ps])["a"] == pytest.approx(0.15)
    assert predicted_iteration_times(ps, res.shifts, {e: 10.0}) == pytest.approx({"a": 0.1, "b": 0.1})


def test_bfs_respects_every_link_on_a_tree_shaped_affinity_graph():
    # chain a -l1- b -l2- c: loop-free, so each link's own optimum must hold with the global shifts
    l1, l2 = ("1", "x", 0), ("2", "x", 0)
    ps = {"a": prof("a", 0.075, 0.025, [l1]), "b": prof("b", 0.075, 0.025, [l1, l2]), "c": prof("c", 0.075, 0.025, [l2])}
    res = time_shifts(ps, {l1: 10.0, l2: 10.0})
    assert res.cycles == 0 and not res.loops
    assert res.link_scores == {l1: pytest.approx(1.0), l2: pytest.approx(1.0)}


def test_loops_are_detected_and_reported():
    # three jobs pairwise sharing three links: a cycle a-l1-b-l2-c-l3-a
    l1, l2, l3 = ("1", "x", 0), ("2", "x", 0), ("3", "x", 0)
    ps = {"a": prof("a", 0.05, 0.05, [l1, l3]), "b": prof("b", 0.05, 0.05, [l1, l2]), "c": prof("c", 0.05, 0.05, [l2, l3])}
    res = time_shifts(ps, {l1: 10.0, l2: 10.0, l3: 10.0})
    assert res.cycles == 1
    # three half-period jobs cannot pairwise interleave: some link is incompatible and a loop edge disagrees
    assert min(res.link_scores.values()) < 1.0
    assert res.loops and res.inconsistent_loops >= 1
    # the scores are those of the final shifts, recomputed (never the per-link optimum)
    for e, js in shared_links(ps).items():
        per = res.perimeter_s
        rows = [demand(ps[j], e, res.shifts[j], per, res.buckets) for j in js]
        assert res.link_scores[e] == pytest.approx(compatibility_score(np.array(rows), 10.0))


def test_fixed_jobs_keep_their_shift_and_new_job_fills_the_gap():
    e = ("l", "m", 0)
    ps = {"old": prof("old", 0.05, 0.05, [e]), "new": prof("new", 0.05, 0.05, [e])}
    res = time_shifts(ps, {e: 10.0}, fixed={"old": 0.02})
    assert res.shifts["old"] == 0.02
    assert (res.shifts["new"] - 0.02) % 0.1 == pytest.approx(0.05, abs=1e-3)


def test_rank_candidates_prefers_compatible_then_cheaper():
    e1, e2 = ("1", "x", 0), ("2", "x", 0)
    running = {"r": (prof("r", 0.02, 0.08, [e1]), 0.0)}
    clash = prof("n", 0.02, 0.08, [e1])  # shares e1 with a job that communicates 80% of the time
    free = prof("n", 0.02, 0.09, [e2])  # slower alone, but alone
    ranked = rank_candidates({e1: 10.0, e2: 10.0}, running, [clash, free])
    assert [r.index for r in ranked] == [1, 0]
    assert ranked[0].compat == 1.0 and ranked[1].compat < 1.0


def test_time_shifts_for_random_jobs_are_within_periods():
    rng = random.Random(3)
    links = [(str(i), "x", 0) for i in range(12)]
    ps = {}
    for j in range(20):
        T = rng.choice([0.1, 0.2, 0.4])
        comm = T * rng.uniform(0.1, 0.5)
        ps[f"j{j}"] = prof(f"j{j}", T - comm, comm, rng.sample(links, 3), rate=rng.uniform(2, 8))
    res = time_shifts(ps, dict.fromkeys(links, 10.0))
    per = res.perimeter_s
    for j, p in ps.items():
        assert 0 <= res.shifts[j] < effective_period(p.period_s, per) + 1e-9
    assert all(0 <= s <= 1 for s in res.link_scores.values()) or min(res.link_scores.values()) > -5


def test_profile_routes_a_ring_over_rails(cluster):
    spec = JobSpec("a", gpus=16, compute_s=0.1, grad_bytes=4e9)
    p = comm_profile(cluster, spec, cluster.gpus()[:16])
    # a ring over two DGX hosts with rail routing crosses NIC->leaf links of both hosts, every rail, nothing else
    assert {(u.split("/")[0], v.split("/")[1] if "/" in v else v) for u, v, _ in p.link_rates if u.startswith("node")} == {
        (h, f"leaf{r}") for h in ("node0", "node1") for r in range(8)}
    assert p.comm_s > 0 and all(r <= cluster.graph.edges[e]["bw"] + 1e-9 for e, r in p.link_rates.items())
    # a single-host job has no network traffic
    assert comm_profile(cluster, JobSpec("b", gpus=8, grad_bytes=4e9), cluster.gpus()[16:24]).link_rates == {}
    assert dp_groups(list("abcdef"), 3) == [["a", "d"], ["b", "e"], ["c", "f"]]


def test_components_group_jobs_by_shared_links():
    e1, e2, e3 = ("1", "x", 0), ("2", "x", 0), ("3", "x", 0)
    jobs = [PlacedJob(prof(n, 0.1, 0.1, ls)) for n, ls in (("a", [e1]), ("b", [e1, e2]), ("c", [e2]), ("d", [e3]))]
    comps = sorted(sorted(j.name for j in c) for c in link_components(jobs))
    assert comps == [["a", "b", "c"], ["d"]]


def test_fluid_model_agrees_with_emu_on_a_shared_uplink():
    """The fast job-level model against emu's flow-level simulator on two cross-SU jobs sharing spine uplinks."""
    topo = topology.build_cluster(4, hosts_per_su=2, oversubscription=4)
    g = topo.gpus()
    specs = {"a": JobSpec("a", 16, compute_s=0.02, grad_bytes=1e9), "b": JobSpec("b", 16, compute_s=0.02, grad_bytes=1e9)}
    pa = comm_profile(topo, specs["a"], g[0:8] + g[16:24])
    pb = comm_profile(topo, specs["b"], g[8:16] + g[24:32])
    assert set(pa.link_rates) & set(pb.link_rates)
    jobs = [PlacedJob(pa, 0.0), PlacedJob(pb, 0.0)]
    fluid = FluidSlowdown(topo)(jobs)
    emu = EmuSlowdown(topo, specs, iterations=3)(jobs)
    for n in specs:
        assert fluid[n] > comm_profile(topo, specs[n], pa.gpus if n == "a" else pb.gpus).period_s * 1.05  # contention is felt
        assert fluid[n] == pytest.approx(emu[n], rel=0.25)


