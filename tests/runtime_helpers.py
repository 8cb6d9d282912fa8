"""Shared by the runtime tests: job plans for one host, the example script as a module, free ports."""

from __future__ import annotations

import importlib.util
import socket
import sys
from pathlib import Path

from netweave.runtime import plan as jp

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "train_transformer.py"


def example():
    """``examples/train_transformer.py`` imported as a module (the file the README shows)."""
    if "train_transformer" not in sys.modules:
        spec = importlib.util.spec_from_file_location("train_transformer", EXAMPLE)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["train_transformer"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["train_transformer"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_host_plan(world: int = 2, *, port: int = 29400, pp: int = 1, policy: str = "ddp", partition_bytes: float | None = None,
                  credit_bytes: float | None = None, knobs: dict | None = None, offset: float = 0.0, period: float | None = None,
                  layers: int = 4, recompute: tuple[str, ...] = ("full", "none"), torch_class: str | None = "Schedule1F1B",
                  actions_csv: str | None = None, microbatches: int = 4) -> jp.JobPlan:
    """A job on one host (127.0.0.1): data parallel with ``policy``, or a pipeline of ``pp`` equal stages over ``layers``."""
    ranks = [jp.Rank(r, "localhost", r, f"localhost/gpu{r}") for r in range(world)]
    hosts = [jp.Host("localhost", 0, world, ",".join(str(r) for r in range(world)))]
    pipeline = dp = None
    if pp > 1:
        per = layers // pp
        stages = tuple(jp.Stage(i, i, (i * per, layers if i == pp - 1 else (i + 1) * per), (), recompute[i]) for i in range(pp))
        pipeline = jp.Pipeline("1F1B", microbatches, stages, torch_class=torch_class, actions_csv=actions_csv)
    else:
        dp = jp.DataParallel(policy, partition_bytes, credit_bytes, True, dict(knobs or {}))
    return jp.JobPlan(job="t", world_size=world, ranks=ranks, hosts=hosts, rendezvous=jp.Rendezvous("127.0.0.1", port),
                      parallelism=jp.Parallelism(dp=world // pp, pp=pp), start_offset_s=offset, period_s=period, data_parallel=dp,
                      pipeline=pipeline)
