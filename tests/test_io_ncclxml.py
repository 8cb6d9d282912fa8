"""NCCL topology XML: import rules, round trips with the builders and with samples, multi-host, errors."""

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from topology import InputError, LinkKind, NodeKind, TopologyError, build_cluster, build_node
from topology.io import dumps, read_topology
from topology.io.ncclxml import parse_nccl_xml, to_nccl_xml
from topology.io.nvsmi import parse_nvidia_smi
from topology.paths import PathType, device_path, gpu_path

DATA = Path(__file__).parent / "data"


def _edges(topo):
    return sorted((u, v, str(d["kind"]), round(d["bw"], 6), d.get("count")) for u, v, _, d in topo.links())


def _pairs(topo):
    """Class and bandwidth of every GPU-GPU and GPU-NIC path."""
    gpus, nics = topo.gpus(), topo.nodes(NodeKind.NIC)
    out = {}
    for a in gpus:
        for b in gpus + nics:
            if a != b:
                p = device_path(topo, a, b)
                out[(a, b)] = (p.path_type, round(p.bw, 6))
    return out


@pytest.mark.parametrize("kind", ["dgx-h100", "dgx-a100"])
def test_builder_round_trip_is_exact_with_nccl_rates(kind):
    built = build_node(kind, nccl_model=True)
    again = parse_nccl_xml(to_nccl_xml(built))
    assert again.gpus() == built.gpus()
    for g in built.gpus():
        for key in ("index", "numa", "model", "memory_gib", "tflops"):
            assert again.graph.nodes[g][key] == built.graph.nodes[g][key]
    for n in built.nodes(NodeKind.NIC):
        for key in ("index", "name", "numa", "speed_gbps"):
            assert again.graph.nodes[n][key] == built.graph.nodes[n][key]
    assert _edges(again) == _edges(built)
    assert _pairs(again) == _pairs(built)


@pytest.mark.parametrize("kind", ["pcie-server", "gb200-nvl72"])
def test_other_servers_keep_classes_and_rates(kind):
    import inspect

    from topology.builders import NODE_BUILDERS

    options = {"nccl_model": True} if "nccl_model" in inspect.signature(NODE_BUILDERS[kind]).parameters else {}
    built = build_node(kind, **options)
    host = built.hosts()[0]
    text = to_nccl_xml(built, host)
    again = parse_nccl_xml(text, host=host)
    assert to_nccl_xml(again) == text
    gpus, nics = built.gpus(host), built.nodes(NodeKind.NIC, host)
    for a in gpus:
        for b in gpus + nics:
            if a != b:
                p, q = device_path(built, a, b), device_path(again, a, b)
                assert (q.path_type, q.bw) == pytest.approx((p.path_type, p.bw)), (a, b)
    if kind == "gb200-nvl72":
        c2c = [d for _, v, d in again.graph.out_edges(gpus[0], data=True) if d.get("c2c")]
        assert len(c2c) == 1 and c2c[0]["bw"] == pytest.approx(225.0)  # half a Grace's 450 GB/s NVLink-C2C


def test_spec_rates_come_back_as_nccl_rates():
    built = build_node("dgx-h100")  # spec-sheet rates: PCIe Gen5 x16 = 63, NVLink4 = 25 per link
    again = parse_nccl_xml(to_nccl_xml(built))
    assert device_path(again, "node0/gpu0", "node0/nic0").bw == pytest.approx(48.0)
    assert gpu_path(again, 0, 1).bw == pytest.approx(18 * 20.6)
    assert {k: v[0] for k, v in _pairs(again).items()} == {k: v[0] for k, v in _pairs(built).items()}


def test_hgx_h100_sample():
    topo = read_topology(DATA / "nccl_hgx_h100.xml")
    assert topo.hosts() == ["node0"]
    assert len(topo.gpus()) == 8 and len(topo.nodes(NodeKind.NVSWITCH)) == 4
    assert len(topo.nodes(NodeKind.PCIE_SWITCH)) == 8  # the NVMe drive is left out
    assert [topo.graph.nodes[g]["numa"] for g in topo.gpus()] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert topo.graph.nodes["node0/gpu0"]["busid"] == "0000:19:00.0"
    assert topo.graph.nodes["node0/nic5"]["name"] == "mlx5_9"
    counts = sorted(d["count"] for _, v, d in topo.graph.out_edges("node0/gpu3", data=True) if d["kind"] == LinkKind.NVLINK)
    assert counts == [4, 4, 5, 5]
    p = gpu_path(topo, 0, 6)
    assert p.path_type is PathType.NVL and p.bw == pytest.approx(18 * 20.6)
    p = device_path(topo, "node0/gpu2", "node0/nic2")
    assert p.path_type is PathType.PIX and p.bw == pytest.approx(48.0)
    cpu_link = [d["bw"] for _, v, d in topo.graph.out_edges("node0/cpu0", data=True) if v == "node0/cpu1"]
    assert cpu_link == [22.0]  # Sapphire Rapids (family 6, model 143): NCCL's SRP_QPI_BW


@pytest.mark.parametrize("name", ["nccl_hgx_h100.xml", "nccl_two_hosts_a100.xml"])
def test_sample_round_trip_is_stable(name):
    first = read_topology(DATA / name)
    for host in first.hosts():
        text = to_nccl_xml(first, host)
        again = parse_nccl_xml(text, source=name, host=host if len(first.hosts()) > 1 else None)
        assert to_nccl_xml(again) == text
        if len(first.hosts()) == 1:
            assert again.to_dict()["nodes"] == first.to_dict()["nodes"]
            assert again.to_dict()["links"] == first.to_dict()["links"]
        else:
            mine = {n: d for n, d in first.graph.nodes(data=True) if d.get("host") == host}
            assert len(mine) == again.graph.number_of_nodes()
            assert _edges(again) == sorted(e for e in _edges(first) if first.host_of(e[0]) == host)


def test_two_hosts():
    topo = read_topology(DATA / "nccl_two_hosts_a100.xml")
    assert topo.hosts() == ["node0", "node1"]
    with pytest.raises(TopologyError, match="2 hosts .*choose one with --host"):
        to_nccl_xml(topo)
    with pytest.raises(TopologyError, match="unknown host 'node7'"):
        to_nccl_xml(topo, "node7")
    # Direct NVLink: four links of NCCL's SM80 20 GB/s, one way per <nvlink> element.
    p = gpu_path(topo, "node1/gpu0", "node1/gpu3")
    assert p.path_type is PathType.NVL and p.bw == pytest.approx(80.0) and p.nodes == ("node1/gpu0", "node1/gpu3")
    eth = topo.graph.nodes["node0/nic2"]
    assert eth["virtual"] and eth["speed_gbps"] == 10.0  # speed="-1" -> NCCL's 10 Gb/s
    cpu0 = ET.fromstring(to_nccl_xml(topo, "node0")).find("cpu")
    assert [net.get("name") for net in cpu0.findall("nic/net")] == ["eth0"]  # the socket NIC stays directly under <cpu>
    assert device_path(topo, "node0/gpu0", "node0/gpu2").path_type is PathType.NVL
    assert topo.graph.nodes["node0/nic1"]["busid"] == "0000:0c:00.1"


def test_broadcom_two_level_switch_is_flattened():
    def bridge(busid, sub, inner):
        return (f'<pci busid="{busid}" class="0x060400" vendor="0x1000" device="0xc030" subsystem_vendor="0x1000" '
                f'subsystem_device="{sub}" link_speed="32.0 GT/s PCIe" link_width="16">{inner}</pci>')

    gpu = '<pci busid="0000:03:00.0" class="0x030200" link_speed="32.0 GT/s PCIe" link_width="16"><gpu dev="0" sm="90"/></pci>'
    nic = ('<pci busid="0000:05:00.0" class="0x020700" link_speed="32.0 GT/s PCIe" link_width="16">'
           '<nic><net name="m" dev="0" speed="400000"/></nic></pci>')
    cpu = '<system version="1"><cpu numaid="0" arch="arm64">{}</cpu></system>'
    # Level 0 (subsystem device 0x0xxx) over two level-1 parts (0x1xxx): one switch, GPU-NIC is PIX.
    flat = parse_nccl_xml(cpu.format(bridge("0000:01:00.0", "0x0009", bridge("0000:02:00.0", "0x100b", gpu) + bridge("0000:04:00.0", "0x100b", nic))))
    assert len(flat.nodes(NodeKind.PCIE_SWITCH)) == 1
    assert device_path(flat, "node0/gpu0", "node0/nic0").path_type is PathType.PIX
    # Other ids stay a three-switch tree: PXB.
    deep = parse_nccl_xml(cpu.format(bridge("0000:01:00.0", "0x1009", bridge("0000:02:00.0", "0x100b", gpu) + bridge("0000:04:00.0", "0x100b", nic))))
    assert len(deep.nodes(NodeKind.PCIE_SWITCH)) == 3
    assert device_path(deep, "node0/gpu0", "node0/nic0").path_type is PathType.PXB


def test_nvidia_smi_to_xml_keeps_classes():
    smi = read_topology(DATA / "nvsmi_dgx_a100.txt")
    back = parse_nccl_xml(to_nccl_xml(smi))
    gpus = smi.gpus()
    for a in gpus:
        for b in gpus:
            assert gpu_path(back, a, b).path_type is gpu_path(smi, a, b).path_type
    assert _pairs(back).keys() == _pairs(smi).keys()
    assert {k: v[0] for k, v in _pairs(back).items()} == {k: v[0] for k, v in _pairs(smi).items()}


def test_export_needs_one_host_and_a_cpu():
    with pytest.raises(TopologyError, match="choose one with --host"):
        dumps(build_cluster(2), "nccl-xml")
    text = to_nccl_xml(build_cluster(2), host="node1")
    assert parse_nccl_xml(text).gpus() == [f"node0/gpu{i}" for i in range(8)]


def test_direct_nvlink_topology_exports():
    smi = parse_nvidia_smi((DATA / "nvsmi_messy_workstation.txt").read_text())
    back = parse_nccl_xml(to_nccl_xml(smi), host="ws-17")
    assert gpu_path(back, 0, 1).path_type is PathType.NVL
    assert [d["count"] for _, _, d in back.graph.out_edges("ws-17/gpu0", data=True) if d["kind"] == LinkKind.NVLINK] == [4]


# --- malformed input -------------------------------------------------------------------------

GOOD = """<system version="1">
  <cpu numaid="0" arch="x86_64" vendor="GenuineIntel" familyid="6" modelid="143">
    <pci busid="0000:1a:00.0" class="0x060400" link_speed="32.0 GT/s PCIe" link_width="16">
      <pci busid="0000:1b:00.0" class="0x030200" link_speed="32.0 GT/s PCIe" link_width="16">
        <gpu dev="0" sm="90" rank="0" gdr="1">
          <nvlink target="0000:05:00.0" count="18" tclass="0x068000"/>
        </gpu>
      </pci>
      <pci busid="0000:1c:00.0" class="0x020700" link_speed="32.0 GT/s PCIe" link_width="16">
        <nic><net name="mlx5_0" dev="0" speed="400000"/></nic>
      </pci>
    </pci>
  </cpu>
</system>
"""


def test_good_baseline_parses():
    topo = parse_nccl_xml(GOOD)
    assert device_path(topo, "node0/gpu0", "node0/nic0").path_type is PathType.PIX


@pytest.mark.parametrize(
    "text, where",
    [
        (GOOD.replace(' sm="90"', ""), '<gpu> under pci 0000:1b:00.0: missing attribute "sm"'),
        (GOOD.replace("</gpu>", "</gpux>"), "line 7: not well-formed XML"),
        (GOOD.replace("<system", "<sys").replace("</system>", "</sys>"), "<sys>: the root element must be <system>"),
        (GOOD.replace('link_speed="32.0 GT/s PCIe" link_width="16">\n        <gpu', 'link_speed="fast" link_width="16">\n        <gpu'),
         '<pci busid=0000:1b:00.0>: attribute "link_speed" \'fast\' is not a PCIe rate'),
        (GOOD.replace('tclass="0x068000"', 'tclass="0x030200"'), "<nvlink> of <gpu dev=0> (pci 0000:1b:00.0): target 0000:05:00.0 is not a GPU"),
        (GOOD.replace('busid="0000:1c:00.0"', 'busid="0000:1b:00.0"'), "<pci busid=0000:1b:00.0>: bus id 0000:1b:00.0 appears twice"),
        (GOOD.replace('vendor="GenuineIntel"', 'vendor="Acme"'), "<cpu numaid=0>: attribute \"vendor\" 'Acme' is not one NCCL knows"),
        (GOOD.replace('busid="0000:1a:00.0"', 'busid="slot 3"'), '<pci> under <cpu numaid=0>: attribute "busid" \'slot 3\' is not a PCI bus id'),
        (GOOD.replace(' dev="0" speed', ' speed'), '<net name=mlx5_0> under <pci busid=0000:1c:00.0>: missing attribute "dev"'),
        (GOOD.replace('count="18"', 'count="many"'), '<nvlink> of <gpu dev=0> (pci 0000:1b:00.0): attribute "count" must be an integer'),
        (GOOD.replace(' numaid="0"', ""), '<cpu>: missing attribute "numaid"'),
    ],
)
def test_errors_name_file_and_element(text, where):
    with pytest.raises(InputError) as exc:
        parse_nccl_xml(text, source="topo.xml")
    message = str(exc.value)
    assert message.startswith(f"topo.xml: {where}"), message
    assert "\n" not in message


def test_byte_order_mark_is_ignored():
    text = (DATA / "nccl_hgx_h100.xml").read_text()
    assert parse_nccl_xml("\ufeff" + text).to_dict() == parse_nccl_xml(text).to_dict()
