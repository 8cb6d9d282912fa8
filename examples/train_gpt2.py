"""Train GPT-2 (token ids, an attention mask, positions, a tied head) as a pipeline, split where the job plan says.

The plan comes from ``netweave launch`` with the model's measured profile (``netweave pipe profile --model
pipesched.gpt2:gpt2 ...``, ``model:`` in the jobs file); a launch script of the bundle runs this under torchrun:

    NETWEAVE_JOB_PLAN=$PWD/bundle/job0/plan.json torchrun --nproc-per-node 2 examples/train_gpt2.py --layers 2 --out 'r{rank}.json'

torch traces the model and cuts it before the submodule that begins each of the plan's stages (``split``: the names
the profile was split at, ``blocks.0``, ..., ``ln_f``). The causal mask is the same for every micro-batch and every
stage needs it: it is passed as a constant (a buffer in each stage); positions are a per-batch input of the first
stage, like the token ids. The data is synthetic: the next token is a fixed function of the current one.
Each rank writes a JSON result: losses, the split points, its stages' parameters (name: elements), a sum of its tied parameters.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

import netweave.runtime as nw
from pipesched.gpt2 import causal_mask, gpt2


def batch(step: int, *, rows: int, seq: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, positions and next-token targets (``(7 * token + 3) mod vocab``), the same on every rank."""
    ids = torch.randint(vocab, (rows, seq), generator=torch.Generator().manual_seed(seed * 1000 + step))
    positions = torch.arange(seq).expand(rows, seq).contiguous()
    return ids, positions, (7 * ids + 3) % vocab


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("layers", 2), ("hidden", 32), ("heads", 2), ("seq-len", 16), ("vocab", 64), ("batch", 8), ("steps", 8), ("seed", 0)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--out", default="gpt2-r{rank}.json", help="result file per rank ({rank} is replaced)")
    args = ap.parse_args(argv)
    try:
        job = nw.init()
        micro = args.batch // job.plan.pipeline.microbatches
        spec = gpt2(args.layers, args.hidden, args.heads, args.seq_len, args.vocab, microbatch=micro, dropout=0.0, seed=args.seed)
        ids, _, positions = spec["args"]                       # one micro-batch of example inputs, for the trace
        run = job.pipeline(spec["model"], loss_fn, example_args=(ids,), example_kwargs={"positions": positions},
                           constants={"mask": causal_mask(args.seq_len)}, split=spec["split"])
    except nw.PlanFormatError as exc:                          # the plan does not fit this job or model: one line
        print(f"train_gpt2: {exc}", file=sys.stderr)
        return 2
    opt = torch.optim.Adam(run.parameters(), lr=args.lr)
    losses = []
    for step in job.iterations(args.steps):
        opt.zero_grad(set_to_none=True)
        ids, positions, target = batch(step, rows=args.batch, seq=args.seq_len, vocab=args.vocab, seed=args.seed)
        out = run.step(ids.to(job.device), target.to(job.device), positions=positions.to(job.device))
        opt.step()
        losses.append(torch.stack(out).mean().item() if out else None)
    stages = {s.stage_index: {n: p.numel() for n, p in s.submod.named_parameters()} for s in run.stages}
    tied = {n: p.detach().double().sum().item() for _, ps in run.tied for p in ps
            for n, q in run.stages[0].submod.named_parameters() if q is p}
    with open(args.out.format(rank=job.rank), "w") as f:
        json.dump({"rank": job.rank, "losses": losses, "boundaries": run.boundaries, "stages": stages, "tied": tied,
                   "recomputed": run.recomputed}, f)
    job.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
