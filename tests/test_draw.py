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


# --- readable detailed view: no two boxes of one row overlap; formats by extension -------------------------

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from topology.draw import _host_layout, _Layout, spread_row  # noqa: E402
from topology.errors import InputError  # noqa: E402

DATA = Path(__file__).parent / "data"


@settings(max_examples=60, deadline=None)
@given(desired=st.lists(st.floats(-20, 20, allow_nan=False), min_size=1, max_size=12), gap=st.floats(0.1, 3.0))
def test_spread_row_is_the_least_squares_optimum(desired, gap):
    """Brute force by another method: p = p0 + k*gap + cumulative slacks >= 0 is a bounded linear least-squares problem."""
    from scipy.optimize import lsq_linear

    out = spread_row(desired, gap)
    order = sorted(range(len(desired)), key=lambda i: desired[i])
    placed = [out[i] for i in order]
    assert all(b - a >= gap - 1e-6 for a, b in zip(placed, placed[1:], strict=False))  # no overlap, order kept
    n = len(desired)
    A = np.zeros((n, n))  # columns: p0, then slack s_1..s_{n-1}
    A[:, 0] = 1.0
    for k in range(1, n):
        A[k:, k] = 1.0
    target = np.array([desired[i] - k * gap for k, i in enumerate(order)])
    ref = lsq_linear(A, target, bounds=([-np.inf] + [0.0] * (n - 1), [np.inf] * n), tol=1e-12)
    best = float(np.sum((A @ ref.x - target) ** 2))
    ours = float(sum((out[i] - desired[i]) ** 2 for i in range(n)))
    assert ours <= best + 1e-6 * (1 + best)
    if all(b - a >= gap for a, b in zip(sorted(desired), sorted(desired)[1:], strict=False)):
        assert out == pytest.approx(desired, abs=1e-8)  # already readable: nothing moves (positions are rounded to 1e-9)


def _rows_do_not_overlap(topo):
    lay = _Layout()
    x = 0.0
    for h in topo.hosts():
        x += _host_layout(topo, h, x, 0.0, lay) + 0.8
    rows = {}
    for n, (px, py) in lay.pos.items():
        rows.setdefault(py, []).append((px - lay.size[n][0] / 2, px + lay.size[n][0] / 2, n))
    for boxes in rows.values():
        boxes.sort()
        for (_, right, a), (left, _, b) in zip(boxes, boxes[1:], strict=False):
            assert right <= left + 1e-9, f"{a} overlaps {b}"
    return lay


@pytest.mark.parametrize("dump", sorted(p.name for p in DATA.glob("nvsmi_*.txt")))
def test_imported_nodes_have_no_overlapping_boxes(dump, tmp_path):
    from topology.io import read_topology

    topo = read_topology(DATA / dump, "nvidia-smi", gpu_model="H100-SXM5-80GB")
    lay = _rows_do_not_overlap(topo)
    assert set(lay.pos) == {n for n in topo.graph if topo.graph.nodes[n].get("host")}  # every device drawn
    draw_topology(topo, tmp_path / "node.png")


@pytest.mark.parametrize("kind", ["dgx-h100", "dgx-a100", "pcie-server", "gb200-nvl72"])
def test_built_nodes_have_no_overlapping_boxes(kind):
    _rows_do_not_overlap(build_cluster(2, node=kind))


def test_format_follows_the_extension(tmp_path):
    topo = build_node("dgx-h100")
    draw_topology(topo, tmp_path / "n.svg")
    draw_topology(topo, tmp_path / "n.pdf")
    draw_topology(topo, tmp_path / "n.PNG")
    assert b"<svg" in (tmp_path / "n.svg").read_bytes()[:2000]
    assert (tmp_path / "n.pdf").read_bytes()[:5] == b"%PDF-"
    png_size(tmp_path / "n.PNG")
    with pytest.raises(InputError, match=r"n\.jpg: unknown picture format '\.jpg'"):
        draw_topology(topo, tmp_path / "n.jpg")
    assert not (tmp_path / "n.jpg").exists()


def test_cli_draw_svg_and_bad_extension(tmp_path, capsys, monkeypatch):
    from netweave.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["topo", "import", str(DATA / "nvsmi_dgx_h100.txt"), "--out", "node.json"]) == 0
    assert main(["topo", "draw", "node.json", "--out", "node.svg"]) == 0
    assert (tmp_path / "node.svg").read_text().lstrip().startswith("<?xml")
    capsys.readouterr()
    assert main(["topo", "draw", "node.json", "--out", "node.gif"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "expected a file ending in .png, .svg or .pdf" in err
