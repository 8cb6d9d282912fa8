"""netweave.placement: HiveD cells and virtual clusters, CASSINI time shifts, launch plans, trace replay.

See ``docs/placement.md``.

>>> import topology, placement
>>> plan = placement.plan_jobs(topology.default_cluster(), [placement.JobSpec("a", 8)], policy="hived")
>>> plan["jobs"][0]["hosts"]
['node0']
"""

from .cassini import compatibility_score, rank_candidates, time_shifts, unified_perimeter
from .cells import Cell, CellTree, cell_hierarchy
from .contention import EmuSlowdown, FluidSlowdown, PlacedJob
from .hived import AllocationResult, HivedScheduler, QuotaError
from .planner import load_jobs, plan_jobs, plan_text
from .profiles import CommProfile, JobSpec, comm_profile
from .replay import POLICIES, Replay, replay
from .traces import TraceJob, read_pai, read_philly, read_trace, synthetic_trace

__all__ = [
    "POLICIES",
    "AllocationResult",
    "Cell",
    "CellTree",
    "CommProfile",
    "EmuSlowdown",
    "FluidSlowdown",
    "HivedScheduler",
    "JobSpec",
    "PlacedJob",
    "QuotaError",
    "Replay",
    "TraceJob",
    "cell_hierarchy",
    "comm_profile",
    "compatibility_score",
    "load_jobs",
    "plan_jobs",
    "plan_text",
    "rank_candidates",
    "read_pai",
    "read_philly",
    "read_trace",
    "replay",
    "synthetic_trace",
    "time_shifts",
    "unified_perimeter",
]
