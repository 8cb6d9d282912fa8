"""The reference replay loop: :class:`placement.replay.Replay` with every incremental structure replaced by the plain computation.

At every event it scans all running jobs for the next finish and for the jobs done (no finish heap), asks the slowdown
model about the whole running set (no ``update``), sums the demands on the links it re-evaluates afresh, finds
CASSINI's link-sharing jobs by scanning all running ones and sorts all LAS candidates by (queue, arrival, name) (no kept
order, no crossing heap). The placement steps (first-fit, FIFO's head-of-line loop, HiveD's cells, CASSINI's ranking)
and the arithmetic of progress are the fast loop's own, so the two must give the same floats:
``tests/test_scale.py`` asserts it on random traces.

Progress is summed per stretch of constant rate, and attained service per run, in both loops: adding up every event's
share instead (the loop before the scale work) rounds differently, and a replay amplifies those last bits (start times
are the phases the fluid model's answers depend on), so long replays of the two kinds part; see ``docs/placement.md``.
"""

from __future__ import annotations

import bisect
import math

from placement.contention import PlacedJob
from placement.replay import Replay


class ReferenceReplay(Replay):
    """The slow, simple loop (see the module docstring); same constructor and result as :class:`Replay`."""

    def _next_finish(self) -> float:
        return min((max(max(r.ready, r.anchor) + r.remaining * r.iter_time, self.now) for r in self.running.values()), default=math.inf)

    def _finishing(self) -> list[str]:
        return [n for n, r in self.running.items() if self.remaining(r) <= 1e-9 * max(1.0, r.spec.iterations)]

    def _recompute(self) -> None:
        times = self.slowdown([PlacedJob(r.profile, r.ready) for r in self.running.values()])
        for name, r in self.running.items():
            self._set_iter_time(r, max(times.get(name, r.profile.period_s), 1e-12))
        self._changed = {}
        self._overload_rate = self._overload(dict.fromkeys([*self._ov_jobs, *self.running]))

    _ov_every_shared = True  # every re-evaluated link with two users or more comes to _over_capacity, which sums afresh

    def _over_capacity(self, link, rates) -> bool:
        return sum(rates) > self._ov_limit[link]

    def _sharing(self, links):
        return {n: (r.profile, r.ready) for n, r in self.running.items() if links.intersection(r.profile.link_rates)}

    def _schedule_las(self) -> bool:
        cands = [*self.running.values(), *(self.jobs[n] for n in self.queue)]
        cands.sort(key=lambda r: (bisect.bisect_right(self._las_sorted, self.attained(r)), r.trace.arrival_s, r.trace.name))
        budget, keep = len(self.gpus), set()
        for r in cands:
            if r.spec.gpus <= budget:
                keep.add(r.trace.name)
                budget -= r.spec.gpus
        changed = False
        for name in [n for n in self.running if n not in keep]:
            self._stop(self.running[name])
            self.queue.append(name)
            self.stats["preemptions"] += 1
            changed = True
        for r in cands:
            if r.trace.name in keep and not r.running:
                self.queue.remove(r.trace.name)
                self._start(r, self._first_fit(r.spec.gpus))
                changed = True
        return changed

    def _las_add(self, r) -> None:  # the kept order is not used here
        pass

    def _las_remove(self, r) -> None:
        pass
