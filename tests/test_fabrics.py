"""Fabric builders: rail-optimized, leaf-spine and the k-ary fat tree."""

import doctest
from collections import Counter

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import topology.fabrics
from topology import NodeKind, SwitchTier, TopologyError, build_cluster
from topology.fabrics import FABRIC_BUILDERS, fat_tree_ports

NODE_KINDS = ["dgx-h100", "dgx-a100", "pcie-server", "gb200-nvl72"]


def network_neighbours(t, node):
    return [v for _, v, d in t.graph.out_edges(node, data=True) if d["kind"] == "network"]


def capacity(t, u, tiers):
    """Total bandwidth from switch ``u`` towards neighbours that are NICs (tiers=None) or switches of ``tiers``."""
    total = 0.0
    for _, v, d in t.graph.out_edges(u, data=True):
        kind = t.kind(v)
        if (tiers is None and kind is NodeKind.NIC) or (kind is NodeKind.SWITCH and t.graph.nodes[v]["tier"] in (tiers or ())):
            total += d["bw"]
    return total


def check_invariants(t):
    t.validate()
    assert nx.is_strongly_connected(t.graph)
    fwd = Counter((u, v, d["kind"], d["bw"]) for u, v, _, d in t.links())
    rev = Counter((v, u, d["kind"], d["bw"]) for u, v, _, d in t.links())
    assert fwd == rev, "every link must have a reverse of equal bandwidth"
    assert all(d["bw"] > 0 for _, _, _, d in t.links())
    # Every NIC has exactly one cable into the fabric, at its line rate.
    for nic in t.nodes(NodeKind.NIC):
        (leaf,) = network_neighbours(t, nic)
        assert t.graph.nodes[leaf]["tier"] is SwitchTier.LEAF
        assert t.graph.edges[nic, leaf, 0]["bw"] == pytest.approx(t.graph.nodes[nic]["speed_gbps"] / 8)


def test_doctests():
    assert doctest.testmod(topology.fabrics).failed == 0


fabric_cases = st.one_of(
    st.tuples(
        st.just("rail-optimized"),
        st.fixed_dictionaries({
            "hosts_per_su": st.integers(1, 8),
            "spines": st.none() | st.integers(1, 6),
            "oversubscription": st.sampled_from([1.0, 1.5, 2.0, 3.0, 4.0]),
        }),
    ),
    st.tuples(
        st.just("leaf-spine"),
        st.fixed_dictionaries({
            "hosts_per_leaf": st.none() | st.integers(1, 6),
            "spines": st.none() | st.integers(1, 6),
            "oversubscription": st.sampled_from([1.0, 1.5, 2.0, 3.0, 4.0]),
        }),
    ),
    st.tuples(st.just("fat-tree"), st.fixed_dictionaries({}, optional={"k": st.sampled_from([8, 10, 12])})),
)


@settings(max_examples=60, deadline=None)
@given(case=fabric_cases, node=st.sampled_from(NODE_KINDS), nodes=st.integers(1, 24))
def test_fabric_properties(case, node, nodes):
    fabric, options = case
    per_host = {"dgx-h100": 8, "dgx-a100": 8, "pcie-server": 4, "gb200-nvl72": 4}[node]
    if fabric == "fat-tree" and "k" in options and fat_tree_ports(options["k"]) < nodes * per_host:
        with pytest.raises(TopologyError, match="host ports"):
            build_cluster(nodes, node=node, fabric=fabric, **options)
        return
    t = build_cluster(nodes, node=node, fabric=fabric, **options)
    assert len(t.hosts()) == nodes
    check_invariants(t)
    oversub = options.get("oversubscription", 1.0)
    for leaf in t.switches(SwitchTier.LEAF):
        down = capacity(t, leaf, None)
        up = capacity(t, leaf, (SwitchTier.SPINE,))
        if fabric == "fat-tree":
            # Al-Fares: k/2 uplinks per edge switch at the common line rate; never oversubscribed.
            k = t.meta["fabric"]["k"]
            assert up == pytest.approx(k / 2 * t.meta["fabric"]["link_gbps"] / 8)
            assert up >= down - 1e-9
        elif down:
            assert up == pytest.approx(down / oversub)


def test_rail_optimized_puts_rail_i_on_leaf_i_of_its_su():
    t = build_cluster(10, fabric="rail-optimized", hosts_per_su=4)
    assert len(t.switches(SwitchTier.LEAF)) == 3 * 8
    for h, host in enumerate(t.hosts()):
        for nic in t.nodes(NodeKind.NIC, host):
            (leaf,) = network_neighbours(t, nic)
            assert leaf == f"su{h // 4}/leaf{t.graph.nodes[nic]['rail']}"


def test_rail_optimized_superpod_scalable_unit_counts():
    # DGX SuperPOD H100: 32 DGX per SU, one leaf per rail; 1:1, so each leaf has 32 x 50 GB/s up.
    t = build_cluster(64)
    assert len(t.switches(SwitchTier.LEAF)) == 16
    for leaf in t.switches(SwitchTier.LEAF):
        assert capacity(t, leaf, (SwitchTier.SPINE,)) == pytest.approx(32 * 50.0)
        # 32 uplink cables per leaf over 8 spine groups: 4 cables (200 GB/s) per leaf-spine link.
        ups = [d for _, v, d in t.graph.out_edges(leaf, data=True) if t.kind(v) is NodeKind.SWITCH]
        assert len(ups) == 8 and all(d["count"] == 4 and d["bw"] == 200.0 for d in ups)


def test_leaf_spine_keeps_hosts_whole_and_fills_64_port_leaves():
    t = build_cluster(10, fabric="leaf-spine")
    # 1:1 on 64 ports: 32 down ports = 4 DGX H100 of 8 NICs per leaf.
    assert t.meta["fabric"]["hosts_per_leaf"] == 4
    assert len(t.switches(SwitchTier.LEAF)) == 3
    for h, host in enumerate(t.hosts()):
        leaves = {network_neighbours(t, nic)[0] for nic in t.nodes(NodeKind.NIC, host)}
        assert leaves == {f"leaf{h // 4}"}
    # 3:1 on 64 ports: 48 down ports = 6 DGX per leaf.
    assert build_cluster(7, fabric="leaf-spine", oversubscription=3).meta["fabric"]["hosts_per_leaf"] == 6


@pytest.mark.parametrize("k", [4, 8])
def test_fat_tree_exact_structure(k):
    half = k // 2
    hosts = fat_tree_ports(k) // 4  # PCIe servers with 4 NICs fill every host port
    t = build_cluster(hosts, node="pcie-server", fabric="fat-tree", k=k)
    edge, agg, core = (t.switches(tier) for tier in (SwitchTier.LEAF, SwitchTier.SPINE, SwitchTier.CORE))
    assert (len(edge), len(agg), len(core)) == (k * half, k * half, half * half)
    assert len(t.nodes(NodeKind.SWITCH)) == 5 * k * k // 4
    net = [(u, v) for u, v, _, d in t.links("network")]
    assert len(net) == 2 * (fat_tree_ports(k) * 3)  # host, edge-agg and agg-core tiers each have k^3/4 cables
    for e in edge:
        nbrs = network_neighbours(t, e)
        assert sum(t.kind(v) is NodeKind.NIC for v in nbrs) == half
        ups = [v for v in nbrs if t.kind(v) is NodeKind.SWITCH]
        assert len(ups) == half and all(t.graph.nodes[v]["pod"] == t.graph.nodes[e]["pod"] for v in ups)
    for a in agg:
        nbrs = network_neighbours(t, a)
        assert sum(t.graph.nodes[v]["tier"] is SwitchTier.LEAF for v in nbrs) == half
        assert sum(t.graph.nodes[v]["tier"] is SwitchTier.CORE for v in nbrs) == half
    for c in core:
        pods = Counter(t.graph.nodes[v]["pod"] for v in network_neighbours(t, c))
        assert pods == Counter(range(k))  # exactly one aggregation switch in every pod
    check_invariants(t)


def test_fat_tree_has_full_bisection_bandwidth():
    # k=4 filled with 16 NICs: max flow from the NICs of pods 0-1 to those of pods 2-3 is 8 x line rate.
    t = build_cluster(4, node="pcie-server", fabric="fat-tree", k=4)
    g = nx.DiGraph()
    for u, v, _, d in t.links("network"):
        g.add_edge(u, v, capacity=g.get_edge_data(u, v, {"capacity": 0})["capacity"] + d["bw"])
    nics = t.nodes(NodeKind.NIC)
    for nic in nics:
        pod = t.graph.nodes[network_neighbours(t, nic)[0]]["pod"]
        if pod < 2:
            g.add_edge("S", nic, capacity=1e9)
        else:
            g.add_edge(nic, "T", capacity=1e9)
    assert nx.maximum_flow_value(g, "S", "T") == pytest.approx(8 * 50.0)


def test_fat_tree_too_many_nics_names_the_needed_k():
    with pytest.raises(TopologyError, match=r"k=4 has 16 host ports .* 32 NICs; use k >= 6"):
        build_cluster(4, fabric="fat-tree", k=4)
    with pytest.raises(TopologyError, match="even"):
        build_cluster(1, fabric="fat-tree", k=5)


def test_nvl72_racks_join_a_rail_optimized_fabric():
    t = build_cluster(36, node="gb200-nvl72", fabric="rail-optimized", hosts_per_su=18)
    assert len(t.switches(SwitchTier.LEAF)) == 2 * 4  # two SUs (racks) x four rails
    check_invariants(t)


@pytest.mark.parametrize("fabric", ["leaf-spine", "fat-tree"])
def test_8192_gpus_build(fabric):
    t = build_cluster(1024, fabric=fabric)
    assert len(t.gpus()) == 8192
    if fabric == "fat-tree":
        assert t.meta["fabric"]["k"] == 32  # 32^3/4 = 8192 host ports exactly
        assert len(t.switches()) == 5 * 32 * 32 // 4
    else:
        assert len(t.switches(SwitchTier.LEAF)) == 256


def test_unknown_fabric_and_bad_options():
    with pytest.raises(TopologyError, match="fat-tree"):
        build_cluster(2, fabric="torus")
    for fabric in ("rail-optimized", "leaf-spine"):
        with pytest.raises(TopologyError, match="oversubscription"):
            build_cluster(2, fabric=fabric, oversubscription=0.5)
    with pytest.raises(TopologyError, match="no NICs"):
        build_cluster(2, node="pcie-server", node_options={"nics_per_switch": 0}, fabric="leaf-spine")
    assert set(FABRIC_BUILDERS) == {"rail-optimized", "leaf-spine", "fat-tree"}
