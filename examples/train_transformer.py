"""Train a small transformer through netweave's runtime: data parallel or a pipeline, as the job plan says.

A launch script of a ``netweave launch`` bundle runs it (it exports ``NETWEAVE_JOB_PLAN`` and starts torchrun):

    NETWEAVE_JOB_PLAN=$PWD/bundle/job0/plan.json torchrun --nproc-per-node 2 examples/train_transformer.py --steps 20 --out 'r{rank}.json'

The data is synthetic (a fixed token-to-token map to learn, drawn from ``--seed``), so every run with the same
arguments trains the same way. Each rank writes a small JSON result: per-step loss, iteration times, the measured
start against the plan's offset, its rank, and a digest of the parameters it trained (equal on the replicas of a stage).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import netweave.runtime as nw


class Embed(nn.Module):
    """Token embedding plus learned positions (a parameter of this non-leaf module)."""

    def __init__(self, vocab: int, width: int, seq: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Parameter(torch.zeros(seq, width))

    def forward(self, x):
        return self.tokens(x) + self.positions


class Block(nn.Module):
    """Pre-norm transformer block: ``nn.MultiheadAttention`` (its in_proj_weight is a non-leaf parameter) and an MLP."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    def __init__(self, width: int, vocab: int):
        super().__init__()
        self.norm, self.out = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, x):
        return self.out(self.norm(x))


def build_model(*, width: int = 32, depth: int = 2, heads: int = 4, vocab: int = 64, seq: int = 16, seed: int = 0) -> nn.Sequential:
    """The model as a list of blocks (embedding, ``depth`` transformer blocks, head): a pipeline plan's layers index it."""
    torch.manual_seed(seed)
    return nn.Sequential(Embed(vocab, width, seq), *(Block(width, heads) for _ in range(depth)), Head(width, vocab))


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def batch(step: int, *, rows: int, seq: int, vocab: int, seed: int, rank: int = 0):
    """Synthetic tokens and their targets under a fixed random token map (the same map for every step and rank)."""
    table = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    x = torch.randint(vocab, (rows, seq), generator=torch.Generator().manual_seed(seed + 1000 * step + 7 * rank + 1))
    return x, table[x]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--depth", type=int, default=2, help="transformer blocks (a pipeline plan's layers are depth + 2)")
    ap.add_argument("--batch", type=int, default=8, help="rows per step and data-parallel replica")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="result-{rank}.json", help="result file; {rank} is replaced by the rank")
    ap.add_argument("--params-out", help="data parallel: also torch.save the trained parameters by name here ({rank} as for --out)")
    args = ap.parse_args(argv)
    seq, vocab = 16, 64
    try:
        job = nw.init()                                       # reads $NETWEAVE_JOB_PLAN; torchrun gives the rank
        model = build_model(width=args.width, depth=args.depth, vocab=vocab, seq=seq, seed=args.seed)
        if job.plan.pipeline is not None:
            pipe = job.pipeline(model, loss_fn)               # this rank's stages, recomputation and schedule
            params, mode = pipe.parameters(), "pipeline"
        else:
            model = job.data_parallel(model)                  # DDP with the plan's communication hook
            params, mode = list(model.parameters()), "data_parallel"
    except nw.PlanFormatError as exc:                         # the plan does not fit this job or model: one line
        print(f"train_transformer: {exc}", file=sys.stderr)
        return 2
    opt = torch.optim.SGD(params, lr=args.lr)
    losses, iteration_s = [], []
    for step in job.iterations(args.steps):                  # waits out the start offset, then keeps the phase
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if mode == "pipeline":                                # the ranks of one pipeline draw the same batch; stage 0 feeds it
            x, y = batch(step, rows=args.batch, seq=seq, vocab=vocab, seed=args.seed, rank=pipe.replica)
            out = pipe.step(x.to(job.device), y.to(job.device))
            loss = torch.stack(out).mean().item() if out else None
        else:
            x, y = batch(step, rows=args.batch, seq=seq, vocab=vocab, seed=args.seed, rank=job.rank)
            lossv = loss_fn(model(x.to(job.device)), y.to(job.device))
            lossv.backward()
            loss = lossv.item()
        opt.step()
        iteration_s.append(time.perf_counter() - t)
        losses.append(loss)
    result = {"job": job.plan.job, "rank": job.rank, "world_size": job.world_size, "mode": mode, "backend": job.backend,
              "losses": losses, "iteration_s": iteration_s, "timing": job.timing(),
              "comm_plan": job.comm_plan.policy if job.comm_plan else None, "traffic_route": job.traffic_route,
              "params_sha256": hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in params)).hexdigest()}
    with open(args.out.format(rank=job.rank), "w") as f:
        json.dump(result, f)
    if args.params_out and mode == "data_parallel":           # for comparing with plain DDP (tests/test_launch_emulation.py)
        torch.save({n: p.detach().cpu() for n, p in model.module.named_parameters()}, args.params_out.format(rank=job.rank))
    job.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
