"""The gradient scheduler on real gloo all-reduces between two processes."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flowsched.ddp import GradientScheduler, ddp_bucket_caps, timed_comm_hook
from flowsched.gradients import analytic_gradient_profile
from flowsched.intrajob import bytescheduler_plan, ddp_plan, prophet_plan

STEPS = 3
LR = 0.1


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def layers_of(model):
    return [m for m in model if isinstance(m, torch.nn.Linear)]


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def make_plan(kind, model):
    sizes = [sum(p.numel() * 4 for p in m.parameters()) for m in layers_of(model)]
    prof = analytic_gradient_profile(["a", "b", "c"], sizes, [1e-3] * 3, [1e-3] * 3, bandwidth=1e6, overhead=1e-5)
    return {
        "ddp": lambda: ddp_plan(prof, bucket_cap=3000, first_bucket=3000),
        "bytescheduler": lambda: bytescheduler_plan(prof, partition=1024, credit=2048),
        "prophet": lambda: prophet_plan(prof, partition=512),
    }[kind]()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CASES = [("ddp", None), ("bytescheduler", None), ("prophet", None), ("bytescheduler", "fp16")]


def worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for kind, compress in CASES:
            model = make_model()
            plan = make_plan(kind, model)
            sched = GradientScheduler(layers_of(model), plan, optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=LR), compress=compress)
            for step in range(STEPS):
                x, y = batch(rank, step)
                loss = torch.nn.functional.mse_loss(model(x), y)
                sched.begin_iteration()
                loss.backward()
            sched.synchronize(step=True)
            orders = [list(log.order) for log in sched.logs]
            sched.close()
            out.put((rank, kind, compress, [p.detach().numpy().copy() for p in model.parameters()], orders))
    finally:
        dist.destroy_process_group()


def reference_params():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        for rank in range(2):
            x, y = batch(rank, step)
            (torch.nn.functional.mse_loss(model(x), y) / 2).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


@pytest.fixture(scope="module")
def two_rank_results():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, 2, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    for _ in range(2 * len(CASES)):
        rank, kind, compress, params, orders = out.get(timeout=120)
        results[(rank, kind, compress)] = (params, orders)
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    return results


@pytest.mark.parametrize("kind,compress", CASES)
def test_scheduled_training_equals_averaged_sgd(two_rank_results, kind, compress):
    ref = reference_params()
    tol = 2e-3 if compress else 1e-5
    plan = make_plan(kind, make_model())
    for rank in range(2):
        params, orders = two_rank_results[(rank, kind, compress)]
        for got, want in zip(params, ref, strict=True):
            assert torch.allclose(torch.from_numpy(got), want, atol=tol), (kind, rank)
        # every rank issued the plan's collectives in the plan's order, every iteration
        assert orders == [list(range(len(plan.transfers)))] * STEPS


def test_bucket_caps_follow_plan_blocks():
    model = make_model()
    plan = make_plan("prophet", model)
    caps = ddp_bucket_caps(plan)
    assert len(caps) == len(plan.transfers) and all(c >= 1 for c in caps)


def test_timed_hook_composes_with_compression_hook():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hook, log = timed_comm_hook(default_hooks.fp16_compress_hook)
    assert callable(hook) and log == []
