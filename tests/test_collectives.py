"""Collective plans and their routed alpha-beta cost, against nccl-tests' bus-bandwidth formulas."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from topology import InputError, LinkKind, NodeKind, Topology, build_cluster, build_node
from topology.collectives import (
    ALGORITHMS,
    OPS,
    CollectiveSchedule,
    P2PFlow,
    alpha_beta,
    bus_factor,
    collective_flows,
    collective_time,
    double_binary_tree,
    ideal_time,
    plan_collective,
    schedule_time,
    schedules_cost_and_loads,
)
from topology.routing import route_flows

S = float(2**30)


def star(n: int, bw: float, latency_us: float = 0.0) -> Topology:
    """n GPUs, each with one link of ``bw`` GB/s to a single NVSwitch: one uniform bottleneck."""
    t = Topology("star")
    t.add_node("h/nvs0", NodeKind.NVSWITCH, host="h", index=0, domain="h")
    for i in range(n):
        t.add_node(f"h/gpu{i}", NodeKind.GPU, host="h", index=i)
        t.add_link(f"h/gpu{i}", "h/nvs0", LinkKind.NVLINK, bw, latency_us=latency_us)
    return t


def test_bus_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 4) == 1.5
    assert bus_factor("reduce_scatter", 4) == bus_factor("all_gather", 4) == bus_factor("all_to_all", 4) == 0.75
    assert bus_factor("broadcast", 4) == bus_factor("send_recv", 4) == 1.0
    assert ideal_time("all_gather", 4, 4e9, 100.0) == pytest.approx(0.03)


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_ring_all_reduce_beta_is_exactly_the_bus_bound(n):
    B, L = 37.0, 0.4
    t = star(n, B, latency_us=L)
    c = collective_time(t, "all_reduce", t.gpus(), S)
    assert c.beta_s == pytest.approx(2 * (n - 1) / n * S / (B * 1e9), rel=1e-12)
    assert c.busbw_beta == pytest.approx(B, rel=1e-12)
    assert c.alpha_s == pytest.approx(2 * (n - 1) * 2 * L * 1e-6)  # 2(n-1) steps of one GPU -> switch -> GPU transfer
    assert c.time_s == pytest.approx(c.alpha_s + c.beta_s)
    assert c.algbw == pytest.approx(S / c.time_s / 1e9)
    assert c.busbw == pytest.approx(c.algbw * 2 * (n - 1) / n)


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send_recv"])
def test_one_dgx_h100_reaches_the_nvswitch_bandwidth(op):
    t = build_node("dgx-h100")
    assert collective_time(t, op, t.gpus(), S).busbw_beta == pytest.approx(450.0, rel=1e-12)
    nccl = build_node("dgx-h100", nccl_model=True)
    assert collective_time(nccl, op, nccl.gpus(), S).busbw_beta == pytest.approx(18 * 20.6, rel=1e-12)


@pytest.mark.parametrize("hosts", [2, 3, 4])
def test_dgx_nodes_on_a_rail_fabric_are_limited_by_nvlink_or_the_eight_nics(hosts):
    t = build_cluster(hosts)
    c = collective_time(t, "all_reduce", t.gpus(), S)
    assert c.channels == 8
    assert c.busbw_beta == pytest.approx(min(450.0, 8 * 50.0), rel=1e-12)
    assert t.graph.nodes[c.bottleneck_link[0]]["kind"] == NodeKind.NIC
    # NCCL's figures: 18 x 20.6 = 370.8 GB/s NVLink is now below 8 x 48 (PCIe) and 8 x 50 (NIC)
    nccl = build_cluster(hosts, node_options={"nccl_model": True})
    assert collective_time(nccl, "all_reduce", nccl.gpus(), S).busbw_beta == pytest.approx(370.8, rel=1e-12)
    # 200 Gb/s NICs: 8 x 25 GB/s
    slow = build_cluster(hosts, node_options={"nic_gbps": 200})
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        assert collective_time(slow, op, slow.gpus(), S).busbw_beta == pytest.approx(200.0, rel=1e-12)


def test_ecmp_on_a_non_blocking_spine_matches_rail_for_rings():
    t = build_cluster(2)
    assert collective_time(t, "all_reduce", t.gpus(), S, policy="ecmp").busbw_beta == pytest.approx(400.0)
    # static routing pins each cross-rail hop of the 8 rings on one 12.5 GB/s spine group (D-mod-K gives
    # every hop of a step its own group): 8 channels x 12.5 GB/s
    assert collective_time(t, "all_reduce", t.gpus(), S, policy="shortest").busbw_beta == pytest.approx(8 * 12.5)
    # in a full scalable unit the spine groups are as wide as the NICs: static routing costs nothing
    full = build_cluster(4, hosts_per_su=4, spines=1)
    assert collective_time(full, "all_reduce", full.gpus(), S, policy="shortest").busbw_beta == pytest.approx(400.0)


def test_latency_chains_of_tree_and_broadcast():
    n, L = 6, 0.5
    t = star(n, 10.0, latency_us=L)
    hop = 2 * L * 1e-6  # GPU -> switch -> GPU
    # one island: both trees are the chain; the tail's way up to the head and back down is the depth
    assert collective_time(t, "all_reduce", t.gpus(), S, "tree").alpha_s == pytest.approx(2 * (n - 1) * hop)
    # a pipelined broadcast waits for the whole chain once
    assert collective_time(t, "broadcast", t.gpus(), S).alpha_s == pytest.approx((n - 1) * hop)
    assert collective_time(t, "all_gather", t.gpus(), S, step_overhead_us=3.0).alpha_s == pytest.approx((n - 1) * (hop + 3e-6))


def test_rail_policy_keeps_rings_off_the_spine():
    t = build_cluster(3)
    for step in collective_flows(t, "all_reduce", t.gpus(), S)[:1]:
        for u, v, _ in route_flows(t, step, "rail"):
            assert not any(x.startswith("spine") for x in (u, v))


def test_tree_on_one_host_is_a_chain():
    # both trees are the chain; a middle GPU sends S/2 up and S/2 down per tree: 2S over its link
    n, B = 8, 450.0
    t = build_node("dgx-h100")
    c = collective_time(t, "all_reduce", t.gpus(), S, "tree")
    assert c.beta_s == pytest.approx(2 * S / (B * 1e9))
    assert c.busbw_beta == pytest.approx((n - 1) / n * B)


def test_tree_on_two_dgx_hand_computed():
    # 8 channels x 2 trees, D = S/16 per (channel, tree). A GPU heads the chain of one channel
    # (sends D down per tree over NVLink; its up/down hops to the other host use its NIC), is the
    # tail of one (D up per tree) and in the middle of six (D up and D down per tree):
    # NVLink out = 2 * (6*2D + D + D) = 28 D = 1.75 S; each NIC carries 2D = S/8 < 1.75 S * 50/450.
    t = build_cluster(2)
    c = collective_time(t, "all_reduce", t.gpus(), S, "tree")
    assert c.beta_s == pytest.approx(1.75 * S / 450e9)
    assert c.busbw_beta == pytest.approx(2 * 15 / 16 * 450 / 1.75)
    # alpha: the longest leaf-to-root chain up and back down
    assert c.alpha_s > collective_time(t, "all_reduce", t.gpus()[:8], S, "tree").alpha_s


def test_all_to_all_two_dgx_hand_computed():
    # each GPU sends S/16 to each of 15 peers; NIC j of a host carries the 8 transfers to GPU j of
    # the other host (rail policy: relayed over NVLink): 8 * S/16 = S/2 at 50 GB/s
    t = build_cluster(2)
    c = collective_time(t, "all_to_all", t.gpus(), S)
    assert c.beta_s == pytest.approx(S / 2 / 50e9)
    assert c.busbw_beta == pytest.approx(15 / 16 * 100.0)
    # the shift algorithm runs 15 steps one after another; in step k GPU i sends to i+k, so k (or
    # 16-k) GPUs of each host send to the other host, each to a different rail: one S/16 transfer
    # per NIC and direction in every step, which outlasts the NVLink and PCIe hops
    ring = collective_time(t, "all_to_all", t.gpus(), S, "ring")
    assert ring.beta_s == pytest.approx(15 * S / 16 / 50e9)
    assert ring.steps == 15


def test_hierarchical_two_dgx_hand_computed():
    t = build_cluster(2)
    c = collective_time(t, "all_reduce", t.gpus(), S, "hierarchical")
    # 7 reduce-scatter steps (S/8 per GPU at 450), 2 inter-host ring steps of the S/8 shard halves (S/16 at 50), 7 all-gather steps
    expected = 14 * S / 8 / 450e9 + 2 * S / 16 / 50e9
    assert c.beta_s == pytest.approx(expected)
    assert c.steps == 16
    with pytest.raises(InputError):
        collective_time(t, "all_reduce", t.gpus()[:11], S, "hierarchical")


def test_send_recv_and_broadcast():
    t = build_cluster(2)
    c = collective_time(t, "send_recv", ["node0/gpu3", "node1/gpu3"], S)
    assert c.busbw_beta == pytest.approx(50.0) and c.busbw == pytest.approx(c.algbw)
    c = collective_time(t, "broadcast", t.gpus(), S)
    assert c.busbw_beta == pytest.approx(400.0)  # 8 channels, one rail each


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(op=st.sampled_from(OPS), policy=st.sampled_from(["rail", "ecmp", "shortest"]), data=st.data())
def test_step_beta_equals_the_loop_over_route_flows(op, policy, data):
    """Differential: a step's beta, bottleneck link, its bw and load (read from arrays) equal the plain loop over
    route_flows' loads and the graph's bandwidths, ties going to the first link in route_flows' order."""
    from topology.collectives import _step_cost
    from topology.paths import view

    t = CLUSTER3
    gpus = data.draw(st.lists(st.sampled_from(t.gpus()), min_size=2, max_size=16, unique=True))
    algorithm = data.draw(st.sampled_from([a for a in ALGORITHMS[op] if a != "hierarchical"]))
    for step in plan_collective(t, op, gpus, S, algorithm).steps[:2]:
        beta, worst, worst_bw, worst_load = 0.0, None, float("inf"), 0.0
        for e, load in route_flows(t, step, policy).items():
            bw = t.graph.edges[e]["bw"]
            if load / (bw * 1e9) > beta:
                beta, worst, worst_bw, worst_load = load / (bw * 1e9), e, bw, load
        got = _step_cost(t, view(t), step, None, policy, 0.0)
        assert (got[0], got[2], got[3], got[4]) == (beta, worst, worst_bw, worst_load)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(op=st.sampled_from(OPS), data=st.data())
def test_costs_from_warm_caches_equal_costs_from_a_fresh_view(op, data):
    """Differential: the view caches a plan and its cost read (ring order keys, pair latencies, link table) give, once
    warm from other groups, exactly the plan and cost computed on a freshly built view."""
    from topology.paths import clear_cache

    t = build_cluster(4, hosts_per_su=2)
    pick = st.lists(st.sampled_from(t.gpus()), min_size=1, max_size=12, unique=True)
    groups = [data.draw(pick) for _ in range(3)]
    algorithm = data.draw(st.sampled_from(ALGORITHMS[op]))
    policy = data.draw(st.sampled_from(["rail", "ecmp", "shortest"]))

    def cost(gpus):
        try:
            plan = plan_collective(t, op, gpus, S, algorithm)
        except InputError:  # hierarchical on unequal hosts
            return None
        return plan.gpus, plan.steps, collective_time(t, op, gpus, S, algorithm, policy)

    warm = [cost(g) for g in groups] + [cost(g) for g in reversed(groups)]
    for i, g in enumerate(groups):
        clear_cache(t)
        assert cost(g) == warm[i] == warm[len(warm) - 1 - i]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(op=st.sampled_from(OPS), hosts=st.integers(1, 3), per_host=st.integers(1, 8), data=st.data())
def test_plans_move_the_right_number_of_bytes(op, hosts, per_host, data):
    t = CLUSTER3
    gpus = [g for h in t.hosts()[:hosts] for g in t.gpus(h)[:per_host]]
    n = len(gpus)
    algorithm = data.draw(st.sampled_from(ALGORITHMS[op]))
    plan = plan_collective(t, op, gpus, S, algorithm)
    assert sorted(plan.gpus) == sorted(gpus)
    total = sum(f.nbytes for step in plan.steps for f in step)
    for step in plan.steps:
        for f in step:
            assert isinstance(f, P2PFlow) and f.src != f.dst and f.src in gpus and f.dst in gpus
    if n == 1:
        assert plan.steps == []
        return
    expected = {
        "all_reduce": 2 * (n - 1) * S,
        "reduce_scatter": (n - 1) * S,
        "all_gather": (n - 1) * S,
        "all_to_all": (n - 1) * S,
        "send_recv": n * S,
    }
    if op == "broadcast":
        assert total == pytest.approx((n - 1) * S)  # every non-root receives S once, over the channels
    elif op == "all_reduce" and algorithm == "hierarchical":
        k, m = per_host, hosts
        assert total == pytest.approx(2 * (k - 1) * S * m + 2 * (m - 1) * S)
    else:
        assert total == pytest.approx(expected[op])
    cost = collective_time(t, op, gpus, S, algorithm)
    ab = alpha_beta(t, op, gpus, algorithm)
    assert ab.time(S) == pytest.approx(cost.time_s, rel=1e-9)
    # nccl-tests' bus bound: a rank moves at least factor * S bytes, so busbw cannot exceed what a
    # GPU can send over all its links at once (NVLink 450 + PCIe 63: the tree uses both)
    assert cost.busbw_beta <= (450.0 + 63.0) * (1 + 1e-9)
    if algorithm == "ring" or n <= per_host:
        assert cost.busbw_beta <= 450.0 * (1 + 1e-9)


CLUSTER3 = build_cluster(3)


def test_ring_order_is_host_major_and_rotated_per_channel():
    t = build_cluster(2)
    gpus = ["node1/gpu2", "node0/gpu5", "node0/gpu1", "node1/gpu7"]
    plan = plan_collective(t, "all_gather", gpus, S)
    assert plan.gpus == ["node1/gpu2", "node1/gpu7", "node0/gpu1", "node0/gpu5"]
    assert plan.channels == 2
    step = plan.steps[0]
    cross = [(f.src, f.dst) for f in step if t.host_of(f.src) != t.host_of(f.dst)]
    # channel 0 enters node0 at gpu1 and leaves from gpu5; channel 1 the other way round
    expected = [("node1/gpu7", "node0/gpu1"), ("node0/gpu5", "node1/gpu2"), ("node1/gpu2", "node0/gpu5"), ("node0/gpu1", "node1/gpu7")]
    assert sorted(cross) == sorted(expected)
    assert all(f.nbytes == S / (4 * 2) for f in step)
    assert len(plan.steps) == 3 and all(s is step for s in plan.steps)


def test_double_binary_tree_structure():
    assert double_binary_tree(1) == ([-1], [-1])
    for m in range(2, 40):
        trees = double_binary_tree(m)
        inner = []
        for parents in trees:
            assert parents.count(-1) == 1
            for r in range(m):  # every rank reaches the root without cycles
                seen, x = set(), r
                while x != -1:
                    assert x not in seen
                    seen.add(x)
                    x = parents[x]
            children = [sum(1 for p in parents if p == r) for r in range(m)]
            assert max(children) <= 2
            inner.append({r for r in range(m) if children[r]})
        # complementary: only rank 0 of an odd-sized group is inner in both (as in NCCL's shifted tree)
        assert inner[0] & inner[1] <= ({0} if m % 2 else set())


def test_input_errors_and_trivial_groups():
    t = build_node("dgx-h100")
    with pytest.raises(InputError):
        collective_time(t, "all_scatter", t.gpus(), S)
    with pytest.raises(InputError):
        collective_time(t, "all_gather", t.gpus(), S, "tree")
    with pytest.raises(InputError):
        collective_time(t, "all_gather", ["node0/gpu0", "node0/gpu0"], S)
    with pytest.raises(InputError):
        collective_time(t, "all_gather", t.gpus(), -1)
    with pytest.raises(InputError):
        collective_time(t, "all_gather", t.gpus(), S, policy="random")
    one = collective_time(t, "all_reduce", ["node0/gpu0"], S)
    assert one.time_s == 0.0 and one.to_dict()["algbw"] is None
    pair = [P2PFlow("node0/gpu0", "node0/gpu1", 4.0), P2PFlow("node0/gpu1", "node0/gpu0", 4.0)]
    assert collective_flows(t, "all_reduce", [0, 1], 8.0) == [pair, pair]


_TWO_SUS = build_cluster(8, hosts_per_su=4)


def _reference_cost_and_loads(topo, plans, policy, network_only):
    """What schedules_cost_and_loads stands for: schedule_time per plan, route_flows of every distinct step's flows times its count."""
    flows = []
    for plan in plans:
        counts: dict[int, list] = {}
        for step in plan.steps:
            counts.setdefault(id(step), [step, 0])[1] += 1
        flows += [(f.src, f.dst, float(f.nbytes) * n) for step, n in counts.values() for f in step]
    return [schedule_time(topo, p, policy) for p in plans], route_flows(topo, flows, policy, network_only=network_only)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_schedules_cost_and_loads_equals_time_and_routing_separately(data):
    """Differential, exact (floats and link order): one routing of the steps gives schedule_time's costs and
    route_flows' loads, for random groups over two SUs, every all-reduce algorithm and policy, one or two groups;
    route_flows' numpy sums equal its plain loop."""
    import topology.routing as routing

    topo = _TWO_SUS
    gpus = topo.gpus()
    per_host = data.draw(st.sampled_from([1, 2, 4]))
    n_hosts = data.draw(st.integers(1, 6))
    hosts = data.draw(st.lists(st.integers(0, 7), min_size=n_hosts, max_size=n_hosts, unique=True))
    local = [sorted(data.draw(st.permutations(range(8)))[:per_host]) for _ in hosts]
    group = [gpus[8 * h + i] for h, ix in zip(hosts, local, strict=True) for i in ix]
    groups = [group[0::2], group[1::2]] if len(group) % 2 == 0 and len(group) > 2 and data.draw(st.booleans()) else [group]
    algorithm = data.draw(st.sampled_from(["ring", "tree", "hierarchical"] if per_host > 1 or len(groups) == 1 else ["ring", "tree"]))
    policy = data.draw(st.sampled_from(["rail", "ecmp", "shortest"]))
    nbytes = data.draw(st.sampled_from([1e6, 3.1e9, 102e6 * 4]))
    try:
        plans = [plan_collective(topo, "all_reduce", g, nbytes, algorithm) for g in groups]
    except InputError:  # hierarchical on groups with unequal hosts
        return
    network_only = data.draw(st.booleans())
    costs, loads = schedules_cost_and_loads(topo, plans, policy, network_only=network_only)
    ref_costs, ref_loads = _reference_cost_and_loads(topo, plans, policy, network_only)
    assert [c.to_dict() for c in costs] == [c.to_dict() for c in ref_costs]
    assert list(loads.items()) == list(ref_loads.items())
    flows = [(f.src, f.dst, f.nbytes) for p in plans for step in p.steps[:1] for f in step]
    with_arrays = route_flows(topo, flows, policy, network_only=network_only)
    saved, routing._ARRAY_PAIRS = routing._ARRAY_PAIRS, 1 << 30
    try:
        with_loop = route_flows(topo, flows, policy, network_only=network_only)
    finally:
        routing._ARRAY_PAIRS = saved
    assert list(with_arrays.items()) == list(with_loop.items())
    assert all(type(v) is float for v in with_arrays.values())


def test_schedules_cost_and_loads_merges_repeated_pairs_as_route_flows_does():
    """A step whose flows repeat a pair (and a pair shared by two schedules, and an empty flow) takes route_flows'
    merging path: the same floats as routing the flows separately."""
    topo = _TWO_SUS
    a, b, c = "node0/gpu0", "node1/gpu3", "node4/gpu5"
    step = [P2PFlow(a, b, 1e6), P2PFlow(a, b, 3e6), P2PFlow(b, c, 0.0), P2PFlow(c, a, 7e5)]
    one = CollectiveSchedule("all_reduce", "ring", [a, b, c], 1e6, 1, [step, step, [P2PFlow(b, a, 2e6)]])
    two = CollectiveSchedule("all_reduce", "ring", [a, b], 1e6, 1, [[P2PFlow(a, b, 5e5)]])
    for network_only in (False, True):
        costs, loads = schedules_cost_and_loads(topo, [one, two], "rail", network_only=network_only)
        ref_costs, ref_loads = _reference_cost_and_loads(topo, [one, two], "rail", network_only)
        assert [x.to_dict() for x in costs] == [x.to_dict() for x in ref_costs]
        assert list(loads.items()) == list(ref_loads.items()) and loads


def test_schedules_cost_and_loads_of_a_step_with_unequal_volumes():
    """A step of distinct pairs with unequal volumes, repeated (each pair's volume lined up with its fractions,
    times the repetitions): the same floats as schedule_time and route_flows computed apart."""
    topo = _TWO_SUS
    a, b, c, d = "node0/gpu0", "node1/gpu3", "node4/gpu5", "node5/gpu1"
    step = [P2PFlow(a, b, 1e6), P2PFlow(b, c, 3.3e6), P2PFlow(c, d, 7e5), P2PFlow(d, a, 1e6)]
    plan = CollectiveSchedule("all_reduce", "ring", [a, b, c, d], 1e6, 1, [step, step, step])
    for network_only in (False, True):
        costs, loads = schedules_cost_and_loads(topo, [plan], "rail", network_only=network_only)
        ref_costs, ref_loads = _reference_cost_and_loads(topo, [plan], "rail", network_only)
        assert [x.to_dict() for x in costs] == [x.to_dict() for x in ref_costs]
        assert [(e, v.hex()) for e, v in loads.items()] == [(e, v.hex()) for e, v in ref_loads.items()] and loads
