import json

import pytest

from topology import LinkKind, NodeKind, Topology, TopologyError, build_cluster, build_node
from topology.io import dumps, loads, read_topology, write_topology


def test_dgx_h100_structure():
    t = build_node("dgx-h100")
    assert len(t.gpus()) == 8
    assert len(t.nodes(NodeKind.NVSWITCH)) == 4
    assert len(t.nodes(NodeKind.CPU)) == 2
    # 18 NVLink4 lanes per GPU, 25 GB/s per direction each: 450 GB/s per GPU.
    for g in t.gpus():
        out = [d for _, _, d in t.graph.out_edges(g, data=True) if d["kind"] == LinkKind.NVLINK]
        assert sum(d["count"] for d in out) == 18
        assert sum(d["bw"] for d in out) == pytest.approx(450.0)


def test_nccl_model_rates():
    t = build_node("dgx-h100", nccl_model=True)
    g = t.gpus()[0]
    nvl = sum(d["bw"] for _, _, d in t.graph.out_edges(g, data=True) if d["kind"] == LinkKind.NVLINK)
    assert nvl == pytest.approx(18 * 20.6)  # NCCL's SM90 per-link figure
    pcie = [d["bw"] for _, _, d in t.graph.out_edges(g, data=True) if d["kind"] == LinkKind.PCIE]
    assert pcie == [48.0]  # Gen5 x16 in NCCL's model


def test_links_are_duplex_and_symmetric(cluster):
    edges = {}
    for u, v, _, d in cluster.links():
        edges.setdefault((u, v), []).append(d["bw"])
    for (u, v), bws in edges.items():
        assert sorted(bws) == sorted(edges[(v, u)])


def test_8192_gpus_build():
    t = build_cluster(1024)
    assert len(t.gpus()) == 8192
    assert len(t.switches("leaf")) == 32 * 8


def test_json_round_trip(tmp_path, cluster):
    path = tmp_path / "c.json"
    write_topology(cluster, path)
    again = read_topology(path)
    assert again == cluster
    assert dumps(again) == dumps(cluster)
    assert again.kind(again.gpus()[0]) is NodeKind.GPU


@pytest.mark.parametrize(
    "mutate, where",
    [
        (lambda d: d["links"][3].__setitem__("bw", "fast"), "links[3].bw"),
        (lambda d: d["nodes"][0].__setitem__("kind", "toaster"), "nodes[0].kind"),  # the schema names the field
        (lambda d: d["links"][0].__setitem__("src", "nowhere"), "links[0]"),
        (lambda d: d.__setitem__("version", 99), "version"),
    ],
)
def test_json_errors_name_the_field(cluster, mutate, where):
    data = json.loads(dumps(cluster))
    mutate(data)
    with pytest.raises(TopologyError) as exc:
        loads(json.dumps(data), "json", source="c.json")
    assert str(exc.value).startswith(f"c.json: {where}: ")


def test_resolve_gpu(cluster):
    assert cluster.resolve_gpu("node1/gpu2") == "node1/gpu2"
    assert cluster.resolve_gpu(10) == "node1/gpu2"
    assert cluster.resolve_gpu("gpu10") == "node1/gpu2"
    with pytest.raises(TopologyError):
        cluster.resolve_gpu("node9/gpu0")
    with pytest.raises(TopologyError):
        cluster.resolve_gpu("node0/nic0")


def test_add_link_rejects_bad_input():
    t = Topology()
    t.add_node("a", NodeKind.GPU, host="h")
    with pytest.raises(TopologyError):
        t.add_link("a", "b", LinkKind.PCIE, 10)
    t.add_node("b", NodeKind.GPU, host="h")
    with pytest.raises(TopologyError):
        t.add_link("a", "b", LinkKind.PCIE, 0)
