"""netweave.pipesched: the pipeline planner.

Profiles (measured or analytic) -> partition (PipeDream DP with AdaPipe recomputation, links from the
Topology) -> schedule (GPipe, 1F1B, interleaved 1F1B, ZB-H1, interleaved zero bubble, looped BFS, ZB-V, DualPipe-V,
Chimera as per-rank action lists) -> event-driven
simulation with memory and lower bounds -> export to torch.distributed.pipelining and real runs.
See ``docs/pipesched.md``.

>>> import topology, pipesched
>>> prof = pipesched.analytic_profile(pipesched.GPTConfig(layers=8, hidden=1024, heads=16, seq_len=1024, vocab=32000))
>>> devs, links = pipesched.devices_from_topology(topology.default_cluster(), count=4)
>>> p = pipesched.plan(prof, devs, links, microbatches=8, schedule="1f1b")
>>> p.sim.makespan >= p.bound["bound_s"]
True
"""

from .devices import Device, LinkModel, devices_from_topology
from .export import TORCH_CLASSES, export_plan, schedule_csv, torch_schedule_class, write_torch_csv
from .partition import Partition, PlanError, partition, uniform_partition
from .plan import Plan, plan, plan_partition, uniform_plan
from .profile import GPTConfig, LayerProfile, ModelProfile, analytic_profile, load_profile, measure_profile, save_profile
from .schedules import (
    Action,
    Schedule,
    chimera,
    dualpipev,
    gpipe,
    interleaved_1f1b,
    interleaved_zb,
    looped_bfs,
    make_schedule,
    one_f_one_b,
    validate,
    zb_h1,
    zbv,
)
from .simulate import StageCost, gantt_png, lower_bound, simulate, write_chrome_trace

__all__ = [
    "TORCH_CLASSES", "Action", "Device", "GPTConfig", "LayerProfile", "LinkModel", "ModelProfile", "Partition", "Plan", "PlanError",
    "Schedule", "StageCost", "analytic_profile", "chimera", "devices_from_topology", "dualpipev", "export_plan", "gantt_png", "gpipe",
    "interleaved_1f1b", "interleaved_zb", "load_profile", "looped_bfs", "lower_bound", "make_schedule", "measure_profile", "one_f_one_b",
    "partition", "plan", "plan_partition", "save_profile", "schedule_csv", "simulate", "torch_schedule_class", "uniform_partition",
    "uniform_plan", "validate", "write_chrome_trace", "write_torch_csv", "zb_h1", "zbv",
]
