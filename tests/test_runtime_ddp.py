"""The runtime's DDP hook on two gloo ranks: the example's transformer trains exactly as plain DDP does, for every policy,
with pieces small enough that buckets really split; a rank whose model differs gives the same clear error on every rank."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from runtime_helpers import example, free_port, one_host_plan

from netweave.runtime import plan as jp

STEPS = 3
CASES = [("ddp", None, None, {"bucket_cap_bytes": 8192, "first_bucket_bytes": 4096}),
         ("bytescheduler", 2048, 4096, {}),
         ("prophet", 2048, None, {"bandwidth_Bps": 2e5, "backward_s": 0.1})]


def _train(ex, model, rank, step_fn):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = ex.batch(step, rows=4, seq=16, vocab=64, seed=0, rank=rank)
        opt.zero_grad(set_to_none=True)
        ex.loss_fn(model(x), y).backward()
        opt.step()
        step_fn()


def _worker(rank, port, plans, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from torch.nn.parallel import DistributedDataParallel as DDP

    import netweave.runtime as nw

    ex = example()
    try:
        for policy, path in plans:
            job = nw.init(path)
            ddp = job.data_parallel(ex.build_model(seed=0))
            _train(ex, ddp, rank, lambda: None)
            plain = DDP(ex.build_model(seed=0))
            _train(ex, plain, rank, lambda: None)
            got = {n: p.detach().numpy().copy() for n, p in ddp.module.named_parameters()}   # by value through the queue
            want = {n: p.detach().numpy().copy() for n, p in plain.module.named_parameters()}
            out.put((rank, policy, got, want, job.comm_plan.to_dict(), job.hook.log))
            job.hook.close()
        # a rank whose model differs: wider on rank 1
        job = nw.init(plans[0][1])
        try:
            job.data_parallel(ex.build_model(width=32 if rank == 0 else 48, seed=0))
            out.put((rank, "mismatch", None))
        except nw.ModelMismatchError as exc:
            out.put((rank, "mismatch", str(exc)))
    except Exception as exc:  # reported to the test, not hung
        import traceback

        out.put((rank, "error", f"{exc}\n{traceback.format_exc()}"))
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plans")
    port = free_port()
    plans = []
    for policy, part, credit, knobs in CASES:
        path = tmp / f"{policy}.json"
        path.write_text(jp.dumps(one_host_plan(2, port=port, policy=policy, partition_bytes=part, credit_bytes=credit, knobs=knobs)))
        plans.append((policy, str(path)))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, plans, out)) for r in range(2)]
    for p in procs:
        p.start()
    res: dict = {}
    try:
        for _ in range(2 * (len(CASES) + 1)):
            msg = out.get(timeout=180)
            assert msg[1] != "error", msg[2]
            res[(msg[0], msg[1])] = msg[2:]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
    return res


@pytest.mark.parametrize("policy", [c[0] for c in CASES])
def test_hook_trains_every_parameter_as_plain_ddp(results, policy):
    for rank in range(2):
        got, want, plan, log = results[(rank, policy)]
        assert got.keys() == want.keys() and "1.attn.in_proj_weight" in got and "0.positions" in got
        for name in want:
            assert torch.allclose(torch.from_numpy(got[name]), torch.from_numpy(want[name]), atol=1e-5, rtol=1e-4), (policy, rank, name)
        assert set(plan["names"]) == set(got)
        # the buckets really split: more transfers than parameters, or (ddp) several parameters per transfer
        pieces = sum(len(t) for t in plan["transfers"])
        assert pieces > len(plan["names"]) or policy == "ddp"
        assert len(plan["transfers"]) > 1
        # every iteration issued the plan's transfers in the plan's order
        assert [it["order"] for it in log] == [list(range(len(plan["transfers"])))] * STEPS
    assert results[(0, policy)][2] == results[(1, policy)][2]   # one plan, broadcast from rank 0


def test_bytescheduler_sends_front_layers_first_once_ready(results):
    plan = results[(0, "bytescheduler")][2]
    names = plan["names"]
    first_param = [t[0][0] for t in plan["transfers"]]
    # the last parameter's gradient is ready first and goes first; the embedding (front) is not last in the order
    assert first_param[0] == len(names) - 1
    assert first_param.index(0) < len(first_param) - 1


def test_a_rank_whose_model_differs_fails_on_every_rank(results):
    msgs = [results[(r, "mismatch")][0] for r in range(2)]
    assert all(m is not None for m in msgs)
    assert msgs[0] == msgs[1]
    assert "data_parallel: rank 1's model differs from rank 0's" in msgs[0] and "here" in msgs[0] and "\n" not in msgs[0]
