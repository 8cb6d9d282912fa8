"""``netweave flow``: flow plans (cross-job), their enforcement, gradient profiles and in-job schedules, the control plane, the NCCL hook."""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any

from topology.clitools import add_json_flag, add_output, emit, load_callable, progress
from topology.errors import InputError
from topology.inputs import check_interface, check_name, check_number
from topology.units import flag_action, parse_duration, parse_rate

from .plan import POLICIES


def register(sub: argparse._SubParsersAction) -> None:
    flow = sub.add_parser("flow", help="flow scheduling: cross-job plans, HTB/DSCP enforcement, gradient schedules, control plane")
    fsub = flow.add_subparsers(dest="flow_command", metavar="ACTION", required=True)

    p = fsub.add_parser("keys", help="generate CURVE key pairs for the scheduler and agents")
    add_output(p, "--out", required=True, help="key directory (NAME.key public, NAME.key_secret secret)", directory=True)
    p.add_argument("--agents", default="", help="comma-separated agent host names")
    add_json_flag(p)
    p.set_defaults(func=cmd_keys)

    p = fsub.add_parser("plan", help="cross-job flow plan for a workload on a topology")
    p.add_argument("--workload", required=True, help="workload file (YAML or JSON, see docs/workload.md)")
    p.add_argument("--topology", required=True, help="topology file")
    p.add_argument("--policy", choices=POLICIES, default="sincronia",
                   help="cross-job order: Sincronia, Parrot, Geryon (per-tensor bands) or fair sharing (default sincronia)")
    p.add_argument("--epoch", type=int, default=1, help="plan generation number (default 1)")
    p.add_argument("--classes", type=int, default=8, help="priority classes to use, 1..8 (default 8)")
    add_output(p, "--out", required=True, help="flow plan file (.json)")
    add_output(p, "--nccl-plan", default=None, metavar="DIR", help="also write each host's NCCL plugin plan file into DIR", directory=True)
    add_json_flag(p)
    p.set_defaults(func=cmd_plan)

    p = fsub.add_parser("apply", help="install (or print) a host's HTB tree and DSCP filters")
    p.add_argument("plan", help="flow plan file")
    p.add_argument("--host", required=True, help="the host of the plan whose HTB tree and filters to install")
    p.add_argument("--dev", default="eth0", help="egress interface (default eth0)")
    p.add_argument("--rate-mbit", action=flag_action(parse_rate, unit="Mbit/s"), default=None,
                   help="link rate in Mbit/s, or with a unit (100Mbit, 10Gb/s) (default: the plan's link_rate of the host)")
    p.add_argument("--time-scale", type=float, default=1.0, help="divide the plan's rates by this factor (emulation)")
    p.add_argument("--netns", default=None, help="apply inside this network namespace")
    p.add_argument("--dry-run", action="store_true", help="print the tc batch instead of running it")
    add_json_flag(p)
    p.set_defaults(func=cmd_apply)

    p = fsub.add_parser("profile", help="measure a gradient profile of a torch model and write it as JSON")
    p.add_argument("--model", default=None, metavar="MODULE:CALLABLE", help="callable returning a torch.nn.Module (default: built-in MLP)")
    p.add_argument("--input-shape", default=None, help="batch shape for --model, e.g. 32,784")
    p.add_argument("--bandwidth", action=flag_action(parse_rate), default=10.0,
                   help="all-reduce goodput in GB/s, or with a unit (100Gb/s), to store in the profile (default 10)")
    p.add_argument("--overhead-us", action=flag_action(parse_duration, unit="us"), default=10.0,
                   help="cost of one collective launch in microseconds, or with a unit (default 10)")
    p.add_argument("--iterations", type=int, default=5, help="timed backward passes; the profile is their median (default 5)")
    add_output(p, "--out", required=True, help="gradient profile file to write (JSON)")
    add_json_flag(p)
    p.set_defaults(func=cmd_profile)

    p = fsub.add_parser("schedule", help="in-job gradient schedule and its modelled iteration time vs the lower bound")
    p.add_argument("--profile", required=True, help="gradient profile JSON (netweave flow profile)")
    p.add_argument("--policy", choices=("ddp", "prophet", "bytescheduler"), default="prophet",
                   help="DDP's buckets, Prophet's blocks or ByteScheduler's partitions and credit (default prophet)")
    p.add_argument("--bandwidth", action=flag_action(parse_rate), default=None,
                   help="override the profile's bandwidth (GB/s, or with a unit: 100Gb/s)")
    add_output(p, "--out", default=None, help="write the plan (JSON)")
    add_json_flag(p)
    p.set_defaults(func=cmd_schedule)

    p = fsub.add_parser("serve", help="run the scheduler service and publish a plan")
    p.add_argument("--config", required=True, help="control-plane configuration (see docs/flowsched.md)")
    p.add_argument("--plan", required=True, help="flow plan to publish")
    p.add_argument("--duration", action=flag_action(parse_duration), default=None,
                   help="stop after this many seconds, or e.g. 5min (default: until interrupted)")
    p.add_argument("--until-acked", action="store_true", help="stop as soon as every host acknowledged the plan")
    add_json_flag(p)
    p.set_defaults(func=cmd_serve)

    p = fsub.add_parser("agent", help="run one host's agent")
    p.add_argument("--config", required=True, help="control-plane configuration (see docs/flowsched.md)")
    p.add_argument("--host", required=True, help="this agent's host: its entry in the configuration and the plan")
    p.add_argument("--dry-run", action="store_true", help="record tc batches instead of running them")
    p.add_argument("--duration", action=flag_action(parse_duration), default=None, help="stop after this many seconds, or e.g. 5min")
    p.add_argument("--until-applied", action="store_true",
                   help="stop once a plan is in force: applied, or found intact in the kernel (a restart with a state file)")
    p.add_argument("--state", default=None, help="state file keeping the epoch in force across restarts "
                   "(default: the configuration's agents.HOST.state, agent-HOST.state.json beside it; none with --dry-run)")
    add_json_flag(p)
    p.set_defaults(func=cmd_agent)

    p = fsub.add_parser("nccl", help="the NCCL plugin library of csrc/: build it, load it, read its plan and profiler ring")
    nsub = p.add_subparsers(dest="nccl_command", metavar="ACTION", required=True)
    q = nsub.add_parser("build", help="build csrc/ (make) and print the plugin library's path")
    q.add_argument("--sanitize", action="store_true", help="the ASan/UBSan build")
    add_json_flag(q)
    q.set_defaults(func=cmd_nccl_build)
    q = nsub.add_parser("env", help="print NCCL's environment for the fabric: the net plugin on TCP, NCCL_IB_TC/SL on IB and RoCE")
    q.add_argument("--plan", default=None, help="plugin plan file (netweave flow plan --nccl-plan)")
    q.add_argument("--ring", default=None, help="profiler ring file (%%p = pid); loads the profiler plugin")
    q.add_argument("--topology", default="default", help="topology whose fabric picks the transport (default: the built-in cluster, InfiniBand)")
    q.add_argument("--transport", choices=["ib", "roce", "tcp"], default=None, help="override the fabric's transport")
    q.add_argument("--class", dest="traffic_class", type=int, default=None, help="the job's NCCL class 0..7 (IB, RoCE: NCCL_IB_TC, NCCL_IB_SL)")
    q.add_argument("--tuner", action="store_true", help="also load the tuner plugin")
    q.add_argument("--profiler", action="store_true", help="also load the profiler plugin")
    add_json_flag(q)
    q.set_defaults(func=cmd_nccl_env)
    q = nsub.add_parser("check-plan", help="parse a plugin plan file and print it normalised")
    q.add_argument("path", help="plugin plan file (netweave-plan 1)")
    add_json_flag(q)
    q.set_defaults(func=cmd_nccl_check_plan)
    q = nsub.add_parser("ring", help="print the events of a profiler ring")
    q.add_argument("path", help="profiler ring file (NETWEAVE_PROF_RING of the process, %%p replaced by its pid)")
    add_json_flag(q)
    q.set_defaults(func=cmd_nccl_ring)
    q = nsub.add_parser("loopback", help="load the net plugin as NCCL does and move messages over lo, showing the sockets' marks")
    q.add_argument("--class", dest="traffic_class", type=int, default=None, help="the communicator's NCCL trafficClass (0..7)")
    q.add_argument("--plan", default=None, help="plugin plan file")
    add_json_flag(q)
    q.set_defaults(func=cmd_nccl_loopback)


def cmd_keys(args: argparse.Namespace) -> int:
    from .control import generate_keys

    agents = [check_name(a, what="agent host name", where="--agents") for a in args.agents.split(",") if a]
    made = generate_keys(args.out, agents)
    data = {name: {"public": str(pub), "secret": str(sec)} for name, (pub, sec) in made.items()}
    emit(args, data, "\n".join(f"{name}: {d['public']} (secret {d['secret']})" for name, d in data.items()))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from emu.workload import read_workload
    from topology.io import read_topology

    from .plan import plan_from_workload, write_nccl_plan, write_plan

    check_number(args.epoch, what="an epoch", where="--epoch", integer=True, minimum=0, maximum=2**62)
    topo = read_topology(args.topology)
    workload = read_workload(args.workload)
    d = plan_from_workload(workload, topo, args.policy, epoch=args.epoch, classes=args.classes)
    write_plan(d.plan, args.out)
    files = [args.out]
    if args.nccl_plan:
        Path(args.nccl_plan).mkdir(parents=True, exist_ok=True)
        for h in d.plan.hosts:
            files.append(str(write_nccl_plan(d.plan, h, Path(args.nccl_plan) / f"{h}.plan")))
    lines = [f"{args.policy} plan, epoch {d.plan.epoch}: {len(d.plan.hosts)} hosts, {len(d.plan.jobs())} jobs -> {args.out}",
             f"  order: {' > '.join(d.order) or '(no inter-host traffic)'}"]
    for c in d.coflows:
        j = str(c.name)
        rate = f", {d.rates[j] * 8 / 1e9:.1f} Gb/s" if j in d.rates else ""
        lines.append(f"  {j}: class {d.classes.get(j)}{rate}, {sum(f.nbytes for f in c.flows) / 1e9:.3f} GB/iteration between "
                     f"{len({f.src for f in c.flows} | {f.dst for f in c.flows})} hosts")
    emit(args, {**d.to_dict(), "files": files}, "\n".join(lines))
    return 0


def cmd_apply(args: argparse.Namespace) -> int:
    from .enforce import EnforceError, apply_tc, host_tc_commands, verify_tc
    from .plan import read_plan

    check_name(args.host, what="host name", where="--host")
    check_interface(args.dev, where="--dev")
    if args.netns is not None:
        check_name(args.netns, what="network namespace name", where="--netns")
    check_number(args.time_scale, what="a time scale", where="--time-scale", positive=True, maximum=1e9)
    plan = read_plan(args.plan)
    lines = host_tc_commands(plan, args.host, args.dev, rate_mbit=args.rate_mbit, time_scale=args.time_scale)
    if not args.dry_run:
        apply_tc(lines, args.dev, netns=args.netns)  # transactional: a refused tree leaves the device's current one
        problems = verify_tc(lines, args.dev, netns=args.netns)
        if problems:
            raise EnforceError(f"installed, but the kernel does not hold the tree: {'; '.join(problems[:3])}", where=args.dev)
    emit(args, {"host": args.host, "dev": args.dev, "applied": not args.dry_run, "verified": not args.dry_run, "commands": lines},
         "\n".join(f"tc {x}" for x in lines) if args.dry_run else f"installed {len(lines)} tc lines on {args.dev} (read back: identical)")
    return 0


def cmd_nccl_build(args: argparse.Namespace) -> int:
    from . import ncclhook

    build_dir = ncclhook.build(sanitize=args.sanitize)
    emit(args, {"build_dir": str(build_dir), "library": str(build_dir / ncclhook.PLUGIN_LIB)}, str(build_dir / ncclhook.PLUGIN_LIB))
    return 0


def cmd_nccl_env(args: argparse.Namespace) -> int:
    import shlex

    from . import ncclhook

    if args.traffic_class is not None and not 0 <= args.traffic_class <= 7:
        raise InputError(f"--class must be 0..7, got {args.traffic_class}")
    plan = None
    if args.plan is not None:
        plan = ncclhook.read_plan(args.plan)  # a bad plan fails here, not inside NCCL
    if args.transport is None:
        import topology
        from topology.io import read_topology

        transport = ncclhook.fabric_transport(topology.default_cluster() if args.topology == "default" else read_topology(args.topology))
    else:
        transport = args.transport
    dscp = None
    if plan is not None and args.traffic_class is not None:
        dscp = plan.resolve(args.traffic_class)["dscp"]  # the plan may re-mark the class
    needs_lib = transport == "tcp" or args.tuner or args.profiler or args.ring is not None
    env = ncclhook.fabric_env(transport, traffic_class=args.traffic_class, dscp=dscp, plan=Path(args.plan).resolve() if args.plan else None,
                              tuner=args.tuner, profiler=args.profiler, ring=args.ring, build_dir=ncclhook.build() if needs_lib else None)
    lines = [f"# {transport} fabric: " + ("the netweave net plugin carries the class on its sockets" if transport == "tcp"
                                          else "NCCL's own IB transport; the class rides on NCCL_IB_TC / NCCL_IB_SL")]
    emit(args, env, "\n".join(lines + [f"export {k}={shlex.quote(v)}" for k, v in env.items()]))
    return 0


def cmd_nccl_check_plan(args: argparse.Namespace) -> int:
    import dataclasses

    from . import ncclhook

    plan = ncclhook.read_plan(args.path)
    emit(args, dataclasses.asdict(plan), ncclhook.format_plan(plan).rstrip("\n"))
    return 0


def cmd_nccl_ring(args: argparse.Namespace) -> int:
    from . import ncclhook

    with ncclhook.ProfilerRing(args.path) as ring:
        events = ncclhook.events_to_dicts(ring.read())
        dropped = ring.dropped
    emit(args, {"events": events, "dropped": dropped}, "\n".join([str(e) for e in events] + [f"dropped={dropped}"]))
    return 0


def cmd_nccl_loopback(args: argparse.Namespace) -> int:
    from . import ncclhook

    if args.traffic_class is not None and not 0 <= args.traffic_class <= 7:
        raise InputError(f"--class must be 0..7, got {args.traffic_class}")
    if args.plan is not None:
        ncclhook.read_plan(args.plan)
    t = ncclhook.loopback_transfer(args.traffic_class, plan=args.plan)
    sockets = t["marks"]["sender"] + t["marks"]["receiver"]
    marks = sorted({(m["tos"] >> 2, m["prio"], m["pacing"]) for m in sockets})
    text = [f"ncclNetPlugin_v{t['version']}: {t['bytes']} of {t['expected_bytes']} bytes received intact over lo",
            f"{len(sockets)} sockets: " + "; ".join(f"DSCP {d}, SO_PRIORITY {p:#x}" + (f", pacing {r} B/s" if r < 2**63 else "")
                                                      for d, p, r in marks)]
    emit(args, t, "\n".join(text))
    return 0


def _load_model(spec: str, shape: str | None) -> tuple[Any, Any, Any]:
    import torch

    factory = load_callable(spec, where="--model")  # from the current directory too, as `python -m` imports
    model = factory()
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"{spec} returned {type(model).__name__}, expected a torch.nn.Module", where="--model")
    if not shape:
        raise InputError("give the batch shape of the model's input, e.g. 32,784", where="--input-shape")
    try:
        dims = tuple(int(x) for x in shape.split(","))
    except ValueError:
        raise InputError(f"expected comma-separated integers, got {shape!r}", where="--input-shape") from None
    gen = torch.Generator().manual_seed(0)
    return model, lambda: (torch.randn(*dims, generator=gen), None), lambda out, _y: out.float().pow(2).mean()


def cmd_profile(args: argparse.Namespace) -> int:
    from .demo import small_model
    from .gradients import measure_gradient_profile

    model, make_batch, loss = _load_model(args.model, args.input_shape) if args.model else small_model()
    progress(f"profiling {args.model or 'the built-in MLP'} ({args.iterations} iterations)")
    prof = measure_gradient_profile(model, make_batch, loss, bandwidth=args.bandwidth, overhead=args.overhead_us * 1e-6,
                                    iterations=args.iterations)
    prof.save(args.out)
    emit(args, prof.to_dict(), f"{prof.layers} layers, {prof.total_bytes / 1e6:.2f} MB of gradients, backward {prof.backward * 1e3:.2f} ms, "
                               f"forward {sum(prof.forward) * 1e3:.2f} ms -> {args.out}")
    return 0


def cmd_schedule(args: argparse.Namespace) -> int:
    from topology.io import atomic_write_text

    from .gradients import GradientProfile
    from .intrajob import ddp_plan, simulate_iteration, tune_bytescheduler, tune_prophet

    prof = GradientProfile.load(args.profile)
    if args.bandwidth is not None:
        prof = prof.with_bandwidth(args.bandwidth)
    plan = {"ddp": ddp_plan, "prophet": tune_prophet, "bytescheduler": tune_bytescheduler}[args.policy](prof)
    timing = simulate_iteration(prof, plan)
    bound = prof.lower_bound()
    if args.out:
        import json

        atomic_write_text(args.out, json.dumps(plan.to_dict(), indent=1) + "\n")
    data = {"policy": args.policy, "iteration_s": timing.iteration_time, "lower_bound_s": bound, "ratio": timing.iteration_time / bound,
            "launches": len(plan.transfers), "comm_end_s": timing.comm_end, "params": plan.params, "plan": plan.to_dict()}
    emit(args, data, f"{args.policy}: {len(plan.transfers)} launches, modelled iteration {timing.iteration_time * 1e3:.3f} ms, "
                     f"lower bound {bound * 1e3:.3f} ms ({timing.iteration_time / bound:.3f} x)")
    return 0


def _run_until(service: Any, done: Any, duration: float | None) -> None:
    deadline = None if duration is None else time.monotonic() + duration
    try:
        while (deadline is None or time.monotonic() < deadline) and not done():
            time.sleep(0.05)
    except KeyboardInterrupt:
        pass


def cmd_serve(args: argparse.Namespace) -> int:
    from .control import Scheduler, load_config
    from .plan import read_plan

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = load_config(args.config)
    plan = read_plan(args.plan)
    with Scheduler(config) as sched:
        sched.publish(plan)
        progress(f"scheduler on {config.scheduler_bind}: published epoch {plan.epoch} to {', '.join(plan.hosts)}")
        _run_until(sched, (lambda: all(sched.agents[h].epoch >= plan.epoch for h in plan.hosts)) if args.until_acked else (lambda: False),
                   args.duration)
        status = sched.status()
    acked = all(status["agents"][h]["epoch"] >= plan.epoch for h in plan.hosts)
    emit(args, status, f"epoch {plan.epoch}: " + ", ".join(f"{h} {'acked' if a['epoch'] >= plan.epoch else 'pending'}"
                                                          for h, a in status["agents"].items() if h in plan.hosts))
    return 0 if acked or not args.until_acked else 1


def cmd_agent(args: argparse.Namespace) -> int:
    from .control import Agent, load_config
    from .enforce import DryRunApplier, TcApplier, class_bytes

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = load_config(args.config)
    if args.host not in config.agents:
        raise InputError(f"host {args.host!r} is not in the configuration's agents", source=args.config, where="agents")
    ac = config.agents[args.host]
    dev = ac.dev or "eth0"
    applier = DryRunApplier(dev, ac.rate_mbit) if args.dry_run else TcApplier(dev, ac.rate_mbit, netns=ac.netns)
    meter = None if args.dry_run else (lambda: {str(p): v["sent_bytes"] for p, v in class_bytes(dev, netns=ac.netns).items()})
    state = None if args.dry_run else (args.state or ac.state)  # a dry run changes no kernel, so it must not record an epoch in force
    with Agent(args.host, config, applier, meter=meter, state_path=state) as agent:
        progress(f"agent {args.host} on {ac.bind}, scheduler {config.scheduler_bind}, epoch in force {agent.epoch}")
        in_force = lambda: agent.epoch >= 0 and bool(agent.applied or agent.verified)  # noqa: E731
        _run_until(agent, in_force if args.until_applied else (lambda: False), args.duration)
        data = {"host": args.host, "epoch": agent.epoch, "floor": agent.floor, "applied": agent.applied, "verified": agent.verified,
                "rejected": list(agent.rejected), "commands": applier.applied[-1][1] if applier.applied else []}
    emit(args, data, f"agent {args.host}: applied epochs {agent.applied or 'none'}, rejected {len(agent.rejected)} messages")
    return 0 if in_force() or not args.until_applied else 1
