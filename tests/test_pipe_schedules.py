"""Schedules as data, validator, event-driven simulator and lower bounds: closed forms and invariants."""

from __future__ import annotations

import json
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesched.devices import LinkModel
from pipesched.partition import in_flight
from pipesched.schedules import (
    LOOPED,
    SCHEDULES,
    Action,
    Schedule,
    ScheduleError,
    chimera,
    gpipe,
    interleaved_1f1b,
    interleaved_zb,
    looped_bfs,
    make_schedule,
    one_f_one_b,
    validate,
    zb_h1,
    zbv,
)
from pipesched.simulate import StageCost, chrome_trace, closed_form_bubble, gantt_png, lower_bound, simulate, uniform_costs


@pytest.mark.parametrize("family", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(2, 1), (4, 4), (4, 8), (3, 7), (8, 16), (5, 3)])
def test_gpipe_1f1b_bubble_closed_form(family, p, m):
    F, B = 1.5, 2.5
    res = simulate(make_schedule(family, p, m), uniform_costs(p, F, B))
    assert res.makespan == pytest.approx((m + p - 1) * (F + B))
    assert res.bubble_fraction == pytest.approx(closed_form_bubble(family, p, m))
    assert lower_bound(make_schedule(family, p, m), uniform_costs(p, F, B))["bound_s"] == pytest.approx(res.makespan)


@pytest.mark.parametrize(("p", "m"), [(4, 8), (4, 4), (8, 16), (6, 13)])
def test_1f1b_holds_p_microbatches_on_first_stage_gpipe_holds_m(p, m):
    res = simulate(one_f_one_b(p, m), uniform_costs(p, 1.0, 2.0))
    assert res.peak_in_flight[0] == min(p, m)
    assert [res.peak_in_flight[s] for s in range(p)] == [min(m, p - s) for s in range(p)]
    assert simulate(gpipe(p, m), uniform_costs(p, 1.0, 2.0)).peak_in_flight[0] == m


@pytest.mark.parametrize(("p", "m", "v"), [(4, 8, 2), (4, 8, 4), (4, 12, 3), (2, 4, 2), (8, 16, 2), (4, 16, 2)])
def test_interleaved_bubble_divided_by_v(p, m, v):
    F, B = 1.0, 2.0     # per device: each of the v chunks costs 1/v of it
    sched = interleaved_1f1b(p, m, v)
    assert validate(sched) == []
    res = simulate(sched, uniform_costs(p * v, F / v, B / v))
    assert res.makespan == pytest.approx(m * (F + B) + (p - 1) * (F + B) / v)
    assert res.bubble_fraction == pytest.approx(closed_form_bubble("interleaved", p, m, v))


@pytest.mark.parametrize(("p", "m"), [(4, 8), (4, 4), (8, 16), (3, 9)])
def test_zb_h1_bubble(p, m):
    f, i, w = 1.0, 1.0, 1.0    # ZB-H1: (p-1)(F+I-W) of idle per rank at F = I = W
    sched = zb_h1(p, m)
    assert validate(sched) == []
    res = simulate(sched, uniform_costs(p, f, i + w, i, w))
    assert res.makespan == pytest.approx(m * (f + i + w) + (p - 1) * (f + i - w))
    assert res.makespan < simulate(one_f_one_b(p, m), uniform_costs(p, f, i + w)).makespan
    assert max(res.peak_in_flight.values()) <= p


@pytest.mark.parametrize(("D", "N"), [(2, 2), (4, 4), (4, 8), (6, 6), (6, 12), (8, 8), (8, 16)])
def test_chimera_bubble(D, N):
    """Chimera's (D-2)/(2N+D-2) holds in the paper's setting of equal forward and backward slots, N a multiple of D."""
    sched = chimera(D, N)
    assert validate(sched) == []
    res = simulate(sched, {s: StageCost(f=1.0, b=1.0) for s in range(2 * D)})
    assert res.bubble_fraction == pytest.approx(closed_form_bubble("chimera", D, N), abs=1e-12)
    one = simulate(one_f_one_b(D, N), uniform_costs(D, 2.0, 2.0))   # same work per rank as a plain pipeline
    assert res.makespan < one.makespan or D == 2
    assert sched.stage_rank[D + 0] == D - 1 and sched.stage_layers[D + 0] == 0   # replica of stage 0 on the last rank


def test_chimera_replica_allreduce_is_simulated():
    D = 4
    costs = {s: StageCost(f=1.0, b=1.0, reduce_s=0.5) for s in range(2 * D)}
    res = simulate(chimera(D, D), costs)
    reduces = [s for s in res.timeline if s.action.kind == "REDUCE_GRAD"]
    assert len(reduces) == 2 * D
    for span in reduces:   # after both replicas' last backward
        layer = chimera(D, D).stage_layers[span.action.stage]
        last = max(s.end for s in res.timeline if s.action.kind == "B" and chimera(D, D).stage_layers[s.action.stage] == layer)
        assert span.start >= last - 1e-12


def test_chimera_and_interleaved_reject_bad_shapes():
    with pytest.raises(ScheduleError, match="even number of ranks"):
        chimera(3, 6)
    with pytest.raises(ScheduleError, match="at least as many micro-batches"):
        interleaved_1f1b(4, 2, 2)


@settings(max_examples=40, deadline=None)
@given(family=st.sampled_from(sorted(SCHEDULES)), p=st.integers(1, 6), m=st.integers(1, 12), seed=st.integers(0, 10**6))
def test_every_schedule_is_valid_and_never_beats_its_lower_bound(family, p, m, seed):
    if family == "chimera":
        p, m = 2 * ((p + 1) // 2), 2 * ((m + 1) // 2)
    try:
        sched = make_schedule(family, p, m, chunks=2)
    except ScheduleError:      # a shape the family does not take (interleaved: m < p, DualPipe-V: m < 2p, ...)
        return
    assert validate(sched) == []
    rng = random.Random(seed)
    costs = {}
    for s in range(sched.num_stages):
        i, w = rng.uniform(0.1, 2), rng.uniform(0.1, 2)
        costs[s] = StageCost(f=rng.uniform(0.1, 2), b=i + w, i=i, w=w, out_bytes=rng.uniform(0, 100), saved_bytes=rng.uniform(1, 10),
                             wgrad_bytes=0.5, transient_bytes=rng.uniform(0, 3), state_bytes=rng.uniform(0, 5), reduce_s=rng.uniform(0, 1))
    links = LinkModel.from_matrices([[rng.uniform(10, 100) for _ in range(p)] for _ in range(p)], [[rng.uniform(0, 0.5)] * p for _ in range(p)])
    res = simulate(sched, costs, links)
    lb = lower_bound(sched, costs, links)
    assert res.makespan >= lb["bound_s"] * (1 - 1e-9)
    assert res.makespan >= lb["work_bound_s"] * (1 - 1e-9)
    busy = [sum(s.end - s.start for s in res.timeline if s.rank == r) for r in range(p)]
    assert busy == pytest.approx(res.busy)
    # ranks never run two actions at once; memory returns to the model states at the end
    for r in range(p):
        spans = sorted((s.start, s.end) for s in res.timeline if s.rank == r)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:], strict=False))
        states = sum(costs[s].state_bytes for s in range(sched.num_stages) if sched.stage_rank[s] == r)
        assert res.memory_trace[r][-1][1] == pytest.approx(states)
    # processor sharing only slows things down
    assert simulate(sched, costs, links, cores=1).makespan >= res.makespan * (1 - 1e-9)
    # the run-ahead engine and the event loop are two implementations of one model: identical results
    events = simulate(sched, costs, links, engine="events")
    assert events.timeline == res.timeline and events.peak_memory == res.peak_memory and events.peak_in_flight == res.peak_in_flight
    assert sorted(events.transfers, key=repr) == sorted(res.transfers, key=repr) and events.busy == res.busy


def test_validator_finds_broken_schedules():
    s = one_f_one_b(2, 2)
    s.actions[1] = [Action(1, "B", 0), Action(1, "F", 0), Action(1, "F", 1), Action(1, "B", 1)]
    assert any("before its forward" in p for p in validate(s))
    s = one_f_one_b(2, 2)
    s.actions[0] = [Action(0, "F", 0), Action(0, "F", 1), Action(0, "B", 0)]
    assert any("stage 0: backwards" in p for p in validate(s))
    s = one_f_one_b(2, 2)
    s.actions[0] = [Action(1, "F", 0)] + s.actions[0]
    assert any("belongs to rank 1" in p for p in validate(s))
    # deadlock: rank 0 waits for micro-batch 1's gradient before it sends micro-batch 1 forward
    s = one_f_one_b(2, 2)
    s.actions[0] = [Action(0, "F", 0), Action(0, "B", 1), Action(0, "F", 1), Action(0, "B", 0)]
    problems = validate(s)
    assert any("before its forward" in p for p in problems)
    s = gpipe(2, 2)
    s.actions[0] = [Action(0, "F", 0), Action(0, "B", 0), Action(0, "F", 1), Action(0, "B", 1)]
    s.actions[1] = [Action(1, "F", 1), Action(1, "F", 0), Action(1, "B", 0), Action(1, "B", 1)]
    assert any("deadlock" in p for p in validate(s))


def test_memory_limit_check():
    costs = {s: StageCost(f=1, b=2, saved_bytes=10, state_bytes=100) for s in range(4)}
    assert validate(one_f_one_b(4, 8), costs, memory_limit=140) == []       # 100 + 4 * 10 on rank 0
    assert any("rank 0: peak memory" in p for p in validate(one_f_one_b(4, 8), costs, memory_limit=139))
    assert validate(gpipe(4, 8), costs, memory_limit=140)                      # GPipe holds all 8


def test_recompute_transient_and_wgrad_memory():
    costs = {0: StageCost(f=1, b=2, i=1, w=1, saved_bytes=10, wgrad_bytes=4, transient_bytes=7, state_bytes=0)}
    res = simulate(zb_h1(1, 1), costs)
    levels = [lvl for _, lvl in res.memory_trace[0]]
    assert max(levels) == 17 and 4 in levels and levels[-1] == 0


def test_transfers_use_the_link_and_serialise():
    sched = gpipe(2, 2)
    costs = {0: StageCost(f=1.0, b=1.0, out_bytes=100.0), 1: StageCost(f=1.0, b=1.0, out_bytes=0.0)}
    links = LinkModel.uniform(2, 50.0, 0.25)     # 2 s + 0.25 s per message
    res = simulate(sched, costs, links)
    acts = [t for t in res.transfers if t.what.startswith("act")]
    assert [(t.start, t.end) for t in acts] == [(1.0, 3.25), (3.0, 5.25)]
    f1 = {(s.action.mb): s.start for s in res.timeline if s.rank == 1 and s.action.kind == "F"}
    assert f1 == {0: 3.25, 1: 5.25}


def test_schedule_json_round_trip_and_comms_lowering():
    for sched in (one_f_one_b(3, 4), interleaved_1f1b(2, 4, 2), zb_h1(3, 3), chimera(4, 4)):
        back = Schedule.from_dict(json.loads(json.dumps(sched.to_dict())))
        assert back.rows() == sched.rows() and back.stage_rank == sched.stage_rank and back.chains == sched.chains
        assert validate(back) == []
    low = one_f_one_b(2, 2).with_comms()
    assert [str(a) for a in low[1]] == ["1RECV_F0", "1F0", "1B0", "1SEND_B0", "1RECV_F1", "1F1", "1B1", "1SEND_B1"]
    assert Action.parse("3SEND_B12") == Action(3, "SEND_B", 12) and str(Action.parse("0REDUCE_GRAD")) == "0REDUCE_GRAD"
    with pytest.raises(ScheduleError, match="bad action"):
        Action.parse("3X1")


def test_torch_accepts_our_schedules():
    """torch's own validator and comms dry-run accept our rows (compute_only lowering by torch)."""
    ts = pytest.importorskip("torch.distributed.pipelining.schedules")
    for sched in (gpipe(4, 6), one_f_one_b(4, 6), zb_h1(4, 6), interleaved_1f1b(4, 8, 2), interleaved_zb(4, 8, 2), looped_bfs(3, 5, 2),
                  zbv(4, 8), make_schedule("dualpipev", 3, 7)):
        order = {r: [ts._Action.from_str(x) for x in row] for r, row in enumerate(sched.rows())}
        mapping = ts._validate_schedule(order, sched.ranks, sched.num_stages, sched.microbatches)
        assert mapping == dict(enumerate(sched.stage_rank))
        lowered = ts._add_send_recv(order, stage_to_rank=lambda s, m=mapping: m[s], num_stages=sched.num_stages)
        ts._simulate_comms_compute(lowered, lambda s, m=mapping: m[s], sched.num_stages)
        ours = {r: [ts._Action.from_str(str(a)) for a in acts] for r, acts in sched.with_comms().items()}
        ts._simulate_comms_compute(ours, lambda s, m=mapping: m[s], sched.num_stages)


def test_gantt_and_chrome_trace(tmp_path):
    res = simulate(one_f_one_b(4, 8), uniform_costs(4, 1.0, 2.0))
    png = gantt_png(res, tmp_path / "g.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = chrome_trace(res)
    compute = [e for e in events if e["ph"] == "X" and e["cat"] != "p2p"]
    assert len(compute) == 4 * 16
    assert max(e["ts"] + e["dur"] for e in compute) == pytest.approx(res.makespan * 1e6)
    assert math.isclose(sum(e["dur"] for e in compute) / 1e6, sum(res.busy))


# --------------------------------------------------------------------------------------------------------------
# The families torch ships (issue #21): torch's own order, closed forms, memory model
# --------------------------------------------------------------------------------------------------------------

TORCH_CLASS_OF = {"interleaved": "ScheduleInterleaved1F1B", "interleaved_zb": "ScheduleInterleavedZeroBubble",
                  "zbh1": "ScheduleInterleavedZeroBubble", "looped_bfs": "ScheduleLoopedBFS", "zbv": "ScheduleZBVZeroBubble",
                  "dualpipev": "ScheduleDualPipeV"}


def torch_rows(family: str, p: int, m: int, v: int) -> list[list[str]]:
    """The per-rank compute order torch's schedule class builds (its own _calculate_single_rank_operations), with its
    empty slots dropped and DualPipe-V's overlapped F+B pairs as the two actions torch runs in turn."""
    ts = pytest.importorskip("torch.distributed.pipelining.schedules")
    from pipesched.export import TORCH_CLASSES

    assert TORCH_CLASSES[family] == TORCH_CLASS_OF[family]
    obj = object.__new__(getattr(ts, TORCH_CLASS_OF[family]))
    obj.pp_group_size, obj._n_microbatches, obj.n_local_stages, obj._stages = p, m, v, [None] * v
    obj.num_stages = obj._num_stages = p * v
    obj.number_of_rounds = max(1, m // p)
    obj.microbatches_per_round = m // obj.number_of_rounds
    obj.pipeline_order = {r: obj._calculate_single_rank_operations(r) for r in range(p)}
    if family in ("interleaved_zb", "zbh1"):
        obj.pipeline_order = obj._add_bubbles_to_actions(p * v)
    return [[str(x) for a in obj.pipeline_order[r] if a is not None for x in (a.sub_actions or (a,))] for r in range(p)]


@pytest.mark.parametrize("family", ["interleaved", "interleaved_zb", "zbh1", "looped_bfs", "zbv", "dualpipev"])
def test_action_order_equals_torchs(family):
    """Each family's order is what torch's class of that family executes, for every shape both accept."""
    compared = 0
    for p in range(1, 6):
        for m in range(1, 13):
            for v in ((2, 3) if family in LOOPED else (1,) if family == "zbh1" else (2,)):
                try:
                    ours = make_schedule(family, p, m, chunks=v)
                except ScheduleError:
                    continue
                assert ours.rows() == torch_rows(family, p, m, v), (p, m, v)
                assert validate(ours) == []
                compared += 1
    assert compared >= 30


def test_v_placement_is_torchs():
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    for p in range(1, 6):
        assert zbv(p, 2 * p).stage_rank == tuple(generate_stage_to_rank_mapping(p, 2 * p, style="v")[s] for s in range(2 * p))


@pytest.mark.parametrize(("p", "m", "v"), [(2, 4, 2), (4, 8, 2), (4, 4, 2), (3, 9, 3), (8, 16, 2), (4, 6, 2)])
def test_looped_bfs_bubble_and_memory(p, m, v):
    F, B = 1.0, 2.0    # per device; each chunk costs 1/v
    sched = looped_bfs(p, m, v)
    res = simulate(sched, uniform_costs(p * v, F / v, B / v))
    assert res.makespan == pytest.approx(m * (F + B) + (p - 1) * (F + B) / v)
    assert res.bubble_fraction == pytest.approx(closed_form_bubble("looped_bfs", p, m, v))
    assert all(res.peak_in_flight[s] == m for s in range(p * v))       # every chunk holds all m, like GPipe


@pytest.mark.parametrize(("p", "m", "v"), [(2, 4, 2), (4, 8, 2), (4, 4, 2), (3, 9, 3), (8, 16, 2), (4, 16, 3)])
def test_interleaved_zb_bubble_and_memory(p, m, v):
    sched = interleaved_zb(p, m, v)
    res = simulate(sched, uniform_costs(p * v, 1.0, 2.0, 1.0, 1.0))
    assert res.makespan == pytest.approx(3 * m * v + p - 1)               # (p-1) F of idle per rank at F = I = W
    assert res.bubble_fraction == pytest.approx(closed_form_bubble("interleaved_zb", p, m, v))
    assert [res.peak_in_flight[s] for s in range(p * v)] == [min(m, 2 * p) if s < p else min(m, p) for s in range(p * v)]
    one = simulate(interleaved_1f1b(p, m, v), uniform_costs(p * v, 1.0, 2.0))
    assert res.makespan < one.makespan


@pytest.mark.parametrize("family", ["zbv", "dualpipev"])
@pytest.mark.parametrize(("p", "m"), [(1, 2), (2, 4), (2, 7), (3, 6), (4, 8), (4, 13), (6, 12)])
def test_v_schedules_bubble_and_memory(family, p, m):
    sched = make_schedule(family, p, m)
    res = simulate(sched, uniform_costs(2 * p, 1.0, 2.0, 1.0, 1.0))
    assert res.makespan == pytest.approx(6 * m + p - 1)                  # (p-1) F of idle per rank at F = I = W, m >= 2p
    assert res.bubble_fraction == pytest.approx(closed_form_bubble(family, p, m))
    assert [res.peak_in_flight[s] for s in range(2 * p)] == [min(m, 2 * p - s) for s in range(2 * p)]
    assert res.makespan <= simulate(zb_h1(p, m), uniform_costs(p, 2.0, 4.0, 2.0, 2.0)).makespan


def test_chimera_closed_form_is_for_equal_forward_and_backward():
    """Issue #21.5: (D-2)/(2N+D-2) holds for F = B (the docstring said B = 2F, where the simulated bubble differs)."""
    assert "F = B" in closed_form_bubble.__doc__ and "B = 2F" not in closed_form_bubble.__doc__.split("with F = B")[0]
    at_equal = simulate(chimera(4, 8), {s: StageCost(f=1.0, b=1.0) for s in range(8)})
    at_double = simulate(chimera(4, 8), {s: StageCost(f=1.0, b=2.0) for s in range(8)})
    assert at_equal.bubble_fraction == pytest.approx(closed_form_bubble("chimera", 4, 8))
    assert at_double.bubble_fraction != pytest.approx(closed_form_bubble("chimera", 4, 8))


@settings(max_examples=60, deadline=None)
@given(family=st.sampled_from(sorted(SCHEDULES)), p=st.integers(1, 6), m=st.integers(1, 14), v=st.integers(1, 3), seed=st.integers(0, 10**6))
def test_memory_model_in_flight_matches_the_simulator(family, p, m, v, seed):
    """For every family, shape and costs: the partitioner's in-flight count is at least the simulated peak, and equal."""
    if family == "chimera":
        p, m = 2 * ((p + 1) // 2), 2 * ((m + 1) // 2)
    try:
        sched = make_schedule(family, p, m, chunks=v)
    except ScheduleError:
        return
    rng = random.Random(seed)
    costs = {s: StageCost(f=rng.uniform(0.1, 2), b=rng.uniform(0.2, 3), i=rng.uniform(0.1, 2), w=rng.uniform(0.1, 2))
             for s in range(sched.num_stages)}
    res = simulate(sched, costs)
    chunks = v if family in LOOPED else 1
    if family == "chimera":
        for k in range(p):
            peak = max(res.peak_in_flight[s] for s in range(2 * p) if sched.stage_layers[s] == k)
            assert in_flight(family, k, p, m, ranks=p) == peak
        return
    for s in range(sched.num_stages):
        assert in_flight(family, s, sched.num_stages, m, ranks=p, chunks=chunks) == res.peak_in_flight[s], s
