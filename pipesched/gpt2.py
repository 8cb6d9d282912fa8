"""A GPT-2-shaped decoder written out in plain torch, for profiling a real model's pipeline (no downloads).

The layout is GPT-2's (Radford et al. 2019; the shapes of the 124M checkpoint by default): token and position
embeddings, pre-LayerNorm blocks of causal self-attention (one fused QKV projection, explicit ``softmax(QK^T /
sqrt(d) + mask)``, attention dropout) and a GELU MLP of width ``4h``, a final LayerNorm and an LM head whose
weight **is** the token embedding's (tied). Unlike a chain of one-tensor modules, the forward takes extra
arguments that every block needs: the additive attention ``mask`` (``[s, s]``, ``-inf`` above the diagonal for
causal attention, or any padding pattern) and the ``positions`` (``[b, s]`` token positions, e.g. shifted for
packed sequences). :func:`gpt2` builds the model with example inputs for one micro-batch and a cross-entropy
loss on next-token targets, in the form :func:`pipesched.model_profile.profile_model` and ``netweave pipe
profile --model pipesched.gpt2:gpt2`` take. With ``pipe_splits=True`` the forward calls
``torch.distributed.pipelining.pipe_split()`` before every block and before the final LayerNorm.

>>> spec = gpt2(layers=2, hidden=64, heads=4, seq_len=16, vocab=100, microbatch=2)
>>> model, (ids, mask, positions) = spec["model"], spec["args"]
>>> tuple(model(ids, mask, positions).shape), model.lm_head.weight is model.wte.weight
((2, 16, 100), True)
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=2)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(h // self.heads)) + mask
        att = self.attn_drop(F.softmax(scores, dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, s, h)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads, dropout)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(approximate="tanh"), nn.Linear(4 * hidden, hidden), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """GPT-2: ``forward(ids, mask, positions) -> logits``; ``lm_head.weight`` is ``wte.weight``."""

    def __init__(self, layers: int = 12, hidden: int = 768, heads: int = 12, seq_len: int = 1024, vocab: int = 50257,
                 dropout: float = 0.1, pipe_splits: bool = False) -> None:
        super().__init__()
        self.pipe_splits = pipe_splits
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq_len, hidden)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(hidden, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.wte.weight          # tied, as in GPT-2

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(ids) + self.wpe(positions))
        for block in self.blocks:
            if self.pipe_splits:
                torch.distributed.pipelining.pipe_split()
            x = block(x, mask)
        if self.pipe_splits:
            torch.distributed.pipelining.pipe_split()
        return self.lm_head(self.ln_f(x))


def causal_mask(seq_len: int) -> torch.Tensor:
    """The additive causal mask: 0 on and below the diagonal, ``-inf`` above."""
    return torch.full((seq_len, seq_len), float("-inf")).triu(1)


def gpt2(layers: int = 12, hidden: int = 768, heads: int = 12, seq_len: int = 1024, vocab: int = 50257, microbatch: int = 1,
         dropout: float = 0.1, pipe_splits: bool = False, seed: int = 0) -> dict[str, Any]:
    """A :class:`GPT2` (fixed seed) with one micro-batch of example inputs and its next-token cross-entropy loss.

    Returns ``{"model", "args": (ids, mask, positions), "loss_fn", "split": [module names]}``: ``split`` names the
    submodules that begin a segment (every block, then the final LayerNorm), so that the segments are the
    embedding, the blocks and the head, the layer kinds of :func:`pipesched.profile.analytic_profile`.
    """
    import torch.distributed.pipelining  # noqa: F401  (pipe_split)

    for key, value in (("layers", layers), ("hidden", hidden), ("heads", heads), ("seq_len", seq_len), ("vocab", vocab), ("microbatch", microbatch)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
    torch.manual_seed(seed)
    model = GPT2(layers, hidden, heads, seq_len, vocab, dropout, pipe_splits)
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(vocab, (microbatch, seq_len), generator=gen)
    targets = torch.randint(vocab, (microbatch, seq_len), generator=gen)
    positions = torch.arange(seq_len).expand(microbatch, seq_len).contiguous()

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    split = [f"blocks.{i}" for i in range(layers)] + ["ln_f"]
    return {"model": model, "args": (ids, causal_mask(seq_len), positions), "loss_fn": loss_fn, "split": split}
