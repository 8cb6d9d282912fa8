"""The CPU-run model: per-message and per-action CPU work, the calibration record, CPU-time profiles."""

from __future__ import annotations

import dataclasses
import random
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesched.devices import Device, LinkModel
from pipesched.schedules import make_schedule
from pipesched.simulate import SharedCpu, StageCost, simulate


def _messages(schedule, a) -> int:
    if a.kind not in ("F", "B", "I"):
        return 0
    r = schedule.stage_rank[a.stage]
    return sum(1 for s in schedule.neighbours(a.stage) if s is not None and schedule.stage_rank[s] != r)


@pytest.mark.parametrize(("family", "p", "m"), [("1f1b", 4, 6), ("gpipe", 3, 4), ("zbh1", 4, 8)])
def test_message_and_action_cpu_are_work_on_the_acting_rank(family, p, m):
    """SharedCpu(c >= ranks, msg, act) == plain simulation with each action lengthened by act + msg x its cross-rank messages."""
    sched = make_schedule(family, p, m)
    costs = {s: StageCost(f=1.0 + 0.1 * s, b=2.0 + 0.2 * s, i=1.1, w=0.9 + 0.2 * s, out_bytes=10.0) for s in range(p)}
    links = LinkModel.uniform(p, 100.0, 0.05)
    msg, act = 0.03, 0.007
    shared = simulate(sched, costs, links, cores=SharedCpu(cores=p, message_cpu_s=msg, action_cpu_s=act))
    # Ends of the chain exchange with one neighbour, inner stages with two; W sends nothing.
    counts = {s: 1 if s in (0, p - 1) else 2 for s in range(p)}
    longer = {s: dataclasses.replace(c, f=c.f + act + msg * counts[s], b=c.b + act + msg * counts[s],
                                     i=c.i_s + act + msg * counts[s], w=c.w_s + act) for s, c in costs.items()}
    plain = simulate(sched, longer, links)
    assert shared.makespan == pytest.approx(plain.makespan, rel=1e-12)
    assert [(s.rank, str(s.action), s.start, s.end) for s in shared.timeline] == \
        [(s.rank, str(s.action), pytest.approx(s.start), pytest.approx(s.end)) for s in plain.timeline]
    for a in sched.actions[1]:
        assert _messages(sched, a) == (0 if a.kind == "W" else 2)


def test_fewer_cores_than_ranks_only_slows_the_run_and_busy_work_is_conserved():
    sched = make_schedule("1f1b", 4, 8)
    costs = {s: StageCost(f=1.0, b=2.0, out_bytes=1.0) for s in range(4)}
    links = LinkModel.uniform(4, 1e3, 0.01)
    free = simulate(sched, costs, links, cores=SharedCpu(4, 0.05, 0.01))
    shared = simulate(sched, costs, links, cores=SharedCpu(2, 0.05, 0.01))
    assert shared.makespan > free.makespan
    # total work is 4 ranks x 8 micro-batches x (F + B + 2 x action) + messages; two cores cannot do it faster than half
    work = 4 * 8 * (3.0 + 2 * 0.01) + 0.05 * 8 * 2 * (1 + 2 + 2 + 1)
    assert shared.makespan >= work / 2 - 1e-9


def test_calibration_record_latency_and_link():
    from pipesched.calibrate import CpuCalibration

    cal = CpuCalibration(ranks=4, cores=1.8, message_bytes=4096, one_way_s=1e-3, message_cpu_s=2e-4, solo_rate=10.0, all_rate=18.0,
                         foreign_cores=0.1, cpu_share=1.9, slowdown=1.05)
    assert cal.latency_s == pytest.approx(6e-4)
    link = cal.link()
    assert link.time(0, 3, 4096) == pytest.approx(6e-4) and link.time(2, 2, 4096) == 0.0
    assert cal.shared_cpu() == SharedCpu(1.8, 2e-4)
    assert set(cal.to_dict()) >= {"cores", "one_way_s", "message_cpu_s", "latency_s", "cpu_share", "slowdown", "foreign_cores"}
    # a measured one-way time below the CPU work never gives a negative wait
    assert dataclasses.replace(cal, one_way_s=1e-4).latency_s == 0.0


def test_compare_is_zero_when_the_run_matches_the_model():
    """compare()'s bookkeeping: a run that did exactly what the model says has no error anywhere."""
    from pipesched.calibrate import compare
    from pipesched.partition import evaluate_partition
    from pipesched.plan import plan_partition
    from pipesched.profile import LayerProfile, ModelProfile
    from pipesched.runner import RunResult

    lays = tuple(LayerProfile(f"l{k}", 0.01 * (k + 1), 0.01, 0.01, 64, 256, {o: 128 for o in ("none", "selective", "full")},
                              {o: 0.0 for o in ("none", "selective", "full")}) for k in range(6))
    prof = ModelProfile("t", lays, source="measured")
    devs = [Device(f"r{i}") for i in range(3)]
    links = LinkModel.uniform(3, 1e6, 1e-4)
    shared = SharedCpu(2, 5e-4, 2e-4)
    part = evaluate_partition(prof, [(0, 2), (2, 4), (4, 6)], devs, links, microbatches=4, family="1f1b")
    p = plan_partition(prof, part, devs, links, family="1f1b", microbatches=4, cores=shared)
    walls: dict[str, list[float]] = {}
    for s in p.sim.timeline:
        walls.setdefault(f"{s.action.stage} {s.action.kind}", []).append(s.end - s.start)
    cpu = {f"{s} {k}": p.costs[s].duration(k) + shared.action_cpu_s for s in range(3) for k in ("F", "B")}
    rank_cpu = [sum(cpu[f"{a.stage} {a.kind}"] + shared.message_cpu_s * _messages(p.schedule, a) for a in p.schedule.actions[r])
                for r in range(3)]
    run = RunResult([p.sim.makespan], [], {k: statistics.median(v) for k, v in walls.items()}, [0.0] * 3, [0.0] * 3, 1e-4, 1e6,
                    action_cpu_medians=cpu, rank_cpu_s=rank_cpu)
    out = compare(p, run)
    assert out["error"] == pytest.approx(0.0, abs=1e-12)
    assert out["per_action_mape"] == pytest.approx(0.0, abs=1e-12) and out["work_mape"] == pytest.approx(0.0, abs=1e-12)
    assert out["rank_work_predicted_s"] == pytest.approx(rank_cpu)


def test_cpu_clock_profile_keeps_the_callers_gradients():
    torch = pytest.importorskip("torch")
    from pipesched.profile import measure_profile

    layers = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU()), torch.nn.Linear(16, 4)]
    sentinel = torch.full_like(layers[1].weight, 7.0)
    layers[1].weight.grad = sentinel
    prof = measure_profile(layers, torch.randn(4, 8), repeats=2, clock="cpu", loss_fn=lambda out: out.square().mean())
    assert prof.reference["clock"] == "cpu" and prof.reference["statistic"] == "median"
    assert layers[1].weight.grad is sentinel and layers[0][0].weight.grad is None
    assert all(lay.fwd_s > 0 and lay.bwd_s > 0 for lay in prof.layers)
    with pytest.raises(KeyError):
        measure_profile(layers, torch.randn(4, 8), repeats=1, clock="sundial")


@pytest.mark.slow
def test_calibrate_cpu_measures_share_and_messages():
    pytest.importorskip("torch")
    import os

    from pipesched.calibrate import calibrate_cpu

    cal = calibrate_cpu(2, 4096, window_s=0.2, alternations=1, rounds=20)
    assert cal.ranks == 2 and cal.message_bytes == 4096
    assert 0 < cal.cpu_share <= (os.cpu_count() or 1) + 0.2
    assert cal.one_way_s > 0 and cal.message_cpu_s >= 0 and cal.foreign_cores >= 0
    assert cal.solo_rate > 0 and cal.all_rate > 0 and cal.slowdown > 0


# --------------------------------------------------------------------------------------------------------------
# Efficiency of an oversubscribed CPU
# --------------------------------------------------------------------------------------------------------------

def test_efficiency_changes_nothing_while_ranks_fit_on_the_cores():
    sched = make_schedule("1f1b", 4, 8)
    costs = {s: StageCost(f=1.0 + 0.3 * s, b=2.0, out_bytes=1.0) for s in range(4)}
    links = LinkModel.uniform(4, 1e3, 0.01)
    ideal = simulate(sched, costs, links, cores=SharedCpu(4, 0.05, 0.01))
    lossy = simulate(sched, costs, links, cores=SharedCpu(4, 0.05, 0.01, efficiency=0.6))
    assert lossy.makespan == ideal.makespan


def test_efficiency_scales_the_shared_rate():
    """Two ranks on one core: GPipe's forwards of stage 1 trail stage 0's by one, so apart from the first and the
    last forward both compute at once, each at ``efficiency / 2`` (free backwards, no messages)."""
    m, f = 6, 1.0
    sched = make_schedule("gpipe", 2, m)
    costs = {s: StageCost(f=f, b=0.0) for s in range(2)}
    for eff in (1.0, 0.8, 0.5):
        res = simulate(sched, costs, cores=SharedCpu(1.0, efficiency=eff))
        # first forward alone (rate 1), then 2(m-1) forwards' work at total rate eff, then the last one alone
        assert res.makespan == pytest.approx(f + 2 * (m - 1) * f / eff + f, rel=1e-12)


def test_bad_efficiency_is_refused():
    for bad in (0.0, -0.1, 1.2):
        with pytest.raises(ValueError, match="efficiency"):
            SharedCpu(2.0, efficiency=bad)


@settings(max_examples=40, deadline=None)
@given(p=st.integers(2, 4), extra=st.integers(0, 4), cores=st.sampled_from([1.0, 1.5, 2.0]),
       eff=st.floats(0.55, 1.0), seed=st.integers(0, 10_000), family=st.sampled_from(["1f1b", "gpipe", "zbh1"]))
def test_solve_efficiency_recovers_the_efficiency_of_a_simulated_run(p, extra, cores, eff, seed, family):
    from pipesched.calibrate import solve_efficiency

    rng = random.Random(seed)
    sched = make_schedule(family, p, p + extra)
    costs = {s: StageCost(f=rng.uniform(0.5, 2.0), b=rng.uniform(1.0, 4.0), out_bytes=1.0) for s in range(p)}
    links = LinkModel.uniform(p, 1e3, 0.01)
    shared = SharedCpu(cores, 0.02, 0.005)
    measured = simulate(sched, costs, links, cores=dataclasses.replace(shared, efficiency=eff)).makespan
    found = solve_efficiency(sched, costs, links, shared, measured)
    again = simulate(sched, costs, links, cores=dataclasses.replace(shared, efficiency=found)).makespan
    assert again == pytest.approx(measured, rel=1e-3)
    # the simulated time never shrinks as the efficiency falls
    assert simulate(sched, costs, links, cores=dataclasses.replace(shared, efficiency=min(1.0, found + 0.1))).makespan <= again + 1e-9


def test_solve_efficiency_clamps_to_its_range():
    from pipesched.calibrate import solve_efficiency

    sched = make_schedule("1f1b", 4, 8)
    costs = {s: StageCost(f=1.0, b=2.0) for s in range(4)}
    shared = SharedCpu(2.0)
    ideal = simulate(sched, costs, cores=shared).makespan
    assert solve_efficiency(sched, costs, None, shared, 0.9 * ideal) == 1.0      # faster than ideal sharing: nothing lost
    assert solve_efficiency(sched, costs, None, shared, 10 * ideal, low=0.5) == 0.5
