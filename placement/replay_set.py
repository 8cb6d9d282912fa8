"""Many replays at once: every (trace, policy) pair as one task of an :mod:`emu.sweep` executor (local pool or Ray).

Each task calls :func:`placement.replay.replay` unchanged on plain inputs (the
topology, one trace, one policy, the replay options) and builds its own
:class:`~placement.contention.FluidSlowdown` (``fluid_radius``), so a task's
answer does not depend on which process or machine ran it, nor on the tasks
run before it: the local executor and Ray give the same per-job rows and the
same metrics (only ``metrics["wall_s"]``, the task's own wall time, differs).

>>> from topology import default_cluster
>>> from placement.traces import synthetic_trace
>>> from emu.sweep import LocalExecutor
>>> trace = synthetic_trace(4, seed=1)
>>> results = replay_many(default_cluster(), {"t": trace}, ["fifo", "hived"], executor=LocalExecutor(1))
>>> sorted(results), results["t", "fifo"].metrics["jobs"]
([('t', 'fifo'), ('t', 'hived')], 4)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from topology.errors import InputError
from topology.model import Topology

from .replay import POLICIES, ReplayResult, replay
from .traces import TraceJob


def replay_task(spec: dict[str, Any]) -> ReplayResult:
    """One replay from a plain spec: ``topology`` (a :class:`Topology`), ``trace``, ``policy``, ``fluid_radius``, ``fluid_max_ball``, ``options``."""
    from .contention import FluidSlowdown

    topo = spec["topology"]
    slowdown = FluidSlowdown(topo, radius=spec.get("fluid_radius"), max_ball=spec.get("fluid_max_ball"))
    return replay(topo, spec["trace"], spec["policy"], slowdown=slowdown, **spec.get("options", {}))


def replay_many(topo: Topology, traces: Mapping[str, Sequence[TraceJob]], policies: Sequence[str], *, executor: Any = None,
                fluid_radius: int | None = None, fluid_max_ball: int | None = None, progress: Any = None,
                **options: Any) -> dict[tuple[str, str], ReplayResult]:
    """Replay every trace under every policy; ``{(trace name, policy): ReplayResult}`` in trace-then-policy order.

    ``executor`` is an :mod:`emu.sweep` executor (default: one local process);
    ``fluid_radius`` and ``fluid_max_ball`` are :class:`~placement.contention.FluidSlowdown`'s ``radius`` and
    ``max_ball``; ``options`` go to :class:`~placement.replay.Replay` (``routing``, ``candidates``, ...);
    ``progress(done, total)`` hears of each finished replay.
    """
    from emu.sweep import LocalExecutor

    for p in policies:
        if p not in POLICIES:
            raise InputError(f"unknown policy {p!r}; expected one of {', '.join(POLICIES)}", where="policy")
    if not traces or not policies:
        raise InputError("nothing to replay: give at least one trace and one policy")
    keys = [(name, p) for name in traces for p in policies]
    specs = [{"topology": topo, "trace": list(traces[name]), "policy": p, "fluid_radius": fluid_radius, "fluid_max_ball": fluid_max_ball,
              "options": dict(options)} for name, p in keys]
    results = (executor or LocalExecutor(1)).map(replay_task, specs, progress)
    return dict(zip(keys, results, strict=True))


__all__ = ["replay_many", "replay_task"]
