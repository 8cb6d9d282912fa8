"""Paths, NCCL path classes, the vectorised bandwidth matrix and bisection bandwidth."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from topology import LinkKind, NodeKind, SwitchTier, Topology, TopologyError, build_cluster, build_node
from topology.paths import (
    LOC_BW,
    PathType,
    bandwidth_classes,
    bandwidth_matrix,
    bisection_bandwidth,
    clear_cache,
    device_path,
    gpu_path,
)


def test_path_type_order_is_nccls():
    names = [p.name for p in sorted(PathType)]
    assert names == ["LOC", "NVL", "NVB", "C2C", "PIX", "PXB", "P2C", "PXN", "PHB", "SYS", "NET", "DIS"]


def test_dgx_h100_gpu_pairs_are_nvl_at_the_nvswitch_bandwidth():
    t = build_node("dgx-h100")
    for a in t.gpus():
        for b in t.gpus():
            p = gpu_path(t, a, b)
            if a == b:
                assert (p.path_type, p.bw, p.nodes) == (PathType.LOC, LOC_BW, (a,))
            else:
                assert p.path_type == PathType.NVL and p.bw == 450.0 and p.hops == 2
    nccl = build_node("dgx-h100", nccl_model=True)
    assert gpu_path(nccl, 0, 5).bw == pytest.approx(18 * 20.6)


def test_dgx_h100_gpu_to_nic_classes():
    t = build_node("dgx-h100")
    own = device_path(t, "node0/gpu2", "node0/nic2")
    assert own.path_type == PathType.PIX and own.bw == 63.0 and own.nodes == ("node0/gpu2", "node0/pcie2", "node0/nic2")
    # another rail: through GPU 6 over NVLink (PXN, class 7) beats the CPU (PHB 8 / SYS 9)
    other = device_path(t, "node0/gpu2", "node0/nic6")
    assert other.path_type == PathType.PXN and other.nodes[2] == "node0/gpu6"
    # a NIC to a NIC of the other socket has no GPU relay to use: it crosses the sockets
    assert device_path(t, "node0/nic0", "node0/nic7").path_type == PathType.SYS
    assert device_path(t, "node0/nic0", "node0/nic1").path_type == PathType.PHB
    assert device_path(t, "node0/nic0", "node0/nic1").bw == 63.0


def _pcie_tree() -> Topology:
    """Two sockets; socket 0 has a two-level PCIe tree, socket 1 one switch; one GPU pair has a direct NVLink chain."""
    t = Topology("pcie-tree")
    h = "h"
    for s in range(2):
        t.add_node(f"h/cpu{s}", NodeKind.CPU, host=h, numa=s)
    t.add_link("h/cpu0", "h/cpu1", LinkKind.CPU, 20.0, latency_us=0.2)
    for sw in ("top", "b1", "b2", "c", "d"):
        t.add_node(f"h/{sw}", NodeKind.PCIE_SWITCH, host=h)
    t.add_link("h/top", "h/cpu0", LinkKind.PCIE, 32.0)
    t.add_link("h/b1", "h/top", LinkKind.PCIE, 30.0)
    t.add_link("h/b2", "h/top", LinkKind.PCIE, 28.0)
    t.add_link("h/c", "h/cpu0", LinkKind.PCIE, 26.0)
    t.add_link("h/d", "h/cpu1", LinkKind.PCIE, 24.0)
    where = {0: "b1", 1: "b1", 2: "b2", 3: "c", 4: "d", 5: "d", 6: "d"}
    for i, sw in where.items():
        t.add_node(f"h/gpu{i}", NodeKind.GPU, host=h, index=i)
        t.add_link(f"h/gpu{i}", f"h/{sw}", LinkKind.PCIE, 25.0)
    t.add_link("h/gpu4", "h/gpu5", LinkKind.NVLINK, 100.0, count=4)
    t.add_link("h/gpu5", "h/gpu6", LinkKind.NVLINK, 40.0, count=2)
    return t


@pytest.mark.parametrize(
    ("a", "b", "ptype", "bw"),
    [
        (0, 1, PathType.PIX, 25.0),  # one switch
        (0, 2, PathType.PXB, 25.0),  # b1 -> top -> b2, no host bridge
        (0, 3, PathType.PHB, 25.0),  # through CPU 0
        (2, 3, PathType.PHB, 25.0),
        (3, 4, PathType.SYS, 20.0),  # across the sockets: the 20 GB/s SMP link is the bottleneck
        (4, 5, PathType.NVL, 100.0),
        (4, 6, PathType.NVB, 40.0),  # through GPU 5: NVB, narrowest NVLink
    ],
)
def test_pcie_and_nvlink_classes_on_a_hand_built_host(a, b, ptype, bw):
    t = _pcie_tree()
    p = gpu_path(t, f"h/gpu{a}", f"h/gpu{b}")
    assert (p.path_type, p.bw) == (ptype, bw)
    rev = gpu_path(t, f"h/gpu{b}", f"h/gpu{a}")
    assert (rev.path_type, rev.bw) == (ptype, bw)


def test_gpu_does_not_relay_pcie_traffic():
    t = _pcie_tree()
    t.add_node("h/gpu7", NodeKind.GPU, host="h", index=7)  # reachable only over NVLink from gpu4
    t.add_link("h/gpu4", "h/gpu7", LinkKind.NVLINK, 50.0)
    assert gpu_path(t, "h/gpu5", "h/gpu7").path_type == PathType.NVB  # NVLink in, NVLink out: relayed
    # gpu3 would have to enter gpu4 over PCIe and leave over NVLink: GPUs do not forward that
    assert gpu_path(t, "h/gpu3", "h/gpu7").path_type == PathType.DIS


def test_gb200_gpu_to_nic_is_p2c():
    t = build_cluster(2, node="gb200-nvl72", fabric="leaf-spine")
    p = device_path(t, "node0/gpu0", "node0/nic0")
    assert p.path_type == PathType.P2C
    # GPUs of different trays of one NVL72 rack talk over NVLink, not the network
    q = gpu_path(t, "node0/gpu0", "node1/gpu3")
    assert q.path_type == PathType.NVL and q.bw == 18 * 50.0


def test_inter_host_paths_on_rail_optimized():
    t = build_cluster(2)
    same = gpu_path(t, "node0/gpu2", "node1/gpu2")
    assert same.path_type == PathType.NET and same.bw == 50.0
    assert "su0/leaf2" in same.nodes and not any(n.startswith("spine") for n in same.nodes)
    cross = gpu_path(t, "node0/gpu2", "node1/gpu5")
    # the spine groups of a 2-host SU carry 12.5 GB/s each: rail 5 via local GPU 5 (PXN) is wider
    assert cross.bw == 50.0 and cross.nodes[2] == "node0/gpu5" and "su0/leaf5" in cross.nodes
    assert cross.latency_us == pytest.approx(sum(t.graph.edges[u, v, 0]["latency_us"] for u, v in zip(cross.nodes, cross.nodes[1:], strict=False)))


def test_full_su_prefers_the_rail_on_equal_width():
    t = build_cluster(4, hosts_per_su=4, spines=1)  # spine group: 4*50 GB/s per leaf, as wide as a NIC path
    p = gpu_path(t, "node0/gpu1", "node3/gpu6")
    assert p.bw == 50.0 and not any(n.startswith("spine") for n in p.nodes)


def test_across_scalable_units_the_spine_is_the_bottleneck():
    t = build_cluster(2, hosts_per_su=1)  # two SUs: every leaf has 50 GB/s up, 6.25 per spine group
    p = gpu_path(t, "node0/gpu0", "node1/gpu0")
    assert p.path_type == PathType.NET and p.bw == 6.25 and any(n.startswith("spine") for n in p.nodes)


def test_disconnected_and_unknown():
    t = Topology()
    for h in ("a", "b"):
        t.add_node(f"{h}/gpu0", NodeKind.GPU, host=h, index=0)
    p = gpu_path(t, "a/gpu0", "b/gpu0")
    assert p.path_type == PathType.DIS and p.bw == 0.0
    m = bandwidth_matrix(t)
    assert m.path_type[0, 1] == PathType.DIS and m.bw[0, 1] == 0.0
    with pytest.raises(TopologyError):
        device_path(t, "a/gpu0", "nope")


def _direct_cable_pair() -> Topology:
    """Two single-GPU hosts whose NICs are cabled back to back (no switch)."""
    t = Topology("b2b")
    for h in ("a", "b"):
        t.add_node(f"{h}/gpu0", NodeKind.GPU, host=h, index=0)
        t.add_node(f"{h}/pcie0", NodeKind.PCIE_SWITCH, host=h)
        t.add_node(f"{h}/nic0", NodeKind.NIC, host=h, index=0, rail=0)
        t.add_link(f"{h}/gpu0", f"{h}/pcie0", LinkKind.PCIE, 30.0)
        t.add_link(f"{h}/nic0", f"{h}/pcie0", LinkKind.PCIE, 30.0)
    t.add_link("a/nic0", "b/nic0", LinkKind.NETWORK, 12.5)
    return t


def test_back_to_back_cable():
    t = _direct_cable_pair()
    p = gpu_path(t, "a/gpu0", "b/gpu0")
    assert (p.path_type, p.bw) == (PathType.NET, 12.5)
    assert bandwidth_matrix(t).bw[0, 1] == 12.5


def _assert_matrix_matches_pairs(t: Topology, gpus: list[str], pairs: list[tuple[int, int]]) -> None:
    m = bandwidth_matrix(t, gpus)
    for i, j in pairs:
        p = gpu_path(t, gpus[i], gpus[j])
        assert m.path_type[i, j] == p.path_type, (gpus[i], gpus[j])
        assert m.bw[i, j] == pytest.approx(p.bw), (gpus[i], gpus[j])


CLUSTERS = {
    "rail-2su-oversub": lambda: build_cluster(3, hosts_per_su=2, oversubscription=2),
    "leaf-spine": lambda: build_cluster(3, fabric="leaf-spine", hosts_per_leaf=2, oversubscription=3),
    "fat-tree": lambda: build_cluster(2, fabric="fat-tree", k=4),
    "dgx-a100": lambda: build_cluster(2, node="dgx-a100"),
    "pcie-server": lambda: build_cluster(2, node="pcie-server", fabric="leaf-spine"),
    "gb200": lambda: build_cluster(3, node="gb200-nvl72", fabric="leaf-spine"),
    "pcie-tree": _pcie_tree,
    "b2b": _direct_cable_pair,
}


@pytest.mark.parametrize("name", sorted(CLUSTERS))
def test_matrix_equals_pairwise_paths(name):
    t = CLUSTERS[name]()
    gpus = t.gpus()
    rng = random.Random(name)
    rng.shuffle(gpus)
    n = len(gpus)
    pairs = [(i, j) for i in range(n) for j in range(n)]
    if len(pairs) > 150:
        pairs = rng.sample(pairs, 150)
    _assert_matrix_matches_pairs(t, gpus, pairs)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    nodes=st.integers(1, 4),
    per_su=st.integers(1, 3),
    spines=st.integers(1, 3),
    oversub=st.sampled_from([1.0, 2.0, 4.0]),
    seed=st.integers(0, 1000),
)
def test_matrix_equals_pairwise_paths_random_rail_fabrics(nodes, per_su, spines, oversub, seed):
    t = build_cluster(nodes, hosts_per_su=per_su, spines=spines, oversubscription=oversub)
    gpus = t.gpus()
    rng = random.Random(seed)
    n = len(gpus)
    pairs = [(rng.randrange(n), rng.randrange(n)) for _ in range(25)]
    _assert_matrix_matches_pairs(t, gpus, pairs)


def test_matrix_subset_and_structure_cache():
    t = build_cluster(3)
    sub = ["node2/gpu1", "node0/gpu4", "node0/gpu1"]
    m = bandwidth_matrix(t, sub)
    assert m.gpus == sub
    assert m.get("node0/gpu4", "node0/gpu1") == (PathType.NVL, 450.0)
    assert m.get("node2/gpu1", "node0/gpu1") == (PathType.NET, 50.0)
    assert np.all(np.diag(m.bw) == LOC_BW)
    d = m.to_dict()
    assert d["gpus"] == sub and d["path_type"][1][2] == "NVL" and d["bw"][0][2] == 50.0
    from topology.paths import view

    assert view(t).cache["island_structures"] == 1  # three identical DGX: one intra-host search


def test_bandwidth_classes_count_every_ordered_pair():
    t = build_cluster(2)
    classes = bandwidth_classes(t)
    assert [(c["path_type"], c["bw"], c["pairs"]) for c in classes] == [("NVL", 450.0, 2 * 8 * 7), ("NET", 50.0, 2 * 8 * 8)]
    t = _pcie_tree()
    classes = bandwidth_classes(t)
    assert sum(c["pairs"] for c in classes) == 7 * 6
    keys = [(PathType[c["path_type"]], -c["bw"]) for c in classes]
    assert keys == sorted(keys)


@pytest.mark.parametrize("hosts", [2, 4, 6])
def test_bisection_rail_optimized_non_blocking(hosts):
    assert bisection_bandwidth(build_cluster(hosts))["bw"] == hosts / 2 * 8 * 50


@pytest.mark.parametrize("r", [2.0, 4.0])
def test_bisection_oversubscribed(r):
    # rail-optimized, 2 hosts per SU: the SU cut crosses the spine, whose capacity is leaf downlinks / r
    assert bisection_bandwidth(build_cluster(4, hosts_per_su=2, oversubscription=r))["bw"] == pytest.approx(4 / 2 * 8 * 50 / r)
    # leaf-spine, 2 hosts per leaf
    res = bisection_bandwidth(build_cluster(8, fabric="leaf-spine", hosts_per_leaf=2, oversubscription=r))
    assert res["bw"] == pytest.approx(8 / 2 * 8 * 50 / r)
    assert res["cuts"]["interleaved hosts, even | odd"] > res["bw"]  # the leaf-local cut is not the minimum


@pytest.mark.parametrize(("k", "hosts", "node"), [(4, 2, "dgx-h100"), (4, 4, "pcie-server"), (8, 32, "pcie-server")])
def test_bisection_fat_tree(k, hosts, node):
    t = build_cluster(hosts, node=node, fabric="fat-tree", k=k)
    assert bisection_bandwidth(t)["bw"] == pytest.approx(k**3 / 8 * 50)


def test_bisection_small_hand_built():
    t = _direct_cable_pair()
    assert bisection_bandwidth(t)["bw"] == 12.5
    assert bisection_bandwidth(build_node("dgx-h100"))["bw"] == 0.0


def test_cache_is_refreshed_after_edits():
    t = build_node("dgx-h100")
    assert gpu_path(t, 0, 1).bw == 450.0
    for u, v, k in list(t.graph.edges(keys=True)):
        if t.graph.nodes[u]["kind"] == NodeKind.NVSWITCH or t.graph.nodes[v]["kind"] == NodeKind.NVSWITCH:
            t.graph.remove_edge(u, v, k)
    assert gpu_path(t, 0, 1).path_type == PathType.NVL  # cached: link edits need an explicit clear
    clear_cache(t)
    assert gpu_path(t, 0, 1).path_type == PathType.PHB
    t.add_node("node0/gpu8", NodeKind.GPU, host="node0", index=8)
    t.add_link("node0/gpu0", "node0/gpu8", LinkKind.NVLINK, 7.0)
    assert gpu_path(t, 0, 8).bw == 7.0  # node count changed: rebuilt automatically


def test_to_dict_round_trip_fields():
    t = build_cluster(2)
    d = gpu_path(t, 0, 9).to_dict()
    assert d["path_type"] == "NET" and d["bw"] == 50.0 and d["nodes"][0] == "node0/gpu0" and d["hops"] == len(d["nodes"]) - 1
    assert any(t.graph.nodes[n].get("tier") == SwitchTier.LEAF for n in d["nodes"])


@pytest.mark.parametrize("name", ["pcie-tree", "gb200", "dgx-a100", "pcie-server"])
def test_single_source_search_equals_pair_search(name):
    """The bulk search used for host blocks, NIC choice and routes agrees with the per-pair search."""
    from topology.paths import _NVS, _p2c_sensitive, _search, _search_all, view

    t = CLUSTERS[name]()
    vw = view(t)
    rng = random.Random(name)
    sources = [a for a in range(len(vw.names)) if vw.island[a] >= 0 and vw.kind[a] != _NVS]
    for s in rng.sample(sources, min(12, len(sources))):
        targets = [x for x in range(len(vw.names)) if vw.island[x] == vw.island[s] and x != s and vw.kind[x] != _NVS]
        bulk = _search_all(vw, s, targets)
        for x in targets:
            pair = _search(vw, s, x)
            if _p2c_sensitive(vw, x, s):
                continue
            if pair is None:
                assert x not in bulk
                continue
            cls, bw, nhops, _, hops = bulk[x]
            assert (cls, bw, nhops) == (pair[0], pair[1], len(pair[2])), (vw.names[s], vw.names[x])
            # the bulk path is a walk s -> x of the same class and width
            assert hops[0][0] == s and hops[-1][1].v == x
            assert max(_edge_cls(vw, u, e, s, x) for u, e in hops) == cls
            assert min(e.bw for _, e in hops) == bw


def _edge_cls(vw, u, e, s, x):
    from topology.paths import _edge_class

    return _edge_class(vw, u, e, s, x)


def _random_topology(seed: int) -> Topology:
    """Hosts with random PCIe trees, NVLinks, NVSwitches and NICs, on a random switch fabric."""
    rng = random.Random(seed)
    t = Topology(f"random{seed}")
    bws = [12.5, 25.0, 50.0, 63.0, 100.0]
    switches = [t.add_node(f"sw{j}", NodeKind.SWITCH, tier=rng.choice([SwitchTier.LEAF, SwitchTier.SPINE])) for j in range(rng.randint(1, 4))]
    for j in range(1, len(switches)):  # a connected fabric, plus a few extra cables
        t.add_link(switches[j], switches[rng.randrange(j)], LinkKind.NETWORK, rng.choice(bws))
    for _ in range(rng.randint(0, 2)):
        a, b = rng.sample(switches, 2) if len(switches) > 1 else (None, None)
        if a:
            t.add_link(a, b, LinkKind.NETWORK, rng.choice(bws))
    nics = []
    for h in range(rng.randint(2, 4)):
        host = f"h{h}"
        cpus = [t.add_node(f"{host}/cpu{c}", NodeKind.CPU, host=host, numa=c) for c in range(rng.randint(1, 2))]
        if len(cpus) == 2:
            t.add_link(cpus[0], cpus[1], LinkKind.CPU, rng.choice([10.0, 22.0]))
        pcie = []
        for p in range(rng.randint(1, 4)):
            sw = t.add_node(f"{host}/pcie{p}", NodeKind.PCIE_SWITCH, host=host)
            parent = rng.choice(cpus + pcie)
            t.add_link(sw, parent, LinkKind.PCIE, rng.choice(bws))
            pcie.append(sw)
        gpus = []
        for g in range(rng.randint(1, 4)):
            gpu = t.add_node(f"{host}/gpu{g}", NodeKind.GPU, host=host, index=g)
            t.add_link(gpu, rng.choice(pcie), LinkKind.PCIE, rng.choice(bws))
            gpus.append(gpu)
        if len(gpus) > 1 and rng.random() < 0.5:
            nvs = t.add_node(f"{host}/nvs0", NodeKind.NVSWITCH, host=host, domain=host)
            for gpu in gpus:
                t.add_link(gpu, nvs, LinkKind.NVLINK, rng.choice([100.0, 450.0]))
        for _ in range(rng.randint(0, 2)):
            if len(gpus) > 1:
                a, b = rng.sample(gpus, 2)
                t.add_link(a, b, LinkKind.NVLINK, rng.choice([20.0, 40.0]))
        for n in range(rng.randint(0, 2)):
            nic = t.add_node(f"{host}/nic{n}", NodeKind.NIC, host=host, index=n, rail=n)
            t.add_link(nic, rng.choice(pcie + cpus), LinkKind.PCIE, rng.choice(bws))
            t.add_link(nic, rng.choice(switches), LinkKind.NETWORK, rng.choice(bws))
            nics.append(nic)
    if len(nics) > 1 and rng.random() < 0.3:  # a back-to-back cable
        a, b = rng.sample(nics, 2)
        if t.host_of(a) != t.host_of(b):
            t.add_link(a, b, LinkKind.NETWORK, rng.choice(bws))
    return t


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6))
def test_matrix_equals_pairwise_paths_random_graphs(seed):
    t = _random_topology(seed)
    gpus = t.gpus()
    _assert_matrix_matches_pairs(t, gpus, [(i, j) for i in range(len(gpus)) for j in range(len(gpus))])


def test_cached_paths_follow_changes_made_through_the_topology():
    from topology import LinkKind, NodeKind, Topology

    t = Topology()
    for g in ("h/g0", "h/g1"):
        t.add_node(g, NodeKind.GPU, host="h")
    t.add_link("h/g0", "h/g1", LinkKind.NVLINK, 25.0)
    assert gpu_path(t, "h/g0", "h/g1").bw == 25.0
    t.add_link("h/g0", "h/g1", LinkKind.NVLINK, 100.0)  # a parallel link adds its bandwidth
    assert gpu_path(t, "h/g0", "h/g1").bw == 125.0
    for _, _, d in t.graph.edges(data=True):  # an in-place edit, declared with touch()
        d["bw"] = 10.0
    t.touch()
    assert gpu_path(t, "h/g0", "h/g1").bw == 20.0


@pytest.mark.parametrize("name", sorted(CLUSTERS))
def test_bandwidth_classes_equal_counting_the_matrix(name):
    """Differential: the structural count equals counting the expanded matrix entry by entry, on every GPU subset kind."""
    from topology.paths import matrix_classes

    t = CLUSTERS[name]()
    gpus = t.gpus()
    rng = random.Random(name)
    subsets = [None, rng.sample(gpus, max(2, len(gpus) // 3)), gpus[::-1], gpus[:1]]
    for sub in subsets:
        assert bandwidth_classes(t, sub) == matrix_classes(bandwidth_matrix(t, sub)), sub
    twice = [gpus[0], gpus[0], gpus[-1]]  # a GPU listed twice: LOC with itself (the matrix path)
    assert bandwidth_classes(t, twice) == matrix_classes(bandwidth_matrix(t, twice))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hosts=st.integers(1, 7), per_su=st.integers(1, 4), oversub=st.sampled_from([1, 2, 4]), seed=st.integers(0, 10**6))
def test_bandwidth_classes_differential_on_random_rail_clusters(hosts, per_su, oversub, seed):
    from topology.paths import matrix_classes

    t = build_cluster(hosts, hosts_per_su=per_su, oversubscription=oversub)
    sub = random.Random(seed).sample(t.gpus(), random.Random(seed + 1).randint(1, len(t.gpus())))
    assert bandwidth_classes(t, sub) == matrix_classes(bandwidth_matrix(t, sub))
    assert sum(c["pairs"] for c in bandwidth_classes(t)) == len(t.gpus()) * (len(t.gpus()) - 1)
