"""How well a predicted order of candidates holds in measured runs: Kendall's tau with tolerance ties.

A planner ranks candidates (placements, pipeline schedules) by a predicted
cost; running them for real gives a measured cost each. :func:`rank_agreement`
compares the two orders with Kendall's tau-b (:func:`scipy.stats.kendalltau`),
after :func:`tie_classes` has merged predicted values closer than a tolerance
(default :data:`DEFAULT_TIE_TOLERANCE`, 2 %) into one class: a planner that
predicts 100 and 101 ms has not ranked those two candidates, so the pair
counts as tied, neither concordant nor discordant, and tau-b's denominator
leaves it out on the predicted side. Measured values are compared as they are
unless ``measured_tolerance`` is given.

Tie classes: values are sorted ascending; a value joins the current class when
it is within ``tolerance`` (relative) of the class's *smallest* value, else it
opens a new class. Measured from the smallest member, a chain of values each
1.5 % above the last does not collapse into one class.

>>> tie_classes([100.0, 101.0, 103.0, 110.0])
[0, 0, 1, 2]
>>> r = rank_agreement([1.0, 2.0, 3.0, 4.0], [10.0, 30.0, 20.0, 40.0])
>>> round(r["tau"], 4), r["concordant"], r["discordant"]
(0.6667, 5, 1)
>>> r = rank_agreement([1.0, 1.01, 2.0], [5.0, 6.0, 7.0])   # the first two predicted within 2 %: tied
>>> round(r["tau"], 4), r["tied_predicted"], round(r["tau_untied"], 4)
(0.8165, 1, 1.0)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from topology.errors import InputError

#: Predicted values closer than this (relative) count as tied.
DEFAULT_TIE_TOLERANCE = 0.02


def _check(values: Sequence[float], where: str) -> list[float]:
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
            raise InputError(f"expected a positive finite cost, got {v!r}", where=f"{where}[{i}]")
        out.append(float(v))
    return out


def tie_classes(values: Sequence[float], tolerance: float = DEFAULT_TIE_TOLERANCE) -> list[int]:
    """The class of each value: equal classes are ties, higher classes larger values (see the module docstring).

    >>> tie_classes([3.0, 1.0, 1.015, 1.03, 2.0])   # 1.03 is 3 % above the class's smallest, 1.0: a class of its own
    [3, 0, 0, 1, 2]
    >>> tie_classes([1.0, 2.0], tolerance=0.0)
    [0, 1]
    """
    vals = _check(values, "values")
    if not (isinstance(tolerance, int | float) and math.isfinite(tolerance) and tolerance >= 0):
        raise InputError(f"expected a non-negative tolerance, got {tolerance!r}", where="tolerance")
    order = sorted(range(len(vals)), key=lambda i: vals[i])
    out = [0] * len(vals)
    cls, low = -1, -math.inf
    for i in order:
        if vals[i] > low * (1 + tolerance):
            cls, low = cls + 1, vals[i]
        out[i] = cls
    return out


def pair_counts(x: Sequence[float], y: Sequence[float]) -> dict[str, int]:
    """Concordant, discordant and tied pairs of two equally long sequences, by brute force over all pairs.

    >>> pair_counts([0, 0, 1], [1, 2, 3])
    {'concordant': 2, 'discordant': 0, 'tied_x': 1, 'tied_y': 0, 'tied_both': 0}
    """
    out = {"concordant": 0, "discordant": 0, "tied_x": 0, "tied_y": 0, "tied_both": 0}
    n = len(x)
    for i in range(n):
        for j in range(i + 1, n):
            dx, dy = x[i] - x[j], y[i] - y[j]
            if dx == 0 and dy == 0:
                out["tied_both"] += 1
            elif dx == 0:
                out["tied_x"] += 1
            elif dy == 0:
                out["tied_y"] += 1
            elif (dx > 0) == (dy > 0):
                out["concordant"] += 1
            else:
                out["discordant"] += 1
    return out


def kendall_tau_b(x: Sequence[float], y: Sequence[float]) -> float:
    """Kendall's tau-b, ``(C - D) / sqrt((P - Tx) (P - Ty))`` with ``P`` pairs and ``Tx``/``Ty`` pairs tied in x/y; NaN when undefined.

    ``scipy.stats.kendalltau`` computes the same (``tests/test_emu_ranking.py`` checks them against each other); this
    brute-force form is for the small lists here and the doctests.

    >>> kendall_tau_b([1, 2, 3], [3, 2, 1]), kendall_tau_b([1, 1], [1, 2])
    (-1.0, nan)
    """
    c = pair_counts(x, y)
    pairs = sum(c.values())
    tx, ty = c["tied_x"] + c["tied_both"], c["tied_y"] + c["tied_both"]
    denom = math.sqrt((pairs - tx) * (pairs - ty))
    return (c["concordant"] - c["discordant"]) / denom if denom > 0 else math.nan


def rank_agreement(predicted: Sequence[float], measured: Sequence[float], *, tolerance: float = DEFAULT_TIE_TOLERANCE,
                   measured_tolerance: float = 0.0) -> dict[str, Any]:
    """Kendall's tau-b between predicted and measured costs (lower is better on both), predicted ties within ``tolerance``.

    Returns ``tau`` (tau-b on the tie classes, NaN when every candidate is tied on one side), ``pvalue``
    (scipy's, for what it is worth with a handful of candidates), ``tau_untied`` (tau-b on the raw predicted
    values), the pair counts (``concordant``, ``discordant``, ``tied_predicted``, ``tied_measured``, ``tied_both``),
    ``predicted_classes`` and ``measured_classes``, and the orders (candidate indices, best first).
    """
    from scipy.stats import kendalltau

    pred = _check(predicted, "predicted")
    meas = _check(measured, "measured")
    if len(pred) != len(meas):
        raise InputError(f"{len(pred)} predicted but {len(meas)} measured costs", where="measured")
    if len(pred) < 2:
        raise InputError(f"a ranking needs at least 2 candidates, got {len(pred)}", where="predicted")
    pc = tie_classes(pred, tolerance)
    mc = tie_classes(meas, measured_tolerance)
    counts = pair_counts(pc, mc)
    tau = kendall_tau_b(pc, mc)
    pvalue = math.nan
    if not math.isnan(tau):
        res = kendalltau(pc, mc, variant="b")
        pvalue = float(res.pvalue)
    return {"tau": tau, "pvalue": pvalue, "tau_untied": kendall_tau_b(pred, mc), "n": len(pred),
            "concordant": counts["concordant"], "discordant": counts["discordant"], "tied_predicted": counts["tied_x"],
            "tied_measured": counts["tied_y"], "tied_both": counts["tied_both"], "tolerance": tolerance,
            "measured_tolerance": measured_tolerance, "predicted_classes": pc, "measured_classes": mc,
            "predicted_order": sorted(range(len(pred)), key=lambda i: (pred[i], i)),
            "measured_order": sorted(range(len(meas)), key=lambda i: (meas[i], i))}


def spread(values: Sequence[float]) -> float:
    """``(max - min) / median`` of repeated measurements of one candidate (0 for one).

    >>> round(spread([1.0, 1.2, 1.1]), 4)
    0.1818
    """
    vals = _check(values, "values")
    if not vals:
        raise InputError("expected at least one measurement", where="values")
    return (max(vals) - min(vals)) / statistics.median(vals)


def pairs_within_noise(names: Sequence[str], measured: Sequence[float], spreads: Sequence[float]) -> list[tuple[str, str]]:
    """Pairs whose measured gap, relative to the faster of the two, is smaller than the larger of their spreads.

    Such a pair's measured order is within the machine's noise: a repeat could swap it.

    >>> pairs_within_noise(["a", "b", "c"], [1.0, 1.05, 2.0], [0.1, 0.0, 0.0])
    [('a', 'b')]
    """
    out = []
    for i in range(len(names)):
        for j in range(i + 1, len(names)):
            gap = abs(measured[i] - measured[j]) / min(measured[i], measured[j])
            if gap < max(spreads[i], spreads[j]):
                out.append((names[i], names[j]))
    return out


__all__ = ["DEFAULT_TIE_TOLERANCE", "kendall_tau_b", "pair_counts", "pairs_within_noise", "rank_agreement", "spread", "tie_classes"]
