"""The gradient scheduler on real gloo all-reduces between two processes."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flowsched.ddp import GradientScheduler, ddp_bucket_caps, timed_comm_hook
from flowsched.gradients import analytic_gradient_profile, gradient_layers, layer_parameters
from flowsched.intrajob import bytescheduler_plan, ddp_plan, prophet_plan

STEPS = 3
LR = 0.1


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def layers_of(model):
    return gradient_layers(model)


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def make_plan(kind, model):
    sizes = [sum(p.numel() * 4 for p in m.parameters()) for m in layers_of(model)]
    prof = analytic_gradient_profile(["a", "b", "c"], sizes, [1e-3] * 3, [1e-3] * 3, bandwidth=1e-3, overhead=1e-5)
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
            sched = GradientScheduler(layers_of(model), plan, optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=LR), compress=compress,
                                      model=model)
            for step in range(STEPS):
                x, y = batch(rank, step)
                loss = torch.nn.functional.mse_loss(model(x), y)
                sched.begin_iteration()
                loss.backward()
            sched.synchronize(step=True)
            orders = [list(log.order) for log in sched.logs]
            sched.close()
            out.put((rank, kind, compress, [p.detach().numpy().copy() for p in model.parameters()], orders))
        out.put((rank, "mha", None, *mha_transformer(rank)))
        out.put((rank, "ddp-caps", None, *ddp_with_caps(rank)))
    finally:
        dist.destroy_process_group()


def transformer_batch(rank, step):
    from runtime_helpers import example

    return example().batch(step, rows=2, seq=16, vocab=64, seed=0, rank=rank)


def transformer():
    from runtime_helpers import example

    return example().build_model(width=8, depth=1, heads=2, seed=0)


def mha_transformer(rank):
    """The example's transformer (nn.MultiheadAttention: in_proj_weight is a non-leaf module's) under the scheduler."""
    from runtime_helpers import example

    model = transformer()
    layers = gradient_layers(model)
    sizes = [sum(p.numel() * 4 for p in ps) for ps in layer_parameters(layers)]
    prof = analytic_gradient_profile([str(i) for i in range(len(layers))], sizes, [1e-3] * len(layers), [1e-3] * len(layers), bandwidth=1e-3)
    sched = GradientScheduler(layers, bytescheduler_plan(prof, partition=256, credit=512), model=model,
                              optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=LR))
    for step in range(STEPS):
        x, y = transformer_batch(rank, step)
        loss = example().loss_fn(model(x), y)
        sched.begin_iteration()
        loss.backward()
    sched.synchronize(step=True)
    sched.close()
    return [p.detach().numpy().copy() for p in model.parameters()], None


def ddp_with_caps(rank):
    """Each rank plans from its own (different) profile; ddp_bucket_caps agrees on rank 0's caps, so DDP runs."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model = make_model()
    plan = prophet_plan(analytic_gradient_profile(["a", "b", "c"], [1 << 20, 3 << 20, 2 << 20], [1e-3] * 3, [1e-3] * 3,
                                                  bandwidth=1.0 * (1 + rank)), partition=(1 + rank) << 20)
    caps = ddp_bucket_caps(plan)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb_list=caps)
    hook, log = timed_comm_hook(default_hooks.allreduce_hook)
    ddp.register_comm_hook(None, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().numpy().copy() for p in model.parameters()], (caps, len(log))


def reference_params(build=make_model, data=batch, loss=torch.nn.functional.mse_loss):
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        for rank in range(2):
            x, y = data(rank, step)
            (loss(model(x), y) / 2).backward()
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
    for _ in range(2 * (len(CASES) + 2)):
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


def test_scheduler_trains_multihead_attention_parameters(two_rank_results):
    from runtime_helpers import example

    ref = reference_params(transformer, transformer_batch, example().loss_fn)
    start = [p.detach() for p in transformer().parameters()]
    names = [n for n, _ in transformer().named_parameters()]
    for rank in range(2):
        params, _ = two_rank_results[(rank, "mha", None)]
        for name, got, want, before in zip(names, params, ref, start, strict=True):
            assert torch.allclose(torch.from_numpy(got), want, atol=1e-5), (rank, name)
            assert not torch.equal(want, before), name          # every parameter, in_proj_weight included, was trained


def test_scheduler_refuses_layers_that_miss_parameters():
    from topology.errors import InputError

    model = transformer()
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        leaves = [m for m in model.modules() if not list(m.children()) and list(m.parameters())]   # the old discovery
        with pytest.raises(InputError, match="in none of the layers, first '0.positions'"):
            GradientScheduler(leaves, ddp_plan(analytic_gradient_profile(["x"] * len(leaves), [1.0] * len(leaves), [1e-3] * len(leaves),
                                                                         [1e-3] * len(leaves), bandwidth=1e-3)), model=model)
    finally:
        dist.destroy_process_group()


def test_ddp_with_agreed_bucket_caps_and_timed_hook(two_rank_results):
    ref = reference_params()
    caps = []
    for rank in range(2):
        params, (rank_caps, logged) = two_rank_results[(rank, "ddp-caps", None)]
        caps.append(rank_caps)
        assert logged >= STEPS                                  # the timed hook was registered and ran every step
        for got, want in zip(params, ref, strict=True):
            assert torch.allclose(torch.from_numpy(got), want, atol=1e-5)
    assert caps[0] == caps[1]                                   # rank 0's caps on both ranks
