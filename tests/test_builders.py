"""Node builders: DGX, PCIe-only servers, GB200 NVL72 trays and racks."""

import doctest
import json

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import topology.builders
import topology.hardware
from topology import LinkKind, NodeKind, Topology, TopologyError, build_cluster, build_node
from topology.builders import NODE_BUILDERS, add_gb200_nvl72_tray, add_hosts


def out_links(t, node, kind=None):
    return [(v, d) for _, v, d in t.graph.out_edges(node, data=True) if kind is None or d["kind"] == kind]


def assert_duplex(t):
    fwd = sorted((u, v, d["kind"], d["bw"]) for u, v, _, d in t.links())
    rev = sorted((v, u, d["kind"], d["bw"]) for u, v, _, d in t.links())
    assert fwd == rev


@pytest.mark.parametrize("module", [topology.builders, topology.hardware])
def test_doctests(module):
    assert doctest.testmod(module).failed == 0


def test_pcie_server_default_is_2_8_5_reference():
    t = build_node("pcie-server")
    t.validate()
    assert len(t.gpus()) == 8
    assert len(t.nodes(NodeKind.PCIE_SWITCH)) == 4
    assert len(t.nodes(NodeKind.NIC)) == 4
    assert len(t.nodes(NodeKind.CPU)) == 2
    assert not t.nodes(NodeKind.NVSWITCH)
    assert not list(t.links(LinkKind.NVLINK))
    for g in t.gpus():
        (sw, d), = out_links(t, g)
        assert t.kind(sw) is NodeKind.PCIE_SWITCH
        assert d["bw"] == pytest.approx(31.5)  # L40S is Gen4 x16 even on a Gen5 switch
    for sw in t.nodes(NodeKind.PCIE_SWITCH):
        gpus = [v for v, _ in out_links(t, sw) if t.kind(v) is NodeKind.GPU]
        nics = [v for v, _ in out_links(t, sw) if t.kind(v) is NodeKind.NIC]
        (cpu, up), = [(v, d) for v, d in out_links(t, sw) if t.kind(v) is NodeKind.CPU]
        assert len(gpus) == 2 and len(nics) == 1
        assert up["bw"] == pytest.approx(63.0)  # Gen5 x16
        assert all(t.graph.nodes[x]["numa"] == t.graph.nodes[cpu]["numa"] for x in gpus + nics)
    # Switches 0-1 under CPU 0, 2-3 under CPU 1.
    assert [t.graph.nodes[s]["numa"] for s in t.nodes(NodeKind.PCIE_SWITCH)] == [0, 0, 1, 1]
    assert [t.graph.nodes[n]["rail"] for n in t.nodes(NodeKind.NIC)] == [0, 1, 2, 3]
    assert_duplex(t)


def test_pcie_server_nccl_model_rates():
    t = build_node("pcie-server", nccl_model=True, pcie_gen=4)
    assert {d["bw"] for _, _, _, d in t.links(LinkKind.PCIE)} == {24.0}  # NCCL: Gen4 x16 = 24 GB/s


@settings(max_examples=40, deadline=None)
@given(
    per_switch=st.integers(1, 4),
    switches=st.integers(1, 6),
    nics_per_switch=st.integers(0, 2),
    gen=st.sampled_from([3, 4, 5, 6]),
    sockets=st.integers(1, 2),
    model=st.sampled_from(sorted(topology.hardware.GPU_SPECS)),
)
def test_pcie_server_options(per_switch, switches, nics_per_switch, gen, sockets, model):
    gpus = per_switch * switches
    if sockets > switches:
        with pytest.raises(TopologyError):
            build_node("pcie-server", gpus=gpus, gpus_per_switch=per_switch, sockets=sockets)
        return
    t = build_node("pcie-server", gpus=gpus, gpus_per_switch=per_switch, nics_per_switch=nics_per_switch, pcie_gen=gen, sockets=sockets, model=model)
    t.validate()
    assert len(t.gpus()) == gpus
    assert len(t.nodes(NodeKind.PCIE_SWITCH)) == switches
    assert len(t.nodes(NodeKind.NIC)) == switches * nics_per_switch
    assert nx.is_strongly_connected(t.graph)
    assert_duplex(t)
    gpu_gen = min(gen, topology.hardware.GPU_SPECS[model]["pcie_gen"])
    for g in t.gpus():
        (_, d), = out_links(t, g)
        assert d["bw"] == pytest.approx(topology.hardware.pcie_bw(gpu_gen))
        assert t.graph.nodes[g]["model"] == model


def test_pcie_server_rejects_bad_options():
    with pytest.raises(TopologyError, match="multiple of gpus_per_switch"):
        build_node("pcie-server", gpus=6, gpus_per_switch=4)
    with pytest.raises(TopologyError, match="pcie_gen"):
        build_node("pcie-server", pcie_gen=2)
    with pytest.raises(TopologyError, match="unknown GPU model"):
        build_node("pcie-server", model="X100")


def test_gb200_nvl72_rack_structure():
    t = build_node("gb200-nvl72")
    t.validate()
    assert len(t.gpus()) == 72
    assert len(t.hosts()) == 18
    chips = t.nodes(NodeKind.NVSWITCH)
    assert len(chips) == 18
    assert all(t.host_of(c) is None and t.graph.nodes[c]["domain"] == "rack0" for c in chips)
    for g in t.gpus():
        assert t.graph.nodes[g]["domain"] == "rack0"
        nvl = out_links(t, g, LinkKind.NVLINK)
        # 18 NVLink5 links of 50 GB/s per direction, one to each chip: 900 GB/s per GPU.
        assert len(nvl) == 18
        assert sorted(v for v, _ in nvl) == sorted(chips)
        assert all(d["bw"] == 50.0 and d["count"] == 1 for _, d in nvl)
        (cpu, c2c), = out_links(t, g, LinkKind.PCIE)
        assert t.kind(cpu) is NodeKind.CPU and c2c["c2c"] is True
    for c in chips:
        assert len(out_links(t, c)) == 72
    for h in t.hosts():
        assert len(t.gpus(h)) == 4
        assert len(t.nodes(NodeKind.CPU, h)) == 2
        nics = t.nodes(NodeKind.NIC, h)
        assert [t.graph.nodes[n]["rail"] for n in nics] == [0, 1, 2, 3]
        # each NIC on the Grace of its GPU
        for i, nic in enumerate(nics):
            (cpu, _), = out_links(t, nic)
            assert t.graph.nodes[cpu]["numa"] == t.graph.nodes[t.gpus(h)[i]]["numa"]
    assert nx.is_strongly_connected(t.graph)
    assert_duplex(t)


def test_gb200_nccl_model_uses_sm100_per_link_figure():
    t = Topology()
    add_gb200_nvl72_tray(t, "n0", nccl_model=True)
    g = t.gpus()[0]
    assert sum(d["bw"] for _, d in out_links(t, g, LinkKind.NVLINK)) == pytest.approx(18 * 40.1)


def test_gb200_domain_is_full_at_18_trays():
    t = Topology()
    for i in range(18):
        add_gb200_nvl72_tray(t, f"n{i}")
    with pytest.raises(TopologyError, match="is full"):
        add_gb200_nvl72_tray(t, "n18")
    add_gb200_nvl72_tray(t, "n18", domain="rack1")
    assert len(t.nodes(NodeKind.NVSWITCH)) == 36


def test_gb200_cluster_groups_trays_into_racks():
    t = build_cluster(40, node="gb200-nvl72")
    assert len(t.hosts()) == 40 and len(t.gpus()) == 160
    domains = {}
    for g in t.gpus():
        domains.setdefault(t.graph.nodes[g]["domain"], []).append(g)
    assert {d: len(gs) for d, gs in domains.items()} == {"rack0": 72, "rack1": 72, "rack2": 16}
    # A partly populated rack still has all 18 chips; GPUs only reach their own domain's chips.
    assert len(t.nodes(NodeKind.NVSWITCH)) == 54
    for g in domains["rack2"]:
        assert {t.graph.nodes[v]["domain"] for v, _ in out_links(t, g, LinkKind.NVLINK)} == {"rack2"}


def test_multi_host_kinds_reject_manual_grouping():
    with pytest.raises(TopologyError, match="domain"):
        add_hosts(Topology(), "gb200-nvl72", 4, domain="x")
    with pytest.raises(TopologyError, match="host"):
        build_node("gb200-nvl72", host="n0")


@pytest.mark.parametrize("kind", sorted(NODE_BUILDERS))
def test_every_node_kind_validates_and_round_trips(kind):
    t = build_node(kind)
    t.validate()
    assert nx.is_strongly_connected(t.graph)
    assert_duplex(t)
    again = Topology.from_dict(json.loads(json.dumps(t.to_dict())))
    assert again == t
    # Every GPU can reach a NIC (so it can join a fabric) and all NICs carry a line rate.
    for n in t.nodes(NodeKind.NIC):
        assert t.graph.nodes[n]["speed_gbps"] > 0


def test_unknown_node_kind_lists_choices():
    with pytest.raises(TopologyError, match="pcie-server"):
        build_node("dgx-z9")
