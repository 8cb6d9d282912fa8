"""Multi-job workload mixes on the default cluster: the cases the simulator is checked against Mininet on.

Each function returns a :class:`~emu.workload.Workload` on
:func:`topology.default_cluster` (4 DGX H100, 8 rails of 400 Gb/s NICs, one
NIC per GPU, a non-blocking leaf-spine). Jobs on disjoint GPUs of that
fabric never share a link below the spines unless their traffic is steered
onto another GPU's NIC, so the mixes that must contend do so the way real
jobs do: a pipeline's sends and a data-parallel all-reduce leaving the same
GPU, an all-to-all's many flows per NIC, or PXN (``routing: rail``) moving
several jobs' traffic onto one rail.

- :func:`dp_sizes`: data-parallel jobs of 16, 8 and 4 GPUs over the same
  leaves and spines (no link binds two jobs: each runs as it would alone);
- :func:`pipeline_beside_dp`: a 2-stage x 2-replica pipeline job whose
  activation/gradient sends and stage all-reduces share NICs, beside an
  8-GPU data-parallel job;
- :func:`moe_beside_dp`: a mixture-of-experts job (all-to-all dispatch and
  combine, 4 flows per NIC at once) beside a data-parallel job;
- :func:`three_classes`: three 2-GPU jobs in priority classes 0, 1, 2 whose
  rail-aligned rings all leave ``node0`` through NIC 0;
- :func:`cassini_pair`: two such jobs, started at given offsets (the
  benchmark takes them from :func:`placement.cassini.time_shifts`, which
  lives above this package).

>>> [j.name for j in three_classes().jobs], [j.priority for j in three_classes().jobs]
(['hi', 'mid', 'lo'], [0, 1, 2])
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from .results import RunResult
from .workload import CollectivePhase, ComputePhase, Job, P2PPhase, Transfer, Workload


def _g(host: int, gpu: int) -> str:
    return f"node{host}/gpu{gpu}"


def dp_sizes(iterations: int = 4) -> Workload:
    """Data-parallel jobs of 16 (4 hosts x GPUs 0-3), 8 (4 hosts x GPUs 4-5) and 4 GPUs (2 hosts x GPUs 6-7)."""
    return Workload("dp-sizes", [
        Job.data_parallel("dp16", [_g(h, k) for h in range(4) for k in range(4)], compute_s=0.004, nbytes=400e6, iterations=iterations),
        Job.data_parallel("dp8", [_g(h, k) for h in range(4) for k in (4, 5)], compute_s=0.003, nbytes=200e6, iterations=iterations),
        Job.data_parallel("dp4", [_g(h, k) for h in (2, 3) for k in (6, 7)], compute_s=0.002, nbytes=100e6, iterations=iterations),
    ])


def pipeline_dp_job(name: str = "ppdp", iterations: int = 4) -> Job:
    """Two pipeline stages x two data-parallel replicas on GPU 0 of the four hosts.

    Stage 0 (``node0``, ``node1``) computes, sends 50 MB of activations to
    stage 1 (``node2``, ``node3``), which computes forward and backward and
    then at once sends 50 MB of gradients back and all-reduces its 200 MB of
    weight gradients: both leave the same GPU's NIC. Stage 0 then computes its
    backward pass and all-reduces its own gradients.

    >>> [p.name for p in pipeline_dp_job().phases]
    ['fwd0', 'act', 'fwdbwd1', 'grad', 'ar1', 'bwd0', 'ar0']
    """
    s0, s1 = (_g(0, 0), _g(1, 0)), (_g(2, 0), _g(3, 0))
    phases = (
        ComputePhase("fwd0", 0.002),
        P2PPhase("act", tuple(Transfer(a, b, 50e6) for a, b in zip(s0, s1, strict=True)), after=("fwd0",)),
        ComputePhase("fwdbwd1", 0.003, after=("act",)),
        P2PPhase("grad", tuple(Transfer(b, a, 50e6) for a, b in zip(s0, s1, strict=True)), after=("fwdbwd1",)),
        CollectivePhase("ar1", "all_reduce", 200e6, group=s1, after=("fwdbwd1",)),
        ComputePhase("bwd0", 0.002, after=("grad",)),
        CollectivePhase("ar0", "all_reduce", 200e6, group=s0, after=("bwd0",)),
    )
    return Job(name, s0 + s1, phases, iterations=iterations)


def pipeline_beside_dp(iterations: int = 4) -> Workload:
    """:func:`pipeline_dp_job` beside an 8-GPU data-parallel job on GPUs 1-2 of every host."""
    return Workload("pipeline-beside-dp", [
        pipeline_dp_job(iterations=iterations),
        Job.data_parallel("dp8", [_g(h, k) for h in range(4) for k in (1, 2)], compute_s=0.004, nbytes=200e6, iterations=iterations),
    ])


def moe_beside_dp(iterations: int = 4, algorithm: str = "direct") -> Workload:
    """An 8-GPU mixture-of-experts job (GPUs 0-3 of ``node0``, ``node1``; 100 MB all-to-alls) beside a 4-GPU data-parallel job."""
    return Workload("moe-beside-dp", [
        Job.mixture_of_experts("moe", [_g(h, k) for h in (0, 1) for k in range(4)], compute_s=0.002, expert_s=0.001, nbytes=100e6,
                               iterations=iterations, algorithm=algorithm),
        Job.data_parallel("dp4", [_g(h, k) for h in (0, 1) for k in (4, 5)], compute_s=0.003, nbytes=100e6, iterations=iterations),
    ])


#: GPUs of the rail-sharing jobs: ring ``node0/gpu<k>`` <-> ``node<h>/gpu0``; with ``routing: rail`` every job's traffic
#: out of ``node0`` goes through ``node0/nic0`` (the NIC on the destination GPU's rail).
RAIL_PAIRS = {"hi": (_g(0, 1), _g(1, 0)), "mid": (_g(0, 2), _g(2, 0)), "lo": (_g(0, 3), _g(3, 0))}


def three_classes(iterations: int = 4) -> Workload:
    """Three 2-GPU data-parallel jobs in classes 0, 1, 2 sharing ``node0``'s NIC 0 (``routing: rail``), with 1, 1.5 and 2 ms of compute."""
    return Workload("three-classes", [
        Job.data_parallel(name, RAIL_PAIRS[name], compute_s=compute, nbytes=100e6, iterations=iterations, priority=prio, routing="rail")
        for name, compute, prio in (("hi", 0.001, 0), ("mid", 0.0015, 1), ("lo", 0.002, 2))
    ])


def cassini_pair(shifts: Mapping[str, float] | None = None, *, iterations: int = 6, compute_s: float = 0.002,
                 grad_bytes: float = 100e6) -> Workload:
    """Two 2-GPU data-parallel jobs ``a``, ``b`` sharing ``node0``'s NIC 0, started at ``shifts`` (default: unshifted)."""
    shifts = shifts or {}
    pairs = {"a": RAIL_PAIRS["hi"], "b": RAIL_PAIRS["mid"]}
    return Workload("cassini-pair", [
        Job.data_parallel(name, gpus, compute_s=compute_s, nbytes=grad_bytes, iterations=iterations, routing="rail",
                          start_offset=float(shifts.get(name, 0.0)))
        for name, gpus in pairs.items()
    ])


def nic_utilisation(topo: Any, workload: Workload, result: RunResult, *, default_routing: str = "ecmp") -> dict[str, float]:
    """Mean utilisation of every NIC direction over the run, from a result's flow records (any backend).

    A flow between servers counts its bytes on the NIC it leaves through
    (``"<nic> out"``) and the one it enters through (``"<nic> in"``) on the
    simulator's route (the job's ``routing``); the utilisation is those bytes
    over the NIC's rate times the run's makespan. The simulator's busiest NIC
    is the mix's bottleneck; the emulation's flow records give the same
    figure from measured times (a longer run, a lower utilisation).

    >>> from topology import default_cluster
    >>> from emu.sim import simulate
    >>> t = default_cluster()
    >>> u = nic_utilisation(t, three_classes(), simulate(t, three_classes()))
    >>> max(u, key=u.get), round(max(u.values()), 2)
    ('node0/nic0 out', 0.8)
    """
    from topology.model import LinkKind

    from .net import route_nics

    rate = {u: d["bw"] * 1e9 for u, _v, _k, d in topo.links(LinkKind.NETWORK) if topo.graph.nodes[u].get("kind") == "nic"}
    routing = {j.name: j.routing or default_routing for j in workload.jobs}
    carried: dict[str, float] = {}
    for f in result.flows:
        if topo.host_of(f.src) == topo.host_of(f.dst) or f.nbytes <= 0:
            continue
        out_nic, in_nic = route_nics(topo, f.src, f.dst, routing[f.job])
        for nic, way in ((out_nic, "out"), (in_nic, "in")):
            if nic is not None:
                carried[f"{nic} {way}"] = carried.get(f"{nic} {way}", 0.0) + f.nbytes
    span = result.makespan
    return {k: b / (rate[k.split()[0]] * span) for k, b in sorted(carried.items())} if span > 0 else {}


def interchangeable(workload: Workload) -> set[frozenset[str]]:
    """The pairs of jobs that differ only in their name and which GPUs they hold: the same phases on as many GPUs, started together.

    No model can say which of two such jobs ends up faster on a shared link:
    the one that happens to pull ahead first keeps the larger share, so their
    order in a real run is set by noise (docs/validation/emu.md, the
    unshifted CASSINI pair). :func:`ranking_agrees` leaves these pairs out.

    >>> sorted(sorted(p) for p in interchangeable(cassini_pair())), interchangeable(cassini_pair({"b": 0.002}))
    ([['a', 'b']], set())
    """
    def spec(j: Job) -> tuple:
        return (j.phases, j.iterations, j.arrival, j.start_offset, j.priority, j.rate_cap, j.routing, len(j.gpus))

    jobs = workload.jobs
    return {frozenset((a.name, b.name)) for i, a in enumerate(jobs) for b in jobs[i + 1:] if spec(a) == spec(b)}


def ranking_agrees(reference: Mapping[str, float], other: Mapping[str, float], *, tie: float = 0.02,
                   interchangeable: Collection[frozenset[str]] = ()) -> bool:
    """Whether ``other`` orders every pair of jobs as ``reference`` does (pairs within ``tie`` of each other in ``reference`` may go either way).

    Pairs in ``interchangeable`` (see :func:`interchangeable`) are not compared.

    >>> ranking_agrees({"a": 1.0, "b": 2.0}, {"a": 1.1, "b": 1.9}), ranking_agrees({"a": 1.0, "b": 2.0}, {"a": 2.0, "b": 1.9})
    (True, False)
    >>> ranking_agrees({"a": 1.0, "b": 1.01}, {"a": 1.2, "b": 1.0})   # a tie in the reference
    True
    >>> ranking_agrees({"a": 1.0, "b": 2.0}, {"a": 2.0, "b": 1.9}, interchangeable=[frozenset("ab")])
    True
    """
    names: Sequence[str] = sorted(reference)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            ra, rb = reference[a], reference[b]
            if abs(ra - rb) <= tie * max(ra, rb) or frozenset((a, b)) in interchangeable:
                continue
            if (ra < rb) != (other[a] < other[b]):
                return False
    return True


__all__ = ["RAIL_PAIRS", "cassini_pair", "dp_sizes", "interchangeable", "moe_beside_dp", "nic_utilisation", "pipeline_beside_dp",
           "pipeline_dp_job", "ranking_agrees", "three_classes"]
