"""Gradient profiles: when each gradient becomes ready, how big it is, and how fast the network is.

A :class:`GradientProfile` is the input of the in-job schedulers (Prophet,
ByteScheduler-style priority). Gradients are indexed by *layer in forward
order* (0 = first layer of the model, the first one the next forward pass needs).
Backward produces them roughly in reverse, at ``ready[i]`` seconds after the
backward pass starts.

Two sources:

- :func:`measure_gradient_profile` runs a real ``torch.nn.Module`` (CPU or GPU)
  with per-parameter hooks (``register_post_accumulate_grad_hook``) and forward
  hooks, and records ready times, sizes and per-layer forward times;
- :func:`analytic_gradient_profile` derives one from per-layer forward/backward
  times and parameter bytes (e.g. a ``pipesched`` profile).

The JSON format is ``{"format": "netweave-gradient-profile", "version": 2, ...}``
with the fields of :class:`GradientProfile` (``bandwidth`` in GB/s; version 1 files, whose
``bandwidth`` is in bytes/s, are still read).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from topology.errors import InputError
from topology.io import atomic_write_text
from topology.schema import load_schema, validate

FORMAT = "netweave-gradient-profile"
VERSION = 2
#: versions read: 1 kept ``bandwidth`` in bytes/s
READ_VERSIONS = (1, 2)


@dataclass
class GradientProfile:
    """Per-layer gradient sizes and ready times, forward times, and the network's speed.

    Attributes:
        names: layer names in forward order.
        nbytes: gradient bytes per layer.
        ready: seconds after backward start when each layer's gradient is ready.
        forward: forward time per layer (seconds), for the next iteration's forward pass.
        backward: total backward time (seconds).
        bandwidth: all-reduce goodput in GB/s (algorithm bandwidth: bytes / time / 1e9), the project's unit;
            :attr:`bytes_per_s` is the same in bytes/s, what the schedulers compute with.
        overhead: fixed cost per collective launch (seconds), the alpha term.

    >>> p = GradientProfile(["l0", "l1"], [4e6, 4e6], [0.02, 0.01], [0.005, 0.005], 0.02, 1.0, 1e-4)   # 1 GB/s
    >>> p.layers, p.total_bytes, round(p.compute_time, 3), p.bytes_per_s, round(p.comm_time(1), 6)
    (2, 8000000.0, 0.03, 1000000000.0, 0.0081)
    """

    names: list[str]
    nbytes: list[float]
    ready: list[float]
    forward: list[float]
    backward: float
    bandwidth: float
    overhead: float = 0.0

    def __post_init__(self) -> None:
        n = len(self.names)
        for field in ("nbytes", "ready", "forward"):
            if len(getattr(self, field)) != n:
                raise InputError(f"{field}: expected {n} entries (one per layer), got {len(getattr(self, field))}")
        if not self.bandwidth > 0:
            raise InputError(f"bandwidth: expected a positive number of GB/s, got {self.bandwidth!r}")
        if any(b < 0 for b in self.nbytes) or any(r < 0 for r in self.ready) or any(f < 0 for f in self.forward):
            raise InputError("nbytes, ready and forward must be non-negative")
        self.nbytes = [float(x) for x in self.nbytes]
        self.ready = [float(x) for x in self.ready]
        self.forward = [float(x) for x in self.forward]

    @property
    def layers(self) -> int:
        return len(self.names)

    @property
    def bytes_per_s(self) -> float:
        """:attr:`bandwidth` in bytes/s."""
        return self.bandwidth * 1e9

    @property
    def total_bytes(self) -> float:
        return float(sum(self.nbytes))

    @property
    def compute_time(self) -> float:
        """Forward plus backward time of one iteration."""
        return float(sum(self.forward) + self.backward)

    def comm_time(self, collectives: int | None = None) -> float:
        """Time to all-reduce every gradient in ``collectives`` launches (default: one per layer)."""
        k = self.layers if collectives is None else collectives
        return self.total_bytes / self.bytes_per_s + k * self.overhead

    def lower_bound(self) -> float:
        """The overlap lower bound on iteration time: max(compute, communication in one launch)."""
        return max(self.compute_time, self.comm_time(1))

    def with_bandwidth(self, bandwidth: float, overhead: float | None = None) -> GradientProfile:
        """A copy with ``bandwidth`` GB/s (and ``overhead`` seconds per launch, when given)."""
        d = asdict(self)
        d["bandwidth"] = bandwidth
        if overhead is not None:
            d["overhead"] = overhead
        return GradientProfile(**d)

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str | None = None) -> GradientProfile:
        """Parse the JSON form, checked against ``flowsched/schemas/gradient-profile.schema.json`` first; errors name the field."""
        validate(data, load_schema("flowsched", "gradient-profile"), source=source)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise InputError(f'expected an object with "format": "{FORMAT}"', source=source)
        if data.get("version") not in READ_VERSIONS:
            raise InputError(f"unsupported version {data.get('version')!r}, expected one of {READ_VERSIONS}", source=source, where="version")
        fields = ("names", "nbytes", "ready", "forward", "backward", "bandwidth", "overhead")
        missing = [f for f in fields[:-1] if f not in data]
        if missing:
            raise InputError(f"missing field {missing[0]!r}", source=source, where=missing[0])
        _check_fields(data, source)
        values = {f: data[f] for f in fields if f in data}
        if data["version"] == 1:
            values["bandwidth"] = data["bandwidth"] / 1e9   # version 1 kept bytes/s
        try:
            return cls(**values)
        except InputError as exc:
            raise InputError(exc.message, source=source) from None

    def save(self, path: str | Path) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> GradientProfile:
        from topology.inputs import loads_json, read_text

        return cls.from_dict(loads_json(read_text(path), source=str(path)), source=str(path))


def _check_fields(data: dict[str, Any], source: str | None) -> None:
    """Types and bounds of a profile file's fields (lists of at most MAX_LAYERS finite numbers), before any arithmetic."""
    from topology.inputs import check_number
    from topology.limits import MAX_BANDWIDTH_GBS, MAX_BYTES, MAX_LAYERS, MAX_SECONDS

    names = data["names"]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or len(names) > MAX_LAYERS:
        raise InputError(f"expected a list of at most {MAX_LAYERS} layer names", source=source, where="names")
    for key, hi in (("nbytes", MAX_BYTES), ("ready", MAX_SECONDS), ("forward", MAX_SECONDS)):
        if not isinstance(data[key], list):
            raise InputError("expected a list of numbers, one per layer", source=source, where=key)
        for i, x in enumerate(data[key]):
            check_number(x, what=f"a {key} value", source=source, where=f"{key}[{i}]", minimum=0, maximum=hi)
    check_number(data["backward"], what="a backward time", source=source, where="backward", minimum=0, maximum=MAX_SECONDS)
    gbs = data["version"] == VERSION
    check_number(data["bandwidth"], what=f"a bandwidth in {'GB/s' if gbs else 'bytes/s'}", source=source, where="bandwidth", positive=True,
                 maximum=MAX_BANDWIDTH_GBS * (1 if gbs else 1e9))
    check_number(data.get("overhead", 0.0), what="an overhead", source=source, where="overhead", minimum=0, maximum=MAX_SECONDS)


def analytic_gradient_profile(
    names: Sequence[str],
    param_bytes: Sequence[float],
    forward: Sequence[float],
    backward: Sequence[float],
    *,
    bandwidth: float,
    overhead: float = 0.0,
) -> GradientProfile:
    """Build a profile from per-layer costs: layer *i*'s gradient is ready when backward has
    passed through layers L-1 .. i. ``bandwidth`` is the all-reduce goodput in GB/s, ``overhead`` seconds per launch.

    >>> p = analytic_gradient_profile(["a", "b", "c"], [1, 2, 3], [1, 1, 1], [2, 2, 2], bandwidth=1.0)
    >>> p.ready
    [6.0, 4.0, 2.0]
    """
    bw = np.asarray(backward, dtype=float)
    ready = np.cumsum(bw[::-1])[::-1]
    return GradientProfile(list(names), list(param_bytes), ready.tolist(), list(forward), float(bw.sum()), bandwidth, overhead)


def gradient_layers(module: Any) -> list[Any]:
    """The layers of a model for per-layer gradient scheduling: the modules that own trainable parameters.

    A module that owns a trainable parameter directly is a layer together with everything under it (its
    forward runs its children: ``nn.MultiheadAttention`` owns ``in_proj_weight`` and runs ``out_proj``), so
    parameters of non-leaf modules are never left out. Registration order (forward order for sequential
    models); a module met twice (shared) counts once, and a module whose parameters all belong to an
    earlier layer (tied weights) is no layer of its own. With :func:`layer_parameters` every trainable
    parameter is in exactly one layer.

    >>> import torch.nn as nn
    >>> m = nn.Sequential(nn.Linear(4, 4), nn.MultiheadAttention(4, 2), nn.ReLU())
    >>> [type(x).__name__ for x in gradient_layers(m)]
    ['Linear', 'MultiheadAttention']
    """
    layers: list[Any] = []
    seen: set[int] = set()
    claimed: set[int] = set()

    def visit(m: Any) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        if any(p.requires_grad for p in m.parameters(recurse=False)):
            new = [p for p in m.parameters() if p.requires_grad and id(p) not in claimed]
            if new:
                layers.append(m)
                claimed.update(id(p) for p in new)
            seen.update(id(sub) for sub in m.modules())
            return
        for child in m.children():
            visit(child)

    visit(module)
    return layers


def layer_parameters(layers: Sequence[Any]) -> list[list[Any]]:
    """Each layer's trainable parameters (its own and its children's), each parameter in the first layer that has it.

    Raises :class:`InputError` for a layer left with none (frozen, or all its parameters in earlier layers).
    """
    claimed: set[int] = set()
    out = []
    for i, layer in enumerate(layers):
        ps = [p for p in layer.parameters() if p.requires_grad and id(p) not in claimed]
        if not ps:
            raise InputError(f"layer {i} ({type(layer).__name__}) has no trainable parameters that an earlier layer does not "
                             "already have; leave it out (flowsched.gradients.gradient_layers finds the layers)")
        claimed.update(id(p) for p in ps)
        out.append(ps)
    return out


def measure_gradient_profile(
    module: Any,
    make_batch: Callable[[], tuple[Any, Any]],
    loss_fn: Callable[[Any, Any], Any],
    *,
    bandwidth: float,
    overhead: float = 0.0,
    warmup: int = 2,
    iterations: int = 5,
    layers: Sequence[Any] | None = None,
) -> GradientProfile:
    """Measure a real module: per-layer gradient ready times and sizes, and forward times.

    ``bandwidth`` (all-reduce goodput, GB/s) and ``overhead`` (seconds per launch) are stored in the
    profile for the schedulers; they are not measured here.

    ``layers`` are the sub-modules that count as layers (default:
    :func:`gradient_layers`, which covers every trainable parameter, those of
    non-leaf modules included). Ready time of a layer = when the last of its
    parameters' gradients has been accumulated. Medians over ``iterations``.
    """
    import torch

    if layers is None:
        layers = gradient_layers(module)
    if not layers:
        raise InputError("the module has no layers with trainable parameters")
    groups = layer_parameters(layers)
    names = []
    sizes = []
    for layer, params in zip(layers, groups, strict=True):
        sizes.append(float(sum(p.numel() * p.element_size() for p in params)))
        names.append(next((n for n, m in module.named_modules() if m is layer), f"layer{len(names)}"))

    stamps: dict[int, float] = {}
    fwd_start: dict[int, float] = {}
    fwd_time: dict[int, float] = {}
    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: fwd_start.__setitem__(i, time.perf_counter())))
        handles.append(layer.register_forward_hook(lambda m, a, o, i=i: fwd_time.__setitem__(i, time.perf_counter() - fwd_start[i])))
        for p in groups[i]:
            handles.append(p.register_post_accumulate_grad_hook(lambda p, i=i: stamps.__setitem__(i, time.perf_counter())))
    ready_runs, fwd_runs, bwd_runs = [], [], []
    try:
        for it in range(warmup + iterations):
            x, y = make_batch()
            module.zero_grad(set_to_none=True)
            stamps.clear()
            out = module(x)
            loss = loss_fn(out, y)
            t0 = time.perf_counter()
            loss.backward()
            t1 = time.perf_counter()
            if it >= warmup:
                ready_runs.append([stamps.get(i, t1) - t0 for i in range(len(layers))])
                fwd_runs.append([fwd_time.get(i, 0.0) for i in range(len(layers))])
                bwd_runs.append(t1 - t0)
    finally:
        for h in handles:
            h.remove()
    del torch  # imported for its side effect of failing early when torch is missing
    return GradientProfile(
        names,
        sizes,
        np.median(np.array(ready_runs), axis=0).tolist(),
        np.median(np.array(fwd_runs), axis=0).tolist(),
        float(np.median(bwd_runs)),
        bandwidth,
        overhead,
    )
