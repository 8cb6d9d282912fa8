"""The runtime's pieces in one process: phase slots, parameter coverage, plans, recomputation and one-line errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from runtime_helpers import example, one_host_plan

from netweave.runtime import plan as jp
from netweave.runtime.ddp import POLICIES, ModelMismatchError, covered, make_plan, trainable_parameters
from netweave.runtime.phase import PhaseClock
from netweave.runtime.pipeline import apply_recompute, build_pipeline


class FakeTime:
    def __init__(self, now: float):
        self.now = now

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        assert s >= 0
        self.now += s


@settings(max_examples=200, deadline=None)
@given(offset=st.floats(0, 5), period=st.floats(0.01, 2), tol=st.floats(0, 0.9),
       work=st.lists(st.floats(0, 5), min_size=1, max_size=30))
def test_phase_slots_keep_the_grid(offset, period, tol, work):
    t = FakeTime(1000.0)
    clock = PhaseClock(1000.0, offset, period, tol, clock=t.clock, sleep=t.sleep)
    for w in work:
        start = clock.wait()
        slot = 1000.0 + offset + clock.slots[-1] * period
        assert start >= slot - 1e-9                                  # never before its slot
        assert start - slot <= tol * period + 1e-9                   # never more than the tolerance behind it
        t.now += w * period                                          # the iteration's work
    assert clock.slots[0] == 0 and clock.starts[0] == pytest.approx(1000.0 + offset)
    assert all(b > a for a, b in zip(clock.slots, clock.slots[1:], strict=False))
    fast = all(w <= 1 for w in work[:-1])
    assert (clock.reanchors == 0) == (clock.slots == list(range(len(work)))) or not fast


def test_without_period_only_the_offset_is_waited():
    t = FakeTime(50.0)
    clock = PhaseClock(50.0, 0.25, None, clock=t.clock, sleep=t.sleep)
    assert clock.wait() == 50.25
    t.now += 3.0
    assert clock.wait() == 53.25 and clock.summary()["first_start_s"] == 0.25


def _tree(draw, depth):
    """A random module: own parameters (some frozen), children, and sometimes a child shared with another place."""
    m = nn.Module()
    for i in range(draw(st.integers(0, 2))):
        p = nn.Parameter(torch.zeros(draw(st.integers(1, 4))), requires_grad=draw(st.booleans()))
        m.register_parameter(f"p{i}", p)
    if depth > 0:
        for i in range(draw(st.integers(0, 3))):
            m.add_module(f"c{i}", _tree(draw, depth - 1))
    return m


@st.composite
def module_trees(draw):
    root = _tree(draw, 3)
    mods = list(root.modules())
    for k in range(draw(st.integers(0, 2)) if len(mods) > 1 else 0):   # share a module (and its parameters) in a second place
        i = draw(st.integers(0, len(mods) - 2))
        j = draw(st.integers(i + 1, len(mods) - 1))   # later in pre-order: never an ancestor of mods[i], so no cycle
        mods[i].add_module(f"shared{k}", mods[j])
    if draw(st.booleans()):                      # and a bare shared parameter (tied weights)
        owners = [m for m in root.modules() if list(m.parameters(recurse=False))]
        if owners:
            other = mods[draw(st.integers(0, len(mods) - 1))]
            other.tied = next(owners[0].parameters(recurse=False))
    return root


@settings(max_examples=150, deadline=None)
@given(module_trees(), st.sampled_from(POLICIES), st.integers(4, 12))
def test_plans_cover_exactly_the_trainable_parameters(tree, policy, partition):
    want = {id(p) for p in tree.parameters() if p.requires_grad}       # torch's own walk: each parameter once
    named = trainable_parameters(tree)
    assert [id(p) for _, p in named] == list(dict.fromkeys(id(p) for _, p in named))   # each once
    assert {id(p) for _, p in named} == want
    plan = make_plan([(n, p.numel(), p.element_size()) for n, p in named], policy, partition_bytes=partition, credit_bytes=2 * partition)
    if named:
        covered(plan, [p.numel() for _, p in named])            # every element of every parameter exactly once


@settings(max_examples=150, deadline=None)
@given(module_trees())
def test_gradient_scheduler_layers_cover_exactly_the_trainable_parameters(tree):
    from flowsched.gradients import gradient_layers, layer_parameters

    layers = gradient_layers(tree)
    groups = layer_parameters(layers)
    flat = [id(p) for g in groups for p in g]
    assert len(flat) == len(set(flat)) and all(groups)
    assert set(flat) == {id(p) for p in tree.parameters() if p.requires_grad}


def test_multihead_attention_parameters_are_covered():
    model = example().build_model(width=8, depth=1, heads=2)
    names = [n for n, _ in trainable_parameters(model)]
    assert "1.attn.in_proj_weight" in names and "1.attn.in_proj_bias" in names and "0.positions" in names
    assert len(names) == len(list(model.parameters()))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_gives_the_same_gradients(mode):
    ex = example()
    plain, ckpt = ex.build_model(width=16, depth=2, heads=2), ex.build_model(width=16, depth=2, heads=2)
    done = apply_recompute(list(ckpt), mode)
    names = [type(m).__name__ for m in done]
    if mode == "full":
        assert len(done) == 4
    else:   # attention inside the two blocks; the embedding (block 0, no attention) whole; the head (block 3) not
        assert names == ["Embed", "MultiheadAttention", "MultiheadAttention"]
    x, y = ex.batch(0, rows=2, seq=16, vocab=64, seed=0)
    for m in (plain, ckpt):
        ex.loss_fn(m(x), y).backward()
    for (n, a), b in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), n
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in ckpt.named_parameters()]


@pytest.mark.parametrize(("model", "field"), [
    (lambda ex: list(ex.build_model(width=8, depth=1, heads=2)), "pipeline.stages"),          # 3 blocks, plan splits 4
    (lambda ex: nn.Module(), "pipeline.stages[0].modules"),                                 # no names to resolve
])
def test_model_that_cannot_be_split_as_planned(model, field):
    plan = one_host_plan(2, pp=2)
    with pytest.raises(ModelMismatchError) as err:
        build_pipeline(plan, model(example()), None, rank=0, device=torch.device("cpu"), source="b/plan.json")
    assert str(err.value).startswith(f"b/plan.json: {field}: ")


def test_missing_module_name_is_named():
    from dataclasses import replace

    plan = one_host_plan(2, pp=2)
    stages = tuple(replace(s, modules=("0", "1") if s.index == 0 else ("2", "nope")) for s in plan.pipeline.stages)
    plan = jp.loads(jp.dumps(replace(plan, pipeline=replace(plan.pipeline, stages=stages))))
    model = nn.Module()
    for i in range(3):
        model.add_module(str(i), nn.Linear(2, 2))
    with pytest.raises(ModelMismatchError, match=r"pipeline.stages\[1\].modules\[1\]: the model has no submodule 'nope'"):
        build_pipeline(plan, model, None, rank=0, device=torch.device("cpu"))


def test_torchrun_world_size_must_agree_with_the_plan(tmp_path, monkeypatch):
    import netweave.runtime as nw

    path = tmp_path / "plan.json"
    path.write_text(jp.dumps(one_host_plan(2)))
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(nw.PlanFormatError, match=r"plan.json: world_size: torchrun started 3 ranks \(WORLD_SIZE\), the plan has 2"):
        nw.init(path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("GROUP_RANK", "1")     # a second torchrun node, but the plan has one host
    with pytest.raises(nw.PlanFormatError, match=r"ranks\[1\].host: rank 1 runs on torchrun node 1 \(GROUP_RANK\), the plan puts it on "
                                                 "localhost, node 0"):
        nw.init(path)
    for var in ("WORLD_SIZE", "RANK", "GROUP_RANK"):
        monkeypatch.delenv(var)
    monkeypatch.delenv(nw.PLAN_ENV, raising=False)
    with pytest.raises(nw.PlanFormatError, match="NETWEAVE_JOB_PLAN"):
        nw.init()
