"""The result of running a workload on a backend (simulator or emulator): one type for both.

Every backend returns a :class:`RunResult`, so that results can be compared
(:func:`compare_results`), plotted (:mod:`emu.plots`) and stored in one JSON
format. **All times are in workload seconds**: a backend that dilates time
(the Mininet backend divides bandwidths by ``time_scale`` k and so runs k times
slower) divides its measured times by k before filling the result.

Definitions
    - a job's *release* is ``arrival + start_offset``; iteration *i* ends when all
      of its phases have finished; the *iteration time* of iteration *i* is
      ``end[i] - end[i-1]`` with ``end[-1] = release``;
    - ``jct = finish - arrival`` (the time shift is paid for);
    - a flow's ``end`` is when its last byte arrived (transmission plus path latency);
    - link utilisation is the mean rate over a time bin divided by the link's capacity.

>>> r = RunResult("sim", "w", "t", jobs={"a": JobResult("a", 0.0, 0.0, [1.0, 2.5])})
>>> r.jobs["a"].iteration_times(), r.jobs["a"].jct, r.makespan
([1.0, 1.5], 2.5, 2.5)
>>> RunResult.from_dict(r.to_dict()) == r
True
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from topology.errors import InputError

RESULT_FORMAT = "netweave-emu-result"
RESULT_VERSION = 1


@dataclass(slots=True)
class FlowRecord:
    """One point-to-point flow: ``step`` is the collective step (0 for p2p phases)."""

    job: str
    iteration: int
    phase: str
    step: int
    src: str
    dst: str
    nbytes: float
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(slots=True)
class PhaseRecord:
    """One phase instance: ``kind`` is compute, collective or p2p."""

    job: str
    iteration: int
    phase: str
    kind: str
    start: float
    end: float


@dataclass
class JobResult:
    name: str
    arrival: float
    release: float
    iteration_ends: list[float]

    @property
    def finish(self) -> float:
        return self.iteration_ends[-1] if self.iteration_ends else math.nan

    @property
    def jct(self) -> float:
        return self.finish - self.arrival

    def iteration_times(self) -> list[float]:
        ends = [self.release, *self.iteration_ends]
        return [b - a for a, b in zip(ends, ends[1:], strict=False)]

    def mean_iteration_time(self) -> float:
        times = self.iteration_times()
        return float(np.mean(times)) if times else math.nan

    def to_dict(self) -> dict[str, Any]:
        done = bool(self.iteration_ends)  # a run stopped before a job's first iteration ended has no finish (null, not NaN)
        return {"name": self.name, "arrival": self.arrival, "release": self.release, "iteration_ends": list(self.iteration_ends),
                "finish": self.finish if done else None, "jct": self.jct if done else None, "iteration_times": self.iteration_times()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> JobResult:
        return cls(d["name"], float(d["arrival"]), float(d["release"]), [float(x) for x in d["iteration_ends"]])


@dataclass
class LinkUtilisation:
    """Per-link utilisation over time: ``util[l, b]`` is link ``l``'s mean rate in bin ``b`` over its capacity.

    ``links`` are ``"u->v"`` (``"u->v#key"`` for a parallel link with key != 0),
    ``capacity`` in GB/s, ``bin_edges`` in seconds (``len(bin_edges) == util.shape[1] + 1``).
    """

    links: list[str]
    capacity: list[float]
    kinds: list[str]
    bin_edges: np.ndarray
    util: np.ndarray

    def busiest(self, n: int = 10) -> list[int]:
        """Indices of the ``n`` links with the highest mean utilisation (only links that carried traffic)."""
        if not len(self.links):
            return []
        widths = np.diff(self.bin_edges)
        mean = (self.util * widths).sum(axis=1) / max(widths.sum(), 1e-300)
        order = np.argsort(-mean, kind="stable")
        return [int(i) for i in order[:n] if mean[i] > 0]

    def mean(self) -> np.ndarray:
        widths = np.diff(self.bin_edges)
        return (self.util * widths).sum(axis=1) / max(widths.sum(), 1e-300)

    def to_dict(self) -> dict[str, Any]:
        return {"links": list(self.links), "capacity_gbs": list(self.capacity), "kinds": list(self.kinds),
                "bin_edges": [float(x) for x in self.bin_edges], "util": np.round(self.util, 6).tolist()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LinkUtilisation:
        util = np.asarray(d["util"], dtype=float).reshape(len(d["links"]), max(len(d["bin_edges"]) - 1, 0))
        return cls(list(d["links"]), [float(x) for x in d["capacity_gbs"]], list(d["kinds"]), np.asarray(d["bin_edges"], dtype=float), util)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, LinkUtilisation) and self.links == other.links and self.capacity == other.capacity
                and self.kinds == other.kinds and np.array_equal(self.bin_edges, other.bin_edges)
                and np.allclose(self.util, other.util, atol=1e-6))


_FLOW_COLUMNS = ("job", "iteration", "phase", "step", "src", "dst", "nbytes", "start", "end")
_PHASE_COLUMNS = ("job", "iteration", "phase", "kind", "start", "end")


@dataclass
class RunResult:
    """What a backend measured for one workload on one topology."""

    backend: str
    workload: str
    topology: str
    jobs: dict[str, JobResult] = field(default_factory=dict)
    phases: list[PhaseRecord] = field(default_factory=list)
    flows: list[FlowRecord] = field(default_factory=list)
    links: LinkUtilisation | None = None
    time_scale: float = 1.0
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def makespan(self) -> float:
        ends = [j.finish for j in self.jobs.values() if j.iteration_ends]
        return max(ends) if ends else 0.0

    def job_table(self) -> list[dict[str, Any]]:
        """One row per job: iterations, mean/min/max iteration time, JCT, finish."""
        rows = []
        for j in self.jobs.values():
            it = j.iteration_times()
            rows.append({"job": j.name, "iterations": len(it), "mean_iteration_s": j.mean_iteration_time(),
                         "min_iteration_s": min(it) if it else math.nan, "max_iteration_s": max(it) if it else math.nan,
                         "jct_s": j.jct, "finish_s": j.finish})
        return rows

    def summary(self) -> dict[str, Any]:
        return {"backend": self.backend, "workload": self.workload, "topology": self.topology, "time_scale": self.time_scale,
                "makespan_s": self.makespan, "flows": len(self.flows), "jobs": self.job_table(), "meta": self.meta}

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": RESULT_FORMAT,
            "version": RESULT_VERSION,
            "backend": self.backend,
            "workload": self.workload,
            "topology": self.topology,
            "time_scale": self.time_scale,
            "makespan": self.makespan,
            "meta": self.meta,
            "jobs": [j.to_dict() for j in self.jobs.values()],
            "phases": {"columns": list(_PHASE_COLUMNS), "rows": [[getattr(p, c) for c in _PHASE_COLUMNS] for p in self.phases]},
            "flows": {"columns": list(_FLOW_COLUMNS), "rows": [[getattr(f, c) for c in _FLOW_COLUMNS] for f in self.flows]},
            "links": self.links.to_dict() if self.links is not None else None,
        }

    @classmethod
    def from_dict(cls, d: Any, *, source: str | None = None) -> RunResult:
        if not isinstance(d, dict) or d.get("format") != RESULT_FORMAT:
            raise InputError(f"expected a JSON object with \"format\": \"{RESULT_FORMAT}\"", source=source)
        if d.get("version") != RESULT_VERSION:
            raise InputError(f"unsupported version {d.get('version')!r}, expected {RESULT_VERSION}", source=source, where="version")
        try:
            phases = [PhaseRecord(*row) for row in _rows(d["phases"], _PHASE_COLUMNS)]
            flows = [FlowRecord(*row) for row in _rows(d["flows"], _FLOW_COLUMNS)]
            jobs = {j["name"]: JobResult.from_dict(j) for j in d["jobs"]}
            links = LinkUtilisation.from_dict(d["links"]) if d.get("links") else None
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"malformed result ({type(exc).__name__}: {exc})", source=source) from None
        return cls(d["backend"], d["workload"], d["topology"], jobs, phases, flows, links, float(d.get("time_scale", 1.0)), dict(d.get("meta") or {}))

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the JSON form atomically; returns the path."""
        from topology.io import atomic_write_text

        atomic_write_text(path, json.dumps(self.to_dict(), default=_json_default) + "\n")
        return Path(path)

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> RunResult:
        from topology.inputs import loads_json, read_text

        return cls.from_dict(loads_json(read_text(path), source=str(path)), source=str(path))


def _rows(table: dict[str, Any], columns: tuple[str, ...]) -> list[list[Any]]:
    if list(table["columns"]) != list(columns):
        raise ValueError(f"expected columns {list(columns)}")
    return table["rows"]


def _json_default(x: Any) -> Any:
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


def compare_results(reference: RunResult, other: RunResult) -> dict[str, Any]:
    """Agreement of ``other`` with ``reference`` on per-job iteration times.

    Per job: the mean iteration time of each, the signed relative error of the
    mean, and the MAPE over iterations (iteration *i* against iteration *i*).
    Overall: ``mape`` is the mean over jobs of |relative error of the mean
    iteration time| (in %), and ``jct_mape`` the same for JCTs.

    >>> a = RunResult("sim", "w", "t", jobs={"j": JobResult("j", 0.0, 0.0, [1.0, 2.0])})
    >>> b = RunResult("mininet", "w", "t", jobs={"j": JobResult("j", 0.0, 0.0, [1.1, 2.2])})
    >>> c = compare_results(a, b)
    >>> round(c["rows"][0]["error_pct"], 6), round(c["mape"], 6)
    (10.0, 10.0)
    """
    rows = []
    for name, ref in reference.jobs.items():
        oth = other.jobs.get(name)
        if oth is None:
            raise InputError(f"job {name!r} is missing from the {other.backend} result")
        r_it, o_it = ref.iteration_times(), oth.iteration_times()
        n = min(len(r_it), len(o_it))
        per_iter = [abs(o - r) / r * 100 for r, o in zip(r_it[:n], o_it[:n], strict=True) if r > 0]
        r_mean, o_mean = ref.mean_iteration_time(), oth.mean_iteration_time()
        rows.append({
            "job": name,
            f"{reference.backend}_iteration_s": r_mean,
            f"{other.backend}_iteration_s": o_mean,
            "error_pct": (o_mean - r_mean) / r_mean * 100 if r_mean > 0 else math.nan,
            "iteration_mape_pct": float(np.mean(per_iter)) if per_iter else math.nan,
            f"{reference.backend}_jct_s": ref.jct,
            f"{other.backend}_jct_s": oth.jct,
            "jct_error_pct": (oth.jct - ref.jct) / ref.jct * 100 if ref.jct > 0 else math.nan,
        })
    errors = [abs(r["error_pct"]) for r in rows if not math.isnan(r["error_pct"])]
    jct_errors = [abs(r["jct_error_pct"]) for r in rows if not math.isnan(r["jct_error_pct"])]
    return {"reference": reference.backend, "other": other.backend, "rows": rows,
            "mape": float(np.mean(errors)) if errors else math.nan,
            "jct_mape": float(np.mean(jct_errors)) if jct_errors else math.nan}


def format_comparison(cmp: dict[str, Any]) -> str:
    """The agreement table as text."""
    ref, oth = cmp["reference"], cmp["other"]
    from topology.clitools import render_table

    rows = [(r["job"], f"{r[f'{ref}_iteration_s']:.6g}", f"{r[f'{oth}_iteration_s']:.6g}", f"{r['error_pct']:.2f}", f"{r['iteration_mape_pct']:.2f}",
             f"{r['jct_error_pct']:.2f}") for r in cmp["rows"]]
    lines = [render_table(["job", f"{ref} iteration s>", f"{oth} iteration s>", "error %>", "iteration MAPE %>", "JCT error %>"], rows)]
    lines.append(f"MAPE of mean iteration time over jobs: {cmp['mape']:.2f}%   (JCT: {cmp['jct_mape']:.2f}%)")
    return "\n".join(lines)


__all__ = [
    "RESULT_FORMAT",
    "RESULT_VERSION",
    "FlowRecord",
    "JobResult",
    "LinkUtilisation",
    "PhaseRecord",
    "RunResult",
    "compare_results",
    "format_comparison",
]
