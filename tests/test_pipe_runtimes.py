"""How torch's runtimes post messages (pipesched.runtimes) and what a rendezvous transport does in the simulator."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesched.devices import LinkModel
from pipesched.runtimes import RUNTIMES, asap_lowering_rendezvous, builtin_1f1b_rendezvous, rendezvous_for
from pipesched.schedules import ScheduleError, make_schedule
from pipesched.simulate import Rendezvous, SharedCpu, StageCost, simulate

# ----------------------------------------------------------------------------------------------------------------
# torch's lowering, reproduced
# ----------------------------------------------------------------------------------------------------------------


def _torch_recv_positions(schedule) -> dict[tuple[int, str, int], tuple[int, int]]:
    """Where torch's own ``_add_send_recv`` puts every receive: (rank, index of the next compute action)."""
    from torch.distributed.pipelining.schedules import _Action, _add_send_recv, _ComputationType

    compute = {r: [_Action.from_str(str(a)) for a in acts] for r, acts in schedule.actions.items()}
    lowered = _add_send_recv(compute, stage_to_rank=lambda s: schedule.stage_rank[s], num_stages=schedule.num_stages)
    out = {}
    for r, acts in lowered.items():
        computes = 0
        for a in acts:
            if a.computation_type == _ComputationType.RECV_F:
                out[(a.stage_index, "act", a.microbatch_index)] = (r, computes)
            elif a.computation_type == _ComputationType.RECV_B:
                out[(a.stage_index, "grad", a.microbatch_index)] = (r, computes)
            elif a.computation_type not in (_ComputationType.SEND_F, _ComputationType.SEND_B):
                computes += 1
    return out


@pytest.mark.parametrize("family,ranks,m", [("1f1b", 2, 8), ("1f1b", 4, 8), ("1f1b", 4, 5), ("gpipe", 3, 6),
                                            ("zbh1", 4, 8), ("interleaved", 2, 8), ("interleaved", 4, 8)])
def test_asap_lowering_puts_receives_where_torch_does(family, ranks, m):
    schedule = make_schedule(family, ranks, m)
    assert dict(asap_lowering_rendezvous(schedule).recv_before) == _torch_recv_positions(schedule)


# ----------------------------------------------------------------------------------------------------------------
# torch's Schedule1F1B
# ----------------------------------------------------------------------------------------------------------------


def test_builtin_1f1b_posts_each_receive_before_its_consumer():
    schedule = make_schedule("1f1b", 4, 8)
    rv = builtin_1f1b_rendezvous(schedule)
    for r, acts in schedule.actions.items():
        for i, a in enumerate(acts):
            prev, nxt = schedule.neighbours(a.stage)
            if a.kind == "F" and prev is not None:
                assert rv.recv_before[(a.stage, "act", a.mb)] == (r, i)
            if a.kind == "B" and nxt is not None:
                assert rv.recv_before[(a.stage, "grad", a.mb)] == (r, i)
    # a rank waits only for its own sends, each after producing it and at most once
    seen = set()
    for (r, i), keys in rv.send_waits.items():
        for stage, kind, mb in keys:
            assert (kind, stage) in (("act", r + 1), ("grad", r - 1))
            producer = next(j for j, a in enumerate(schedule.actions[r]) if schedule.outgoing(a) == (stage, kind, mb))
            assert producer < i and (stage, kind, mb) not in seen
            seen.add((stage, kind, mb))


@pytest.mark.parametrize("family,ranks", [("gpipe", 4), ("interleaved", 2), ("zbh1", 4)])
def test_builtin_1f1b_refuses_other_orders(family, ranks):
    with pytest.raises(ScheduleError):
        builtin_1f1b_rendezvous(make_schedule(family, ranks, 8))


def test_unknown_runtime_is_refused():
    with pytest.raises(ScheduleError, match="unknown runtime"):
        rendezvous_for("megatron", make_schedule("1f1b", 2, 4))


@pytest.mark.parametrize("m", [2, 4, 9])
def test_late_receives_of_a_busy_last_rank_cost_one_handshake_per_forward(m):
    """Two ranks, a near-free first stage and a busy last one, free links: with every receive posted in advance
    the last rank runs back to back, ``m (f + b)``; under Schedule1F1B it asks for each forward's input only
    after its previous backward, and its first rank is then blocked on that send, so each forward but the first
    waits one handshake: ``m (f + b) + (m - 1) h``. Torch's _PipelineScheduleRuntime posts them early: no wait."""
    eps, f, b, h = 1e-9, 1.0, 2.0, 0.25
    schedule = make_schedule("1f1b", 2, m)
    costs = {0: StageCost(f=eps, b=eps), 1: StageCost(f=f, b=b)}
    ideal = simulate(schedule, costs).makespan
    builtin = simulate(schedule, costs, rendezvous=rendezvous_for("torch-1f1b", schedule, h)).makespan
    runtime = simulate(schedule, costs, rendezvous=rendezvous_for("torch-runtime", schedule, h)).makespan
    assert ideal == pytest.approx(m * (f + b) + 2 * eps, abs=1e-6)
    assert builtin == pytest.approx(m * (f + b) + (m - 1) * h, abs=1e-6)
    assert runtime == pytest.approx(ideal, abs=1e-6)


def test_a_send_moves_only_once_its_receive_is_posted():
    """GPipe on 2 ranks, 2 micro-batches, links of 1 s serialisation + 0.5 s latency. Rank 1 posts the receive of
    micro-batch 1 only when its F0 ends (t = 3.5), after rank 0 sent it (t = 2): the data moves one latency after
    the post (4 -> 5.5) where it would have arrived at 3.5; a sender blocked on that send makes it a handshake."""
    schedule = make_schedule("gpipe", 2, 2)
    assert [str(a) for a in schedule.actions[1]][:2] == ["1F0", "1F1"]
    costs = {s: StageCost(f=1.0, b=1.0, out_bytes=10.0) for s in range(2)}
    links = LinkModel.uniform(2, 10.0, 0.5)

    def f1_start(rv) -> float:
        res = simulate(schedule, costs, links, rendezvous=rv)
        return next(x.start for x in res.timeline if x.rank == 1 and str(x.action) == "1F1")

    assert f1_start(None) == pytest.approx(3.5)                       # arrived at 3.5, rank 1 free at 3.5
    early = Rendezvous(recv_before={(1, "act", 0): (1, 0), (1, "act", 1): (1, 0)}, handshake_s=3.0)
    assert f1_start(early) == pytest.approx(3.5)
    # torch's lowering visits the ranks round-robin: the receive of micro-batch 1 lands after rank 1's F0
    assert rendezvous_for("torch-runtime", schedule).recv_before[(1, "act", 1)] == (1, 1)
    late = dataclasses.replace(early, recv_before={**early.recv_before, (1, "act", 1): (1, 1)})
    assert f1_start(late) == pytest.approx(5.5)                       # 3.5 + 0.5 latency + 1 + 0.5
    blocked = dataclasses.replace(late, send_waits={(0, 2): ((1, "act", 1),)})
    assert f1_start(blocked) == pytest.approx(3.5 + 3.0 + 1 + 0.5)    # the handshake instead of the latency


# ----------------------------------------------------------------------------------------------------------------
# Invariants on random pipelines
# ----------------------------------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(p=st.integers(2, 4), extra=st.integers(0, 4), seed=st.integers(0, 10_000), h=st.floats(0.0, 0.5),
       cores=st.sampled_from([None, 1.0, 2.0]))
def test_posting_late_never_helps(p, extra, seed, h, cores):
    rng = random.Random(seed)
    schedule = make_schedule("1f1b", p, p + extra)
    costs = {s: StageCost(f=rng.uniform(0.2, 2.0), b=rng.uniform(0.5, 4.0), out_bytes=1.0) for s in range(p)}
    links = LinkModel.uniform(p, 100.0, 0.01)
    shared = None if cores is None else SharedCpu(cores, 0.01)
    ideal = simulate(schedule, costs, links, cores=shared).makespan
    for runtime in RUNTIMES[1:]:
        rv = rendezvous_for(runtime, schedule, h)
        t = simulate(schedule, costs, links, cores=shared, rendezvous=rv).makespan
        if cores is None:   # no processor sharing: a pure longest path, monotone in every delay
            assert t >= ideal - 1e-9
            slower = simulate(schedule, costs, links, rendezvous=dataclasses.replace(rv, handshake_s=h + 0.1)).makespan
            assert slower >= t - 1e-9
        assert t <= ideal + (len(schedule.actions[0]) * 2 + 2) * (h + 0.02) * p + 1e-6


@settings(max_examples=30, deadline=None)
@given(p=st.integers(2, 4), extra=st.integers(0, 4), h=st.floats(0.0, 0.02), seed=st.integers(0, 10_000))
def test_solve_handshake_recovers_the_handshake_of_a_simulated_run(p, extra, h, seed):
    from pipesched.calibrate import solve_handshake

    rng = random.Random(seed)
    schedule = make_schedule("1f1b", p, p + extra)
    costs = {s: StageCost(f=rng.uniform(0.001, 0.004), b=rng.uniform(0.002, 0.008), out_bytes=1e4) for s in range(p - 1)}
    costs[p - 1] = StageCost(f=0.02, b=0.04, out_bytes=1e4)      # a busy last rank: late receives on its critical path
    links = LinkModel.uniform(p, 1e9, 5e-5)
    shared = SharedCpu(2.0, 3e-4, 5e-5, 0.9)
    rv = rendezvous_for("torch-1f1b", schedule)
    measured = simulate(schedule, costs, links, cores=shared, rendezvous=dataclasses.replace(rv, handshake_s=h)).makespan
    found = solve_handshake(schedule, costs, links, shared, rv, measured)
    again = simulate(schedule, costs, links, cores=shared, rendezvous=dataclasses.replace(rv, handshake_s=found)).makespan
    assert again == pytest.approx(measured, rel=1e-4, abs=1e-6)


def test_plans_carry_their_runtime():
    from pipesched.devices import Device
    from pipesched.plan import resimulate, uniform_plan, with_runtime
    from pipesched.profile import GPTConfig, analytic_profile

    prof = analytic_profile(GPTConfig(layers=8, hidden=1024, heads=8, seq_len=512, vocab=32000))
    devices = [Device(f"d{r}") for r in range(2)]
    links = LinkModel.uniform(2, 1e9, 1e-4)
    p = uniform_plan(prof, devices, links, microbatches=4)
    assert p.runtime == "ideal" and resimulate(p).makespan == pytest.approx(p.sim.makespan)
    q = with_runtime(p, "torch-1f1b", 0.01)
    assert q.runtime == "torch-1f1b" and q.handshake_s == 0.01
    assert q.sim.makespan >= p.sim.makespan - 1e-12
    assert resimulate(q).makespan == pytest.approx(q.sim.makespan)
