"""The flow-level simulator: closed-form cases, max-min fairness against brute force, result files."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emu.results import RunResult
from emu.sim import simulate
from emu.sim_maxmin import check_maxmin, maxmin_rates, maxmin_rates_reference
from emu.workload import CollectivePhase, ComputePhase, Job, P2PPhase, Transfer, Workload
from topology import LinkKind, NodeKind, Topology

GB = 1e9


def star(n: int, bw: float = 10.0, *, down_bw: float | None = None, latency_us: float = 0.0) -> Topology:
    """GPUs h/gpu0..n-1 on one switch; uplinks ``bw``, downlinks ``down_bw`` GB/s."""
    t = Topology("star")
    t.add_node("sw", NodeKind.SWITCH, tier="leaf")
    for i in range(n):
        g = t.add_node(f"h/gpu{i}", NodeKind.GPU, host="h", index=i)
        t.add_link(g, "sw", LinkKind.NETWORK, bw, latency_us=latency_us, duplex=False)
        t.add_link("sw", g, LinkKind.NETWORK, down_bw or bw, latency_us=latency_us, duplex=False)
    return t


def ring(n: int, bw: float = 10.0) -> Topology:
    """A unidirectional ring of n GPUs, one link of ``bw`` GB/s from each GPU to the next."""
    t = Topology("ring")
    for i in range(n):
        t.add_node(f"h/gpu{i}", NodeKind.GPU, host="h", index=i)
    for i in range(n):
        t.add_link(f"h/gpu{i}", f"h/gpu{(i + 1) % n}", LinkKind.NVLINK, bw, duplex=False)
    return t


def p2p_job(name: str, transfers: list[tuple[int, int, float]], *, iterations: int = 1, priority: int = 0, rate_cap: float | None = None,
            start_offset: float = 0.0, compute_s: float | None = None) -> Job:
    gpus = sorted({f"h/gpu{i}" for a, b, _ in transfers for i in (a, b)})
    phases: list = [P2PPhase("send", tuple(Transfer(f"h/gpu{a}", f"h/gpu{b}", s) for a, b, s in transfers), priority=priority, rate_cap=rate_cap)]
    if compute_s is not None:
        phases.append(ComputePhase("compute", compute_s, after=("send",)))
    return Job(name, tuple(gpus), tuple(phases), iterations=iterations, start_offset=start_offset)


def flow_ends(result: RunResult, job: str | None = None) -> list[float]:
    return [f.end for f in result.flows if job is None or f.job == job]


def test_one_flow_one_link_takes_size_over_bandwidth():
    t = star(2, bw=10.0)
    r = simulate(t, Workload("w", [p2p_job("a", [(0, 1, 3 * GB)])]))
    assert flow_ends(r) == pytest.approx([0.3], rel=1e-12)
    assert r.jobs["a"].iteration_times() == pytest.approx([0.3], rel=1e-12)


def test_latency_is_added_once_per_flow():
    t = star(2, bw=10.0, latency_us=5.0)
    r = simulate(t, Workload("w", [p2p_job("a", [(0, 1, 1 * GB)])]))
    assert flow_ends(r) == pytest.approx([0.1 + 10e-6], rel=1e-12)  # two hops of 5 us
    r0 = simulate(t, Workload("w", [p2p_job("a", [(0, 1, 1 * GB)])]), latency=False)
    assert flow_ends(r0) == pytest.approx([0.1], rel=1e-12)


@pytest.mark.parametrize("n", [2, 3, 7])
def test_n_flows_on_a_bottleneck_get_b_over_n_each(n):
    # n senders, one receiver: the receiver's downlink (10 GB/s) is the bottleneck
    t = star(n + 1, bw=10.0)
    r = simulate(t, Workload("w", [p2p_job("a", [(i, n, 1 * GB) for i in range(n)])]))
    assert flow_ends(r) == pytest.approx([n * 0.1] * n, rel=1e-12)


def test_unequal_flows_finish_as_processor_sharing():
    # sizes 1, 2, 4 GB on one 10 GB/s link: rates 10/3 until the first is done, then 5, then 10
    t = star(4, bw=10.0)
    r = simulate(t, Workload("w", [p2p_job("a", [(0, 3, 1 * GB), (1, 3, 2 * GB), (2, 3, 4 * GB)])]))
    ends = sorted(flow_ends(r))
    t1 = 3 * 1 / 10
    t2 = t1 + 2 * (2 - 1) / 10
    t3 = t2 + (4 - 2) / 10
    assert ends == pytest.approx([t1, t2, t3], rel=1e-12)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_all_reduce_takes_2_n_minus_1_over_n_s_over_b(n):
    t = ring(n, bw=10.0)
    job = Job("ar", tuple(f"h/gpu{i}" for i in range(n)), (CollectivePhase("ar", "all_reduce", 4 * GB, algorithm="ring"),))
    r = simulate(t, Workload("w", [job]), routing="shortest")
    assert r.jobs["ar"].iteration_times() == pytest.approx([2 * (n - 1) / n * 4 * GB / (10 * GB)], rel=1e-9)


def test_strict_priority_serves_the_urgent_class_first():
    t = star(3, bw=10.0)
    hi = p2p_job("hi", [(0, 2, 2 * GB)], priority=0)
    lo = p2p_job("lo", [(1, 2, 3 * GB)], priority=3)
    r = simulate(t, Workload("w", [lo, hi]))
    assert flow_ends(r, "hi") == pytest.approx([0.2], rel=1e-12)
    assert flow_ends(r, "lo") == pytest.approx([0.5], rel=1e-12)
    # with equal classes they share: the 2 GB flow ends at 0.4 s, the other at 0.5 s
    r_eq = simulate(t, Workload("w", [p2p_job("lo", [(1, 2, 3 * GB)]), p2p_job("hi", [(0, 2, 2 * GB)])]))
    assert flow_ends(r_eq, "hi") == pytest.approx([0.4], rel=1e-12)
    assert flow_ends(r_eq, "lo") == pytest.approx([0.5], rel=1e-12)


def test_weighted_classes_share_by_weight():
    t = star(3, bw=10.0)
    w = Workload("w", [p2p_job("hi", [(0, 2, 3 * GB)], priority=0), p2p_job("lo", [(1, 2, 3 * GB)], priority=1)])
    r = simulate(t, w, sharing="weighted", class_weights=(3, 1, 1, 1, 1, 1, 1, 1))
    # hi gets 7.5 GB/s until done at 0.4 s (lo has moved 1 GB), then lo gets 10 GB/s for 2 GB
    assert flow_ends(r, "hi") == pytest.approx([0.4], rel=1e-12)
    assert flow_ends(r, "lo") == pytest.approx([0.6], rel=1e-12)


def test_rate_cap_limits_a_flow_and_frees_the_rest():
    t = star(3, bw=10.0)
    capped = p2p_job("capped", [(0, 2, 1 * GB)], rate_cap=2.5)
    free = p2p_job("free", [(1, 2, 3 * GB)])
    r = simulate(t, Workload("w", [capped, free]))
    assert flow_ends(r, "capped") == pytest.approx([0.4], rel=1e-12)
    assert flow_ends(r, "free") == pytest.approx([0.4], rel=1e-12)  # 7.5 GB/s for 0.4 s = 3 GB


def test_dependency_chain_and_iteration_barrier():
    t = star(2, bw=10.0)
    phases = (ComputePhase("fwd", 0.2), P2PPhase("send", (Transfer("h/gpu0", "h/gpu1", 1 * GB),), after=("fwd",)),
              ComputePhase("bwd", 0.3, after=("send",)))
    r = simulate(t, Workload("w", [Job("a", ("h/gpu0", "h/gpu1"), phases, iterations=3)]))
    assert r.jobs["a"].iteration_times() == pytest.approx([0.6, 0.6, 0.6], rel=1e-12)
    starts = sorted((p.iteration, p.start) for p in r.phases if p.phase == "fwd")
    assert [s for _, s in starts] == pytest.approx([0.0, 0.6, 1.2], rel=1e-12)


def test_after_previous_lets_iterations_overlap():
    # compute(i+1) waits only for compute(i): compute and send pipeline
    t = star(2, bw=10.0)
    send = P2PPhase("send", (Transfer("h/gpu0", "h/gpu1", 10 * GB),), after=("compute",))
    phases = (ComputePhase("compute", 1.0, after_previous=("compute",)), send)
    r = simulate(t, Workload("w", [Job("a", ("h/gpu0", "h/gpu1"), phases, iterations=3)]))
    assert r.jobs["a"].iteration_ends == pytest.approx([2.0, 3.0, 4.0], rel=1e-12)
    assert r.jobs["a"].iteration_times() == pytest.approx([2.0, 1.0, 1.0], rel=1e-12)


def test_start_offset_interleaves_two_jobs_on_a_shared_link():
    # each iteration: send 10 GB over the shared 10 GB/s downlink (1 s), then compute 1 s
    t = star(3, bw=10.0)

    def workload(offset):
        return Workload("w", [p2p_job("a", [(0, 2, 10 * GB)], iterations=3, compute_s=1.0),
                              p2p_job("b", [(1, 2, 10 * GB)], iterations=3, compute_s=1.0, start_offset=offset)])

    together = simulate(t, workload(0.0))
    assert together.jobs["a"].iteration_times() == pytest.approx([3.0] * 3, rel=1e-12)  # 2 s shared send + 1 s compute
    shifted = simulate(t, workload(1.0))  # CASSINI's time shift: b sends while a computes
    assert shifted.jobs["a"].iteration_times() == pytest.approx([2.0] * 3, rel=1e-12)
    assert shifted.jobs["b"].iteration_times() == pytest.approx([2.0] * 3, rel=1e-12)
    assert shifted.jobs["b"].jct == pytest.approx(7.0, rel=1e-12)  # the shift is paid for


def test_arrival_delays_release_and_jct_counts_from_arrival():
    t = star(2, bw=10.0)
    job = Job("a", ("h/gpu0", "h/gpu1"), (ComputePhase("c", 1.0),), iterations=2, arrival=5.0, start_offset=0.5)
    r = simulate(t, Workload("w", [job]))
    assert r.jobs["a"].iteration_ends == pytest.approx([6.5, 7.5])
    assert r.jobs["a"].jct == pytest.approx(2.5)


def test_ecmp_splits_over_parallel_paths():
    t = Topology("diamond")
    for g in ("h/gpu0", "h/gpu1"):
        t.add_node(g, NodeKind.GPU, host="h")
    for s in ("s0", "s1"):
        t.add_node(s, NodeKind.SWITCH)
        t.add_link("h/gpu0", s, LinkKind.NETWORK, 10.0)
        t.add_link(s, "h/gpu1", LinkKind.NETWORK, 10.0)
    w = Workload("w", [Job("a", ("h/gpu0", "h/gpu1"), (P2PPhase("s", (Transfer("h/gpu0", "h/gpu1", 2 * GB),)),))])
    assert flow_ends(simulate(t, w, routing="ecmp")) == pytest.approx([0.1], rel=1e-9)
    assert flow_ends(simulate(t, w, routing="shortest")) == pytest.approx([0.2], rel=1e-9)


def test_reference_solver_gives_the_same_simulation():
    t = star(4, bw=10.0)
    w = Workload("w", [p2p_job("a", [(0, 3, 1 * GB), (1, 3, 2 * GB)], iterations=2, compute_s=0.1, priority=1),
                       p2p_job("b", [(2, 3, 1.5 * GB)], iterations=3, compute_s=0.05, rate_cap=4.0)])
    fast = simulate(t, w)
    slow = simulate(t, w, solver="python", memo=False)
    unmemoised = simulate(t, w, memo=False)
    assert fast.meta["memo_hits"] > 0
    for name in ("a", "b"):
        assert fast.jobs[name].iteration_ends == pytest.approx(slow.jobs[name].iteration_ends, rel=1e-9)
        assert fast.jobs[name].iteration_ends == pytest.approx(unmemoised.jobs[name].iteration_ends, rel=1e-12)


def test_link_utilisation_conserves_bytes():
    t = star(3, bw=10.0)
    w = Workload("w", [p2p_job("a", [(0, 2, 1 * GB), (1, 2, 2 * GB)], iterations=2, compute_s=0.05)])
    r = simulate(t, w, util_bins=16)
    links = r.links
    widths = np.diff(links.bin_edges)
    carried = (links.util * widths[None, :] * np.asarray(links.capacity)[:, None] * GB).sum(axis=1)
    by_link = dict(zip(links.links, carried, strict=True))
    assert by_link["sw->h/gpu2"] == pytest.approx(2 * 3 * GB, rel=1e-9)
    assert by_link["h/gpu0->sw"] == pytest.approx(2 * 1 * GB, rel=1e-9)
    assert links.util.max() <= 1 + 1e-9


def test_result_round_trips_through_json(tmp_path):
    t = star(3, bw=10.0)
    r = simulate(t, Workload("w", [p2p_job("a", [(0, 2, 1 * GB)], iterations=2, compute_s=0.05)]))
    back = RunResult.read(r.write(tmp_path / "r.json"))
    assert back.jobs == r.jobs and back.flows == r.flows and back.phases == r.phases and back.links == r.links
    assert back.makespan == r.makespan


def test_bad_gpu_is_an_input_error():
    from topology.errors import InputError

    w = Workload("w", [Job.data_parallel("a", ["h/gpu0", "h/gpu9"], compute_s=0.1, nbytes=1e9)])
    with pytest.raises(InputError, match=r"jobs\[0\]\.gpus\[1\]"):
        simulate(star(2), w)
    with pytest.raises(InputError, match="sharing"):
        simulate(star(2), Workload("w", [p2p_job("a", [(0, 1, 1e9)])]), sharing="fair")


# -- max-min fairness: the solver against brute force -------------------------------------------------------


@st.composite
def instances(draw):
    n_links = draw(st.integers(1, 6))
    n_flows = draw(st.integers(1, 8))
    capacity = draw(st.lists(st.integers(1, 20).map(float), min_size=n_links, max_size=n_links))
    paths = [sorted(draw(st.sets(st.integers(0, n_links - 1), min_size=1, max_size=n_links))) for _ in range(n_flows)]
    weight = draw(st.lists(st.sampled_from([1.0, 2.0, 3.0]), min_size=n_flows, max_size=n_flows))
    cap = draw(st.lists(st.one_of(st.just(math.inf), st.integers(1, 10).map(float)), min_size=n_flows, max_size=n_flows))
    prio = draw(st.lists(st.integers(0, 2), min_size=n_flows, max_size=n_flows))
    sharing = draw(st.sampled_from(["strict", "weighted"]))
    return paths, capacity, weight, cap, prio, sharing


def _csr(paths):
    indptr = np.cumsum([0] + [len(p) for p in paths])
    return indptr, np.asarray([link for p in paths for link in p], dtype=np.intp)


@settings(max_examples=150, deadline=None)
@given(instances())
def test_vectorised_maxmin_matches_reference_and_is_maxmin_fair(inst):
    paths, capacity, weight, cap, prio, sharing = inst
    indptr, links = _csr(paths)
    fast = maxmin_rates(indptr, links, np.asarray(capacity), weight=np.asarray(weight), cap=np.asarray(cap), prio=np.asarray(prio), sharing=sharing)
    ref = maxmin_rates_reference(paths, capacity, weight=weight, cap=cap, prio=prio, sharing=sharing)
    assert fast.tolist() == pytest.approx(ref, rel=1e-9, abs=1e-9)
    assert check_maxmin(paths, capacity, fast.tolist(), weight=weight, cap=cap, prio=prio, sharing=sharing) == []


@settings(max_examples=100, deadline=None)
@given(instances(), st.data())
def test_no_flow_can_grow_without_hurting_a_smaller_one(inst, data):
    """Brute force over perturbations: raising a flow needs lowering one with smaller or equal normalised rate (same class)."""
    paths, capacity, weight, cap, prio, _ = inst
    rate = maxmin_rates_reference(paths, capacity, weight=weight, cap=cap, prio=prio, sharing="weighted")
    f = data.draw(st.integers(0, len(paths) - 1))
    if rate[f] >= cap[f] * (1 - 1e-9):
        return
    delta = 1e-3
    load = [0.0] * len(capacity)
    for g, p in enumerate(paths):
        for link in p:
            load[link] += rate[g]
    # links on f's path that have no room: some flow there must give up delta; the cheapest such flow
    # (lowest normalised rate other than f) must not be below f's normalised rate
    tight = [link for link in paths[f] if load[link] + delta > capacity[link] * (1 + 1e-12)]
    assert tight, "a flow below its cap with slack on every link: not max-min (it could grow for free)"
    level = rate[f] / weight[f]
    # the bottleneck link: on it f's level is the highest, so growing f lowers a flow whose level is <= f's
    assert any(all(rate[g] / weight[g] <= level * (1 + 1e-9) + 1e-12 for g in range(len(paths)) if link in paths[g]) for link in tight)


def test_checker_rejects_an_allocation_that_is_not_maxmin():
    paths, capacity = [[0], [0, 1], [1]], [1.0, 3.0]
    assert check_maxmin(paths, capacity, [0.5, 0.5, 2.5]) == []
    assert check_maxmin(paths, capacity, [0.5, 0.5, 2.0])  # flow 2 could grow: no bottleneck
    assert check_maxmin(paths, capacity, [0.8, 0.2, 2.8])  # flow 1 is below flow 0 on its only saturated link
    assert check_maxmin(paths, capacity, [0.6, 0.5, 2.5])  # link 0 over capacity


# -- the command line ------------------------------------------------------------------------------------------


def test_cli_run_writes_result_and_timeline(tmp_path, capsys):
    from emu.workload import write_workload
    from netweave.cli import main
    from topology.io import write_topology

    write_topology(star(3), tmp_path / "t.json")
    write_workload(Workload("w", [p2p_job("a", [(0, 2, 1 * GB)], iterations=2, compute_s=0.1)]), tmp_path / "w.json")
    rc = main(["emu", "run", str(tmp_path / "w.json"), "--topology", str(tmp_path / "t.json"), "--out", str(tmp_path / "out"), "--json"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["jobs"][0]["mean_iteration_s"] == pytest.approx(0.2)
    back = RunResult.read(tmp_path / "out" / "result.json")
    assert back.jobs["a"].iteration_ends == pytest.approx([0.2, 0.4])
    assert (tmp_path / "out" / "timeline.png").stat().st_size > 1000


def test_cli_example_runs_on_the_default_cluster(tmp_path, capsys):
    from netweave.cli import main

    assert main(["emu", "example", "--out", str(tmp_path / "ex.yaml")]) == 0
    assert main(["emu", "run", str(tmp_path / "ex.yaml"), "--out", str(tmp_path / "o"), "--no-flows"]) == 0
    assert "dp-a" in capsys.readouterr().out


def test_cli_errors_are_one_line(tmp_path, capsys, monkeypatch):
    import sys

    from emu.workload import write_workload
    from netweave.cli import main

    (tmp_path / "bad.yaml").write_text("jobs:\n  - name: a\n    gpus: [node0/gpu0]\n    phases: [{name: c, duration: -1}]\n")
    assert main(["emu", "run", str(tmp_path / "bad.yaml"), "--out", str(tmp_path / "o")]) == 2
    assert "bad.yaml: jobs[0].phases[0].duration: expected a non-negative number" in capsys.readouterr().err
    write_workload(Workload("w", [p2p_job("a", [(0, 1, 1 * GB)])]), tmp_path / "w.yaml")
    from topology.io import write_topology

    write_topology(star(2), tmp_path / "t.json")
    monkeypatch.setitem(sys.modules, "emu.mininet_backend", None)  # as if the module were absent
    assert main(["emu", "compare", str(tmp_path / "w.yaml"), "--topology", str(tmp_path / "t.json"), "--out", str(tmp_path / "o")]) == 2
    assert "Mininet backend is not available" in capsys.readouterr().err


def test_demo_shows_interference_only_on_the_oversubscribed_fabric(tmp_path, cluster):
    import json as _json

    from emu.demo import demo

    report, text = demo(cluster, tmp_path)
    _json.dumps(report)
    assert abs(report["slowdown_default"]) < 1e-9  # non-blocking fabric: the two jobs do not interfere
    assert report["slowdown_oversubscribed"] > 0.2
    s = report["scenarios"]
    alone = s["alone_oversubscribed"]["mean_iteration_s"]["dp-a"]
    assert s["shifted_oversubscribed"]["mean_iteration_s"]["dp-a"] < s["together_oversubscribed"]["mean_iteration_s"]["dp-a"]
    assert s["priority_oversubscribed"]["mean_iteration_s"]["dp-a"] == pytest.approx(alone, rel=1e-9)  # class 0 runs as if alone
    assert (tmp_path / "timeline-oversubscribed.png").exists() and "oversubscribed" in text


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"])
@pytest.mark.parametrize("policy", ["rail", "ecmp"])
def test_uncontended_ring_collectives_match_the_alpha_beta_model(op, policy):
    """Alone on the fabric, a ring collective's simulated time is topology.collectives' alpha-beta time exactly."""
    from topology import build_cluster
    from topology.collectives import collective_time

    t = build_cluster(2)
    gpus = [g for g in t.gpus() if int(g[-1]) < 4]  # 4 GPUs on each host: 4 channels crossing rails
    job = Job("j", tuple(gpus), (CollectivePhase("c", op, 1e9, algorithm="ring"),), routing=policy)
    simulated = simulate(t, Workload("w", [job])).jobs["j"].iteration_times()[0]
    assert simulated == pytest.approx(collective_time(t, op, gpus, 1e9, "ring", policy=policy).time_s, rel=1e-9)


def test_compare_results_reports_per_job_error_and_mape():
    from emu.results import JobResult, compare_results, format_comparison

    t = star(3, bw=10.0)
    sim = simulate(t, Workload("w", [p2p_job("a", [(0, 2, 1 * GB)], iterations=2, compute_s=0.1),
                                     p2p_job("b", [(1, 2, 1 * GB)], iterations=2, compute_s=0.1)]))
    same = compare_results(sim, sim)
    assert same["mape"] == 0 and all(r["error_pct"] == 0 for r in same["rows"])
    slower = RunResult("mininet", sim.workload, sim.topology, jobs={
        "a": JobResult("a", 0.0, 0.0, [e * 1.1 for e in sim.jobs["a"].iteration_ends]),
        "b": JobResult("b", 0.0, 0.0, [e * 0.8 for e in sim.jobs["b"].iteration_ends])})
    cmp = compare_results(sim, slower)
    assert [r["error_pct"] for r in cmp["rows"]] == pytest.approx([10.0, -20.0])
    assert cmp["mape"] == pytest.approx(15.0) and "MAPE" in format_comparison(cmp)


@st.composite
def small_workloads(draw):
    n = 4
    jobs = []
    for j in range(draw(st.integers(1, 3))):
        phases: list = []
        names: list[str] = []
        for k in range(draw(st.integers(1, 4))):
            name = f"p{k}"
            after = tuple(draw(st.lists(st.sampled_from(names), unique=True, max_size=2))) if names else ()
            if draw(st.booleans()):
                phases.append(ComputePhase(name, draw(st.sampled_from([0.0, 0.05, 0.1, 0.3])), after))
            else:
                pairs = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)).filter(lambda p: p[0] != p[1]), min_size=1, max_size=3))
                transfers = tuple(Transfer(f"h/gpu{a}", f"h/gpu{b}", draw(st.sampled_from([0.5, 1.0, 2.0])) * GB) for a, b in pairs)
                phases.append(P2PPhase(name, transfers, after, priority=draw(st.sampled_from([None, 0, 1, 2])),
                                       rate_cap=draw(st.sampled_from([None, None, 2.5, 7.0]))))
            names.append(name)
        jobs.append(Job(f"j{j}", tuple(f"h/gpu{i}" for i in range(n)), tuple(phases), iterations=draw(st.integers(1, 3)),
                        start_offset=draw(st.sampled_from([0.0, 0.05, 0.2]))))
    return Workload("random", tuple(jobs)), draw(st.sampled_from(["strict", "weighted"]))


@settings(max_examples=25, deadline=None)
@given(small_workloads())
def test_random_workloads_agree_across_solvers_and_respect_line_rates(case):
    w, sharing = case
    t = star(4, bw=10.0, down_bw=5.0)
    fast = simulate(t, w, sharing=sharing, util_bins=32)
    naive = simulate(t, w, sharing=sharing, solver="python", memo=False)
    for name, job in fast.jobs.items():
        assert job.iteration_ends == pytest.approx(naive.jobs[name].iteration_ends, rel=1e-7, abs=1e-12)
        assert len(job.iteration_ends) == w.job(name).iterations
    for f in fast.flows:
        cap = w.job(f.job).phase_rate_cap(w.job(f.job).phases[int(f.phase[1:])])
        best = min(5.0, cap or math.inf) * GB  # the receiver's 5 GB/s downlink bounds every flow
        assert f.end - f.start >= f.nbytes / best * (1 - 1e-9)
    if fast.links is not None and fast.links.util.size:  # (None when nothing took time)
        assert fast.links.util.max() <= 1 + 1e-9


def test_single_user_links_as_caps_leave_the_rates_unchanged():
    """The solver's reduced incidence (single-user links folded into caps) gives the full incidence's rates."""
    from emu.sim import SimConfig, Simulator
    from emu.sim_maxmin import maxmin_rates_coo
    from topology import build_cluster

    t = build_cluster(2)
    g = t.gpus()
    w = Workload("w", [Job.data_parallel("a", g[:3] + g[8:11], compute_s=0.0, nbytes=1e9, routing="ecmp"),
                       Job("b", tuple(g[4:6] + g[12:14]), (CollectivePhase("ag", "all_to_all", 1e9, rate_cap=20.0),), routing="rail")])
    sim = Simulator(t, w, SimConfig())
    reduced_somewhere = False
    for tpl in sim.step_cache.values():
        n = len(tpl.sub_bytes)
        local_full = np.unique(tpl.entry_link, return_inverse=True)
        full = maxmin_rates_coo(tpl.entry_sub, local_full[1], n, sim.net.capacity[local_full[0]], cap=tpl.sub_cap)
        local_red = np.unique(tpl.solve_link, return_inverse=True)
        red = maxmin_rates_coo(tpl.solve_sub, local_red[1], n, sim.net.capacity[local_red[0]], cap=tpl.solve_cap)
        assert red == pytest.approx(full, rel=1e-9)
        reduced_somewhere |= len(tpl.solve_link) < len(tpl.entry_link)
    assert reduced_somewhere
