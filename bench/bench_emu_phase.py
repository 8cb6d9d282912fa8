"""The unshifted CASSINI pair over many iterations: how the relative phase of two identical jobs moves in Mininet and in the simulator.

Two 2-GPU data-parallel jobs (2 ms of compute, a 100 MB ring all-reduce; :func:`emu.mixes.cassini_pair`) share
``node0``'s NIC 0 and start together. The plain fluid model keeps them in lockstep at 6 ms per iteration; the
emulation does not. Per iteration this benchmark extracts, from each backend's phase records, the offset between
the two jobs' all-reduce starts (``|b - a|``: which one leads is chance) and each job's iteration time, for:

- Mininet (:func:`emu.mininet_backend.run_mininet`, K = 16000, M = 50 as in the agreement suite), in both NIC modes;
- the plain simulator (exactly fair shares) and the simulator with the emulated TCP's join ramp
  (:func:`emu.net.tcp_join_options`), the baseline each emulated figure is compared with.

Writes ``bench/results/emu_cassini_phase.{json,md,png}`` and keeps each emulated run under
``bench/results/raw/emu_cassini_phase_<mode>.json`` so that ``--render`` redraws the figure and recomputes the
simulator's side without emulating. Emulation needs root; run it under the shared lock:
``flock /tmp/netweave-bench.lock .venv/bin/python bench/bench_emu_phase.py [--iterations 30]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import RESULTS, markdown_table, write_results  # noqa: E402
from emu import mixes  # noqa: E402
from emu.net import tcp_join_options  # noqa: E402
from emu.results import RunResult  # noqa: E402
from emu.sim import simulate  # noqa: E402
from topology import default_cluster  # noqa: E402
from topology.io import atomic_write_text  # noqa: E402

OPTS = {"time_scale": 16000, "byte_scale": 50}
MODES = ("aggregate", "per-leaf")
NAME = "emu_cassini_phase"


def phase_offsets(result: RunResult, *, phase: str = "allreduce", first: str = "a", second: str = "b") -> list[float]:
    """Per iteration, the start of ``second``'s ``phase`` minus that of ``first``'s (seconds of workload time).

    >>> from topology import default_cluster
    >>> r = simulate(default_cluster(), mixes.cassini_pair({"b": 0.001}, iterations=3))
    >>> [round(d * 1e3, 6) for d in phase_offsets(r)]   # the plain model keeps the offset
    [1.0, 1.0, 1.0]
    """
    starts: dict[str, dict[int, float]] = {first: {}, second: {}}
    for p in result.phases:
        if p.phase == phase and p.job in starts:
            starts[p.job][p.iteration] = p.start
    n = min(len(s) for s in starts.values())
    return [starts[second][i] - starts[first][i] for i in range(n)]


def series(result: RunResult) -> dict[str, list[float]]:
    """How far apart the jobs' all-reduces start (|b - a|: which job leads is chance) and both jobs' iteration times, in ms."""
    return {"offset": [abs(d) * 1e3 for d in phase_offsets(result)],
            **{job: [t * 1e3 for t in result.jobs[job].iteration_times()] for job in ("a", "b")}}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def plot(curves: dict[str, dict[str, list[float]]], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 7), dpi=110)
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True)
    styles = {"sim, fair shares": ("k", ":"), "sim, join ramp": ("tab:red", "-"), "Mininet aggregate": ("tab:blue", "-"),
              "Mininet per-leaf": ("tab:green", "-")}
    for label, s in curves.items():
        colour, line = styles.get(label, ("grey", "--"))
        it = range(len(s["offset"]))
        top.plot(it, s["offset"], color=colour, linestyle=line, marker="o", markersize=3, label=label)
        bottom.plot(range(len(s["a"])), s["a"], color=colour, linestyle=line, marker="o", markersize=3, label=f"{label}: job a")
        bottom.plot(range(len(s["b"])), s["b"], color=colour, linestyle=line, marker="x", markersize=3, alpha=0.6)
    top.axhline(1.0, color="grey", linewidth=0.6)
    top.axhline(2.0, color="grey", linewidth=0.6)
    top.set_ylabel("|b's all-reduce start - a's| (ms)")
    top.set_title("Unshifted CASSINI pair on node0/nic0: lockstep (0 ms), one ring step apart (1 ms), interleaved (2 ms)")
    top.legend(loc="lower right", fontsize=8)
    bottom.set_ylabel("iteration time (ms; o job a, x job b)")
    bottom.set_xlabel("iteration")
    bottom.set_ylim(3.8, 6.2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--render", action="store_true", help="no emulation: read the kept runs under bench/results/raw/")
    parser.add_argument("--cpu-limit", type=float, default=1.01, help="CPU busy fraction above which an emulated run fails its fidelity check")
    parser.add_argument("--short-runs", type=int, default=4,
                        help="also this many runs of 6 iterations (the agreement suite's) per mode: the spread of their means")
    args = parser.parse_args()
    raw = {mode: RESULTS / "raw" / f"{NAME}_{mode.replace('-', '_')}.json" for mode in MODES}
    raw_short = RESULTS / "raw" / f"{NAME}_short.json"
    if not args.render:
        if os.geteuid() != 0:
            print("bench_emu_phase needs root (Mininet) unless --render; nothing measured", file=sys.stderr)
            raise SystemExit(2)
        from emu.mininet_backend import run_mininet

        def emulate(mode: str, iterations: int) -> RunResult:
            return run_mininet(default_cluster(), mixes.cassini_pair(iterations=iterations), nic_mode=mode, cpu_limit=args.cpu_limit,
                               raise_on_fidelity=False, **OPTS)

        for mode in MODES:
            emulate(mode, args.iterations).write(raw[mode])
        short = {mode: [] for mode in MODES}
        for _ in range(args.short_runs):
            for mode in MODES:
                r = emulate(mode, 6)
                short[mode].append({"load_1m": os.getloadavg()[0], "cpu_busy": r.meta.get("fidelity", {}).get("cpu", {}).get("busy_mean"),
                                    **{job: [t * 1e3 for t in r.jobs[job].iteration_times()] for job in ("a", "b")}})
        if args.short_runs:
            atomic_write_text(raw_short, json.dumps(short, indent=1) + "\n")
    topo = default_cluster()
    emus = {mode: RunResult.read(raw[mode]) for mode in MODES}
    iterations = min(len(r.jobs["a"].iteration_ends) for r in emus.values())
    workload = mixes.cassini_pair(iterations=iterations)
    join = tcp_join_options(topo, byte_scale=OPTS["byte_scale"])
    curves = {"sim, fair shares": series(simulate(topo, workload)), "sim, join ramp": series(simulate(topo, workload, **join))}
    curves.update({f"Mininet {mode}": series(r) for mode, r in emus.items()})
    shorts = {"sim, fair shares": "sim_fair", "sim, join ramp": "sim_ramp", "Mininet aggregate": "emu_agg", "Mininet per-leaf": "emu_leaf"}
    rows = []
    for k in range(iterations):
        row: dict = {"iteration": k}
        for label, s in curves.items():
            short = shorts[label]
            row[f"{short}_offset_ms"] = s["offset"][k]
            row[f"{short}_a_ms"] = s["a"][k]
            row[f"{short}_b_ms"] = s["b"][k]
        rows.append(row)
    summary = {label: {"mean_first_6_ms": _mean(s["a"][:6] + s["b"][:6]), "mean_all_ms": _mean(s["a"] + s["b"]),
                       "last_offset_ms": s["offset"][-1]} for label, s in curves.items()}
    short_rows = []
    if raw_short.exists():
        sim6 = simulate(topo, mixes.cassini_pair(iterations=6), **join)
        sim_ms = {job: sim6.jobs[job].mean_iteration_time() * 1e3 for job in ("a", "b")}
        for mode, runs in json.loads(raw_short.read_text()).items():
            for i, run in enumerate(runs):
                emu_ms = {job: _mean(run[job]) for job in ("a", "b")}
                errors = {job: 100 * (emu_ms[job] - sim_ms[job]) / sim_ms[job] for job in emu_ms}
                short_rows.append({"mode": mode, "run": i, "emu_a_ms": emu_ms["a"], "emu_b_ms": emu_ms["b"], "sim_a_ms": sim_ms["a"],
                                   "sim_b_ms": sim_ms["b"], "mape_pct": _mean([abs(e) for e in errors.values()]),
                                   "pair_mean_error_pct": 100 * (_mean(list(emu_ms.values())) / _mean(list(sim_ms.values())) - 1),
                                   "cpu_busy": run.get("cpu_busy"), "load_1m": run.get("load_1m")})
    plot(curves, RESULTS / f"{NAME}.png")
    fid = {mode: r.meta.get("fidelity", {}).get("cpu", {}).get("busy_mean") for mode, r in emus.items()}
    text = "; ".join(f"{label}: mean {v['mean_first_6_ms']:.3f} ms over the first 6 iterations, {v['mean_all_ms']:.3f} ms over all "
                     f"{iterations}, last offset {v['last_offset_ms']:.3f} ms" for label, v in summary.items())
    write_results(NAME, rows, title="Unshifted CASSINI pair: relative phase and iteration times per iteration, Mininet vs simulator",
                  extra={"summary": summary, "options": {**OPTS, **join}, "cpu_busy": fid, "short_runs": short_rows},
                  notes=f"Two identical 2-GPU DP jobs (2 ms compute + 100 MB ring all-reduce) on node0/nic0 (routing: rail), started "
                        f"together; K={OPTS['time_scale']}, M={OPTS['byte_scale']}; cpu_busy {fid}. offset = |b's all-reduce start - a's| "
                        f"(0: lockstep, 6 ms/iteration; 1: one ring step apart, 5 ms; 2: interleaved, 4 ms). sim_ramp: the simulator "
                        f"with the emulated TCP's join ramp ({join['join_ramp_s'] * 1e3:.3f} ms at weight {join['join_weight']}). {text}. "
                        f"Figure: {NAME}.png."
                        + (f"\n\nRepeated runs of 6 iterations (the agreement suite's), mean iteration time per job against the "
                           f"simulator with the join ramp:\n\n{markdown_table(short_rows)}" if short_rows else ""))


if __name__ == "__main__":
    main()
