"""The job's phase: its CASSINI start offset and the iteration slots that keep it.

CASSINI (NSDI 2024) interleaves the communication phases of jobs that share a link by shifting
each job's start by a few tens of milliseconds: with equal (or harmonic) iteration periods, job B's
all-reduce then falls into job A's compute gap, iteration after iteration. The shift only holds as
long as every job keeps its phase, so the runtime does not just sleep once:

- all ranks share a reference time ``t0``: rank 0's clock when every rank is ready to train, rounded up
  to a multiple of the period since the Unix epoch (:func:`grid_start`) and broadcast. The rounding puts
  every job with the same (or a harmonic) period on one grid whenever each started, so that the offsets
  are relative between jobs, as CASSINI means them (given hosts whose clocks are synchronised);
- the grid of slots is ``t0 + start_offset_s + n * period_s`` for n = 0, 1, 2, ...; iteration 0
  starts in slot 0 (never earlier), and each later iteration takes the next slot;
- an iteration that comes to its slot early waits for it (a fast job does not creep forward);
- one that comes late by at most ``tolerance * period_s`` starts at once (small jitter is absorbed,
  the phase error stays within the tolerance);
- one that comes later than that is **re-anchored**: it waits for the next slot of the same grid,
  so the phase against the other jobs is restored, at the cost of the rest of a period. A job that
  is re-anchored often runs slower than its plan's period: its plan (or its period) should be
  redone; :attr:`PhaseClock.reanchors` counts the events.

Without a period (``period_s`` is None) only the start offset is waited out.

This module is stdlib only; the clock and the sleep are injectable for tests.

>>> now = [100.0]
>>> clock = PhaseClock(t0=100.0, offset_s=0.5, period_s=1.0, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
>>> clock.wait(), clock.wait()          # slot 0 at t0 + 0.5, slot 1 one period later
(100.5, 101.5)
>>> now[0] = 102.55                     # 0.05 late for slot 2: within the tolerance, starts at once
>>> clock.wait()
102.55
>>> now[0] = 103.9                      # 0.4 late for slot 3: waits for slot 4 (re-anchored)
>>> clock.wait(), clock.reanchors
(104.5, 1)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field


def grid_start(now: float, period_s: float | None) -> float:
    """The first multiple of ``period_s`` (since the clock's epoch) at or after ``now``; ``now`` without a period.

    >>> grid_start(100.25, 0.5), grid_start(100.5, 0.5), grid_start(100.25, None)
    (100.5, 100.5, 100.25)
    """
    if not period_s:
        return now
    return math.ceil(now / period_s - 1e-9) * period_s


@dataclass
class PhaseClock:
    """Waits for each iteration's slot (see the module docstring for the rule)."""

    t0: float
    offset_s: float = 0.0
    period_s: float | None = None
    tolerance: float = 0.1
    clock: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep
    starts: list[float] = field(default_factory=list)     # each iteration's measured start (clock time)
    slots: list[int] = field(default_factory=list)        # the slot each iteration took
    reanchors: int = 0

    def __post_init__(self) -> None:
        if self.period_s is not None and self.period_s <= 0:
            raise ValueError(f"period_s must be positive, got {self.period_s}")
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"tolerance must be in [0, 1), got {self.tolerance}")

    @property
    def anchor(self) -> float:
        """Slot 0: when the first iteration may start."""
        return self.t0 + self.offset_s

    def slot_time(self, n: int) -> float:
        return self.anchor + n * (self.period_s or 0.0)

    def wait(self) -> float:
        """Wait for the next iteration's slot; return the iteration's start (clock time)."""
        now = self.clock()
        if not self.slots:
            n = 0
        elif self.period_s is None:
            n = self.slots[-1] + 1
            self.slots.append(n)
            self.starts.append(now)
            return now
        else:
            n = self.slots[-1] + 1
            late = now - self.slot_time(n)
            if late > self.tolerance * self.period_s:
                n = math.ceil((now - self.anchor) / self.period_s)
                self.reanchors += 1
        target = self.slot_time(n)
        if target > now:
            self.sleep(target - now)
            now = self.clock()
        self.slots.append(n)
        self.starts.append(now)
        return now

    def summary(self) -> dict[str, object]:
        """What a test (or a result file) checks: t0, the plan's offset and period, starts relative to t0."""
        return {"t0": self.t0, "start_offset_s": self.offset_s, "period_s": self.period_s, "tolerance": self.tolerance,
                "first_start_s": (self.starts[0] - self.t0) if self.starts else None,
                "starts_s": [s - self.t0 for s in self.starts], "slots": list(self.slots), "reanchors": self.reanchors}
