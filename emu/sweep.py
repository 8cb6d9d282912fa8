"""Parameter sweeps: every combination of some workload or simulator settings, simulated through one executor interface.

A sweep point is a pure function of its *spec* (topology, workload, simulator
config, as plain data): :func:`run_point` turns a spec into a result row, so
any engine that can call a function on a picklable argument can run it.

Executors (``get_executor``)
    ``local``: a ``concurrent.futures`` process pool (``max_workers=1`` runs in
    this process); the default and what most tests use.
    ``ray``: Ray tasks (``ray.remote``/``ray.wait``), one per point, on the
    cluster at ``address`` (``ray start --head`` on one machine, then
    ``--address HEAD:6379`` on any) or on a local Ray instance started for the
    call; chosen by ``auto`` when an address is given (or ``$RAY_ADDRESS`` is set).
    Rows are the local executor's, in the same order. Both report progress
    (``progress(done, total)``, e.g. :func:`eta_progress`) as points finish.
    Emulation points should ask Ray for a ``mininet`` custom resource so that
    only one Mininet runs per kernel (Mininet cannot share a kernel).

Sweep axes name what they change:
    ``jobs.<job>.<field>`` (``start_offset``, ``priority``, ``rate_cap``, ``iterations``, ``arrival``, ``routing``),
    ``jobs.*.<field>`` (every job), ``jobs.<job>.phases.<phase>.<field>`` (``bytes``, ``duration``,
    ``priority``, ``rate_cap``, ``algorithm``, ``op``), ``config.<field>`` (a :class:`~emu.sim.SimConfig` field).

>>> parse_axes(["jobs.b.start_offset=0,0.5", "config.sharing=strict,weighted"])
{'jobs.b.start_offset': [0, 0.5], 'config.sharing': ['strict', 'weighted']}
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib.util
import itertools
import json
import math
import os
import socket
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any, Protocol

from topology.clitools import eta_progress
from topology.errors import InputError
from topology.model import Topology

from .workload import Workload, workload_from_dict


class SweepError(InputError):
    """A sweep axis or value that does not fit the workload or the simulator."""


ProgressFn = Callable[[int, int], None]
"""``progress(done, total)``: called once before any item finishes (``done=0``) and after each one finishes."""


class Executor(Protocol):
    name: str

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any], progress: ProgressFn | None = None) -> list[Any]:
        """``[fn(x) for x in items]``, in order, however the engine runs them; ``progress`` hears of each finished item."""
        ...


class LocalExecutor:
    """A process pool on this machine (``max_workers=1``: no pool, in this process)."""

    name = "local"

    def __init__(self, max_workers: int | None = None):
        if max_workers is not None and max_workers < 1:
            raise SweepError(f"max_workers must be >= 1, got {max_workers}")
        self.max_workers = max_workers

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any], progress: ProgressFn | None = None) -> list[Any]:
        items = list(items)
        tick = progress or (lambda done, total: None)
        tick(0, len(items))
        if self.max_workers == 1 or len(items) <= 1:
            results = []
            for x in items:
                results.append(fn(x))
                tick(len(results), len(items))
            return results
        with ProcessPoolExecutor(max_workers=self.max_workers) as pool:
            futures = {pool.submit(fn, x): i for i, x in enumerate(items)}
            out: list[Any] = [None] * len(items)
            for done, future in enumerate(as_completed(futures), start=1):
                out[futures[future]] = future.result()
                tick(done, len(items))
            return out


# The packages a Ray task imports: shipped to a remote cluster (runtime_env py_modules) so that its nodes need only
# the third-party dependencies. Listed by name so that this module does not import upward.
SHIPPED_PACKAGES = ("topology", "emu", "placement")


def _probe_address(address: str, timeout_s: float = 5.0) -> None:
    """Fail at once, naming the address, when nothing listens there (ray.init would retry for minutes)."""
    if address == "auto":
        return
    rest = address.split("://", 1)[-1]
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SweepError(f"--address {address!r}: expected HOST:PORT (the head's GCS address, e.g. 10.0.0.5:6379), ray://HOST:PORT or auto")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise SweepError(f"--address {address!r}: no Ray head answers there ({exc.strerror or exc}); start one with 'ray start --head'") from None


class RayExecutor:
    """Ray tasks, one per item, on the cluster at ``address`` or on a local Ray instance started (and stopped) here.

    ``num_cpus`` and ``resources`` (e.g. ``{"mininet": 1}``) are asked for every task. With an ``address``
    this process connects as a driver and ships the project's packages (:data:`SHIPPED_PACKAGES`) with the
    tasks (``ship_code``); without one it starts Ray on this machine with ``local_cpus`` CPUs (default: all)
    and shuts it down after ``map``. A Ray already initialised in this process (``ray.init`` by the caller) is
    used as it is and left running. Errors a task raises come back as they were raised.
    """

    name = "ray"

    def __init__(self, *, num_cpus: float = 1, resources: dict[str, float] | None = None, address: str | None = None,
                 local_cpus: int | None = None, ship_code: bool | None = None):
        if importlib.util.find_spec("ray") is None:
            raise SweepError("the Ray executor needs the 'ray' package (pip install 'netweave[ray]'); use --executor local")
        import ray

        if address is not None and not address.strip():
            raise SweepError("--address is empty: expected HOST:PORT, ray://HOST:PORT or auto")
        if not num_cpus > 0:
            raise SweepError(f"num_cpus must be positive, got {num_cpus}")
        self.ray = ray
        self.num_cpus = num_cpus
        self.resources = resources or {}
        self.address = address
        self.local_cpus = local_cpus
        self.ship_code = address is not None if ship_code is None else ship_code

    def check(self) -> None:
        """Fail now, in one line, when ``address`` is malformed or no Ray head answers there (before any work starts)."""
        if self.address is not None and not self.ray.is_initialized():
            _probe_address(self.address)

    def _connect(self) -> bool:
        """Initialise Ray if this process has not; True when it was started here (and so is shut down here)."""
        ray = self.ray
        if ray.is_initialized():
            return False
        options: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
        if self.ship_code:
            options["runtime_env"] = {"py_modules": [importlib.import_module(name) for name in SHIPPED_PACKAGES]}
        if self.address is None:
            ray.init(num_cpus=self.local_cpus, **options)
            return True
        _probe_address(self.address)
        try:
            ray.init(address=self.address, **options)
        except (ConnectionError, TimeoutError, ValueError, RuntimeError) as exc:
            raise SweepError(f"--address {self.address!r}: cannot join that Ray cluster: {str(exc).splitlines()[0] if str(exc) else exc}") from None
        return True

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any], progress: ProgressFn | None = None) -> list[Any]:
        ray = self.ray
        items = list(items)
        tick = progress or (lambda done, total: None)
        started = self._connect()
        try:
            task = ray.remote(num_cpus=self.num_cpus, resources=self.resources or None)(fn)
            refs = [task.remote(x) for x in items]
            tick(0, len(refs))
            pending = list(refs)
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                tick(len(refs) - len(pending), len(refs))
            try:
                return list(ray.get(refs))
            except ray.exceptions.RayTaskError as exc:
                if isinstance(exc.cause, Exception):  # the task's own error (an InputError names the field), not Ray's wrapper
                    raise exc.cause from None
                raise
        finally:
            if started:
                ray.shutdown()


def get_executor(kind: str = "auto", *, max_workers: int | None = None, address: str | None = None,
                 **ray_options: Any) -> LocalExecutor | RayExecutor:
    """``local``, ``ray``, or ``auto``: Ray when a cluster address is given (``address`` or ``$RAY_ADDRESS``), else local.

    ``ray`` without an address starts a local Ray instance; ``max_workers`` is then its CPU count.
    """
    if kind == "auto":
        kind = "ray" if address or os.environ.get("RAY_ADDRESS") else "local"
    if kind == "local":
        if address:
            raise SweepError("--address names a Ray cluster: use it with --executor ray (or auto)")
        return LocalExecutor(max_workers)
    if kind == "ray":
        if max_workers is not None and max_workers < 1:
            raise SweepError(f"max_workers must be >= 1, got {max_workers}")
        return RayExecutor(address=address or os.environ.get("RAY_ADDRESS") or None, local_cpus=max_workers, **ray_options)
    raise SweepError(f"unknown executor {kind!r}; expected auto, local or ray")


# -- axes and points -------------------------------------------------------------------------------


def _value(text: str) -> Any:
    low = text.strip().lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            continue
    return text.strip()


def parse_axes(items: Iterable[str]) -> dict[str, list[Any]]:
    """``["FIELD=V1,V2", ...]`` -> ``{FIELD: [V1, V2]}`` with numbers, booleans and ``none`` parsed."""
    axes: dict[str, list[Any]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key.strip() or not values.strip():
            raise SweepError(f"--set {item!r}: expected FIELD=V1,V2,...")
        axes[key.strip()] = [_value(v) for v in values.split(",")]
    return axes


_JOB_FIELDS = {"start_offset", "priority", "rate_cap", "iterations", "arrival", "routing"}
_PHASE_FIELDS = {"bytes", "duration", "priority", "rate_cap", "algorithm", "op"}


def apply_point(workload: dict[str, Any], config: dict[str, Any], point: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Copies of the workload dict and the config dict with ``point``'s values set."""
    workload, config = copy.deepcopy(workload), dict(config)
    for path, value in point.items():
        parts = path.split(".")
        if parts[0] == "config" and len(parts) == 2:
            config[parts[1]] = tuple(value) if isinstance(value, list) else value
            continue
        if parts[0] != "jobs" or len(parts) not in (3, 5) or (len(parts) == 5 and parts[2] != "phases"):
            raise SweepError(f"axis {path!r}: expected jobs.<job>.<field>, jobs.<job>.phases.<phase>.<field> or config.<field>")
        jobs = [j for j in workload["jobs"] if parts[1] in ("*", j["name"])]
        if not jobs:
            raise SweepError(f"axis {path!r}: no job named {parts[1]!r}")
        for job in jobs:
            if len(parts) == 3:
                if parts[2] not in _JOB_FIELDS:
                    raise SweepError(f"axis {path!r}: a job field is one of {', '.join(sorted(_JOB_FIELDS))}")
                job[parts[2]] = value
            else:
                phases = [p for p in job["phases"] if parts[3] in ("*", p["name"])]
                if not phases:
                    raise SweepError(f"axis {path!r}: job {job['name']!r} has no phase {parts[3]!r}")
                if parts[4] not in _PHASE_FIELDS:
                    raise SweepError(f"axis {path!r}: a phase field is one of {', '.join(sorted(_PHASE_FIELDS))}")
                for phase in phases:
                    phase[parts[4]] = value
    return workload, config


def spec_id(spec: dict[str, Any]) -> str:
    """A content address for a spec (same inputs, same id)."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:16]


def run_point(spec: dict[str, Any]) -> dict[str, Any]:
    """Simulate one spec (``topology``, ``workload``, ``config`` as plain data, plus ``point``) and summarise it."""
    from .sim import SimConfig, simulate

    topo = Topology.from_dict(spec["topology"])
    workload = workload_from_dict(spec["workload"], source=f"sweep point {spec['point']}")
    fields = {f.name for f in dataclasses.fields(SimConfig)}
    unknown = sorted(set(spec["config"]) - fields)
    if unknown:
        raise SweepError(f"config.{unknown[0]}: not a simulator setting; expected one of {', '.join(sorted(fields))}")
    result = simulate(topo, workload, SimConfig(**spec["config"]), record_flows=False, track_links="none")
    jobs = {name: {"mean_iteration_s": j.mean_iteration_time(), "jct_s": j.jct, "finish_s": j.finish} for name, j in result.jobs.items()}
    jcts = [j["jct_s"] for j in jobs.values()]
    return {"id": spec_id({k: spec[k] for k in ("topology", "workload", "config")}), "point": spec["point"], "makespan_s": result.makespan,
            "mean_jct_s": sum(jcts) / len(jcts) if jcts else math.nan, "jobs": jobs, "events": result.meta["events"]}


def sweep(topo: Topology, workload: Workload, axes: dict[str, list[Any]], *, config: dict[str, Any] | None = None,
          executor: Executor | None = None, progress: ProgressFn | None = None) -> dict[str, Any]:
    """Simulate every combination of ``axes`` values; rows in the order of ``itertools.product``.

    Every point is validated before any runs, so a bad axis fails at once
    with the field named.
    """
    if not axes:
        raise SweepError("nothing to sweep: give at least one axis")
    executor = executor or get_executor("auto")
    base_workload, base_config = workload.to_dict(), dict(config or {})
    topo_data = topo.to_dict()
    specs = []
    for values in itertools.product(*axes.values()):
        point = dict(zip(axes, values, strict=True))
        w, c = apply_point(base_workload, base_config, point)
        workload_from_dict(w, source=f"sweep point {point}").validate(topo)
        specs.append({"topology": topo_data, "workload": w, "config": c, "point": point})
    rows = executor.map(run_point, specs, progress)
    best = min(rows, key=lambda r: r["mean_jct_s"])
    return {"axes": axes, "executor": executor.name, "rows": rows, "best": {"point": best["point"], "mean_jct_s": best["mean_jct_s"]}}


def format_sweep(table: dict[str, Any]) -> str:
    """The sweep as a text table: one line per point."""
    axes = list(table["axes"])
    jobs = list(table["rows"][0]["jobs"]) if table["rows"] else []
    from topology.clitools import render_table

    columns = [f"{a}>" for a in axes] + ["mean JCT ms>", "makespan ms>"] + [f"{j} iteration ms>" for j in jobs]
    rows = [[str(r["point"][a]) for a in axes] + [f"{r['mean_jct_s'] * 1e3:.4f}", f"{r['makespan_s'] * 1e3:.4f}"]
            + [f"{r['jobs'][j]['mean_iteration_s'] * 1e3:.4f}" for j in jobs] for r in table["rows"]]
    lines = [render_table(columns, rows)]
    lines.append(f"best: {table['best']['point']} (mean JCT {table['best']['mean_jct_s'] * 1e3:.4f} ms) on the {table['executor']} executor")
    return "\n".join(lines)


__all__ = ["SHIPPED_PACKAGES", "Executor", "LocalExecutor", "ProgressFn", "RayExecutor", "SweepError", "apply_point", "eta_progress",
           "format_sweep", "get_executor", "parse_axes", "run_point", "spec_id", "sweep"]
