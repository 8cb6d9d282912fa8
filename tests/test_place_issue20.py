"""Issue #20: the placement planner's defects found against HiveD's own algorithm, each as a test."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import topology
from placement.cassini import compatibility_score, demand, effective_period, time_shifts, unified_perimeter
from placement.hived import HivedScheduler
from placement.profiles import CommProfile
from placement.replay import replay
from placement.traces import TraceJob


def _host(gpu: str) -> str:
    return gpu.split("/")[0]


# 1. opportunistic jobs stay out of a VC's bound cell while idle unbound hosts exist
def test_opportunistic_job_avoids_the_bound_host_of_a_one_gpu_guaranteed_job(cluster):
    s = HivedScheduler(cluster, {"a": {"host": 1}})
    g = s.allocate("g", 1, vc="a")
    bound = _host(g.gpus[0])
    opp = s.allocate("opp", 1)
    assert opp.ok and _host(opp.gpus[0]) != bound
    g2 = s.allocate("g2", 7, vc="a")
    assert g2.ok and g2.preempted == [] and "opp" in s.jobs


# 2. guaranteed and opportunistic work kept apart per node: fewer preemptions
def test_opportunistic_job_avoids_a_node_with_a_bound_cell_so_the_vc_grows_without_preempting(cluster):
    s = HivedScheduler(cluster, {"a": {"numa": 2}})
    g1 = s.allocate("g1", 4, vc="a")
    opp = s.allocate("opp", 4)
    assert opp.ok and _host(opp.gpus[0]) != _host(g1.gpus[0])  # not beside the guaranteed job in its node
    g2 = s.allocate("g2", 4, vc="a")
    assert g2.ok and g2.preempted == []


def test_opportunistic_jobs_can_be_kept_out_of_bound_cells(cluster):
    s = HivedScheduler(cluster, {"a": {"hostx2": 2}})
    assert s.allocate("g", 4, vc="a").ok  # binds a hostx2 cell; the other half of the cluster is unbound
    assert s.allocate("o1", 16).ok
    assert s.allocate("o2", 4).ok  # only idle GPUs inside the bound cell are left: HiveD lets it use them
    s.free("o2")
    s.opportunistic_in_bound_cells = False
    assert not s.allocate("o3", 4).ok


# 3. a replay with VCs where a guaranteed job preempts an opportunistic one
@pytest.mark.parametrize("policy", ["hived", "hived+cassini"])
def test_replay_with_vcs_requeues_preempted_opportunistic_jobs(policy):
    topo = topology.build_cluster(1)
    trace = [TraceJob("opp", 0.0, 8, 100.0, 100.0, 0.0), TraceJob("guar", 10.0, 8, 50.0, 100.0, 0.0, vc="a")]
    r = replay(topo, trace, policy, virtual_clusters={"a": {"host": 1}})
    jobs = {j["name"]: j for j in r.jobs}
    assert r.metrics["finished"] == 2 and r.metrics["preemptions"] == 1
    assert jobs["guar"]["jct_s"] == pytest.approx(50.0)
    # opp ran 10 s, waited 50 s, then ran its remaining 90 s: progress is kept
    assert jobs["opp"]["finish_s"] == pytest.approx(150.0)


# 4. one impossible job blocks no virtual cluster
def test_request_larger_than_its_vc_is_refused_on_arrival_and_blocks_nobody(cluster):
    # b0 keeps the cluster busy; huge (16 GPUs, VC a holds 8) used to sit at the queue's head until the cluster drained
    trace = [TraceJob("b0", 0.0, 8, 100.0, 100.0, 0.0, vc="b"), TraceJob("huge", 1.0, 16, 100.0, 100.0, 0.0, vc="a"),
             TraceJob("small", 2.0, 8, 10.0, 100.0, 0.0, vc="b"), TraceJob("a-ok", 3.0, 8, 10.0, 100.0, 0.0, vc="a")]
    r = replay(cluster, trace, "hived", virtual_clusters={"a": {"host": 1}, "b": {"host": 2}})
    jobs = {j["name"]: j for j in r.jobs}
    assert jobs["huge"]["start_s"] is None and "quota" in jobs["huge"]["reason"]
    assert jobs["small"]["queue_s"] == pytest.approx(0.0) and jobs["a-ok"]["queue_s"] == pytest.approx(0.0)


def test_scheduler_names_a_request_its_vc_can_never_hold(cluster):
    s = HivedScheduler(cluster, {"a": {"host": 1}})
    r = s.allocate("huge", 16, vc="a")
    assert not r.ok and r.reason["resource"] == "quota" and r.reason.get("never") is True
    assert s.allocate("fits", 8, vc="a").ok


@pytest.mark.parametrize(("relax", "never"), [(True, False), ("node", True), (False, True)])
def test_never_fits_by_cell_shape_when_pieces_may_not_split(cluster, relax, never):
    # 8 GPUs in a VC of two numa cells: by count it fits; as one host piece it does not, unless pieces may split below a node
    s = HivedScheduler(cluster, {"a": {"numa": 2}}, relax=relax)
    why = s.never_fits(8, "a")
    assert (why is not None) == never
    assert s.allocate("j", 8, vc="a").ok != never
    if never:
        assert why["level"] == "host" and "may not be split" in why["message"]


def test_vc_queues_are_independent(cluster):
    # VC a's head waits for its own running job; VC b's job behind it in arrival order starts at once
    trace = [TraceJob("a1", 0.0, 8, 100.0, 100.0, 0.0, vc="a"), TraceJob("a2", 1.0, 8, 10.0, 100.0, 0.0, vc="a"),
             TraceJob("b1", 2.0, 8, 10.0, 100.0, 0.0, vc="b")]
    r = replay(cluster, trace, "hived", virtual_clusters={"a": {"host": 1}, "b": {"host": 1}})
    jobs = {j["name"]: j for j in r.jobs}
    assert jobs["a2"]["queue_s"] == pytest.approx(99.0) and jobs["b1"]["queue_s"] == pytest.approx(0.0)


# 5. CASSINI with three jobs on a link: ties between excess-free rotations
def _brute_force_link(profiles, e, cap, buckets):
    names = list(profiles)
    per = unified_perimeter([p.period_s for p in profiles.values()])
    width = per / buckets
    base = demand(profiles[names[0]], e, 0.0, per, buckets)
    options = [[demand(profiles[n], e, k * width, per, buckets) for k in range(round(effective_period(profiles[n].period_s, per) / width))]
               for n in names[1:]]
    return max(compatibility_score(base + sum(rows), cap) for rows in itertools.product(*options))


def test_three_jobs_on_a_link_do_not_line_up_two_of_them():
    e = ("l", "m", 0)

    def prof(name, period, frac, rate):
        comm = period * frac
        return CommProfile(name, (), period - comm, comm, {e: rate}, {e: rate * comm})

    ps = {"j0": prof("j0", 0.2, 0.5, 3.0), "j1": prof("j1", 0.2, 0.6, 6.0), "j2": prof("j2", 0.1, 0.6, 5.0)}
    res = time_shifts(ps, {e: 10.0}, buckets=40)
    best = _brute_force_link(ps, e, 10.0, 40)
    assert best == pytest.approx(0.97, abs=0.01)
    assert res.link_scores[e] == pytest.approx(best, abs=1e-9)
    assert np.isfinite(res.link_scores[e])


# replays with virtual clusters: every job finishes under every policy, and GPU-time is conserved
@pytest.mark.parametrize("policy", ["fifo", "las", "hived", "hived+cassini"])
def test_replays_with_vcs_finish_every_job_and_conserve_gpu_time(cluster, policy):
    import random

    rng = random.Random(7)
    vcs = {"a": {"host": 2}, "b": {"hostx2": 1}}
    trace = []
    for i in range(60):
        vc = rng.choice(["a", "a", "b", None])
        gpus = rng.choice([1, 2, 4, 8] + ([16] if vc != "a" else []))
        trace.append(TraceJob(f"j{i:02d}", round(i * rng.uniform(5, 40), 1), gpus, float(rng.randint(20, 400)), 100.0, 0.0, vc=vc,
                              priority=rng.randint(0, 2)))
    r = replay(cluster, trace, policy, virtual_clusters=vcs)
    assert r.metrics["finished"] == len(trace), [j for j in r.jobs if j["finish_s"] is None][:3]
    # compute-only jobs progress at 1 / compute per second while placed, and nothing runs unplaced: GPU-seconds are conserved
    used = r.metrics["gpu_utilisation"] * r.metrics["makespan_s"] * len(cluster.gpus())
    assert used == pytest.approx(sum(t.gpus * t.duration_s for t in trace), rel=1e-6)
    if policy.startswith("hived"):
        assert r.metrics["preemptions"] > 0  # guaranteed jobs did reclaim their cells from opportunistic ones


# 7. the allocation time split by phase
def test_phase_timer_splits_the_time_of_each_operation(cluster):
    import time

    from placement.hived import PHASES

    s = HivedScheduler(cluster, {"a": {"host": 2}, "b": {"numa": 2}})
    s.phase_s = dict.fromkeys(PHASES, 0.0)
    t0 = time.perf_counter()
    for i in range(6):
        s.allocate(f"o{i}", 4)
    s.allocate("g", 16, vc="a")  # preempts opportunistic jobs
    s.allocate("h", 8, vc="b")
    for j in list(s.jobs):
        s.free(j)
    total = time.perf_counter() - t0
    assert set(s.phase_s) == set(PHASES) and all(v >= 0 for v in s.phase_s.values())
    assert s.phase_s["search"] > 0 and s.phase_s["walk"] > 0 and s.phase_s["bind"] > 0 and s.phase_s["release"] > 0
    assert sum(s.phase_s.values()) <= total
