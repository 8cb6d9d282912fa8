"""``nvidia-smi topo -m`` import: NCCL path classes equal the matrix codes, structure, robustness, errors."""

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from topology import InputError, LinkKind, NodeKind
from topology.io import read_topology
from topology.io.nvsmi import nvsmi_to_nccl, parse_nvidia_smi, read_matrix
from topology.paths import PathType, device_path, gpu_path

DATA = Path(__file__).parent / "data"
SAMPLES = ["nvsmi_dgx_h100.txt", "nvsmi_dgx_a100.txt", "nvsmi_messy_workstation.txt", "nvsmi_old_driver_soc.txt"]


def _load(name, **options):
    text = (DATA / name).read_text(encoding="utf-8")
    return text, parse_nvidia_smi(text, source=name, **options)


def _ids(topo, matrix):
    host = topo.hosts()[0]
    nic_by_name = {topo.graph.nodes[n]["name"]: n for n in topo.nodes(NodeKind.NIC)}
    return {d: f"{host}/gpu{int(d[3:])}" if matrix.is_gpu(d) else nic_by_name[matrix.nic_names.get(d, d)] for d in matrix.devices}


@pytest.mark.parametrize("name", SAMPLES)
def test_gpu_pair_classes_match_matrix(name):
    text, topo = _load(name)
    matrix = read_matrix(text)
    ids = _ids(topo, matrix)
    gpus = [d for d in matrix.devices if matrix.is_gpu(d)]
    for a in gpus:
        for b in gpus:
            expected = PathType[nvsmi_to_nccl(matrix.codes[(a, b)])]
            assert gpu_path(topo, ids[a], ids[b]).path_type is expected, (a, b, matrix.codes[(a, b)])


@pytest.mark.parametrize("name", SAMPLES)
def test_nic_classes_follow_matrix(name):
    """NIC pairs match exactly; a GPU-NIC path is the matrix class, or better only by relaying through a GPU over NVLink (PXN)."""
    text, topo = _load(name)
    matrix = read_matrix(text)
    ids = _ids(topo, matrix)
    for a in matrix.devices:
        for b in matrix.devices:
            if a == b or (matrix.is_gpu(a) and matrix.is_gpu(b)):
                continue
            expected = PathType[nvsmi_to_nccl(matrix.codes[(a, b)])]
            path = device_path(topo, ids[a], ids[b])
            relays = [n for n in path.nodes[1:-1] if topo.kind(n) is NodeKind.GPU]
            if relays:
                assert path.path_type < expected and matrix.is_gpu(a) != matrix.is_gpu(b)
            else:
                assert path.path_type is expected, (a, b, matrix.codes[(a, b)], path.nodes)


def test_dgx_h100_structure_and_rates():
    _, topo = _load("nvsmi_dgx_h100.txt")
    assert topo.hosts() == ["node0"]
    assert len(topo.gpus()) == 8 and len(topo.nodes(NodeKind.NIC)) == 12
    assert [topo.graph.nodes[c]["numa"] for c in topo.nodes(NodeKind.CPU)] == [0, 1]
    assert [topo.graph.nodes[g]["numa"] for g in topo.gpus()] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert topo.graph.nodes["node0/nic11"]["name"] == "mlx5_11"
    assert topo.graph.nodes["node0/gpu0"]["model"] == "H100-SXM5-80GB"  # inferred from NV18
    (nvs,) = topo.nodes(NodeKind.NVSWITCH)
    for g in topo.gpus():
        (link,) = [d for _, v, d in topo.graph.out_edges(g, data=True) if v == nvs]
        assert link["count"] == 18 and link["bw"] == pytest.approx(450.0)
    # GPU1 and mlx5_3 share one PCIe Gen5 switch (PIX): 63 GB/s spec rate, no other device on it.
    (sw,) = [v for _, v, d in topo.graph.out_edges("node0/gpu1", data=True) if d["kind"] == LinkKind.PCIE]
    assert sorted(u for u, _ in topo.graph.in_edges(sw) if topo.kind(u) is not NodeKind.CPU) == ["node0/gpu1", "node0/nic3"]
    assert device_path(topo, "node0/gpu1", "node0/nic3").bw == pytest.approx(63.0)
    assert gpu_path(topo, 0, 7).bw == pytest.approx(450.0)


def test_nccl_model_and_options():
    _, topo = _load("nvsmi_dgx_h100.txt", nccl_model=True, host="dgx07", nic_gbps=200)
    assert topo.hosts() == ["dgx07"]
    assert gpu_path(topo, 0, 5).bw == pytest.approx(18 * 20.6)
    assert device_path(topo, "dgx07/gpu0", "dgx07/nic0").bw == pytest.approx(48.0)
    assert topo.graph.nodes["dgx07/nic0"]["speed_gbps"] == 200
    _, gen4 = _load("nvsmi_dgx_h100.txt", pcie_gen=4, nvlink="direct")
    assert device_path(gen4, "node0/gpu0", "node0/nic0").bw == pytest.approx(31.5)
    assert not gen4.nodes(NodeKind.NVSWITCH) and gpu_path(gen4, 0, 1).nodes == ("node0/gpu0", "node0/gpu1")


def test_dgx_a100_pxb_tree():
    _, topo = _load("nvsmi_dgx_a100.txt")
    assert topo.graph.nodes["node0/gpu0"]["model"] == "A100-SXM4-80GB"
    assert sorted({topo.graph.nodes[c]["numa"] for c in topo.nodes(NodeKind.CPU)}) == [1, 3, 5, 7]
    # GPU0 and mlx5_0 are PXB: each on its own switch below a common parent switch.
    path = device_path(topo, "node0/gpu0", "node0/nic0")
    assert path.path_type is PathType.PXB
    assert [topo.kind(n) for n in path.nodes] == [NodeKind.GPU] + [NodeKind.PCIE_SWITCH] * 3 + [NodeKind.NIC]
    assert path.bw == pytest.approx(31.5)  # PCIe Gen4 x16, spec rate


def test_messy_paste():
    _, topo = _load("nvsmi_messy_workstation.txt")
    assert topo.hosts() == ["ws-17"]  # from the shell prompt
    nv = [(u, v, d["count"]) for u, v, _, d in topo.links(LinkKind.NVLINK)]
    assert sorted(nv) == [("ws-17/gpu0", "ws-17/gpu1", 4), ("ws-17/gpu1", "ws-17/gpu0", 4)]
    assert gpu_path(topo, 0, 1).bw == pytest.approx(100.0)
    # GPU3 and NIC1 are NODE: same NUMA node, different host bridges, both on the root complex.
    g3, n1 = topo.graph.nodes["ws-17/gpu3"], topo.graph.nodes["ws-17/nic1"]
    assert g3["numa"] == n1["numa"] == 1 and g3["host_bridge"] != n1["host_bridge"]


def test_old_driver_without_numa_column():
    _, topo = _load("nvsmi_old_driver_soc.txt", gpu_model="A100-SXM4-80GB")
    assert [topo.graph.nodes[g]["numa"] for g in topo.gpus()] == [0, 0, 1, 1]  # grouped by CPU affinity
    assert gpu_path(topo, 0, 2).path_type is PathType.SYS
    assert gpu_path(topo, 0, 2).bw == pytest.approx(16.0)  # AMD inter-socket figure for an A100 host


def test_read_topology_guesses_format():
    topo = read_topology(DATA / "nvsmi_dgx_h100.txt")
    assert topo.meta["imported"]["format"] == "nvidia-smi"


# --- property: any PCIe tree -> its matrix -> import -> same classes ------------------------


@st.composite
def pcie_trees(draw):
    """Random servers: NUMA nodes > host bridges > (devices | switch subtrees); returns each device's chain to the CPU."""
    chains: list[tuple[int, int, tuple[str, ...]]] = []  # (numa, host bridge, switches from the top)
    counter = [0]

    def subtree(numa, hb, path, depth):
        counter[0] += 1
        sw = path + (f"s{counter[0]}",)
        for _ in range(draw(st.integers(1, 3))):
            if depth < 2 and draw(st.integers(0, 3)) == 0:
                subtree(numa, hb, sw, depth + 1)
            else:
                chains.append((numa, hb, sw))

    for numa in range(draw(st.integers(1, 2))):
        for hb in range(draw(st.integers(1, 2))):
            for _ in range(draw(st.integers(1, 2))):
                if draw(st.booleans()):
                    chains.append((numa, hb, ()))
                else:
                    subtree(numa, hb, (), 0)
    chains = chains[:9]
    gpus = draw(st.integers(1, len(chains)))
    labels = [f"GPU{i}" for i in range(gpus)] + [f"NIC{i}" for i in range(len(chains) - gpus)]
    order = draw(st.permutations(range(len(chains))))
    return {labels[i]: chains[order[i]] for i in range(len(chains))}


def _code(a, b):
    (na, ha, pa), (nb, hb, pb) = a, b
    if na != nb:
        return "SYS"
    common = 0
    while common < min(len(pa), len(pb)) and pa[common] == pb[common]:
        common += 1
    if common == 0:
        return "PHB" if ha == hb else "NODE"
    bridges = (len(pa) - common) + (len(pb) - common) + 1
    return "PIX" if bridges == 1 else "PXB"


def _render(devices, seps):
    labels = list(devices)
    rows = ["\t" + "\t".join(labels) + "\tCPU Affinity\tNUMA Affinity"]
    for k, a in enumerate(labels):
        cells = [" X " if a == b else _code(devices[a], devices[b]) for b in labels]
        sep = seps[k % len(seps)]
        tail = f"{sep}{devices[a][0] * 8}-{devices[a][0] * 8 + 7}{sep}{devices[a][0]}" if a.startswith("GPU") else ""
        rows.append(a + sep + sep.join(cells) + tail)
    return "\n".join(rows) + "\n"


@settings(max_examples=40, deadline=None)
@given(pcie_trees(), st.lists(st.sampled_from(["\t", "  ", " \t", "     "]), min_size=1, max_size=3))
def test_any_pcie_tree_round_trips_through_the_matrix(devices, seps):
    text = _render(devices, seps)
    topo = parse_nvidia_smi(text, host="h")
    matrix = read_matrix(text)
    ids = _ids(topo, matrix)
    for a in devices:
        for b in devices:
            if a != b:
                assert device_path(topo, ids[a], ids[b]).path_type is PathType[nvsmi_to_nccl(_code(devices[a], devices[b]))], (a, b)


# --- malformed input -------------------------------------------------------------------------

GOOD = """\tGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV4\tPIX\t0-7\t0
GPU1\tNV4\t X \tSYS\t8-15\t1
NIC0\tPIX\tSYS\t X
"""


def test_good_baseline_parses():
    assert len(parse_nvidia_smi(GOOD).gpus()) == 2


@pytest.mark.parametrize(
    "text, line, fragment",
    [
        ("hello\n", None, "no matrix header"),
        (GOOD.replace("NV4\tPIX", "NV4\tPIZ"), 2, "row GPU0, column NIC0: expected X, NV#, PIX"),
        (GOOD.replace("NIC0\tPIX\tSYS\t X\n", ""), None, "no matrix row for NIC0"),
        (GOOD.replace("GPU1\tNV4\t X \tSYS", "GPU1\tNV4\t X \tPHB"), 3, "says PHB but row NIC0"),
        (GOOD.replace("GPU0\t X \tNV4", "GPU0\tPIX\tNV4"), 2, "'PIX' on the diagonal"),
        (GOOD.replace("NV4\tPIX", "NV4\tNV2").replace("PIX\tSYS\t X", "NV2\tSYS\t X"), 2, "NVLink code NV2 between a GPU and a NIC"),
        (GOOD.replace("0-7\t0", "0-7\t0\t1\t9"), 2, "more than the header has columns"),
        (GOOD.replace("GPU1\tNV4", "GPU0\t X \tNV4\tPIX\t0-7\t0\nGPU1\tNV4"), 3, "second row for GPU0"),
        (GOOD.replace("8-15\t1", "8-15\t0"), 3, "report the same NUMA affinity 0"),
    ],
)
def test_errors_name_file_and_line(text, line, fragment):
    with pytest.raises(InputError) as exc:
        parse_nvidia_smi(text, source="topo.txt")
    message = str(exc.value)
    assert message.startswith("topo.txt: " + (f"line {line}: " if line else "")), message
    assert fragment in message, message
    assert "\n" not in message


def test_inconsistent_matrix_is_rejected():
    # GPU0-GPU1 and GPU1-GPU2 share a switch (PIX) but GPU0-GPU2 claims PXB: no PCIe tree gives that.
    text = "\tGPU0\tGPU1\tGPU2\nGPU0\t X \tPIX\tPXB\nGPU1\tPIX\t X \tPIX\nGPU2\tPXB\tPIX\t X \n"
    with pytest.raises(InputError, match=r"^t.txt: line 2: GPU0-GPU2 is PXB in the matrix, but .* gives PIX"):
        parse_nvidia_smi(text, source="t.txt")


def test_cells_without_separator_parse_the_same():
    text = (DATA / "nvsmi_dgx_h100.txt").read_text()
    squashed = text
    for a in ("NV18", "PIX", "NODE", "SYS"):
        for b in ("PIX", "NODE", "SYS"):
            squashed = squashed.replace(f"{a}\t{b}", f"{a}{b}")
    assert "NV18PIX" in squashed and "NODESYS" in squashed
    assert parse_nvidia_smi(squashed).to_dict() == parse_nvidia_smi(text).to_dict()
    pasted = text.replace("\tSYS", "\u00a0SYS").replace("\t", "   ")  # a web page's no-break spaces, tabs expanded
    assert parse_nvidia_smi(pasted).to_dict() == parse_nvidia_smi(text).to_dict()


def test_byte_order_mark_is_ignored():
    text = (DATA / "nvsmi_dgx_h100.txt").read_text()
    assert parse_nvidia_smi("\ufeff" + text).to_dict() == parse_nvidia_smi(text).to_dict()


# --- the GPU model: from a flag, from `nvidia-smi -L` lines in the dump, from NV#, else a stated default ---------

_DATA = Path(__file__).parent / "data"
_PCIE_ONLY = (_DATA / "nvsmi_old_driver_soc.txt").read_text()


def _imported(topo):
    return topo.meta["imported"]["gpu_model"], topo.meta["imported"]["gpu_model_from"]


def test_gpu_model_from_nvidia_smi_list_lines():
    import warnings

    listed = "".join(f"GPU {i}: NVIDIA L40S (UUID: GPU-{i:08x})\n" for i in range(4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no guess, no warning
        topo = parse_nvidia_smi(listed + _PCIE_ONLY)
    assert _imported(topo) == ("L40S-48GB", "nvidia-smi -L")
    assert {topo.graph.nodes[g]["model"] for g in topo.gpus()} == {"L40S-48GB"}
    assert _imported(parse_nvidia_smi(listed + _PCIE_ONLY, gpu_model="A100-SXM4-80GB")) == ("A100-SXM4-80GB", "given")


def test_unknown_or_mixed_listed_models_are_refused():
    with pytest.raises(InputError, match=r"line 2: GPU model 'NVIDIA H100 PCIe' is not in the hardware table"):
        parse_nvidia_smi("GPU 0: NVIDIA L40S (UUID: GPU-1)\nGPU 1: NVIDIA H100 PCIe (UUID: GPU-2)\n" + _PCIE_ONLY)
    with pytest.raises(InputError, match="several GPU models"):
        parse_nvidia_smi("GPU 0: NVIDIA L40S (UUID: GPU-1)\nGPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-2)\n" + _PCIE_ONLY)


def test_model_from_nvlink_count_and_the_stated_default():
    assert _imported(parse_nvidia_smi((_DATA / "nvsmi_dgx_a100.txt").read_text())) == ("A100-SXM4-80GB", "NV12 links")
    with pytest.warns(UserWarning, match="GPU model is not in the dump; assumed H100-SXM5-80GB"):
        topo = parse_nvidia_smi(_PCIE_ONLY)
    assert _imported(topo) == ("H100-SXM5-80GB", "default")


def test_cli_import_says_when_the_model_is_assumed(tmp_path, capsys):
    from netweave.cli import main

    assert main(["topo", "import", str(_DATA / "nvsmi_old_driver_soc.txt"), "--out", str(tmp_path / "a.json")]) == 0
    assert "note: " in capsys.readouterr().err
    listed = tmp_path / "l40s.txt"
    listed.write_text("GPU 0: NVIDIA L40S (UUID: GPU-1)\n" + _PCIE_ONLY)
    assert main(["topo", "import", str(listed), "--out", str(tmp_path / "b.json")]) == 0  # format guessed with the list lines
    assert "note" not in capsys.readouterr().err
    assert '"gpu_model": "L40S-48GB"' in (tmp_path / "b.json").read_text()
