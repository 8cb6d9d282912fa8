import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowsched.gradients import GradientProfile, analytic_gradient_profile, measure_gradient_profile
from flowsched.intrajob import (
    CommPlan,
    MiB,
    bytescheduler_plan,
    ddp_plan,
    gradient_stages,
    prophet_plan,
    simulate_iteration,
    tune_bytescheduler,
    tune_prophet,
)
from topology.errors import InputError


def random_profile(seed: int, layers: int | None = None) -> GradientProfile:
    rng = random.Random(seed)
    n = layers or rng.randint(1, 12)
    return analytic_gradient_profile(
        [f"l{i}" for i in range(n)],
        [rng.choice([0.25, 1, 3, 8, 20]) * MiB for _ in range(n)],
        [rng.uniform(0.5e-3, 3e-3) for _ in range(n)],
        [rng.uniform(1e-3, 6e-3) for _ in range(n)],
        bandwidth=rng.choice([0.1, 0.5, 2.0]),
        overhead=rng.choice([0.0, 1e-4, 1e-3]),
    )


def test_single_layer_closed_form():
    p = analytic_gradient_profile(["fc"], [8 * MiB], [0.01], [0.02], bandwidth=1.0, overhead=1e-3)
    for plan in (ddp_plan(p), bytescheduler_plan(p, partition=64 * MiB), prophet_plan(p, partition=64 * MiB)):
        t = simulate_iteration(p, plan)
        assert t.iteration_time == pytest.approx(0.02 + 1e-3 + 8 * MiB / 1e9 + 0.01)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 100_000))
def test_every_plan_sends_every_byte_once_and_respects_the_lower_bound(seed):
    p = random_profile(seed)
    for plan in (ddp_plan(p), bytescheduler_plan(p, partition=2 * MiB, credit=4 * MiB), prophet_plan(p, partition=MiB)):
        plan.check_covers(p)
        t = simulate_iteration(p, plan)
        assert t.iteration_time >= p.lower_bound() - 1e-12
        assert t.comm_end >= p.total_bytes / p.bytes_per_s + p.overhead - 1e-12
        assert all(e >= s for s, e in zip(t.starts, t.ends, strict=True))


def test_ddp_buckets_follow_ready_order_and_cap():
    p = random_profile(3, layers=12)
    plan = ddp_plan(p, bucket_cap=10 * MiB, first_bucket=1 * MiB)
    flat = [layer for t in plan.transfers for layer, _ in t.parts]
    assert flat == sorted(range(12), key=lambda i: (p.ready[i], -i))
    for t in plan.transfers:
        assert t.nbytes <= 10 * MiB or len(t.parts) == 1
    assert plan.barrier


def test_priority_sends_front_layer_before_queued_back_layers():
    # Layer 2's huge gradient is ready first; layer 0's small one arrives while it is still queued:
    # ByteScheduler must send layer 0's partition before the rest of layer 2.
    p = GradientProfile(["l0", "l1", "l2"], [1 * MiB, 1 * MiB, 64 * MiB], [0.003, 0.002, 0.001], [0.001] * 3, 0.003, 1.0, 0.0)
    plan = bytescheduler_plan(p, partition=1 * MiB, credit=1 * MiB)
    order = [t.parts[0][0] for t in plan.transfers]
    first_l0 = order.index(0)
    assert first_l0 < len(order) - 1 and 2 in order[first_l0 + 1 :]
    assert simulate_iteration(p, plan).iteration_time < simulate_iteration(p, ddp_plan(p)).iteration_time


def test_bandwidth_bound_job_speedups_in_the_model():
    # Communication-dominated job: the schedulers overlap comm with backward and with the next forward.
    p = analytic_gradient_profile([f"l{i}" for i in range(16)], [6 * MiB] * 16, [2e-3] * 16, [4e-3] * 16, bandwidth=0.5, overhead=2e-4)
    base = simulate_iteration(p, ddp_plan(p)).iteration_time
    for plan in (tune_bytescheduler(p), tune_prophet(p)):
        t = simulate_iteration(p, plan).iteration_time
        assert t < base
        assert t <= 1.15 * p.lower_bound()


def test_prophet_stages_follow_gaps():
    ready = [0.030, 0.029, 0.028, 0.012, 0.011, 0.010]  # two bursts separated by a long gap
    p = GradientProfile([f"l{i}" for i in range(6)], [MiB] * 6, ready, [0.001] * 6, 0.03, 1.0)
    assert gradient_stages(p) == [[5, 4, 3], [2, 1, 0]]
    plan = prophet_plan(p, partition=MiB)
    first_block = plan.transfers[0]
    # the first block is sent during the gap and holds the most urgent of the first stage's gradients
    assert len(first_block.parts) > 1 and first_block.layers[0] == 3
    assert first_block.nbytes <= p.bytes_per_s * (0.030 - 0.012)


def test_profile_json_round_trip_and_errors(tmp_path):
    p = random_profile(5)
    path = tmp_path / "g.json"
    p.save(path)
    assert GradientProfile.load(path) == p
    data = p.to_dict()
    data["nbytes"] = data["nbytes"][:-1]
    path.write_text(json.dumps(data))
    with pytest.raises(InputError, match="g.json: nbytes: expected"):
        GradientProfile.load(path)
    plan = tune_bytescheduler(p)
    assert CommPlan.from_dict(json.loads(json.dumps(plan.to_dict()))).transfers == plan.transfers


def test_measured_profile_from_a_real_module():
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    p = measure_gradient_profile(
        model, lambda: (torch.randn(32, 64), torch.randint(0, 10, (32,))), torch.nn.functional.cross_entropy, bandwidth=1.0, iterations=3
    )
    assert p.names == ["0", "2", "4"]
    assert p.nbytes == [(64 * 256 + 256) * 4, (256 * 256 + 256) * 4, (256 * 10 + 10) * 4]
    # backward runs from the last layer to the first
    assert p.ready[2] <= p.ready[1] <= p.ready[0] <= p.backward + 1e-3
    assert all(f > 0 for f in p.forward)
