"""Kendall's tau with tolerance ties (emu.ranking): closed forms, ties, and scipy as a second implementation."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import kendalltau

from emu.ranking import kendall_tau_b, pair_counts, rank_agreement, tie_classes
from topology.errors import InputError


def test_same_and_reversed_order():
    assert rank_agreement([1, 2, 3, 4], [10, 20, 30, 40])["tau"] == 1.0
    assert rank_agreement([1, 2, 3, 4], [40, 30, 20, 10])["tau"] == -1.0


def test_one_adjacent_swap_of_n_costs_two_over_n_choose_2():
    # n items, one adjacent pair swapped: C = P - 1, D = 1, tau = (P - 2) / P with P = n(n-1)/2
    for n in range(2, 9):
        measured = list(range(1, n + 1))
        measured[0], measured[1] = measured[1], measured[0]
        p = n * (n - 1) // 2
        r = rank_agreement(list(range(1, n + 1)), measured)
        assert (r["concordant"], r["discordant"]) == (p - 1, 1)
        assert r["tau"] == pytest.approx((p - 2) / p)


def test_predicted_within_two_percent_are_tied():
    # classes [0, 0, 1]: C = 2, D = 0, one pair tied in x; tau-b = 2 / sqrt((3 - 1) * 3)
    r = rank_agreement([100.0, 101.9, 150.0], [3.0, 2.0, 9.0])
    assert r["predicted_classes"] == [0, 0, 1]
    assert (r["concordant"], r["discordant"], r["tied_predicted"]) == (2, 0, 1)
    assert r["tau"] == pytest.approx(2 / math.sqrt(6))
    # untied, the swapped pair counts against the ranking
    assert r["tau_untied"] == pytest.approx(1 / 3)
    # 2.1 % apart is not a tie
    assert rank_agreement([100.0, 102.1, 150.0], [3.0, 2.0, 9.0])["predicted_classes"] == [0, 1, 2]


def test_tie_classes_are_measured_from_the_smallest_member():
    assert tie_classes([1.0, 1.015, 1.03, 1.045]) == [0, 0, 1, 1]
    assert tie_classes([5.0, 5.0, 5.0]) == [0, 0, 0]


def test_all_tied_gives_nan():
    r = rank_agreement([1.0, 1.01], [1.0, 2.0])
    assert math.isnan(r["tau"]) and math.isnan(r["pvalue"])


def test_measured_tolerance_ties_the_measured_side():
    r = rank_agreement([1.0, 2.0, 3.0], [1.0, 1.005, 2.0], measured_tolerance=0.01)
    assert r["measured_classes"] == [0, 0, 1] and r["tied_measured"] == 1


@pytest.mark.parametrize("pred, meas, where", [([1.0], [1.0], "predicted"), ([1.0, 2.0], [1.0], "measured"),
                                               ([1.0, math.nan], [1.0, 2.0], "predicted[1]"), ([1.0, 2.0], [0.0, 2.0], "measured[0]"),
                                               ([1.0, True], [1.0, 2.0], "predicted[1]")])
def test_bad_input_names_the_field(pred, meas, where):
    with pytest.raises(InputError) as e:
        rank_agreement(pred, meas)
    assert where in str(e.value)


costs = st.lists(st.floats(min_value=0.5, max_value=2.0, allow_nan=False), min_size=2, max_size=8)


@settings(max_examples=200, deadline=None)
@given(costs, st.data())
def test_tau_b_matches_scipy(pred, data):
    meas = data.draw(st.lists(st.sampled_from([1.0, 1.5, 2.0, 3.0]), min_size=len(pred), max_size=len(pred)))
    pc = tie_classes(pred)
    mine = kendall_tau_b(pc, meas)
    theirs = kendalltau(pc, meas, variant="b").statistic
    if math.isnan(mine):
        assert math.isnan(theirs)
    else:
        assert mine == pytest.approx(theirs, abs=1e-12)


@settings(max_examples=100, deadline=None)
@given(costs)
def test_invariants(pred):
    # a ranking agrees perfectly with itself, and reversing one side flips the sign
    rank = {v: i for i, v in enumerate(sorted(set(pred)))}
    meas = [float(len(rank) - rank[p]) for p in pred]   # the exact reverse order (2.5 - p can round distinct costs into ties)
    pc = tie_classes(pred)
    c = pair_counts(pc, pred)
    assert c["discordant"] == 0
    r, rev = rank_agreement(pred, pred), rank_agreement(pred, meas)
    if not math.isnan(r["tau"]):
        assert r["tau"] > 0 and rev["tau"] == pytest.approx(-r["tau"])
    # tie classes are monotone in the values
    assert all(pc[i] <= pc[j] for i in range(len(pred)) for j in range(len(pred)) if pred[i] <= pred[j])


def test_spread_and_pairs_within_noise():
    from emu.ranking import pairs_within_noise, spread

    assert spread([2.0]) == 0.0
    assert spread([1.0, 1.5, 2.0]) == pytest.approx(1.0 / 1.5)
    # gaps relative to the faster: a/b 10 %, b/c 50 %, a/c 65 %; only a/b is inside a spread (b's 15 %)
    assert pairs_within_noise(["a", "b", "c"], [1.0, 1.1, 1.65], [0.0, 0.15, 0.2]) == [("a", "b")]
    assert pairs_within_noise(["a", "b"], [1.0, 1.1], [0.0, 0.0]) == []
