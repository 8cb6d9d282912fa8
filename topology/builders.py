"""Builders for servers (nodes): DGX/HGX H100 and A100, PCIe-only servers, NVL72 trays.

A node builder adds one server's devices and internal links to a
:class:`~topology.model.Topology` and returns the ids of its NICs, in rail
order, so that a fabric builder (:mod:`topology.fabrics`) can cable them.

Numbers come from :mod:`topology.hardware`, where each has its source.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import hardware as hw
from .errors import TopologyError
from .model import LinkKind, NodeKind, Topology


@dataclass(frozen=True)
class LinkRates:
    """Per-direction rates (GB/s) for one node type, spec-sheet or NCCL-model."""

    nvlink_per_link: float
    pcie: float
    cpu: float
    nic: float


def _rates(nvlink_spec: float, sm: int, pcie_gen: int, cpu: str, nic_gbps: float, nccl_model: bool) -> LinkRates:
    return LinkRates(
        nvlink_per_link=hw.NCCL_NVLINK_BW_PER_LINK[sm] if nccl_model else nvlink_spec,
        pcie=hw.pcie_bw(pcie_gen, 16, nccl_model=nccl_model),
        cpu=hw.CPU_INTERCONNECT_BW[cpu],
        nic=hw.nic_bw(nic_gbps),
    )


def _add_cpus(topo: Topology, host: str, sockets: int, rates: LinkRates, arch: str) -> list[str]:
    cpus = [topo.add_node(f"{host}/cpu{s}", NodeKind.CPU, host=host, numa=s, arch=arch) for s in range(sockets)]
    for a in range(sockets):
        for b in range(a + 1, sockets):
            topo.add_link(cpus[a], cpus[b], LinkKind.CPU, rates.cpu, latency_us=hw.LATENCY_US["cpu"])
    return cpus


def add_dgx_h100(topo: Topology, host: str, *, nic_gbps: float = 400, nccl_model: bool = False, model: str = "H100-SXM5-80GB") -> list[str]:
    """Add one DGX/HGX H100: 8 GPUs, 4 NVSwitches, 8 PCIe Gen5 switches, 2 NUMA nodes, 8 NICs.

    Each GPU reaches the four NVSwitches with 5, 5, 4 and 4 NVLink4 links (18 in
    all, as in NCCL topology dumps of HGX H100). GPU *i* shares a PCIe Gen5
    switch with ConnectX-7 NIC *i* (rail *i*); GPUs 0-3 hang off CPU 0 and 4-7
    off CPU 1 (DGX H100 user guide). NIC names follow the guide's Table 6.

    >>> t = Topology(); nics = add_dgx_h100(t, "n0")
    >>> len(t.gpus()), len(nics), len(t.nodes("nvswitch"))
    (8, 8, 4)
    """
    spec = hw.GPU_SPECS[model]
    rates = _rates(hw.NVLINK4_BW_PER_LINK, spec["sm"], 5, "sapphire-rapids", nic_gbps, nccl_model)
    return _add_nvswitch_node(
        topo, host, model=model, gpus=8, nvswitch_lanes=(5, 5, 4, 4), rates=rates, gpus_per_pcie_switch=1,
        nics_per_pcie_switch=1, cpu_arch="sapphire-rapids", nic_gbps=nic_gbps,
        nic_names=("mlx5_0", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_9", "mlx5_10", "mlx5_11"),
    )


def add_dgx_a100(topo: Topology, host: str, *, nic_gbps: float = 200, nccl_model: bool = False, model: str = "A100-SXM4-80GB") -> list[str]:
    """Add one DGX/HGX A100: 8 GPUs, 6 NVSwitches (2 NVLink3 links each), 4 PCIe Gen4 switches.

    Each PCIe switch carries two GPUs and two ConnectX-6 200 Gb/s NICs (DGX A100
    user guide); two AMD sockets.

    >>> t = Topology(); nics = add_dgx_a100(t, "n0")
    >>> len(t.gpus()), len(nics), len(t.nodes("nvswitch")), len(t.nodes("pcie_switch"))
    (8, 8, 6, 4)
    """
    spec = hw.GPU_SPECS[model]
    rates = _rates(hw.NVLINK3_BW_PER_LINK, spec["sm"], 4, "amd", nic_gbps, nccl_model)
    return _add_nvswitch_node(
        topo, host, model=model, gpus=8, nvswitch_lanes=(2,) * 6, rates=rates, gpus_per_pcie_switch=2,
        nics_per_pcie_switch=2, cpu_arch="amd", nic_gbps=nic_gbps,
        nic_names=tuple(f"mlx5_{i}" for i in range(8)),
    )


def _add_nvswitch_node(
    topo: Topology,
    host: str,
    *,
    model: str,
    gpus: int,
    nvswitch_lanes: tuple[int, ...],
    rates: LinkRates,
    gpus_per_pcie_switch: int,
    nics_per_pcie_switch: int,
    cpu_arch: str,
    nic_gbps: float,
    nic_names: tuple[str, ...],
) -> list[str]:
    spec = hw.GPU_SPECS[model]
    cpus = _add_cpus(topo, host, 2, rates, cpu_arch)
    nvs = [topo.add_node(f"{host}/nvs{j}", NodeKind.NVSWITCH, host=host, index=j, domain=host) for j in range(len(nvswitch_lanes))]
    switches = gpus // gpus_per_pcie_switch
    pcie = []
    for s in range(switches):
        numa = s * 2 // switches
        sw = topo.add_node(f"{host}/pcie{s}", NodeKind.PCIE_SWITCH, host=host, index=s, numa=numa)
        topo.add_link(sw, cpus[numa], LinkKind.PCIE, rates.pcie, latency_us=hw.LATENCY_US["pcie"])
        pcie.append(sw)
    for i in range(gpus):
        numa = i * 2 // gpus
        g = topo.add_node(
            f"{host}/gpu{i}", NodeKind.GPU, host=host, index=i, model=model, numa=numa, domain=host,
            memory_gib=spec["memory_gib"], tflops=spec["tflops_bf16"],
        )
        for j, lanes in enumerate(nvswitch_lanes):
            topo.add_link(g, nvs[j], LinkKind.NVLINK, lanes * rates.nvlink_per_link, latency_us=hw.LATENCY_US["nvlink"] / 2, count=lanes)
        topo.add_link(g, pcie[i // gpus_per_pcie_switch], LinkKind.PCIE, rates.pcie, latency_us=hw.LATENCY_US["pcie"])
    nics = []
    for i in range(switches * nics_per_pcie_switch):
        sw = pcie[i // nics_per_pcie_switch]
        nic = topo.add_node(
            f"{host}/nic{i}", NodeKind.NIC, host=host, index=i, rail=i, numa=topo.graph.nodes[sw]["numa"],
            name=nic_names[i], speed_gbps=nic_gbps,
        )
        topo.add_link(nic, sw, LinkKind.PCIE, rates.pcie, latency_us=hw.LATENCY_US["pcie"])
        nics.append(nic)
    return nics


NodeBuilder = Callable[..., list[str]]

NODE_BUILDERS: dict[str, NodeBuilder] = {
    "dgx-h100": add_dgx_h100,
    "hgx-h100": add_dgx_h100,
    "dgx-a100": add_dgx_a100,
    "hgx-a100": add_dgx_a100,
}


def node_builder(kind: str) -> NodeBuilder:
    """The node builder registered under ``kind`` (see ``NODE_BUILDERS``)."""
    try:
        return NODE_BUILDERS[kind]
    except KeyError:
        raise TopologyError(f"unknown node kind {kind!r}; expected one of {', '.join(sorted(NODE_BUILDERS))}") from None


def build_node(kind: str = "dgx-h100", host: str = "node0", **options) -> Topology:
    """A topology holding one server of ``kind``.

    >>> build_node("dgx-h100").summary()["gpus"]
    8
    """
    topo = Topology(f"{kind}-node", builder={"kind": "node", "node": kind, **options})
    node_builder(kind)(topo, host, **options)
    return topo
