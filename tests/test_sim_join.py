"""The simulator's join ramp (``SimConfig.join_ramp_s``, the emulated TCP's convergence): closed forms and invariants.

The emulation runs behind the figures are ``bench/bench_emu_phase.py`` (the unshifted CASSINI pair over 30
iterations) and the CASSINI rows of ``bench/bench_emu.py``; docs/validation/emu.md tells what they showed.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emu import mixes
from emu.net import tcp_join_options
from emu.sim import simulate
from emu.workload import ComputePhase, Job, P2PPhase, Transfer, Workload
from topology import default_cluster
from topology.errors import InputError
from topology.fabrics import star

LINK_BPS = 25e9  # star()'s links: 200 Gb/s


@pytest.fixture(scope="module")
def cluster():
    return default_cluster()


def _senders(size: float, *, compute_s: float = 0.002, offset_b: float = 0.0, iterations: int = 1) -> Workload:
    """Jobs ``a`` (n0 -> n2) and ``b`` (n1 -> n2) of one flow each per iteration, meeting on n2's downlink only."""
    def job(name: str, src: str, offset: float) -> Job:
        phases = (ComputePhase("compute", compute_s), P2PPhase("send", (Transfer(src, "n2/gpu0", size),), after=("compute",)))
        return Job(name, (src, "n2/gpu0"), phases, iterations=iterations, start_offset=offset)

    return Workload("senders", [job("a", "n0/gpu0", 0.0), job("b", "n1/gpu0", offset_b)])


def _times(topo, workload, **options) -> dict[str, list[float]]:
    return {n: j.iteration_times() for n, j in simulate(topo, workload, latency=False, **options).jobs.items()}


# -- closed forms ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("t0", [0.0002, 0.0005])
def test_a_joining_flow_runs_at_its_join_weight_for_the_ramp_then_at_half(t0):
    # a alone for t0, then b joins: a gets c/(1+w) for tau, then c/2; b ends when the link has carried both (work conserving)
    size, tau, w, c = 25e6, 0.0002, 0.25, LINK_BPS
    times = _times(star(3), _senders(size, offset_b=t0), join_ramp_s=tau, join_weight=w)
    a_end = t0 + tau + 2 * (size - c * t0 - c * tau / (1 + w)) / c
    assert times["a"][0] == pytest.approx(0.002 + a_end, rel=1e-9)
    assert times["b"][0] == pytest.approx(0.002 + 2 * size / c - t0, rel=1e-9)
    plain = _times(star(3), _senders(size, offset_b=t0))
    assert plain["a"][0] == pytest.approx(0.002 + t0 + 2 * (size - c * t0) / c, rel=1e-9)   # the fluid model: fair at once


def test_an_aligned_pair_drifts_apart_by_delta_per_iteration():
    # both start together: the first listed counts as established, the other joins; every later iteration a starts alone
    # and b joins d_k later, so the offset grows by delta = tau (1 - w) / (1 + w) per iteration while the ramp fits in a's flow
    size, tau, w, c, compute = 25e6, 0.0001, 0.25, LINK_BPS, 0.002
    s = size / c
    delta = tau * (1 - w) / (1 + w)
    times = _times(star(3), _senders(size, compute_s=compute, iterations=5), join_ramp_s=tau, join_weight=w)
    assert times["a"] == pytest.approx([compute + 2 * s - (k + 1) * delta for k in range(5)], rel=1e-9)
    assert times["b"] == pytest.approx([compute + 2 * s - k * delta for k in range(5)], rel=1e-9)
    assert _times(star(3), _senders(size, compute_s=compute, iterations=5)) == {  # the fluid model: locked forever
        "a": pytest.approx([compute + 2 * s] * 5, rel=1e-9), "b": pytest.approx([compute + 2 * s] * 5, rel=1e-9)}


@settings(max_examples=25, deadline=None)
@given(d=st.floats(0.0, 1e-3))
def test_the_plain_model_keeps_any_offset_of_an_equal_pair(d):
    # the neutral equilibrium: b starts its 1 ms flow d after a's; a ends at 2 ms - d, b at 2 ms, so both next start d apart again
    s = 25e6 / LINK_BPS
    times = _times(star(3), _senders(25e6, offset_b=d, iterations=4))
    assert times["a"] == pytest.approx([0.002 + 2 * s - d] * 4, abs=1e-12)
    assert times["b"] == pytest.approx([0.002 + 2 * s - d] * 4, abs=1e-12)


# -- invariants --------------------------------------------------------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(tau=st.floats(1e-5, 1.5e-3), w=st.floats(0.05, 1.0), d=st.floats(0.0, 2e-3))
def test_the_pair_stays_between_the_interleaved_and_the_locked_iteration(cluster, tau, w, d):
    # each job's communication takes at least its own 2 ms and at most both jobs' 4 ms (the link never idles while it waits)
    times = _times(cluster, mixes.cassini_pair({"b": d}, iterations=8), join_ramp_s=tau, join_weight=w)
    for series in times.values():
        assert all(4e-3 - 1e-12 <= x <= 6e-3 + 1e-12 for x in series)


@settings(max_examples=15, deadline=None)
@given(tau=st.floats(1e-5, 1.5e-3), w=st.floats(0.05, 1.0))
def test_an_interleaved_pair_is_unchanged(cluster, tau, w):
    # b 2 ms after a: each job's 2 ms of communication falls in the other's 2 ms of compute, so nothing joins anything
    workload = mixes.cassini_pair({"b": 2e-3}, iterations=5)
    ramped, plain = _times(cluster, workload, join_ramp_s=tau, join_weight=w), _times(cluster, workload)
    assert ramped == {n: pytest.approx(x, rel=1e-12) for n, x in plain.items()}
    assert plain["a"] == pytest.approx([4e-3] * 5, rel=1e-12)


def test_the_cassini_shifted_pair_of_the_agreement_suite_is_unchanged(cluster):
    from bench.bench_emu import cassini_shifts

    shifted = mixes.cassini_pair(cassini_shifts(cluster, mixes.cassini_pair()))
    plain = simulate(cluster, shifted)
    ramped = simulate(cluster, shifted, **tcp_join_options(cluster, byte_scale=50))
    assert {n: j.iteration_times() for n, j in ramped.jobs.items()} == {n: j.iteration_times() for n, j in plain.jobs.items()}


@settings(max_examples=15, deadline=None)
@given(compute=st.floats(1e-4, 4e-3), nbytes=st.floats(1e6, 2e8), offset=st.floats(0.0, 3e-3), tau=st.floats(1e-5, 2e-3),
       w=st.floats(0.05, 1.0))
def test_jobs_that_share_no_link_are_unchanged(cluster, compute, nbytes, offset, tau, w):
    # rings on rails 0 and 1 (each job's own NICs and NVLinks): the join ramp never applies
    workload = Workload("apart", [
        Job.data_parallel("a", [f"node{h}/gpu0" for h in range(4)], compute_s=compute, nbytes=nbytes, iterations=3),
        Job.data_parallel("b", [f"node{h}/gpu1" for h in range(4)], compute_s=compute * 1.5, nbytes=nbytes, iterations=3,
                          start_offset=offset),
    ])
    assert _times(cluster, workload, join_ramp_s=tau, join_weight=w) == _times(cluster, workload)


def test_the_unshifted_pair_leaves_lockstep_and_settles_one_ring_step_apart(cluster):
    # what the emulation showed (docs/validation/emu.md): 6 ms, then 5 ms per iteration once the jobs run one step apart
    times = _times(cluster, mixes.cassini_pair(iterations=12), **tcp_join_options(cluster, byte_scale=50))
    assert times["b"][0] == pytest.approx(6e-3, rel=1e-9)   # work conserving: the joiner ends when both jobs' bytes are through
    assert times["a"][0] < 6e-3
    assert all(x == pytest.approx(5e-3, rel=0.02) for x in times["a"][4:] + times["b"][5:])


def test_bad_join_options_are_input_errors(cluster):
    with pytest.raises(InputError, match="join_ramp_s"):
        simulate(cluster, mixes.cassini_pair(iterations=1), join_ramp_s=-1.0)
    with pytest.raises(InputError, match="join_weight"):
        simulate(cluster, mixes.cassini_pair(iterations=1), join_ramp_s=1e-3, join_weight=0.0)


def test_the_join_ramp_is_the_same_at_any_time_scale_and_grows_with_the_byte_scale(cluster):
    one, fifty = tcp_join_options(cluster), tcp_join_options(cluster, byte_scale=50)
    assert fifty["join_ramp_s"] == pytest.approx(50 * one["join_ramp_s"])
    assert one["join_ramp_s"] == pytest.approx(2 * 200 * 1448 / 50e9)   # two drains of a 200-packet queue at 50 GB/s


def test_the_phase_benchmark_reads_the_drift_from_phase_records():
    # bench/bench_emu_phase.py's offsets, on the closed form above: d_k = k delta
    from bench.bench_emu_phase import phase_offsets

    tau, w = 0.0001, 0.25
    result = simulate(star(3), _senders(25e6, iterations=4), latency=False, join_ramp_s=tau, join_weight=w)
    assert phase_offsets(result, phase="send") == pytest.approx([k * tau * (1 - w) / (1 + w) for k in range(4)], abs=1e-12)


def test_the_committed_agreement_table_is_the_current_model():
    # bench_emu.py --resim recomputes the simulator's side of emu_agreement; the committed table must be what the model gives now
    import json
    from pathlib import Path

    from bench.bench_emu import resimulate

    rows = json.loads((Path(__file__).resolve().parents[1] / "bench" / "results" / "emu_agreement.json").read_text())["rows"]
    again = resimulate(rows)
    assert [r["sim_iter_ms"] for r in again] == pytest.approx([r["sim_iter_ms"] for r in rows], rel=1e-9)
    assert [(r["goal"], r["ranking"]) for r in again] == [(r["goal"], r["ranking"]) for r in rows]
    unshifted = [r for r in rows if r["case"].startswith("CASSINI") and "(unshifted)" in r["case"]]
    assert unshifted and all(r["goal"] == "met" for r in unshifted)
