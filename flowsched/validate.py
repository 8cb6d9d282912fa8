"""Scenario runners that validate the flow scheduler: in the flow-level simulator and in Mininet.

Three scenarios, each a builder (pure data, tested without root) plus a runner:

1. **One bandwidth-bound data-parallel job** (:func:`run_intrajob_emulation`):
   real torch (gloo) ranks, one per emulated host, train an MLP whose gradient
   volume dominates at the emulated link rate. Each rank measures the gradient
   profile (:func:`~flowsched.gradients.measure_gradient_profile`) and the
   all-reduce goodput on the emulated link, then trains with default
   ``DistributedDataParallel``, with :class:`~flowsched.ddp.GradientScheduler`
   running a Prophet plan and with a ByteScheduler plan. The per-rank script is
   :mod:`flowsched.torchrun_job`.
2. **Jobs contending on a bottleneck** (:func:`contention_scenario`,
   :func:`policy_plan`, :func:`contention_workload`): data-parallel jobs whose
   rings all cross the same two host ports. Policies: ``fair`` (one class: TCP /
   max-min sharing), ``sincronia`` (BSSI order of the jobs' coflows mapped to
   strict priority classes, DSCP-marked, HTB ``prio`` at every port),
   ``geryon`` (the same order folded onto fewer classes by equal-bytes bands)
   and ``parrot`` (Parrot's LP allocation, recomputed at every job completion;
   on a shared bottleneck its optimum is "SRPT job first, a floor for the
   others", enforced by classes whose HTB guaranteed rate is the floor; see
   :func:`policy_plan` for why not per-flow pacing). The same workload runs in
   :func:`emu.sim.simulate` and :func:`emu.mininet_backend.run_mininet`.
3. **Coflow ordering quality** on random instances (:func:`random_coflows`,
   :func:`sebf_order`): the benchmark compares BSSI against brute force, the
   lower bound and simple orders.

Units follow the workload format: bytes, seconds and GB/s at real-fabric scale;
the emulator divides rates by ``time_scale`` (and bytes by ``byte_scale``).

>>> topo, jobs = contention_scenario()
>>> [j.name for j in jobs], policy_plan(topo, jobs, "sincronia")["priority"]
(['jobA', 'jobB', 'jobC'], {'jobA': 0, 'jobB': 1, 'jobC': 2})
"""

from __future__ import annotations

import math
import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from emu.workload import CollectivePhase, ComputePhase, Job, Workload
from topology import LinkKind, NodeKind, Topology
from topology.errors import InputError

from .coflow import Coflow, Flow, Port, parrot_rates, priority_bands, sincronia_order

#: Name prefix of every emulated network these runners create (hosts ``fvh0``.., switches ``fvs0``..).
EMU_PREFIX = "fv"
POLICIES = ("fair", "sincronia", "geryon", "parrot")


# -- topology -----------------------------------------------------------------------------------------------


def star_topology(hosts: int = 2, gpus_per_host: int = 1, *, nic_gbps: float = 100.0, name: str | None = None) -> Topology:
    """``hosts`` servers, each with ``gpus_per_host`` GPUs behind one NIC, cabled to one leaf switch.

    The only network bottlenecks are the hosts' ports (the coflow papers' "big
    switch"): GPU-NIC links are PCIe at 64 GB/s, far above the NIC.

    >>> t = star_topology(3, 2, nic_gbps=100)
    >>> len(t.hosts()), len(t.gpus()), sorted({d["bw"] for _, _, _, d in t.links("network")})
    (3, 6, [12.5])
    """
    if hosts < 1 or gpus_per_host < 1:
        raise InputError(f"star_topology: hosts and gpus_per_host must be >= 1, got {hosts}, {gpus_per_host}")
    if not nic_gbps > 0:
        raise InputError(f"star_topology: nic_gbps must be positive, got {nic_gbps!r}")
    topo = Topology(name or f"star-{hosts}x{gpus_per_host}-{nic_gbps:g}g")
    leaf = topo.add_node("leaf0", NodeKind.SWITCH, tier="leaf", index=0)
    for h in range(hosts):
        host = f"host{h}"
        nic = topo.add_node(f"{host}/nic0", NodeKind.NIC, host=host, index=0, rail=0, speed_gbps=nic_gbps)
        for g in range(gpus_per_host):
            gpu = topo.add_node(f"{host}/gpu{g}", NodeKind.GPU, host=host, index=g, model="emulated")
            topo.add_link(gpu, nic, LinkKind.PCIE, 64.0, latency_us=1.0)
        topo.add_link(nic, leaf, LinkKind.NETWORK, nic_gbps / 8, latency_us=1.0)
    return topo


def port_capacity(topo: Topology) -> dict[Port, float]:
    """Bytes/s of every host's egress (``("out", host)``) and ingress (``("in", host)``) network port."""
    g = topo.graph
    cap: dict[Port, float] = {}
    for u, v, _k, d in topo.links(LinkKind.NETWORK):
        if g.nodes[u]["kind"] == NodeKind.NIC:
            cap[("out", g.nodes[u]["host"])] = cap.get(("out", g.nodes[u]["host"]), 0.0) + d["bw"] * 1e9
        if g.nodes[v]["kind"] == NodeKind.NIC:
            cap[("in", g.nodes[v]["host"])] = cap.get(("in", g.nodes[v]["host"]), 0.0) + d["bw"] * 1e9
    return cap


# -- scenario 2: jobs contending on a bottleneck ------------------------------------------------------------


@dataclass(frozen=True)
class ContendingJob:
    """A data-parallel job: ``iterations`` x (compute ``compute_s``, then a ring all-reduce of ``nbytes``) on ``gpus``."""

    name: str
    gpus: tuple[str, ...]
    iterations: int
    compute_s: float
    nbytes: float


def contention_scenario(jobs: int = 3, *, hosts: int = 2, nic_gbps: float = 100.0, base_bytes: float = 200e6, growth: float = 2.0,
                        iterations: int = 4, compute_s: float = 2e-3) -> tuple[Topology, list[ContendingJob]]:
    """``jobs`` jobs of growing size whose rings all cross the same host ports.

    Job *k* (named ``jobA``, ``jobB``, ...) uses GPU *k* of every host and
    all-reduces ``base_bytes * growth**k`` per iteration, so every host port is
    shared by all jobs and the jobs differ only in size: the setting in which
    ordering (smallest first) beats fair sharing.

    >>> topo, js = contention_scenario(2, base_bytes=1e6)
    >>> [(j.name, j.gpus, j.nbytes) for j in js]
    [('jobA', ('host0/gpu0', 'host1/gpu0'), 1000000.0), ('jobB', ('host0/gpu1', 'host1/gpu1'), 2000000.0)]
    """
    if not 1 <= jobs <= 26:
        raise InputError(f"contention_scenario: jobs must be in 1..26, got {jobs}")
    if iterations < 1 or not base_bytes > 0 or not growth > 0 or compute_s < 0:
        raise InputError("contention_scenario: iterations >= 1, base_bytes > 0, growth > 0 and compute_s >= 0 are required")
    topo = star_topology(hosts, jobs, nic_gbps=nic_gbps, name=f"contention-{hosts}h-{jobs}j")
    out = [ContendingJob(f"job{chr(65 + k)}", tuple(f"host{h}/gpu{k}" for h in range(hosts)), iterations, compute_s, base_bytes * growth**k)
           for k in range(jobs)]
    return topo, out


def iteration_coflow(topo: Topology, job: ContendingJob, *, iterations: float = 1.0) -> Coflow:
    """The host-level coflow of ``iterations`` of ``job``'s all-reduces (ring steps summed per host pair)."""
    from topology.collectives import collective_flows

    pair: dict[tuple[str, str], float] = {}
    for step in collective_flows(topo, "all_reduce", list(job.gpus), job.nbytes, algorithm="ring"):
        for f in step:
            a, b = topo.host_of(f.src), topo.host_of(f.dst)
            if a != b:
                pair[(a, b)] = pair.get((a, b), 0.0) + f.nbytes * iterations
    return Coflow(job.name, [Flow(a, b, nb) for (a, b), nb in sorted(pair.items())])


def alone_iteration_time(topo: Topology, job: ContendingJob) -> float:
    """Compute time plus the all-reduce's bottleneck-port time when the job has the network to itself."""
    cap = port_capacity(topo)
    load = iteration_coflow(topo, job).port_bytes()
    return job.compute_s + max((b / cap[p] for p, b in load.items()), default=0.0)


def policy_plan(topo: Topology, jobs: Sequence[ContendingJob], policy: str, *, classes: int = 2, floor: float = 0.01,
                parrot_rounds: int = 6) -> dict[str, Any]:
    """Decide every iteration's traffic class (0 = most urgent) under ``policy``; pure data.

    Returns ``{"policy", "order", "priority": {job: class of its first iteration}, "classes": {job: [class per
    iteration]}, ...}``.

    - ``fair``: every job in class 0 (TCP / max-min sharing inside the class).
    - ``sincronia``: BSSI order of the jobs' whole remaining traffic (one coflow
      per job), class = position in the order (at most 8 classes).
    - ``geryon``: the same order folded onto ``classes`` classes by
      :func:`~flowsched.coflow.priority_bands` with the jobs' bytes as sizes.
    - ``parrot``: at time 0 and at every (simulated) job completion,
      :func:`~flowsched.coflow.parrot_rates` allocates each active job's
      per-iteration coflow a rate (remaining-time estimates = remaining
      iterations x alone iteration time, starvation floor ``floor``). On a
      shared bottleneck the LP's optimum is a vertex: the preferred (SRPT) job
      gets everything but the other jobs' floors. It is enforced as such: jobs
      are ranked by allocated rate into classes, and every HTB class keeps a
      guaranteed rate (the emulator's ``floor_fraction``, 1% by default; pass
      the same ``floor``), i.e. the floor. An iteration keeps the class of the
      epoch it starts in (the allocation changes at iteration granularity).
      Epoch boundaries come from :func:`emu.sim.simulate` and are refined until
      they stop moving (at most ``parrot_rounds`` simulations).

    Deviation: per-flow pacing at Parrot's rates (``SO_MAX_PACING_RATE``) cannot
    change a flow's rate mid-flow nor hand a computing job's share to the others,
    so a paced iteration that starts while a smaller job runs stays at the floor
    rate for its whole length; classes with guaranteed floors are work-conserving
    and re-rate instantly, which is what Parrot's allocation at every event means.

    >>> topo, jobs = contention_scenario()
    >>> policy_plan(topo, jobs, "geryon")["priority"]
    {'jobA': 0, 'jobB': 0, 'jobC': 1}
    """
    if policy not in POLICIES:
        raise InputError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}", where="policy")
    names = [j.name for j in jobs]
    if len(set(names)) != len(names):
        raise InputError("job names must be unique")
    cap = port_capacity(topo)
    whole = [iteration_coflow(topo, j, iterations=j.iterations) for j in jobs]
    order = sincronia_order(whole, cap)
    plan: dict[str, Any] = {"policy": policy, "order": list(order)}
    if policy == "fair":
        prio = dict.fromkeys(names, 0)
    elif policy == "sincronia":
        prio = {n: min(k, 7) for k, n in enumerate(order)}
    elif policy == "geryon":
        size = {c.name: sum(f.nbytes for f in c.flows) for c in whole}
        prio = priority_bands(order, classes=min(classes, 8), sizes=[size[n] for n in order])
    else:
        plan.update(_parrot_classes(topo, list(jobs), floor=floor, rounds=parrot_rounds))
        plan["priority"] = {n: row[0] for n, row in plan["classes"].items()}
        return plan
    plan["priority"] = {n: prio[n] for n in names}
    plan["classes"] = {j.name: [prio[j.name]] * j.iterations for j in jobs}
    return plan


def _parrot_classes(topo: Topology, jobs: list[ContendingJob], *, floor: float, rounds: int) -> dict[str, Any]:
    from emu.sim import simulate

    cap = port_capacity(topo)
    alone = {j.name: alone_iteration_time(topo, j) for j in jobs}
    per_it = {j.name: iteration_coflow(topo, j) for j in jobs}
    # Predicted progress: when each iteration's all-reduce starts, when each job ends (none known before the first simulation).
    starts = {j.name: [0.0] * j.iterations for j in jobs}
    finish = {j.name: math.inf for j in jobs}
    classes: dict[str, list[int]] = {}
    epochs: list[dict[str, Any]] = []
    history = []
    for _ in range(max(1, rounds)):
        boundaries = sorted({0.0, *[t for t in finish.values() if math.isfinite(t)]})
        epochs = []
        for t in boundaries:
            active = [j for j in jobs if finish[j.name] > t + 1e-12]
            if not active:
                continue
            left = {j.name: sum(1 for s in starts[j.name] if s >= t - 1e-12) for j in active}
            remaining = {n: max(1, k) * alone[n] for n, k in left.items()}
            alloc = parrot_rates([per_it[j.name] for j in active], remaining, cap, floor=min(floor, 1 / len(active)))
            ranked = sorted(alloc.rates, key=lambda n: (-alloc.rates[n], remaining[n]))
            epochs.append({"start": t, "active": [j.name for j in active], "remaining_s": remaining, "coflows_per_s": alloc.rates,
                           "weights": alloc.weights, "srpt_job": alloc.srpt_job, "confidence": alloc.confidence,
                           "class": {n: min(k, 7) for k, n in enumerate(ranked)}})
        new = {}
        for j in jobs:
            row = []
            for s in starts[j.name]:
                epoch = max((e for e in epochs if e["start"] <= s + 1e-12 and j.name in e["active"]), key=lambda e: e["start"])
                row.append(epoch["class"][j.name])
            new[j.name] = row
        if new == classes:
            break
        classes = new
        result = simulate(topo, _workload(jobs, classes, "parrot-refine"))
        finish = {n: r.finish for n, r in result.jobs.items()}
        for p in result.phases:
            if p.kind == "collective":
                starts[p.job][int(p.phase[2:])] = p.start
        history.append({n: round(t, 9) for n, t in finish.items()})
    return {"classes": classes, "epochs": epochs, "refinement": history}


def _workload(jobs: Sequence[ContendingJob], classes: dict[str, list[int]], name: str) -> Workload:
    out = []
    for j in jobs:
        phases: list[ComputePhase | CollectivePhase] = []
        for i in range(j.iterations):
            phases.append(ComputePhase(f"c{i}", j.compute_s, after=(f"ar{i - 1}",) if i else ()))
            phases.append(CollectivePhase(f"ar{i}", "all_reduce", j.nbytes, after=(f"c{i}",), priority=classes[j.name][i]))
        out.append(Job(j.name, j.gpus, tuple(phases), iterations=1))
    return Workload(name, out)


def contention_workload(jobs: Sequence[ContendingJob], plan: dict[str, Any]) -> Workload:
    """The workload of ``jobs`` under ``plan`` (from :func:`policy_plan`), iterations unrolled into phases
    ``c0, ar0, c1, ar1, ...`` so that each all-reduce can carry its own class.

    >>> topo, jobs = contention_scenario(2)
    >>> w = contention_workload(jobs, policy_plan(topo, jobs, "sincronia"))
    >>> [(p.name, getattr(p, "priority", None)) for p in w.jobs[1].phases][:2]
    [('c0', None), ('ar0', 1)]
    """
    return _workload(jobs, plan["classes"], f"contention-{plan['policy']}")


def mean_jct(result: Any) -> float:
    """Average job completion time of an :class:`emu.results.RunResult`."""
    jcts = [j.jct for j in result.jobs.values()]
    return float(sum(jcts) / len(jcts)) if jcts else math.nan


def simulate_policies(topo: Topology, jobs: Sequence[ContendingJob], policies: Sequence[str] = POLICIES, *,
                      sim_options: dict[str, Any] | None = None, **plan_options: Any) -> dict[str, Any]:
    """Run every policy in the flow-level simulator: ``{policy: {"plan", "result", "mean_jct_s", "jct_s"}}``.

    ``sim_options`` go to :func:`emu.sim.simulate` (e.g. ``{"latency": False}``).
    """
    from emu.sim import simulate

    out = {}
    for policy in policies:
        plan = policy_plan(topo, jobs, policy, **plan_options)
        result = simulate(topo, contention_workload(jobs, plan), **(sim_options or {}))
        out[policy] = {"plan": plan, "result": result, "mean_jct_s": mean_jct(result), "jct_s": {n: r.jct for n, r in result.jobs.items()}}
    return out


def emulate_policy(topo: Topology, jobs: Sequence[ContendingJob], plan: dict[str, Any], *, time_scale: float, byte_scale: float = 1.0,
                   out_dir: Any = None, cpu_limit: float = 1.01, **options: Any) -> tuple[Any, dict[str, Any]]:
    """Run one policy's workload in Mininet (:func:`emu.mininet_backend.run_mininet`); returns ``(RunResult, fidelity)``.

    A failed fidelity check does not lose the run: ``fidelity["ok"]`` says it
    failed (and ``fidelity["problems"]`` why). The CPU check is off by default
    (``cpu_limit`` > 1) because /proc/stat counts every process on a shared
    machine, ours or not; ``fidelity["cpu"]`` still reports the busy fraction.
    The emulated names use :data:`EMU_PREFIX`.
    """
    from emu.mininet_backend import run_mininet

    options = {"prefix": EMU_PREFIX, **options}
    result = run_mininet(topo, contention_workload(jobs, plan), time_scale=time_scale, byte_scale=byte_scale, out_dir=out_dir,
                         cpu_limit=cpu_limit, raise_on_fidelity=False, **options)
    return result, result.meta["fidelity"]


# -- scenario 3: random coflow instances --------------------------------------------------------------------


def random_coflows(n: int, hosts: int, *, seed: int | random.Random = 0, max_width: int = 4, min_bytes: float = 1e6,
                   max_bytes: float = 1e9, weighted: bool = False) -> list[Coflow]:
    """``n`` random coflows on ``hosts`` hosts: each has 1..``max_width`` senders and receivers (all pairs carry a
    flow), flow sizes log-uniform in ``[min_bytes, max_bytes]`` (coflow sizes span decades, as in the Facebook trace
    the coflow papers use), weights 1 or uniform in [1, 4] when ``weighted``.

    >>> cs = random_coflows(3, 4, seed=1)
    >>> len(cs), all(f.src != f.dst for c in cs for f in c.flows)
    (3, True)
    """
    if n < 0 or hosts < 2 or max_width < 1:
        raise InputError("random_coflows: n >= 0, hosts >= 2 and max_width >= 1 are required")
    rng = seed if isinstance(seed, random.Random) else random.Random(seed)
    out = []
    for k in range(n):
        senders = rng.sample(range(hosts), rng.randint(1, min(max_width, hosts - 1)))
        others = [h for h in range(hosts) if h not in senders] or list(range(hosts))
        receivers = rng.sample(others, rng.randint(1, min(max_width, len(others))))
        scale = math.exp(rng.uniform(math.log(min_bytes), math.log(max_bytes)))
        flows = [Flow(f"h{s}", f"h{r}", scale * rng.uniform(0.5, 1.5)) for s in senders for r in receivers if s != r]
        out.append(Coflow(f"c{k}", flows, weight=rng.uniform(1, 4) if weighted else 1.0))
    return out


def sebf_order(coflows: Sequence[Coflow], capacity_Bps: float | dict[Port, float]) -> list[Hashable]:
    """Varys' Smallest-Effective-Bottleneck-First order (static: every coflow's bottleneck time alone, ascending).

    A baseline for :func:`~flowsched.coflow.sincronia_order`; ties keep the input order.
    """
    def gamma(c: Coflow) -> float:
        return max((b / (capacity_Bps[p] if isinstance(capacity_Bps, dict) else capacity_Bps) for p, b in c.port_bytes().items()), default=0.0)

    return [c.name for c in sorted(coflows, key=gamma)]


# -- scenario 1: one bandwidth-bound job, real torch ranks ----------------------------------------------------


@dataclass(frozen=True)
class IntrajobSetup:
    """The bandwidth-bound job of scenario 1: an MLP of ``layers`` x (``width`` x ``width``) on ``world`` emulated hosts.

    ``rate_mbit`` is the emulated link rate (payload); the time scale is 1, so
    emulated seconds are the job's seconds. ``balance`` > 0 lets the ranks scale
    the batch (starting from ``batch``) until compute ~= ``balance`` x
    communication: on a shared machine compute time follows the load, and the
    regime (how bandwidth-bound the job is) should not. ``compute_nice`` runs
    the ranks' training threads that many nice levels below their
    communication threads, standing in for GPU compute, which does not take
    the CPU from the network stack (see :mod:`flowsched.torchrun_job`).

    >>> s = IntrajobSetup()
    >>> round(s.gradient_bytes / 1e6, 2), s.rank_args(0, "10.0.1.1", "fvh0-eth0")[:4]
    (16.81, ['--rank', '0', '--world', '2'])
    """

    world: int = 2
    rate_mbit: float = 120.0
    layers: int = 16
    width: int = 512
    batch: int = 1024
    iters: int = 6
    warmup: int = 2
    rounds: int = 3
    threads: int = 1
    balance: float = 0.6
    compute_nice: int = 10
    master_port: int = 29611

    def __post_init__(self) -> None:
        if self.world < 2:
            raise InputError(f"world must be >= 2 (one rank per emulated host), got {self.world}", where="world")
        if not 1 <= self.rate_mbit <= 200:
            raise InputError(f"rate_mbit must be in 1..200 (shared machine), got {self.rate_mbit}", where="rate_mbit")
        if min(self.layers, self.width, self.batch, self.iters, self.rounds, self.threads) < 1 or self.warmup < 0:
            raise InputError("layers, width, batch, iters, rounds and threads must be >= 1 and warmup >= 0")

    @property
    def gradient_bytes(self) -> float:
        return float(self.layers * (self.width * self.width + self.width) * 4)

    def topology(self) -> Topology:
        return star_topology(self.world, 1, nic_gbps=self.rate_mbit / 1000, name=f"intrajob-{self.world}h-{self.rate_mbit:g}mbit")

    def rank_args(self, rank: int, master_addr: str, ifname: str) -> list[str]:
        return ["--rank", str(rank), "--world", str(self.world), "--master-addr", master_addr, "--master-port", str(self.master_port),
                "--ifname", ifname, "--layers", str(self.layers), "--width", str(self.width), "--batch", str(self.batch),
                "--iters", str(self.iters), "--warmup", str(self.warmup), "--rounds", str(self.rounds), "--threads", str(self.threads),
                "--balance", str(self.balance), "--compute-nice", str(self.compute_nice)]


def summarize_intrajob(report: dict[str, Any]) -> dict[str, Any]:
    """Speed-ups and distance to the overlap lower bound from a :mod:`flowsched.torchrun_job` report.

    >>> r = {"median_s": {"ddp": 2.0, "prophet": 1.5, "bytescheduler": 1.6, "compute": 1.2}, "lower_bound_s": 1.4,
    ...      "compute_s": 1.2, "comm_s": 1.4}
    >>> s = summarize_intrajob(r)
    >>> round(s["speedup_vs_ddp"]["prophet"], 3), round(s["over_bound"]["prophet"], 3)
    (1.333, 0.071)
    """
    med = report["median_s"]
    bound = report["lower_bound_s"]
    methods = [m for m in ("ddp", "prophet", "bytescheduler") if m in med]
    return {
        "median_s": {m: med[m] for m in methods},
        "lower_bound_s": bound,
        "compute_s": report["compute_s"],
        "comm_s": report["comm_s"],
        "speedup_vs_ddp": {m: med["ddp"] / med[m] for m in methods},
        "over_bound": {m: med[m] / bound - 1 for m in methods},
    }


def run_intrajob_emulation(setup: IntrajobSetup = IntrajobSetup(), *, calibrate_seconds: float = 1.0, timeout_s: float = 600.0,
                           prefix: str = EMU_PREFIX) -> dict[str, Any]:
    """Run scenario 1 in Mininet: ``setup.world`` hosts on one switch, one torch rank each; returns the report.

    The report is rank 0's (:mod:`flowsched.torchrun_job`) plus ``summary``
    (:func:`summarize_intrajob`) and ``fidelity`` (HTB tree check, iperf3
    calibration before and after, CPU busy fraction of the whole machine during
    the run; ``cpu_note`` says when other work shared the machine).
    Needs root and Mininet.
    """
    import json
    import subprocess
    import sys
    from pathlib import Path

    from emu.mininet_backend import EMULATION_NICE, stop_processes, wait_for_ranks
    from emu.net import CpuMonitor, emulated_network, plan_network

    topo = setup.topology()
    plan = plan_network(topo, time_scale=1.0, prefix=prefix)
    names = list(plan.hosts)
    ifaces = [plan.interfaces_of(h)[0] for h in names]
    fidelity: dict[str, Any] = {}
    repo = str(Path(__file__).resolve().parent.parent)
    with emulated_network(plan) as net:
        fidelity["htb_before"] = net.verify_htb()
        fidelity["calibration_before"] = net.calibrate(seconds=calibrate_seconds, raise_on_error=False)
        out = net.workdir / "intrajob.json"
        procs, logs = [], []
        try:
            with CpuMonitor() as cpu:
                for rank, (h, iface) in enumerate(zip(names, ifaces, strict=True)):
                    logs.append(net.workdir / f"rank{rank}.log")
                    with open(logs[-1], "w") as logf:
                        args = ["nice", "-n", str(EMULATION_NICE), sys.executable, "-m", "flowsched.torchrun_job",
                                *setup.rank_args(rank, ifaces[0].ip, iface.dev), "--timeout", str(timeout_s), "--out", str(out)]
                        procs.append(net.popen(h, args, stdout=logf, stderr=subprocess.STDOUT, cwd=repo))
                wait_for_ranks(procs, logs, timeout_s, what="intra-job run")
        finally:
            stop_processes(procs)
        report = json.loads(out.read_text())
        fidelity["htb_after"] = net.verify_htb(raise_on_error=False)
        fidelity["calibration_after"] = net.calibrate(seconds=calibrate_seconds, raise_on_error=False)
    fidelity["cpu"] = cpu.report()
    fidelity["link_ok"] = all(fidelity[k].get("ok", False) for k in ("htb_after", "calibration_before", "calibration_after"))
    report["setup"] = {**setup.__dict__, "gradient_bytes": setup.gradient_bytes}
    report["fidelity"] = fidelity
    report["summary"] = summarize_intrajob(report)
    return report
