"""``netweave demo`` part for the placement planner: HiveD + CASSINI on the default cluster.

Places four data-parallel jobs (two of them in virtual clusters) with HiveD's
buddy allocator, lets CASSINI rank the candidates and time-shift the jobs that
share links, prints placements, shifts and torchrun lines, and checks with the
fluid model of emu (emu.fluid) what the shifts buy. Then fails one GPU to show how a
VC's guarantee degrades visibly, and replays a synthetic trace under every policy.
"""

from __future__ import annotations

import pathlib
from typing import Any

from topology.clitools import render_table
from topology.io import atomic_write_text
from topology.model import Topology

from .contention import FluidSlowdown, PlacedJob
from .hived import HivedScheduler
from .planner import dumps_plan, plan_jobs, plan_text
from .profiles import JobSpec, comm_profile
from .replay import POLICIES, replay
from .traces import synthetic_trace

DEMO_VCS = {"research": {"host": 2}, "prod": {"numa": 2}}
DEMO_JOBS = [
    JobSpec("gpt", 12, compute_s=0.030, grad_bytes=3e9, vc="research", priority=10),
    JobSpec("bert", 12, compute_s=0.030, grad_bytes=3e9),
    JobSpec("resnet", 4, compute_s=0.050, grad_bytes=1e8, vc="prod"),
    JobSpec("dlrm", 4, compute_s=0.020, grad_bytes=8e8),
]


def demo(topo: Topology, out: pathlib.Path) -> tuple[dict[str, Any], str]:
    """Plan the demo jobs on ``topo``; write ``plan.json`` and Slurm hostfiles under ``out``; return (report, text)."""
    out = pathlib.Path(out)
    plan = plan_jobs(topo, DEMO_JOBS, virtual_clusters=DEMO_VCS, policy="hived+cassini")
    atomic_write_text(out / "plan.json", dumps_plan(plan))
    for j in plan["jobs"]:
        if j["placed"]:
            atomic_write_text(out / f"{j['name']}.hostfile", j["launch"]["slurm_hostfile"])
    # when sharing is unavoidable (only the buddy allocator's first choice, no VCs), CASSINI shifts the jobs instead
    forced = plan_jobs(topo, [JobSpec(**{**j.to_dict(), "vc": None}) for j in DEMO_JOBS], policy="hived+cassini", candidates=1)
    effect = _shift_effect(topo, forced)
    # HiveD guarantees under a failure
    sched = HivedScheduler(topo, DEMO_VCS)
    failed = [topo.gpus(host=topo.hosts()[0])[0], topo.hosts()[1]]
    failure = sched.fail(failed)["guarantees"]
    # a trace replayed under every policy, slowdowns from emu.fluid
    trace = synthetic_trace(120, seed=1, arrival_rate=1 / 90, mean_duration_s=400, network_heavy=0.6)
    replays = {p: replay(topo, trace, p) for p in POLICIES}
    from .cli import plot_jct

    plot_jct(replays, out / "replay_jct.png", title=f"{len(trace)} synthetic jobs on {topo.name}")
    report = {"plan": plan, "shared_links_plan": forced, "iteration_times": effect,
              "failure_check": {"failed": failed, "ok": failure["ok"], "chains": failure["chains"]},
              "replay": {p: r.metrics for p, r in replays.items()},
              "files": sorted(str(p.relative_to(out)) for p in out.glob("*") if p.is_file())}
    lines = [plan_text(plan), "", "with the buddy allocator's first choice only, jobs share links and CASSINI time-shifts them:",
             plan_text(forced), "  iteration time per job (emu.fluid job-level model): solo / all started together / with the shifts"]
    effect_rows = [(n, f"{e['solo_ms']:.1f}", f"{e['unshifted_ms']:.1f}", f"{e['shifted_ms']:.1f}") for n, e in effect.items()]
    lines.append(render_table(["job", "solo ms>", "together ms>", "shifted ms>"], effect_rows, indent=4))
    deficits = [d for c in failure["chains"].values() for d in c["deficits"]]
    lines.append(f"  after failing {report['failure_check']['failed']}: guarantees {'hold' if failure['ok'] else 'DEGRADED'}"
                 + "".join(f"; level {d['level']} short of {d['missing']} cell(s)" for d in deficits))
    from emu.fluid import fluid_engine

    lines.append(f"  trace replay of {len(trace)} synthetic jobs (emu.fluid slowdowns, {fluid_engine().split(' ')[0]} event loop); "
                 "JCT CDF in replay_jct.png:")
    rows = [(p, f"{m['avg_jct_s']:.0f}", f"{m['p99_jct_s']:.0f}", f"{m['avg_queue_s']:.0f}", f"{m['fragmentation']:.3f}",
             f"{m['overloaded_link_s']:.1f}") for p, m in ((p, r.metrics) for p, r in replays.items())]
    lines.append(render_table(["policy", "avg JCT s>", "p99 JCT s>", "avg queue s>", "frag>", "overloaded link-s>"], rows, indent=4))
    return report, "\n".join(lines)


def _shift_effect(topo: Topology, plan: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Iteration times by the fluid model: the plan's placements started together vs with their time shifts."""
    specs = {s.name: s for s in DEMO_JOBS}
    placed = [j for j in plan["jobs"] if j["placed"]]
    profiles = {j["name"]: comm_profile(topo, specs[j["name"]], j["gpus"]) for j in placed}
    model = FluidSlowdown(topo)
    together = model([PlacedJob(profiles[n], 0.0) for n in profiles])
    shifted = model([PlacedJob(profiles[j["name"]], j["start_offset_s"]) for j in placed])
    return {n: {"solo_ms": profiles[n].period_s * 1e3, "unshifted_ms": together[n] * 1e3, "shifted_ms": shifted[n] * 1e3} for n in profiles}
