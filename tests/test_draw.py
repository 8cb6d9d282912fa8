"""draw_topology writes valid PNGs, detailed for small topologies and aggregated for large ones."""

import doctest
import struct

import pytest

import topology.draw
from topology import build_cluster, build_node
from topology.draw import DETAIL_MAX_HOSTS, _draw_aggregated, _host_groups, _merge, draw_topology

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    assert data[-8:-4] == b"IEND"
    return struct.unpack(">II", data[16:24])


def test_doctests():
    assert doctest.testmod(topology.draw).failed == 0


@pytest.mark.parametrize("kind", ["dgx-h100", "pcie-server"])
def test_node_png(tmp_path, kind):
    path = tmp_path / f"{kind}.png"
    draw_topology(build_node(kind), path, title=f"one {kind}")
    w, h = png_size(path)
    assert w > 600 and h > 300


def test_default_cluster_png(tmp_path, cluster):
    path = tmp_path / "default.png"
    draw_topology(cluster, path)
    w, h = png_size(path)
    assert w > h > 400  # wide: four hosts side by side under the fabric


def test_nvl72_and_fat_tree_pngs(tmp_path):
    for name, topo in {
        "gb200-2trays": build_cluster(2, node="gb200-nvl72"),
        "rack": build_node("gb200-nvl72"),
        "fat-tree": build_cluster(2, fabric="fat-tree"),
    }.items():
        path = tmp_path / f"{name}.png"
        draw_topology(topo, path)
        png_size(path)


def test_1024_node_cluster_uses_the_aggregated_view(tmp_path, monkeypatch):
    topo = build_cluster(1024)
    assert len(topo.hosts()) > DETAIL_MAX_HOSTS
    called = []
    monkeypatch.setattr(topology.draw, "_draw_aggregated", lambda *a: called.append(1) or _draw_aggregated(*a))
    path = tmp_path / "big.png"
    draw_topology(topo, path)
    assert called == [1]
    png_size(path)


def test_host_groups_follow_scalable_units():
    topo = build_cluster(70)  # rail-optimized, 32 hosts per SU
    groups = _host_groups(topo, topo.hosts())
    assert [len(v) for v in groups.values()] == [32, 32, 6]
    assert list(groups) == ["SU 0", "SU 1", "SU 2"]


def test_merge_caps_columns_and_keeps_order():
    keys = [f"SU {i}" for i in range(32)]
    merged = _merge(keys, 8)
    columns = list(dict.fromkeys(merged.values()))
    assert columns[0] == "SU 0-3" and columns[-1] == "SU 28-31" and len(columns) == 8
    assert _merge(["a", "b"], 8) == {"a": "a", "b": "b"}
