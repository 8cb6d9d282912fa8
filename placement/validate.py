"""CASSINI's time shift checked with real traffic: two jobs on one bottleneck, in the simulator and in Mininet.

The scenario (:func:`two_job_scenario`): three servers on one leaf switch;
``node0`` has two GPUs, ``node1`` and ``node2`` one each, every server one NIC
(100 Gb/s by default). Job ``a`` runs on ``node0/gpu0`` + ``node1/gpu0``, job
``b`` on ``node0/gpu1`` + ``node2/gpu0``; each iteration computes for
``compute_s`` and then ring-all-reduces ``grad_bytes`` between its two GPUs.
Both rings cross ``node0``'s NIC cable (both directions) and nothing else is
shared, so that cable is the one bottleneck; the Mininet backend emulates it
faithfully (its per-leaf mode has one interface per server on the one leaf,
and no spine is involved). Both jobs have the same iteration time, so
CASSINI's unified circle is one iteration.

CASSINI's shift comes from :mod:`placement.cassini` on the jobs'
:func:`~placement.profiles.comm_profile` (the same path the planner takes);
the shift is applied as the second job's ``start_offset`` in the workload
format, and the same workload runs in :func:`emu.sim.simulate` and in
:func:`emu.mininet_backend.run_mininet`. The iteration-time *gain* of a shift
is the jobs' mean iteration time without it over the mean with it (warm-up
iterations skipped, and only iterations while both jobs run,
:func:`measured_iteration_times`); :func:`agreement` asks that the emulated gain have the
simulated gain's direction and be within ``tolerance`` (15 %) of its size.

Closed form (:func:`fluid_iteration_time`): two identical jobs with compute
``C`` and alone communication time ``M`` (``C >= M``) sharing one link
fairly, the second started ``d`` later, keep their offset from iteration to
iteration, and each iteration takes ``C + M + max(0, M - circ(d))`` where
``circ(d)`` is the circular distance of ``d`` from 0 on a circle of ``C + M``:
``C + 2M`` unshifted, ``C + M`` once the communication phases no longer meet.

Time scaling: rates are divided by ``time_scale`` (K) and bytes by
``byte_scale`` (M), so emulated time is workload time x K/M. The defaults
(100 Gb/s NICs, K = 1000, M = 100, 50 ms compute, 625 MB of gradients) give
100 Mbit/s emulated links and a 1 s emulated iteration.

>>> s = two_job_scenario()
>>> s.shared_links(), round(s.emulated_link_mbit()), round(s.emulated_iteration_s(), 2)
(['leaf0->node0/nic0', 'node0/nic0->leaf0'], 100, 1.0)
>>> shift = s.cassini().shifts
>>> round(shift["b"] / s.period_s(), 2), shift["a"]
(0.5, 0.0)
>>> round(fluid_iteration_time(0.05, 0.05, 0.0), 3), round(fluid_iteration_time(0.05, 0.05, 0.05), 3)
(0.15, 0.1)
"""

from __future__ import annotations

import math
import statistics
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from emu.results import RunResult
from emu.workload import Job, Workload
from topology.clitools import render_table
from topology.errors import InputError
from topology.model import LinkKind, NodeKind, Topology

from .cassini import ShiftResult, predicted_iteration_times, shared_links, time_shifts
from .profiles import CommProfile, JobSpec, comm_profile

#: Name prefix of the emulated networks made here (hosts ``cvh0``.., switches ``cvs0``..), when the backend takes one.
EMU_PREFIX = "cv"
#: Highest emulated link rate this validation allows (Mbit/s): leaves CPU for the 2-core machine's other work.
MAX_EMULATED_MBIT = 200.0
BACKENDS = ("sim", "mininet")
DEFAULT_TOLERANCE = 0.15
#: Gains within this of 1 have no direction (a shift that changes nothing).
DIRECTION_DEADBAND = 0.01


# -- the scenario -------------------------------------------------------------------------------------------


def shared_bottleneck_topology(nic_gbps: float = 100.0) -> Topology:
    """Three servers on one leaf: ``node0`` with two GPUs, ``node1`` and ``node2`` with one; one ``nic_gbps`` NIC each.

    GPU-NIC links are PCIe at 64 GB/s, far above the NIC, so the network
    cables are the only possible bottlenecks.

    >>> t = shared_bottleneck_topology()
    >>> t.hosts(), len(t.gpus()), sorted({d["bw"] for _, _, _, d in t.links("network")})
    (['node0', 'node1', 'node2'], 4, [12.5])
    """
    if not (isinstance(nic_gbps, int | float) and math.isfinite(nic_gbps) and nic_gbps > 0):
        raise InputError(f"expected a positive NIC speed in Gb/s, got {nic_gbps!r}", where="nic_gbps")
    topo = Topology(f"shared-bottleneck-{nic_gbps:g}g")
    leaf = topo.add_node("leaf0", NodeKind.SWITCH, tier="leaf", index=0)
    for h, gpus in (("node0", 2), ("node1", 1), ("node2", 1)):
        nic = topo.add_node(f"{h}/nic0", NodeKind.NIC, host=h, index=0, rail=0, speed_gbps=float(nic_gbps))
        for g in range(gpus):
            gpu = topo.add_node(f"{h}/gpu{g}", NodeKind.GPU, host=h, index=g, model="emulated")
            topo.add_link(gpu, nic, LinkKind.PCIE, 64.0, latency_us=1.0)
        topo.add_link(nic, leaf, LinkKind.NETWORK, nic_gbps / 8, latency_us=1.0)
    return topo


@dataclass(frozen=True)
class ShiftScenario:
    """Jobs placed on a topology, run ``iterations`` times each, and how to emulate them.

    ``specs`` and ``placements`` (job -> GPUs in rank order) feed CASSINI;
    :meth:`workload` turns them, with per-job shifts, into the workload both
    backends run. ``warmup`` iterations are left out of the means.
    """

    name: str
    topo: Topology
    specs: tuple[JobSpec, ...]
    placements: Mapping[str, tuple[str, ...]]
    iterations: int = 6
    warmup: int = 1
    time_scale: float = 1000.0
    byte_scale: float = 100.0

    def profiles(self) -> dict[str, CommProfile]:
        """Each job's CASSINI profile: compute, then its all-reduce's demand on every network link it crosses."""
        return {s.name: comm_profile(self.topo, s, self.placements[s.name]) for s in self.specs}

    def period_s(self) -> float:
        """The longest alone iteration time (compute + alpha-beta all-reduce), in workload seconds."""
        return max(p.period_s for p in self.profiles().values())

    def shared_links(self) -> list[str]:
        """The links that more than one job crosses (``"u->v"``): the bottleneck."""
        return sorted(f"{u}->{v}" for u, v, _ in shared_links(self.profiles()))

    def cassini(self) -> ShiftResult:
        """CASSINI's time shifts for the jobs (per-link rotation search, then the affinity-graph BFS)."""
        return time_shifts(self.profiles(), self.topo)

    def predicted(self, shifts: Mapping[str, float]) -> dict[str, float]:
        """CASSINI's own first-order estimate of each job's iteration time under ``shifts``."""
        return predicted_iteration_times(self.profiles(), shifts, self.topo)

    def workload(self, shifts: Mapping[str, float] | None = None) -> Workload:
        """The jobs as data-parallel workload jobs, job ``j`` released ``shifts[j]`` seconds late (its time shift)."""
        shifts = dict(shifts or {})
        unknown = sorted(set(shifts) - {s.name for s in self.specs})
        if unknown:
            raise InputError(f"no job named {unknown[0]!r}; jobs: {', '.join(s.name for s in self.specs)}", where="shifts")
        jobs = []
        for s in self.specs:
            shift = float(shifts.get(s.name, 0.0))
            if not (math.isfinite(shift) and shift >= 0):
                raise InputError(f"expected a non-negative time shift, got {shift!r}", where=f"shifts.{s.name}")
            jobs.append(Job.data_parallel(s.name, list(self.placements[s.name]), compute_s=s.compute_s, nbytes=s.grad_bytes,
                                          iterations=self.iterations, algorithm=s.algorithm, start_offset=shift))
        label = ",".join(f"{j}+{v * 1e3:g}ms" for j, v in sorted(shifts.items()) if v) or "unshifted"
        return Workload(f"{self.name}[{label}]", tuple(jobs), {"scenario": self.name})

    def emulated_link_mbit(self) -> float:
        """The fastest emulated network link (Mbit/s of payload) at this time scale."""
        return max(d["bw"] for _, _, _, d in self.topo.links(LinkKind.NETWORK)) * 8e3 / self.time_scale

    def emulated_iteration_s(self) -> float:
        """One alone iteration in emulated (wall-clock) seconds: workload seconds x K / M."""
        return self.period_s() * self.time_scale / self.byte_scale

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "topology": self.topo.name, "jobs": [s.to_dict() for s in self.specs],
                "placements": {k: list(v) for k, v in self.placements.items()}, "iterations": self.iterations, "warmup": self.warmup,
                "time_scale": self.time_scale, "byte_scale": self.byte_scale, "emulated_link_mbit": self.emulated_link_mbit(),
                "emulated_iteration_s": self.emulated_iteration_s(), "period_s": self.period_s(), "shared_links": self.shared_links()}


def two_job_scenario(*, nic_gbps: float = 100.0, compute_s: float = 0.05, grad_bytes: float = 625e6, iterations: int = 6, warmup: int = 1,
                     time_scale: float = 1000.0, byte_scale: float = 100.0) -> ShiftScenario:
    """Two data-parallel jobs whose all-reduces share ``node0``'s NIC cable (see the module docstring).

    Raises :class:`~topology.errors.InputError` naming the parameter when a
    value is out of range, including an emulated link rate above
    :data:`MAX_EMULATED_MBIT` (the message gives the time scale that fits).

    >>> s = two_job_scenario(compute_s=0.06, grad_bytes=500e6)
    >>> [(p.job, round(p.compute_s, 3), round(p.comm_s, 3)) for p in s.profiles().values()]
    [('a', 0.06, 0.04), ('b', 0.06, 0.04)]
    """
    for key, value in (("compute_s", compute_s), ("grad_bytes", grad_bytes), ("time_scale", time_scale), ("byte_scale", byte_scale)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise InputError(f"expected a positive number, got {value!r}", where=key)
    if byte_scale < 1:
        raise InputError(f"expected a byte scale >= 1, got {byte_scale!r}", where="byte_scale")
    for key, value, low in (("iterations", iterations, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise InputError(f"expected an integer >= {low}, got {value!r}", where=key)
    if warmup >= iterations:
        raise InputError(f"warm-up ({warmup}) must leave at least one of the {iterations} iterations to measure", where="warmup")
    topo = shared_bottleneck_topology(nic_gbps)
    mbit = nic_gbps * 1e3 / time_scale
    if mbit > MAX_EMULATED_MBIT:
        raise InputError(f"time_scale {time_scale:g} maps {nic_gbps:g} Gb/s NICs to {mbit:g} Mbit/s; this validation keeps emulated links "
                         f"at or below {MAX_EMULATED_MBIT:g} Mbit/s, so use a time_scale of at least {nic_gbps * 1e3 / MAX_EMULATED_MBIT:g}",
                         where="time_scale")
    specs = (JobSpec("a", 2, compute_s=float(compute_s), grad_bytes=float(grad_bytes), iterations=iterations),
             JobSpec("b", 2, compute_s=float(compute_s), grad_bytes=float(grad_bytes), iterations=iterations))
    placements = {"a": ("node0/gpu0", "node1/gpu0"), "b": ("node0/gpu1", "node2/gpu0")}
    name = f"two-jobs-{compute_s * 1e3:g}ms-{grad_bytes / 1e6:g}MB"
    return ShiftScenario(name, topo, specs, placements, iterations, warmup, float(time_scale), float(byte_scale))


def fluid_iteration_time(compute_s: float, comm_s: float, shift_s: float) -> float:
    """Closed-form iteration time of two identical jobs sharing one link fairly, the second shifted by ``shift_s``.

    Valid for ``compute_s >= comm_s`` (to 1 %; ``comm_s`` is one job's communication
    time alone): the leader of the two communication phases has the link to
    itself for the offset ``e``, the two share it for ``2(M - e)``, the
    follower finishes alone, and both then compute for ``C``, which keeps the
    offset unchanged. Each iteration takes ``C + M + max(0, M - e)``, ``e``
    being the shift's circular distance from 0 on a circle of ``C + M``.

    >>> [round(fluid_iteration_time(0.6, 0.4, d), 3) for d in (0.0, 0.2, 0.4, 0.5, 0.8, 1.0)]
    [1.4, 1.2, 1.0, 1.0, 1.2, 1.4]
    """
    if compute_s < 0.99 * comm_s:
        raise InputError(f"the closed form needs compute_s >= comm_s, got {compute_s!r} < {comm_s!r}", where="compute_s")
    period = compute_s + comm_s
    e = math.fmod(shift_s, period) if period > 0 else 0.0
    e = min(e, period - e)
    return compute_s + comm_s + max(0.0, comm_s - e)


# -- running the cases --------------------------------------------------------------------------------------


def measured_iteration_times(result: RunResult, warmup: int) -> dict[str, float]:
    """Each job's mean iteration time (workload seconds) while every job runs, its first ``warmup`` iterations left out.

    Only iterations that lie inside the window in which all jobs are running
    (from the last release to the first finish) count: a shifted job's first
    iterations before the other is released, or its last ones after the
    other has finished, meet no contention and measure nothing about the
    shift. When no iteration of a job lies inside the window, all its
    iterations after the warm-up count.
    """
    jobs = list(result.jobs.values())
    start = max(j.release for j in jobs)
    end = min(j.finish for j in jobs)
    eps = 1e-9 * max(1.0, abs(end))
    out = {}
    for job in jobs:
        ends = [job.release, *job.iteration_ends]
        spans = list(zip(ends, ends[1:], strict=False))[warmup:]
        inside = [b - a for a, b in spans if a >= start - eps and b <= end + eps]
        times = inside or [b - a for a, b in spans]
        out[job.name] = float(statistics.fmean(times)) if times else math.nan
    return out


def _run_mininet(scenario: ShiftScenario, workload: Workload, out: Path, options: Mapping[str, Any]) -> tuple[RunResult, dict[str, Any]]:
    """One Mininet run; a failed fidelity check keeps the result and says so in the returned report."""
    from emu.mininet_backend import run_mininet

    options = {"prefix": EMU_PREFIX, **options}
    result = run_mininet(scenario.topo, workload, time_scale=scenario.time_scale, byte_scale=scenario.byte_scale, out_dir=out,
                         raise_on_fidelity=False, **options)
    return result, result.meta["fidelity"]


def _fidelity_summary(fidelity: Mapping[str, Any]) -> dict[str, Any]:
    cpu = fidelity.get("cpu") or {}
    cal = [fidelity.get(k) or {} for k in ("calibration_before", "calibration_after")]
    return {"ok": bool(fidelity.get("ok")), "problems": list(fidelity.get("problems") or []), "cpu_busy_mean": cpu.get("busy_mean"),
            "calibration_error": [c.get("error") for c in cal], "drops": fidelity.get("drops"), "wall_s": fidelity.get("wall_s"),
            "run_wall_s": fidelity.get("run_wall_s")}


def run_case(scenario: ShiftScenario, shifts: Mapping[str, float], backend: str, *, repeats: int = 1, out_dir: str | Path | None = None,
             mininet_options: Mapping[str, Any] | None = None, sim_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Run the scenario with ``shifts`` on one backend; per-job mean iteration times, the median over ``repeats`` runs.

    The simulator is deterministic and runs once. Mininet runs ``repeats``
    times (needs root); each run's fidelity report is summarised in
    ``runs[k]["fidelity"]`` and ``fidelity_ok`` is true when every run passed.
    ``mininet_options`` go to :func:`emu.mininet_backend.run_mininet` (e.g.
    ``cpu_limit``, ``probe_dscp``, ``calibrate_seconds``).
    """
    if backend not in BACKENDS:
        raise InputError(f"expected a backend in {', '.join(BACKENDS)}, got {backend!r}", where="backend")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise InputError(f"expected a positive number of repeats, got {repeats!r}", where="repeats")
    workload = scenario.workload(shifts)
    runs: list[dict[str, Any]] = []
    if backend == "sim":
        from emu.sim import simulate

        result = simulate(scenario.topo, workload, record_flows=False, **dict(sim_options or {}))
        runs.append({"mean_iteration_s": measured_iteration_times(result, scenario.warmup), "jct_s": {n: j.jct for n, j in result.jobs.items()}})
    else:
        with tempfile.TemporaryDirectory(prefix="netweave-cv-") as tmp:
            for k in range(repeats):
                out = Path(out_dir) / f"run{k}" if out_dir is not None else Path(tmp) / f"run{k}"
                result, fidelity = _run_mininet(scenario, workload, out, mininet_options or {})
                runs.append({"mean_iteration_s": measured_iteration_times(result, scenario.warmup),
                             "jct_s": {n: j.jct for n, j in result.jobs.items()}, "fidelity": _fidelity_summary(fidelity)})
    jobs = list(runs[0]["mean_iteration_s"])
    median = {j: float(statistics.median(r["mean_iteration_s"][j] for r in runs)) for j in jobs}
    return {"backend": backend, "shifts_s": {s.name: float(shifts.get(s.name, 0.0)) for s in scenario.specs}, "repeats": len(runs),
            "mean_iteration_s": median, "mean_s": float(statistics.fmean(median.values())), "runs": runs,
            "fidelity_ok": all(r.get("fidelity", {"ok": True})["ok"] for r in runs)}


def gain(unshifted: Mapping[str, Any], shifted: Mapping[str, Any]) -> dict[str, Any]:
    """Iteration-time gain of a shift: mean iteration time without it over with it (> 1: the shift helps), overall and per job.

    >>> gain({"mean_iteration_s": {"a": 1.5, "b": 1.5}}, {"mean_iteration_s": {"a": 1.0, "b": 1.0}})
    {'gain': 1.5, 'per_job': {'a': 1.5, 'b': 1.5}}
    """
    base, new = unshifted["mean_iteration_s"], shifted["mean_iteration_s"]
    overall = statistics.fmean(base.values()) / statistics.fmean(new.values())
    return {"gain": float(overall), "per_job": {j: float(base[j] / new[j]) for j in base}}


def direction(g: float, deadband: float = DIRECTION_DEADBAND) -> int:
    """+1 when a gain speeds the jobs up, -1 when it slows them down, 0 within ``deadband`` of no change."""
    return 1 if g > 1 + deadband else -1 if g < 1 - deadband else 0


def agreement(gain_sim: float, gain_emu: float, tolerance: float = DEFAULT_TOLERANCE) -> dict[str, Any]:
    """Do the gains agree: same direction, and ``|gain_emu - gain_sim| / gain_sim <= tolerance``?

    >>> agreement(1.5, 1.4)["agrees"], agreement(1.5, 1.2)["agrees"], agreement(1.1, 0.95)["same_direction"]
    (True, False, False)
    """
    rel = abs(gain_emu - gain_sim) / gain_sim
    same = direction(gain_sim) == direction(gain_emu)
    return {"gain_sim": gain_sim, "gain_emu": gain_emu, "relative_difference": rel, "tolerance": tolerance, "same_direction": same,
            "agrees": bool(same and rel <= tolerance)}


def named_shifts(scenario: ShiftScenario, fractions: Sequence[float] = ()) -> dict[str, dict[str, float]]:
    """The shift settings to compare: ``none``, ``cassini`` and, per fraction ``f``, job ``b`` delayed by ``f`` of an iteration.

    >>> sorted(named_shifts(two_job_scenario(), [0.25]))
    ['cassini', 'none', 'period*0.25']
    """
    period = scenario.period_s()
    out: dict[str, dict[str, float]] = {"none": {}, "cassini": {j: s for j, s in scenario.cassini().shifts.items() if s}}
    last = scenario.specs[-1].name
    for f in fractions:
        out[f"period*{f:g}"] = {last: f * period}
    return out


def validate_shift(scenario: ShiftScenario, *, fractions: Sequence[float] = (), backends: Sequence[str] = BACKENDS, repeats: int = 1,
                   tolerance: float = DEFAULT_TOLERANCE, out_dir: str | Path | None = None,
                   mininet_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Run every shift setting of :func:`named_shifts` on every backend and compare each setting's gain over ``none``.

    Returns ``{"scenario", "cassini", "cases": {setting: {backend: case}},
    "gains": {setting: {backend: gain}}, "agreement": {setting: ...}}``;
    ``agreement`` is present when both backends ran, and ``agrees`` is true
    when every setting's gains agree.
    """
    settings = named_shifts(scenario, fractions)
    res = scenario.cassini()
    report: dict[str, Any] = {"scenario": scenario.to_dict(), "cassini": res.to_dict(), "settings": settings, "cases": {}, "gains": {},
                              "predicted": {}, "closed_form": {}}
    profiles = scenario.profiles()
    identical = len({(p.compute_s, p.comm_s) for p in profiles.values()}) == 1 and len(profiles) == 2
    for name, shifts in settings.items():
        report["cases"][name] = {}
        for backend in backends:
            sub = Path(out_dir) / name / backend if out_dir is not None else None
            report["cases"][name][backend] = run_case(scenario, shifts, backend, repeats=repeats, out_dir=sub, mininet_options=mininet_options)
        report["predicted"][name] = scenario.predicted(shifts)
        p = next(iter(profiles.values()))
        if identical and p.compute_s >= 0.99 * p.comm_s:
            offset = max(shifts.values(), default=0.0) - min((shifts.get(j, 0.0) for j in profiles), default=0.0)
            report["closed_form"][name] = fluid_iteration_time(p.compute_s, p.comm_s, offset)
    for name in settings:
        if name == "none":
            continue
        report["gains"][name] = {b: gain(report["cases"]["none"][b], report["cases"][name][b]) for b in backends}
    if "sim" in backends and "mininet" in backends:
        report["agreement"] = {name: agreement(g["sim"]["gain"], g["mininet"]["gain"], tolerance) for name, g in report["gains"].items()}
        report["agrees"] = all(a["agrees"] for a in report["agreement"].values())
    report["fidelity_ok"] = all(c.get("fidelity_ok", True) for case in report["cases"].values() for c in case.values())
    return report


def format_report(report: Mapping[str, Any]) -> str:
    """The report as a few lines of text: per setting and backend, mean iteration times and gains."""
    lines = [f"scenario {report['scenario']['name']}: shared links {', '.join(report['scenario']['shared_links'])}, "
             f"CASSINI shifts {', '.join(f'{j} {s * 1e3:.2f} ms' for j, s in report['cassini']['shifts_s'].items())}"]
    jobs = sorted({j for cases in report["cases"].values() for case in cases.values() for j in case["mean_iteration_s"]})
    rows = []
    for name, cases in report["cases"].items():
        for backend, case in cases.items():
            g = report["gains"].get(name, {}).get(backend, {}).get("gain")
            its = case["mean_iteration_s"]
            rows.append([name, backend] + [f"{its[j] * 1e3:.2f}" if j in its else "" for j in jobs] + [f"{g:.3f}" if g is not None else ""])
    lines.append(render_table(["case", "backend"] + [f"{j} ms>" for j in jobs] + ["gain>"], rows, indent=2))
    for name, a in (report.get("agreement") or {}).items():
        lines.append(f"  {name}: sim {a['gain_sim']:.3f} vs mininet {a['gain_emu']:.3f} ({a['relative_difference']:.1%}; "
                     f"{'agree' if a['agrees'] else 'DISAGREE'})")
    return "\n".join(lines)


__all__ = [
    "BACKENDS",
    "EMU_PREFIX",
    "MAX_EMULATED_MBIT",
    "ShiftScenario",
    "agreement",
    "direction",
    "fluid_iteration_time",
    "format_report",
    "gain",
    "measured_iteration_times",
    "named_shifts",
    "run_case",
    "shared_bottleneck_topology",
    "two_job_scenario",
    "validate_shift",
]
