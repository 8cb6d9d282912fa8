"""Pictures of a :class:`~emu.results.RunResult`: link utilisation over time above a Gantt chart of the jobs' phases.

Matplotlib is used through its object API with the Agg canvas, so importing
this module changes no global backend.

>>> import tempfile, pathlib
>>> from emu.results import JobResult, PhaseRecord, RunResult
>>> r = RunResult("sim", "w", "t", jobs={"a": JobResult("a", 0.0, 0.0, [1.0])}, phases=[PhaseRecord("a", 0, "c", "compute", 0.0, 1.0)])
>>> with tempfile.TemporaryDirectory() as d:
...     p = plot_timeline(r, pathlib.Path(d) / "t.png")
...     p.stat().st_size > 1000
True
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .results import RunResult

KIND_COLOURS = {"compute": "#9fb7d6", "collective": "#e8833a", "p2p": "#4a9c5d"}


def plot_timeline(result: RunResult, path: str | os.PathLike[str], *, links: int = 8, max_jobs: int = 40, title: str | None = None) -> Path:
    """Write a PNG: the ``links`` busiest links' utilisation (top) and each job's phases (bottom, at most ``max_jobs`` rows).

    Time is in workload seconds (see :mod:`emu.results`). Returns the path.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    util = result.links
    busiest = util.busiest(links) if util is not None else []
    jobs = list(result.jobs)[:max_jobs]
    fig = Figure(figsize=(14, 3 + 0.25 * max(len(jobs), 4) + (2.5 if busiest else 0)), dpi=110)
    FigureCanvasAgg(fig)
    heights = ([2.5] if busiest else []) + [max(1.5, 0.25 * len(jobs))]
    axes = fig.subplots(len(heights), 1, sharex=True, gridspec_kw={"height_ratios": heights}, squeeze=False)[:, 0]
    end = max(result.makespan, 1e-12)
    if busiest:
        ax = axes[0]
        edges = util.bin_edges
        for i in busiest:
            ax.stairs(util.util[i] * 100, edges, label=f"{util.links[i]} ({util.capacity[i]:g} GB/s)", linewidth=1.2)
        ax.set_ylabel("utilisation %")
        ax.set_ylim(0, 105)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0), borderaxespad=0.0)
        ax.grid(alpha=0.3)
        ax.set_title(title or f"{result.workload} on {result.topology} ({result.backend})")
    ax = axes[-1]
    rows = {name: k for k, name in enumerate(jobs)}
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for p in result.phases:
        row = rows.get(p.job)
        if row is not None and p.end >= p.start:
            bars.setdefault((row, p.kind), []).append((p.start, max(p.end - p.start, end * 1e-4)))
    for (row, kind), spans in bars.items():
        ax.broken_barh(spans, (row - 0.38, 0.76), facecolors=KIND_COLOURS.get(kind, "#888888"), linewidth=0)
    for name, row in rows.items():
        for t in result.jobs[name].iteration_ends:
            ax.plot([t, t], [row - 0.45, row + 0.45], color="black", linewidth=0.4)
    ax.set_yticks(range(len(jobs)), jobs, fontsize=7)
    ax.set_ylim(len(jobs) - 0.5, -0.5)
    ax.set_xlim(0, end * 1.02)
    ax.set_xlabel("time (s)")
    handles = [ax.bar(0, 0, color=c, label=k) for k, c in KIND_COLOURS.items()]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0), borderaxespad=0.0)
    if not busiest:
        ax.set_title(title or f"{result.workload} on {result.topology} ({result.backend})")
    fig.tight_layout()
    fig.savefig(path)
    return path


def plot_comparison(results: list[RunResult], path: str | os.PathLike[str]) -> Path:
    """Bar chart of every job's mean iteration time under each backend."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    jobs = list(results[0].jobs)
    fig = Figure(figsize=(max(6, 0.6 * len(jobs) * len(results)), 4), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    width = 0.8 / len(results)
    x = np.arange(len(jobs))
    for k, r in enumerate(results):
        ax.bar(x + k * width, [r.jobs[j].mean_iteration_time() * 1e3 if j in r.jobs else np.nan for j in jobs], width, label=r.backend)
    ax.set_xticks(x + width * (len(results) - 1) / 2, jobs, rotation=30, fontsize=8)
    ax.set_ylabel("mean iteration time (ms)")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return path


__all__ = ["KIND_COLOURS", "plot_comparison", "plot_timeline"]
