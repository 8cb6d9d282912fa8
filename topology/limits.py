"""Bounds on what one input may ask for: every reader and command checks against these constants.

A small input must not be able to make netweave hang or exhaust memory (a
hostlist ``a[0-9999]b[0-9999]`` names 10^8 hosts; a quota of 2^31 cells, a model
of 10^6 layers or ``iterations: 1e9`` each ask for work without end). Each limit
is far above any real cluster or model; a value above it is rejected with an
:class:`~topology.errors.InputError` that names the field and the limit. The
constants live here, in one place, and ``docs/architecture.md`` lists them.

>>> MAX_HOSTS >= 10_000 and MAX_NAME_LENGTH >= 64
True
"""

from __future__ import annotations

#: bytes of any one input file (topology, jobs, trace, workload, model, plan, configuration)
MAX_INPUT_BYTES = 64 * 1024 * 1024
#: nesting depth of JSON/YAML documents (lists and mappings inside each other)
MAX_NESTING = 64
#: characters of a name (job, host, virtual cluster, device, switch, interface-free name)
MAX_NAME_LENGTH = 128
#: characters of a network interface name (Linux ``IFNAMSIZ`` less the NUL)
MAX_INTERFACE_LENGTH = 15
#: hosts a topology or a Slurm hostlist may name
MAX_HOSTS = 65_536
#: nodes (devices) of one topology
MAX_TOPOLOGY_NODES = 2_000_000
#: GPUs one job may ask for
MAX_JOB_GPUS = 1_048_576
#: jobs in a jobs file, a workload or a trace
MAX_JOBS = 1_000_000
#: cells of one level a virtual cluster's quota may ask for
MAX_QUOTA_CELLS = 1_048_576
#: layers of a model (analytic configuration or profile)
MAX_LAYERS = 100_000
#: iterations of a job (workload, jobs file)
MAX_ITERATIONS = 1_000_000
#: runs of phases in a workload (iterations x phases, summed over its jobs): what the simulators step through,
#: a few milliseconds each, so that a run is bounded by minutes
MAX_PHASE_RUNS = 200_000
#: pipeline stages and micro-batches
MAX_STAGES = 4_096
MAX_MICROBATCHES = 65_536
#: largest link bandwidth in GB/s (1 PB/s); every bandwidth must be finite and positive
MAX_BANDWIDTH_GBS = 1e6
#: NVLinks bonded between two GPUs (``NV#`` of ``nvidia-smi topo -m``; 18 on H100)
MAX_NVLINK_LANES = 64
#: largest NIC line rate in Gb/s
MAX_NIC_GBPS = 8e6
#: largest compute rate of a device in TFLOP/s
MAX_TFLOPS = 1e7
#: largest byte count of one transfer, gradient or tensor (1 EB)
MAX_BYTES = 1e18
#: largest duration in seconds (a compute phase, an arrival, an offset): ten years
MAX_SECONDS = 3.2e8

__all__ = [
    "MAX_BANDWIDTH_GBS",
    "MAX_BYTES",
    "MAX_HOSTS",
    "MAX_INPUT_BYTES",
    "MAX_INTERFACE_LENGTH",
    "MAX_ITERATIONS",
    "MAX_JOBS",
    "MAX_JOB_GPUS",
    "MAX_LAYERS",
    "MAX_MICROBATCHES",
    "MAX_NAME_LENGTH",
    "MAX_NESTING",
    "MAX_NIC_GBPS",
    "MAX_NVLINK_LANES",
    "MAX_PHASE_RUNS",
    "MAX_QUOTA_CELLS",
    "MAX_SECONDS",
    "MAX_STAGES",
    "MAX_TFLOPS",
    "MAX_TOPOLOGY_NODES",
]
