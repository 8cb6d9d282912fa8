"""The job inside the training script: :func:`init` reads the bundle's plan and starts torch.distributed; a
:class:`Job` keeps the phase and builds the data-parallel model or the pipeline the plan describes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import plan as jp
from .ddp import CommPlan, ModelMismatchError, PlannedAllReduce, planned_ddp
from .phase import PhaseClock, grid_start
from .pipeline import PipelineRun, build_pipeline, build_traced_pipeline

PLAN_ENV = "NETWEAVE_JOB_PLAN"
_INIT_ROUTE: list[tuple[Any, str | None]] = [(None, None)]   # (process group init() created, its traffic route)


class Job:
    """One rank of a planned job (made by :func:`init`)."""

    def __init__(self, plan: jp.JobPlan, *, source: str, rank: int, local_rank: int, device: Any, backend: str,
                 traffic_route: str | None):
        self.plan, self.source = plan, source
        self.rank, self.world_size, self.local_rank = rank, plan.world_size, local_rank
        self.device, self.backend = device, backend
        self.traffic_route = traffic_route    # how the job's traffic class reached the backend (None: it did not)
        self.clock: PhaseClock | None = None  # made when the first iteration is asked for (t0 agreed then)
        self.comm_plan: CommPlan | None = None
        self.hook: PlannedAllReduce | None = None   # the (first) hook this rank registered; all of them in _hooks
        self._hooks: list[PlannedAllReduce] = []

    # -- phase ----------------------------------------------------------------------------------------------
    def iterations(self, steps: int | None = None, *, tolerance: float | None = None) -> Iterator[int]:
        """Yield step numbers 0, 1, ... (``steps`` of them, or forever), each at its slot: the first after the
        job's start offset, the later ones on the plan's period (see :mod:`netweave.runtime.phase`)."""
        if self.clock is None:
            self.clock = PhaseClock(self.agree_t0(), self.plan.start_offset_s, self.plan.period_s)
        if tolerance is not None:
            self.clock.tolerance = tolerance
        k = 0
        while steps is None or k < steps:
            self.clock.wait()
            yield k
            k += 1

    def agree_t0(self) -> float:
        """The job's reference time: rank 0's clock (``time.time()``) once every rank is ready to train, broadcast.

        Taken when the training loop starts, not at the rendezvous, so that building the model and the
        stages (seconds, and different per rank) does not eat the start offset. With a period, it is rounded
        up to a multiple of ``period_s`` since the Unix epoch (:func:`netweave.runtime.phase.grid_start`), so that
        jobs started at different moments share one grid and their offsets are relative to each other.
        """
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            return grid_start(time.time(), self.plan.period_s)
        stamp = torch.zeros(1, dtype=torch.float64, device=self.device if self.backend == "nccl" else "cpu")
        dist.barrier()
        if self.rank == 0:
            stamp.fill_(grid_start(time.time(), self.plan.period_s))
        dist.broadcast(stamp, src=0)
        return float(stamp.item())

    @property
    def t0(self) -> float | None:
        return None if self.clock is None else self.clock.t0

    def timing(self) -> dict[str, Any]:
        """t0, the plan's offset and period, each iteration's measured start (s after t0), slots and re-anchors."""
        return {} if self.clock is None else self.clock.summary()

    # -- data parallel --------------------------------------------------------------------------------------
    def data_parallel(self, model: Any, **ddp_kwargs: Any) -> Any:
        """``model`` on this rank's device in ``DistributedDataParallel``, with the plan's communication hook.

        The plan is made on rank 0 from its model's trainable parameters and the bundle's ``data_parallel``
        knobs, and broadcast; every rank checks its parameters against rank 0's first, and a difference is a
        :class:`ModelMismatchError` on every rank. Keyword arguments go to DDP.
        """
        if self.plan.pipeline is not None:
            raise ModelMismatchError("the plan is a pipeline: use job.pipeline(...)", source=self.source, where="pipeline")
        if self.plan.parallelism.tp != 1:
            raise ModelMismatchError(f"this runtime has no tensor parallelism, the plan has tp={self.plan.parallelism.tp}", source=self.source,
                                     where="parallelism.tp")
        ddp, self.comm_plan, self.hook = planned_ddp(model.to(self.device), self.plan.data_parallel, device=self.device,
                                                     backend=self.backend, source=self.source, **ddp_kwargs)
        self._hooks.append(self.hook)
        return ddp

    # -- pipeline parallel ----------------------------------------------------------------------------------
    def pipeline(self, model: Any, loss_fn: Any, *, example_args: tuple | None = None, example_kwargs: dict[str, Any] | None = None,
                 constants: dict[str, Any] | None = None, split: list[str] | None = None) -> PipelineRun:
        """This rank's stages of the plan's pipeline, with their recomputation, under the plan's schedule.

        ``model`` is the list of blocks the plan's ``layers`` index (list, ``nn.ModuleList``, ``nn.Sequential``)
        or a model whose submodules the plan's ``modules`` name. Build it identically on every rank (same seed).

        With ``example_args`` (one micro-batch of the first stage's inputs) the model is traced and split by torch
        instead (any ``nn.Module``: extra arguments, tied weights): ``example_kwargs`` the first stage's keyword
        inputs, ``constants`` keyword arguments shared by every micro-batch and stage (an attention mask),
        ``split`` the submodules that begin layers 1, 2, ... (see :func:`netweave.runtime.pipeline.build_traced_pipeline`).
        """
        plan_dir = Path(self.source).parent if self.source != "<plan>" else None
        if example_args is not None:
            return build_traced_pipeline(self.plan, model, loss_fn, example_args=example_args, example_kwargs=example_kwargs,
                                         constants=constants, split=split, rank=self.rank, device=self.device, source=self.source,
                                         plan_dir=plan_dir)
        run = build_pipeline(self.plan, model, loss_fn, rank=self.rank, device=self.device, backend=self.backend, source=self.source,
                             plan_dir=plan_dir)
        if run.ddp:
            self.comm_plan, self.hook = run.ddp[0][1], run.ddp[0][2]
            self._hooks += [h for _, _, h in run.ddp]
        return run

    def close(self) -> None:
        """Stop the hook's thread and leave the process group."""
        import torch.distributed as dist

        for hook in self._hooks:
            hook.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    if v is None:
        return None
    try:
        return int(v)
    except ValueError:
        raise jp.PlanFormatError(f"expected an integer, got {v!r}", source="environment", where=name) from None


def init(plan: str | os.PathLike[str] | jp.JobPlan | None = None, *, device: Any = None, timeout_s: float = 600.0) -> Job:
    """Read the job plan (``plan``, default ``$NETWEAVE_JOB_PLAN``), start torch.distributed as the plan says.

    Rank, world size, local rank and node come from torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``GROUP_RANK``, ``MASTER_ADDR``/``MASTER_PORT``; the plan's rendezvous where those are unset)
    and must agree with the plan. The device is ``cuda:LOCAL_RANK`` where CUDA is available (backend nccl), else the CPU
    (gloo). On NCCL the job's ``traffic.traffic_class`` goes into the communicator's ``traffic_class`` where this
    torch exposes it (otherwise ``NCCL_IB_TC`` from the launch script carries it); gloo has no such knob (the
    launch script's socket marker does). An already-initialised process group is used as it is.
    """
    import datetime

    import torch
    import torch.distributed as dist

    if isinstance(plan, jp.JobPlan):
        job_plan, source = plan, "<plan>"
    else:
        path = plan if plan is not None else os.environ.get(PLAN_ENV)
        if not path:
            raise jp.PlanFormatError(f"no job plan: pass its path to init() or set {PLAN_ENV} (the launch scripts do)",
                                     source="environment", where=PLAN_ENV)
        job_plan, source = jp.load(path), str(path)
    rank = _env_int("RANK")
    world = _env_int("WORLD_SIZE")
    local_rank = _env_int("LOCAL_RANK")
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    if world is None:
        world, rank = 1, 0
    if world != job_plan.world_size:
        raise jp.PlanFormatError(f"torchrun started {world} ranks (WORLD_SIZE), the plan has {job_plan.world_size}", source=source,
                                 where="world_size")
    if rank is None or not 0 <= rank < world:
        raise jp.PlanFormatError(f"RANK {rank} is not in 0..{world - 1}", source="environment", where="RANK")
    planned = job_plan.ranks[rank]
    local_rank = planned.local_rank if local_rank is None else local_rank
    node = _env_int("GROUP_RANK")   # torchrun's node rank
    host = next(h for h in job_plan.hosts if h.host == planned.host)
    if node is not None and node != host.node_rank:
        raise jp.PlanFormatError(f"rank {rank} runs on torchrun node {node} (GROUP_RANK), the plan puts it on {host.host}, node "
                                 f"{host.node_rank}", source=source, where=f"ranks[{rank}].host")
    if local_rank != planned.local_rank:
        raise jp.PlanFormatError(f"rank {rank} runs as LOCAL_RANK {local_rank}, the plan puts it at local rank {planned.local_rank} "
                                 f"on {planned.host}", source=source, where=f"ranks[{rank}].local_rank")
    if device is None:
        device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    route = None
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", job_plan.rendezvous.addr)
        os.environ.setdefault("MASTER_PORT", str(job_plan.rendezvous.port))
        options = None
        tc = job_plan.traffic.traffic_class
        if backend == "nccl" and tc is not None:
            options = dist.ProcessGroupNCCL.Options()
            if hasattr(options.config, "traffic_class"):
                options.config.traffic_class = tc
                route = "ncclConfig_t.trafficClass"
            else:
                options = None
                route = "NCCL_IB_TC" if "NCCL_IB_TC" in os.environ else None
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s),
                                pg_options=options, device_id=device if backend == "nccl" else None)
        _INIT_ROUTE[0] = (dist.group.WORLD, route)
    else:
        if dist.get_backend() != backend:
            backend = dist.get_backend()
        # a later init() in the same process (another plan, the same process group): the class reached the communicator
        # when the first init() created it (found by the GPU check: three plans in one process, the later two said None)
        group, first_route = _INIT_ROUTE[0]
        if group is dist.group.WORLD:
            route = first_route
    return Job(job_plan, source=source, rank=rank, local_rank=local_rank, device=device, backend=backend, traffic_route=route)
