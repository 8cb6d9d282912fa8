"""``netweave launch``: from a cluster and a jobs file to one launchable bundle per job.

For every job of the jobs file this runs the planners in order and writes what a launch needs:

1. **model and parallelism**: the job's model (a GPT/Llama description or a measured ``netweave pipe profile``)
   gives its compute time and gradient bytes when the jobs file does not; ``parallelism: auto`` picks the smallest
   pipeline depth whose plan fits in GPU memory (fewer stages, fewer bubbles), data parallelism over the rest;
2. **placement** (:func:`placement.planner.plan_jobs`): HiveD cells, rank order, CASSINI start offsets, a master
   port per job (no two jobs of one launch share one);
3. **pipeline** (pp > 1, :func:`pipesched.plan.plan`) on the job's own GPUs: stages, per-stage recomputation and the
   schedule, as torch's public class for the family or as torch's schedule CSV;
4. **in-job communication** (:mod:`flowsched.intrajob`): the data-parallel policy (DDP, ByteScheduler, Prophet) and its
   knobs, tuned on the model's gradient profile over the job's all-reduce bandwidth;
5. **cross-job classes** (:func:`flowsched.coflow.sincronia_order` over each job's per-iteration coflow, then
   :func:`flowsched.plan.plan_from_order`): a priority class and DSCP per job;
6. **NCCL environment by fabric** (:func:`flowsched.ncclhook.fabric_env`): the project's net plugin on TCP fabrics,
   NCCL's own IB transport with ``NCCL_IB_TC``/``NCCL_IB_SL`` on InfiniBand and RoCE, the ``LD_PRELOAD`` marker for
   gloo jobs.

Output, ``DIR/<job>/``: ``plan.json`` (:mod:`netweave.runtime.plan`), ``launch-<host>.sh`` per host, ``job.sbatch``,
``hostfile`` and, on TCP fabrics, ``nccl.plan``; ``DIR/launch.json`` (a summary) and ``DIR/flows.json`` (the cross-job
flow plan, for ``netweave flow apply``). The bundle is built in a temporary directory beside ``DIR`` and renamed
into place; an existing job directory is swapped with the new one in one ``renameat2(RENAME_EXCHANGE)``.

>>> import topology, tempfile, pathlib
>>> from placement.planner import loads_jobs_file
>>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / "train.py").write_text("")
>>> jf = loads_jobs_file("jobs: [{name: a, gpus: 16, script: train.py}, {name: b, gpus: 8, script: train.py}]",
...                      source=str(d / "jobs.yaml"))
>>> lp = plan_launch(topology.default_cluster(), jf, jobs_source=str(d / "jobs.yaml"))
>>> [(b.plan.job, b.plan.rendezvous.port, len(b.host_scripts)) for b in lp.bundles]
[('a', 29500, 2), ('b', 29501, 1)]
>>> sorted(write_bundles(lp, d / "out"))[:3]
['a/hostfile', 'a/job.sbatch', 'a/launch-node0.sh']
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import errno
import json
import math
import os
import shlex
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from netweave.runtime import plan as jp
from placement.planner import JobsFile, plan_jobs
from placement.profiles import JobSpec, dp_groups
from topology.errors import InputError
from topology.io import _umask, atomic_write_text
from topology.model import Topology

PIPELINE_FAMILIES = ("1f1b", "zbh1", "interleaved", "gpipe")   # what `schedule: auto` tries (Chimera is not exportable)
# Families whose torch class the runtime has run (tests/test_runtime_example.py); the others run from the plan's CSV.
RUNTIME_TORCH_FAMILIES = ("1f1b", "gpipe", "interleaved")
RANK_LAYOUT = "pp-dp-tp: rank (s*dp + d)*tp + t is pipeline stage s, replica d, tensor rank t"
MiB = 1024 * 1024


@dataclass
class JobBundle:
    """One job's bundle, in memory: the plan and the text of every file."""

    plan: jp.JobPlan
    host_scripts: dict[str, str]          # host -> launch-<host>.sh
    sbatch: str
    hostfile: str
    nccl_plan: str | None = None          # the net plugin's plan file (TCP fabrics)


@dataclass
class LaunchPlan:
    """Everything ``netweave launch`` writes, before it is written."""

    bundles: list[JobBundle]
    transport: str
    placement: dict[str, Any]
    flow_plan: Any                        # flowsched.plan.FlowPlan
    out: Path | None = None               # where the bundles will live (scripts name it); None: not yet known

    def summary(self) -> dict[str, Any]:
        return {"format": "netweave-launch", "version": 1, "transport": self.transport, "topology": self.placement.get("topology"),
                "jobs": [{"job": b.plan.job, "dir": b.plan.job, "hosts": [h.host for h in b.plan.hosts], "world_size": b.plan.world_size,
                          "parallelism": dataclasses.asdict(b.plan.parallelism), "rendezvous": dataclasses.asdict(b.plan.rendezvous),
                          "traffic": dataclasses.asdict(b.plan.traffic), "start_offset_s": b.plan.start_offset_s, "period_s": b.plan.period_s,
                          "pipeline": None if b.plan.pipeline is None else {"schedule": b.plan.pipeline.schedule,
                                                                              "torch_class": b.plan.pipeline.torch_class,
                                                                              "recompute": [s.recompute for s in b.plan.pipeline.stages]},
                          "data_parallel": None if b.plan.data_parallel is None else b.plan.data_parallel.policy,
                          "scripts": [f"launch-{h.host}.sh" for h in b.plan.hosts]} for b in self.bundles]}


# ----------------------------------------------------------------------------------------------- planning --
def plan_launch(topo: Topology, jobs_file: JobsFile, *, jobs_source: str, policy: str = "hived+cassini", routing: str = "rail",
                candidates: int = 4, transport: str | None = None, base_port: int = 29500, addresses: Mapping[str, str] | None = None,
                interfaces: Mapping[str, str] | None = None, out: str | os.PathLike[str] | None = None,
                lib_dir: str | os.PathLike[str] | None = None) -> LaunchPlan:
    """Plan every job of ``jobs_file`` on ``topo`` and render its bundle (see the module docstring).

    ``addresses``/``interfaces`` (host -> address / interface; ``"*"`` for every host) add to the jobs file's sections
    and win over them. ``out``: the output directory the Slurm script records (default: found at run time only).
    ``lib_dir``: where the scripts find the NCCL plugin and marker (default this checkout's ``csrc/build``).
    Errors are :class:`~topology.errors.InputError` naming the jobs file and field.
    """
    from flowsched import ncclhook

    specs = list(jobs_file.jobs)
    for i, spec in enumerate(specs):
        if not jp.NAME_RE.fullmatch(spec.name):
            raise InputError(f"job name {spec.name!r} cannot name a directory (expected {jp.NAME_RE.pattern})", source=jobs_source,
                             where=f"jobs[{i}].name")
        if spec.launch.script is None:
            raise InputError("expected the training script's path (script: train.py)", source=jobs_source, where=f"jobs[{i}].script")
    transport = ncclhook.fabric_transport(topo, transport)
    addr = {**jobs_file.addresses, **(addresses or {})}
    ifaces = {**jobs_file.interfaces, **(interfaces or {})}
    models = [_model_profile(s, i, jobs_source) for i, s in enumerate(specs)]
    specs = [_with_model(topo, s, m, i, jobs_source) for i, (s, m) in enumerate(zip(specs, models, strict=True))]
    placement = plan_jobs(topo, specs, virtual_clusters=jobs_file.virtual_clusters, policy=policy, candidates=candidates, routing=routing,
                          base_port=base_port)
    rows = {r["name"]: r for r in placement["jobs"]}
    for i, s in enumerate(specs):
        r = rows[s.name]
        if not r["placed"]:
            raise InputError(f"job {s.name!r} cannot be placed: {(r.get('reason') or {}).get('message', 'no reason given')}", source=jobs_source,
                             where=f"jobs[{i}].gpus")
    gpus = {s.name: list(rows[s.name]["gpus"]) for s in specs}
    pipes = {s.name: _pipeline_plan(topo, s, prof, [gpus[s.name][k * s.dp * s.tp] for k in range(s.pp)], i, jobs_source)
             for i, (s, prof) in enumerate(zip(specs, models, strict=True)) if s.pp > 1}
    p2p = {s.name: pipeline_flows(pipes[s.name], s, gpus[s.name], prof) for s, prof in zip(specs, models, strict=True) if s.name in pipes}
    if policy == "hived+cassini" and any(p2p.values()):   # placement's shifts saw only all-reduces: redo them with the pipelines' traffic
        for name, shift in cassini_offsets(topo, specs, gpus, p2p, routing=routing).items():
            rows[name]["start_offset_s"] = shift
    flow_plan = cross_job_classes(topo, specs, gpus, p2p)
    needs_lib = transport == "tcp" or any(s.launch.backend == "gloo" or s.launch.nccl_plugins for s in specs)
    lib = Path(lib_dir) if lib_dir is not None else (ncclhook.build() if needs_lib else ncclhook.BUILD)
    out_path = Path(out).resolve() if out is not None else None
    bundles = []
    for i, (s, prof) in enumerate(zip(specs, models, strict=True)):
        priority = next(r.priority for r in flow_plan.rules(rows[s.name]["hosts"][0]) if r.job == s.name)
        bundles.append(_bundle(topo, s, prof, i, rows[s.name], priority, pipes.get(s.name), transport=transport, addresses=addr, interfaces=ifaces,
                               jobs_source=jobs_source, placement=placement, lib=lib, out=out_path))
    return LaunchPlan(bundles, transport, placement, flow_plan, out_path)


def _model_profile(spec: JobSpec, i: int, source: str):
    """The job's :class:`pipesched.profile.ModelProfile`, or None when the jobs file gives no model."""
    from pipesched.profile import analytic_profile, config_from_dict, load_model_config, load_profile

    model = spec.launch.model
    if model is None:
        if spec.launch.auto or spec.pp > 1:
            raise InputError(f"{'parallelism: auto' if spec.launch.auto else f'pp = {spec.pp}'} needs the job's model "
                             "(a GPT/Llama description, or a `netweave pipe profile` file)", source=source, where=f"jobs[{i}].model")
        return None
    try:
        if isinstance(model, Mapping):
            return analytic_profile(config_from_dict(dict(model), source=f"jobs[{i}].model"))
        if not isinstance(model, str):
            raise InputError(f"expected a model description (mapping) or a file path, got {model!r}")
        path = Path(model).expanduser()
        if not path.is_absolute():
            path = Path(source).parent / path
        if not path.is_file():
            raise InputError(f"no such model file: {str(path)!r}")
        head = path.read_text(errors="replace")[:4096]
        if '"netweave-pipe-profile"' in head:
            return load_profile(path)
        return analytic_profile(load_model_config(path))
    except InputError as exc:
        raise InputError(str(exc), source=source, where=f"jobs[{i}].model") from None
    except (UnicodeDecodeError, OSError) as exc:  # a binary or unreadable model file
        raise InputError(f"cannot read the model file ({exc})", source=source, where=f"jobs[{i}].model") from None


def _reference_speed(topo: Topology, prof) -> float:
    """How much faster the cluster's first GPU is than the profile's reference device."""
    from pipesched.devices import devices_from_topology

    devices, _ = devices_from_topology(topo, count=1, reference_tflops=prof.reference.get("tflops"))
    return devices[0].speed


def _per_tp(prof, tp: int):
    """The profile as one tensor-parallel rank runs it: times / tp (ideal speed-up; the TP all-reduces are not modelled)."""
    return prof if tp == 1 else prof.scaled(1.0 / tp)


def _pipeline_plan(topo: Topology, spec: JobSpec, prof, gpus: Sequence[str], i: int, source: str, *, pp: int | None = None):
    """The best pipeline plan of the job's families on ``gpus`` (one per stage position), or an error naming the field."""
    from pipesched.devices import Device, devices_from_topology
    from pipesched.partition import PlanError
    from pipesched.plan import plan
    from pipesched.schedules import ScheduleError

    pp = pp or spec.pp
    lp = spec.launch
    where = f"jobs[{i}].pp"
    if pp > len(prof.layers):
        raise InputError(f"pp = {pp} stages but the model has {len(prof.layers)} layers (embedding, blocks, head)", source=source, where=where)
    m = lp.microbatches or 2 * pp
    devices, links = devices_from_topology(topo, gpus=list(gpus), reference_tflops=prof.reference.get("tflops"))
    if lp.memory is not None:
        devices = [Device(d.name, d.speed, lp.memory) for d in devices]
    families = PIPELINE_FAMILIES if lp.schedule == "auto" else (lp.schedule,)
    found, why = [], []
    for fam in families:
        try:
            cand = plan(_per_tp(prof, spec.tp), devices, links, microbatches=m, schedule=fam, chunks=lp.chunks)
        except (PlanError, ScheduleError) as exc:
            why.append(f"{fam}: {exc.message if hasattr(exc, 'message') else exc}")
            continue
        if cand.memory_ok:
            found.append(cand)
        else:
            why.append(f"{fam}: " + "; ".join(cand.problems))
    if not found:
        field_name = "schedule" if lp.schedule != "auto" and len(why) == 1 else ("model" if pp <= len(prof.layers) else "pp")
        raise InputError(f"the model cannot be split into {pp} pipeline stages as planned ({'; '.join(why)})", source=source,
                         where=f"jobs[{i}].{field_name}")
    return min(found, key=lambda c: c.sim.makespan)


def _with_model(topo: Topology, spec: JobSpec, prof, i: int, source: str) -> JobSpec:
    """``spec`` with its parallelism resolved (``auto``) and compute time and gradient bytes derived from the model
    where the jobs file does not give them. The pipeline estimate here runs on the cluster's first GPUs (placement
    is not known yet); the bundle's plan is made again on the job's own GPUs."""
    if prof is None:
        return spec
    given = spec.launch.given
    if spec.launch.auto:
        spec = dataclasses.replace(spec, pp=_auto_pp(topo, spec, prof, i, source))
    speed = _reference_speed(topo, prof)
    if spec.pp > 1:
        compute = _pipeline_plan(topo, spec, prof, topo.gpus()[: spec.pp], i, source).sim.makespan
    else:
        m = spec.launch.microbatches or 1
        compute = m * sum(lay.fwd_s + lay.bwd_s for lay in _per_tp(prof, spec.tp).layers) / speed
    changes: dict[str, Any] = {}
    if not given & {"compute", "compute_s", "compute_ms"}:
        changes["compute_s"] = compute
    if "grad_bytes" not in given:
        changes["grad_bytes"] = float(sum(lay.param_bytes for lay in prof.layers))
    return dataclasses.replace(spec, **changes)


def _auto_pp(topo: Topology, spec: JobSpec, prof, i: int, source: str) -> int:
    """``parallelism: auto``: the smallest pipeline depth dividing the job's GPUs (over tp) whose plan fits in memory.

    Deeper pipelines only add bubbles and stage-boundary traffic; data parallelism takes the rest of the GPUs.
    """
    ways = spec.gpus // spec.tp
    tried = []
    for pp in (p for p in range(1, ways + 1) if ways % p == 0 and p <= len(prof.layers)):
        if pp > len(topo.gpus()):
            break
        try:
            _pipeline_plan(topo, dataclasses.replace(spec, pp=pp), prof, topo.gpus()[:pp], i, source, pp=pp)
            return pp
        except InputError as exc:
            tried.append(f"pp={pp}: {exc.message}")
    raise InputError("parallelism: auto found no pipeline depth whose plan fits in memory (" + "; ".join(tried[-2:]) + ")", source=source,
                     where=f"jobs[{i}].parallelism")


def pipeline_flows(p, spec: JobSpec, gpus: Sequence[str], prof) -> list[tuple[str, str, float]]:
    """One iteration's pipeline traffic of a job as ``(src GPU, dst GPU, bytes)``: at every stage boundary that changes
    pipeline rank, each micro-batch's activation forward and its gradient back, for every (replica, tensor rank)."""
    sched = p.schedule
    spans = [p.partition.stages[sched.stage_layers[sid]].layers for sid in range(sched.num_stages)]
    dp, tp = spec.dp, spec.tp
    out = []
    for sid in range(sched.num_stages - 1):
        a, b = sched.stage_rank[sid], sched.stage_rank[sid + 1]
        if a == b:
            continue
        nbytes = float(prof.layers[spans[sid][1] - 1].output_bytes) * sched.microbatches
        for d in range(dp):
            for t in range(tp):
                src, dst = gpus[(a * dp + d) * tp + t], gpus[(b * dp + d) * tp + t]
                out += [(src, dst, nbytes), (dst, src, nbytes)]
    return out


def cassini_offsets(topo: Topology, specs: Sequence[JobSpec], gpus: Mapping[str, Sequence[str]],
                    extra_flows: Mapping[str, Sequence[tuple[str, str, float]]], *, routing: str = "rail") -> dict[str, float]:
    """CASSINI's start offsets (:func:`placement.cassini.time_shifts`) over every job's network traffic: placement's
    profile (data-parallel all-reduces) plus ``extra_flows`` per iteration (e.g. :func:`pipeline_flows`).

    Deviation, stated: a pipeline's activations cross its stage boundaries all through the iteration; the profile lumps
    them into one communication arc at the end of the iteration, as long as the busiest link needs to carry them, and
    takes that arc out of the compute time, so the job's period stays the pipeline plan's.

    >>> import topology
    >>> t = topology.fabrics.star(3, gpus_per_host=2)
    >>> a, b = JobSpec("a", 2, compute_s=0.1, grad_bytes=0.0, pp=2), JobSpec("b", 2, compute_s=0.1, grad_bytes=0.0, pp=2)
    >>> g = {"a": ["n0/gpu0", "n1/gpu0"], "b": ["n1/gpu1", "n2/gpu0"]}
    >>> flows = {"a": [("n0/gpu0", "n1/gpu0", 1e9)], "b": [("n2/gpu0", "n1/gpu1", 1e9)]}
    >>> off = cassini_offsets(t, [a, b], g, flows)
    >>> off["a"], round(off["b"], 3)    # b's activations enter n1's downlink while a's are done
    (0.0, 0.04)
    """
    from placement.cassini import time_shifts
    from placement.profiles import CommProfile, comm_profile
    from topology.model import LinkKind
    from topology.routing import route_flows

    g = topo.graph
    profiles = {}
    for s in specs:
        prof = comm_profile(topo, s, list(gpus[s.name]), policy=routing)
        loads = {e: b / 1e9 for e, b in route_flows(topo, extra_flows.get(s.name, ()), routing).items()
                 if g.edges[e]["kind"] == LinkKind.NETWORK and b > 0}
        if loads:
            link_bytes = dict(prof.link_bytes)
            for e, b in loads.items():
                link_bytes[e] = link_bytes.get(e, 0.0) + b
            busy = max(b / g.edges[e]["bw"] for e, b in loads.items())
            comm = prof.comm_s + busy
            prof = CommProfile(s.name, prof.gpus, max(prof.compute_s - busy, 0.0), comm, {e: b / comm for e, b in link_bytes.items()}, link_bytes)
        profiles[s.name] = prof
    return dict(time_shifts(profiles, topo).shifts)


def cross_job_classes(topo: Topology, specs: Sequence[JobSpec], gpus: Mapping[str, Sequence[str]],
                      extra_flows: Mapping[str, Sequence[tuple[str, str, float]]] | None = None):
    """The cross-job flow plan: Sincronia's order over every job's per-iteration coflow (its data-parallel all-reduces
    and ``extra_flows``, e.g. :func:`pipeline_flows`, between hosts, on the hosts' NIC capacities), mapped onto priority
    classes (:func:`flowsched.plan.plan_from_order`).

    >>> import topology
    >>> t = topology.default_cluster()
    >>> p = cross_job_classes(t, [JobSpec("big", 16, grad_bytes=8e9), JobSpec("small", 16, grad_bytes=1e8)],
    ...                       {"big": t.gpus()[:16], "small": t.gpus()[16:]})
    >>> p.order, p.meta["classes"]
    (['small', 'big'], {'small': 0, 'big': 4})
    """
    from flowsched.coflow import Coflow, Flow, sincronia_order
    from flowsched.plan import host_capacities, plan_from_order
    from topology.collectives import collective_flows

    egress, ingress = host_capacities(topo)
    capacity = {**{("out", h): bw for h, bw in egress.items()}, **{("in", h): bw for h, bw in ingress.items()}}
    coflows = []
    for s in specs:
        volume: dict[tuple[str, str], float] = {}
        if s.grad_bytes > 0 and s.dp > 1:
            for group in dp_groups(list(gpus[s.name]), s.tp, s.pp):
                for step in collective_flows(topo, "all_reduce", group, s.grad_bytes / (s.tp * s.pp), algorithm=s.algorithm):
                    for f in step:
                        a, b = topo.host_of(f.src), topo.host_of(f.dst)
                        if a != b:
                            volume[(a, b)] = volume.get((a, b), 0.0) + float(f.nbytes)
        for src, dst, nbytes in (extra_flows or {}).get(s.name, ()):
            a, b = topo.host_of(src), topo.host_of(dst)
            if a != b:
                volume[(a, b)] = volume.get((a, b), 0.0) + float(nbytes)
        coflows.append(Coflow(s.name, [Flow(a, b, v) for (a, b), v in sorted(volume.items())]))
    order = sincronia_order(coflows, capacity)
    hosts = {s.name: list(dict.fromkeys(topo.host_of(g) for g in gpus[s.name])) for s in specs}
    return plan_from_order(order, hosts, policy="sincronia")


def _data_parallel(topo: Topology, spec: JobSpec, prof, gpus: Sequence[str], pipeline) -> tuple[jp.DataParallel, float | None]:
    """The in-job communication plan's policy and knobs, and its modelled iteration time (None without a model).

    With a model the knobs the jobs file leaves open are tuned (:func:`flowsched.intrajob.tune_prophet`,
    :func:`~flowsched.intrajob.tune_bytescheduler`) on the gradient profile of one replica (for pp > 1: the stage with the
    most gradient bytes), over the all-reduce bandwidth of the job's first data-parallel group on ``topo``.
    """
    from flowsched import intrajob
    from flowsched.gradients import analytic_gradient_profile
    from topology.collectives import collective_time

    want = spec.launch.data_parallel
    policy = want.get("policy", "ddp")
    if spec.dp == 1:
        return jp.DataParallel(policy=policy, barrier=want.get("barrier", True), params={"note": "dp = 1: nothing to reduce"}), None
    if prof is None:
        defaults = {"ddp": (None, None, True), "bytescheduler": (4 * MiB, 16 * MiB, False), "prophet": (4 * MiB, 8 * MiB, False)}[policy]
        part = want.get("partition", defaults[0])
        credit = want.get("credit", defaults[1] if "partition" not in want or policy != "prophet" else 2 * part)
        params = {"tuned": False, "why": "no model in the jobs file: the knobs given, else the papers' defaults"}
        if policy == "ddp":
            params["bucket_cap_bytes"] = 25 * MiB
        return jp.DataParallel(policy=policy, partition_bytes=part, credit_bytes=credit, barrier=want.get("barrier", defaults[2]),
                               params=params), None
    layers = list(_per_tp(prof, spec.tp).layers)
    if pipeline is not None:
        spans = [s.layers for s in pipeline.stages]
        lo, hi = max(spans, key=lambda sp: sum(lay.param_bytes for lay in layers[sp[0]:sp[1]]))
        layers = layers[lo:hi]
    speed = _reference_speed(topo, prof)
    group = dp_groups(list(gpus), spec.tp, spec.pp)[0]
    total = float(sum(lay.param_bytes for lay in layers)) / spec.tp
    t_big = collective_time(topo, "all_reduce", group, max(total, 1.0), algorithm=spec.algorithm).time_s
    t_small = collective_time(topo, "all_reduce", group, 1.0, algorithm=spec.algorithm).time_s
    bandwidth = max(total, 1.0) / max(t_big - t_small, 1e-12)
    gp = analytic_gradient_profile([lay.name for lay in layers], [lay.param_bytes / spec.tp for lay in layers],
                                   [lay.fwd_s / speed for lay in layers], [lay.bwd_s / speed for lay in layers],
                                   bandwidth=bandwidth / 1e9, overhead=t_small)
    tuned = True
    if policy == "ddp":
        cp = intrajob.ddp_plan(gp)
        part, credit = None, None
    elif policy == "bytescheduler":
        if "partition" in want and "credit" in want:
            cp, tuned = intrajob.bytescheduler_plan(gp, partition=want["partition"], credit=want["credit"]), False
        else:
            cp = intrajob.tune_bytescheduler(gp, **({"partitions": (want["partition"],)} if "partition" in want else {}))
        part, credit = cp.params["partition"], cp.credit
    else:
        if "partition" in want:
            cp, tuned = intrajob.prophet_plan(gp, partition=want["partition"], credit=want.get("credit")), False
        else:
            cp = intrajob.tune_prophet(gp)
        part, credit = cp.params["partition"], cp.credit
    modelled = intrajob.simulate_iteration(gp, cp).iteration_time
    # the runtime re-makes the plan over the model's own parameters from these (netweave.runtime.ddp.make_plan's knobs)
    params = {"tuned": tuned, "modelled_iteration_s": modelled, "collectives": len(cp.transfers), "bandwidth_Bps": bandwidth,
              "overhead_s": t_small, "backward_s": gp.backward, "gradient_bytes": total}
    if policy == "ddp":
        params.update(bucket_cap_bytes=cp.params["bucket_cap"], first_bucket_bytes=cp.params["first_bucket"])
    if policy == "prophet":
        params["gap_factor"] = cp.params["gap_factor"]
    return jp.DataParallel(policy=policy, partition_bytes=part, credit_bytes=credit, barrier=want.get("barrier", cp.barrier), params=params), modelled


def _pipeline_section(spec: JobSpec, p) -> jp.Pipeline:
    from pipesched.export import schedule_csv, spans_for_schedule, torch_schedule_class

    sched = p.schedule
    spans = spans_for_schedule(sched, p.partition)
    stages = tuple(jp.Stage(index=sid, rank=sched.stage_rank[sid], layers=tuple(spans[sid]),
                            recompute=p.partition.stages[sched.stage_layers[sid]].recompute) for sid in range(sched.num_stages))
    torch_class = torch_schedule_class(p.family) if p.family in RUNTIME_TORCH_FAMILIES else None
    if p.family == "interleaved" and sched.microbatches % max(1, sched.microbatches // sched.ranks):
        torch_class = None  # torch's ScheduleInterleaved1F1B needs micro-batches in whole rounds; its runtime runs our CSV
    return jp.Pipeline(schedule=p.family, microbatches=sched.microbatches, stages=stages, chunks=p.chunks if p.family == "interleaved" else 1,
                       torch_class=torch_class, actions_csv=None if torch_class else schedule_csv(sched),
                       predicted_iteration_s=p.sim.makespan)


def _bundle(topo: Topology, spec: JobSpec, prof, i: int, row: Mapping[str, Any], priority: int, pipe, *, transport: str,
            addresses: Mapping[str, str], interfaces: Mapping[str, str], jobs_source: str, placement: Mapping[str, Any], lib: Path,
            out: Path | None) -> JobBundle:
    from emu.htb import dscp_for_priority
    from flowsched import ncclhook
    from flowsched.plan import nccl_class

    gpus: list[str] = list(row["gpus"])
    per_host = row["launch"]["per_host"]
    hosts_order = [h["host"] for h in per_host]
    for h in hosts_order:
        if not jp.NAME_RE.fullmatch(h):
            raise InputError(f"host name {h!r} cannot name a launch script (expected {jp.NAME_RE.pattern})", source=placement.get("topology"))
    local: dict[str, int] = {}
    ranks = []
    for r, g in enumerate(gpus):
        h = topo.host_of(g)
        ranks.append(jp.Rank(r, h, local.setdefault(h, 0), g))
        local[h] += 1
    hosts = [jp.Host(h["host"], h["node_rank"], len(h["gpus"]), h["cuda_visible_devices"]) for h in per_host]
    master = hosts_order[0]
    rdzv = jp.Rendezvous(addresses.get(master, master), int(row["launch"]["master_port"]))
    pipeline = None
    prediction: dict[str, Any] = {"compute_s": spec.compute_s, "comm_s": row["comm_s"], "placement_iteration_s": row["iteration_s"]}
    period = float(row["iteration_s"])
    if pipe is not None:
        p = pipe
        pipeline = _pipeline_section(spec, p)
        period = p.sim.makespan + float(row["comm_s"])
        prediction.update(pipeline_iteration_s=p.sim.makespan, bubble_fraction=p.sim.bubble_fraction, pipeline_gap_to_bound=p.gap)
    dp_section, modelled = _data_parallel(topo, spec, prof, gpus, pipeline)
    if modelled is not None and spec.pp == 1:
        m = spec.launch.microbatches or 1
        per_mb = sum(lay.fwd_s + lay.bwd_s for lay in _per_tp(prof, spec.tp).layers) / _reference_speed(topo, prof)
        period = (m - 1) * per_mb + modelled   # accumulation micro-batches, then the last one's backward overlapped with the plan
        prediction["dp_modelled_iteration_s"] = modelled
    prediction["iteration_s"] = period
    prediction["start_offset_s"] = row["start_offset_s"]
    period_s: float | None = period
    if prof is None and not spec.launch.given & {"compute", "compute_s", "compute_ms"}:
        # no model and no compute time: the prediction rests on placement's default compute time; the runtime must
        # not pace the job to it (it would slow a faster job down), so the plan's period stays unknown
        period_s = None
        prediction["note"] = "no model and no compute time in the jobs file: iteration_s uses the default compute time; period_s unset"
    traffic = jp.Traffic(traffic_class=nccl_class(priority), dscp=dscp_for_priority(priority), priority=priority)
    provenance = {"netweave": _version(), "command": "netweave launch", "topology": placement.get("topology"),
                  "jobs_file": str(Path(jobs_source).resolve()), "placement_policy": placement.get("policy"), "routing": placement.get("routing"),
                  "class_policy": "sincronia", "transport": transport, "backend": spec.launch.backend, "rank_layout": RANK_LAYOUT,
                  "model": None if prof is None else prof.name, "parallelism": "auto" if spec.launch.auto else "given"}
    plan = jp.JobPlan(job=spec.name, world_size=len(gpus), ranks=ranks, hosts=hosts, rendezvous=rdzv,
                      parallelism=jp.Parallelism(spec.dp, spec.tp, spec.pp), start_offset_s=float(row["start_offset_s"]), period_s=period_s,
                      traffic=traffic, data_parallel=dp_section, pipeline=pipeline, prediction=prediction, provenance=provenance)
    jp.check(plan, source=f"{jobs_source}: jobs[{i}]")
    # the environment that carries the class: fabric knobs for NCCL jobs, the socket marker for gloo jobs
    nccl_plan = None
    lp = spec.launch
    if lp.backend == "gloo":
        env = ncclhook.marker_env(dscp=traffic.dscp, build_dir=Path("@lib"))
        note = f"gloo job: the LD_PRELOAD marker sets DSCP {traffic.dscp} on every TCP socket of the job"
    else:
        plugin_plan = "@bundle/nccl.plan"
        if transport == "tcp" or lp.nccl_plugins:
            fp = ncclhook.FlowPlan(classes={traffic.traffic_class: ncclhook.ClassMark(dscp=traffic.dscp)},
                                   comms=[ncclhook.CommRule("order", n, traffic.traffic_class) for n in range(16)])
            nccl_plan = ncclhook.format_plan(fp)
        env = ncclhook.fabric_env(transport, traffic_class=traffic.traffic_class, dscp=traffic.dscp,
                                  plan=plugin_plan if nccl_plan else None, tuner="tuner" in lp.nccl_plugins,
                                  profiler="profiler" in lp.nccl_plugins, build_dir=Path("@lib"))
        note = ({"tcp": f"TCP fabric: the netweave net plugin marks the job's sockets (class {traffic.traffic_class}, DSCP {traffic.dscp})",
                 "ib": f"InfiniBand: NCCL's own IB transport; class on NCCL_IB_TC (DSCP {traffic.dscp} << 2) and NCCL_IB_SL",
                 "roce": f"RoCE: NCCL's own IB transport; class on NCCL_IB_TC (DSCP {traffic.dscp} << 2, the IP TOS) and NCCL_IB_SL (priority)"}
                [transport])
    scripts = {h.host: _host_script(plan, h, spec, env, note, interfaces.get(h.host, interfaces.get("*", "")), lib) for h in hosts}
    bundle_dir = None if out is None else out / spec.name
    sbatch = _sbatch(plan, bundle_dir)
    return JobBundle(plan, scripts, sbatch, row["launch"]["slurm_hostfile"], nccl_plan)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("netweave")
    except Exception:  # not installed (a checkout on PYTHONPATH)
        return "checkout"


# ----------------------------------------------------------------------------------------------- rendering --
def _sh(value: str) -> str:
    """A shell word for ``value``; ``@lib``/``@bundle`` prefixes become the script's ``$lib``/``$bundle`` variables."""
    for tag, var in (("@lib/", "${lib}/"), ("@bundle/", "${bundle}/")):
        if value.startswith(tag):
            rest = value[len(tag):]
            if not all(c.isalnum() or c in "._-/" for c in rest):
                raise ValueError(f"unsafe path {rest!r}")
            return f'"{var}{rest}"'
    return shlex.quote(value)


def _host_script(plan: jp.JobPlan, host: jp.Host, spec: JobSpec, env: Mapping[str, str], note: str, ifname: str, lib: Path) -> str:
    r = plan.rendezvous
    argv = [spec.launch.script or "train.py", *spec.launch.args]
    lines = [
        "#!/usr/bin/env bash",
        f"# netweave launch bundle: job {plan.job}, host {host.host} (node rank {host.node_rank} of {len(plan.hosts)}, "
        f"{host.nproc} ranks). Written by `netweave launch`.",
        "# Overrides from the environment: NETWEAVE_MASTER_ADDR, NETWEAVE_MASTER_PORT, NETWEAVE_IFNAME (empty: none),",
        "# NETWEAVE_LIB_DIR (the netweave NCCL plugin and socket marker), NETWEAVE_TORCHRUN (default torchrun).",
        "set -euo pipefail",
        'bundle="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
        f'lib="${{NETWEAVE_LIB_DIR:-{_dq(str(lib))}}}"',
        'export NETWEAVE_JOB_PLAN="${bundle}/plan.json"',
        f"export CUDA_VISIBLE_DEVICES={shlex.quote(host.cuda_visible_devices)}",
        f'master_addr="${{NETWEAVE_MASTER_ADDR:-{_dq(r.addr)}}}"',
        f'master_port="${{NETWEAVE_MASTER_PORT:-{r.port}}}"',
        f'ifname="${{NETWEAVE_IFNAME-{_dq(ifname)}}}"',
        'if [ -n "$ifname" ]; then',
        '    export GLOO_SOCKET_IFNAME="$ifname" NCCL_SOCKET_IFNAME="=$ifname"',
        "fi",
        f"# {note}",
    ]
    lines += [f"export {k}={_sh(v)}" for k, v in env.items()]
    lines.append(f'exec "${{NETWEAVE_TORCHRUN:-torchrun}}" --nnodes={len(plan.hosts)} --nproc-per-node={host.nproc} '
                 f'--node-rank={host.node_rank} --master-addr="$master_addr" --master-port="$master_port" {shlex.join(argv)}')
    return "\n".join(lines) + "\n"


def _dq(value: str) -> str:
    """``value`` safe inside a double-quoted ``${VAR:-...}`` default (no expansion, no quote)."""
    if any(c in value for c in '"$`\\\n'):
        raise InputError(f"{value!r} cannot go into a launch script (quote, $, backquote or backslash)")
    return value


def _sbatch(plan: jp.JobPlan, bundle_dir: Path | None) -> str:
    hosts = [h.host for h in plan.hosts]
    n = len(hosts)
    nodelist = ",".join(hosts)
    cases = "|".join(hosts)
    recorded = _dq(str(bundle_dir)) if bundle_dir is not None else ""
    lines = [
        "#!/usr/bin/env bash",
        f"#SBATCH --job-name=netweave-{plan.job}",
        f"#SBATCH --nodes={n}",
        f"#SBATCH --ntasks={n}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --nodelist={nodelist}",
        f"# netweave launch bundle: job {plan.job} under Slurm. srun starts one task per host of the plan (--nodelist); each",
        "# task runs its host's launch-<host>.sh, which holds the node rank, CUDA_VISIBLE_DEVICES and the NCCL environment:",
        "# the node rank comes from SLURMD_NODENAME (the plan's rank order, not Slurm's sorted node order). The bundle is",
        "# $NETWEAVE_BUNDLE, else this file's directory when run directly, else the directory it was written to.",
        "set -euo pipefail",
        'bundle="${NETWEAVE_BUNDLE:-}"',
        'if [ -z "$bundle" ] && [ -f "$(dirname "${BASH_SOURCE[0]}")/plan.json" ]; then bundle="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"; fi',
        f'bundle="${{bundle:-{recorded}}}"',
        'if [ -z "$bundle" ] || [ ! -f "$bundle/plan.json" ]; then',
        f'    echo "netweave: job {plan.job}: cannot find the bundle (set NETWEAVE_BUNDLE to its directory)" >&2; exit 2',
        "fi",
        f'if [ "${{SLURM_NNODES:-{n}}}" != "{n}" ]; then',
        f'    echo "netweave: job {plan.job} needs {n} nodes ({nodelist}), Slurm gave ${{SLURM_NNODES}}" >&2; exit 2',
        "fi",
        "export NETWEAVE_BUNDLE=\"$bundle\"",
        f"exec srun --nodes={n} --ntasks={n} --ntasks-per-node=1 --nodelist={nodelist} --kill-on-bad-exit=1 \\",
        f"    bash -c 'case \"${{SLURMD_NODENAME:-}}\" in {cases}) exec bash \"$NETWEAVE_BUNDLE/launch-$SLURMD_NODENAME.sh\";; "
        f"*) echo \"netweave: node ${{SLURMD_NODENAME:-?}} is not a host of job {plan.job} ({nodelist})\" >&2; exit 2;; esac'",
    ]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------- writing --
def check_output(out: str | os.PathLike[str]) -> Path:
    """Raise unless ``out`` can receive bundles (an existing writable directory, or a new name in one); return it absolute.

    Called before any planning, so that a bad ``--out`` costs nothing and writes nothing.
    """
    path = Path(out).expanduser()
    if str(out) == "" or path.name in ("", ".", ".."):
        path = path.resolve()
    parent = path.parent
    if path.exists() and not path.is_dir():
        raise InputError("exists and is not a directory", where=f"--out {out}")
    if not parent.is_dir():
        raise InputError(f"the parent directory {str(parent)!r} does not exist or is not a directory", where=f"--out {out}")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.is_dir() and not os.access(path, os.W_OK | os.X_OK)):
        raise InputError("not writable", where=f"--out {out}")
    return path.absolute()


def staging_dir(out: Path) -> Path:
    """A fresh directory beside ``out`` (same file system, so renames are atomic), with the umask's mode."""
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.netweave-", dir=out.parent))
    except OSError as exc:
        raise InputError(f"cannot create a directory beside it ({exc.strerror})", where=f"--out {out}") from None
    os.chmod(tmp, 0o777 & ~_umask())
    return tmp


def write_bundles(lp: LaunchPlan, out: str | os.PathLike[str], *, staging: Path | None = None) -> list[str]:
    """Write every bundle of ``lp`` under ``out``, all or nothing per job (see the module docstring); the written paths.

    ``staging``: a directory from :func:`staging_dir` to build in (made here when None); it is gone afterwards.
    """
    out = Path(out).absolute()
    tmp = staging or staging_dir(out)
    mode_x = 0o777 & ~_umask()
    written: list[str] = []
    try:
        for b in lp.bundles:
            d = tmp / b.plan.job
            d.mkdir(mode=0o777)
            files = {"plan.json": jp.dumps(b.plan), "job.sbatch": b.sbatch, "hostfile": b.hostfile,
                     **{f"launch-{h}.sh": s for h, s in b.host_scripts.items()}}
            if b.nccl_plan is not None:
                files["nccl.plan"] = b.nccl_plan
            for name, text in files.items():
                atomic_write_text(d / name, text)
                if name.endswith(".sh") or name.endswith(".sbatch"):
                    os.chmod(d / name, mode_x)
                written.append(f"{b.plan.job}/{name}")
            _fsync_dir(d)
        from flowsched.plan import dumps_plan

        atomic_write_text(tmp / "launch.json", json.dumps(lp.summary(), indent=1) + "\n")
        atomic_write_text(tmp / "flows.json", dumps_plan(lp.flow_plan))
        written += ["launch.json", "flows.json"]
        if not out.exists():
            try:
                os.rename(tmp, out)
                _fsync_dir(out.parent)
                return written
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
        for b in lp.bundles:
            _replace(tmp / b.plan.job, out / b.plan.job)
        for name in ("launch.json", "flows.json"):
            os.replace(tmp / name, out / name)
        _fsync_dir(out)
        return written
    except OSError as exc:
        raise InputError(f"cannot write the bundle ({exc.strerror or exc})", where=f"--out {out}") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _replace(new: Path, old: Path) -> None:
    """Put directory ``new`` at ``old``: one atomic exchange where the kernel has it (Linux renameat2), then drop the old one."""
    if not old.exists() and not old.is_symlink():
        os.rename(new, old)
        return
    if _exchange(new, old):
        _remove(new)  # now holds the old bundle
        return
    # no RENAME_EXCHANGE (another OS or file system): two renames, a moment without the directory
    aside = new.with_name(new.name + ".old")
    os.rename(old, aside)
    os.rename(new, old)
    _remove(aside)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically with ``renameat2(RENAME_EXCHANGE)``; False where the system cannot."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def launch_text(lp: LaunchPlan, out: Path) -> str:
    """A human summary of what was written."""
    lines = [f"netweave launch: {len(lp.bundles)} job bundle(s) in {out} ({lp.transport} fabric)"]
    for b in lp.bundles:
        p = b.plan
        pipe = (f"pp {p.parallelism.pp} {p.pipeline.schedule} ({p.pipeline.torch_class or 'runtime CSV'}), recompute "
                f"{'/'.join(s.recompute for s in p.pipeline.stages)}") if p.pipeline else "no pipeline"
        dpol = p.data_parallel.policy if p.data_parallel else "-"
        lines.append(f"  {p.job}: {p.world_size} ranks on {', '.join(h.host for h in p.hosts)}; dp {p.parallelism.dp} tp {p.parallelism.tp}; "
                     f"{pipe}; data parallel {dpol}; rendezvous {p.rendezvous.addr}:{p.rendezvous.port}; class {p.traffic.traffic_class} "
                     f"(DSCP {p.traffic.dscp}); start offset {p.start_offset_s * 1e3:.2f} ms; iteration {_ms(p.period_s)}")
        lines.append(f"      run: bash {out / p.job}/launch-<host>.sh on each host, or sbatch {out / p.job}/job.sbatch")
    return "\n".join(lines)


def _ms(x: float | None) -> str:
    return "unknown" if x is None or not math.isfinite(x) else f"{x * 1e3:.4g} ms"
