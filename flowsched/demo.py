"""``netweave demo`` part for the flow scheduler: in-job gradient scheduling and cross-job flow plans.

1. A small torch model is profiled on this CPU (per-layer gradient ready times
   and sizes, :func:`flowsched.gradients.measure_gradient_profile`); DDP,
   ByteScheduler and Prophet plans are scored with the iteration model
   (:func:`flowsched.intrajob.simulate_iteration`) against the overlap lower
   bound. The network is the all-reduce between two servers of the topology
   (alpha and beta from :func:`topology.collectives.alpha_beta`), slowed down by
   the factor that makes one all-reduce of all gradients last as long as the
   model's compute on this CPU (time dilation, as in the emulator): a CPU-sized
   model on a 400 Gb/s fabric would otherwise have nothing to schedule.
2. Three jobs contend on the topology: Sincronia's order, Parrot's rates and
   Geryon's classes are computed from their per-iteration coflows; the plans go
   to ``out/flow_plan*.json``, the first host's NCCL plugin plan to
   ``out/<host>.nccl.plan``, and that host's tc batch is shown.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
from typing import Any

from emu.net import plan_network
from emu.workload import Job, Workload
from topology import Topology
from topology.clitools import render_table
from topology.collectives import alpha_beta

from .coflow import cct_lower_bound, priority_cct, weighted_cct
from .enforce import host_tc_commands, network_tc_commands
from .gradients import GradientProfile, measure_gradient_profile
from .intrajob import ddp_plan, simulate_iteration, tune_bytescheduler, tune_prophet
from .plan import host_capacities, nccl_class, plan_from_workload, write_nccl_plan, write_plan

IN_JOB_POLICIES = ("ddp", "bytescheduler", "prophet")


def small_model(seed: int = 0) -> tuple[Any, Any, Any]:
    """``(module, make_batch, loss_fn)``: a 6-layer MLP (about 3.4 M parameters) on 64-sample batches."""
    import torch

    torch.manual_seed(seed)
    widths = [512, 1024, 1024, 512, 512, 256, 10]
    layers: list[Any] = []
    for a, b in zip(widths[:-1], widths[1:], strict=True):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    gen = torch.Generator().manual_seed(seed)

    def make_batch() -> tuple[Any, Any]:
        return torch.randn(64, widths[0], generator=gen), torch.randint(0, widths[-1], (64,), generator=gen)

    return model, make_batch, torch.nn.functional.cross_entropy


def profile_small_model(*, bandwidth: float = 1.0, overhead: float = 0.0, iterations: int = 3) -> GradientProfile:
    """Measure :func:`small_model` on this CPU."""
    import torch

    model, make_batch, loss = small_model()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # steadier timings on a shared machine
    try:
        return measure_gradient_profile(model, make_batch, loss, bandwidth=bandwidth, overhead=overhead, warmup=1, iterations=iterations)
    finally:
        torch.set_num_threads(threads)


def dilate_to_topology(profile: GradientProfile, topo: Topology) -> tuple[GradientProfile, float]:
    """The profile on the all-reduce between the first GPUs of the first two servers, slowed down by ``K`` so that
    all gradients in one launch take as long as the compute; returns ``(profile, K)``."""
    hosts = topo.hosts()
    gpus = [topo.gpus(hosts[0])[0], topo.gpus(hosts[1])[0]] if len(hosts) > 1 else topo.gpus(hosts[0])[:2]
    ab = alpha_beta(topo, "all_reduce", gpus)
    k = profile.compute_time / (ab.beta_s_per_byte * profile.total_bytes)
    return profile.with_bandwidth(1.0 / (ab.beta_s_per_byte * k) / 1e9, ab.alpha_s * k), k


def in_job_plans(profile: GradientProfile) -> dict[str, dict[str, Any]]:
    """DDP, ByteScheduler (tuned) and Prophet (tuned) on ``profile``: plan and modelled iteration time."""
    out = {}
    for name, plan in (("ddp", ddp_plan(profile)), ("bytescheduler", tune_bytescheduler(profile)), ("prophet", tune_prophet(profile))):
        t = simulate_iteration(profile, plan)
        out[name] = {"plan": plan, "iteration_s": t.iteration_time, "comm_end_s": t.comm_end, "launches": len(plan.transfers),
                     "params": {k: v for k, v in plan.params.items() if k != "modelled_iteration_time"}}
    return out


def contending_workload(topo: Topology) -> Workload:
    """Three data-parallel jobs whose rings share servers: a big one, a medium one and a small one."""
    hosts = topo.hosts()
    if len(hosts) < 3:
        from topology.errors import InputError

        raise InputError("the flow demo needs a topology with at least three servers")
    g = {h: topo.gpus(h) for h in hosts[:3]}
    half = len(g[hosts[0]]) // 2
    big = Job.data_parallel("big", g[hosts[0]][:half] + g[hosts[1]][:half], compute_s=0.020, nbytes=8e9, iterations=50)
    mid = Job.data_parallel("mid", g[hosts[1]][half:] + g[hosts[2]][:half], compute_s=0.010, nbytes=2e9, iterations=50)
    small = Job.data_parallel("small", g[hosts[2]][half:] + g[hosts[0]][half:], compute_s=0.005, nbytes=2.5e8, iterations=50)
    return Workload("flow-demo", (big, mid, small), {"description": "three data-parallel jobs, each ring crossing two servers"})


def demo(topo: Topology, out: pathlib.Path) -> tuple[dict, str]:
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {}
    lines: list[str] = ["Flow scheduler"]

    measured = profile_small_model()
    profile, k = dilate_to_topology(measured, topo)
    profile.save(out / "gradient_profile.json")
    plans = in_job_plans(profile)
    bound = profile.lower_bound()
    report["in_job"] = {"layers": profile.layers, "gradient_bytes": profile.total_bytes, "compute_s": profile.compute_time,
                        "time_dilation": k, "bandwidth": profile.bandwidth, "overhead_s": profile.overhead, "lower_bound_s": bound,
                        "policies": {n: {key: v for key, v in d.items() if key != "plan"} for n, d in plans.items()}}
    lines.append(f"  in-job: {profile.layers}-layer MLP, {profile.total_bytes / 1e6:.1f} MB of gradients, compute "
                 f"{profile.compute_time * 1e3:.2f} ms on this CPU; network = 2-server all-reduce slowed {k:.3g}x")
    rows = [(n, f"{plans[n]['iteration_s'] * 1e3:.2f}", f"{plans[n]['iteration_s'] / bound:.3f}", plans[n]["launches"]) for n in IN_JOB_POLICIES]
    rows.append(("lower bound", f"{bound * 1e3:.2f}", "1.000", ""))
    lines.append(render_table(["policy", "ms/iteration>", "x lower bound>", "launches>"], rows, indent=4))

    w = contending_workload(topo)
    egress, ingress = host_capacities(topo)
    cap = {**{("out", h): c for h, c in egress.items()}, **{("in", h): c for h, c in ingress.items()}}
    decisions = {p: plan_from_workload(w, topo, p, epoch=1) for p in ("sincronia", "parrot", "geryon")}
    sin = decisions["sincronia"]
    coflows = sin.coflows
    cct = priority_cct(coflows, sin.order, cap)
    fifo = priority_cct(coflows, [c.name for c in coflows], cap)
    lb = cct_lower_bound(coflows, cap)
    write_plan(sin.plan, out / "flow_plan.json")
    write_plan(decisions["parrot"].plan, out / "flow_plan_parrot.json")
    write_plan(decisions["geryon"].plan, out / "flow_plan_geryon.json")
    host = sorted(sin.plan.hosts)[0]
    write_nccl_plan(sin.plan, host, out / f"{host}.nccl.plan")
    tc = host_tc_commands(decisions["parrot"].plan, host, "eth0")
    (out / f"{host}.tc").write_text("\n".join(tc) + "\n")
    # the same plan on the emulated network (per-NIC ports at 1/1000 of the fabric), as the Mininet backend would install it
    net = plan_network(topo, time_scale=1000.0, hosts=sorted(decisions["parrot"].plan.hosts))
    port = next(b for b in network_tc_commands(decisions["parrot"].plan, net) if b.where == net.emu_host(host))
    (out / f"{port.dev}.tc").write_text("\n".join(port.lines) + "\n")
    report["cross_job"] = {
        "jobs": [j.name for j in w.jobs], "coflow_bytes": {str(c.name): sum(f.nbytes for f in c.flows) for c in coflows},
        "sincronia": {"order": sin.order, "classes": sin.classes, "cct_s": {str(n): v for n, v in cct.items()},
                      "total_cct_s": weighted_cct(coflows, cct), "workload_order_total_cct_s": weighted_cct(coflows, fifo), "lower_bound_s": lb},
        "parrot": {"rates": decisions["parrot"].rates, "classes": decisions["parrot"].classes, "remaining_s": decisions["parrot"].remaining},
        "geryon": {"classes": decisions["geryon"].classes},
        "files": ["flow_plan.json", "flow_plan_parrot.json", "flow_plan_geryon.json", f"{host}.nccl.plan", f"{host}.tc"],
        "tc_host": host, "tc_lines": len(tc), "emulated_port": port.dev, "emulated_port_lines": port.lines,
    }
    lines.append(f"  cross-job: {', '.join(f'{c.name} {sum(f.nbytes for f in c.flows) / 1e9:.2f} GB' for c in coflows)} per iteration")
    lines.append(f"    Sincronia order {' > '.join(sin.order)}, classes {sin.classes}; total CCT {weighted_cct(coflows, cct) * 1e3:.2f} ms "
                 f"(workload order {weighted_cct(coflows, fifo) * 1e3:.2f} ms, lower bound {lb * 1e3:.2f} ms)")
    lines.append("    Parrot rates " + ", ".join(f"{j} {r * 8 / 1e9:.0f} Gb/s" for j, r in decisions["parrot"].rates.items())
                 + f" (SRPT job {decisions['parrot'].plan.meta.get('srpt_job')})")
    lines.append(f"    Geryon classes {decisions['geryon'].classes}")
    lines.append(f"    plan -> {out / 'flow_plan.json'}; NCCL plugin plan -> {out / f'{host}.nccl.plan'}")
    lines.append(f"    tc batch of the Parrot plan for {host}'s first NIC, emulated at 1/1000 ({port.dev}, {len(port.lines)} lines):")
    lines += [f"      tc {x}" for x in port.lines if x.startswith(("qdisc replace", "class change"))]
    lines.append(f"      ... 8 leaves, 8 DSCP filters; {host}'s full-rate batch in {out / f'{host}.tc'}")
    report["nccl_hook"], hook_lines = nccl_hook_demo(sin.plan, host, out / f"{host}.nccl.plan")
    return report, "\n".join(lines + hook_lines)


GPU_RESULTS = pathlib.Path(__file__).resolve().parent.parent / "bench" / "results" / "ncclhook_gpu.json"


def nccl_hook_demo(plan: Any, host: str, nccl_plan: pathlib.Path) -> tuple[dict, list[str]]:
    """The host's NCCL plan loaded into the plugin library the way NCCL loads it, for the host's most urgent job."""
    from . import ncclhook

    rule = min(plan.rules(host), key=lambda r: r.priority)
    k = nccl_class(rule.priority)
    try:
        t = ncclhook.loopback_transfer(k, plan=nccl_plan)
    except (ncclhook.NcclHookError, OSError, subprocess.TimeoutExpired) as e:
        return {"skipped": str(e)}, [f"  NCCL hook: skipped ({str(e).splitlines()[0]})"]
    sockets = t["marks"]["sender"] + t["marks"]["receiver"]
    marks = sorted({(m["tos"] >> 2, m["prio"]) for m in sockets})
    report: dict[str, Any] = {"job": rule.job, "traffic_class": k, "transfer": t}
    lines = [f"  NCCL hook: {ncclhook.PLUGIN_LIB} loaded as NCCL loads it (ncclNetPlugin_v{t['version']}); "
             f"{t['bytes'] / 1e6:.1f} MB moved intact over lo",
             f"    job {rule.job} (priority {rule.priority} -> NCCL trafficClass {k}) with {nccl_plan.name}: "
             f"{len(sockets)} sockets marked " + ", ".join(f"DSCP {d} / SO_PRIORITY {p:#x}" for d, p in marks)]
    if GPU_RESULTS.exists():  # the last real-NCCL run, committed by csrc/tests/gpu_nccl_check.py
        gpu = json.loads(GPU_RESULTS.read_text())
        ratios = gpu.get("scenarios", {}).get("contention", {}).get("ratios", [])
        if ratios:
            report["gpu_record"] = {"date": gpu["date"], "device": gpu["device"], "nccl": gpu["nccl_version"], "ratios": ratios}

            def span(xs: list[float]) -> str:
                lo, hi = f"{min(xs):.2f}", f"{max(xs):.2f}"
                return lo if lo == hi else f"{lo}-{hi}"

            lines.append(f"    recorded on {gpu['device']} with NCCL {gpu['nccl_version']} ({gpu['date']}, bench/results/ncclhook_gpu.md): "
                         f"a small all-reduce beside a bulk one took {span([r['plan'] for r in ratios])}x its time alone with the "
                         f"plan, {span([r['no_plan'] for r in ratios])}x without")
    return report, lines
