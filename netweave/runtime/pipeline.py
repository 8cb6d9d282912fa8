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

**Traced models** (:func:`build_traced_pipeline`, ``job.pipeline(model, loss_fn, example_args=...)``): a real
model whose blocks take extra arguments (an attention mask, positions) and whose head shares the embedding's
weight is not a list of one-tensor blocks. torch's ``torch.distributed.pipelining.pipeline()`` traces it
(``torch.export``, on one micro-batch of example inputs) and splits it with ``SplitPoint.BEGINNING`` before the
first submodule of every stage after the first: the first of the stage's ``modules`` when the plan names them,
else ``split[lo - 1]`` where ``split`` lists the submodules that begin layers 1, 2, ... (the names the model was
profiled with, ``profile_model(split=...)``), else the model's own ``pipe_split()`` markers (the one before layer
``lo`` is kept, the others dropped). This rank's stages are torch's ``build_stage``. Extra arguments:

- per micro-batch inputs (token ids, positions) are the first stage's: positional ``example_args``/keyword
  ``example_kwargs`` here, then ``run.step(ids, positions=..., target=...)`` (torch's schedules split
  arguments and keyword arguments along dimension 0 into micro-batches and hand them to the first stage);
- inputs that later stages use too must be the same for every micro-batch (torch's traced stages receive only
  the previous stage's activations): ``constants={"mask": causal_mask}`` holds them as (non-persistent)
  buffers of a wrapper module, so that the trace copies each into every stage that reads it.

Tied parameters (GPT-2's head is the token embedding): torch's split gives every stage that names one of the
aliases its own copy (GPT-2's first stage holds ``lm_head.weight`` too, unused); :meth:`PipelineRun.step` sums
the gradients of all copies after the backward (an unused copy counts zero; one all-reduce over the ranks
holding copies) and gives every copy the sum, so the copies stay equal under the same optimizer.

Recomputation of a traced stage applies to its whole ``GraphModule``: ``full`` checkpoints it (only its inputs
are kept); ``selective`` checkpoints it with ``create_selective_checkpoint_contexts`` and an operator policy
that saves the outputs of matrix multiplications (``mm``, ``addmm``: the linear layers) and of fused attention and
recomputes the rest (attention scores and softmax, dropout, norms, activations) -- the policy
``pipesched.model_profile.selective_policy`` measures, so the planner's selective bytes are what runs.
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


SELECTIVE_SAVED_OPS = ("mm", "addmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                       "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention")


def selective_context() -> Any:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint``: save the :data:`SELECTIVE_SAVED_OPS` outputs, recompute the rest."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = {getattr(torch.ops.aten, n).default for n in SELECTIVE_SAVED_OPS if hasattr(torch.ops.aten, n)}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def recompute_traced(module: Any, mode: str) -> Any:
    """Apply a traced stage's recomputation to its whole module (in place; see the module docstring); returns it.

    >>> import torch
    >>> layer = recompute_traced(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()), "selective")
    >>> layer(torch.ones(2, 4)).sum().backward()
    >>> tuple(layer[0].weight.grad.shape), layer._netweave_recompute
    ((4, 4), True)
    """
    from torch.utils.checkpoint import checkpoint

    if mode not in ("none", "selective", "full"):
        raise ValueError(f"unknown recompute mode {mode!r}")
    if mode != "none" and not getattr(module, "_netweave_recompute", False):
        extra = {"context_fn": selective_context} if mode == "selective" else {}
        module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False, **extra)
        module._netweave_recompute = True
    return module


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
                 pipeline_rank: int = 0, ddp: list[tuple[Any, Any, Any]] | None = None,
                 tied: list[tuple[Any, list[Any]]] | None = None, boundaries: list[str] | None = None):
        self.stages, self.schedule, self.recomputed = stages, schedule, recomputed
        self.tied = tied or []                  # (process group, this rank's copies) per tied parameter group (traced models)
        self.boundaries = boundaries or []      # traced models: the submodule (or marker) each stage after the first begins at
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

    def step(self, inputs: Any = None, target: Any = None, **kwargs: Any) -> list[Any]:
        """One pipelined forward and backward of a whole batch (split into the plan's micro-batches).

        The first stage's rank passes ``inputs`` (and keyword inputs, e.g. ``positions=``), the last
        stage's rank ``target``; others may pass them all (they are ignored). Gradients of tied parameters are
        summed over their copies afterwards. Returns the micro-batches' losses on the last stage's rank, else ``[]``.
        """
        import torch
        import torch.distributed as dist

        losses: list[Any] = []
        args, kw = ((inputs,), kwargs) if self.is_first else ((), {})
        self.schedule.step(*args, target=target if self.is_last else None, losses=losses if self.is_last else None, **kw)
        for group, copies in self.tied:   # the sum over every use of the tied weight, on every copy
            total = sum((p.grad if p.grad is not None else torch.zeros_like(p) for p in copies[1:]),
                        start=copies[0].grad.clone() if copies[0].grad is not None else torch.zeros_like(copies[0]))
            if group is not None:
                dist.all_reduce(total, group=group)
            for p in copies:
                p.grad = total.clone()
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
    schedule = plan_schedule(pl, stages, loss_fn, pipe_rank=pipe_rank, source=source, plan_dir=plan_dir)
    return PipelineRun(stages, schedule, recomputed, replica=replica, pipeline_rank=pipe_rank, ddp=ddps)


def plan_schedule(pl: Any, stages: list[Any], loss_fn: Any, *, pipe_rank: int, source: str, plan_dir: Path | None) -> Any:
    """torch's schedule for this rank's ``stages``: the plan's ``torch_class``, else its ``actions_csv`` in torch's runtime."""
    from torch.distributed.pipelining import schedules as ts

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
    return schedule


def _with_constants(model: Any, constants: dict[str, Any]) -> Any:
    """``model`` called with ``constants`` as keyword arguments, held as non-persistent buffers (traced as stage constants)."""
    import torch.nn as nn

    class WithConstants(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            for key, value in constants.items():
                self.register_buffer(f"const_{key}", value, persistent=False)

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return self.model(*args, **kwargs, **{key: getattr(self, f"const_{key}") for key in constants})

    return WithConstants()


def traced_split_points(plan: JobPlan, split: list[str] | None, source: str) -> list[str] | None:
    """Where stages 1, 2, ... begin: the first of each stage's plan ``modules``, else ``split[lo - 1]``; None: the model's markers."""
    pl = plan.pipeline
    assert pl is not None
    layers = pl.stages[-1].layers[1]
    if all(s.modules for s in pl.stages):
        return [s.modules[0] for s in pl.stages[1:]]
    if split is None:
        return None
    if len(split) != layers - 1:
        raise ModelMismatchError(f"the plan splits {layers} layers, `split` names where {len(split) + 1} layers begin "
                                 f"(every layer after the first: {layers - 1} names)", source=source, where="pipeline.stages")
    return [split[s.layers[0] - 1] for s in pl.stages[1:]]


def build_traced_pipeline(plan: JobPlan, model: Any, loss_fn: Any, *, example_args: tuple = (), example_kwargs: dict[str, Any] | None = None,
                          constants: dict[str, Any] | None = None, split: list[str] | None = None, rank: int, device: Any,
                          source: str = "<plan>", plan_dir: Path | None = None) -> PipelineRun:
    """This rank's stages of a traced ``model`` split as the plan says, and the plan's schedule (see the module docstring).

    ``example_args``/``example_kwargs`` are one micro-batch of the first stage's inputs; ``constants`` the
    keyword arguments every micro-batch shares (an attention mask); ``split`` the submodules that begin layers
    1, 2, ... of the plan's layer list (unless the plan's stages name their ``modules``; neither: the model's
    ``pipe_split()`` markers, one before each layer after the first). One pipeline (``dp = 1``, ``tp = 1``).
    """
    import torch.distributed as dist
    from torch.distributed.pipelining import SplitPoint, build_stage, pipeline
    from torch.distributed.pipelining._IR import aten_pipe_split_alias

    pl = plan.pipeline
    if pl is None:
        raise ModelMismatchError("the plan has no pipeline", source=source, where="pipeline")
    par = plan.parallelism
    if par.tp != 1 or par.dp != 1:
        raise ModelMismatchError(f"a traced model runs as one pipeline here (dp = tp = 1), the plan has dp={par.dp}, tp={par.tp}",
                                 source=source, where="parallelism")
    constants = dict(constants or {})
    module = _with_constants(model, constants) if constants else model
    prefix = "model." if constants else ""
    points = traced_split_points(plan, split, source)
    layers = pl.stages[-1].layers[1]
    named: dict[int, set[str]] = {}   # the user's tied parameters: one Parameter under several names
    for name, p in module.named_parameters(remove_duplicate=False):
        named.setdefault(id(p), set()).add(name)
    aliases = [names for names in named.values() if len(names) > 1]
    kwargs: dict[str, Any] = {}
    if points is not None:
        for j, name in enumerate(points):
            try:
                model.get_submodule(name)
            except AttributeError:
                raise ModelMismatchError(f"the model has no submodule {name!r} to begin a stage at", source=source,
                                         where=f"pipeline.stages[{j + 1}]") from None
        kwargs["split_spec"] = {prefix + name: SplitPoint.BEGINNING for name in points}
    else:
        keep = {s.layers[0] for s in pl.stages[1:]}
        points = [f"pipe_split {k}" for k in sorted(keep)]

        def keep_stage_markers(gm: Any) -> Any:   # the model's k-th marker begins layer k: keep those that begin a stage
            markers = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == aten_pipe_split_alias]
            if len(markers) != layers - 1:
                raise ModelMismatchError(f"the plan splits {layers} layers, the model has {len(markers)} pipe_split() markers "
                                         f"(expected {layers - 1}; or pass `split` names)", source=source, where="pipeline.stages")
            for k, node in enumerate(markers, start=1):
                if k not in keep:
                    gm.graph.erase_node(node)
            gm.recompile()
            return gm

        kwargs["split_policy"] = keep_stage_markers
    pipe = pipeline(module, tuple(example_args), dict(example_kwargs or {}), **kwargs)
    if pipe.num_stages != len(pl.stages):
        raise ModelMismatchError(f"torch split the model into {pipe.num_stages} stages, the plan has {len(pl.stages)}", source=source,
                                 where="pipeline.stages")
    pipe_rank = rank
    stages, recomputed = [], {}
    for s in pl.stages:
        if s.rank == pipe_rank:
            sub = recompute_traced(pipe.get_stage_module(s.index), s.recompute).to(device)
            recomputed[s.index] = [type(sub).__name__] if s.recompute != "none" else []
            stages.append(build_stage(sub, s.index, pipe.info(), device))
    # Tied parameters: torch's split gives each stage naming one of the aliases its own copy (a stage may hold
    # a copy it does not use). Group the copies by the user's aliases; every rank creates every group in order.
    rank_of = {s.index: s.rank for s in pl.stages}
    groups: dict[tuple[int, ...], Any] = {}
    tied = []
    for names in aliases:
        ranks = tuple(sorted({rank_of[i] for i in range(pipe.num_stages)
                              if any(n in names for n, _ in pipe.get_stage_module(i).named_parameters())}))
        if len(ranks) > 1 and ranks not in groups:
            groups[ranks] = dist.new_group(list(ranks))
        copies = list({id(p): p for st in stages for n, p in st.submod.named_parameters() if n in names}.values())
        if pipe_rank in ranks and (len(ranks) > 1 or len(copies) > 1):
            tied.append((groups.get(ranks), copies))
    schedule = plan_schedule(pl, stages, loss_fn, pipe_rank=pipe_rank, source=source, plan_dir=plan_dir)
    return PipelineRun(stages, schedule, recomputed, pipeline_rank=pipe_rank, tied=tied, boundaries=points)
