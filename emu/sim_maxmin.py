"""Max-min fair rates by progressive filling: the vectorised solver and a plain reference.

The problem: flows ``f`` cross sets of links; link ``l`` has capacity
``c[l]``; flow ``f`` has a weight ``w[f] > 0``, a rate cap ``cap[f]`` (``inf``
for none) and a traffic class ``prio[f]`` (0 is served first).

- ``sharing="strict"``: classes are served in strict priority. Class 0 gets
  the weighted max-min fair allocation of the full capacities; class 1 the one
  of what class 0 left; and so on.
- ``sharing="weighted"``: one weighted max-min allocation over all flows (the
  caller puts the class weights into ``w``).

Optional per-entry coefficients ``coef[f, l] > 0``: flow ``f`` loads link
``l`` at ``coef[f, l]`` times its rate (``sum_f coef[f, l]·rate[f] <= c[l]``).
The rate is then a flow's *progress* in units of its own choosing, e.g. the
fraction of its isolated speed for a job whose communication phase loads each
link by a different amount (:mod:`emu.fluid`). Without coefficients every
entry counts once, the classic case the packet-level simulator uses.

Progressive filling (Bertsekas & Gallager, *Data Networks*, 6.5.2): raise the
normalised level ``t`` of every unfrozen flow (rate ``w[f]·t``) until a link
saturates or a flow reaches its cap; freeze the flows crossing saturated links
and the capped flows; repeat. The result is the unique weighted max-min fair
allocation: every flow is at its cap or crosses a saturated link on which its
normalised rate is the largest of its class and no lower class gets anything.

The vectorised solver keeps the flow x link incidence as two index arrays
(COO) and does each filling round with ``np.bincount``; a round costs
O(entries) in numpy and the number of rounds is the number of distinct
bottleneck levels, usually a handful.

>>> import numpy as np
>>> indptr, links = np.array([0, 1, 3, 4]), np.array([0, 0, 1, 1])   # f0: l0; f1: l0, l1; f2: l1
>>> maxmin_rates(indptr, links, np.array([1.0, 3.0])).tolist()
[0.5, 0.5, 2.5]
>>> maxmin_rates_reference([[0], [0, 1], [1]], [1.0, 3.0])
[0.5, 0.5, 2.5]

With coefficients (job 0 loads link 0 with 10 units per unit of progress,
job 1 with 10 on link 0 and 1 on link 1, job 2 with 4 on link 1) and every
progress capped at 1:

>>> maxmin_rates(indptr, links, np.array([10.0, 4.0]), coef=np.array([10.0, 10.0, 1.0, 4.0]), cap=np.ones(3)).tolist()
[0.5, 0.5, 0.875]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_TOL = 1e-9


def maxmin_rates(
    indptr: np.ndarray,
    links: np.ndarray,
    capacity: np.ndarray,
    *,
    weight: np.ndarray | None = None,
    cap: np.ndarray | None = None,
    prio: np.ndarray | None = None,
    alive: np.ndarray | None = None,
    sharing: str = "strict",
    coef: np.ndarray | None = None,
) -> np.ndarray:
    """Rates of the flows whose links are ``links[indptr[f]:indptr[f+1]]`` (CSR), in capacity units.

    ``alive`` (default all) masks the flows that take part; the others get 0.
    A flow with no link gets its cap (``inf`` when uncapped). ``coef`` (aligned
    with ``links``, default all 1) is the load of each entry per unit of rate.
    """
    n_flows = len(indptr) - 1
    entry_flow = np.repeat(np.arange(n_flows), np.diff(indptr))
    return maxmin_rates_coo(entry_flow, links, n_flows, capacity, weight=weight, cap=cap, prio=prio, alive=alive, sharing=sharing, coef=coef)


def maxmin_rates_coo(
    entry_flow: np.ndarray,
    entry_link: np.ndarray,
    n_flows: int,
    capacity: np.ndarray,
    *,
    weight: np.ndarray | None = None,
    cap: np.ndarray | None = None,
    prio: np.ndarray | None = None,
    alive: np.ndarray | None = None,
    sharing: str = "strict",
    coef: np.ndarray | None = None,
) -> np.ndarray:
    """:func:`maxmin_rates` with the incidence as (flow, link) pairs (COO), the form the simulator keeps.

    ``coef`` (one per entry, ``>= 0``; default all 1): flow ``entry_flow[i]``
    loads link ``entry_link[i]`` at ``coef[i]`` times its rate. Entries with a
    zero coefficient are ignored (the flow does not use that link).

    >>> maxmin_rates_coo(np.array([0, 1, 1, 2]), np.array([0, 0, 1, 1]), 3, np.array([1.0, 3.0])).tolist()
    [0.5, 0.5, 2.5]
    >>> maxmin_rates_coo(np.array([0, 1]), np.array([0, 0]), 2, np.array([6.0]), coef=np.array([1.0, 2.0])).tolist()
    [2.0, 2.0]
    """
    capacity = np.asarray(capacity, dtype=float)
    weight = np.ones(n_flows) if weight is None else np.asarray(weight, dtype=float)
    cap = np.full(n_flows, np.inf) if cap is None else np.asarray(cap, dtype=float)
    alive = np.ones(n_flows, dtype=bool) if alive is None else np.asarray(alive, dtype=bool)
    entry_flow = np.asarray(entry_flow, dtype=np.intp)
    entry_link = np.asarray(entry_link, dtype=np.intp)
    if coef is not None:
        coef = np.asarray(coef, dtype=float)
        if coef.shape != entry_flow.shape:
            raise ValueError(f"coef must have one value per entry ({entry_flow.shape}), got {coef.shape}")
        if not (coef >= 0).all() or not np.isfinite(coef).all():
            raise ValueError("coef must be finite and >= 0")
        used = coef > 0
        if not used.all():
            entry_flow, entry_link, coef = entry_flow[used], entry_link[used], coef[used]
    rate = np.zeros(n_flows)
    residual = capacity.astype(float, copy=True)
    if sharing == "weighted" or prio is None:
        _fill(entry_flow, entry_link, alive.copy(), weight, cap, residual, capacity, rate, coef)
    elif sharing == "strict":
        prio = np.asarray(prio)
        classes = np.unique(prio[alive])
        if len(classes) == 1:
            _fill(entry_flow, entry_link, alive.copy(), weight, cap, residual, capacity, rate, coef)
        else:
            for c in classes:
                _fill(entry_flow, entry_link, alive & (prio == c), weight, cap, residual, capacity, rate, coef)
    else:
        raise ValueError(f"sharing must be 'strict' or 'weighted', got {sharing!r}")
    return rate


def _fill(entry_flow: np.ndarray, entry_link: np.ndarray, active: np.ndarray, weight: np.ndarray, cap: np.ndarray,
          residual: np.ndarray, capacity: np.ndarray, rate: np.ndarray, coef: np.ndarray | None = None) -> None:
    """Progressive filling of the ``active`` flows on ``residual`` capacity (both updated in place).

    ``coef`` (per entry, all > 0) scales each entry's load; ``None`` is the unit case, kept on its own code path.
    """
    n_links = len(residual)
    keep = active[entry_flow]
    ef, el = entry_flow[keep], entry_link[keep]
    ec = None if coef is None else coef[keep]
    # flows without any link are limited by their cap alone
    has_link = np.zeros(len(active), dtype=bool)
    has_link[ef] = True
    linkless = active & ~has_link
    rate[linkless] = cap[linkless]
    active = active & has_link
    # links already full (by higher classes) freeze their flows at 0
    full = residual <= _TOL * capacity
    if full.any():
        blocked = np.zeros(len(active), dtype=bool)
        blocked[ef[full[el]]] = True
        active &= ~blocked
        keep = active[ef]
        ef, el = ef[keep], el[keep]
        if ec is not None:
            ec = ec[keep]
    while ef.size:
        wsum = np.bincount(el, weights=weight[ef] if ec is None else weight[ef] * ec, minlength=n_links)
        used = wsum > 0
        level = float(np.min(residual[used] / wsum[used]))
        idx = np.flatnonzero(active)
        headroom = (cap[idx] - rate[idx]) / weight[idx]
        cap_level = float(headroom.min())
        step = max(min(level, cap_level), 0.0)
        rate[idx] += step * weight[idx]
        residual -= step * wsum
        saturated = used & (residual <= _TOL * capacity)
        residual[saturated] = 0.0
        frozen = np.zeros(len(active), dtype=bool)
        frozen[ef[saturated[el]]] = True
        at_cap = np.isfinite(headroom) & (headroom - step <= _TOL * np.abs(headroom))
        frozen[idx[at_cap]] = True
        active &= ~frozen
        keep = active[ef]
        ef, el = ef[keep], el[keep]
        if ec is not None:
            ec = ec[keep]


def maxmin_rates_reference(
    paths: Sequence[Sequence[int]],
    capacity: Sequence[float],
    *,
    weight: Sequence[float] | None = None,
    cap: Sequence[float] | None = None,
    prio: Sequence[int] | None = None,
    sharing: str = "strict",
    coef: Sequence[Sequence[float]] | None = None,
) -> list[float]:
    """The same allocation computed with plain Python loops, one flow and one link at a time.

    It is the baseline of the benchmark and the oracle of the tests; it shares
    no code with :func:`maxmin_rates`. ``coef[f][i]`` is the load flow ``f``
    puts on link ``paths[f][i]`` per unit of rate (default 1).
    """
    n = len(paths)
    if coef is not None:  # drop zero-coefficient entries: such a flow does not use that link
        paths = [[link for link, k in zip(p, c, strict=True) if k > 0] for p, c in zip(paths, coef, strict=True)]
        coef = [[k for k in c if k > 0] for c in coef]
    else:
        coef = [[1.0] * len(p) for p in paths]
    weight = list(weight) if weight is not None else [1.0] * n
    cap = list(cap) if cap is not None else [float("inf")] * n
    prio = list(prio) if prio is not None else [0] * n
    residual = [float(c) for c in capacity]
    rate = [0.0] * n
    classes = [None] if sharing == "weighted" else sorted(set(prio))
    for cls in classes:
        active = {f for f in range(n) if cls is None or prio[f] == cls}
        for f in list(active):
            if not paths[f]:
                rate[f] = cap[f]
                active.discard(f)
            elif any(residual[link] <= _TOL * capacity[link] for link in paths[f]):
                active.discard(f)
        while active:
            load: dict[int, float] = {}
            for f in active:
                for link, k in zip(paths[f], coef[f], strict=True):
                    load[link] = load.get(link, 0.0) + weight[f] * k
            step = min(residual[link] / w for link, w in load.items())
            for f in active:
                step = min(step, (cap[f] - rate[f]) / weight[f])
            step = max(step, 0.0)
            for f in active:
                rate[f] += step * weight[f]
            saturated = set()
            for link, w in load.items():
                residual[link] -= step * w
                if residual[link] <= _TOL * capacity[link]:
                    residual[link] = 0.0
                    saturated.add(link)
            for f in list(active):
                if rate[f] >= cap[f] * (1 - _TOL) or any(link in saturated for link in paths[f]):
                    active.discard(f)
    return rate


def check_maxmin(paths: Sequence[Sequence[int]], capacity: Sequence[float], rate: Sequence[float], *, weight: Sequence[float] | None = None,
                 cap: Sequence[float] | None = None, prio: Sequence[int] | None = None, sharing: str = "strict", tol: float = 1e-6,
                 coef: Sequence[Sequence[float]] | None = None) -> list[str]:
    """The violations of the max-min fairness conditions by ``rate`` (empty when it is max-min fair).

    Feasibility: no link over capacity, no flow over its cap. Bottleneck
    property: every flow below its cap crosses a saturated link on which its
    normalised rate ``rate/weight`` is the largest among the flows it competes
    with (its own class under strict priority, everyone under weighted
    sharing), and, under strict priority, no flow of a lower class gets any of
    that link. An allocation with these properties is the max-min fair one:
    no flow could go faster without slowing a flow whose normalised rate is
    smaller or equal. With ``coef`` a link's load is ``sum coef[f][i]·rate[f]``
    (the bottleneck property is unchanged: the coefficients are positive).
    """
    n = len(paths)
    if coef is not None:
        paths = [[link for link, k in zip(p, c, strict=True) if k > 0] for p, c in zip(paths, coef, strict=True)]
        coef = [[k for k in c if k > 0] for c in coef]
    else:
        coef = [[1.0] * len(p) for p in paths]
    weight = list(weight) if weight is not None else [1.0] * n
    cap = list(cap) if cap is not None else [float("inf")] * n
    prio = list(prio) if prio is not None else [0] * n
    load = [0.0] * len(capacity)
    users: dict[int, list[int]] = {}
    for f, path in enumerate(paths):
        for link, k in zip(path, coef[f], strict=True):
            load[link] += rate[f] * k
            users.setdefault(link, []).append(f)
    problems = []
    for link, c in enumerate(capacity):
        if load[link] > c * (1 + tol) + tol:
            problems.append(f"link {link} carries {load[link]:.6g} > capacity {c:.6g}")
    for f in range(n):
        if rate[f] > cap[f] * (1 + tol) + tol:
            problems.append(f"flow {f} runs at {rate[f]:.6g} > cap {cap[f]:.6g}")
        if rate[f] >= cap[f] * (1 - tol) or not paths[f]:
            continue
        ok = False
        for link in paths[f]:
            if load[link] < capacity[link] * (1 - tol):
                continue
            peers = [g for g in users[link] if sharing == "weighted" or prio[g] == prio[f]]
            lower = [g for g in users[link] if sharing == "strict" and prio[g] > prio[f]]
            top = max(rate[g] / weight[g] for g in peers)
            if rate[f] / weight[f] >= top * (1 - tol) - tol and all(rate[g] <= tol for g in lower):
                ok = True
                break
        if not ok:
            problems.append(f"flow {f} (rate {rate[f]:.6g}) has no bottleneck link")
    return problems


__all__ = ["check_maxmin", "maxmin_rates", "maxmin_rates_coo", "maxmin_rates_reference"]
