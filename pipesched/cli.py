"""``netweave pipe``: profile, plan, simulate, export and run pipeline-parallel training plans."""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Any

from topology.clitools import add_json_flag, add_output, emit, progress, render_table
from topology.errors import InputError
from topology.units import parse_size

SOURCE_LABELS = {"interleaved": ("ranks' profile between steps", "error_interleaved"),
                 "replay": ("ranks' replay of their actions", "error_replay"),
                 "pre-run": ("ranks' pre-run profile", "error_pre_run"),
                 "pooled": ("pooled profiles", "error_pooled"),
                 "probe-scaled": ("probe-scaled", "error_probe_scaled")}
"""How ``pipe run`` names each of :data:`pipesched.calibrate.PREDICTION_SOURCES` and its error in the report."""


def register(sub: argparse._SubParsersAction) -> None:
    pipe = sub.add_parser("pipe", help="pipeline parallelism: profile, plan, simulate, export, run")
    psub = pipe.add_subparsers(dest="pipe_command", metavar="ACTION", required=True)

    p = psub.add_parser("profile", help="per-layer profile: analytic from a GPT/Llama config, or measured here (a real model, the MLP chain)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="GPT/Llama config (YAML or JSON): layers, hidden, heads, seq_len, vocab, ...; "
                                     "or package.module:factory, a function returning a torch model with example inputs (measured here)")
    src.add_argument("--mlp", help="measure the built-in MLP chain with these hidden widths, e.g. 256,256,2048")
    p.add_argument("--split", help="with a factory: submodule names that begin a segment, e.g. 'blocks.*,ln_f' (* matches one name "
                                   "component), or pipe_split for the model's pipe_split() calls (default: the factory's split, "
                                   "else pipe_split)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="with a factory: keyword argument for it (repeatable)")
    p.add_argument("--repeats", type=int, default=5, help="timed repetitions per segment for a factory's model (default 5)")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="with a factory: wall time, or the thread's CPU time")
    p.add_argument("--dim", type=int, default=128, help="model width of --mlp (default 128)")
    p.add_argument("--microbatch", type=int, default=32, help="rows per micro-batch for --mlp (default 32)")
    p.add_argument("--threads", type=int, default=1, help="torch threads while measuring (default 1)")
    add_output(p, "--out", help="write the profile JSON here")
    add_json_flag(p)
    p.set_defaults(func=cmd_profile)

    for name, helptext, func in (
        ("plan", "plan a pipeline: partition (DP + recompute), schedule, simulation, lower bound", cmd_plan),
        ("simulate", "simulate one schedule on a given (default: uniform) partition", cmd_simulate),
        ("export", "plan and write torch.distributed.pipelining CSV + stage layout", cmd_export),
    ):
        p = psub.add_parser(name, help=helptext)
        _add_model_args(p)
        if name == "simulate":
            p.add_argument("--spans", help="layer spans per stage, e.g. 0:5,5:9,9:14 (default: equal layer counts)")
        if name == "export":
            p.add_argument("--format", choices=["compute_only", "compute_comms"], default="compute_only",
                           help="torch's CSV: compute actions only (torch adds the sends and receives) or with them (default compute_only)")
            add_output(p, "--out", required=True, help="output directory (schedule.csv, stages.json, plan.json)", directory=True)
        else:
            add_output(p, "--out", help="write the plan/simulation JSON here")
            add_output(p, "--gantt", help="write a Gantt chart PNG here")
            add_output(p, "--trace", help="write a Chrome/Perfetto trace JSON here")
        add_json_flag(p)
        p.set_defaults(func=func)

    p = psub.add_parser("run", help="plan, run with real gloo processes on this CPU, compare with the prediction and a uniform split")
    p.add_argument("--mlp", default="128,128,128,128,128,128,128,128,1024,1024,1024,1024", help="hidden widths of the MLP chain (comma-separated)")
    p.add_argument("--dim", type=int, default=128, help="the chain's input and output width (default 128)")
    p.add_argument("--batch", type=int, default=256, help="rows per iteration, split into the micro-batches (default 256)")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per iteration (default 8)")
    p.add_argument("--stages", type=int, default=4, help="pipeline stages = processes (default 4)")
    p.add_argument("--schedule", default="auto", choices=["auto", "1f1b", "zbh1", "gpipe", "interleaved"],
                   help="our plan's schedule family (default auto); the baseline is always uniform + Schedule1F1B")
    p.add_argument("--iterations", type=int, default=3, help="timed iterations per run, after one warm-up (default 3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank process (default 1)")
    p.add_argument("--no-baseline", action="store_true", help="skip the uniform torch Schedule1F1B run")
    p.add_argument("--rounds", type=int, default=1, help="rounds of (ours, uniform) runs, alternating which goes first (default 1)")
    p.add_argument("--predict-from", default="replay", choices=list(SOURCE_LABELS),
                   help="what each run is predicted from: the ranks' replay of their own compute actions between its steps "
                        "(default), the profile passes they take between its steps, "
                        "the profile they take right before its first step, the median of the profiles taken so far, "
                        "or that rescaled by a CPU speed probe")
    p.add_argument("--replay", action="store_true",
                   help="with another --predict-from: still replay the ranks' actions before each timed step and record "
                        "that prediction too (the runs take about half as long again)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cpu: gloo processes on this CPU (default); cuda: NCCL, every rank on GPU 0 (see docs/pipesched.md)")
    p.add_argument("--sharing", choices=["mps", "time-slice"], default=None,
                   help="with --device cuda: how the ranks share the GPU (default: mps when CUDA_MPS_ACTIVE_THREAD_PERCENTAGE is set)")
    add_output(p, "--out", help="write the report JSON here")
    add_output(p, "--trace", help="write predicted and measured timelines into one Chrome trace")
    add_json_flag(p)
    p.set_defaults(func=cmd_run)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="GPT/Llama config (YAML or JSON)")
    src.add_argument("--profile", help="profile JSON (from `netweave pipe profile`)")
    p.add_argument("--topology", help="topology file (default: the built-in 4 x DGX H100 cluster)")
    p.add_argument("--gpus", help="comma-separated GPUs in pipeline order (default: the first --stages GPUs)")
    p.add_argument("--stages", type=int, required=True, help="pipeline depth (devices)")
    p.add_argument("--microbatches", type=int, required=True, help="micro-batches per iteration")
    p.add_argument("--memory", help="memory per device, e.g. 80GiB (default: each GPU's memory)")
    p.add_argument("--schedule", default="auto", help="auto, gpipe, 1f1b, zbh1, interleaved, interleaved_zb, looped_bfs, zbv, dualpipev, "
                                                      "chimera (default auto: the fastest that torch can run)")
    p.add_argument("--chunks", type=int, default=2, help="virtual stages per device for interleaved, interleaved_zb, looped_bfs (default 2)")
    p.add_argument("--recompute", default="none,selective,full",
                   help="recomputation options the planner may choose from, comma-separated (default none,selective,full)")
    p.add_argument("--replicate", type=int, default=1, help="allow PipeDream stage replication up to this many devices")


def _load(args: argparse.Namespace):
    import topology
    from topology.inputs import check_number
    from topology.limits import MAX_MICROBATCHES, MAX_STAGES

    from .devices import Device, devices_from_topology
    from .profile import analytic_profile, load_model_config, load_profile

    check_number(args.stages, what="a number of stages", where="--stages", integer=True, minimum=1, maximum=MAX_STAGES)
    check_number(args.microbatches, what="a number of micro-batches", where="--microbatches", integer=True, minimum=1, maximum=MAX_MICROBATCHES)
    check_number(args.chunks, what="a number of chunks", where="--chunks", integer=True, minimum=1, maximum=MAX_STAGES)
    check_number(args.replicate, what="a replication limit", where="--replicate", integer=True, minimum=1, maximum=MAX_STAGES)
    prof = analytic_profile(load_model_config(args.model)) if args.model else load_profile(args.profile)
    if args.stages > len(prof.layers):
        raise InputError(f"{args.stages} stages but the model has only {len(prof.layers)} layers (embedding, blocks, head)", where="--stages")
    if args.topology:
        from topology.io import read_topology

        topo = read_topology(args.topology)
    else:
        topo = topology.default_cluster()
    gpus = [g.strip() for g in args.gpus.split(",")] if getattr(args, "gpus", None) else None
    count = None if gpus else args.stages
    devices, links = devices_from_topology(topo, gpus=gpus, count=count, reference_tflops=prof.reference.get("tflops"))
    if len(devices) != args.stages:
        raise InputError(f"{len(devices)} GPUs given for {args.stages} stages", where="--gpus")
    if args.memory:
        mem = parse_size(args.memory, where="--memory", positive=True)
        devices = [Device(d.name, d.speed, mem) for d in devices]
    recompute = [o.strip() for o in args.recompute.split(",") if o.strip()]
    return prof, topo, devices, links, recompute


def _write_outputs(args: argparse.Namespace, result, title: str, data: dict[str, Any]) -> None:
    from topology.io import atomic_write_text

    from .simulate import gantt_png, write_chrome_trace

    if getattr(args, "out", None):
        atomic_write_text(args.out, json.dumps(data, indent=1, default=str) + "\n")
    if getattr(args, "gantt", None):
        gantt_png(result, args.gantt, title=title)
    if getattr(args, "trace", None):
        write_chrome_trace(args.trace, ("predicted", result))


def _factory_options(items: list[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` pairs, values read as YAML scalars (``3``, ``0.1``, ``true``, ``gelu``)."""
    import yaml

    options: dict[str, Any] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_]\w*", key.strip()):
            raise InputError(f"expected KEY=VALUE with KEY a Python name, got {item!r}", where="--set")
        try:
            options[key.strip()] = yaml.safe_load(value) if value.strip() else ""
        except yaml.YAMLError:
            options[key.strip()] = value
    return options


def _profile_factory(args: argparse.Namespace):
    from .model_profile import load_factory, profile_model

    if args.repeats < 1:
        raise InputError(f"expected at least 1 repetition, got {args.repeats}", where="--repeats")
    spec = load_factory(args.model, _factory_options(args.set))
    if args.split is None:
        split = spec.split
    elif args.split.strip() == "pipe_split":
        split = None
    else:
        split = args.split.split(",")
    progress(f"splitting {args.model} and measuring every segment on this CPU ...")
    return profile_model(spec.model, spec.args, spec.kwargs, split=split, loss_fn=spec.loss_fn, repeats=args.repeats,
                         threads=args.threads, clock=args.clock, name=args.model.rpartition(":")[2])


def cmd_profile(args: argparse.Namespace) -> int:
    from topology.io import atomic_write_text

    from .model_profile import FACTORY_RE
    from .profile import analytic_profile, dumps_profile, load_model_config

    if args.model and FACTORY_RE.fullmatch(args.model) and not Path(args.model).exists():
        prof = _profile_factory(args)
    elif args.split is not None or args.set:
        raise InputError("--split and --set need a model factory (--model package.module:function)", where="--split" if args.split else "--set")
    elif args.model:
        prof = analytic_profile(load_model_config(args.model))
    else:
        from .calibrate import profile_mlp

        try:
            widths = [int(x) for x in args.mlp.split(",")]
        except ValueError:
            raise InputError("expected comma-separated integers", where="--mlp") from None
        progress(f"measuring {len(widths)} layers on this CPU ...")
        prof = profile_mlp(widths, args.dim, args.microbatch, threads=args.threads)
    if args.out:
        atomic_write_text(args.out, dumps_profile(prof))
    mib = 2**20
    rows = [(lay.name, f"{lay.fwd_s * 1e3:.4g}", f"{lay.bwd_input_s * 1e3:.4g}", f"{lay.bwd_weight_s * 1e3:.4g}", f"{lay.output_bytes / mib:.3g}",
             f"{lay.param_bytes / mib:.4g}", "/".join(f"{lay.saved_bytes[k] / mib:.4g}" for k in ("none", "selective", "full")))
            for lay in prof.layers]
    lines = [f"profile {prof.name} ({prof.source}, micro-batch {prof.microbatch_size}): {len(prof.layers)} layers",
             render_table(["layer", "F ms>", "I ms>", "W ms>", "out MiB>", "param MiB>", "act none/sel/full MiB>"], rows)]
    for group in prof.reference.get("tied", []):
        lines.append(f"tied: {' = '.join(group['params'])} ({group['bytes'] / 2**20:.4g} MiB) held by layers "
                     f"{', '.join(str(k) for k in group['layers'])}, counted in each")
    emit(args, prof.to_dict(), "\n".join(lines))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from .plan import plan

    prof, _, devices, links, recompute = _load(args)
    p = plan(prof, devices, links, microbatches=args.microbatches, schedule=args.schedule, chunks=args.chunks, recompute=recompute,
             max_replicas=args.replicate)
    data = p.to_dict()
    _write_outputs(args, p.sim, f"{prof.name}: {p.family}, predicted {p.sim.makespan * 1e3:.4g} ms, bound {p.bound['bound_s'] * 1e3:.4g} ms", data)
    emit(args, data, p.text())
    return 0


def _parse_spans(text: str, n: int) -> list[tuple[int, int]]:
    spans = []
    for k, part in enumerate(text.split(",")):
        m = re.fullmatch(r"\s*(\d+):(\d+)\s*", part)
        if not m or int(m.group(1)) >= int(m.group(2)):
            raise InputError(f"span {k} {part!r}: expected START:END with START < END", where="--spans")
        spans.append((int(m.group(1)), int(m.group(2))))
    if spans[0][0] != 0 or spans[-1][1] != n or any(a[1] != b[0] for a, b in zip(spans, spans[1:], strict=False)):
        raise InputError(f"spans must be contiguous and cover layers 0..{n - 1}", where="--spans")
    return spans


def cmd_simulate(args: argparse.Namespace) -> int:
    from .partition import FAMILIES, evaluate_partition, positions_on_devices, uniform_partition
    from .plan import plan_partition
    from .schedules import LOOPED

    prof, _, devices, links, recompute = _load(args)
    family = "1f1b" if args.schedule == "auto" else args.schedule
    if family not in FAMILIES:
        raise InputError(f"unknown schedule {family!r}, expected one of {list(FAMILIES)}", where="--schedule")
    chunks = args.chunks if family in LOOPED else 1
    positions = len(positions_on_devices(family, len(devices), chunks))
    spans = _parse_spans(args.spans, len(prof.layers)) if args.spans else uniform_partition(prof, positions)
    if len(spans) != positions:
        raise InputError(f"{len(spans)} spans for {positions} stage positions", where="--spans")
    part = evaluate_partition(prof, spans, devices, links, microbatches=args.microbatches, family=family, chunks=chunks, options=recompute)
    if any(math.isinf(s.time_s) for s in part.stages):
        bad = [k for k, s in enumerate(part.stages) if math.isinf(s.time_s)]
        raise InputError(f"stages {bad} do not fit in device memory with recomputation {recompute}", where="--spans")
    p = plan_partition(prof, part, devices, links, family=family, microbatches=args.microbatches, chunks=chunks)
    data = p.to_dict()
    _write_outputs(args, p.sim, f"{prof.name}: {family} (given spans)", data)
    emit(args, data, p.text())
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from topology.io import atomic_write_text

    from .export import export_plan
    from .plan import plan

    prof, _, devices, links, recompute = _load(args)
    # The same plan as `pipe plan` with these arguments (auto ranks only what torch can run).
    p = plan(prof, devices, links, microbatches=args.microbatches, schedule=args.schedule, chunks=args.chunks, recompute=recompute)
    if p.export_problem:
        raise InputError(f"the {p.family} plan cannot be exported: {p.export_problem}", where="--schedule")
    info = export_plan(p.schedule, p.partition, args.out, format=args.format, layer_names=[lay.name for lay in prof.layers])
    out = Path(args.out)
    atomic_write_text(out / "plan.json", json.dumps(p.to_dict(), indent=1, default=str) + "\n")
    files = [str(out / "schedule.csv"), str(out / "stages.json"), str(out / "plan.json")]
    if not args.json:  # stdout is the written paths, one per line (for scripts); what they hold goes to stderr
        progress(f"{p.family} plan for {prof.name}: predicted {p.sim.makespan * 1e3:.4g} ms; {args.format} CSV, load with: {info['torch_loader']}")
    emit(args, {**info, "files": files}, "\n".join(files))
    return 0


def _run_on_gpu(args: argparse.Namespace, widths: list[int]) -> int:
    import os

    import torch

    from .calibrate import gpu_validation

    if not torch.cuda.is_available():
        raise InputError("no CUDA GPU is visible to torch on this machine", where="--device")
    sharing = args.sharing or ("mps" if os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") else "time-slice")
    progress(f"profiling on the GPU, planning and running {args.stages} NCCL processes on GPU 0 ({sharing}) ...")
    rep = gpu_validation(widths, dim=args.dim, batch=args.batch, microbatches=args.microbatches, stages=args.stages,
                         iterations=args.iterations, rounds=args.rounds, schedule=args.schedule, sharing=sharing)
    if args.out:
        from topology.io import atomic_write_text

        atomic_write_text(args.out, json.dumps(rep, indent=1, default=str) + "\n")
    lines = [f"{rep['device']}, NCCL {rep['nccl']}, ranks sharing the GPU by {sharing}; plan: {rep['plan']['schedule']}, "
             f"spans {rep['plan']['spans']}"]
    for rnd in rep["rounds"]:
        for arm in rnd["order"]:
            c = rnd[arm]
            lines.append(f"round {rnd['round']} {arm}: predicted {c['predicted_s'] * 1e3:.4g} ms, measured {c['measured_s'] * 1e3:.4g} ms "
                         f"(error {c['error']:+.1%}), per-action error {c['per_action_mape']:.1%} mean abs")
    lines.append(f"ours vs uniform + torch 1F1B: {rep['summary']['speedup_median']:.3f}x measured (median of rounds)")
    emit(args, rep, "\n".join(lines))
    return 0


def _ms_list(seconds: list[float]) -> str:
    return "[" + ", ".join(f"{x * 1e3:.1f}" for x in seconds) + "] ms"


def cmd_run(args: argparse.Namespace) -> int:
    from .calibrate import cpu_validation
    from .runner import measured_timeline
    from .simulate import write_chrome_trace

    try:
        widths = [int(x) for x in args.mlp.split(",")]
    except ValueError:
        raise InputError("expected comma-separated integers", where="--mlp") from None
    if args.batch % args.microbatches:
        raise InputError(f"batch {args.batch} is not divisible into {args.microbatches} micro-batches", where="--batch")
    if args.stages > len(widths):
        raise InputError(f"{args.stages} stages but the model has only {len(widths)} layers", where="--stages")
    if args.rounds < 1:
        raise InputError(f"expected at least 1 round, got {args.rounds}", where="--rounds")
    if args.device == "cuda":
        return _run_on_gpu(args, widths)
    progress(f"profiling, planning and running {args.stages} gloo processes ...")
    rep = cpu_validation(widths, dim=args.dim, batch=args.batch, microbatches=args.microbatches, stages=args.stages, threads=args.threads,
                         iterations=args.iterations, schedule=args.schedule, baseline=not args.no_baseline, rounds=args.rounds,
                         predict_from=args.predict_from, replay=args.replay or args.predict_from == "replay")
    plan_obj, run = rep.pop("_plan"), rep.pop("_run")
    if args.trace:
        write_chrome_trace(args.trace, ("predicted", plan_obj.sim), ("measured", measured_timeline(run, args.stages)))
    if args.out:
        from topology.io import atomic_write_text

        atomic_write_text(args.out, json.dumps(rep, indent=1, default=str) + "\n")
    o = rep["ours"]
    lines = [f"plan: {o['schedule']}, spans {rep['plan']['spans']}",
             f"ours: predicted {o['predicted_s'] * 1e3:.4g} ms (from the {SOURCE_LABELS[args.predict_from][0]}), "
             f"measured {o['measured_s'] * 1e3:.4g} ms (error {o['error']:+.1%}), per-action error {o['per_action_mape']:.1%} mean abs",
             "other predictions: " + ", ".join(f"{label} {o[key]:+.1%}" for source, (label, key) in SOURCE_LABELS.items()
                                                 if source != args.predict_from and o[key] is not None)
             + f" (CPU speed probe x{o['probe_scale']:.3f} since the profiles)",
             f"CPU work: modelled {sum(o['rank_work_predicted_s']) * 1e3:.4g} ms, measured {sum(o['rank_cpu_measured_s']) * 1e3:.4g} ms "
             f"(all ranks); CPU share calibrated {rep['shared_cpu']['cores']:.2f} cores at sharing efficiency "
             f"{rep['shared_cpu']['efficiency']:.2f} (ideal sharing: {o['error_ideal_sharing']:+.1%}), "
             f"other users took {o['foreign_cores']:.2f} during the run",
             f"diagnostic (uses the run): the plan simulated on its actions' measured CPU times {o['run_costs_error']:+.1%}",
             "message waits per rank and step: measured " + _ms_list(o["rank_wait_measured_s"])
             + ", simulated idle " + _ms_list(o["rank_idle_predicted_s"])]
    if "uniform_torch_1f1b" in rep:
        u = rep["uniform_torch_1f1b"]
        hs = rep["runtime_calibration"].get("handshake_s")
        lines.append(f"uniform + torch Schedule1F1B: predicted {u['predicted_s'] * 1e3:.4g} ms, measured {u['measured_s'] * 1e3:.4g} ms "
                     f"(error {u['error']:+.1%}; simulated with Schedule1F1B's message posting"
                     + (f", late-receive handshake {hs * 1e3:.2f} ms" if hs is not None else "")
                     + f"; every receive posted in advance: {u['error_ideal_posting']:+.1%})")
        lines.append(f"measured speed-up {rep['speedup_measured']:.2f}x (predicted {rep['speedup_predicted']:.2f}x)")
    if args.rounds > 1:
        summ = rep["summary"]
        lines.append(f"{args.rounds} rounds: {summ['within']} of {summ['runs']} predictions within 10 %; errors "
                     + "; ".join(f"{arm}: " + ", ".join(f"{e:+.1%}" for e in summ[arm]["errors"]) for arm in ("ours", "uniform_torch_1f1b")
                                 if arm in summ)
                     + ("; speed-up per round " + ", ".join(f"{x:.2f}x" for x in summ["speedups"]) if "speedups" in summ else ""))
    emit(args, rep, "\n".join(lines))
    return 0
