"""Flow routing: policies, NVSwitch striping, conservation and rail properties."""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_paths import _random_topology  # tests/ is on sys.path under pytest

from topology import InputError, LinkKind, NodeKind, SwitchTier, TopologyError, build_cluster, build_node
from topology.paths import PathType, device_path, link_attrs
from topology.routing import POLICIES, flow_paths, link_utilisation, nearest_port, route_flows


def _is_spine(t, node: str) -> bool:
    d = t.graph.nodes[node]
    return d["kind"] == NodeKind.SWITCH and d["tier"] != SwitchTier.LEAF


def _assert_walk(t, src, dst, edges):
    assert edges[0][0] == src and edges[-1][1] == dst
    for (_, v, _), (u2, _, _) in zip(edges, edges[1:], strict=False):
        assert v == u2
    for e in edges:
        assert t.graph.has_edge(*e)


def test_nvswitch_striping_is_proportional_to_lanes():
    t = build_node("dgx-h100")
    paths = flow_paths(t, "node0/gpu0", "node0/gpu1", "ecmp")
    fracs = sorted(f for f, _ in paths)
    assert fracs == pytest.approx([4 / 18, 4 / 18, 5 / 18, 5 / 18])
    loads = route_flows(t, [("node0/gpu0", "node0/gpu1", 450.0)])
    # every plane is loaded to the same fraction of its bandwidth: the GPU sees 450 GB/s
    assert {round(load / t.graph.edges[e]["bw"], 12) for e, load in loads.items()} == {1.0}


def test_same_rail_flows_stay_on_the_leaf_under_every_policy():
    t = build_cluster(3)
    for policy in POLICIES:
        paths = flow_paths(t, "node0/gpu4", "node2/gpu4", policy)
        assert len(paths) == 1
        nodes = [v for _, v, _ in paths[0][1]]
        assert nodes == ["node0/pcie4", "node0/nic4", "su0/leaf4", "node2/nic4", "node2/pcie4", "node2/gpu4"]


def test_cross_rail_policies_differ():
    t = build_cluster(2)
    src, dst = "node0/gpu1", "node1/gpu6"
    shortest = flow_paths(t, src, dst, "shortest")
    assert len(shortest) == 1 and sum(_is_spine(t, v) for _, v, _ in shortest[0][1]) == 1
    ecmp = flow_paths(t, src, dst, "ecmp")
    spines = defaultdict(float)
    for f, edges in ecmp:
        _assert_walk(t, src, dst, edges)
        for _, v, _ in edges:
            if _is_spine(t, v):
                spines[v] += f
    assert sorted(spines.values()) == pytest.approx([1 / 8] * 8)  # equal split over the 8 spine groups
    rail = flow_paths(t, src, dst, "rail")
    for _f, edges in rail:
        _assert_walk(t, src, dst, edges)
        nodes = [v for _, v, _ in edges]
        assert "node0/gpu6" in nodes and "node0/nic6" in nodes and not any(_is_spine(t, v) for v in nodes)
    assert sum(f for f, _ in rail) == pytest.approx(1.0)


def test_shortest_is_destination_mod_k():
    t = build_cluster(2)

    def spine(src, dst):
        ((_, edges),) = flow_paths(t, src, dst, "shortest")
        (s,) = [v for _, v, _ in edges if _is_spine(t, v)]
        return s

    # one source, seven destinations on other rails: seven different spine groups
    assert len({spine("node0/gpu0", f"node1/gpu{j}") for j in range(1, 8)}) == 7
    # one destination, sources on different rails: the same spine group
    assert len({spine(f"node0/gpu{i}", "node1/gpu5") for i in range(8) if i != 5}) == 1


def test_fat_tree_ecmp_spreads_over_aggregation_and_core():
    t = build_cluster(2, fabric="fat-tree", k=4)
    # node0's NICs fill pods 0-1, node1's pods 2-3: any flow between them crosses the core
    paths = flow_paths(t, "node0/nic0", "node1/nic0", "ecmp")
    cores = defaultdict(float)
    for f, edges in paths:
        for _, v, _ in edges:
            if t.graph.nodes[v].get("tier") == SwitchTier.CORE:
                cores[v] += f
    assert sorted(cores.values()) == pytest.approx([1 / 4] * 4)
    assert len(flow_paths(t, "node0/nic0", "node1/nic0", "shortest")) == 1


def test_nearest_port_spreads_ties():
    t = build_cluster(1, node="pcie-server", fabric="leaf-spine")  # 2 GPUs share each PCIe switch and its NIC
    assert nearest_port(t, "node0/gpu0") == nearest_port(t, "node0/gpu1") == "node0/nic0"
    t = build_cluster(1, node="dgx-a100")  # 2 GPUs and 2 NICs per PCIe switch
    ports = [nearest_port(t, g) for g in t.gpus()]
    assert ports == [f"node0/nic{i}" for i in range(8)]


def test_route_flows_merges_and_validates():
    t = build_cluster(2)
    a = route_flows(t, [("node0/gpu0", "node1/gpu0", 3.0), ("node0/gpu0", "node1/gpu0", 4.0), ("node0/gpu1", "node0/gpu1", 9.0)])
    assert a[("node0/nic0", "su0/leaf0", 0)] == 7.0
    assert route_flows(t, [("node0/gpu0", "node1/gpu0", 0.0)]) == {}
    with pytest.raises(InputError):
        route_flows(t, [("node0/gpu0", "node1/gpu0", 1.0)], "random")
    with pytest.raises(InputError):
        route_flows(t, [("node0/gpu0", "nowhere", 1.0)])
    with pytest.raises(InputError):
        route_flows(t, [("node0/gpu0", "node1/gpu0", -1.0)])
    worst = link_utilisation(t, a)[0]
    assert worst[1] == pytest.approx(7.0 / 50.0)


def _net_flow(loads):
    out = defaultdict(float)
    for (u, v, _), x in loads.items():
        out[u] += x
        out[v] -= x
    return out


def _cluster(kind: str, nodes: int):
    if kind == "rail":
        return build_cluster(nodes, hosts_per_su=2, spines=2)
    if kind == "leaf-spine":
        return build_cluster(nodes, fabric="leaf-spine", hosts_per_leaf=2, spines=3)
    return build_cluster(nodes, fabric="fat-tree", k=4 if nodes <= 2 else 6)


FABRICS = {k: {n: _cluster(k, n) for n in (1, 2, 3)} for k in ("rail", "leaf-spine", "fat-tree")}


ROUTED = {"fabric": st.sampled_from(sorted(FABRICS)), "nodes": st.integers(1, 3), "policy": st.sampled_from(POLICIES), "use_nics": st.booleans()}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**ROUTED, picks=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 10**6), st.floats(0.5, 100.0)), min_size=1, max_size=6))
def test_loads_conserve_traffic(fabric, nodes, policy, picks, use_nics):
    t = FABRICS[fabric][nodes]
    ends = t.gpus() + (t.nodes(NodeKind.NIC) + t.switches() if use_nics else [])
    flows = [(ends[a % len(ends)], ends[b % len(ends)], vol) for a, b, vol in picks]
    # each flow alone: outflow at src = inflow at dst = volume, zero net flow elsewhere
    for src, dst, vol in flows:
        paths = flow_paths(t, src, dst, policy)
        assert sum(f for f, _ in paths) == pytest.approx(1.0)
        for f, edges in paths:
            assert f > 0
            if src != dst:
                _assert_walk(t, src, dst, edges)
        net = _net_flow(route_flows(t, [(src, dst, vol)], policy))
        for node, x in net.items():
            expected = vol if node == src and src != dst else -vol if node == dst and src != dst else 0.0
            assert x == pytest.approx(expected, abs=1e-9 * vol), node
    # all together: node balance is the sum of the flows' balances
    net = _net_flow(route_flows(t, flows, policy))
    expected = defaultdict(float)
    for src, dst, vol in flows:
        if src != dst:
            expected[src] += vol
            expected[dst] -= vol
    for node in set(net) | set(expected):
        assert net.get(node, 0.0) == pytest.approx(expected.get(node, 0.0), abs=1e-6)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**ROUTED, picks=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 10**6), st.floats(0.0, 1e9)), max_size=12))
def test_network_only_and_array_loads_equal_route_flows(fabric, nodes, policy, picks, use_nics):
    """Differentials, the same floats in the same order (each link's terms are added in the same order), with merged
    pairs, self flows and zero volumes, cold and cached: route_flows(network_only=True) is the full result with the links
    inside hosts dropped, and the array form the collective cost loops read (numpy bincount) is the full result."""
    from topology.paths import view
    from topology.routing import _link_ids, _route_loads

    t = FABRICS[fabric][nodes]
    ends = t.gpus() + (t.nodes(NodeKind.NIC) + t.switches() if use_nics else [])
    flows = [(ends[a % len(ends)], ends[b % len(ends)], vol) for a, b, vol in picks]
    flows += flows[: len(flows) // 2]   # repeated pairs are merged first
    for _ in range(2):
        full = route_flows(t, flows, policy)
        expected = [(e, x) for e, x in full.items() if t.graph.edges[e]["kind"] == LinkKind.NETWORK]
        assert list(route_flows(t, flows, policy, network_only=True).items()) == expected
        links, loads = _route_loads(t, flows, policy)
        edges = _link_ids(view(t), t)[1]
        assert [(edges[i], x) for i, x in zip(links.tolist(), loads.tolist(), strict=True)] == list(full.items())


def test_link_attrs_are_the_graphs_own_dicts_and_follow_changes():
    t = build_cluster(2)
    table = link_attrs(t)
    assert len(table) == t.graph.number_of_edges()
    assert all(table[(u, v, k)] is d for u, v, k, d in t.graph.edges(keys=True, data=True))
    t.add_link("node0/nic0", "su0/leaf1", LinkKind.NETWORK, 25.0)   # a change through the topology: a new table
    assert link_attrs(t)[("node0/nic0", "su0/leaf1", 0)]["bw"] == 25.0 and len(link_attrs(t)) == len(table) + 2  # both directions


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes=st.integers(2, 3), per_su=st.integers(1, 3), a=st.integers(0, 10**6), b=st.integers(0, 10**6))
def test_ecmp_splits_sum_to_one_at_every_hop(nodes, per_su, a, b):
    t = build_cluster(nodes, hosts_per_su=per_su, spines=3)
    gpus = t.gpus()
    src, dst = gpus[a % len(gpus)], gpus[b % len(gpus)]
    if src == dst:
        return
    loads = route_flows(t, [(src, dst, 1.0)], "ecmp")
    out = defaultdict(float)
    for (u, _, _), x in loads.items():
        out[u] += x
    assert out[src] == pytest.approx(1.0)
    # the traffic leaving each switch equals the traffic entering it
    into = defaultdict(float)
    for (_, v, _), x in loads.items():
        into[v] += x
    for node in out:
        if t.graph.nodes[node]["kind"] == NodeKind.SWITCH:
            assert out[node] == pytest.approx(into[node])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes=st.integers(2, 5), per_su=st.integers(1, 4), a=st.integers(0, 10**6), b=st.integers(0, 10**6))
def test_rail_policy_never_uses_a_spine_within_a_scalable_unit(nodes, per_su, a, b):
    t = build_cluster(nodes, hosts_per_su=per_su)
    gpus = t.gpus()
    src, dst = gpus[a % len(gpus)], gpus[b % len(gpus)]
    hs, hd = int(t.host_of(src)[4:]), int(t.host_of(dst)[4:])
    loads = route_flows(t, [(src, dst, 1.0)], "rail")
    uses_spine = any(_is_spine(t, u) or _is_spine(t, v) for u, v, _ in loads)
    if hs // per_su == hd // per_su:
        assert not uses_spine  # same SU: rail j's leaf connects both hosts, whatever src's rail
    elif hs != hd:
        assert uses_spine  # different SUs: only the spine connects them
        # and it still arrives on the destination GPU's own rail
        rail = t.graph.nodes[dst]["index"]
        assert any(u == f"{t.host_of(dst)}/nic{rail}" for u, _, _ in loads)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), policy=st.sampled_from(POLICIES), pick=st.lists(st.integers(0, 10**6), min_size=2, max_size=2))
def test_random_graphs_route_exactly_where_a_path_exists(seed, policy, pick):
    t = _random_topology(seed)
    ends = t.gpus() + t.nodes(NodeKind.NIC)
    src, dst = ends[pick[0] % len(ends)], ends[pick[1] % len(ends)]
    connected = device_path(t, src, dst).path_type != PathType.DIS
    try:
        paths = flow_paths(t, src, dst, policy)
    except TopologyError:
        assert not connected
        return
    assert connected
    assert sum(f for f, _ in paths) == pytest.approx(1.0)
    net = _net_flow(route_flows(t, [(src, dst, 2.0)], policy))
    for node, x in net.items():
        assert x == pytest.approx(2.0 if node == src else -2.0 if node == dst else 0.0, abs=1e-9)
