"""``netweave bench``: run the benchmark scripts of ``bench/`` into an output directory.

Each ``bench/bench_<name>.py`` is a standalone script that prints its table and
writes ``<name>*.json`` and ``.md`` (and sometimes ``.png``) into its results
directory. ``netweave bench`` runs them from a source checkout (the benchmarks
are not part of the installed package) with that directory set to ``--out``
(default ``./netweave-bench/`` in the current directory), so the results
committed in ``bench/results/`` -- the ones the docs cite -- change only when
asked for with ``--update-results``.

A script run directly (``python bench/bench_sim.py``) writes to
``$NETWEAVE_BENCH_OUT`` when that is set, else to ``bench/results/``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from topology.clitools import emit, progress
from topology.errors import InputError

BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"
COMMITTED_RESULTS = BENCH_DIR / "results"
DEFAULT_OUT = "netweave-bench"
OUT_ENV = "NETWEAVE_BENCH_OUT"   # read by bench/_common.py


def available() -> dict[str, Path]:
    """Benchmark name -> script, for every ``bench/bench_<name>.py`` of the source checkout."""
    if not BENCH_DIR.is_dir():
        raise InputError(f"no bench/ directory at {BENCH_DIR}: run from a source checkout (git clone + make setup)")
    return {p.stem.removeprefix("bench_"): p for p in sorted(BENCH_DIR.glob("bench_*.py"))}


def script_arguments(extra: list[str]) -> list[str]:
    """The arguments for each script: everything after ``--extra`` (repeated ``--extra`` words dropped, ``--extra=X`` is X).

    >>> script_arguments(["--quick", "--extra", "--only", "agreement", "--extra=--repeats=2"])
    ['--quick', '--only', 'agreement', '--repeats=2']
    """
    return [a.removeprefix("--extra=") for a in extra if a != "--extra"]


def output_directory(args: argparse.Namespace) -> Path:
    """Where the scripts write: ``bench/results/`` with ``--update-results``, else ``--out`` (made absolute)."""
    if args.update_results:
        if args.out is not None:
            raise InputError("--out and --update-results exclude each other: --update-results writes bench/results/")
        return COMMITTED_RESULTS
    out = Path(args.out if args.out is not None else DEFAULT_OUT).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {args.out}: exists and is not a directory")
    return out


def cmd_bench(args: argparse.Namespace) -> int:
    scripts = available()
    if args.list or not args.names:
        emit(args, sorted(scripts), "benchmarks: " + ", ".join(sorted(scripts))
             + "\nrun: netweave bench NAME... | all  [--out DIR | --update-results]")
        return 0
    names = sorted(scripts) if args.names == ["all"] else args.names
    for n in names:
        if n not in scripts:
            raise InputError(f"unknown benchmark {n!r}; expected one of {', '.join(sorted(scripts))} or all")
    out = output_directory(args)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, OUT_ENV: str(out)}
    results = []
    for n in names:
        progress(f"== bench {n} -> {out}/")
        t0 = time.perf_counter()
        code = subprocess.call([sys.executable, str(scripts[n]), *script_arguments(args.extra)], cwd=BENCH_DIR.parent, env=env)
        results.append({"name": n, "exit": code, "seconds": round(time.perf_counter() - t0, 1), "out": str(out)})
    emit(args, results, "\n".join(f"{r['name']}: exit {r['exit']} in {r['seconds']} s" for r in results) + f"\nresults in {out}/")
    return max((r["exit"] for r in results), default=0)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run benchmarks (bench/bench_*.py) into an output directory (default ./netweave-bench/)",
                       description="Run benchmarks. Results go to --out (default ./netweave-bench/ in the current directory); "
                                   "the committed bench/results/ change only with --update-results.")
    p.add_argument("names", nargs="*", help="benchmark names, or 'all'")
    p.add_argument("--list", action="store_true", help="list the benchmarks")
    p.add_argument("--out", default=None, metavar="DIR", help=f"results directory (default ./{DEFAULT_OUT}/ in the current directory)")
    p.add_argument("--update-results", action="store_true", help="write into bench/results/, the committed results the docs cite")
    p.add_argument("--json", action="store_true", help="machine-readable JSON on stdout")
    p.add_argument("--extra", nargs=argparse.REMAINDER, action="extend", default=[], metavar="ARG",
                   help="arguments passed to each script: everything after --extra (put it last), e.g. --extra --quick")
    p.set_defaults(func=cmd_bench)
