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


def transformer_chain(blocks: int, dim: int = 64, heads: int = 4, ffn: int = 4, seed: int = 0) -> list[Any]:
    """``blocks`` pre-LayerNorm transformer blocks on ``[batch, seq, dim]`` (causal self-attention, GELU MLP of ``ffn * dim``).

    Each block maps one tensor to one of the same shape, so the chain runs in :func:`pipesched.runner.run_pipeline`
    like :func:`mlp_chain` (with ``input_shape=(seq, dim)``). Attention is torch's ``scaled_dot_product_attention``
    with ``is_causal=True``. Built from a fixed seed: every process that calls it gets the same weights.

    >>> import torch
    >>> layers = transformer_chain(2, dim=16, heads=2)
    >>> x = torch.randn(3, 5, 16)
    >>> tuple(layers[1](layers[0](x)).shape)
    (3, 5, 16)
    """
    import torch
    from torch import nn

    if dim % heads:
        raise ValueError(f"dim {dim} is not a multiple of heads {heads}")

    class TransformerBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1 = nn.LayerNorm(dim)
            self.qkv = nn.Linear(dim, 3 * dim)
            self.proj = nn.Linear(dim, dim)
            self.ln_2 = nn.LayerNorm(dim)
            self.mlp = nn.Sequential(nn.Linear(dim, ffn * dim), nn.GELU(), nn.Linear(ffn * dim, dim))

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = (t.view(b, s, heads, dim // heads).transpose(1, 2) for t in self.qkv(self.ln_1(x)).split(dim, dim=2))
            att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(att.transpose(1, 2).reshape(b, s, dim))
            return x + self.mlp(self.ln_2(x))

    torch.manual_seed(seed)
    return [TransformerBlock() for _ in range(blocks)]
