"""The placement planner's candidate ranking held against real runs: plan, run every candidate in Mininet, Kendall's tau.

The planner (:func:`placement.planner.plan_jobs` with ``hived+cassini``) asks
HiveD for up to ``candidates`` placements of a new job
(:meth:`~placement.hived.HivedScheduler.candidates`), scores each with
CASSINI against the running jobs (:func:`placement.cassini.rank_candidates`:
alone iteration time x ``(2 - compat)``, the new job time-shifted) and takes
the best. :func:`rank_placements` takes the same steps on a contended mix
and keeps every candidate with its score; :func:`run_ranking` then runs the
whole mix once per candidate (the running jobs where they are, the new job on
the candidate's GPUs with the candidate's time shift) in the flow-level
simulator and in Mininet, measures every job's mean iteration time
(:func:`placement.validate.measured_iteration_times`: warm-up left out, only
while all jobs run) and compares the orders with :func:`emu.ranking.rank_agreement`
(Kendall's tau-b; predicted values within 2 % are one tie class).

The mix (:func:`contended_mix`): ``2 * leaves`` small servers (2 GPUs, one
100 Gb/s NIC each) on a leaf/spine fabric (:func:`topology.fabrics.leaf_spine`,
two servers per leaf, one spine, 2:1 oversubscribed). On every leaf a running
data-parallel job holds ``gpu0`` of both servers, so every free GPU shares its
server's NIC with a running job and each of HiveD's candidates for the new
2-GPU job (a pair of ``gpu1`` on one leaf) shares both NICs with one running
job. All jobs have the same alone iteration time (50 ms), so CASSINI's circle
is one iteration; the running jobs differ in their share of it spent
communicating (``comm_fractions``, one per leaf), hence in how much of the
new job's all-reduce a time shift can keep out of their way: the candidates
really differ, and by how much is what the planner predicts. The running jobs
do not share links with each other.

Predicted costs compared with the measured new-job iteration time:
``planner_cost`` (CASSINI's score, what the planner ranks by),
``cassini_iter_s`` (CASSINI's first-order fluid estimate of the new job's
iteration, :func:`placement.cassini.predicted_iteration_times`) and
``sim_iter_s`` (the flow-level simulator, :func:`emu.sim.simulate`, on the
same workload the emulation runs).

>>> m = contended_mix(leaves=3)
>>> [c["gpus"] for c in rank_placements(m)]
[['node2/gpu1', 'node3/gpu1'], ['node0/gpu1', 'node1/gpu1'], ['node4/gpu1', 'node5/gpu1']]
"""

from __future__ import annotations

import math
import statistics
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from emu.ranking import DEFAULT_TIE_TOLERANCE, pairs_within_noise, rank_agreement, spread
from emu.workload import Job, Workload
from topology.errors import InputError
from topology.fabrics import build_cluster
from topology.model import LinkKind, Topology

from .cassini import predicted_iteration_times, rank_candidates
from .hived import HivedScheduler
from .planner import rank_order
from .profiles import CommProfile, JobSpec, comm_profile
from .validate import _fidelity_summary, measured_iteration_times

#: Name prefix of the emulated networks made here (hosts ``rkh0``.., switches ``rks0``..).
EMU_PREFIX = "rk"
#: The running jobs' share of an iteration spent communicating, one per leaf (the default mix has five leaves).
DEFAULT_COMM_FRACTIONS = (0.45, 0.2, 0.65, 0.35, 0.55)


@dataclass(frozen=True)
class RankingMix:
    """Running jobs on fixed GPUs, a new job to place, and how to run the mix (iterations, time and byte scale)."""

    name: str
    topo: Topology
    running: tuple[tuple[JobSpec, tuple[str, ...]], ...]
    new: JobSpec
    iterations: int = 8
    warmup: int = 2
    time_scale: float = 1000.0
    byte_scale: float = 100.0
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def running_profiles(self) -> dict[str, CommProfile]:
        return {s.name: comm_profile(self.topo, s, gpus) for s, gpus in self.running}

    def workload(self, gpus: Sequence[str], shift_s: float) -> Workload:
        """The running jobs where they are and the new job on ``gpus`` (rank order) started ``shift_s`` late."""
        jobs = [Job.data_parallel(s.name, list(g), compute_s=s.compute_s, nbytes=s.grad_bytes, iterations=self.iterations)
                for s, g in self.running]
        jobs.append(Job.data_parallel(self.new.name, list(gpus), compute_s=self.new.compute_s, nbytes=self.new.grad_bytes,
                                      iterations=self.iterations, start_offset=float(shift_s)))
        return Workload(f"{self.name}[{self.new.name}@{'+'.join(gpus)}]", tuple(jobs), {"mix": self.name})

    def emulated_link_mbit(self) -> float:
        return max(d["bw"] for _, _, _, d in self.topo.links(LinkKind.NETWORK)) * 8e3 / self.time_scale

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "topology": self.topo.name, "running": [{**s.to_dict(), "placed_on": list(g)} for s, g in self.running],
                "new": self.new.to_dict(), "iterations": self.iterations, "warmup": self.warmup, "time_scale": self.time_scale,
                "byte_scale": self.byte_scale, "emulated_link_mbit": self.emulated_link_mbit(), **self.meta}


def contended_mix(*, leaves: int = 5, comm_fractions: Sequence[float] | None = None, new_comm_fraction: float = 0.7, period_s: float = 0.05,
                  nic_gbps: float = 100.0, iterations: int = 8, warmup: int = 2, time_scale: float = 1000.0,
                  byte_scale: float = 100.0) -> RankingMix:
    """The contended mix of the module docstring: ``leaves`` leaves, a running job per leaf, a new 2-GPU job.

    A job's gradient bytes are chosen so that its alone all-reduce (ring of two, ``S / B`` on the NIC's
    ``B``) takes ``fraction * period_s`` and its compute the rest.

    >>> m = contended_mix(leaves=2, comm_fractions=[0.5, 0.2])
    >>> [(s.name, g) for s, g in m.running]
    [('r0', ('node0/gpu0', 'node1/gpu0')), ('r1', ('node2/gpu0', 'node3/gpu0'))]
    >>> {n: round(p.comm_s / p.period_s, 2) for n, p in m.running_profiles().items()}
    {'r0': 0.5, 'r1': 0.2}
    """
    fractions = list(comm_fractions if comm_fractions is not None else DEFAULT_COMM_FRACTIONS[:leaves])
    if isinstance(leaves, bool) or not isinstance(leaves, int) or leaves < 2:
        raise InputError(f"expected at least 2 leaves, got {leaves!r}", where="leaves")
    if len(fractions) != leaves:
        raise InputError(f"expected {leaves} communication fractions (one per leaf), got {len(fractions)}", where="comm_fractions")
    for i, f in enumerate([*fractions, new_comm_fraction]):
        if isinstance(f, bool) or not isinstance(f, int | float) or not 0 < f < 1:
            raise InputError(f"expected a fraction in (0, 1), got {f!r}", where=f"comm_fractions[{i}]" if i < leaves else "new_comm_fraction")
    topo = build_cluster(2 * leaves, node="pcie-server", fabric="leaf-spine", name=f"ranking-{leaves}leaves",
                         node_options={"gpus": 2, "gpus_per_switch": 2, "nics_per_switch": 1, "sockets": 1, "nic_gbps": float(nic_gbps)},
                         hosts_per_leaf=2, spines=1, oversubscription=2.0)
    nic_bps = nic_gbps / 8 * 1e9
    hosts = topo.hosts()

    def spec(name: str, fraction: float) -> JobSpec:
        return JobSpec(name, 2, compute_s=(1 - fraction) * period_s, grad_bytes=fraction * period_s * nic_bps, iterations=iterations)

    running = tuple((spec(f"r{i}", f), (f"{hosts[2 * i]}/gpu0", f"{hosts[2 * i + 1]}/gpu0")) for i, f in enumerate(fractions))
    return RankingMix(f"contended-{leaves}leaves", topo, running, spec("new", new_comm_fraction), iterations, warmup, float(time_scale),
                      float(byte_scale), {"comm_fractions": fractions, "new_comm_fraction": new_comm_fraction, "period_s": period_s,
                                          "nic_gbps": nic_gbps})


def rank_placements(mix: RankingMix, candidates: int = 6) -> list[dict[str, Any]]:
    """The planner's candidates for the new job, best first, with its score and the predictions (see the module docstring).

    The running jobs are committed to a fresh :class:`~placement.hived.HivedScheduler` on their GPUs; then, as
    :func:`placement.planner.plan_jobs` does, HiveD lists up to ``candidates`` placements and
    :func:`~placement.cassini.rank_candidates` orders them. Each entry: ``rank`` (0 = the planner's pick),
    ``allocator_index``, ``gpus`` (rank order), ``shift_s`` (the new job's CASSINI shift), ``compat``,
    ``shared_links``, ``planner_cost`` and ``cassini_iter_s``.
    """
    sched = HivedScheduler(mix.topo)
    chain = next(iter(sched.trees))
    for s, gpus in mix.running:
        res = sched.allocate(s.name, len(gpus), plan=[(chain, 0, g) for g in gpus])
        if not res.ok:
            raise InputError(f"running job {s.name!r} does not fit on {', '.join(gpus)}: {res.reason}", where="running")
    cands = [c for c in sched.candidates(mix.new.name, mix.new.gpus, limit=candidates) if c.ok]
    if not cands:
        raise InputError(f"no placement of {mix.new.gpus} GPUs for the new job", where="new")
    running = mix.running_profiles()
    profiles = [comm_profile(mix.topo, mix.new, rank_order(mix.topo, c.gpus)) for c in cands]
    ranked = rank_candidates(mix.topo, {n: (p, 0.0) for n, p in running.items()}, profiles)
    out = []
    for pos, r in enumerate(ranked):
        shift = float(r.shifts.shifts.get(mix.new.name, 0.0))
        est = predicted_iteration_times({**running, mix.new.name: r.profile}, r.shifts.shifts, mix.topo)
        out.append({"rank": pos, "allocator_index": r.index, "gpus": list(r.profile.gpus), "shift_s": shift, "compat": r.compat,
                    "shared_links": r.shared, "planner_cost": r.cost, "cassini_iter_s": est[mix.new.name]})
    return out


def _emulate(mix: RankingMix, workload: Workload, out: Path, options: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, Any]]:
    from emu.mininet_backend import run_mininet

    result = run_mininet(mix.topo, workload, time_scale=mix.time_scale, byte_scale=mix.byte_scale, out_dir=out, raise_on_fidelity=False,
                         **{"prefix": EMU_PREFIX, "nic_mode": "aggregate", **options})
    return measured_iteration_times(result, mix.warmup), _fidelity_summary(result.meta["fidelity"])


def run_ranking(mix: RankingMix, *, candidates: int = 6, repeats: int = 1, emulate: bool = True, tolerance: float = DEFAULT_TIE_TOLERANCE,
                mininet_options: Mapping[str, Any] | None = None, out_dir: str | Path | None = None) -> dict[str, Any]:
    """Rank the new job's placements with the planner, run each candidate's mix, and compare the orders.

    Every candidate's workload runs once in the simulator and (``emulate``, needs root and Mininet) ``repeats``
    times in Mininet, the runs of one repeat back to back over the candidates (so that slow drift of the shared
    machine spreads over all candidates alike); a candidate's measured time is the median over its runs.
    Returns ``{"mix", "candidates": [...], "agreement": {name: rank_agreement(...)}}``: each candidate gets
    ``sim_iter_s`` and ``sim_mix_mean_s`` (the new job's and all jobs' mean iteration time in the simulator),
    and with emulation ``emu_iter_s``, ``emu_mix_mean_s``, the per-run values and fidelity summaries.
    ``agreement`` holds tau for ``planner_cost``, ``cassini_iter_s`` and ``sim_iter_s`` against the measured
    new-job time (``emu_iter_s``, else ``sim_iter_s``), and ``sim_mix_mean_s`` against ``emu_mix_mean_s``. With emulation,
    ``emu_iter_spread`` is (max - min) / median of a candidate's runs and ``pairs_within_noise`` lists the pairs of
    candidates (by rank) measured closer than that (:func:`emu.ranking.pairs_within_noise`).
    """
    from emu.sim import simulate

    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise InputError(f"expected a positive number of repeats, got {repeats!r}", where="repeats")
    cands = rank_placements(mix, candidates)
    new = mix.new.name
    for c in cands:
        wl = mix.workload(c["gpus"], c["shift_s"])
        times = measured_iteration_times(simulate(mix.topo, wl, record_flows=False, track_links="none"), mix.warmup)
        c["sim_iter_s"], c["sim_mix_mean_s"] = times[new], statistics.fmean(times.values())
        c["sim_jobs_s"] = times
        c["runs"] = []
    if emulate:
        with tempfile.TemporaryDirectory(prefix="netweave-rk-") as tmp:
            base = Path(out_dir) if out_dir is not None else Path(tmp)
            for k in range(repeats):
                for c in cands:
                    times, fid = _emulate(mix, mix.workload(c["gpus"], c["shift_s"]), base / f"cand{c['rank']}-run{k}", mininet_options or {})
                    c["runs"].append({"jobs_s": times, "fidelity": fid})
        for c in cands:
            c["emu_iter_runs_s"] = [r["jobs_s"][new] for r in c["runs"]]
            c["emu_iter_s"] = statistics.median(c["emu_iter_runs_s"])
            c["emu_iter_spread"] = spread(c["emu_iter_runs_s"])
            c["emu_mix_mean_s"] = statistics.median(statistics.fmean(r["jobs_s"].values()) for r in c["runs"])
            c["emu_jobs_s"] = {j: statistics.median(r["jobs_s"][j] for r in c["runs"]) for j in c["runs"][0]["jobs_s"]}
            c["fidelity_ok"] = all(r["fidelity"]["ok"] for r in c["runs"])
            c["cpu_busy_max"] = max((r["fidelity"]["cpu_busy_mean"] or math.nan for r in c["runs"]), default=math.nan)
    target = "emu_iter_s" if emulate else "sim_iter_s"
    agree: dict[str, Any] = {}
    if len(cands) >= 2:
        measured = [c[target] for c in cands]
        for key in ("planner_cost", "cassini_iter_s", "sim_iter_s"):
            agree[f"{key} vs {target}"] = rank_agreement([c[key] for c in cands], measured, tolerance=tolerance)
        if emulate:
            agree["sim_mix_mean_s vs emu_mix_mean_s"] = rank_agreement([c["sim_mix_mean_s"] for c in cands],
                                                                       [c["emu_mix_mean_s"] for c in cands], tolerance=tolerance)
    out = {"mix": mix.to_dict(), "candidates": cands, "measured": target, "repeats": repeats if emulate else 0, "agreement": agree}
    if emulate:
        out["pairs_within_noise"] = pairs_within_noise([str(c["rank"]) for c in cands], [c["emu_iter_s"] for c in cands],
                                                       [c["emu_iter_spread"] for c in cands])
    return out


__all__ = ["DEFAULT_COMM_FRACTIONS", "EMU_PREFIX", "RankingMix", "contended_mix", "rank_placements", "run_ranking"]
