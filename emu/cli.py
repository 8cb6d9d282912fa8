"""``netweave emu``: run a workload on the simulator or the Mininet emulator, compare them, sweep parameters.

Actions
    ``run WORKLOAD [--topology FILE] [--backend sim|mininet|ns3] [--time-scale K] --out DIR``
        writes ``DIR/result.json`` and ``DIR/timeline.png`` and prints the per-job table;
    ``compare WORKLOAD [--topology FILE] [--time-scale K] --out DIR``
        runs both backends and prints the agreement table (per-job iteration-time error, MAPE);
    ``example --out FILE``
        writes an example workload (YAML, or JSON for ``.json``);
    ``sweep WORKLOAD [--topology FILE] --set FIELD=V1,V2,... [--executor local|ray] [--address HOST:PORT] --out DIR``
        simulates every combination of the values, locally or as Ray tasks (see :mod:`emu.sweep`).

``--topology`` defaults to ``topology.default_cluster()``. Every action takes ``--json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from topology.clitools import CommaSettings, add_json_flag, add_output, emit, progress
from topology.errors import InputError

from .results import RunResult, compare_results, format_comparison


def register(sub: argparse._SubParsersAction) -> None:
    emu = sub.add_parser("emu", help="validation substrate: flow-level simulator and Mininet emulator for workloads")
    esub = emu.add_subparsers(dest="emu_command", metavar="ACTION", required=True)

    p = esub.add_parser("run", help="run a workload on one backend; writes result.json and timeline.png")
    _common(p)
    p.add_argument("--backend", choices=["sim", "mininet", "ns3"], default="sim",
                   help="flow-level simulator, Mininet emulator, or ns-3 packet-level simulation (pip install 'netweave[ns3]')")
    p.add_argument("--ns3-tcp", default="TcpCubic", metavar="VARIANT", help="ns3: TCP congestion control (TcpCubic, TcpNewReno, TcpDctcp, ...)")
    p.add_argument("--ns3-queue", type=int, default=1000, metavar="PACKETS", help="ns3: packets per priority band of every port (default 1000)")
    p.add_argument("--ns3-min-rto-ms", type=float, default=5.0, metavar="MS", help="ns3: TCP's minimum retransmission timeout (default 5 ms)")
    p.add_argument("--time-scale", type=float, default=1000.0, metavar="K",
                   help="emulation time dilation: bandwidths / K, durations x K (mininet only; default 1000)")
    p.add_argument("--byte-scale", type=float, default=1.0, metavar="M", help="emulation: divide every flow's bytes by M (mininet only)")
    p.set_defaults(func=cmd_run)

    p = esub.add_parser("compare", help="run the simulator and the emulator and print their agreement")
    _common(p)
    p.add_argument("--time-scale", type=float, default=1000.0, metavar="K")
    p.add_argument("--byte-scale", type=float, default=1.0, metavar="M")
    p.set_defaults(func=cmd_compare)

    p = esub.add_parser("example", help="write an example workload file")
    add_output(p, "--out", required=True, help="output file (.yaml/.yml, or .json)")
    p.add_argument("--topology", default=None, help="take GPU ids from this topology file (default: the default cluster)")
    add_json_flag(p)
    p.set_defaults(func=cmd_example)

    p = esub.add_parser("sweep", help="simulate every combination of parameter values")
    p.add_argument("workload")
    p.add_argument("--topology", default=None)
    p.add_argument("--set", action=CommaSettings, default=[], metavar="FIELD=V1,V2", required=True,
                   help="a sweep axis, e.g. jobs.dp-b.start_offset=0,0.001,0.002 or config.sharing=strict,weighted (repeatable)")
    p.add_argument("--executor", choices=["auto", "local", "ray"], default="auto",
                   help="local process pool, or Ray tasks (auto: Ray when --address or $RAY_ADDRESS names a cluster, else local)")
    p.add_argument("--address", default=None, metavar="HOST:PORT",
                   help="a Ray cluster's head (as 'ray start --head' prints it); without it --executor ray starts Ray on this machine")
    p.add_argument("--workers", type=int, default=None, help="processes (local) or CPUs of a Ray instance started here")
    add_output(p, "--out", default=None, help="write sweep.json into this directory", directory=True)
    add_json_flag(p)
    p.set_defaults(func=cmd_sweep)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("workload", help="workload file (YAML or JSON, see docs/workload.md)")
    p.add_argument("--topology", default=None, help="topology file (default: the embedded default cluster)")
    add_output(p, "--out", required=True, help="output directory", directory=True)
    p.add_argument("--routing", choices=["shortest", "ecmp", "rail"], default="ecmp", help="simulator: default routing policy")
    p.add_argument("--sharing", choices=["strict", "weighted"], default="strict", help="simulator: how priority classes share links")
    p.add_argument("--no-flows", action="store_true", help="do not keep a record per flow (large runs)")
    add_json_flag(p)


def load_inputs(workload_path: str, topology_path: str | None) -> tuple[Any, Any]:
    """The topology (file or default cluster) and the workload, checked against each other."""
    from topology import default_cluster
    from topology.io import read_topology

    from .workload import read_workload

    topo = read_topology(topology_path) if topology_path else default_cluster()
    workload = read_workload(workload_path)
    workload.validate(topo, source=workload_path)
    return topo, workload


def _simulate(topo: Any, workload: Any, args: argparse.Namespace) -> RunResult:
    from .sim import simulate

    return simulate(topo, workload, routing=args.routing, sharing=args.sharing, record_flows=not args.no_flows)


def mininet_runner() -> Any:
    """``emu.mininet_backend.run_mininet``, imported on demand; a one-line error when it is missing."""
    try:
        from .mininet_backend import run_mininet
    except ModuleNotFoundError as exc:
        if exc.name in ("emu.mininet_backend", "mininet"):
            raise InputError("the Mininet backend is not available here (emu.mininet_backend or the mininet package is missing); "
                             "use --backend sim, or install Mininet (Debian package 'mininet')") from None
        raise
    return run_mininet


def _mininet(topo: Any, workload: Any, args: argparse.Namespace, out: Path) -> RunResult:
    run_mininet = mininet_runner()
    if not args.time_scale > 0:
        raise InputError(f"--time-scale must be positive, got {args.time_scale!r}")
    try:
        return run_mininet(topo, workload, time_scale=args.time_scale, out_dir=out, byte_scale=args.byte_scale)
    except (RuntimeError, OSError) as exc:  # EmulationError / FidelityError: say why in one line
        raise InputError(f"emulation failed: {exc}") from None


def _ns3_options(args: argparse.Namespace) -> Any:
    """The ns-3 backend's options, checked (before anything runs), and the package found."""
    import importlib.util

    from .ns3_backend import Ns3Error, Ns3Options, check_options

    options = Ns3Options(tcp=args.ns3_tcp, routing=args.routing, queue_packets=args.ns3_queue, min_rto_ms=args.ns3_min_rto_ms)
    check_options(options)
    if importlib.util.find_spec("ns") is None:
        raise Ns3Error("the ns-3 backend needs the 'ns3' package (pip install 'netweave[ns3]', ns3==3.44.post0); use --backend sim")
    return options


def _ns3(topo: Any, workload: Any, options: Any) -> RunResult:
    from .ns3_backend import import_ns3, run_ns3

    progress("emu: loading ns-3 (its C++ headers are parsed at import: tens of seconds)")
    import_ns3()
    return run_ns3(topo, workload, options)


def _write(result: RunResult, out: Path, stem: str) -> dict[str, str]:
    from .plots import plot_timeline

    files = {"result": str(result.write(out / f"{stem}.json"))}
    files["timeline"] = str(plot_timeline(result, out / f"{stem}-timeline.png" if stem != "result" else out / "timeline.png"))
    return files


def _job_lines(result: RunResult) -> list[str]:
    lines = [f"{'job':<16} {'iterations':>10} {'mean iter (ms)':>15} {'JCT (ms)':>12} {'finish (ms)':>12}"]
    for row in result.job_table():
        lines.append(f"{row['job']:<16} {row['iterations']:>10} {row['mean_iteration_s'] * 1e3:>15.4f} {row['jct_s'] * 1e3:>12.4f}"
                     f" {row['finish_s'] * 1e3:>12.4f}")
    return lines


def check_scales(args: argparse.Namespace) -> None:
    """``--time-scale`` and ``--byte-scale``: finite and positive (``nan`` and ``inf`` parse as floats)."""
    from topology.inputs import check_number

    check_number(args.time_scale, what="a time scale", where="--time-scale", positive=True, maximum=1e9)
    check_number(args.byte_scale, what="a byte scale", where="--byte-scale", positive=True, maximum=1e12)


def cmd_run(args: argparse.Namespace) -> int:
    check_scales(args)
    topo, workload = load_inputs(args.workload, args.topology)
    ns3_options = _ns3_options(args) if args.backend == "ns3" else None
    out = Path(args.out)
    progress(f"emu: running {workload.name!r} ({len(workload.jobs)} jobs) on {topo.name!r} with the {args.backend} backend")
    if args.backend == "sim":
        result = _simulate(topo, workload, args)
    elif args.backend == "ns3":
        result = _ns3(topo, workload, ns3_options)
    else:
        result = _mininet(topo, workload, args, out)
    files = _write(result, out, "result")
    text = "\n".join([f"{result.backend}: {workload.name} on {topo.name}, makespan {result.makespan * 1e3:.4f} ms", *_job_lines(result),
                      f"wrote {files['result']} and {files['timeline']}"])
    emit(args, {**result.summary(), "files": files}, text)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from .plots import plot_comparison

    check_scales(args)
    topo, workload = load_inputs(args.workload, args.topology)
    mininet_runner()  # fail before simulating when the emulator cannot run
    out = Path(args.out)
    progress("emu: simulating")
    sim = _simulate(topo, workload, args)
    progress(f"emu: emulating with Mininet (time scale {args.time_scale:g})")
    emu = _mininet(topo, workload, args, out / "mininet")
    files = {**{f"sim_{k}": v for k, v in _write(sim, out, "sim").items()}, **{f"mininet_{k}": v for k, v in _write(emu, out, "mininet").items()}}
    cmp = compare_results(sim, emu)
    files["comparison"] = str(out / "comparison.json")
    from topology.io import atomic_write_text

    atomic_write_text(out / "comparison.json", json.dumps(cmp, indent=1) + "\n")
    files["comparison_png"] = str(plot_comparison([sim, emu], out / "comparison.png"))
    emit(args, {**cmp, "files": files}, format_comparison(cmp))
    return 0


def cmd_example(args: argparse.Namespace) -> int:
    from topology.io import read_topology

    from .workload import example_workload, write_workload

    topo = read_topology(args.topology) if args.topology else None
    workload = example_workload(topo)
    write_workload(workload, args.out)
    names = ", ".join(j.name for j in workload.jobs)
    emit(args, {"file": args.out, "workload": workload.to_dict()}, f"wrote {args.out}: {len(workload.jobs)} jobs ({names})")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from .sweep import RayExecutor, eta_progress, format_sweep, get_executor, parse_axes, sweep

    topo, workload = load_inputs(args.workload, args.topology)
    axes = parse_axes(args.set)
    executor = get_executor(args.executor, max_workers=args.workers, address=args.address)
    if isinstance(executor, RayExecutor):
        executor.check()
    where = f" at {executor.address}" if getattr(executor, "address", None) else ""
    progress(f"emu: sweeping {' x '.join(f'{k} ({len(v)})' for k, v in axes.items())} on the {executor.name} executor{where}")
    table = sweep(topo, workload, axes, executor=executor, progress=eta_progress("emu: sweep"))
    if args.out:
        from topology.io import atomic_write_text

        atomic_write_text(Path(args.out) / "sweep.json", json.dumps(table, indent=1, default=str) + "\n")
    emit(args, table, format_sweep(table))
    return 0
