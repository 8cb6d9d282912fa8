"""Shared plumbing for benchmark scripts.

A benchmark prints a table and writes ``<name>.json`` (the raw numbers plus
the machine and date) and ``<name>.md`` (the same table for humans) into
:data:`RESULTS`: ``$NETWEAVE_BENCH_OUT`` when set (``netweave bench`` sets it to
its ``--out``), else ``bench/results/``, the committed results the docs cite. Timings are reported as ratios to a baseline measured in the
same process where one exists, because machines here are shared and noisy.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

RESULTS = Path(os.environ.get("NETWEAVE_BENCH_OUT") or Path(__file__).resolve().parent / "results")


def machine() -> dict[str, Any]:
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }


def timed(fn: Callable[[], Any], repeat: int = 3) -> tuple[float, Any]:
    """Median wall time of ``repeat`` calls, and the last result."""
    times, result = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    if not rows:
        return "(no rows)\n"
    columns = list(columns or rows[0].keys())

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_results(name: str, rows: Sequence[dict[str, Any]], *, title: str, notes: str = "", extra: dict[str, Any] | None = None,
                  columns: Sequence[str] | None = None, out_dir: Path | None = None) -> Path:
    """Write ``<name>.json`` and ``<name>.md``; print the table; return the JSON path."""
    out_dir = out_dir or RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = machine()
    payload = {"benchmark": name, "title": title, "machine": meta, "rows": list(rows), **(extra or {})}
    (out_dir / f"{name}.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    table = markdown_table(rows, columns)
    md = f"# {title}\n\n{meta['date']}, {meta['platform']}, {meta['cpus']} CPUs, Python {meta['python']}\n\n{table}"
    if notes:
        md += f"\n{notes.strip()}\n"
    (out_dir / f"{name}.md").write_text(md)
    print(f"\n{title}\n{table}")
    return out_dir / f"{name}.json"
