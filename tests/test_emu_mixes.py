"""The agreement suite's mixes in the simulator (closed forms, invariants) and the aggregate NIC mode's plumbing (no root needed).

Emulation runs of the same mechanics are in ``tests/test_emu_fidelity.py``.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emu import mixes
from emu.htb import NUM_PRIORITIES, _address_key, batch_state, check_htb_tree, class_counters, htb_tree_commands, nic_ack_classid, nic_classid
from emu.net import WIRE_OVERHEAD, flow_endpoints, plan_network, route_nics
from emu.sim import simulate
from emu.workload import CollectivePhase, Job, Workload, WorkloadError, loads_workload
from topology import default_cluster

NIC_GBS = 50.0  # the default cluster's 400 Gb/s NICs


@pytest.fixture(scope="module")
def topo():
    return default_cluster()


def _iteration(topo, workload, job):
    return simulate(topo, workload, latency=False).jobs[job].mean_iteration_time()


# -- simulator closed forms on the mixes ------------------------------------------------------------------


def test_direct_all_to_all_on_an_idle_fabric_takes_the_busiest_nic_bytes_over_its_rate(topo):
    # 8 GPUs on 2 hosts: each GPU sends S/8 to each of the 4 GPUs of the other host through its own NIC (and 3 x S/8 over NVLink)
    S = 100e6
    w = Workload("moe", [Job.mixture_of_experts("moe", [f"node{h}/gpu{k}" for h in (0, 1) for k in range(4)], compute_s=0.002,
                                                expert_s=0.001, nbytes=S)])
    nic_bytes = 4 * S / 8
    assert _iteration(topo, w, "moe") == pytest.approx(0.002 + 0.001 + 2 * nic_bytes / (NIC_GBS * 1e9), rel=1e-9)


def test_ring_all_to_all_takes_n_minus_1_steps_of_one_chunk_per_nic(topo):
    S, n = 100e6, 8
    w = Workload("moe", [Job.mixture_of_experts("moe", [f"node{h}/gpu{k}" for h in (0, 1) for k in range(4)], compute_s=0.0,
                                                expert_s=0.0, nbytes=S, algorithm="ring")])
    # every step k = 1..7 has a flow crossing hosts (one per NIC at most); the NVLink flows of a step are faster
    assert _iteration(topo, w, "moe") == pytest.approx(2 * (n - 1) * (S / n) / (NIC_GBS * 1e9), rel=1e-9)


def test_jobs_on_a_non_blocking_fabric_run_as_they_would_alone(topo):
    w = mixes.dp_sizes()
    together = simulate(topo, w, latency=False)
    for job in w.jobs:
        alone = simulate(topo, Workload("solo", [job]), latency=False)
        assert together.jobs[job.name].mean_iteration_time() == pytest.approx(alone.jobs[job.name].mean_iteration_time(), rel=1e-9)


def test_pxn_classes_share_one_nic_in_priority_order(topo):
    w = mixes.three_classes()
    r = simulate(topo, w, latency=False)
    times = {j: r.jobs[j].mean_iteration_time() for j in ("hi", "mid", "lo")}
    alone = {j.name: _iteration(topo, Workload("solo", [j]), j.name) for j in w.jobs}
    assert times["hi"] == pytest.approx(alone["hi"], rel=1e-9)  # class 0 never waits
    assert times["hi"] < times["mid"] < times["lo"] and times["mid"] > alone["mid"] and times["lo"] > alone["lo"]
    out_nic = {route_nics(topo, *mixes.RAIL_PAIRS[j], "rail")[0] for j in times}
    assert out_nic == {"node0/nic0"}  # the shared NIC the case is built on


def test_a_cassini_shift_that_separates_the_all_reduces_gives_the_solo_iteration(topo):
    compute = 0.002
    solo = _iteration(topo, Workload("solo", [mixes.cassini_pair().jobs[0]]), "a")
    comm = solo - compute
    shifted = mixes.cassini_pair({"b": (compute + comm) / 2})
    for j in ("a", "b"):
        assert _iteration(topo, shifted, j) == pytest.approx(solo, rel=1e-9)
        assert _iteration(topo, mixes.cassini_pair(), j) > 1.4 * solo  # unshifted, the shared NIC slows both


def test_pipeline_sends_and_all_reduce_share_the_stage_nic(topo):
    w = mixes.pipeline_beside_dp()
    job = w.job("ppdp")
    alone = _iteration(topo, Workload("solo", [job]), "ppdp")
    phases = {p.phase: p.end - p.start for p in simulate(topo, Workload("solo", [job]), latency=False).phases if p.iteration == 0}
    grad_alone = 50e6 / (NIC_GBS * 1e9)
    assert phases["grad"] > 1.5 * grad_alone  # the gradient send shares node2/nic0 and node3/nic0 with the stage-1 all-reduce
    assert _iteration(topo, w, "ppdp") == pytest.approx(alone, rel=1e-9)  # the DP job on GPUs 1-2 takes other NICs


# -- workload: all-to-all algorithms ------------------------------------------------------------------------


def test_all_to_all_accepts_direct_and_other_ops_refuse_it():
    text = """
jobs:
  - name: moe
    gpus: [node0/gpu0, node1/gpu0]
    phases:
      - {name: a2a, kind: collective, op: all_to_all, algorithm: direct, bytes: 1MB}
"""
    assert loads_workload(text).jobs[0].phases[0].algorithm == "direct"
    with pytest.raises(WorkloadError, match=r"all_reduce runs with ring, tree, hierarchical, got 'direct'") as exc:
        loads_workload(text.replace("all_to_all", "all_reduce"), source="w.yaml")
    assert "jobs[0].phases[0].algorithm" in str(exc.value) and "w.yaml" in str(exc.value)
    with pytest.raises(WorkloadError, match="all_to_all runs with"):
        Workload("w", [Job("j", ("node0/gpu0", "node1/gpu0"), (CollectivePhase("x", "all_to_all", 1e6, "tree"),))]).validate()


# -- ranking -------------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.sampled_from("abcde"), st.floats(0.1, 10), min_size=1), st.floats(0.5, 2))
def test_ranking_agrees_with_any_monotone_rescaling(times, factor):
    scaled = {k: factor * v + 0.01 for k, v in times.items()}
    assert mixes.ranking_agrees(times, scaled)
    flipped = {k: 1 / v for k, v in times.items()}
    distinct = any(abs(a - b) > 0.02 * max(a, b) for a in times.values() for b in times.values())
    assert mixes.ranking_agrees(times, flipped) == (not distinct)


# -- aggregate NIC mode: addresses, routes, HTB subtrees ------------------------------------------------------


def test_aggregate_plan_gives_every_nic_an_address_and_its_rate(topo):
    plan = plan_network(topo, time_scale=8000, nic_mode="aggregate", prefix="nw")
    for i in plan.interfaces:
        assert len(i.nic_ips) == len(i.nics) == 8 and len(set(i.nic_ips)) == 8
        assert i.nic_rates_mbit == pytest.approx([NIC_GBS * 8e3 / 8000] * 8) and sum(i.nic_rates_mbit) == pytest.approx(i.rate_mbit)
    assert len({ip for i in plan.interfaces for ip in (*i.nic_ips, i.ip)}) == 4 * 9
    host, switch = plan.htb_specs()[:2]
    assert host[1].nic_match == "src" and switch[1].nic_match == "dst"
    assert [r for _ip, r in host[1].nic_classes] == pytest.approx([50 * WIRE_OVERHEAD] * 8)


@pytest.mark.parametrize("policy", ["ecmp", "rail", "shortest"])
def test_flows_leave_and_enter_through_the_nics_the_simulator_routes_them_through(topo, policy):
    agg = plan_network(topo, time_scale=8000, nic_mode="aggregate", prefix="nw")
    leaf = plan_network(topo, time_scale=1000, prefix="nw")
    for src, dst in [("node0/gpu1", "node3/gpu6"), ("node2/gpu5", "node1/gpu5"), ("node1/gpu7", "node0/gpu0")]:
        out_nic, in_nic = route_nics(topo, src, dst, policy)
        tx, src_ip, rx, dst_ip = flow_endpoints(agg, topo, src, dst, policy)
        assert src_ip == tx.nic_ips[tx.nics.index(out_nic)] and dst_ip == rx.nic_ips[rx.nics.index(in_nic)]
        tx, src_ip, rx, dst_ip = flow_endpoints(leaf, topo, src, dst, policy)
        assert out_nic in tx.nics and (src_ip, dst_ip) == (tx.ip, rx.ip) and tx.leaf == rx.leaf
        if policy == "rail":
            assert in_nic in rx.nics  # rail-aligned: the emulated route is the simulated one
    assert flow_endpoints(agg, topo, "node1/gpu0", "node1/gpu5") is None


def test_nic_subtrees_are_classified_by_address_before_the_plain_leaves():
    nics = [("10.1.0.1", 50.0), ("10.2.0.1", 50.0)]
    lines = htb_tree_commands("d", 400.0, nic_classes=nics, nic_match="dst")
    st_ = batch_state(lines)
    plain_prefs = [pref for (pref, flowid) in st_.filters if flowid in ("1:20",) or flowid.split(":")[1] in {f"{0x10 + p:x}" for p in range(8)}]
    nic_prefs = [pref for (pref, flowid) in st_.filters if int(flowid.split(":")[1], 16) >= 0x100]
    assert len(nic_prefs) == 2 * (NUM_PRIORITIES + 1) and max(nic_prefs) < min(plain_prefs)
    for k, (addr, rate) in enumerate(nics):
        assert st_.classes[nic_classid(k)] == ("1:1", None, rate * 1e6, rate * 1e6)
        for p in range(NUM_PRIORITIES):
            parent, prio, floor, ceil = st_.classes[nic_classid(k, p)]
            assert (parent, prio, ceil) == (nic_classid(k), p, rate * 1e6) and floor == pytest.approx(0.01 * rate * 1e6)
            keys = next(v for (_pref, flowid), v in st_.filters.items() if flowid == nic_classid(k, p))
            assert _address_key(addr, "dst") in keys
        assert st_.classes[nic_ack_classid(k)][1] == 0
    assert htb_tree_commands("d", 400.0) == [x for x in htb_tree_commands("d", 400.0, nic_classes=()) if x]  # no NICs: the plain tree


def _class_text(lines: list[str], sent: dict[str, int]) -> str:
    """``tc -s class show`` text for the classes of a batch, with the given sent bytes."""
    out = []
    for cid, (parent, prio, rate, ceil) in batch_state(lines).classes.items():
        where = "root" if parent is None else f"parent {parent}"
        leaf = f" leaf {cid.split(':')[1]}:" if prio is not None else ""
        out.append(f"class htb {cid} {where}{leaf}{'' if prio is None else f' prio {prio}'} rate {rate / 1e3:.0f}Kbit ceil {ceil / 1e3:.0f}Kbit")
        out.append(f" Sent {sent.get(cid, 0)} bytes {sent.get(cid, 0) // 1000} pkt (dropped 0, overlimits 0 requeues 0)")
    return "\n".join(out) + "\n"


def test_class_counters_add_each_priority_over_the_nic_subtrees():
    lines = htb_tree_commands("d", 400.0, nic_classes=[("10.1.0.1", 50.0), ("10.2.0.1", 50.0)])
    text = _class_text(lines, {"1:13": 5, "1:113": 1000, "1:213": 2000, "1:100": 3005, "1:120": 77, "1:1": 9999})
    counters = class_counters(text)
    assert counters[3]["sent_bytes"] == 3005 and counters[7]["sent_bytes"] == 0 and set(counters) == set(range(NUM_PRIORITIES))


def test_the_tree_check_names_a_missing_nic_leaf_and_filter():
    from emu.htb import HtbSpec

    nics = (("10.1.0.1", 50.0),)
    spec = HtbSpec("d", 400.0, nic_classes=nics)
    lines = htb_tree_commands("d", 400.0, nic_classes=nics)
    cls = _class_text(lines, {})
    qd = "qdisc htb 1: root refcnt 2 r2q 10 default 0x17 direct_packets_stat 0\n" + "".join(
        f"qdisc pfifo {c.split(':')[1]}: parent {c} limit 200p\n" for c in batch_state(lines).leaves)
    assert check_htb_tree(spec, qd, cls, "") != []  # no filters at all
    broken = "\n".join(x for x in cls.splitlines() if not x.startswith("class htb 1:113 "))
    problems = check_htb_tree(spec, qd, broken, "")
    assert any("NIC leaf 1:113 (10.1.0.1, priority 3) missing" in p for p in problems)
    assert any("no u32 filter sending src 10.1.0.1 with TOS 0x80 to 1:113" in p for p in problems)


def test_nic_utilisation_of_a_lone_transfer_is_its_share_of_the_run(topo):
    # one 50 MB send and nothing else: the send's two NICs are busy for the whole run, every other NIC idle
    from emu.workload import P2PPhase, Transfer

    w = Workload("one", [Job("j", ("node0/gpu1", "node2/gpu6"), (P2PPhase("s", (Transfer("node0/gpu1", "node2/gpu6", 50e6),)),))])
    u = mixes.nic_utilisation(topo, w, simulate(topo, w, latency=False))
    assert u == pytest.approx({"node0/nic1 out": 1.0, "node2/nic6 in": 1.0})
    rail = w.with_job(Job("j", ("node0/gpu1", "node2/gpu6"), w.jobs[0].phases, routing="rail"))
    u = mixes.nic_utilisation(topo, rail, simulate(topo, rail, latency=False))
    assert u == pytest.approx({"node0/nic6 out": 1.0, "node2/nic6 in": 1.0})  # PXN: out through the destination's rail
