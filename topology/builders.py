"""Builders for servers (nodes): DGX/HGX H100 and A100, PCIe-only servers, GB200 NVL72 trays.

A node builder adds one server's devices and internal links to a
:class:`~topology.model.Topology` and returns the ids of its NICs, in rail
order, so that a fabric builder (:mod:`topology.fabrics`) can cable them.

Most servers are their own NVLink domain (or have none). A GB200 NVL72 compute
tray is a host whose GPUs share a *rack-wide* NVLink domain with 17 other trays
through 18 NVSwitch chips that belong to no host. Such kinds are listed in
:data:`NVLINK_DOMAIN_HOSTS`; :func:`add_hosts` (used by ``build_cluster``)
groups consecutive hosts of such a kind into domains ``rack0``, ``rack1``, ...

Numbers come from :mod:`topology.hardware`, where each has its source.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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


def add_pcie_server(
    topo: Topology,
    host: str,
    *,
    gpus: int = hw.PCIE_SERVER_GPUS,
    model: str = "L40S-48GB",
    gpus_per_switch: int = hw.PCIE_SERVER_GPUS_PER_SWITCH,
    nics_per_switch: int = hw.PCIE_SERVER_NICS_PER_SWITCH,
    pcie_gen: int = hw.PCIE_SERVER_SWITCH_GEN,
    nic_gbps: float = hw.PCIE_SERVER_NIC_GBPS,
    sockets: int = 2,
    cpu_arch: str = "sapphire-rapids",
    nccl_model: bool = False,
) -> list[str]:
    """Add one PCIe-only GPU server (no NVLink): GPUs and NICs on PCIe switches under the CPU sockets.

    The default is NVIDIA's PCIe-optimised "2-8-5-200" reference server: 8 L40S
    on 4 PCIe Gen5 switches (2 GPUs and one 400 Gb/s ConnectX-7 per switch),
    switches 0-1 under CPU 0 and 2-3 under CPU 1. A GPU's link to its switch
    runs at the lower of the switch's and the GPU's PCIe generation (L40S:
    Gen4). GPU peer traffic goes through the switch (PIX) or the CPUs (PHB/SYS).

    >>> t = Topology(); nics = add_pcie_server(t, "n0")
    >>> len(t.gpus()), len(nics), len(t.nodes("pcie_switch")), len(list(t.links("nvlink")))
    (8, 4, 4, 0)
    """
    spec = _gpu_spec(model)
    if gpus < 1 or gpus_per_switch < 1 or gpus % gpus_per_switch:
        raise TopologyError(f"pcie-server: gpus ({gpus}) must be a positive multiple of gpus_per_switch ({gpus_per_switch})")
    if nics_per_switch < 0:
        raise TopologyError(f"pcie-server: nics_per_switch must be >= 0, got {nics_per_switch}")
    if pcie_gen not in hw.PCIE_X16_BW:
        raise TopologyError(f"pcie-server: pcie_gen must be one of {sorted(hw.PCIE_X16_BW)}, got {pcie_gen!r}")
    if cpu_arch not in hw.CPU_INTERCONNECT_BW:
        raise TopologyError(f"pcie-server: cpu_arch must be one of {sorted(hw.CPU_INTERCONNECT_BW)}, got {cpu_arch!r}")
    switches = gpus // gpus_per_switch
    if sockets < 1 or sockets > switches:
        raise TopologyError(f"pcie-server: sockets must be between 1 and the number of PCIe switches ({switches}), got {sockets}")
    switch_bw = hw.pcie_bw(pcie_gen, 16, nccl_model=nccl_model)
    gpu_bw = hw.pcie_bw(min(pcie_gen, spec["pcie_gen"]), 16, nccl_model=nccl_model)
    latency = hw.LATENCY_US["pcie"]
    cpus = _add_cpus(topo, host, sockets, LinkRates(0.0, switch_bw, hw.CPU_INTERCONNECT_BW[cpu_arch], 0.0), cpu_arch)
    nics: list[str] = []
    for s in range(switches):
        numa = s * sockets // switches
        sw = topo.add_node(f"{host}/pcie{s}", NodeKind.PCIE_SWITCH, host=host, index=s, numa=numa)
        topo.add_link(sw, cpus[numa], LinkKind.PCIE, switch_bw, latency_us=latency, gen=pcie_gen)
        for k in range(gpus_per_switch):
            i = s * gpus_per_switch + k
            g = topo.add_node(
                f"{host}/gpu{i}", NodeKind.GPU, host=host, index=i, model=model, numa=numa,
                memory_gib=spec["memory_gib"], tflops=spec["tflops_bf16"],
            )
            topo.add_link(g, sw, LinkKind.PCIE, gpu_bw, latency_us=latency, gen=min(pcie_gen, spec["pcie_gen"]))
        for _ in range(nics_per_switch):
            i = len(nics)
            nic = topo.add_node(f"{host}/nic{i}", NodeKind.NIC, host=host, index=i, rail=i, numa=numa, name=f"mlx5_{i}", speed_gbps=nic_gbps)
            topo.add_link(nic, sw, LinkKind.PCIE, switch_bw, latency_us=latency, gen=pcie_gen)
            nics.append(nic)
    return nics


def add_gb200_nvl72_tray(
    topo: Topology,
    host: str,
    *,
    domain: str = "rack0",
    nic_gbps: float = hw.NIC_GBPS["ConnectX-7"],
    nccl_model: bool = False,
    model: str = "B200-GB200-186GB",
) -> list[str]:
    """Add one GB200 NVL72 compute tray to the NVLink domain ``domain`` (a rack).

    A tray is a host with 2 Grace CPUs and 4 B200 GPUs (two GB200 superchips):
    GPUs 0-1 reach Grace 0 and GPUs 2-3 Grace 1 over NVLink-C2C (modelled as
    the GPUs' host link: kind ``pcie`` with ``c2c=True``, since the model has no
    C2C link kind), and one 400 Gb/s ConnectX-7 per GPU (rail *i*) hangs off the
    Grace of its GPU on PCIe Gen5 x16, so GPU -> NIC is NCCL's P2C path. Every
    GPU has 18 NVLink5 links, one to each of the domain's 18 NVSwitch chips
    ``<domain>/nvs0..17``; the chips belong to no host (``host=None``) and are
    created by the first tray of the domain. A domain takes at most 18 trays
    (72 GPUs); fewer trays make a partly populated rack, which still has all 18
    chips (GB200 NVL36 is 9 trays with 18 chips).

    ``nccl_model=True`` takes NCCL's NVLink (SM100: 40.1 GB/s per link) and
    PCIe figures; the C2C and Grace-Grace rates are the same in both models.

    >>> t = Topology(); nics = [add_gb200_nvl72_tray(t, f"n{i}") for i in range(2)]
    >>> len(t.gpus()), len(t.nodes("nvswitch")), t.graph.nodes["rack0/nvs0"]["host"]
    (8, 18, None)
    """
    spec = _gpu_spec(model)
    nvl_bw = hw.NCCL_NVLINK_BW_PER_LINK[spec["sm"]] if nccl_model else hw.NVLINK5_BW_PER_LINK
    pcie_bw = hw.pcie_bw(5, 16, nccl_model=nccl_model)
    c2c_bw = hw.NVLINK_C2C_BW_PER_GRACE / 2
    chips = [f"{domain}/nvs{j}" for j in range(hw.NVL72_NVSWITCH_CHIPS)]
    if chips[0] not in topo.graph:
        for j, chip in enumerate(chips):
            topo.add_node(chip, NodeKind.NVSWITCH, host=None, index=j, domain=domain, model="NVLink5-switch")
    elif topo.graph.nodes[chips[0]].get("domain") != domain:
        raise TopologyError(f"gb200 tray {host}: node {chips[0]!r} exists but is not an NVSwitch of domain {domain!r}")
    members = topo.graph.out_degree(chips[0])  # one link from chip 0 to every GPU of the domain
    capacity = hw.NVL72_TRAYS * hw.NVL72_GPUS_PER_TRAY
    if members + hw.NVL72_GPUS_PER_TRAY > capacity:
        raise TopologyError(f"gb200 tray {host}: NVLink domain {domain!r} is full ({capacity} GPUs = {hw.NVL72_TRAYS} trays)")
    cpus = _add_cpus(topo, host, hw.NVL72_CPUS_PER_TRAY, LinkRates(0.0, pcie_bw, hw.CPU_INTERCONNECT_BW["grace"], 0.0), "grace")
    per_cpu = hw.NVL72_GPUS_PER_TRAY // hw.NVL72_CPUS_PER_TRAY
    nics = []
    for i in range(hw.NVL72_GPUS_PER_TRAY):
        numa = i // per_cpu
        g = topo.add_node(
            f"{host}/gpu{i}", NodeKind.GPU, host=host, index=i, model=model, numa=numa, domain=domain,
            memory_gib=spec["memory_gib"], tflops=spec["tflops_bf16"],
        )
        topo.add_link(g, cpus[numa], LinkKind.PCIE, c2c_bw, latency_us=hw.LATENCY_US["pcie"], c2c=True)
        for chip in chips:
            topo.add_link(g, chip, LinkKind.NVLINK, nvl_bw, latency_us=hw.LATENCY_US["nvlink"] / 2, count=1)
        nic = topo.add_node(f"{host}/nic{i}", NodeKind.NIC, host=host, index=i, rail=i, numa=numa, name=f"mlx5_{i}", speed_gbps=nic_gbps)
        topo.add_link(nic, cpus[numa], LinkKind.PCIE, pcie_bw, latency_us=hw.LATENCY_US["pcie"], gen=5)
        nics.append(nic)
    return nics


def _gpu_spec(model: str) -> dict:
    try:
        return hw.GPU_SPECS[model]
    except KeyError:
        raise TopologyError(f"unknown GPU model {model!r}; expected one of {', '.join(sorted(hw.GPU_SPECS))}") from None


NodeBuilder = Callable[..., list[str]]

NODE_BUILDERS: dict[str, NodeBuilder] = {
    "dgx-h100": add_dgx_h100,
    "hgx-h100": add_dgx_h100,
    "dgx-a100": add_dgx_a100,
    "hgx-a100": add_dgx_a100,
    "pcie-server": add_pcie_server,
    "gb200-nvl72": add_gb200_nvl72_tray,
}

# Node kinds whose hosts share a multi-host NVLink domain, with the number of
# hosts per domain: add_hosts passes ``domain=rack<r>`` to their builder.
NVLINK_DOMAIN_HOSTS: dict[str, int] = {"gb200-nvl72": hw.NVL72_TRAYS}


def node_builder(kind: str) -> NodeBuilder:
    """The node builder registered under ``kind`` (see ``NODE_BUILDERS``)."""
    try:
        return NODE_BUILDERS[kind]
    except KeyError:
        raise TopologyError(f"unknown node kind {kind!r}; expected one of {', '.join(sorted(NODE_BUILDERS))}") from None


def add_hosts(topo: Topology, kind: str, count: int, *, prefix: str = "node", **options: Any) -> list[list[str]]:
    """Add ``count`` servers of ``kind`` named ``<prefix>0..`` (zero-padded) and return their NIC lists.

    For a kind in :data:`NVLINK_DOMAIN_HOSTS`, hosts ``r*size .. r*size+size-1``
    form NVLink domain ``rack<r>`` (the last one may be partly populated).

    >>> t = Topology(); nics = add_hosts(t, "gb200-nvl72", 20)
    >>> len(nics), sorted({t.graph.nodes[g]["domain"] for g in t.gpus()})
    (20, ['rack0', 'rack1'])
    """
    if count < 1:
        raise TopologyError(f"nodes must be >= 1, got {count}")
    build = node_builder(kind)
    width = len(str(count - 1))
    per_domain = NVLINK_DOMAIN_HOSTS.get(kind)
    if per_domain and "domain" in options:
        raise TopologyError(f"{kind}: hosts are grouped into NVLink domains rack0, rack1, ... automatically; do not pass 'domain'")
    out = []
    for i in range(count):
        extra = {"domain": f"rack{i // per_domain}"} if per_domain else {}
        out.append(build(topo, f"{prefix}{i:0{width}d}", **options, **extra))
    return out


def build_node(kind: str = "dgx-h100", host: str | None = None, **options: Any) -> Topology:
    """A topology holding one server of ``kind`` (no network fabric).

    For a multi-host NVLink kind (``gb200-nvl72``) it holds one whole NVLink
    domain instead: a rack of 18 trays ``node00..node17`` (``host`` must be left
    out). Options go to the node builder.

    >>> build_node("dgx-h100").summary()["gpus"]
    8
    >>> build_node("gb200-nvl72").summary()["gpus"]
    72
    """
    topo = Topology(f"{kind}-node", builder={"kind": "node", "node": kind, **options})
    per_domain = NVLINK_DOMAIN_HOSTS.get(kind)
    if per_domain:
        if host is not None:
            raise TopologyError(f"{kind}: build_node builds a whole NVLink domain of {per_domain} hosts with generated names; do not pass host")
        add_hosts(topo, kind, per_domain, **options)
    else:
        node_builder(kind)(topo, host or "node0", **options)
    return topo
