"""Partition DP (PipeDream + AdaPipe recompute): brute-force optimality, errors, heterogeneity."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from pipesched.devices import Device, LinkModel
from pipesched.partition import PlanError, evaluate_partition, in_flight, partition, uniform_partition
from pipesched.profile import RECOMPUTE_OPTIONS, GPTConfig, LayerProfile, ModelProfile, analytic_profile


def random_profile(rng: random.Random, n: int) -> ModelProfile:
    layers = []
    for i in range(n):
        f = rng.uniform(0.5, 3.0)
        none = rng.randint(20, 100)
        sel = rng.randint(5, none)
        full = rng.randint(1, sel)
        layers.append(LayerProfile(
            name=f"l{i}", fwd_s=f, bwd_input_s=rng.uniform(0.5, 3), bwd_weight_s=rng.uniform(0.2, 2), output_bytes=rng.randint(1, 50),
            param_bytes=rng.randint(1, 20), saved_bytes={"none": none, "selective": sel, "full": full},
            recompute_s={"none": 0.0, "selective": rng.uniform(0, 0.5) * f, "full": f}, weight_grad_bytes=0,
        ))
    return ModelProfile("rand", tuple(layers), state_factor=2.0)


def random_links(rng: random.Random, p: int) -> LinkModel:
    bw = [[rng.uniform(5, 50) for _ in range(p)] for _ in range(p)]
    lat = [[rng.uniform(0, 0.2) for _ in range(p)] for _ in range(p)]
    return LinkModel.from_matrices(bw, lat)


def brute_force(profile, devices, links, m, family, max_replicas):
    """Every composition into stages x replica counts x recompute options, costed from first principles."""
    lays = profile.layers
    n, P = len(lays), len(devices)
    split = family == "zbh1"
    best = []

    def stage_time(i, j, first, r):
        devs = devices[first:first + r]
        speed = sum(d.speed for d in devs)
        memory = min(d.memory_bytes for d in devs)
        flight = math.ceil(in_flight(family, first, P, m) / r)
        params = sum(lay.param_bytes for lay in lays[i:j])
        sync = 0.0
        if r > 1:
            bw = min(links.bandwidth(a, a + 1) for a in range(first, first + r - 1))
            sync = 4 * (r - 1) * params / (r * bw) / m
        times = []
        for o in RECOMPUTE_OPTIONS:
            mem = params * profile.state_factor + flight * sum(lay.saved_bytes[o] for lay in lays[i:j]) + max(
                lay.saved_bytes["none"] - lay.saved_bytes[o] for lay in lays[i:j])
            if mem <= memory:
                work = sum(lay.fwd_s + (lay.bwd_input_s + lay.bwd_weight_s if split else lay.bwd_s) + lay.recompute_s[o] for lay in lays[i:j])
                times.append(work / speed + sync)
        return min(times, default=math.inf)

    def rec(j, d, acc_max, acc_sum):
        if j == n and d == P:
            best.append((acc_max, acc_sum))
            return
        if j == n or d == P:
            return
        for r in range(1, max_replicas + 1):
            if d + r > P:
                break
            for k in range(j + 1, n + 1):
                t = stage_time(j, k, d, r)
                c = 0.0 if d == 0 else 2 * links.time(d - 1, d, lays[j - 1].output_bytes)
                rec(k, d + r, max(acc_max, t, c), acc_sum + t + c)

    rec(0, 0, 0.0, 0.0)
    bottleneck = min(b for b, _ in best)
    least_sum = min(s for b, s in best if b <= bottleneck * (1 + 1e-9))
    return bottleneck, least_sum


@pytest.mark.parametrize("seed", range(30))
def test_dp_equals_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 7)
    P = rng.randint(1, min(n, 4))
    prof = random_profile(rng, n)
    devices = [Device(f"d{i}", speed=rng.choice([1.0, 0.5, 2.0]), memory_bytes=rng.uniform(150, 600)) for i in range(P)]
    links = random_links(rng, P)
    m = rng.randint(1, 6)
    family = rng.choice(["1f1b", "gpipe", "zbh1"])
    max_replicas = rng.choice([1, 1, 2, 3])
    expect_b, expect_s = brute_force(prof, devices, links, m, family, max_replicas)
    if math.isinf(expect_b):
        with pytest.raises(PlanError):
            partition(prof, devices, links, microbatches=m, family=family, max_replicas=max_replicas)
        return
    part = partition(prof, devices, links, microbatches=m, family=family, max_replicas=max_replicas)
    assert part.bottleneck_s == pytest.approx(expect_b, rel=1e-9)
    assert part.sum_s == pytest.approx(expect_s, rel=1e-9)
    assert part.boundaries[0] == 0 and part.boundaries[-1] == n
    assert sum(len(s.devices) for s in part.stages) == P
    for s in part.stages:
        assert s.memory_bytes <= min(devices[d].memory_bytes for d in s.devices) + 1e-9


def test_recompute_chosen_only_where_memory_is_short():
    """AdaPipe: early 1F1B stages hold more micro-batches, so they recompute while later stages do not."""
    prof = analytic_profile(GPTConfig(layers=16, hidden=4096, heads=32, seq_len=4096, vocab=32000, microbatch_size=1))
    devs = [Device(f"g{i}", memory_bytes=40 * 2**30) for i in range(4)]
    part = partition(prof, devs, LinkModel.uniform(4, 100e9, 1e-6), microbatches=16)
    options = [s.recompute for s in part.stages]
    assert options[0] != "none" and options[-1] == "none"
    order = [RECOMPUTE_OPTIONS.index(o) for o in options]
    assert order == sorted(order, reverse=True)
    for s in part.stages:
        assert s.memory_bytes <= 40 * 2**30


def test_heterogeneous_speed_gets_more_layers():
    prof = analytic_profile(GPTConfig(layers=30, hidden=1024, heads=16, seq_len=1024, vocab=1000))
    devs = [Device("slow", speed=1.0), Device("fast", speed=3.0)]
    part = partition(prof, devs, LinkModel.uniform(2, 100e9, 1e-6), microbatches=8)
    sizes = [s.layers[1] - s.layers[0] for s in part.stages]
    assert sizes[1] > 2 * sizes[0]


def test_slow_link_moves_the_cut_to_a_small_activation():
    layers = [LayerProfile(f"l{i}", 1.0, 1.0, 1.0, 1000 if i != 2 else 1, 1, {o: 1 for o in RECOMPUTE_OPTIONS},
                           {o: 0.0 for o in RECOMPUTE_OPTIONS}) for i in range(6)]
    prof = ModelProfile("cut", tuple(layers))
    slow = LinkModel.uniform(2, 1000.0, 0.0)    # 1000 B/s: a 1000-byte activation costs 2 s each way
    part = partition(prof, [Device("a"), Device("b")], slow, microbatches=4)
    assert part.stages[0].layers == (0, 3)       # the cut after layer 2, whose output is 1 byte


def test_errors_are_clear():
    prof = analytic_profile(GPTConfig(layers=2, hidden=256, heads=4, seq_len=128, vocab=1000))
    devs = [Device(f"g{i}") for i in range(8)]
    with pytest.raises(PlanError, match="only 4 layers"):
        partition(prof, devs, LinkModel.uniform(8, 1e9, 0), microbatches=4)
    with pytest.raises(PlanError, match="layer 0 .* needs"):
        partition(prof, [Device("tiny", memory_bytes=1000)], LinkModel.uniform(1, 1e9, 0), microbatches=4)
    with pytest.raises(PlanError, match="unknown schedule family"):
        partition(prof, devs[:2], LinkModel.uniform(2, 1e9, 0), microbatches=4, family="bogus")


def test_uniform_partition_and_evaluation_agree_with_dp_cost_model():
    rng = random.Random(7)
    prof = random_profile(rng, 8)
    devs = [Device(f"d{i}", memory_bytes=1e9) for i in range(4)]
    links = random_links(rng, 4)
    spans = uniform_partition(prof, 4)
    assert spans == [(0, 2), (2, 4), (4, 6), (6, 8)]
    ev = evaluate_partition(prof, spans, devs, links, microbatches=4)
    best = partition(prof, devs, links, microbatches=4)
    assert best.bottleneck_s <= ev.bottleneck_s + 1e-12
    # every composition is at least as slow as the DP's
    for cuts in itertools.combinations(range(1, 8), 3):
        b = [0, *cuts, 8]
        ev = evaluate_partition(prof, list(zip(b, b[1:], strict=False)), devs, links, microbatches=4)
        assert ev.bottleneck_s >= best.bottleneck_s * (1 - 1e-9)


def test_interleaved_uses_loop_placement():
    prof = analytic_profile(GPTConfig(layers=14, hidden=512, heads=8, seq_len=256, vocab=1000))
    part = partition(prof, [Device(f"g{i}") for i in range(4)], LinkModel.uniform(4, 1e10, 1e-6), microbatches=8,
                     family="interleaved", chunks=2)
    assert [s.devices[0] for s in part.stages] == [0, 1, 2, 3, 0, 1, 2, 3]


def brute_force_flush(profile, devices, links, m, family):
    """min over compositions of max_s (H_s + m t_s), one device per stage, from first principles."""
    lays = profile.layers
    n, P = len(lays), len(devices)
    best = math.inf
    for cuts in itertools.combinations(range(1, n), P - 1):
        b = [0, *cuts, n]
        head, bound = 0.0, 0.0
        for s in range(P):
            i, j = b[s], b[s + 1]
            flight = in_flight(family, s, P, m)
            times = []
            for o in RECOMPUTE_OPTIONS:
                mem = sum(lay.param_bytes for lay in lays[i:j]) * profile.state_factor + flight * sum(
                    lay.saved_bytes[o] for lay in lays[i:j]) + max(lay.saved_bytes["none"] - lay.saved_bytes[o] for lay in lays[i:j])
                if mem <= devices[s].memory_bytes:
                    times.append(sum(lay.fwd_s + lay.bwd_s + lay.recompute_s[o] for lay in lays[i:j]) / devices[s].speed)
            t = min(times, default=math.inf)
            c = 0.0 if s == 0 else 2 * links.time(s - 1, s, lays[i - 1].output_bytes)
            head += c
            bound = max(bound, head + m * t)
            head += t
        best = min(best, bound)
    return best


@pytest.mark.parametrize("seed", range(25))
def test_flush_objective_equals_brute_force(seed):
    rng = random.Random(1000 + seed)
    n = rng.randint(2, 8)
    P = rng.randint(1, min(n, 4))
    prof = random_profile(rng, n)
    devices = [Device(f"d{i}", speed=rng.choice([1.0, 0.5, 2.0]), memory_bytes=rng.uniform(150, 600)) for i in range(P)]
    links = random_links(rng, P)
    m = rng.randint(1, 8)
    expect = brute_force_flush(prof, devices, links, m, "1f1b")
    if math.isinf(expect):
        with pytest.raises(PlanError):
            partition(prof, devices, links, microbatches=m, objective="flush")
        return
    part = partition(prof, devices, links, microbatches=m, objective="flush")
    assert part.meta["flush_bound_s"] == pytest.approx(expect, rel=1e-9)
    assert part.boundaries[0] == 0 and part.boundaries[-1] == n


def test_flush_objective_puts_the_slack_late():
    """Ten equal layers on three stages: the flush bound wants the 4-layer stage first, where it delays nobody."""
    layers = [LayerProfile(f"l{i}", 1.0, 2.0, 0.0, 0, 0, {o: 0 for o in RECOMPUTE_OPTIONS}, {o: 0.0 for o in RECOMPUTE_OPTIONS})
              for i in range(10)]
    prof = ModelProfile("eq", tuple(layers))
    part = partition(prof, [Device(f"g{i}") for i in range(3)], LinkModel.uniform(3, 1e12, 0.0), microbatches=8, objective="flush")
    assert [s.layers[1] - s.layers[0] for s in part.stages] == [4, 3, 3]


# --------------------------------------------------------------------------------------------------------------
# Issue #21: the memory model against the simulator, exact fits, readable refusals
# --------------------------------------------------------------------------------------------------------------

def uniform_layer(name: str, saved: dict[str, float], params: int = 0) -> LayerProfile:
    return LayerProfile(name, 1.0, 1.0, 1.0, 0, params, saved, {"none": 0.0, "selective": 0.5, "full": 1.0})


def test_zbh1_memory_model_counts_what_the_graph_holds_until_w():
    """Issue #21.1: ZB-H1 keeps p micro-batches on every stage; the planner must pick (selective, selective) at 150 bytes."""
    from pipesched.plan import plan

    prof = ModelProfile("two", tuple(uniform_layer(f"l{i}", {"none": 100, "selective": 50, "full": 10}) for i in range(2)))
    devs = [Device(f"d{i}", memory_bytes=160) for i in range(2)]
    links = LinkModel.uniform(2, 1e12, 0.0)
    part = partition(prof, devs, links, microbatches=2, family="zbh1")
    assert [s.recompute for s in part.stages] == ["selective", "selective"] and [s.in_flight for s in part.stages] == [2, 2]
    p = plan(prof, devs, links, microbatches=2, schedule="zbh1")
    assert p.memory_ok and p.sim.peak_memory == [150.0, 150.0]
    assert [s.memory_bytes for s in p.partition.stages] == p.sim.peak_memory


def test_interleaved_memory_model_uses_microbatches_per_round():
    """m = 6 on 4 ranks: one round of 6, so the first rank's warm-up runs every forward of both chunks."""
    assert [in_flight("interleaved", s, 8, 6, ranks=4, chunks=2) for s in range(8)] == [6, 6, 6, 6, 6, 5, 3, 1]


def test_over_memory_message_prints_real_numbers():
    from pipesched.plan import plan_partition

    prof = ModelProfile("two", tuple(uniform_layer(f"l{i}", {"none": 100, "selective": 50, "full": 10}) for i in range(2)))
    devs = [Device(f"d{i}", memory_bytes=160) for i in range(2)]
    links = LinkModel.uniform(2, 1e12, 0.0)
    forced = evaluate_partition(prof, [(0, 1), (1, 2)], devs, links, microbatches=2, family="1f1b", recompute="none",
                                options=RECOMPUTE_OPTIONS)
    p = plan_partition(prof, forced, devs, links, family="zbh1", microbatches=2)
    assert not p.memory_ok and p.problems == ["rank 0 (d0): peak 200 B over 160 B", "rank 1 (d1): peak 200 B over 160 B"]


def test_memory_equal_to_the_limit_fits():
    """Issue #21.4: 0.7 + 0.8 GiB on a 1.5 GiB device is an exact fit, though the prefix sums give 1.5000000000000004."""
    from pipesched.plan import plan

    saved = [0.5, 0.4, 0.7, 0.8]
    prof = ModelProfile("exact", tuple(uniform_layer(f"l{i}", {o: x * 2**30 for o in RECOMPUTE_OPTIONS}) for i, x in enumerate(saved)))
    devs = [Device(f"d{i}", memory_bytes=1.5 * 2**30) for i in range(2)]
    links = LinkModel.uniform(2, 1e12, 0.0)
    p = plan(prof, devs, links, microbatches=1, schedule="1f1b", recompute=("none",))
    assert [s.layers for s in p.partition.stages] == [(0, 2), (2, 4)] and p.memory_ok
    assert max(p.sim.peak_memory) == 1.5 * 2**30


@pytest.mark.parametrize("seed", range(12))
def test_every_family_plans_within_the_simulated_memory(seed):
    """Whatever the family: a plan the partitioner returns fits in memory in the simulation (the model never undercounts)."""
    from pipesched.partition import FAMILIES
    from pipesched.plan import plan

    rng = random.Random(500 + seed)
    n, P = rng.randint(6, 12), rng.choice([2, 2, 3])
    prof = random_profile(rng, n)
    devices = [Device(f"d{i}", memory_bytes=rng.uniform(150, 600)) for i in range(P)]
    m = rng.choice([2, 4, 6, 8])
    for family in FAMILIES:
        try:
            p = plan(prof, devices, random_links(rng, P), microbatches=m, schedule=family, refine_budget=0)
        except PlanError:
            continue
        assert p.memory_ok, (family, p.problems)


def exhaustive_makespan(prof, devs, links, m, family, all_options):
    """Best simulated iteration over every partition (and, with ``all_options``, every per-stage recomputation choice) that fits
    in the simulation's memory; inf when none does."""
    import dataclasses

    from pipesched.plan import plan_partition

    n, P = len(prof.layers), len(devs)
    best = math.inf
    for cuts in itertools.combinations(range(1, n), P - 1):
        b = (0, *cuts, n)
        base = evaluate_partition(prof, [(b[k], b[k + 1]) for k in range(P)], devs, links, microbatches=m, family=family)
        if all_options:
            choices = list(itertools.product(RECOMPUTE_OPTIONS, repeat=P))
        elif any(math.isinf(s.time_s) for s in base.stages):
            continue
        else:
            choices = [tuple(s.recompute for s in base.stages)]
        for opts in choices:
            part = dataclasses.replace(base, stages=tuple(dataclasses.replace(s, recompute=o) for s, o in zip(base.stages, opts, strict=True)))
            p = plan_partition(prof, part, devs, links, family=family, microbatches=m)
            if p.memory_ok:
                best = min(best, p.sim.makespan)
    return best


def random_instance(rng: random.Random, layers: tuple[int, int], stages: list[int]):
    """A random profile, devices with memory limits, links, micro-batch count and flush family."""
    n, P = rng.randint(*layers), rng.choice(stages)
    prof = random_profile(rng, n)
    devs = [Device(f"d{i}", memory_bytes=rng.uniform(150, 600)) for i in range(P)]
    links = random_links(rng, P)
    return prof, devs, links, rng.randint(1, 6), rng.choice(["1f1b", "gpipe", "zbh1"])


@pytest.mark.parametrize("seed", range(10))
def test_plan_reaches_the_exhaustive_optimum_on_small_instances(seed):
    """Issue #21.6: with at most refine_budget partitions plan() tries them all, so it matches the exhaustive optimum over
    partitions and per-stage recomputation (judged by the simulator's memory), which it missed by up to 1.13x before."""
    from pipesched.plan import plan

    prof, devs, links, m, family = random_instance(random.Random(seed), (4, 7), [2, 3])
    best = exhaustive_makespan(prof, devs, links, m, family, all_options=True)
    if math.isinf(best):
        with pytest.raises(PlanError):
            plan(prof, devs, links, microbatches=m, schedule=family)
        return
    assert plan(prof, devs, links, microbatches=m, schedule=family).sim.makespan == pytest.approx(best, rel=1e-9)


HILL_CLIMB_WORST = 1.10     # measured worst ratio to the exhaustive optimum, budget 10 (docs/pipesched.md, "Limits")


@pytest.mark.parametrize("seed", range(12))
def test_hill_climb_stays_within_its_documented_gap(seed):
    """More partitions than the budget: one-boundary moves from the DP's partition; within the bound the docs state."""
    from pipesched.plan import plan

    prof, devs, links, m, family = random_instance(random.Random(seed), (8, 10), [3, 4])
    best = exhaustive_makespan(prof, devs, links, m, family, all_options=False)
    try:
        ours = plan(prof, devs, links, microbatches=m, schedule=family, refine_budget=10).sim.makespan
    except PlanError:
        assert math.isinf(best)
        return
    assert best <= ours * (1 + 1e-9) and ours <= best * HILL_CLIMB_WORST


def test_large_plans_spend_no_simulations_that_cannot_help(monkeypatch):
    """Issue #21.2: at 16 000+ layers x devices plan() does not refine (at 1000 x 64 forty such simulations were 97 % of a
    50 s plan and found nothing), and auto simulates a family only while its lower bound could still win."""
    import importlib

    planmod = importlib.import_module("pipesched.plan")     # the module, not the function pipesched re-exports as `plan`
    calls = []
    real = planmod.simulate
    monkeypatch.setattr(planmod, "simulate", lambda *a, **k: calls.append(a[0].name) or real(*a, **k))
    prof = analytic_profile(GPTConfig(layers=249, hidden=1024, heads=16, seq_len=1024, vocab=32000))
    devs = [Device(f"g{i}", memory_bytes=80 * 2**30) for i in range(64)]
    links = LinkModel.uniform(64, 100e9, 2e-6)
    assert len(prof.layers) * len(devs) > planmod.REFINE_MAX_SIZE
    p = planmod.plan(prof, devs, links, microbatches=64, schedule="1f1b")
    assert calls == ["1f1b"] and "refined_from_s" not in p.partition.meta
    calls.clear()
    p = planmod.plan(prof, devs, links, microbatches=64, schedule="auto")
    planned = [a for a in p.alternatives if "bound_s" in a]
    assert len(calls) == sum("makespan_s" in a for a in planned) < len(planned)
    best = min(a["makespan_s"] for a in planned if "makespan_s" in a)
    assert all(a["bound_s"] > best for a in planned if "skipped" in a) and p.sim.makespan == best
