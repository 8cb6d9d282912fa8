"""Profile a real ``torch.nn.Module`` for the planner: split it where a pipeline may cut it, then time and size every segment.

A real model is not a chain of one-tensor modules: its embedding takes token ids and positions, its blocks take
an attention mask as an extra argument, its head shares its weight with the embedding. :func:`profile_model`
therefore lets torch cut the model the way ``torch.distributed.pipelining`` will run it:

1. **Split.** ``torch.distributed.pipelining.pipeline()`` traces the model with ``torch.export`` and splits the
   graph at ``pipe_split()`` markers into one ``GraphModule`` per segment (torch's ``Pipe``, whose
   ``split_gm`` says which values every segment consumes). The markers come from the model's own
   ``pipe_split()`` calls (``split=None``), or are inserted into the exported graph before the first operation
   of each named submodule (``split=["blocks.0", "blocks.1", ..., "ln_f"]``; ``*`` matches one name
   component, so ``"blocks.*"`` is every block), found from the ``nn_module_stack`` torch.export records on
   every node. An ``ExportedProgram`` can be given instead of the module (with its ``pipe_split`` operators or
   names). Every segment must hold at least one operation.
2. **Time.** The segments run in order on one micro-batch (``fx.Interpreter`` over ``split_gm``, each segment
   fed the real values the earlier ones produced and the model inputs it uses). For each: the forward; I and W
   as torch's runtime runs them for zero-bubble schedules, ``stage_backward_input`` (input gradients; it keeps
   the gradients flowing into the weight operations) then ``stage_backward_weight`` (weight gradients from
   those), the values received from earlier segments getting gradients and the model's inputs not (a segment
   with no received activation, the embedding, has I = 0 and its whole backward in W, as torch's first stage);
   one fused backward accumulating into the weights' ``.grad`` (as a micro-batch's backward does); and the
   fused backward of the same forward run under selective checkpointing, whose excess over the fused backward
   is the selective recomputation time (paired per repetition, clamped to ``[0, F]``). Full recomputation
   costs one forward. Medians over ``repeats`` (``clock="cpu"``: the measuring thread's CPU time, as
   :func:`pipesched.profile.measure_profile`). The last segment's cost includes ``loss_fn`` (applied to its
   output) if given, else a random output gradient is back-propagated.
3. **Size** (exact, from the tensors, not from timing runs): ``param_bytes`` the parameters the segment trains
   (each once); ``output_bytes`` every value produced at or before the segment and consumed after it (a skip
   connection counts at every cut it crosses; model inputs do not: torch's runtime hands them to each stage
   that uses them as root arguments); ``saved_bytes["none"]`` the distinct storages autograd saves for the
   backward (``saved_tensors_hooks``, parameters excluded: a view of a bigger tensor holds the whole storage);
   ``saved_bytes["full"]`` the segment's tensor inputs (what ``torch.utils.checkpoint`` keeps);
   ``saved_bytes["selective"]`` the inputs plus the outputs of the operators :func:`selective_policy` saves
   (what ``torch.utils.checkpoint`` with ``create_selective_checkpoint_contexts(selective_policy)`` keeps);
   ``weight_grad_bytes`` what the autograd nodes producing a parameter's gradient saved plus the gradients
   ``stage_backward_input`` keeps for W (what stays alive from I to W).

**Selective recomputation** is an operator policy, as torchtitan's op-level selective activation checkpointing:
the outputs of matrix multiplications (``mm``, ``addmm``: the linear layers) and of fused attention kernels are
saved; everything else (attention scores ``bmm``, softmax, dropout, norms, activations) is recomputed. For an
explicit-softmax attention this is Korthikanti et al.'s selective recomputation (the ``s^2`` attention terms are
recomputed) minus their keeping of the norm and activation inputs, which this policy recomputes too. It is
executable as is: ``torch.utils.checkpoint.checkpoint(stage, *inputs, use_reentrant=False,
context_fn=selective_context)``.

**Tied parameters** (GPT-2's LM head is the token embedding): torch's ``Pipe`` replicates a parameter used by
several segments into each of them (``MultiUseParameterConfig.REPLICATE``), so each such segment's
``param_bytes`` counts it: on different stages each holds a copy with its own gradient and optimizer state,
which is what a pipeline of the two stages needs (plus one all-reduce of the tied gradient per iteration,
which the planner does not model). If the planner puts them on one stage the copy is counted twice. The
profile lists each tied group in ``reference["tied"]`` (names, segments, bytes).

>>> from pipesched.gpt2 import gpt2
>>> spec = gpt2(layers=2, hidden=32, heads=2, seq_len=8, vocab=50, microbatch=2)
>>> prof = profile_model(spec["model"], spec["args"], split=["blocks.*", "ln_f"], loss_fn=spec["loss_fn"], repeats=1, warmup=0)
>>> [lay.name for lay in prof.layers]
['wte+wpe+drop', 'blocks.0', 'blocks.1', 'ln_f+lm_head']
>>> prof.layers[1].output_bytes == 2 * 8 * 32 * 4, prof.reference["tied"][0]["layers"]
(True, [0, 3])
"""

from __future__ import annotations

import fnmatch
import functools
import operator
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from topology.clitools import load_callable

from .profile import LayerProfile, ModelProfile, ProfileError

FACTORY_RE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


class ModelSpecError(ProfileError):
    """A model factory, split specification or model that cannot be profiled as asked."""


# --------------------------------------------------------------------------------------------------------------
# Selective recomputation policy
# --------------------------------------------------------------------------------------------------------------

@functools.cache
def _saved_ops() -> frozenset:
    import torch

    aten = torch.ops.aten
    names = ("mm", "addmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention")
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """The selective-recomputation policy for ``torch.utils.checkpoint.create_selective_checkpoint_contexts``.

    Saves the outputs of the linear layers' matrix multiplications and of fused attention; recomputes the rest.

    >>> import torch
    >>> from torch.utils.checkpoint import CheckpointPolicy
    >>> selective_policy(None, torch.ops.aten.mm.default) == CheckpointPolicy.MUST_SAVE
    True
    """
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context() -> Any:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint`` that applies :func:`selective_policy`."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(selective_policy)


# --------------------------------------------------------------------------------------------------------------
# Model specifications and factories
# --------------------------------------------------------------------------------------------------------------

@dataclass
class ModelSpec:
    """A model with one micro-batch of example inputs: what :func:`profile_model` needs."""

    model: Any                                  # torch.nn.Module or torch.export.ExportedProgram
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    loss_fn: Callable[[Any], Any] | None = None
    split: list[str] | None = None              # submodule names that begin a segment (None: the model's pipe_split calls)


def spec_from_value(value: Any, *, where: str = "--model") -> ModelSpec:
    """Accept what a factory returns: a dict ``{"model", "args", "kwargs"?, "loss_fn"?, "split"?}``, a tuple
    ``(model, args[, kwargs])``, or an ``ExportedProgram`` (its example inputs are used)."""
    import torch

    if isinstance(value, torch.export.ExportedProgram):
        args, kwargs = value.example_inputs or ((), {})
        return ModelSpec(value, tuple(args), dict(kwargs or {}))
    if isinstance(value, dict):
        unknown = set(value) - {"model", "args", "kwargs", "loss_fn", "split"}
        if unknown or "model" not in value:
            raise ModelSpecError(f"expected a dict with keys model, args[, kwargs, loss_fn, split], got keys {sorted(value)}", where=where)
        model, args, kwargs = value["model"], value.get("args"), value.get("kwargs") or {}
        loss_fn, split = value.get("loss_fn"), value.get("split")
    elif isinstance(value, tuple) and len(value) in (2, 3):
        model, args, kwargs = value[0], value[1], (value[2] if len(value) == 3 else {})
        loss_fn, split = None, None
    else:
        raise ModelSpecError(f"expected (model, args[, kwargs]) or a dict with model and args, got {type(value).__name__}", where=where)
    if isinstance(model, torch.export.ExportedProgram) and args is None:
        return spec_from_value(model, where=where)
    if not isinstance(model, torch.nn.Module | torch.export.ExportedProgram):
        raise ModelSpecError(f"expected a torch.nn.Module or ExportedProgram as the model, got {type(model).__name__}", where=where)
    if not isinstance(args, tuple | list) or not isinstance(kwargs, dict):
        raise ModelSpecError("expected the example args as a tuple and kwargs as a dict", where=where)
    if loss_fn is not None and not callable(loss_fn):
        raise ModelSpecError("expected loss_fn to be callable", where=where)
    if split is not None and (not isinstance(split, list | tuple) or not all(isinstance(s, str) for s in split)):
        raise ModelSpecError("expected split to be a list of submodule names", where=where)
    return ModelSpec(model, tuple(args), dict(kwargs), loss_fn, list(split) if split is not None else None)


def load_factory(ref: str, options: dict[str, Any] | None = None, *, where: str = "--model") -> ModelSpec:
    """Import ``"package.module:function"``, call it with ``options`` and return its :class:`ModelSpec`.

    Every failure (no such module or function, the factory raising, a wrong return value) is one
    :class:`ModelSpecError` naming ``where``.

    >>> spec = load_factory("pipesched.gpt2:gpt2", {"layers": 1, "hidden": 16, "heads": 2, "seq_len": 4, "vocab": 10})
    >>> type(spec.model).__name__, len(spec.args), spec.split
    ('GPT2', 3, ['blocks.0', 'ln_f'])
    """
    if not FACTORY_RE.fullmatch(ref):
        raise ModelSpecError(f"expected package.module:function, got {ref!r}", where=where)
    mod_name, func_name = ref.split(":")
    factory = load_callable(ref, where=where, error=ModelSpecError)   # the current directory first, as `python -m`
    if not callable(factory):
        raise ModelSpecError(f"module {mod_name!r} has no function {func_name!r}", where=where)
    try:
        value = factory(**(options or {}))
    except Exception as exc:   # the user's factory failed: say how, on one line
        raise ModelSpecError(f"factory {ref} failed: {_one_line(exc)}", where=where) from None
    return spec_from_value(value, where=where)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


# --------------------------------------------------------------------------------------------------------------
# Splitting
# --------------------------------------------------------------------------------------------------------------

def _module_path(node: Any) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


def _in_module(path: str, name: str) -> bool:
    return path == name or path.startswith(name + ".")


def _is_compute(node: Any, pipe_split_op: Any) -> bool:
    return node.op == "call_function" and node.target not in (operator.getitem, pipe_split_op)


def expand_split_names(names: Sequence[str], module_names: Sequence[str], *, where: str = "--split") -> list[str]:
    """Expand ``*``/``?`` patterns (each matching within one dotted component) against the model's submodule names.

    >>> expand_split_names(["blocks.*", "ln_f"], ["", "wte", "blocks", "blocks.0", "blocks.0.mlp", "blocks.1", "ln_f"])
    ['blocks.0', 'blocks.1', 'ln_f']
    """
    known = [m for m in module_names if m]
    out: list[str] = []
    for name in names:
        name = name.strip()
        if not name:
            raise ModelSpecError("empty submodule name", where=where)
        if any(c in name for c in "*?["):
            depth = name.count(".")
            hits = [m for m in known if m.count(".") == depth and fnmatch.fnmatchcase(m, name)]
            if not hits:
                raise ModelSpecError(f"pattern {name!r} matches no submodule", where=where)
            out.extend(hits)
        elif name in known:
            out.append(name)
        else:
            close = [m for m in known if m.count(".") == name.count(".")][:6]
            raise ModelSpecError(f"no submodule named {name!r} (submodules at that depth: {', '.join(close) or 'none'})", where=where)
    dup = sorted({n for n in out if out.count(n) > 1})
    if dup:
        raise ModelSpecError(f"submodule {dup[0]!r} named twice", where=where)
    return out


def _split_policy(names: list[str] | None, where: str, segment_names: list[str]) -> Callable[[Any], Any]:
    """A ``pipeline(split_policy=...)`` that inserts ``pipe_split`` before each named submodule's first operation
    (none when ``names`` is None), refuses a split that leaves a segment without operations and fills
    ``segment_names`` with each segment's name (from the ``nn_module_stack`` torch.export records)."""
    from torch.distributed.pipelining._IR import aten_pipe_split_alias as pipe_split_op

    def policy(gm: Any) -> Any:
        graph = gm.graph
        if names:
            nodes = [n for n in graph.nodes if _is_compute(n, pipe_split_op)]
            for name in names:
                first = next((n for n in nodes if _in_module(_module_path(n), name)), None)
                if first is None:
                    raise ModelSpecError(f"submodule {name!r} runs no operation in the forward (unused, or not traced)", where=where)
                with graph.inserting_before(first):
                    graph.call_function(pipe_split_op, ())
        # Every segment must compute something: collect the module paths of the operations between markers.
        segments: list[list[str]] = [[]]
        for n in graph.nodes:
            if n.op == "call_function" and n.target == pipe_split_op:
                segments.append([])
            elif _is_compute(n, pipe_split_op):
                segments[-1].append(_module_path(n))
        if len(segments) == 1:
            raise ModelSpecError("the model has no pipe_split() calls; name the submodules to split before", where=where)
        for k, paths in enumerate(segments):
            if not paths:
                after = "the start" if k == 0 else f"split point {k}"
                before = "the end" if k == len(segments) - 1 else f"split point {k + 1}"
                raise ModelSpecError(f"segment {k} (between {after} and {before}) would be empty: no operation runs there", where=where)
        segment_names[:] = [_segment_name(paths) for paths in segments]
        gm.recompile()
        return gm

    return policy


def split_model(model: Any, args: Sequence[Any], kwargs: dict[str, Any] | None = None, *, split: Sequence[str] | None = None,
                where: str = "--split") -> tuple[Any, list[str], list[str]]:
    """Cut ``model`` (an ``nn.Module`` or ``ExportedProgram``) into torch's ``Pipe`` at ``split`` names or its
    ``pipe_split`` calls; returns the ``Pipe``, the name of every segment and where segments 1, 2, ... begin
    (the submodule names, expanded, or ``"pipe_split k"`` for the model's k-th marker)."""
    import torch
    from torch.distributed.pipelining import pipeline

    if isinstance(model, torch.export.ExportedProgram):
        module_names = sorted({p for n in model.graph.nodes for p, _ in (n.meta.get("nn_module_stack") or {}).values()})
        module = model.module()
    else:
        module_names = [name for name, _ in model.named_modules()]
        module = model
    names = expand_split_names(split, module_names, where=where) if split else None
    try:
        segment_names: list[str] = []
        pipe = pipeline(module, tuple(args), dict(kwargs or {}), split_policy=_split_policy(names, where, segment_names))
    except ModelSpecError:
        raise
    except Exception as exc:   # torch.export's failures (graph breaks, data-dependent control flow) as one line
        cause = exc.__cause__ or exc
        raise ModelSpecError(f"torch could not trace and split the model: {_one_line(cause)}", where="--model") from None
    if len(segment_names) != pipe.num_stages:
        raise ModelSpecError(f"torch made {pipe.num_stages} segments of the {len(segment_names)} split", where=where)
    starts = names or [f"pipe_split {k}" for k in range(1, len(segment_names))]
    return pipe, segment_names, starts


def _segment_name(paths: list[str]) -> str:
    """The innermost module holding all of a segment's operations, else its top-level modules joined by ``+``.

    >>> _segment_name(["blocks.3.ln_1", "blocks.3.attn", "blocks.3"]), _segment_name(["wte", "wpe", "", "drop"])
    ('blocks.3', 'wte+wpe+drop')
    """
    parts = [p.split(".") for p in paths if p]
    if not parts:
        return "root"
    common: list[str] = []
    for comps in zip(*parts, strict=False):
        if len(set(comps)) != 1:
            break
        common.append(comps[0])
    if common and all(paths):
        return ".".join(common)
    tops: list[str] = []
    for comps in parts:
        if comps[0] not in tops:
            tops.append(comps[0])
    return "+".join(tops)


# --------------------------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------------------------

def _storage_key(t: Any) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _tensors(value: Any) -> list[Any]:
    import torch
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _clock(name: str) -> Callable[[], float]:
    import torch

    def synced() -> float:
        torch.cuda.synchronize()
        return time.perf_counter()

    try:
        return {"wall": time.perf_counter, "cpu": time.thread_time, "cuda": synced}[name]
    except KeyError:
        raise ValueError(f"clock must be 'wall' or 'cpu', got {name!r}") from None


def autograd_nodes(outputs: Sequence[Any]) -> list[Any]:
    """Every autograd node that back-propagating ``outputs`` would run (each once)."""
    seen: set[Any] = set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    nodes = []
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        nodes.append(fn)
        stack.extend(f for f, _ in fn.next_functions if f is not None)
    return nodes


def node_saved_tensors(fn: Any) -> list[Any]:
    """The tensors an autograd node saved for its backward (its ``_saved_*`` attributes)."""
    import torch

    out = []
    for attr in dir(fn):
        if attr.startswith("_saved_"):
            value = getattr(fn, attr)
            out.extend(v for v in (value if isinstance(value, tuple | list) else [value]) if isinstance(v, torch.Tensor))
    return out


def _measure_sizes(torch, seg, inputs: list[Any], param_keys: set, loss_fn) -> dict[str, int]:
    """Exact byte counts of one forward: what autograd saves (each storage once), what the selective policy
    keeps, and what the nodes that produce a parameter's gradient saved (needed by W)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    saved_ops = _saved_ops()
    policy_out: dict[tuple[int, int], Any] = {}

    class PolicyOutputs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in saved_ops:
                for t in _tensors(out):
                    policy_out.setdefault(_storage_key(t), t)       # kept alive, so that addresses stay unique
            return out

    saved: set[tuple[int, int]] = set()

    def pack(t):
        key = _storage_key(t)
        if key not in param_keys:
            saved.add(key)
        return t

    # Two forwards: a Python dispatch mode can change how composite operators decompose (and so what autograd
    # saves), so the saved tensors are counted without it.
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = seg(*inputs)
        if loss_fn is not None:
            out = loss_fn(out)
    with torch.no_grad(), PolicyOutputs():
        plain = seg(*inputs)
        if loss_fn is not None:
            loss_fn(plain)
    params = {id(p) for p in seg.parameters()}
    wgrad: set[tuple[int, int]] = set()
    for fn in autograd_nodes([t for t in _tensors(out) if t.requires_grad]):
        tensors = node_saved_tensors(fn)
        keys = {_storage_key(t) for t in tensors}
        feeds_param = any(type(f).__name__ == "AccumulateGrad" and id(f.variable) in params for f, _ in fn.next_functions if f is not None)
        if feeds_param or keys & param_keys:
            wgrad |= keys - param_keys
    input_keys = {_storage_key(t) for t in inputs if isinstance(t, torch.Tensor)}
    policy_kept = set(policy_out)
    policy_out.clear()
    del out
    return {"none": sum(nbytes for _, nbytes in saved), "full": sum(nbytes for _, nbytes in input_keys),
            "selective": sum(nbytes for _, nbytes in (set(policy_kept) | input_keys) - param_keys),
            "wgrad": sum(nbytes for _, nbytes in wgrad)}


def _measure_segment(torch, seg, values: list[Any], received: list[bool], loss_fn, repeats: int, warmup: int, clock: str) -> dict[str, Any]:
    """Time and size one segment; ``received[i]``: argument i comes from an earlier segment (it gets a gradient),
    not from the model's inputs (which torch's runtime hands to the stage as they are)."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
    from torch.utils.checkpoint import checkpoint

    now = _clock(clock)

    def fresh() -> list[Any]:
        return [v.detach().requires_grad_(v.is_floating_point() and recv) if isinstance(v, torch.Tensor) else v
                for v, recv in zip(values, received, strict=True)]

    def forward(*inp):
        out = seg(*inp)
        return loss_fn(out) if loss_fn is not None else out

    def targets(out) -> tuple[list[Any], list[Any]]:
        outs = [t for t in _tensors(out) if t.requires_grad]
        return outs, [torch.ones_like(t) if t.dim() == 0 else torch.randn_like(t) for t in outs]

    # The parameters the segment trains: torch's Pipe may leave an unused copy of a tied weight in a segment.
    named = [(n, p) for n, p in seg.named_parameters() if p.requires_grad]
    outs, grads = targets(forward(*fresh()))
    used = torch.autograd.grad(outs, [p for _, p in named], grads, allow_unused=True) if named and outs else []
    named = [(n, p) for (n, p), g in zip(named, used, strict=True) if g is not None]
    params = [p for _, p in named]
    param_keys = {_storage_key(p) for p in params}
    old_grads = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)     # the fused backward accumulates, as every micro-batch but the first does
    samples: dict[str, list[float]] = {k: [] for k in ("f", "i", "w", "b", "sel")}
    held: dict[tuple[int, int], int] = {}
    try:
        for rep in range(warmup + repeats):
            inp = fresh()
            t0 = now()
            out = forward(*inp)
            t1 = now()
            outs, grads = targets(out)
            float_in = [v for v in inp if isinstance(v, torch.Tensor) and v.requires_grad]
            t2 = now()
            if float_in and outs:
                # torch's own split backward, as its runtime runs I and W: I keeps the gradients flowing into
                # the weight operations, W starts from them (no second pass through the segment).
                _, groups = stage_backward_input(outs, grads, inp, iter(params))
                t3 = now()
                if rep == warmup:   # what stays alive from I to W besides the saved activations: those gradients
                    for g in groups:
                        for t in _tensors(g.get("grads")):
                            held[_storage_key(t)] = t.untyped_storage().nbytes()
                    t3 = now()          # not part of W
                stage_backward_weight(iter(params), groups)
            else:
                # No input gradient (a first stage, token ids in): torch's runtime runs the whole backward as W.
                t3 = now()
                if outs and params:
                    torch.autograd.backward(outs, grads, inputs=params)
            t4 = now()
            inp = fresh()
            outs, _ = targets(forward(*inp))
            float_in = [v for v in inp if isinstance(v, torch.Tensor) and v.requires_grad]
            t5 = now()
            if outs:
                torch.autograd.backward(outs, grads, inputs=float_in + params)
            t6 = now()
            inp = fresh()
            outs, _ = targets(checkpoint(forward, *inp, use_reentrant=False, context_fn=selective_context))
            float_in = [v for v in inp if isinstance(v, torch.Tensor) and v.requires_grad]
            t7 = now()
            if outs:
                torch.autograd.backward(outs, grads, inputs=float_in + params)
            t8 = now()
            if rep >= warmup:
                for key, dt in (("f", t1 - t0), ("i", t3 - t2), ("w", t4 - t3), ("b", t6 - t5), ("sel", (t8 - t7) - (t6 - t5))):
                    samples[key].append(dt)
            del out, outs, inp, float_in
        sizes = _measure_sizes(torch, seg, fresh(), param_keys, loss_fn)
    finally:
        for p, old in zip(params, old_grads, strict=True):
            p.grad = old
    sizes["wgrad"] += sum(held.values())
    return {"samples": samples, "sizes": sizes, "param_bytes": sum(p.numel() * p.element_size() for p in params),
            "param_names": [n for n, _ in named]}


def profile_model(model: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None, *, split: Sequence[str] | None = None,
                  loss_fn: Callable[[Any], Any] | None = None, repeats: int = 5, warmup: int = 1, threads: int | None = None,
                  clock: str = "wall", name: str | None = None, state_factor: float = 4.0) -> ModelProfile:
    """Split ``model`` (``nn.Module`` or ``ExportedProgram``) and profile every segment for one micro-batch; see the module docstring.

    ``args``/``kwargs`` are one micro-batch of example inputs (for an ``ExportedProgram``, its example inputs
    by default); ``split`` names the submodules that begin a segment (``None``: the model's ``pipe_split()``
    calls). Times are medians over ``repeats`` after ``warmup`` untimed runs, with ``threads`` torch threads.
    ``state_factor`` 4 is FP32 weights + grads + Adam's two moments.
    """
    import torch
    from torch.utils._pytree import tree_leaves

    if repeats < 1 or warmup < 0:
        raise ValueError(f"expected repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    _clock(clock)
    exported = isinstance(model, torch.export.ExportedProgram)
    if exported and not args and not kwargs:
        ex_args, ex_kwargs = model.example_inputs or ((), {})
        args, kwargs = tuple(ex_args), dict(ex_kwargs or {})
    pipe, names, starts = split_model(model, args, kwargs, split=split)
    gm = pipe.split_gm
    order = [n for n in gm.graph.nodes if n.op == "call_module"]
    index_of = {n.name: k for k, n in enumerate(order)}
    # The values crossing the cut after segment k: produced at or before k, consumed after it (a skip counts at every cut).
    producer: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_module":
            producer[n.name] = index_of[n.name]
        elif n.op == "call_function" and n.target is operator.getitem and n.args[0].name in producer:
            producer[n.name] = producer[n.args[0].name]
    crossing: list[set[str]] = [set() for _ in order]
    for n in order:
        for a in n.all_input_nodes:
            for k in range(producer.get(a.name, len(order)), index_of[n.name]):
                crossing[k].add(a.name)

    results: list[dict[str, Any]] = []
    value_bytes: dict[str, int] = {}
    last = order[-1].target

    class Profiler(torch.fx.Interpreter):
        """Runs ``split_gm`` once, profiling each segment on the real values the earlier ones produced."""

        def run_node(self, n):
            self._node = n
            out = super().run_node(n)
            if n.op == "call_module" or (n.op == "call_function" and n.target is operator.getitem):
                value_bytes[n.name] = sum(t.numel() * t.element_size() for t in _tensors(out))
            return out

        def call_module(self, target, fargs, fkwargs):
            seg = self.fetch_attr(target)
            received = [not (isinstance(a, torch.fx.Node) and a.op == "placeholder") for a in self._node.args]
            results.append(_measure_segment(torch, seg, list(fargs), received, loss_fn if target == last else None, repeats, warmup, clock))
            with torch.no_grad():
                return seg(*fargs, **fkwargs)

    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        Profiler(gm).run(*tree_leaves((tuple(args), dict(kwargs or {}))))
    finally:
        torch.set_num_threads(old_threads)

    stat = statistics.median
    layers = []
    for k, (node, res) in enumerate(zip(order, results, strict=True)):
        smp, sizes = res["samples"], res["sizes"]
        fwd = stat(smp["f"])
        # The last segment's output is the loss (a scalar) or the model output.
        last_out = 4 if loss_fn is not None else value_bytes[node.name]
        out_bytes = sum(value_bytes[v] for v in crossing[k]) if k < len(order) - 1 else last_out
        layers.append(LayerProfile(
            name=names[k], fwd_s=fwd, bwd_input_s=stat(smp["i"]), bwd_weight_s=stat(smp["w"]),
            output_bytes=int(out_bytes), param_bytes=int(res["param_bytes"]),
            saved_bytes={"none": sizes["none"], "selective": sizes["selective"], "full": sizes["full"]},
            recompute_s={"none": 0.0, "selective": min(max(stat(smp["sel"]), 0.0), fwd), "full": fwd},
            weight_grad_bytes=sizes["wgrad"], bwd_full_s=stat(smp["b"]),
        ))
    source_module = model.module() if exported else model
    tied = tied_groups(source_module, [res["param_names"] for res in results])
    batch = next((t.shape[0] for t in _tensors((args, kwargs)) if t.dim()), 1)
    return ModelProfile(name=name or type(model if not exported else source_module).__name__, layers=tuple(layers), source="measured",
                        microbatch_size=int(batch), state_factor=state_factor,
                        reference={"name": "cpu", "threads": threads or old_threads, "statistic": "median", "clock": clock,
                                   "repeats": repeats, "split": list(split) if split else "pipe_split", "segment_starts": starts,
                                   "tied": tied})


def stage_split_points(profile: ModelProfile, spans: Sequence[Sequence[int]]) -> list[str]:
    """Where the stages of a plan begin, as split points of the profiled model (stages 1, 2, ...).

    ``spans`` are the stages' layer spans (a plan's ``partition.stages[k].layers``, or ``stages.json``'s
    ``layers``). With names, build the stages with torch: ``pipeline(model, args, split_spec={name:
    SplitPoint.BEGINNING for name in stage_split_points(prof, spans)})``; with ``pipe_split`` markers, keep
    the markers listed and remove the others.

    >>> prof = ModelProfile("m", (), reference={"segment_starts": ["blocks.0", "blocks.1", "ln_f"]})
    >>> stage_split_points(prof, [(0, 2), (2, 4)])
    ['blocks.1']
    """
    starts = profile.reference.get("segment_starts")
    if not isinstance(starts, list):
        raise ProfileError("the profile does not record its split points (not made by profile_model)", where="reference.segment_starts")
    return [starts[i - 1] for i, _ in spans[1:]]


def tied_groups(module: Any, segment_params: list[list[str]]) -> list[dict[str, Any]]:
    """Parameters of ``module`` that several segments use (one ``Parameter`` under several names, e.g. GPT-2's
    ``wte.weight`` and ``lm_head.weight``): names, the segments that hold a copy, bytes of one copy."""
    aliases: dict[int, list[str]] = {}
    tensors: dict[int, Any] = {}
    for pname, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(pname)
        tensors[id(p)] = p
    groups = []
    for key, names in aliases.items():
        layers = [k for k, used in enumerate(segment_params) if any(n in used for n in names)]
        if len(layers) > 1:
            p = tensors[key]
            groups.append({"params": names, "layers": layers, "bytes": p.numel() * p.element_size()})
    return groups
