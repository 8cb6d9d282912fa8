"""Hardware figures used by the builders, each with its source.

All bandwidths are per direction, in GB/s (1e9 bytes/s, the unit nccl-tests
reports). Latencies are in microseconds. ``docs/topology.md`` carries the same
table for readers.

Two families of numbers exist for the same wire: the *spec sheet* rate and the
rate *NCCL assumes* in its topology search (``src/graph/topo.h``). The builders
take the spec-sheet rate by default because the flow simulator and emulator
model wires; ``nccl_model=True`` selects NCCL's figures so that cost models can
be compared with what NCCL will plan.
"""

from __future__ import annotations

# --- NVLink ------------------------------------------------------------------
# NVLink4 (H100 SXM5): 18 links per GPU, 50 GB/s bidirectional each, i.e.
# 25 GB/s per direction per link, 450 GB/s per direction per GPU
# (NVIDIA HGX H100 product brief: "900 GB/s" bidirectional per GPU).
NVLINK4_LINKS_PER_H100 = 18
NVLINK4_BW_PER_LINK = 25.0
# NVLink3 (A100 SXM4): 12 links per GPU, 25 GB/s per direction per link,
# 300 GB/s per direction per GPU (A100 datasheet: "600 GB/s" bidirectional).
NVLINK3_LINKS_PER_A100 = 12
NVLINK3_BW_PER_LINK = 25.0
# NVLink5 (B200/GB200): 18 links, 50 GB/s per direction per link, 900 GB/s per
# direction per GPU (GB200 NVL72 datasheet: "1.8 TB/s" bidirectional per GPU).
NVLINK5_LINKS_PER_B200 = 18
NVLINK5_BW_PER_LINK = 50.0

# NCCL's own per-link NVLink figures (ncclTopoNVLinkBw in src/graph/topo.h),
# keyed by SM architecture: H100 (SM90) 20.6, A100 (SM80) 20.0, B200 (SM100) 40.1.
NCCL_NVLINK_BW_PER_LINK = {60: 18.0, 70: 20.0, 80: 20.0, 86: 12.0, 90: 20.6, 100: 40.1}

# --- PCIe --------------------------------------------------------------------
# NCCL computes PCIe bandwidth as width * speed / 80 with speed in units of
# 100 Mb/s per lane (kvDictPciGen: Gen3 8 GT/s -> 60, Gen4 -> 120, Gen5 -> 240):
# Gen3 x16 = 12, Gen4 x16 = 24, Gen5 x16 = 48 GB/s.
NCCL_PCIE_SPEED = {1: 15, 2: 30, 3: 60, 4: 120, 5: 240, 6: 480}
# Spec-sheet x16 payload rates per direction (PCI-SIG: 8/16/32/64 GT/s with
# 128b/130b encoding): Gen3 15.75, Gen4 31.5, Gen5 63.0, Gen6 126 GB/s. NVIDIA
# quotes "64 GB/s" per direction for the H100's Gen5 x16 host link.
PCIE_X16_BW = {3: 15.75, 4: 31.5, 5: 63.0, 6: 126.0}
PCIE_TRANSFER_RATE_GTS = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}


def pcie_bw(gen: int, width: int = 16, *, nccl_model: bool = False) -> float:
    """Per-direction PCIe bandwidth in GB/s for a generation and lane width.

    >>> pcie_bw(5, 16, nccl_model=True)
    48.0
    >>> pcie_bw(4, 8)
    15.75
    """
    if nccl_model:
        return width * NCCL_PCIE_SPEED[gen] / 80.0
    return PCIE_X16_BW[gen] * width / 16.0


# --- CPU interconnect ----------------------------------------------------------
# NCCL's inter-socket figures (src/graph/topo.h): SKL_QPI 10, SRP_QPI 22
# (Sapphire Rapids, used in DGX H100), ERP_QPI 40, AMD 16 (AMD Rome/Milan in DGX A100).
# Grace (GB200 compute tray, two Grace CPUs): NCCL has no Grace-specific
# figure and applies its generic ARM_BW 6 to any Arm inter-socket hop; we take
# that figure because NVIDIA publishes no Grace-to-Grace rate for the tray.
CPU_INTERCONNECT_BW = {"skylake": 10.0, "sapphire-rapids": 22.0, "emerald-rapids": 40.0, "amd": 16.0, "grace": 6.0}

# --- NVLink-C2C (Grace <-> Blackwell inside a GB200 superchip) -------------------
# NVIDIA GB200 NVL72 datasheet: one Grace CPU reaches its two B200 GPUs over
# NVLink-C2C at "900 GB/s" bidirectional, i.e. 450 GB/s per direction for the
# Grace; we give each of the two GPU links half of it (225 GB/s per direction),
# so that both GPUs together cannot exceed the Grace's C2C port. NCCL calls
# such a GPU->CPU->NIC route P2C (src/include/graph.h).
NVLINK_C2C_BW_PER_GRACE = 450.0

# --- Network -------------------------------------------------------------------
# NIC bandwidth in GB/s = line rate in Gb/s / 8 (NCCL: speed_Mbps / 8000):
# ConnectX-7 NDR 400 Gb/s -> 50 GB/s; ConnectX-6 HDR 200 Gb/s -> 25 GB/s.
# Line rates per adapter (NVIDIA ConnectX product briefs): ConnectX-6 HDR
# 200 Gb/s, ConnectX-7 NDR 400 Gb/s (single port as used for GPU rails in DGX
# H100 and GB200 trays), ConnectX-8 XDR 800 Gb/s.
NIC_GBPS = {"ConnectX-6": 200.0, "ConnectX-7": 400.0, "ConnectX-8": 800.0}


def nic_bw(gbps: float) -> float:
    """Per-direction NIC bandwidth in GB/s for a line rate in Gb/s.

    >>> nic_bw(400)
    50.0
    """
    from .errors import TopologyError
    from .inputs import check_number
    from .limits import MAX_NIC_GBPS

    return check_number(gbps, what="a NIC line rate in Gb/s", where="nic_gbps", positive=True, maximum=MAX_NIC_GBPS, error=TopologyError) / 8.0


# --- Latencies (microseconds), order-of-magnitude figures -----------------------
# NVLink/NVSwitch hop ~0.7 us, PCIe switch hop ~0.5 us, inter-socket ~0.2 us
# extra, one InfiniBand switch hop ~0.13 us (NDR switch port-to-port), NIC
# injection ~1 us. These are the alpha terms of the cost models; NCCL's tuner
# uses a few microseconds of base latency per algorithm step for the same effect.
LATENCY_US = {"nvlink": 0.7, "pcie": 0.5, "cpu": 0.2, "nic": 1.0, "switch": 0.13}

# --- Network switches ----------------------------------------------------------------
# NVIDIA Quantum-2 QM9700 (the NDR leaf/spine of DGX SuperPOD H100): 64 ports
# of 400 Gb/s in 32 OSFP cages. The leaf-spine builder derives its default
# hosts per leaf from this radix (half the ports down, half up at 1:1).
SWITCH_PORTS = {"QM9700": 64}
DEFAULT_SWITCH = "QM9700"

# --- NVLink domains (GB200 NVL72) -------------------------------------------------------
# NVIDIA DGX GB200 user guide / multi-node tuning guide: a rack holds 18 1RU
# compute trays (2 Grace + 4 B200 each) and 9 NVLink switch trays with 2
# NVLink5 switch chips each, i.e. 18 chips per 72-GPU domain. Every GPU has
# 18 NVLink5 links, one to each chip (72 GPU-facing ports per chip).
NVL72_TRAYS = 18
NVL72_GPUS_PER_TRAY = 4
NVL72_CPUS_PER_TRAY = 2
NVL72_NVSWITCH_CHIPS = 18

# --- GPUs ------------------------------------------------------------------------
# Dense BF16 tensor TFLOP/s and HBM (datasheets): H100 SXM5 989 TFLOP/s, 80 GB,
# 3.35 TB/s; A100 SXM4 312 TFLOP/s, 80 GB, 2.04 TB/s; B200 (HGX B200, 1000 W)
# 2250 TFLOP/s, 180 GB, 8 TB/s; B200 in GB200 (1200 W) 2500 TFLOP/s, 186 GB
# HBM3e (GB200 NVL72 datasheet: 360 PFLOPS sparse BF16 and 13.4 TB over 72 GPUs;
# MLPerf GB200 system descriptions list 186 GB), 8 TB/s; L40S (L40S datasheet)
# 362 TFLOP/s dense BF16 (733 with sparsity), 48 GB GDDR6 at 864 GB/s, PCIe
# Gen4 x16 and no NVLink. "sm" is the compute capability NCCL keys its NVLink
# figures on (L40S is Ada, SM89; it has no NVLink, so no NCCL figure is needed).
# "pcie_gen" is the GPU's host-link generation (datasheets: A100 and L40S Gen4,
# H100 Gen5, B200 Gen6).
GPU_SPECS = {
    "H100-SXM5-80GB": {"sm": 90, "memory_gib": 80, "tflops_bf16": 989.0, "hbm_gbs": 3350.0, "pcie_gen": 5},
    "A100-SXM4-80GB": {"sm": 80, "memory_gib": 80, "tflops_bf16": 312.0, "hbm_gbs": 2039.0, "pcie_gen": 4},
    "B200-180GB": {"sm": 100, "memory_gib": 180, "tflops_bf16": 2250.0, "hbm_gbs": 8000.0, "pcie_gen": 6},
    "B200-GB200-186GB": {"sm": 100, "memory_gib": 186, "tflops_bf16": 2500.0, "hbm_gbs": 8000.0, "pcie_gen": 6},
    "L40S-48GB": {"sm": 89, "memory_gib": 48, "tflops_bf16": 362.0, "hbm_gbs": 864.0, "pcie_gen": 4},
}

# --- PCIe-only servers ---------------------------------------------------------------
# NVIDIA Enterprise Reference Architecture, PCIe-optimised "2-8-5-200" server:
# 2 CPU sockets, 8 GPUs, 5 NICs (4 east-west, 1 north-south), 200 Gb/s of
# east-west bandwidth per GPU. That is 4 PCIe Gen5 switches, each carrying two
# GPUs and one 400 Gb/s NIC; the north-south NIC is not part of the compute
# fabric and is not modelled.
PCIE_SERVER_GPUS = 8
PCIE_SERVER_GPUS_PER_SWITCH = 2
PCIE_SERVER_NICS_PER_SWITCH = 1
PCIE_SERVER_SWITCH_GEN = 5
PCIE_SERVER_NIC_GBPS = NIC_GBPS["ConnectX-7"]
