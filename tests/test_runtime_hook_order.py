"""The DDP hook called directly, with collectives whose completion the test controls: transfers go in the plan's order,
each as soon as its buckets are in and the credit allows (never later, never over the credit), and fused or in-place
pieces land back in the gradients."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from netweave.runtime.ddp import PlannedAllReduce, make_plan


@pytest.fixture(scope="module", autouse=True)
def one_rank_group(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "f"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _Work:
    def __init__(self, buf):
        self.buf, self.fut = buf, torch.futures.Future()

    def get_future(self):
        return self.fut

    def finish(self):
        self.buf.mul_(2)            # a stand-in for the sum: every element reduced exactly once doubles
        self.fut.set_result([self.buf])

    def wait(self):                 # the thread path waits: the collective completes then
        if not self.fut.done():
            self.finish()
        return True


class _Dist:
    """``torch.distributed`` as the hook uses it, with works completed only when the test says so."""

    def __init__(self):
        self.works: list[tuple[int, _Work]] = []    # (transfer size in elements, work) in issue order

    def all_reduce(self, buf, group=None, async_op=False):
        w = _Work(buf)
        self.works.append((buf.numel(), w))
        return w


class _GradBucket:
    def __init__(self, params, grads):
        self.buffer_ = torch.cat([g.view(-1) for g in grads])
        self.params, pos, self.views = params, 0, []
        for g in grads:
            self.views.append(self.buffer_[pos:pos + g.numel()].view(g.shape))
            pos += g.numel()

    def parameters(self):
        return self.params

    def gradients(self):
        return self.views

    def buffer(self):
        return self.buffer_


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 60), min_size=1, max_size=8), policy=st.sampled_from(["ddp", "bytescheduler", "prophet"]),
       partition=st.integers(8, 200), credit_parts=st.integers(1, 4), seed=st.integers(0, 10**6))
def test_direct_hook_issues_the_plans_transfers_in_order_under_the_credit(sizes, policy, partition, credit_parts, seed):
    rnd = random.Random(seed)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    knobs = {"bucket_cap_bytes": 4 * partition, "first_bucket_bytes": partition} if policy == "ddp" else {}
    plan = make_plan([(f"p{i}", n, 4) for i, n in enumerate(sizes)], policy, partition_bytes=partition,
                     credit_bytes=None if policy == "ddp" else credit_parts * partition, knobs=knobs)
    hook = PlannedAllReduce(plan, params, direct=True)
    assert hook._thread is None
    fake = hook.dist = _Dist()
    # DDP's buckets: runs of parameters in reverse order (gradient-ready order)
    order = list(range(len(sizes)))[::-1]
    cuts = sorted(rnd.sample(range(1, len(order)), rnd.randint(0, len(order) - 1))) if len(order) > 1 else []
    groups = [order[a:b] for a, b in zip([0, *cuts], [*cuts, len(order)], strict=True)]
    values = {i: torch.randn(n) for i, n in enumerate(sizes)}
    buckets = [_GradBucket([params[i] for i in g], [values[i].clone() for i in g]) for g in groups]
    futures, delivered, pending = [], set(), []
    credit = plan.credit_bytes or float("inf")

    def check_eager():
        issued = len(fake.works)
        flying = sum(plan.transfer_bytes(k) for k in pending)
        assert flying <= credit or len(pending) == 1
        if issued < len(plan.transfers):     # the next transfer is held back only for a missing bucket or the credit
            nxt = plan.transfers[issued]
            assert (any(p.param not in delivered for p in nxt) or (pending and flying + plan.transfer_bytes(issued) > credit))

    for g, b in zip(groups, buckets, strict=True):
        futures.append(hook.hook(None, b))
        delivered |= set(g)
        pending = [j for j in range(len(fake.works)) if not fake.works[j][1].fut.done()]
        check_eager()
        while pending and rnd.random() < 0.5:          # some complete while the backward goes on
            k = pending.pop(0)
            fake.works[k][1].finish()
            pending = [j for j in range(len(fake.works)) if not fake.works[j][1].fut.done()]
            check_eager()
    while pending:
        fake.works[pending[0]][1].finish()
        pending = [j for j in range(len(fake.works)) if not fake.works[j][1].fut.done()]
        check_eager()
    # the plan's transfers, all, in order, each of the plan's size
    assert [n for n, _ in fake.works] == [sum(p.count for p in t) for t in plan.transfers]
    assert hook.log[-1]["order"] == list(range(len(plan.transfers)))
    # every bucket complete, every element reduced exactly once, back in the bucket's buffer
    for g, b, f in zip(groups, buckets, futures, strict=True):
        assert f.done()
        assert torch.equal(f.value(), b.buffer())
        for i, v in zip(g, b.views, strict=True):
            assert torch.equal(v.view(-1), 2 * values[i]), (i, policy)
    assert hook._it.next == 0 and not hook._it.grads     # ready for the next backward pass


def test_a_whole_bucket_transfer_is_reduced_in_place():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (5, 7, 3)]
    plan = make_plan([(f"p{i}", p.numel(), 4) for i, p in enumerate(params)], "ddp", knobs={"bucket_cap_bytes": 1 << 20})
    assert [[p.param for p in t] for t in plan.transfers] == [[2, 1, 0]]
    hook = PlannedAllReduce(plan, params)
    fake = hook.dist = _Dist()
    bucket = _GradBucket([params[2], params[1], params[0]], [torch.ones(3), torch.ones(7), torch.ones(5)])
    fut = hook.hook(None, bucket)
    (n, work), = fake.works
    assert n == 15 and work.buf.data_ptr() == bucket.buffer().data_ptr()    # no concatenation: the bucket's own buffer
    work.finish()
    assert fut.done() and torch.equal(bucket.buffer(), torch.full((15,), 2.0))


@settings(max_examples=15, deadline=None)
@given(sizes=st.lists(st.integers(1, 60), min_size=1, max_size=8), policy=st.sampled_from(["ddp", "bytescheduler", "prophet"]),
       partition=st.integers(8, 200), seed=st.integers(0, 10**6))
def test_thread_and_direct_paths_issue_the_same_transfers_with_the_same_result(sizes, policy, partition, seed):
    rnd = random.Random(seed)
    plan = make_plan([(f"p{i}", n, 4) for i, n in enumerate(sizes)], policy, partition_bytes=partition,
                     credit_bytes=None if policy == "ddp" else 2 * partition)
    values = {i: torch.randn(n) for i, n in enumerate(sizes)}
    order = list(range(len(sizes)))[::-1]
    cuts = sorted(rnd.sample(range(1, len(order)), rnd.randint(0, len(order) - 1))) if len(order) > 1 else []
    groups = [order[a:b] for a, b in zip([0, *cuts], [*cuts, len(order)], strict=True)]
    outcome = []
    for direct in (True, False):
        params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
        hook = PlannedAllReduce(plan, params, direct=direct)
        fake = hook.dist = _Dist()
        buckets = [_GradBucket([params[i] for i in g], [values[i].clone() for i in g]) for g in groups]
        futures = [hook.hook(None, b) for b in buckets]
        if direct:
            while any(not w.fut.done() for _, w in fake.works):
                next(w for _, w in fake.works if not w.fut.done()).finish()
        for f in futures:
            f.wait()
        hook.close()
        outcome.append(([n for n, _ in fake.works], hook.log[-1]["order"], [b.buffer().tolist() for b in buckets]))
    assert outcome[0] == outcome[1]
    assert outcome[0][1] == list(range(len(plan.transfers)))
