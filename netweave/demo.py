"""``netweave demo``: the whole stack, end to end, on the embedded default cluster.

Each finished capability adds one section here, so that a newcomer sees every
piece work on the same ``Topology``. Sections print what they did and write
their files (JSON, PNG) under ``--out``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

from topology.clitools import emit


def section_topology(out: Path, report: dict) -> str:
    from topology.draw import draw_topology

    from topology import default_cluster
    from topology.cli import describe, format_description
    from topology.io import write_topology

    topo = default_cluster()
    write_topology(topo, out / "cluster.json")
    draw_topology(topo, out / "cluster.png")
    info = describe(topo)
    report["topology"] = info
    return format_description(info) + f"\n  wrote {out / 'cluster.json'} and {out / 'cluster.png'}"


SECTIONS: list[tuple[str, Callable[[Path, dict], str]]] = [
    ("Topology: 4 DGX H100 nodes on a rail-optimized 400 Gb/s fabric", section_topology),
]


def run_demo(out: Path, *, verbose: bool = True) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"out": str(out), "sections": []}
    for i, (title, fn) in enumerate(SECTIONS, 1):
        started = time.perf_counter()
        if verbose:
            print(f"\n== [{i}/{len(SECTIONS)}] {title}")
        text = fn(out, report)
        elapsed = time.perf_counter() - started
        report["sections"].append({"title": title, "seconds": round(elapsed, 3)})
        if verbose:
            print(text)
            print(f"  ({elapsed:.1f} s)")
    return report


def cmd_demo(args: argparse.Namespace) -> int:
    report = run_demo(Path(args.out), verbose=not args.json)
    if args.json:
        emit(args, report, "")
    else:
        print(f"\ndemo finished; files in {args.out}/")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the whole stack end to end on the embedded default cluster")
    p.add_argument("--out", default="netweave-demo", help="directory for the demo's files (default netweave-demo)")
    p.add_argument("--json", action="store_true", help="print the demo's report as JSON")
    p.set_defaults(func=cmd_demo)
