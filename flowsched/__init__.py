"""netweave.flowsched: network-aware flow scheduling for training jobs.

Modules
    :mod:`~flowsched.coflow`     cross-job coflow ordering and rates (Sincronia BSSI, Parrot LP, Geryon bands)
    :mod:`~flowsched.gradients`  gradient profiles (measured from torch, or analytic)
    :mod:`~flowsched.intrajob`   in-job plans (DDP, ByteScheduler, Prophet) and the iteration model
    :mod:`~flowsched.ddp`        :class:`GradientScheduler`, which runs an in-job plan with real all-reduces
    :mod:`~flowsched.plan`       the flow plan file (``netweave-flow-plan`` v1) and its builders
    :mod:`~flowsched.enforce`    HTB trees + DSCP filters per port, socket marks and pacing
    :mod:`~flowsched.control`    scheduler service and per-host agents over ZeroMQ with CURVE
    :mod:`~flowsched.ncclhook`   the NCCL plugin's plan file, build and profiler ring
    :mod:`~flowsched.cli`        ``netweave flow ...``; :mod:`~flowsched.demo` the ``netweave demo`` part

The plan API is re-exported here; the others are imported from their modules
(``control`` needs pyzmq, ``gradients``/``ddp`` need torch).
"""

from .plan import (
    ClassSpec,
    FlowPlan,
    FlowPlanError,
    FlowRule,
    HostPlan,
    class_table,
    plan_from_bands,
    plan_from_order,
    plan_from_parrot,
    plan_from_workload,
    read_plan,
    to_nccl_plan,
    write_plan,
)

__all__ = [
    "ClassSpec", "FlowPlan", "FlowPlanError", "FlowRule", "HostPlan", "class_table", "plan_from_bands", "plan_from_order",
    "plan_from_parrot", "plan_from_workload", "read_plan", "to_nccl_plan", "write_plan",
]
