"""``netweave bench``: run the benchmark scripts of ``bench/`` and point at their results.

Each ``bench/bench_<name>.py`` is a standalone script that prints its table and
writes ``bench/results/<name>*.json`` and ``.md``. This command runs them from a
source checkout (the benchmarks are not part of the installed package).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from topology.clitools import emit, progress
from topology.errors import InputError

BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"


def available() -> dict[str, Path]:
    if not BENCH_DIR.is_dir():
        raise InputError(f"no bench/ directory at {BENCH_DIR}: run from a source checkout (git clone + make setup)")
    return {p.stem.removeprefix("bench_"): p for p in sorted(BENCH_DIR.glob("bench_*.py"))}


def cmd_bench(args: argparse.Namespace) -> int:
    scripts = available()
    if args.list or not args.names:
        emit(args, sorted(scripts), "benchmarks: " + ", ".join(sorted(scripts)) + "\nrun: netweave bench NAME... | all")
        return 0
    names = sorted(scripts) if args.names == ["all"] else args.names
    for n in names:
        if n not in scripts:
            raise InputError(f"unknown benchmark {n!r}; expected one of {', '.join(sorted(scripts))} or all")
    results = []
    for n in names:
        progress(f"== bench {n}")
        t0 = time.perf_counter()
        code = subprocess.call([sys.executable, str(scripts[n]), *args.extra], cwd=BENCH_DIR.parent)
        results.append({"name": n, "exit": code, "seconds": round(time.perf_counter() - t0, 1)})
    emit(args, results, "\n".join(f"{r['name']}: exit {r['exit']} in {r['seconds']} s" for r in results) + f"\nresults in {BENCH_DIR / 'results'}/")
    return max((r["exit"] for r in results), default=0)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run benchmarks (bench/bench_*.py); results go to bench/results/")
    p.add_argument("names", nargs="*", help="benchmark names, or 'all'")
    p.add_argument("--list", action="store_true", help="list the benchmarks")
    p.add_argument("--extra", action="append", default=[], metavar="ARG", help="argument passed to each script")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench)
