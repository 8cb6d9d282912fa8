"""Pipeline parallel: this rank's stages from the plan, their recomputation, and torch's schedule that runs them.

Stages come from the plan's ``pipeline.stages``: from ``layers`` ranges over a list of blocks the
user passes (a list, ``nn.ModuleList`` or ``nn.Sequential``; each block takes and returns one
tensor), or from ``modules`` names resolved in a model (``model.get_submodule``). Each stage is
the ``nn.Sequential`` of its blocks, in a ``torch.distributed.pipelining.PipelineStage``.

Recomputation (torch's activation checkpointing, non-reentrant) per stage:

- ``full``: every block of the stage is checkpointed (its activations are recomputed in backward);
- ``selective``: the attention modules (``nn.MultiheadAttention``) inside the stage's blocks are
  checkpointed, as Megatron's selective recomputation does (attention's activations are large for
  the FLOPs it takes to recompute them); a block without an attention module is checkpointed whole
  if it is an even-numbered block of the stage (every other block), so selective recomputation of a
  plain MLP stage still halves its saved activations;
- ``none``: nothing.

Parameter names do not change (the forward of the module is wrapped in place).

The schedule: torch's public class when ``pipeline.torch_class`` names one (``Schedule1F1B``,
``ScheduleGPipe``, ``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``,
``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``), otherwise
torch's ``_PipelineScheduleRuntime`` loading ``pipeline.actions_csv`` (compute_only CSV: the text
itself, or a file name relative to the plan's directory).
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import Any

from .ddp import ModelMismatchError, planned_ddp
from .plan import JobPlan, Stage

TORCH_CLASSES = ("Schedule1F1B", "ScheduleGPipe", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble",
                 "ScheduleZBVZeroBubble", "ScheduleDualPipeV")


def checkpointed(module: Any) -> Any:
    """Wrap ``module``'s forward in torch's activation checkpointing (in place; idempotent); returns the module."""
    from torch.utils.checkpoint import checkpoint

    if not getattr(module, "_netweave_recompute", False):
        module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False)
        module._netweave_recompute = True
    return module


def apply_recompute(blocks: list[Any], mode: str) -> list[Any]:
    """Apply a stage's recomputation (``none`` | ``selective`` | ``full``) to its blocks; returns the modules checkpointed."""
    import torch.nn as nn

    done: list[Any] = []
    if mode == "full":
        done = [checkpointed(b) for b in blocks]
    elif mode == "selective":
        for k, b in enumerate(blocks):
            attention = [m for m in b.modules() if isinstance(m, nn.MultiheadAttention)]
            if attention:
                done += [checkpointed(m) for m in attention]
            elif k % 2 == 0:
                done.append(checkpointed(b))
    elif mode != "none":
        raise ValueError(f"unknown recompute mode {mode!r}")
    return done


def stage_blocks(plan: JobPlan, model: Any, stage: Stage, source: str) -> list[Any]:
    """The blocks of one stage of the plan, from ``model`` (a list of blocks, or a model with named submodules)."""
    import torch.nn as nn

    pl = plan.pipeline
    assert pl is not None
    where = f"pipeline.stages[{stage.index}]"
    if isinstance(model, list | tuple | nn.ModuleList | nn.Sequential):
        blocks = list(model)
        want = pl.stages[-1].layers[1]
        if len(blocks) != want:
            raise ModelMismatchError(f"the plan splits {want} layers, the model passed has {len(blocks)} blocks", source=source,
                                     where="pipeline.stages")
        lo, hi = stage.layers
        return blocks[lo:hi]
    if not stage.modules:
        raise ModelMismatchError("the plan names no modules for this stage; pass the model's list of blocks instead", source=source,
                                 where=f"{where}.modules")
    out = []
    for j, name in enumerate(stage.modules):
        try:
            out.append(model.get_submodule(name))
        except AttributeError:
            raise ModelMismatchError(f"the model has no submodule {name!r}", source=source, where=f"{where}.modules[{j}]") from None
    return out


class PipelineRun:
    """This rank's part of a pipeline: its stages, the schedule, and one training step at a time."""

    def __init__(self, stages: list[Any], schedule: Any, recomputed: dict[int, list[str]], *, replica: int = 0,
                 pipeline_rank: int = 0, ddp: list[tuple[Any, Any, Any]] | None = None):
        self.stages, self.schedule, self.recomputed = stages, schedule, recomputed
        self.replica, self.pipeline_rank = replica, pipeline_rank   # which data-parallel replica, which position in it
        self.ddp = ddp or []                                        # per stage with dp > 1: (DDP, its plan, its hook)
        self.is_first = any(s.is_first for s in stages)
        self.is_last = any(s.is_last for s in stages)

    def parameters(self) -> list[Any]:
        """The trainable parameters of this rank's stages (for its optimizer), each once."""
        seen, out = set(), []
        for s in self.stages:
            for p in s.submod.parameters():   # a DDP-wrapped stage module yields its module's parameters
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def step(self, inputs: Any = None, target: Any = None) -> list[Any]:
        """One pipelined forward and backward of a whole batch (split into the plan's micro-batches).

        The first stage's rank passes ``inputs``, the last stage's rank ``target``; others may pass both
        (they are ignored). Returns the micro-batches' losses on the last stage's rank, else ``[]``.
        """
        losses: list[Any] = []
        args = (inputs,) if self.is_first else ()
        self.schedule.step(*args, target=target if self.is_last else None, losses=losses if self.is_last else None)
        return losses


def pipeline_layout(dp: int, pp: int) -> tuple[list[list[int]], list[list[int]]]:
    """Global ranks of every pipeline (one per replica) and every data-parallel group (one per pipeline rank).

    The launch side's order (``placement.profiles.dp_groups``, tp = 1): rank ``s * dp + d`` is pipeline rank ``s``
    of replica ``d``.

    >>> pipeline_layout(2, 2)
    ([[0, 2], [1, 3]], [[0, 1], [2, 3]])
    """
    return [[s * dp + d for s in range(pp)] for d in range(dp)], [[s * dp + d for d in range(dp)] for s in range(pp)]


def build_pipeline(plan: JobPlan, model: Any, loss_fn: Any, *, rank: int, device: Any, backend: str = "gloo", source: str = "<plan>",
                   plan_dir: Path | None = None) -> PipelineRun:
    """This rank's stages and schedule (see the module docstring). ``rank`` is the global rank.

    With ``dp > 1`` every replica runs its own pipeline (its own process group) and each stage module is
    wrapped in DDP over the ranks that hold the same stage in the other replicas, with the plan's
    communication hook (torch's schedules reduce a DDP stage's gradients in its last backward).
    """
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as ts

    pl = plan.pipeline
    if pl is None:
        raise ModelMismatchError("the plan has no pipeline", source=source, where="pipeline")
    par = plan.parallelism
    if par.tp != 1:
        raise ModelMismatchError(f"this runtime has no tensor parallelism, the plan has tp={par.tp}", source=source, where="parallelism.tp")
    pipe_rank, replica = divmod(rank, par.dp)
    mine = [s for s in pl.stages if s.rank == pipe_rank]
    blocks = {s.index: stage_blocks(plan, model, s, source) for s in pl.stages}   # checks every stage, not only ours
    pipe_group = dp_group = None
    if par.dp > 1:   # every rank creates every group, in the same order
        pipes, dps = pipeline_layout(par.dp, par.pp)
        pipe_groups = [dist.new_group(r) for r in pipes]
        dp_groups = [dist.new_group(r) for r in dps]
        pipe_group, dp_group = pipe_groups[replica], dp_groups[pipe_rank]
    stages, recomputed, ddps = [], {}, []
    for s in mine:
        done = apply_recompute(blocks[s.index], s.recompute)
        recomputed[s.index] = [type(m).__name__ for m in done]
        sub: Any = nn.Sequential(*blocks[s.index]).to(device)
        if dp_group is not None:
            ddps.append(planned_ddp(sub, plan.data_parallel, device=device, backend=backend, group=dp_group, source=source))
            sub = ddps[-1][0]
        stages.append(PipelineStage(sub, s.index, len(pl.stages), device, group=pipe_group))
    if pl.torch_class is not None:
        if pl.torch_class not in TORCH_CLASSES or not hasattr(ts, pl.torch_class):
            raise ModelMismatchError(f"{pl.torch_class!r} is not one of torch's public schedules ({', '.join(TORCH_CLASSES)})",
                                     source=source, where="pipeline.torch_class")
        cls = getattr(ts, pl.torch_class)
        if issubclass(cls, ts.PipelineScheduleSingle):
            if len(stages) != 1:
                raise ModelMismatchError(f"{pl.torch_class} runs one stage per rank, pipeline rank {pipe_rank} has {len(stages)}", source=source,
                                         where="pipeline.stages")
            schedule = cls(stages[0], n_microbatches=pl.microbatches, loss_fn=loss_fn)
        else:
            schedule = cls(stages, n_microbatches=pl.microbatches, loss_fn=loss_fn)
    elif pl.actions_csv is not None:
        schedule = ts._PipelineScheduleRuntime(stages, n_microbatches=pl.microbatches, loss_fn=loss_fn)
        text = pl.actions_csv
        if "," not in text and "\n" not in text:   # a file name beside the plan
            path = (plan_dir or Path(".")) / text
            try:
                text = path.read_text()
            except OSError as exc:
                raise ModelMismatchError(f"cannot read the schedule {str(path)!r} ({exc.strerror})", source=source,
                                         where="pipeline.actions_csv") from None
        with tempfile.NamedTemporaryFile("w", suffix=".csv", prefix="netweave-schedule-") as f:
            f.write(text if text.endswith("\n") else text + "\n")
            f.flush()
            schedule._load_csv(f.name, format="compute_only")
    else:
        raise ModelMismatchError("the plan gives neither torch_class nor actions_csv", source=source, where="pipeline")
    return PipelineRun(stages, schedule, recomputed, replica=replica, pipeline_rank=pipe_rank, ddp=ddps)
