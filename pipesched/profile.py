"""Per-layer cost profiles: what the planner knows about a model.

A :class:`ModelProfile` is a chain of :class:`LayerProfile` rows, one per layer, for ONE micro-batch on the
profile's reference device:

- ``fwd_s``: forward time; ``bwd_input_s``: the input-gradient part of the backward (torch's ``I``, the
  Zero Bubble paper's ``B``); ``bwd_weight_s``: the weight-gradient part (``W``); optional ``bwd_full_s``: one
  fused backward (torch's ``B``), which is what a non-split schedule actually runs (default ``I + W``).
- ``output_bytes``: the activation that crosses a stage boundary after this layer (and its gradient coming back).
- ``param_bytes``: weight bytes; model states (weights + grads + optimizer) are ``param_bytes *
  ModelProfile.state_factor``.
- ``saved_bytes[option]``: activation bytes held from F to the backward under each recomputation option
  (``none``: everything autograd saves; ``selective``: the cheap, memory-hungry parts are recomputed, after
  Korthikanti et al. 2022; ``full``: only the layer input is kept). ``recompute_s[option]``: the extra forward
  time the backward pays for it.
- ``weight_grad_bytes``: bytes that stay alive between ``I`` and ``W`` (the inputs of the weight matmuls).

Two sources: :func:`measure_profile` runs a real ``torch.nn.Module`` chain on CPU with hooks and timers, and
:func:`analytic_profile` costs a GPT/Llama configuration from FLOPs, bytes and a device's FLOP/s and memory
bandwidth. :func:`save_profile` / :func:`load_profile` read and write the JSON format documented in
``docs/pipesched.md``.

>>> prof = analytic_profile(GPTConfig(layers=2, hidden=256, heads=4, seq_len=128, vocab=1000))
>>> [layer.name for layer in prof.layers]
['embedding', 'block0', 'block1', 'lm_head']
>>> prof.layers[1].saved_bytes['full'] < prof.layers[1].saved_bytes['selective'] < prof.layers[1].saved_bytes['none']
True
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from topology.errors import InputError
from topology.inputs import check_number, loads_json, loads_yaml, read_text
from topology.limits import MAX_BANDWIDTH_GBS, MAX_BYTES, MAX_LAYERS, MAX_SECONDS, MAX_TFLOPS
from topology.schema import load_schema, validate

RECOMPUTE_OPTIONS = ("none", "selective", "full")
PROFILE_FORMAT = "netweave-pipe-profile"
PROFILE_VERSION = 1

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1}


class ProfileError(InputError):
    """A profile or model configuration that is malformed."""


@dataclass(frozen=True)
class LayerProfile:
    """Costs of one layer for one micro-batch (seconds and bytes); see the module docstring."""

    name: str
    fwd_s: float
    bwd_input_s: float
    bwd_weight_s: float
    output_bytes: int
    param_bytes: int
    saved_bytes: dict[str, int]
    recompute_s: dict[str, float]
    weight_grad_bytes: int = 0
    bwd_full_s: float | None = None

    @property
    def bwd_s(self) -> float:
        """Time of one fused backward (torch's ``B``)."""
        return self.bwd_full_s if self.bwd_full_s is not None else self.bwd_input_s + self.bwd_weight_s

    def to_dict(self) -> dict[str, Any]:
        d = {
            "name": self.name, "fwd_s": self.fwd_s, "bwd_input_s": self.bwd_input_s, "bwd_weight_s": self.bwd_weight_s,
            "output_bytes": self.output_bytes, "param_bytes": self.param_bytes, "saved_bytes": dict(self.saved_bytes),
            "recompute_s": dict(self.recompute_s), "weight_grad_bytes": self.weight_grad_bytes,
        }
        if self.bwd_full_s is not None:
            d["bwd_full_s"] = self.bwd_full_s
        return d


@dataclass(frozen=True)
class ModelProfile:
    """A chain of layer profiles plus what they were measured or computed for."""

    name: str
    layers: tuple[LayerProfile, ...]
    source: str = "analytic"            # "measured" or "analytic"
    microbatch_size: int = 1
    state_factor: float = 8.0           # model-state bytes per weight byte (bf16 + fp32 Adam: 16 B/param / 2 B)
    reference: dict[str, Any] = field(default_factory=dict)   # device the times are for: {"name", "tflops", "hbm_gbs"}

    def __len__(self) -> int:
        return len(self.layers)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT, "version": PROFILE_VERSION, "name": self.name, "source": self.source,
            "microbatch_size": self.microbatch_size, "state_factor": self.state_factor, "reference": dict(self.reference),
            "layers": [layer.to_dict() for layer in self.layers],
        }

    def scaled(self, time_factor: float) -> ModelProfile:
        """The same profile with every time multiplied by ``time_factor`` (calibration to another machine)."""
        layers = tuple(replace(
            lay, fwd_s=lay.fwd_s * time_factor, bwd_input_s=lay.bwd_input_s * time_factor, bwd_weight_s=lay.bwd_weight_s * time_factor,
            bwd_full_s=None if lay.bwd_full_s is None else lay.bwd_full_s * time_factor,
            recompute_s={k: v * time_factor for k, v in lay.recompute_s.items()},
        ) for lay in self.layers)
        return replace(self, layers=layers)


def median_profile(profiles: Sequence[ModelProfile]) -> ModelProfile:
    """Per layer and per time field, the median over several profiles of the same model (sizes from the first).

    Profiles taken at different times see the machine at different speeds; their element-wise median is a
    profile of its typical speed, robust to one profile caught in a slow (or fast) spell.

    >>> a = analytic_profile(GPTConfig(layers=1, hidden=64, heads=2, seq_len=16, vocab=100))
    >>> m = median_profile([a.scaled(1.0), a.scaled(3.0), a.scaled(1.2)])
    >>> round(m.layers[1].fwd_s / a.layers[1].fwd_s, 12), median_profile([a]) == a
    (1.2, True)
    """
    if not profiles:
        raise ProfileError("median_profile needs at least one profile")
    first = profiles[0]
    if len(profiles) == 1:
        return first
    if any(len(p.layers) != len(first.layers) for p in profiles):
        raise ProfileError("profiles of different models (layer counts differ)")
    med = statistics.median
    layers = []
    for k, lay in enumerate(first.layers):
        group = [p.layers[k] for p in profiles]
        full = None if lay.bwd_full_s is None else med(g.bwd_s for g in group)
        layers.append(replace(lay, fwd_s=med(g.fwd_s for g in group), bwd_input_s=med(g.bwd_input_s for g in group),
                              bwd_weight_s=med(g.bwd_weight_s for g in group), bwd_full_s=full,
                              recompute_s={o: med(g.recompute_s[o] for g in group) for o in lay.recompute_s}))
    return replace(first, layers=tuple(layers), reference={**first.reference, "median_of": len(profiles)})


# --------------------------------------------------------------------------------------------------------------
# JSON format
# --------------------------------------------------------------------------------------------------------------

def profile_from_dict(data: Any, *, source: str | None = None) -> ModelProfile:
    """Parse and validate the JSON form; errors name the field.

    The structure is checked against ``pipesched/schemas/pipe-profile.schema.json`` first.
    """
    validate(data, load_schema("pipesched", "pipe-profile"), source=source, error=ProfileError)
    if not isinstance(data, dict):
        raise ProfileError("expected a JSON object", source=source)
    if data.get("format") != PROFILE_FORMAT:
        raise ProfileError(f"expected \"format\": \"{PROFILE_FORMAT}\"", source=source, where="format")
    if data.get("version") != PROFILE_VERSION:
        raise ProfileError(f"unsupported version {data.get('version')!r}, expected {PROFILE_VERSION}", source=source, where="version")
    raw_layers = data.get("layers")
    if not isinstance(raw_layers, list) or not raw_layers:
        raise ProfileError("expected a non-empty list", source=source, where="layers")
    if len(raw_layers) > MAX_LAYERS:
        raise ProfileError(f"{len(raw_layers)} layers, more than {MAX_LAYERS} (the limit)", source=source, where="layers")
    layers = []
    for i, raw in enumerate(raw_layers):
        where = f"layers[{i}]"
        if not isinstance(raw, dict):
            raise ProfileError("expected an object", source=source, where=where)

        def num(key: str, raw=raw, where=where, default: Any = None) -> float:
            value = raw.get(key, default)
            if not isinstance(value, int | float) or isinstance(value, bool) or value < 0 or not math.isfinite(value):
                raise ProfileError("expected a non-negative number", source=source, where=f"{where}.{key}")
            limit = MAX_BYTES if key.endswith("bytes") else MAX_SECONDS
            if value > limit:
                raise ProfileError(f"expected a number <= {limit:g} (the limit)", source=source, where=f"{where}.{key}")
            return value

        def per_option(key: str, raw=raw, where=where) -> dict[str, float]:
            value = raw.get(key)
            if not isinstance(value, dict) or set(value) != set(RECOMPUTE_OPTIONS):
                raise ProfileError(f"expected an object with keys {list(RECOMPUTE_OPTIONS)}", source=source, where=f"{where}.{key}")
            for k, v in value.items():
                if not isinstance(v, int | float) or isinstance(v, bool) or v < 0 or v > (MAX_BYTES if key.endswith("bytes") else MAX_SECONDS):
                    raise ProfileError("expected a non-negative, finite number within the limits", source=source, where=f"{where}.{key}.{k}")
            return dict(value)

        full = raw.get("bwd_full_s")
        layers.append(LayerProfile(
            name=str(raw.get("name", f"layer{i}")), fwd_s=float(num("fwd_s")), bwd_input_s=float(num("bwd_input_s")),
            bwd_weight_s=float(num("bwd_weight_s")), output_bytes=int(num("output_bytes")), param_bytes=int(num("param_bytes")),
            saved_bytes={k: int(v) for k, v in per_option("saved_bytes").items()},
            recompute_s={k: float(v) for k, v in per_option("recompute_s").items()},
            weight_grad_bytes=int(num("weight_grad_bytes", default=0)),
            bwd_full_s=None if full is None else float(num("bwd_full_s")),
        ))
    mbs = data.get("microbatch_size", 1)
    if not isinstance(mbs, int) or isinstance(mbs, bool) or not 1 <= mbs <= 1 << 20:
        raise ProfileError("expected a positive integer", source=source, where="microbatch_size")
    factor = data.get("state_factor", 8.0)
    if not isinstance(factor, int | float) or isinstance(factor, bool) or not 1 <= factor <= 1e6:
        raise ProfileError("expected a number >= 1", source=source, where="state_factor")
    return ModelProfile(name=str(data.get("name", "model")), layers=tuple(layers), source=str(data.get("source", "analytic")),
                        microbatch_size=mbs, state_factor=float(factor), reference=dict(data.get("reference") or {}))


def dumps_profile(profile: ModelProfile) -> str:
    return json.dumps(profile.to_dict(), indent=1) + "\n"


def loads_profile(text: str, *, source: str | None = None) -> ModelProfile:
    return profile_from_dict(loads_json(text, source=source, error=ProfileError), source=source)


def save_profile(profile: ModelProfile, path: str | Path) -> None:
    """Write the JSON profile atomically."""
    from topology.io import atomic_write_text

    atomic_write_text(path, dumps_profile(profile))


def load_profile(path: str | Path) -> ModelProfile:
    return loads_profile(read_text(path, error=ProfileError), source=str(path))


# --------------------------------------------------------------------------------------------------------------
# Analytic GPT / Llama profiles
# --------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GPTConfig:
    """A decoder-only transformer: ``kind`` "gpt" (GELU MLP, LayerNorm, dropout) or "llama" (SwiGLU, RMSNorm, GQA).

    ``tflops`` / ``hbm_gbs`` describe the device the times are for (default: H100 SXM dense BF16 and HBM3);
    ``flops_efficiency`` and ``memory_efficiency`` are the achieved fractions of those peaks (assumptions, not
    measurements: 0.5 and 0.8 are typical of large-model training).
    """

    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    kind: str = "gpt"
    ffn_hidden: int | None = None
    kv_heads: int | None = None
    microbatch_size: int = 1
    dtype: str = "bf16"
    tflops: float = 989.0
    hbm_gbs: float = 3350.0
    flops_efficiency: float = 0.5
    memory_efficiency: float = 0.8
    name: str | None = None

    @property
    def ffn(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        if self.kind == "llama":   # Llama: 2/3 of 4h, rounded up to a multiple of 256
            return int(math.ceil(8 * self.hidden / 3 / 256) * 256)
        return 4 * self.hidden


_CONFIG_FIELDS = {
    "layers": int, "hidden": int, "heads": int, "seq_len": int, "vocab": int, "kind": str, "ffn_hidden": int,
    "kv_heads": int, "microbatch_size": int, "dtype": str, "tflops": float, "hbm_gbs": float,
    "flops_efficiency": float, "memory_efficiency": float, "name": str,
}


# (minimum, maximum) of the numeric fields: far beyond any real model or device, but finite (see topology.limits)
_CONFIG_BOUNDS = {"layers": (1, MAX_LAYERS), "tflops": (1e-3, MAX_TFLOPS), "hbm_gbs": (1e-3, MAX_BANDWIDTH_GBS),
                  "flops_efficiency": (1e-3, 1), "memory_efficiency": (1e-3, 1), "seq_len": (1, 1 << 24), "hidden": (1, 1 << 20),
                  "ffn_hidden": (1, 1 << 22), "vocab": (1, 1 << 24), "heads": (1, 1 << 16), "kv_heads": (1, 1 << 16),
                  "microbatch_size": (1, 1 << 20)}


def config_from_dict(data: Any, *, source: str | None = None) -> GPTConfig:
    """Validate a model configuration (from YAML or JSON); unknown or mistyped fields are named.

    The structure is checked against ``pipesched/schemas/model-config.schema.json`` first.
    """
    validate(data, load_schema("pipesched", "model-config"), source=source, error=ProfileError)
    if not isinstance(data, dict):
        raise ProfileError("expected a mapping of model fields", source=source)
    if "model" in data and isinstance(data["model"], dict):
        data = data["model"]
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key not in _CONFIG_FIELDS:
            raise ProfileError(f"unknown field, expected one of {sorted(_CONFIG_FIELDS)}", source=source, where=key)
        kind = _CONFIG_FIELDS[key]
        if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ProfileError("expected a positive integer", source=source, where=key)
        if kind is float and (not isinstance(value, int | float) or isinstance(value, bool) or value <= 0):
            raise ProfileError("expected a positive number", source=source, where=key)
        if kind is not str:
            lo, hi = _CONFIG_BOUNDS.get(key, (1, 1 << 30))
            check_number(value, what=f"{key} in {lo:g}..{hi:g}", source=source, where=key, minimum=lo, maximum=hi, error=ProfileError)
        if kind is str and not isinstance(value, str):
            raise ProfileError("expected a string", source=source, where=key)
        values[key] = float(value) if kind is float else value
    for key in ("layers", "hidden", "heads", "seq_len", "vocab"):
        if key not in values:
            raise ProfileError("missing required field", source=source, where=key)
    if values.get("kind", "gpt") not in ("gpt", "llama"):
        raise ProfileError("expected 'gpt' or 'llama'", source=source, where="kind")
    if values.get("dtype", "bf16") not in DTYPE_BYTES:
        raise ProfileError(f"expected one of {sorted(DTYPE_BYTES)}", source=source, where="dtype")
    if values["hidden"] % values["heads"]:
        raise ProfileError(f"hidden ({values['hidden']}) must be a multiple of heads ({values['heads']})", source=source, where="heads")
    if "kv_heads" in values and values["heads"] % values["kv_heads"]:
        raise ProfileError("heads must be a multiple of kv_heads", source=source, where="kv_heads")
    for key in ("flops_efficiency", "memory_efficiency"):
        if values.get(key, 0.5) > 1:
            raise ProfileError("expected a fraction in (0, 1]", source=source, where=key)
    return GPTConfig(**values)


def load_model_config(path: str | Path) -> GPTConfig:
    """Read a model configuration from a YAML or JSON file."""
    data = loads_yaml(read_text(path, error=ProfileError), source=str(path), error=ProfileError)
    return config_from_dict(data, source=str(path))


def _roofline(flops: float, nbytes: float, cfg: GPTConfig) -> float:
    """Time of a kernel group: the slower of its compute and its memory traffic at the achieved peaks."""
    return max(flops / (cfg.tflops * 1e12 * cfg.flops_efficiency), nbytes / (cfg.hbm_gbs * 1e9 * cfg.memory_efficiency))


def analytic_profile(cfg: GPTConfig) -> ModelProfile:
    """Cost a GPT/Llama configuration layer by layer: embedding, ``layers`` transformer blocks, LM head.

    FLOPs per micro-batch of ``t = b*s`` tokens (matmul FLOPs, 2 per multiply-add): the block's linear layers
    ``2t*h*(h + 2h_kv) + 2t*h^2`` (QKV + output) plus the MLP (``4t*h*f`` GELU, ``6t*h*f`` SwiGLU); the attention
    core ``4b*s^2*h`` (QK^T and AV). The input gradient costs the linear FLOPs again plus twice the attention core
    (it has no weights); the weight gradient costs the linear FLOPs. The LM head is a ``h x V`` matmul
    (``2t*h*V`` in each of F, I and W) with an FP32 softmax cross-entropy over the logits; the embedding is a
    gather whose cost is memory traffic only; its weight gradient is dense (torch zero-fills a gradient of the
    whole table, scatter-adds into it and adds that into ``.grad``: four passes over the table). Each part's
    time is a roofline ``max(FLOPs/FLOP/s, bytes/bandwidth)``.

    Activation memory per block follows Korthikanti et al. (2022, Table 2 and eq. 1-2) for ``kind="gpt"``:
    ``s*b*h*(34 + 5*a*s/h)`` bytes at 16-bit; selective recomputation drops the ``5*a*s^2*b`` attention-score
    term (softmax, its dropout mask and output) and recomputes the attention core; full recomputation keeps only
    the ``2*s*b*h`` input. For ``kind="llama"`` the same accounting applied to a block without dropout, with
    SwiGLU and grouped KV heads gives ``s*b*(6h + 4h*kv/a + 4h + 8f) + 2*a*s^2*b`` (the attention-score part
    recomputed under "selective"). Sizes scale with ``dtype`` relative to 16 bits (the 1-byte dropout masks are
    scaled too, a small over-estimate for FP32).
    """
    dt = DTYPE_BYTES[cfg.dtype]
    scale = dt / 2.0
    b, s, h, a, v = cfg.microbatch_size, cfg.seq_len, cfg.hidden, cfg.heads, cfg.vocab
    f = cfg.ffn
    kv = cfg.kv_heads or a
    h_kv = h * kv // a
    t = b * s

    lin_flops = 2 * t * h * (h + 2 * h_kv) + 2 * t * h * h + (6 if cfg.kind == "llama" else 4) * t * h * f
    core_flops = 4 * b * s * s * h
    block_params = h * (h + 2 * h_kv) + h * h + (3 if cfg.kind == "llama" else 2) * h * f
    if cfg.kind == "gpt":
        block_params += (h + 2 * h_kv) + h + f + h + 4 * h   # biases and two LayerNorms
        base = 34 * s * b * h
        wgrad = (2 + 2 + 2 + 8) * s * b * h                 # inputs of QKV, proj, fc1, fc2
    else:
        block_params += 2 * h                               # two RMSNorm weights
        base = s * b * (6 * h + 4 * h_kv + 4 * h + 8 * f)
        wgrad = 2 * s * b * (3 * h) + 2 * s * b * f          # inputs of QKV, proj, gate/up (shared) and down
    scores = (5 if cfg.kind == "gpt" else 2) * a * s * s * b
    saved_none = int((base + scores) * scale)
    saved_sel = int(base * scale)
    saved_full = int(2 * s * b * h * scale)
    pbytes = block_params * dt
    act_out = t * h * dt

    f_block = _roofline(lin_flops, pbytes + saved_none, cfg) + _roofline(core_flops, scores * scale, cfg)
    i_block = _roofline(lin_flops, pbytes + saved_none, cfg) + _roofline(2 * core_flops, 2 * scores * scale, cfg)
    w_block = _roofline(lin_flops, 2 * pbytes + wgrad * scale, cfg)
    recompute_sel = _roofline(core_flops, scores * scale, cfg)
    layers = []

    emb_params = v * h + (s * h if cfg.kind == "gpt" else 0)
    layers.append(LayerProfile(
        name="embedding", fwd_s=_roofline(0, 2 * act_out, cfg), bwd_input_s=0.0,
        # W: torch's embedding backward scatter-adds the output gradient into a dense, zero-filled gradient of the
        # whole table, which is then added into the weight's .grad: 4 table-sized passes besides the scatter.
        bwd_weight_s=_roofline(t * h, 3 * act_out + 4 * emb_params * dt, cfg),
        output_bytes=act_out, param_bytes=emb_params * dt,
        saved_bytes={k: 8 * t for k in RECOMPUTE_OPTIONS},  # int64 token ids
        recompute_s={k: 0.0 for k in RECOMPUTE_OPTIONS}, weight_grad_bytes=8 * t,
    ))
    for i in range(cfg.layers):
        layers.append(LayerProfile(
            name=f"block{i}", fwd_s=f_block, bwd_input_s=i_block, bwd_weight_s=w_block, output_bytes=act_out, param_bytes=pbytes,
            saved_bytes={"none": saved_none, "selective": saved_sel, "full": saved_full},
            recompute_s={"none": 0.0, "selective": recompute_sel, "full": f_block}, weight_grad_bytes=int(wgrad * scale),
        ))
    head_flops = 2 * t * h * v
    logits = 4 * t * v                                     # FP32 logits kept for the softmax cross-entropy backward
    head_saved = 2 * t * h * dt + logits
    head_params = v * h + h
    f_head = _roofline(head_flops, head_params * dt + logits, cfg)
    layers.append(LayerProfile(
        name="lm_head", fwd_s=f_head, bwd_input_s=_roofline(head_flops, head_params * dt + 2 * logits, cfg),
        bwd_weight_s=_roofline(head_flops, 2 * head_params * dt + logits, cfg), output_bytes=4, param_bytes=head_params * dt,
        saved_bytes={"none": head_saved, "selective": head_saved, "full": t * h * dt},
        recompute_s={"none": 0.0, "selective": 0.0, "full": f_head}, weight_grad_bytes=t * h * dt + logits,
    ))
    name = cfg.name or f"{cfg.kind}-L{cfg.layers}-h{h}-s{s}"
    return ModelProfile(name=name, layers=tuple(layers), source="analytic", microbatch_size=b, state_factor=16.0 / dt,
                        reference={"name": "analytic", "tflops": cfg.tflops, "hbm_gbs": cfg.hbm_gbs})


# --------------------------------------------------------------------------------------------------------------
# Measured profiles
# --------------------------------------------------------------------------------------------------------------

def _tensor_bytes(t) -> int:
    return t.numel() * t.element_size()


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# The largest mmap threshold glibc accepts on 64-bit hosts (its DEFAULT_MMAP_THRESHOLD_MAX): buffers up to 32 MiB then come from the heap.
RETAINED_BUFFER_MAX_BYTES = 32 << 20


def retain_freed_memory() -> bool:
    """Make this process's C allocator keep freed buffers for reuse instead of handing them back to the OS (glibc only).

    torch's CPU tensors come from glibc's ``malloc``. By default a buffer above its (dynamic) mmap threshold
    is mapped fresh and unmapped on free, and the top of the heap is trimmed, so whether the next buffer of
    that size page-faults in again depends on the process's allocation history. torch's split backward
    allocates a fresh weight gradient in every W (``stage_backward_weight`` takes it from ``autograd.grad``
    and adds it into ``.grad``), where the fused backward accumulates in place: on this machine's 2-stage
    MLP the wide stage's W took 6816 minor page faults (27 MB) and 43 ms per micro-batch inside a step,
    against 0 faults and 24 ms with freed memory retained, while a per-layer profile saw anything in
    between. Fixing the mmap threshold at its maximum (:data:`RETAINED_BUFFER_MAX_BYTES`) and never
    trimming makes every buffer up to that size reused, as torch's caching allocator does on a GPU, in the
    profile and in the runs alike. Returns whether it applied (``False`` without glibc's ``mallopt``).

    >>> isinstance(retain_freed_memory(), bool)
    True
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(_M_MMAP_THRESHOLD, RETAINED_BUFFER_MAX_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def measure_profile(layers: Sequence[Any], example_input: Any, *, loss_fn: Callable[[Any], Any] | None = None,
                    repeats: int = 5, warmup: int = 1, threads: int | None = None, name: str = "measured",
                    state_factor: float = 4.0, statistic: str = "median", clock: str = "wall", passes: int = 1) -> ModelProfile:
    """Run a chain of ``torch.nn.Module`` layers (CPU, or a CUDA GPU) and time and size every layer for one micro-batch.

    For each layer (fed the previous layer's real output): the forward time; the input-gradient time and then the
    weight-gradient time as torch's pipeline runtime splits a backward (``stage_backward_input``, which keeps the
    gradients flowing into the weight operations, then ``stage_backward_weight`` from them, so I + W is about the
    fused backward); and one fused backward over inputs and weights.
    Times are medians over ``repeats`` (``statistic="min"``: minima). ``clock="wall"`` times with
    ``time.perf_counter``; ``clock="cpu"`` with ``time.thread_time``, the CPU time of the measuring thread, which
    does not count the time the thread waits for a core (another process runs) and so gives the work a rank
    must get done whatever the sharing; the simulator's processor sharing then turns work into wall time.
    The fused backward runs as in training: ``torch.autograd.backward`` accumulating into the parameters'
    ``.grad``, zero-filled before the first repetition (a micro-batch's backward adds into existing gradients; a
    fresh ``autograd.grad`` would instead allocate new gradient buffers each time, whose page faults cost the CPU
    ~1 ms per 10 MB here and are absent from a pipelined step). The layer's own ``.grad`` are restored on return.
    Saved activations are counted with ``torch.autograd.graph.saved_tensors_hooks`` (each saved tensor once,
    parameters excluded) and attributed to the layer's direct child module that was running. "selective"
    recomputation drops what parameter-free children (activations, norms without weights, softmax, dropout) saved
    and pays their forward time again; "full" keeps only the layer input and pays the whole forward.
    ``weight_grad_bytes`` is what children with parameters saved (their inputs, needed by W). The last layer is
    followed by ``loss_fn`` (if given), whose cost is charged to it.
    With ``passes`` > 1 the repetitions are spread over that many passes through the whole chain (``repeats /
    passes`` per layer and pass, rounded up; ``warmup`` untimed ones in the first pass, one in later passes) and
    each statistic is taken over all passes' samples: every layer is then timed across the whole profiling window,
    not in one burst of a fraction of a second, so a momentary slowdown of the machine (on this virtual machine
    the same work's CPU time swings by 20-30 % within seconds) is spread over all layers instead of landing on a few.
    ``state_factor`` 4 is FP32 weights + grads + Adam's two moments. On a CPU the process's allocator is first set to
    keep freed buffers (:func:`retain_freed_memory`, as the runner's ranks are), and ``reference["threads"]`` records
    torch's intra-op thread count the layers were timed with (the ranks must run with the same).
    On a GPU (``example_input`` and the layers on a CUDA device) every clock reading waits for the device first
    (``torch.cuda.synchronize``), so a time is the layer's kernels plus their launches; ``clock="cpu"`` is
    refused there (the host thread's CPU time says nothing about the device's work).

    >>> import torch
    >>> layers = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU()), torch.nn.Linear(16, 4)]
    >>> prof = measure_profile(layers, torch.randn(2, 8), repeats=1)
    >>> prof.layers[0].param_bytes, prof.layers[1].output_bytes
    (576, 32)
    """
    import torch

    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    on_gpu = bool(torch.is_tensor(example_input) and example_input.is_cuda)
    if on_gpu and clock != "wall":
        raise ValueError(f"clock={clock!r} cannot time GPU work: use clock='wall' (it waits for the device)")
    layer_clock = "cuda" if on_gpu else clock
    stat = {"median": statistics.median, "min": min}[statistic]
    per_pass = -(-repeats // passes)
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    measured_threads = torch.get_num_threads()
    retained = retain_freed_memory() if not on_gpu else False
    try:
        results: list[LayerProfile] = []
        pooled: list[dict[str, list[float]]] = [{} for _ in layers]
        for k in range(passes):
            x = example_input
            for index, layer in enumerate(layers):
                is_last = index == len(layers) - 1
                lay = _measure_layer(torch, layer, x, loss_fn if is_last else None, per_pass if passes > 1 else repeats,
                                     warmup if k == 0 else min(warmup, 1), f"layer{index}", statistic, layer_clock, samples=pooled[index])
                if k == 0:
                    results.append(lay)
                with torch.no_grad():
                    x = layer(x)
    finally:
        torch.set_num_threads(old_threads)
    if passes > 1:
        results = [_from_samples(lay, smp, stat) for lay, smp in zip(results, pooled, strict=True)]
    batch = example_input.shape[0] if hasattr(example_input, "shape") and example_input.dim() else 1
    return ModelProfile(name=name, layers=tuple(results), source="measured", microbatch_size=int(batch), state_factor=state_factor,
                        reference={"name": torch.cuda.get_device_name(example_input.device) if on_gpu else "cpu",
                                   "threads": measured_threads, "retain_freed_memory": retained, "statistic": statistic, "clock": clock,
                                   "repeats": per_pass * passes, "passes": passes})


def _from_samples(lay: LayerProfile, samples: dict[str, list[float]], stat) -> LayerProfile:
    """``lay`` (sizes from one pass) with its times recomputed from pooled samples of all passes."""
    fwd = stat(samples["f"])
    return replace(lay, fwd_s=fwd, bwd_input_s=stat(samples["i"]), bwd_weight_s=stat(samples["w"]), bwd_full_s=stat(samples["full"]),
                   recompute_s={"none": 0.0, "selective": stat(samples["sel"]) if samples["cheap"][0] else 0.0, "full": fwd})


def _measure_layer(torch, layer, x, loss_fn, repeats: int, warmup: int, name: str, statistic: str = "median",
                   clock: str = "wall", samples: dict[str, list[float]] | None = None) -> LayerProfile:
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    stat = {"median": statistics.median, "min": min}[statistic]
    def synced() -> float:   # the device's queued work is part of what is being timed
        torch.cuda.synchronize()
        return time.perf_counter()

    now = {"wall": time.perf_counter, "cpu": time.thread_time, "cuda": synced}[clock]
    params = [p for p in layer.parameters() if p.requires_grad]
    old_grads = [p.grad for p in params]      # restored on return; the fused backward accumulates into zeroed ones
    for p in params:
        # Zeros, not None: even the first timed fused backward then adds into existing gradients, as all but the
        # first micro-batch of a step do (into None autograd would just keep its result, saving the add: ~40 %
        # of a wide block's backward here, which a profile taken with warmup=0 would otherwise miss).
        p.grad = torch.zeros_like(p)
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    needs_input_grad = torch.is_tensor(x) and x.is_floating_point()
    children = list(layer.named_children())
    child_has_params = {cname: any(True for _ in child.parameters()) for cname, child in children}
    current: list[str | None] = [None]
    child_time: dict[str, float] = {}
    starts: dict[str, float] = {}

    def pre(cname):
        def hook(_mod, _inp):
            current[0] = cname
            starts[cname] = now()
        return hook

    def post(cname):
        def hook(_mod, _inp, _out):
            child_time[cname] = child_time.get(cname, 0.0) + now() - starts[cname]
            current[0] = None
        return hook

    handles: list[Any] = []

    def hook_children() -> None:
        for cname, child in children:
            handles.append(child.register_forward_pre_hook(pre(cname)))
            handles.append(child.register_forward_hook(post(cname)))

    def unhook_children() -> None:
        for h in handles:
            h.remove()
        handles.clear()

    def run_forward():
        inp = x.detach().requires_grad_(needs_input_grad) if torch.is_tensor(x) else x
        out = layer(inp)
        if loss_fn is not None:
            out = loss_fn(out)
        return inp, out

    f_times, i_times, w_times, full_times, sel_times = [], [], [], [], []
    saved: dict[tuple[int, int], tuple[int, str | None]] = {}
    try:
        for rep in range(warmup + repeats):
            t0 = now()
            inp, out = run_forward()
            t1 = now()
            grad_out = torch.ones_like(out) if out.dim() == 0 else torch.randn_like(out)
            inputs = [inp] if needs_input_grad else []
            t2 = now()
            if inputs and params:
                # torch's own split backward, as its runtime runs I and W: I keeps the gradients flowing into the
                # weight operations, W starts from them. (autograd.grad to the parameters on the retained graph
                # would back-propagate through the layer's inside a second time: +44 % on a wide MLP block here.)
                _, groups = stage_backward_input([out], [grad_out], inputs, iter(params))
                t3 = now()
                stage_backward_weight(iter(params), groups)
            elif inputs:
                torch.autograd.grad(out, inputs, grad_out, allow_unused=True)
                t3 = now()
            else:
                # No input gradient (token ids in): torch's runtime runs the whole backward as W.
                t3 = now()
                if params:
                    torch.autograd.grad(out, params, grad_out, allow_unused=True)
            t4 = now()
            child_time.clear()
            # The children are timed (for selective recomputation) in this second forward only, so that the
            # timed forward above carries no hook overhead and each child's time is counted once.
            hook_children()
            try:
                inp, out = run_forward()
            finally:
                unhook_children()
            t5 = now()
            if inputs or params:
                # this forward's input (not the first one's, which is not in this graph: its gradient would be skipped,
                # and with it the first matmul's input-gradient product, a quarter of an MLP block's backward)
                torch.autograd.backward(out, grad_out, inputs=([inp] if needs_input_grad else []) + params)
            t6 = now()
            if rep >= warmup:
                f_times.append(t1 - t0)
                i_times.append(t3 - t2)
                w_times.append(t4 - t3)
                full_times.append(t6 - t5)
                sel_times.append(sum(child_time.get(c, 0.0) for c, _ in children if not child_has_params[c]))

        def pack(t):
            # Count each saved tensor (view) once; parameters are weights, not activations.
            if t.untyped_storage().data_ptr() not in param_storages:
                key = (t.data_ptr(), _tensor_bytes(t))
                saved.setdefault(key, (key[1], current[0]))
            return t

        hook_children()      # the pack hook attributes each saved tensor to the child that was running
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            inp, out = run_forward()
        output_bytes = _tensor_bytes(out) if loss_fn is None else 4
        del inp, out
    finally:
        unhook_children()
        for prm, old in zip(params, old_grads, strict=True):
            prm.grad = old

    total = sum(nbytes for nbytes, _ in saved.values())
    cheap = sum(nbytes for nbytes, owner in saved.values() if owner is not None and not child_has_params[owner])
    if samples is not None:
        for key, values in (("f", f_times), ("i", i_times), ("w", w_times), ("full", full_times), ("sel", sel_times)):
            samples.setdefault(key, []).extend(values)
        samples["cheap"] = [float(cheap)]
    wgrad = sum(nbytes for nbytes, owner in saved.values() if owner is None or child_has_params[owner])
    input_bytes = _tensor_bytes(x) if torch.is_tensor(x) else 0
    fwd = stat(f_times)
    return LayerProfile(
        name=name, fwd_s=fwd, bwd_input_s=stat(i_times), bwd_weight_s=stat(w_times),
        output_bytes=output_bytes, param_bytes=sum(_tensor_bytes(p) for p in params),
        saved_bytes={"none": total, "selective": max(total - cheap, min(total, input_bytes)), "full": min(total, input_bytes)},
        recompute_s={"none": 0.0, "selective": stat(sel_times) if cheap else 0.0, "full": fwd},
        weight_grad_bytes=min(wgrad, total), bwd_full_s=stat(full_times),
    )
