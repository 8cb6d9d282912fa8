"""The placement planner: jobs file in, per-job hosts, GPUs, rank order, time shift and launch lines out.

Jobs file (YAML or JSON; see ``docs/placement.md``)::

    virtual_clusters:            # optional HiveD quotas, {vc: {cell level: count}}
      research: {host: 2}
    defaults: {compute_ms: 120}  # optional, merged into every job
    jobs:
      - {name: llm, gpus: 16, tp: 8, compute_ms: 150, grad_bytes: 2GB, vc: research, priority: 10}
      - {name: cnn, gpus: 8, compute_s: 0.08, grad_bytes: 500MB}

Policies: ``hived+cassini`` (HiveD buddy candidates, ranked by CASSINI, time
shifts from the affinity graph), ``hived`` (the buddy allocator's first
choice, no shifts) and ``first-fit`` (the first idle GPUs in topology order,
contention-blind).

Rank order: hosts in the order of the job's cells, GPUs of a host by local
index, so that tensor-parallel groups (``tp`` consecutive ranks) stay inside
one NVLink domain and data-parallel peers (same local index) sit on the same
rail. The start offset is CASSINI's time shift: delay the first iteration by
that many seconds (exported as ``NETWEAVE_START_OFFSET_S`` in the launch line).

>>> import topology
>>> t = topology.default_cluster()
>>> p = plan_jobs(t, [JobSpec("a", 16, grad_bytes=1e9), JobSpec("b", 4)], policy="hived")
>>> [(j["name"], j["hosts"]) for j in p["jobs"]]
[('a', ['node0', 'node1']), ('b', ['node2'])]
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from topology.errors import InputError
from topology.inputs import check_name, check_number, loads_yaml, read_text
from topology.limits import MAX_BYTES, MAX_ITERATIONS, MAX_JOB_GPUS, MAX_JOBS, MAX_SECONDS
from topology.model import Topology
from topology.schema import load_schema, validate

from .cassini import rank_candidates, time_shifts
from .hived import HivedScheduler
from .profiles import CommProfile, JobSpec, comm_profile, parse_job

POLICIES = ("hived+cassini", "hived", "first-fit")
PLAN_FORMAT = "netweave-placement-plan"


def load_jobs(path: str | Path) -> tuple[list[JobSpec], dict[str, Any]]:
    """Read a jobs file: the job specs and the virtual clusters (empty when none)."""
    jf = load_jobs_file(path)
    return jf.jobs, jf.virtual_clusters


def loads_jobs(text: str, *, source: str | None = None) -> tuple[list[JobSpec], dict[str, Any]]:
    """Parse a jobs file's text: the job specs and the virtual clusters (``source``: its path, for errors and relative paths)."""
    jf = loads_jobs_file(text, source=source)
    return jf.jobs, jf.virtual_clusters


@dataclass(frozen=True)
class JobsFile:
    """Everything a jobs file says: jobs, virtual clusters, and for ``netweave launch`` host addresses and interfaces."""

    jobs: list[JobSpec]
    virtual_clusters: dict[str, Any]
    addresses: dict[str, str] = field(default_factory=dict)    # host -> address torchrun's master is reached at
    interfaces: dict[str, str] = field(default_factory=dict)   # host (or "*") -> network interface for gloo/NCCL sockets


def load_jobs_file(path: str | Path) -> JobsFile:
    """Read a jobs file with its launch sections (``addresses``, ``interfaces``)."""
    return loads_jobs_file(read_text(path), source=str(path))


def loads_jobs_file(text: str, *, source: str | None = None) -> JobsFile:
    data = loads_yaml(text, source=source)  # YAML is a superset of JSON
    validate(data, load_schema("placement", "jobs"), source=source)  # the structure; the cross-checks follow
    if isinstance(data, list):
        data = {"jobs": data}
    if not isinstance(data, Mapping):
        raise InputError("expected a mapping with a 'jobs' list (or a list of jobs)", source=source)
    unknown = set(data) - {"jobs", "virtual_clusters", "defaults", "addresses", "interfaces"}
    if unknown:
        raise InputError(f"unknown top-level field {sorted(unknown)[0]!r}; expected jobs, virtual_clusters, defaults, addresses, interfaces",
                         source=source)
    items = data.get("jobs")
    if not isinstance(items, list) or not items:
        raise InputError("expected a non-empty list of jobs", source=source, where="jobs")
    if len(items) > MAX_JOBS:
        raise InputError(f"{len(items)} jobs, more than {MAX_JOBS} (the limit)", source=source, where="jobs")
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, Mapping):
        raise InputError("expected a mapping", source=source, where="defaults")
    base_dir = Path(source).parent if source else None
    jobs = [parse_job(item, f"jobs[{i}]", source, defaults=defaults, base_dir=base_dir) for i, item in enumerate(items)]
    names = [j.name for j in jobs]
    for i, n in enumerate(names):
        if names.index(n) != i:
            raise InputError(f"job name {n!r} is used twice (also jobs[{names.index(n)}])", source=source, where=f"jobs[{i}].name")
    vcs = data.get("virtual_clusters") or {}
    if not isinstance(vcs, Mapping):
        raise InputError("expected a mapping of VC name to quota", source=source, where="virtual_clusters")
    check_job_names_and_bounds(jobs, vcs, source=source)
    for i, j in enumerate(jobs):
        if j.vc is not None and j.vc not in vcs:
            raise InputError(f"unknown virtual cluster {j.vc!r}; expected one of {', '.join(vcs) or '(none defined)'}", source=source,
                             where=f"jobs[{i}].vc")
    return JobsFile(jobs, dict(vcs), _host_map(data.get("addresses"), "addresses", source), _host_map(data.get("interfaces"), "interfaces", source))


def _host_map(raw: Any, key: str, source: str | None) -> dict[str, str]:
    """A ``{host: value}`` section; values are addresses or interface names, checked as shell-safe words."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise InputError("expected a mapping of host name to " + ("address" if key == "addresses" else "interface"), source=source, where=key)
    out = {}
    for host, value in raw.items():
        value = str(value) if isinstance(value, str | int) and not isinstance(value, bool) else None
        if not isinstance(host, str) or value is None:
            raise InputError(f"expected host: value, got {host!r}: {raw[host]!r}", source=source, where=f"{key}.{host}")
        why = check_host_value(key, value)
        if why:
            raise InputError(why, source=source, where=f"{key}.{host}")
        out[host] = value
    return out


_ADDRESS_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9.:_-]{0,252}")
_IFNAME_RE = re.compile(r"[=^]?[A-Za-z0-9][A-Za-z0-9._:@-]{0,14}(,[=^]?[A-Za-z0-9][A-Za-z0-9._:@-]{0,14})*")


def check_host_value(kind: str, value: str) -> str | None:
    """Why ``value`` is not a valid address (``kind="addresses"``) or interface list (``"interfaces"``), or None.

    >>> check_host_value("addresses", "10.0.0.1"), check_host_value("interfaces", "eth0; rm")
    (None, "expected an interface name or NCCL-style list (eth0, =eth0, ^docker), got 'eth0; rm'")
    """
    if kind == "addresses":
        return None if _ADDRESS_RE.fullmatch(value) else f"expected a host name or IP address, got {value!r}"
    return None if _IFNAME_RE.fullmatch(value) else f"expected an interface name or NCCL-style list (eth0, =eth0, ^docker), got {value!r}"


def check_job_names_and_bounds(jobs: Sequence[JobSpec], vcs: Mapping[str, Any], *, source: str | None = None) -> None:
    """Names that become file names, hostfile names and shell words are safe; counts are within :mod:`topology.limits`.

    Job names name the hostfiles ``place plan --hostfiles DIR`` writes (``DIR/<name>.hostfile``), so a name
    such as ``../../x`` would escape ``DIR``.

    >>> check_job_names_and_bounds([JobSpec("../../escaped", 1)], {})
    Traceback (most recent call last):
    ...
    topology.errors.InputError: jobs[0].name: expected a job name of letters, digits and . _ - + @ : (...), got '../../escaped'
    """
    for vc in vcs:
        check_name(vc, what="virtual-cluster name", source=source, where="virtual_clusters")
    for i, j in enumerate(jobs):
        where = f"jobs[{i}]"
        check_name(j.name, what="job name", source=source, where=f"{where}.name")
        check_number(j.gpus, what="a GPU count", source=source, where=f"{where}.gpus", integer=True, minimum=1, maximum=MAX_JOB_GPUS)
        check_number(j.iterations, what="an iteration count", source=source, where=f"{where}.iterations", integer=True, minimum=1,
                     maximum=MAX_ITERATIONS)
        for name, value, hi in (("compute", j.compute_s, MAX_SECONDS), ("arrival", j.arrival, MAX_SECONDS), ("grad_bytes", j.grad_bytes, MAX_BYTES)):
            check_number(value, what=f"{name} <= {hi:g}", source=source, where=f"{where}.{name}", maximum=hi)
        if j.gpu_model is not None and not isinstance(j.gpu_model, str):
            raise InputError(f"expected a GPU model name, got {j.gpu_model!r}", source=source, where=f"{where}.gpu_model")


def rank_order(topo: Topology, gpus: Sequence[str]) -> list[str]:
    """GPUs in rank order: hosts in first-appearance order, then by local GPU index (the rail on DGX)."""
    first: dict[str, int] = {}
    for g in gpus:
        first.setdefault(topo.host_of(g), len(first))
    return sorted(gpus, key=lambda g: (first[topo.host_of(g)], topo.graph.nodes[g].get("index", 0), g))


def _check_tp(topo: Topology, spec: JobSpec, ordered: Sequence[str]) -> str | None:
    """Why ``ordered`` cannot host the job's tensor-parallel groups inside NVLink domains, or None."""
    if spec.tp <= 1:
        return None
    for k in range(0, len(ordered), spec.tp):
        group = ordered[k : k + spec.tp]
        domains = {topo.graph.nodes[g].get("domain") or topo.host_of(g) for g in group}
        if len(domains) > 1:
            return f"tensor-parallel group of {spec.tp} ranks {k}..{k + spec.tp - 1} would span NVLink domains {sorted(domains)}"
    return None


def launch_lines(topo: Topology, spec: JobSpec, ordered: Sequence[str], shift_s: float, *, script: str = "train.py",
                 port: int = 29500, args: Sequence[str] = ()) -> dict[str, Any]:
    """Per-host torchrun command lines (``script`` with ``args``), CUDA_VISIBLE_DEVICES and a Slurm hostfile (one line per rank).

    ``port``: the job's master port; give every job that can run at the same time its own (:func:`plan_jobs` does).
    """
    hosts: dict[str, list[str]] = {}
    for g in ordered:
        hosts.setdefault(topo.host_of(g), []).append(g)
    master = next(iter(hosts))
    out = []
    for rank, (host, gs) in enumerate(hosts.items()):
        cvd = ",".join(str(topo.graph.nodes[g].get("index", i)) for i, g in enumerate(gs))
        cmd = (f"CUDA_VISIBLE_DEVICES={cvd} NETWEAVE_START_OFFSET_S={shift_s:.6f} torchrun --nnodes={len(hosts)} "
               f"--nproc-per-node={len(gs)} --node-rank={rank} --master-addr={shlex.quote(master)} --master-port={port} "
               f"{shlex.join([script, *args])}")
        out.append({"host": host, "node_rank": rank, "cuda_visible_devices": cvd, "gpus": gs, "command": cmd})
    hostfile = "".join(f"{topo.host_of(g)}\n" for g in ordered)
    return {"per_host": out, "slurm_hostfile": hostfile, "master_addr": master, "master_port": port}


def job_ports(jobs: Sequence[JobSpec], base_port: int = 29500) -> dict[str, int]:
    """A master port per job, all distinct: the job's own ``launch.port``, else the next unused one from ``base_port``.

    >>> job_ports([JobSpec("a", 1), JobSpec("b", 1)])
    {'a': 29500, 'b': 29501}
    """
    fixed = {j.name: j.launch.port for j in jobs if j.launch.port is not None}
    seen: dict[int, str] = {}
    for name, port in fixed.items():
        if port in seen:
            raise InputError(f"jobs {seen[port]!r} and {name!r} both ask for port {port}", where="port")
        seen[port] = name
    out, nxt = {}, base_port
    for j in jobs:
        if j.name in fixed:
            out[j.name] = fixed[j.name]
            continue
        while nxt in seen:
            nxt += 1
        if nxt > 65535:
            raise InputError(f"no free port left from {base_port} for job {j.name!r}", where="--base-port")
        seen[nxt] = j.name
        out[j.name] = nxt
    return out


def _first_fit(topo: Topology, busy: set[str], n: int) -> list[str] | None:
    free = [g for g in topo.gpus() if g not in busy]
    return free[:n] if len(free) >= n else None


def plan_jobs(topo: Topology, jobs: Sequence[JobSpec], *, virtual_clusters: Mapping[str, Any] | None = None,
              policy: str = "hived+cassini", candidates: int = 4, routing: str = "rail", script: str = "train.py",
              script_args: Sequence[str] = (), base_port: int = 29500, failed: Sequence[str] = (),
              scheduler: HivedScheduler | None = None) -> dict[str, Any]:
    """Place ``jobs`` in order on ``topo``; returns the plan as data (see the module docstring).

    ``failed`` names GPUs or hosts that are bad: no job is placed on them (HiveD marks their cells bad, first-fit skips them).

    Launch lines run a job's own ``launch.script``/``args`` when it has one, else ``script`` with ``script_args``.
    Every placed job gets its own master port (its ``launch.port``, else the next free one from ``base_port``),
    so that two jobs whose first host is the same do not both listen on one port.

    ``scheduler``: an allocator that already holds running jobs (a state file, :mod:`placement.state`); the new
    jobs get other GPUs, and stay in it. Not with ``first-fit``.
    """
    if policy not in POLICIES:
        raise InputError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}", where="--policy")
    if scheduler is not None and policy == "first-fit":
        raise InputError("a planner state needs a HiveD policy (hived or hived+cassini), not first-fit", where="--policy")
    sched = scheduler if scheduler is not None else HivedScheduler(topo, virtual_clusters or {}) if policy != "first-fit" else None
    busy: set[str] = set()
    if failed:
        hosts = set(topo.hosts())
        busy = {g for name in failed for g in (topo.gpus(host=name) if name in hosts else [topo.resolve_gpu(name)])}
        if sched is not None:
            sched.fail(failed)
    placed: dict[str, tuple[JobSpec, list[str], CommProfile]] = {}
    rows: list[dict[str, Any]] = []
    fixed: dict[str, float] = {}
    for spec in jobs:
        reason = None
        gpus: list[str] | None = None
        considered = 0
        if sched is None:
            gpus = _first_fit(topo, busy, spec.gpus)
            if gpus is None:
                reason = {"resource": "gpus", "level": "cluster", "message": f"needs {spec.gpus} GPUs, {len(topo.gpus()) - len(busy)} idle"}
        else:
            limit = candidates if policy == "hived+cassini" else 1
            cands = sched.candidates(spec.name, spec.gpus, vc=spec.vc, priority=spec.priority, chain=spec.gpu_model, limit=limit)
            cands = [c for c in cands if c.ok and not c.preempted] or cands[:1]
            usable = []
            for c in cands:
                if not c.ok:
                    reason = c.reason
                    continue
                why = _check_tp(topo, spec, rank_order(topo, c.gpus))
                if why:
                    reason = {"resource": "nvlink-domain", "level": "host", "message": why}
                    continue
                usable.append(c)
            considered = len(usable)
            if usable:
                pick = usable[0]
                if policy == "hived+cassini" and len(usable) > 1:
                    profs = [comm_profile(topo, spec, rank_order(topo, c.gpus), policy=routing) for c in usable]
                    running = {n: (p, fixed.get(n, 0.0)) for n, (_, _, p) in placed.items()}
                    ranked = rank_candidates(topo, running, profs)
                    pick = usable[ranked[0].index]
                res = sched.allocate(spec.name, spec.gpus, vc=spec.vc, priority=spec.priority, chain=spec.gpu_model, plan=pick.plan)
                gpus = res.gpus
        if gpus is None:
            rows.append({"name": spec.name, "placed": False, "reason": reason})
            continue
        ordered = rank_order(topo, gpus)
        why = _check_tp(topo, spec, ordered)
        if why:  # first-fit can split a TP group
            if sched is not None:
                sched.free(spec.name)
            rows.append({"name": spec.name, "placed": False, "reason": {"resource": "nvlink-domain", "level": "host", "message": why}})
            continue
        busy.update(gpus)
        prof = comm_profile(topo, spec, ordered, policy=routing)
        placed[spec.name] = (spec, ordered, prof)
        fixed[spec.name] = 0.0
        rows.append({"name": spec.name, "placed": True, "gpus": ordered, "candidates": considered})
    # time shifts for everything placed, by BFS over the affinity graph (CASSINI); contention-blind policies start at once
    profiles = {n: p for n, (_, _, p) in placed.items()}
    shifts = time_shifts(profiles, topo) if policy == "hived+cassini" else None
    ports = job_ports([placed[r["name"]][0] for r in rows if r["placed"]], base_port)
    for row in rows:
        if not row["placed"]:
            continue
        spec, ordered, prof = placed[row["name"]]
        shift = shifts.shifts.get(spec.name, 0.0) if shifts else 0.0
        hosts = list(dict.fromkeys(topo.host_of(g) for g in ordered))
        row.update({
            "hosts": hosts,
            "cuda_visible_devices": {h: ",".join(str(topo.graph.nodes[g].get("index")) for g in ordered if topo.host_of(g) == h) for h in hosts},
            "ranks": {g: r for r, g in enumerate(ordered)},
            "start_offset_s": shift,
            "iteration_s": prof.period_s, "comm_s": prof.comm_s, "network_links": len(prof.link_rates),
            "launch": launch_lines(topo, spec, ordered, shift, script=spec.launch.script or script,
                                   args=spec.launch.args if spec.launch.script else tuple(script_args), port=ports[spec.name]),
        })
    out = {"format": PLAN_FORMAT, "version": 1, "topology": topo.name, "policy": policy, "routing": routing,
           "jobs": rows, "placed": sum(r["placed"] for r in rows), "unplaced": sum(not r["placed"] for r in rows)}
    if shifts is not None:
        out["cassini"] = {"perimeter_s": shifts.perimeter_s, "cycles": shifts.cycles, "inconsistent_loops": shifts.inconsistent_loops,
                          "shared_links": len(shifts.link_scores),
                          "min_link_score": min(shifts.link_scores.values(), default=1.0)}
    if sched is not None:
        out["guarantees"] = sched.guarantee_report()
    return out


def plan_text(plan: Mapping[str, Any]) -> str:
    """A human summary of a plan."""
    lines = [f"placement plan on {plan['topology']} ({plan['policy']}): {plan['placed']} placed, {plan['unplaced']} not placed"]
    for j in plan["jobs"]:
        if not j["placed"]:
            r = j["reason"] or {}
            lines.append(f"  {j['name']}: NOT PLACED -- {r.get('message', 'no reason')} (resource {r.get('resource')}, level {r.get('level')})")
            continue
        cvd = "; ".join(f"{h}: {v}" for h, v in j["cuda_visible_devices"].items())
        lines.append(f"  {j['name']}: {len(j['gpus'])} GPUs on {', '.join(j['hosts'])}  [{cvd}]  shift {j['start_offset_s'] * 1e3:.2f} ms, "
                     f"iteration {j['iteration_s'] * 1e3:.1f} ms")
        for h in j["launch"]["per_host"]:
            lines.append(f"      {h['command']}")
    if "cassini" in plan:
        c = plan["cassini"]
        lines.append(f"  CASSINI: {c['shared_links']} shared links, min compatibility {c['min_link_score']:.3f}, "
                     f"unified circle {c['perimeter_s'] * 1e3:.1f} ms, {c['cycles']} affinity cycles ({c['inconsistent_loops']} inconsistent)")
    return "\n".join(lines)


def dumps_plan(plan: Mapping[str, Any]) -> str:
    return json.dumps(plan, indent=1, default=str) + "\n"
