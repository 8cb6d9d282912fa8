"""Robust CPU validation: speed-probe rescaling of a prediction, round aggregation, and the tie-aware schedule choice."""

from __future__ import annotations

import math
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesched.calibrate import SpeedProbe, probe_scale, rescaled_plan, run_action_costs, summarize_rounds
from pipesched.devices import Device, LinkModel
from pipesched.plan import choose_robust, plan, uniform_plan
from pipesched.profile import LayerProfile, ModelProfile
from pipesched.simulate import SharedCpu

OPTIONS = ("none", "selective", "full")


def make_profile(times: list[tuple[float, float]]) -> ModelProfile:
    lays = tuple(LayerProfile(f"l{k}", f, b / 2, b / 2, 1024, 4096, {o: 2048 for o in OPTIONS}, {o: 0.0 for o in OPTIONS}, bwd_full_s=b)
                 for k, (f, b) in enumerate(times))
    return ModelProfile("t", lays, source="measured")


layer_times = st.lists(st.tuples(st.floats(1e-3, 2e-2), st.floats(1e-3, 4e-2)), min_size=8, max_size=12)


@settings(max_examples=25, deadline=None)
@given(times=layer_times, scale=st.floats(0.5, 2.0), family=st.sampled_from(["1f1b", "gpipe", "zbh1", "interleaved"]),
       cores=st.sampled_from([1.5, 2.0, 4.0]))
def test_rescaled_plan_is_the_same_plan_with_all_cpu_work_scaled(times, scale, family, cores):
    """Scale 1 reproduces the plan's simulation; with a free link every duration (and so the makespan) scales by k exactly."""
    prof = make_profile(times)
    devs = [Device(f"r{i}") for i in range(4)]
    shared = SharedCpu(cores, 3e-4, 2e-4)
    for link in (LinkModel.uniform(4, math.inf, 5e-4), LinkModel.uniform(4, math.inf, 0.0)):
        p = plan(prof, devs, link, microbatches=8, schedule=family, cores=shared, refine_budget=5)
        same = rescaled_plan(p, prof, 1.0)
        assert same.sim.makespan == p.sim.makespan
        assert [list(s.layers) for s in same.partition.stages] == [list(s.layers) for s in p.partition.stages]
        scaled = rescaled_plan(p, prof, scale)
        assert scaled.family == p.family and scaled.schedule.actions == p.schedule.actions
        assert scaled.shared_cpu == SharedCpu(cores, 3e-4 * scale, 2e-4 * scale)
        if link.link(0, 1)[1] == 0.0:   # (the link's wait is not CPU work: with a latency the makespan scales less than k)
            assert scaled.sim.makespan == pytest.approx(scale * p.sim.makespan, rel=1e-9)


@settings(max_examples=20, deadline=None)
@given(times=layer_times, family=st.sampled_from(["1f1b", "gpipe", "zbh1"]), factor=st.floats(0.5, 2.0))
def test_run_action_costs_replays_the_measured_action_cpu(times, family, factor):
    """A run whose actions cost exactly the modelled work replays to the plan's own simulation; a run whose actions
    all cost ``factor`` times the profile (plus the runtime's per-action cost) gives ``factor`` times every duration."""
    from pipesched.runner import RunResult

    prof = make_profile(times)
    devs = [Device(f"r{i}") for i in range(4)]
    shared = SharedCpu(2.0, 0.0, 2e-4)
    p = plan(prof, devs, LinkModel.uniform(4, math.inf, 0.0), microbatches=8, schedule=family, cores=shared, refine_budget=5)
    kinds = {a.kind for acts in p.schedule.actions.values() for a in acts}

    def run_with(k: float) -> RunResult:
        cpu = {f"{s} {kind}": k * c.duration(kind) + shared.action_cpu_s for s, c in p.costs.items() for kind in kinds}
        return RunResult([1.0], [], {}, [], [], 0.0, 0.0, action_cpu_medians=cpu)

    same = run_action_costs(p, run_with(1.0))
    assert all(same[s].duration(k) == pytest.approx(p.costs[s].duration(k), rel=1e-9) for s in p.costs for k in kinds)
    from pipesched.simulate import simulate

    replay = simulate(p.schedule, same, p.links, cores=p.shared_cpu).makespan
    assert replay == pytest.approx(p.sim.makespan, rel=1e-9)
    scaled = run_action_costs(p, run_with(factor))
    assert all(scaled[s].duration(k) == pytest.approx(factor * p.costs[s].duration(k), rel=1e-9) for s in p.costs for k in kinds)
    assert all(scaled[s].out_bytes == p.costs[s].out_bytes and scaled[s].saved_bytes == p.costs[s].saved_bytes for s in p.costs)


def test_rescaled_plan_needs_a_shared_cpu_and_a_positive_scale():
    prof = make_profile([(0.01, 0.02)] * 8)
    devs = [Device(f"r{i}") for i in range(4)]
    link = LinkModel.uniform(4, math.inf, 0.0)
    with pytest.raises(ValueError, match="SharedCpu"):
        rescaled_plan(uniform_plan(prof, devs, link, microbatches=4, cores=2.0), prof, 1.1)
    with pytest.raises(ValueError, match="positive"):
        rescaled_plan(uniform_plan(prof, devs, link, microbatches=4, cores=SharedCpu(2.0)), prof, 0.0)


def test_probe_scale_is_the_ratio_of_the_readings():
    a, b = SpeedProbe(0.080, 0.081, 0.0), SpeedProbe(0.100, 0.11, 1.0)
    assert probe_scale(a, b) == pytest.approx(1.25) and probe_scale(b, a) == pytest.approx(0.8)
    assert probe_scale(0.08, b) == probe_scale(a, 0.1)
    with pytest.raises(ValueError):
        probe_scale(0.0, b)


def test_speed_probe_reads_cpu_time_of_the_chain():
    pytest.importorskip("torch")
    from pipesched.calibrate import speed_probe

    p = speed_probe([16, 32, 64], 8, 4, repeats=5, warmup=1)
    assert len(p.samples_cpu_s) == 5 and p.cpu_s == statistics.median(p.samples_cpu_s)
    assert p.cpu_s > 0 and p.wall_s > 0
    assert set(p.to_dict()) == {"cpu_s", "wall_s", "at", "samples_cpu_s"}


run_rec = st.fixed_dictionaries({"error": st.floats(-0.5, 0.5), "measured_s": st.floats(0.1, 2.0)})


@settings(max_examples=50, deadline=None)
@given(rounds=st.lists(st.fixed_dictionaries({"ours": run_rec, "uniform_torch_1f1b": run_rec}), min_size=1, max_size=6),
       tol=st.sampled_from([0.05, 0.10]))
def test_summarize_rounds_counts_and_pairs(rounds, tol):
    s = summarize_rounds(rounds, tolerance=tol)
    all_errors = [r[a]["error"] for r in rounds for a in ("ours", "uniform_torch_1f1b")]
    assert s["runs"] == 2 * len(rounds) == len(all_errors)
    assert s["within"] == sum(abs(e) <= tol for e in all_errors) == s["ours"]["within"] + s["uniform_torch_1f1b"]["within"]
    assert s["ours"]["errors"] == [r["ours"]["error"] for r in rounds]
    assert s["ours"]["median_error"] == statistics.median(r["ours"]["error"] for r in rounds)
    pairs = [r["uniform_torch_1f1b"]["measured_s"] / r["ours"]["measured_s"] for r in rounds]
    assert s["speedups"] == pairs and s["speedup_median"] == statistics.median(pairs)
    assert s["rounds_won"] == sum(x > 1 for x in pairs)
    only_ours = summarize_rounds([{"ours": r["ours"]} for r in rounds], arms=("ours",))
    assert "speedups" not in only_ours and only_ours["runs"] == len(rounds)


class _Cand:
    def __init__(self, makespan: float, in_flight: int, name: str):
        self.sim = type("S", (), {"makespan": makespan})()
        self.in_flight, self.name = in_flight, name


@settings(max_examples=100, deadline=None)
@given(cands=st.lists(st.tuples(st.floats(1.0, 2.0), st.integers(1, 40)), min_size=1, max_size=6), margin=st.sampled_from([0.0, 0.02, 0.05, 0.2]))
def test_choose_robust_picks_fewest_in_flight_among_the_tied(cands, margin):
    plans = [_Cand(t, f, str(k)) for k, (t, f) in enumerate(cands)]
    best = choose_robust(plans, margin)
    fastest = min(t for t, _ in cands)
    assert best.sim.makespan <= fastest * (1 + margin)
    tied = [p for p in plans if p.sim.makespan <= fastest * (1 + margin)]
    assert best.in_flight == min(p.in_flight for p in tied)
    assert best.sim.makespan == min(p.sim.makespan for p in tied if p.in_flight == best.in_flight)
    if margin == 0.0:
        assert best.sim.makespan == fastest


def test_choose_robust_rejects_nothing_and_negative_margins():
    from pipesched.partition import PlanError

    with pytest.raises(PlanError):
        choose_robust([])
    with pytest.raises(ValueError):
        choose_robust([_Cand(1.0, 1, "a")], -0.1)


def test_plan_tie_margin_prefers_1f1b_over_an_equally_fast_gpipe():
    """Balanced stages: GPipe and 1F1B have the same makespan; 1F1B holds fewer micro-batches and wins the tie."""
    prof = make_profile([(0.01, 0.02)] * 8)
    devs = [Device(f"r{i}") for i in range(4)]
    link = LinkModel.uniform(4, math.inf, 0.0)
    g = plan(prof, devs, link, microbatches=8, schedule="gpipe")
    o = plan(prof, devs, link, microbatches=8, schedule="1f1b")
    assert g.sim.makespan == pytest.approx(o.sim.makespan) and o.in_flight < g.in_flight
    assert o.in_flight == 4 + 3 + 2 + 1 and g.in_flight == 4 * 8
    for margin in (0.0, 0.05, 0.5):
        best = plan(prof, devs, link, microbatches=8, schedule="auto", tie_margin=margin)
        cands = [a for a in best.alternatives if "makespan_s" in a and a["memory_ok"]]
        fastest = min(a["makespan_s"] for a in cands)
        tied = [a for a in cands if a["makespan_s"] <= fastest * (1 + margin)]
        assert best.family == min(tied, key=lambda a: (a["in_flight"], a["makespan_s"]))["schedule"]
        assert best.family != "gpipe"


def test_profile_passes_pool_samples_over_the_whole_chain():
    """Spread over passes: same sizes as one burst, statistics over every pass's samples, repetitions rounded up per pass."""
    torch = pytest.importorskip("torch")
    from pipesched.profile import _from_samples, measure_profile

    layers = [torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)) for _ in range(3)]
    loss = lambda out: out.square().mean()   # noqa: E731
    one = measure_profile(layers, torch.randn(4, 8), repeats=4, clock="cpu", loss_fn=loss)
    spread = measure_profile(layers, torch.randn(4, 8), repeats=4, clock="cpu", loss_fn=loss, passes=3)
    assert spread.reference["passes"] == 3 and spread.reference["repeats"] == 6 and one.reference["passes"] == 1
    for a, b in zip(one.layers, spread.layers, strict=True):
        def sizes(x):
            return x.output_bytes, x.param_bytes, x.saved_bytes, x.weight_grad_bytes

        assert sizes(a) == sizes(b)
        assert b.fwd_s > 0 and b.bwd_s > 0 and b.recompute_s["full"] == b.fwd_s
        assert (b.recompute_s["selective"] > 0) == (a.recompute_s["selective"] > 0)
    with pytest.raises(ValueError):
        measure_profile(layers, torch.randn(4, 8), passes=0)
    # pooling: the statistic of all passes' samples, not of one pass
    lay = spread.layers[0]
    samples = {"f": [1.0, 5.0, 3.0], "i": [2.0, 2.0, 8.0], "w": [1.0, 4.0, 1.0], "full": [3.0, 9.0, 6.0], "sel": [0.5, 0.1, 0.3], "cheap": [1.0]}
    pooled = _from_samples(lay, samples, statistics.median)
    assert (pooled.fwd_s, pooled.bwd_input_s, pooled.bwd_weight_s, pooled.bwd_s) == (3.0, 2.0, 1.0, 6.0)
    assert pooled.recompute_s == {"none": 0.0, "selective": 0.3, "full": 3.0}
    assert _from_samples(lay, {**samples, "cheap": [0.0]}, min).recompute_s["selective"] == 0.0


@settings(max_examples=30, deadline=None)
@given(factors=st.lists(st.floats(0.5, 2.0), min_size=1, max_size=5), times=layer_times)
def test_median_profile_is_the_elementwise_median(factors, times):
    from pipesched.profile import median_profile

    base = make_profile(times)
    profiles = [base.scaled(f) for f in factors]
    med = median_profile(profiles)
    assert len(med.layers) == len(base.layers)
    for k, lay in enumerate(med.layers):
        group = [p.layers[k] for p in profiles]
        assert lay.fwd_s == statistics.median(g.fwd_s for g in group)
        assert lay.bwd_s == statistics.median(g.bwd_s for g in group)
        assert lay.bwd_input_s == statistics.median(g.bwd_input_s for g in group)
        assert (lay.saved_bytes, lay.output_bytes, lay.param_bytes) == (base.layers[k].saved_bytes, base.layers[k].output_bytes,
                                                                        base.layers[k].param_bytes)
    assert median_profile(list(reversed(profiles))).layers == med.layers     # order does not matter
    assert med.layers[0].fwd_s == pytest.approx(base.layers[0].fwd_s * statistics.median(factors))


def test_median_profile_rejects_nothing_and_mismatched_models():
    from pipesched.profile import ProfileError, median_profile

    with pytest.raises(ProfileError):
        median_profile([])
    with pytest.raises(ProfileError, match="layer counts"):
        median_profile([make_profile([(0.01, 0.02)] * 8), make_profile([(0.01, 0.02)] * 9)])


def test_pipe_run_rejects_zero_rounds_before_starting_anything(capsys):
    from netweave.cli import main

    code = main(["pipe", "run", "--rounds", "0"])
    err = capsys.readouterr().err
    assert code == 2 and "--rounds" in err and "Traceback" not in err


@pytest.mark.slow
def test_pipe_run_end_to_end_predicts_each_run_from_the_ranks_replay_of_their_actions(capsys, tmp_path):
    """The whole CPU validation on a tiny model (2 gloo processes): calibrations, profile, plan, our run and the
    uniform baseline; every run carries the prediction from each source, the replay's being the prediction."""
    import json

    from netweave.cli import main

    out = tmp_path / "report.json"
    code = main(["pipe", "run", "--mlp", "16,16,64,64", "--dim", "16", "--batch", "16", "--microbatches", "4", "--stages", "2",
                 "--iterations", "2", "--schedule", "1f1b", "--out", str(out), "--json"])
    assert code == 0
    rep = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text())["plan"] == rep["plan"]
    assert rep["runtime_calibration"]["idle_message_cpu_s"] is not None       # message cost taken among computing ranks
    for arm in ("ours", "uniform_torch_1f1b"):
        o = rep[arm]
        assert o["predicted_from"] == "replay" and o["predicted_s"] == o["predicted_replay_s"]
        assert o["error"] == pytest.approx(o["predicted_s"] / o["measured_s"] - 1)
        assert len(o["interleaved_totals_s"]) == 2 and all(t > 0 for t in o["interleaved_totals_s"])
        for key in ("error_interleaved", "error_pre_run", "error_pooled", "error_probe_scaled", "run_costs_error", "posthoc_error"):
            assert math.isfinite(o[key])
        # Per rank: the wall time each step waited on messages, next to the time the simulator leaves the rank idle.
        assert len(o["rank_wait_measured_s"]) == len(o["rank_idle_predicted_s"]) == 2
        assert all(0.0 <= w <= max(o["measured_iterations_s"]) for w in o["rank_wait_measured_s"])
        assert all(0.0 <= w <= o["predicted_s"] for w in o["rank_idle_predicted_s"])


def test_cpu_validation_needs_a_round():
    from pipesched.calibrate import cpu_validation

    with pytest.raises(ValueError, match="round"):
        cpu_validation([8, 8], dim=4, batch=8, microbatches=2, stages=2, rounds=0)


@pytest.mark.parametrize("kwargs, match", [({"predict_from": "run"}, "predict_from"),
                                           ({"predict_from": "pre-run", "pre_run_repeats": 0}, "pre_run_repeats"),
                                           ({"predict_from": "interleaved", "interleave_repeats": 0}, "interleave_repeats"),
                                           ({"predict_from": "probe-scaled", "probe": False}, "probe"),
                                           ({"predict_from": "replay", "replay": False}, "replay=True")])
def test_cpu_validation_rejects_an_unknown_prediction_source_before_measuring(kwargs, match):
    from pipesched.calibrate import cpu_validation

    with pytest.raises(ValueError, match=match):
        cpu_validation([8, 8], dim=4, batch=8, microbatches=2, stages=2, **kwargs)


def test_pipe_run_names_every_prediction_source():
    from pipesched.calibrate import PREDICTION_SOURCES
    from pipesched.cli import SOURCE_LABELS

    assert tuple(SOURCE_LABELS) == PREDICTION_SOURCES
