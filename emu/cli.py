"""``netweave emu``: run a workload on the simulator or the Mininet emulator, compare them, sweep parameters.

Actions
    ``run WORKLOAD [--topology FILE] [--backend sim|mininet|ns3] [--time-scale K] [--byte-scale auto|M] [--out DIR]``
        writes ``DIR/result.json`` and ``DIR/timeline.png`` and prints the per-job table;
    ``compare WORKLOAD [--topology FILE] [--time-scale K] [--byte-scale auto|M] [--out DIR]``
        runs both backends and prints the agreement table (per-job iteration-time error, MAPE);
    ``example --out FILE``
        writes an example workload (YAML, or JSON for ``.json``);
    ``sweep WORKLOAD [--topology FILE] --set FIELD=V1,V2,... [--executor local|ray] [--address HOST:PORT] --out DIR``
        simulates every combination of the values, locally or as Ray tasks (see :mod:`emu.sweep`).

``--topology`` defaults to ``topology.default_cluster()``. Every action takes ``--json``. Without ``--out``,
``run`` and ``compare`` write into ``emu-<action>-<workload>-<UTC time>/`` in the current directory (said on stderr).

A Mininet run (``compare``, ``run --backend mininet``) keeps its work: the simulator's result is written first
(``sim.json``), then the byte scale is chosen (``byte-scale.json``, :mod:`emu.scale`) and the expected duration
said, and the emulation's result is written with its fidelity verdict whatever happens (``meta.verdict``; the
iterations that finished when it stops early). Exit status of these two actions:

    0   the emulation finished and passed every fidelity check;
    2   bad input (a file, a flag, or the emulator is not installed), before anything ran;
    3   the emulation finished but failed a fidelity check: every result is written, with the verdict;
    4   the emulation failed or stopped before the end (an error, a check that could no longer pass, the timeout):
        the simulator's result and the iterations that finished are written;
    130 interrupted (Ctrl-C, SIGTERM): likewise kept.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from topology.clitools import CommaSettings, add_json_flag, add_output, emit, progress, render_table
from topology.errors import InputError
from topology.units import flag_action

from .results import RunResult, compare_results, format_comparison
from .scale import parse_byte_scale


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
    _scales(p)
    p.set_defaults(func=cmd_run)

    p = esub.add_parser("compare", help="run the simulator and the emulator and print their agreement (exit 3: fidelity failed, results kept)")
    _common(p)
    _scales(p)
    p.set_defaults(func=cmd_compare)

    p = esub.add_parser("example", help="write an example workload file")
    add_output(p, "--out", required=True, help="output file (.yaml/.yml, or .json)")
    p.add_argument("--topology", default=None, help="take GPU ids from this topology file (default: the default cluster)")
    add_json_flag(p)
    p.set_defaults(func=cmd_example)

    p = esub.add_parser("sweep", help="simulate every combination of parameter values")
    p.add_argument("workload", help="workload file (YAML or JSON, see docs/workload.md)")
    p.add_argument("--topology", default=None, help="topology file (default: the embedded default cluster)")
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
    add_output(p, "--out", default=None, directory=True,
               help="output directory (default: emu-<action>-<workload>-<UTC time>/ in the current directory)")
    p.add_argument("--routing", choices=["shortest", "ecmp", "rail"], default="ecmp", help="simulator: default routing policy")
    p.add_argument("--sharing", choices=["strict", "weighted"], default="strict", help="simulator: how priority classes share links")
    p.add_argument("--no-flows", action="store_true", help="do not keep a record per flow (large runs)")
    add_json_flag(p)


def _scales(p: argparse.ArgumentParser) -> None:
    p.add_argument("--time-scale", type=float, default=1000.0, metavar="K",
                   help="mininet: the emulation runs K times slower than the real fabric: durations x K (default 1000)")
    p.add_argument("--byte-scale", action=flag_action(parse_byte_scale), default="auto", metavar="auto|M",
                   help="mininet: divide every flow's bytes and every link's emulated rate by M (>= 1), so the CPU moves M times fewer "
                        "packets in the same time; auto (default): the smallest M at which a short calibration says the CPU is not the "
                        "bottleneck")


def output_dir(args: argparse.Namespace, action: str) -> Path:
    """``--out``, or ``emu-<action>-<workload stem>-<UTC time>`` in the current directory (said on stderr, checked)."""
    from topology.inputs import check_output

    if args.out is not None:
        return Path(args.out)
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(args.workload).stem).strip("._")[:40] or "workload"
    out = Path(f"emu-{action}-{stem}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")
    check_output(str(out), directory=True)
    progress(f"emu: no --out given: writing into {out}/")
    return out


def load_inputs(workload_path: str, topology_path: str | None) -> tuple[Any, Any]:
    """The topology (file or default cluster) and the workload, checked against each other."""
    from topology import default_cluster
    from topology.io import read_topology

    from .workload import read_workload

    topo = read_topology(topology_path) if topology_path else default_cluster()
    workload = read_workload(workload_path)
    workload.validate(topo, source=workload_path)
    return topo, workload


def _simulate(topo: Any, workload: Any, args: argparse.Namespace, *, record_flows: bool | None = None) -> RunResult:
    from .sim import simulate

    return simulate(topo, workload, routing=args.routing, sharing=args.sharing,
                    record_flows=not args.no_flows if record_flows is None else record_flows)


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


class EmulationStopped(Exception):
    """The emulation failed or stopped before its end (exit 4); what finished is kept."""


def _check_scales_fit(topo: Any, workload: Any, args: argparse.Namespace) -> tuple[list[str] | None, tuple[float, float]]:
    """The emulated servers and the link dilations that fit Mininet; an InputError (before anything runs) when the scales cannot fit."""
    from .mininet_backend import workload_hosts
    from .scale import choose_byte_scale, given_byte_scale, link_scale_bounds

    hosts = workload_hosts(topo, workload)
    bounds = link_scale_bounds(topo, hosts)
    if args.byte_scale == "auto":
        choose_byte_scale(0.0, time_scale=args.time_scale, calibration=None, bounds=bounds)
    else:
        given_byte_scale(args.byte_scale, time_scale=args.time_scale, bounds=bounds)
    return hosts, bounds


def _choose_scale(topo: Any, hosts: list[str] | None, bounds: tuple[float, float], args: argparse.Namespace, sim: RunResult,
                  peak: float) -> tuple[Any, dict[str, Any]]:
    """The byte scale (calibrated for ``auto``) and the run's time estimate.

    ``peak`` is the workload's peak network rate in GB/s (:func:`emu.scale.peak_network_rate` of the simulation).
    """
    from .scale import choose_byte_scale, given_byte_scale, measure_cpu_cost, run_estimate

    K = args.time_scale
    if args.byte_scale != "auto":
        return given_byte_scale(args.byte_scale, time_scale=K, bounds=bounds, peak_gbs=peak), run_estimate(sim.makespan, time_scale=K)
    choice = choose_byte_scale(peak, time_scale=K, calibration=None, bounds=bounds)  # the smallest that fits
    if peak <= 0:
        return choice, run_estimate(sim.makespan, time_scale=K)
    progress(f"emu: calibrating the CPU cost of emulated traffic at byte scale {choice.byte_scale:g} (a few seconds)")
    calibration = measure_cpu_cost(topo, hosts, link_scale=choice.link_scale)
    choice = choose_byte_scale(peak, time_scale=K, calibration=calibration, bounds=bounds)
    return choice, run_estimate(sim.makespan, time_scale=K, setup_s=calibration.setup_s)


def _emulate(topo: Any, workload: Any, args: argparse.Namespace, out: Path, stem: str) -> tuple[RunResult, RunResult, dict[str, str]]:
    """Simulate (kept first), choose the byte scale, say how long it takes, emulate with progress; the results and files written.

    Raises :class:`EmulationStopped` when the emulation fails or stops early, after saying what was kept.
    """
    from topology.io import atomic_write_text

    from .mininet_backend import fidelity_verdict
    from .scale import peak_network_rate
    from .sweep import eta_progress

    run_mininet = mininet_runner()  # fail before simulating when the emulator cannot run
    hosts, bounds = _check_scales_fit(topo, workload, args)
    sim = _simulate(topo, workload, args, record_flows=True)  # the flows give the peak network rate
    peak = peak_network_rate(sim, topo)
    if args.no_flows:
        sim.flows = []
    out.mkdir(parents=True, exist_ok=True)
    files = {f"sim_{k}": v for k, v in _write(sim, out, "sim").items()}
    progress(f"emu: simulated makespan {sim.makespan * 1e3:.4g} ms; kept in {files['sim_result']}")
    try:
        choice, estimate = _choose_scale(topo, hosts, bounds, args, sim, peak)
    except (RuntimeError, OSError) as exc:  # the calibration's network failed (EmulationError) or had no agents
        raise EmulationStopped(f"calibration failed: {exc}", files) from None
    atomic_write_text(out / "byte-scale.json", json.dumps({**choice.to_dict(), "estimate": estimate}, indent=1) + "\n")
    files["byte_scale"] = str(out / "byte-scale.json")
    progress(f"emu: byte scale {choice.byte_scale:g} (links at 1/{choice.link_scale:g} of the fabric's rates): {choice.reason}")
    progress(f"emu: this will take about {estimate['total_s']:.0f} s: {estimate['traffic_s']:.1f} s of emulated workload (simulated makespan "
             f"x time scale {args.time_scale:g}), {estimate['setup_s']:.1f} s {'measured ' if estimate['setup_measured'] else ''}setup, "
             f"{estimate['checks_s']:.1f} s of fidelity checks")
    meta = {"byte_scale_choice": choice.to_dict(), "estimate": estimate}
    result_file = f"{stem}.json"
    try:
        emu = run_mininet(topo, workload, time_scale=choice.link_scale, byte_scale=choice.byte_scale, out_dir=out, result_file=result_file,
                          raise_on_fidelity=False, progress=eta_progress("emu: mininet: phase instances"), meta=meta)
    except KeyboardInterrupt:
        progress(f"emu: interrupted; kept {_kept(out)}")
        raise
    except (RuntimeError, OSError) as exc:  # EmulationError / FidelityError (stopped early) / the system
        raise EmulationStopped(f"emulation failed: {exc}", files) from None
    emu.meta["verdict"] = fidelity_verdict(emu.meta.get("fidelity") or {})
    files[f"{stem}_result"] = str(emu.write(out / result_file))
    files[f"{stem}_timeline"] = str(_plot(emu, out / ("timeline.png" if stem == "result" else f"{stem}-timeline.png")))
    files["fidelity"] = str(out / "fidelity.json")
    return sim, emu, files


def _kept(out: Path) -> str:
    names = [p.name for p in sorted(out.glob("*.json"))] if out.is_dir() else []
    return f"{', '.join(names)} in {out}/" if names else f"nothing in {out}/"


def _verdict_line(verdict: dict[str, Any], estimate_s: float | None) -> str:
    """The verdict in one line: ok or the failed checks with their problems, and the figures behind them.

    >>> line = _verdict_line({"ok": True, "failed": [], "problems": [], "cpu_busy_mean": 0.41, "cpu_limit": 0.95, "calibration_error_before": -0.012,
    ...                       "calibration_error_after": 0.003, "wall_s": 30.2, "lock_wait_s": 10.0}, 18.0)
    >>> print(line.replace("; ", ";\\n"))
    fidelity: ok (CPU busy 41% on average (limit 95%);
    calibration flow -1.2% / +0.3%;
    took 20 s (estimated 18 s) after waiting 10 s for another emulation)
    """
    figures = []
    if verdict.get("cpu_busy_mean") is not None and "cpu" not in verdict["failed"]:
        figures.append(f"CPU busy {verdict['cpu_busy_mean']:.0%} on average (limit {verdict['cpu_limit']:.0%})")
    errors = [verdict.get(f"calibration_error_{k}") for k in ("before", "after")]
    if any(e is not None for e in errors):
        figures.append("calibration flow " + " / ".join(f"{e:+.1%}" if e is not None else "-" for e in errors))
    if verdict.get("wall_s") is not None:
        wait = verdict.get("lock_wait_s") or 0.0
        figures.append(f"took {verdict['wall_s'] - wait:.0f} s" + (f" (estimated {estimate_s:.0f} s)" if estimate_s is not None else "")
                       + (f" after waiting {wait:.0f} s for another emulation" if wait >= 1 else ""))
    if verdict["ok"]:
        return f"fidelity: ok ({'; '.join(figures)})"
    return (f"fidelity: FAILED ({', '.join(verdict['failed']) or 'see problems'}): {'; '.join(verdict['problems'] + figures)}. "
            "The results are kept, but the emulation was not faithful: do not trust its times")


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
    files = {"result": str(result.write(out / f"{stem}.json"))}
    files["timeline"] = str(_plot(result, out / f"{stem}-timeline.png" if stem != "result" else out / "timeline.png"))
    return files


def _plot(result: RunResult, path: Path) -> Path:
    from .plots import plot_timeline

    return plot_timeline(result, path)


def _job_lines(result: RunResult) -> list[str]:
    def ms(seconds: float | None) -> str:   # a job of a partial run may have no finished iteration
        return "-" if seconds is None or seconds != seconds else f"{seconds * 1e3:.4f}"

    rows = [(r["job"], r["iterations"], ms(r["mean_iteration_s"]), ms(r["jct_s"]), ms(r["finish_s"])) for r in result.job_table()]
    return [render_table(["job", "iterations>", "mean iteration ms>", "JCT ms>", "finish ms>"], rows)]


def check_scales(args: argparse.Namespace) -> None:
    """``--time-scale``: finite and positive (``nan`` and ``inf`` parse as floats); ``--byte-scale`` is checked as it is parsed."""
    from topology.inputs import check_number

    check_number(args.time_scale, what="a time scale", where="--time-scale", positive=True, maximum=1e9)


def cmd_run(args: argparse.Namespace) -> int:
    check_scales(args)
    topo, workload = load_inputs(args.workload, args.topology)
    ns3_options = _ns3_options(args) if args.backend == "ns3" else None
    out = output_dir(args, f"run-{args.backend}")
    progress(f"emu: running {workload.name!r} ({len(workload.jobs)} jobs) on {topo.name!r} with the {args.backend} backend")
    if args.backend == "mininet":
        try:
            _sim, result, files = _emulate(topo, workload, args, out, "result")
        except EmulationStopped as exc:
            return _stopped(exc, out)
        files = {"result": files["result_result"], "timeline": files["result_timeline"], **files}
    else:
        result = _simulate(topo, workload, args) if args.backend == "sim" else _ns3(topo, workload, ns3_options)
        files = _write(result, out, "result")
    text = [f"{result.backend}: {workload.name} on {topo.name}, makespan {result.makespan * 1e3:.4f} ms", *_job_lines(result),
            f"wrote {files['result']} and {files['timeline']}"]
    verdict = result.meta.get("verdict")
    if verdict is not None:
        text.append(_verdict_line(verdict, result.meta.get("estimate", {}).get("total_s")))
    emit(args, {**result.summary(), "files": files, **({"verdict": verdict} if verdict is not None else {})}, "\n".join(text))
    return 0 if verdict is None or verdict["ok"] else 3


def cmd_compare(args: argparse.Namespace) -> int:
    from topology.io import atomic_write_text

    from .plots import plot_comparison

    check_scales(args)
    topo, workload = load_inputs(args.workload, args.topology)
    mininet_runner()  # fail before anything else when the emulator cannot run
    out = output_dir(args, "compare")
    try:
        sim, emu, files = _emulate(topo, workload, args, out, "mininet")
    except EmulationStopped as exc:
        return _stopped(exc, out)
    cmp = compare_results(sim, emu)
    verdict = emu.meta["verdict"]
    cmp.update(verdict=verdict, byte_scale=emu.meta.get("byte_scale_choice"), estimate=emu.meta.get("estimate"))
    atomic_write_text(out / "comparison.json", json.dumps(cmp, indent=1, default=str) + "\n")
    files["comparison"] = str(out / "comparison.json")
    files["comparison_png"] = str(plot_comparison([sim, emu], out / "comparison.png"))
    text = [format_comparison(cmp), _verdict_line(verdict, (cmp["estimate"] or {}).get("total_s")), f"wrote {', '.join(files.values())}"]
    emit(args, {**cmp, "files": files}, "\n".join(text))
    return 0 if verdict["ok"] else 3


def _stopped(exc: EmulationStopped, out: Path) -> int:
    """Exit 4: what was kept, then the reason on one line (last, like every error)."""
    progress(f"emu: the emulation did not finish; kept {_kept(out)}")
    print("netweave: error: " + " ".join(str(exc.args[0]).split()), file=sys.stderr, flush=True)
    return 4


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
