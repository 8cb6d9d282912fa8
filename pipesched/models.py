"""Small real models for profiling, running and benchmarking pipelines on CPU.

>>> layers = mlp_chain([32, 128], dim=16)
>>> len(layers), sum(p.numel() for p in layers[1].parameters())
(2, 4240)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def mlp_chain(widths: Sequence[int], dim: int = 64, seed: int = 0) -> list[Any]:
    """Blocks ``Linear(dim, w) -> GELU -> Linear(w, dim)`` with a hidden width per block, so costs differ.

    Built from a fixed seed: every process that calls it gets the same weights.
    """
    import torch
    from torch import nn

    gen = torch.Generator().manual_seed(seed)
    layers = []
    for w in widths:
        block = nn.Sequential(nn.Linear(dim, w), nn.GELU(), nn.Linear(w, dim))
        with torch.no_grad():
            for p in block.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / p.shape[-1]) ** 0.5)
        layers.append(block)
    return layers


def tail_heavy_widths(blocks: int, small: int, large: int, heavy: int | None = None) -> list[int]:
    """``blocks`` widths whose last ``heavy`` (default a third) are wide, like a model ending in a large head.

    An equal-layer-count split puts all the wide blocks on the last stages, so it is unbalanced.

    >>> tail_heavy_widths(6, 8, 64)
    [8, 8, 8, 8, 64, 64]
    """
    heavy = blocks // 3 if heavy is None else heavy
    return [small] * (blocks - heavy) + [large] * heavy
