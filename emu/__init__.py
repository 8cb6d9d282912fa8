"""netweave.emu: the validation substrate.

- :mod:`emu.workload`: the workload description (jobs, phases, dependencies), YAML/JSON;
- :mod:`emu.results`: the result type every backend returns, and backend comparison;
- :mod:`emu.sim`: the flow-level discrete-event simulator (max-min fair sharing);
- the Mininet emulator backend (``emu.mininet_backend``) and the ns-3 packet-level backend (``emu.ns3_backend``),
  imported lazily;
- :mod:`emu.sweep`: parameter sweeps on a local process pool or on Ray.

>>> from emu import Job, Workload
>>> Workload("w", [Job.data_parallel("a", ["node0/gpu0", "node1/gpu0"], compute_s=0.01, nbytes=1e8)]).jobs[0].name
'a'
"""

from .results import FlowRecord, JobResult, LinkUtilisation, PhaseRecord, RunResult, compare_results
from .sim import SimConfig, simulate
from .workload import (
    CollectivePhase,
    ComputePhase,
    Job,
    P2PPhase,
    Transfer,
    Workload,
    WorkloadError,
    read_workload,
    write_workload,
)

__all__ = [
    "CollectivePhase",
    "ComputePhase",
    "FlowRecord",
    "Job",
    "JobResult",
    "LinkUtilisation",
    "P2PPhase",
    "PhaseRecord",
    "RunResult",
    "SimConfig",
    "Transfer",
    "Workload",
    "WorkloadError",
    "compare_results",
    "read_workload",
    "simulate",
    "write_workload",
]
