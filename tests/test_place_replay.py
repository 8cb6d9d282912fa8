"""Trace replay: closed-form JCTs, policy behaviour, metrics, the profile cache (placement.replay)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import topology
from netweave.cli import main
from placement.contention import PlacedJob
from placement.profiles import JobSpec, comm_profile, dp_groups
from placement.replay import ProfileCache, Replay, replay
from placement.traces import TraceJob, dumps_trace, synthetic_trace
from topology.errors import InputError


def _job(name, arrival, gpus, duration, compute_ms=100.0, grad=0.0):
    return TraceJob(name, arrival, gpus, duration, compute_ms, grad)


@pytest.mark.parametrize("policy", ["fifo", "las", "hived", "hived+cassini"])
def test_compute_only_jobs_have_closed_form_jcts(cluster, policy):
    # 32 GPUs: a (32 GPUs, 100 s) runs first, b (8 GPUs, 50 s) arrives at 10 s and waits for it (except LAS, which preempts)
    trace = [_job("a", 0.0, 32, 100.0), _job("b", 10.0, 8, 50.0)]
    r = replay(cluster, trace, policy)
    jobs = {j["name"]: j for j in r.jobs}
    if policy == "las":
        # both in the first LAS queue (attained < 3600 GPU-s): FIFO order inside it, so no preemption yet
        assert jobs["a"]["jct_s"] == pytest.approx(100.0)
    else:
        assert jobs["a"]["jct_s"] == pytest.approx(100.0)
        assert jobs["b"]["queue_s"] == pytest.approx(90.0)
        assert jobs["b"]["jct_s"] == pytest.approx(140.0)
    assert r.metrics["finished"] == 2
    assert r.metrics["avg_jct_s"] == pytest.approx(sum(j["jct_s"] for j in r.jobs) / 2)


def test_las_preempts_jobs_with_large_attained_service(cluster):
    # a has attained 32 GPUs x 200 s = 6400 GPU-s > 3600 when b arrives: b (fresh) preempts it
    trace = [_job("a", 0.0, 32, 400.0), _job("b", 200.0, 8, 50.0)]
    r = replay(cluster, trace, "las")
    jobs = {j["name"]: j for j in r.jobs}
    assert jobs["b"]["queue_s"] == pytest.approx(0.0)
    assert jobs["b"]["jct_s"] == pytest.approx(50.0)
    assert jobs["a"]["jct_s"] == pytest.approx(450.0)
    assert r.metrics["preemptions"] == 1


def test_fragmentation_metric_first_fit_vs_buddy(cluster):
    # 1-GPU jobs then an 8-GPU job: first-fit and buddy both pack, so nothing waits; fragmentation is between 0 and 1
    trace = [_job(f"s{i}", float(i), 1, 1000.0) for i in range(4)] + [_job("big", 10.0, 8, 100.0)]
    for policy in ("fifo", "hived"):
        r = replay(cluster, trace, policy)
        assert 0.0 <= r.metrics["fragmentation"] <= 1.0
        assert {j["name"]: j["queue_s"] for j in r.jobs}["big"] == pytest.approx(0.0)


def test_network_contention_slows_jobs_and_is_counted():
    topo = topology.build_cluster(4, hosts_per_su=2, oversubscription=4)
    # two 12-GPU jobs straddling both SUs share the spine uplinks; alone each would take iterations x solo period
    trace = [_job("a", 0.0, 12, 20.0, compute_ms=20.0, grad=1e9), _job("b", 0.0, 12, 20.0, compute_ms=20.0, grad=1e9)]
    r = replay(topo, trace, "fifo")
    spec = trace[0].spec()
    solo = comm_profile(topo, spec, topo.gpus()[:12]).period_s * spec.iterations
    jobs = {j["name"]: j for j in r.jobs}
    assert jobs["a"]["jct_s"] >= solo * 0.999
    assert r.metrics["overloaded_link_s"] >= 0.0


def test_unplaceable_job_is_reported(cluster):
    r = replay(cluster, [_job("huge", 0.0, 64, 10.0), _job("ok", 1.0, 4, 10.0)], "hived")
    jobs = {j["name"]: j for j in r.jobs}
    assert jobs["huge"]["finish_s"] is None and "64 GPUs" in jobs["huge"]["reason"]
    assert jobs["ok"]["jct_s"] == pytest.approx(10.0)


def test_profile_cache_uses_fabric_symmetry():
    topo = topology.build_cluster(8, hosts_per_su=2)
    cache = ProfileCache(topo)
    assert cache.symmetric
    spec = JobSpec("x", 16, compute_s=0.05, grad_bytes=1e9)
    g = topo.gpus()
    a = cache.profile(spec, g[0:8] + g[16:24])  # hosts 0 and 2: SU0 and SU1
    b = cache.profile(spec, g[32:40] + g[48:56])  # hosts 4 and 6: SU2 and SU3, the same shape
    assert cache.hits == 1 and cache.misses == 1
    direct = comm_profile(topo, spec, g[32:40] + g[48:56])
    assert b.link_rates == pytest.approx(direct.link_rates) and set(b.link_rates) == set(direct.link_rates)
    assert b.comm_s == pytest.approx(direct.comm_s) and a.comm_s == pytest.approx(b.comm_s)


def _renamed_reference(cache: ProfileCache, spec: JobSpec, gpus: list[str]):
    """The profile cache's translation as first written (one rename per link end): the reference for its cheap renaming."""
    hosts = list(dict.fromkeys(cache.host_of[x] for x in gpus))
    su_map: dict[int, int] = {}
    for h in hosts:
        su_map.setdefault(cache.su_of[h], len(su_map))
    used: dict[int, int] = {}
    canon_host = {}
    for h in hosts:
        c = su_map[cache.su_of[h]]
        canon_host[h] = cache.su_hosts[c][used.get(c, 0)]
        used[c] = used.get(c, 0) + 1
    canon = comm_profile(cache.topo, spec, [cache.gpu_at[(canon_host[cache.host_of[x]], cache.index[x])] for x in gpus])
    back_host = {canon_host[h]: h for h in hosts}
    back_su = {c: s for s, c in su_map.items()}

    def rename(node: str) -> str:
        if node in cache.leaf_key:
            pod, rail = cache.leaf_key[node]
            return cache.leaf[(back_su[pod], rail)]
        host, _, rest = node.partition("/")
        return f"{back_host[host]}/{rest}" if rest and host in back_host else node

    return (canon.comm_s, [((rename(u), rename(v), k), r) for (u, v, k), r in canon.link_rates.items()],
            [((rename(u), rename(v), k), b) for (u, v, k), b in canon.link_bytes.items()])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_profile_cache_renaming_equals_renaming_every_link(data):
    """Differential, over random placements and their images under random SU and host permutations: the cache's
    per-node renaming gives exactly (floats, link order) the per-link renaming of the canonical profile, hit or miss;
    images of one placement share one key; and the translated profile equals profiling the placement directly."""
    topo = _SYMMETRIC
    cache = ProfileCache(topo)
    per = len(cache.su_hosts[0])
    n_hosts = data.draw(st.integers(1, 5))
    hosts = data.draw(st.lists(st.sampled_from(topo.hosts()), min_size=n_hosts, max_size=n_hosts, unique=True))
    k = data.draw(st.sampled_from([1, 2, 4, 8]))
    local = [data.draw(st.permutations(range(8)))[:k] for _ in hosts]
    gpus = [cache.gpu_at[(h, i)] for h, ix in zip(hosts, local, strict=True) for i in ix]
    if data.draw(st.booleans()):
        gpus = data.draw(st.permutations(gpus))   # ranks not grouped by host
    tp = data.draw(st.sampled_from([t for t in (1, 2) if len(gpus) % t == 0]))
    spec = JobSpec("j", len(gpus), compute_s=0.05, grad_bytes=data.draw(st.sampled_from([1e8, 3.1e9])), tp=tp,
                   algorithm=data.draw(st.sampled_from(["ring", "tree"])))
    su_perm = data.draw(st.permutations(range(len(cache.su_hosts))))
    host_perm = [data.draw(st.permutations(range(per))) for _ in cache.su_hosts]

    def image(x: str) -> str:  # the same GPU index on the permuted host of the permuted SU
        h = cache.host_of[x]
        su, pos = cache.su_of[h], cache.su_hosts[cache.su_of[h]].index(h)
        return cache.gpu_at[(cache.su_hosts[su_perm[su]][host_perm[su][pos]], cache.index[x])]

    for placement in (gpus, [image(x) for x in gpus], gpus):
        got = cache.profile(spec, placement)
        comm_s, rates, nbytes = _renamed_reference(cache, spec, placement)
        assert got.comm_s == comm_s and list(got.link_rates.items()) == rates and list(got.link_bytes.items()) == nbytes
        assert got.gpus == tuple(placement) and got.job == "j"
        direct = comm_profile(topo, spec, placement)
        assert got.link_bytes.keys() == direct.link_bytes.keys() and got.comm_s == pytest.approx(direct.comm_s, rel=1e-12)
        assert got.link_rates == pytest.approx(direct.link_rates, rel=1e-12)
    assert cache.misses == 1 and cache.hits == 2


def _profile_reference(topo, spec: JobSpec, gpus: list[str], policy: str):
    """comm_profile as first written, from the public functions: schedule_time per DP group, route_flows of every
    distinct step's flows times its count, and each loaded link's ``bw`` read from link_attrs, one link at a time."""
    from topology.collectives import plan_collective, schedule_time
    from topology.paths import link_attrs
    from topology.routing import route_flows

    link_bytes, comm_s = {}, 0.0
    if spec.grad_bytes > 0 and spec.dp > 1:
        plans = [plan_collective(topo, "all_reduce", g, spec.grad_bytes / (spec.tp * spec.pp), algorithm=spec.algorithm)
                 for g in dp_groups(gpus, spec.tp, spec.pp)]
        flows = []
        for plan in plans:
            comm_s = max(comm_s, schedule_time(topo, plan, policy).time_s)
            counts: dict[int, list] = {}
            for step in plan.steps:
                counts.setdefault(id(step), [step, 0])[1] += 1
            flows += [(f.src, f.dst, float(f.nbytes) * n) for step, n in counts.values() for f in step]
        link_bytes = {e: b / 1e9 for e, b in route_flows(topo, flows, policy, network_only=True).items() if b > 0}
        for e, b in link_bytes.items():
            comm_s = max(comm_s, b / link_attrs(topo)[e]["bw"])
    rates = {e: b / comm_s for e, b in link_bytes.items()} if comm_s > 0 else {}
    return comm_s, list(rates.items()), list(link_bytes.items())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_comm_profile_equals_the_public_functions_link_by_link(data):
    """Differential, bit for bit (floats by their hex, link order): comm_profile's arrays give the profile that
    schedule_time, route_flows and link_attrs give, over random placements on two SUs (ranks in any order), every
    all-reduce algorithm and routing policy, tensor and pipeline degrees, and gradients that are empty."""
    topo = _TWO_SUS
    hosts = data.draw(st.lists(st.sampled_from(topo.hosts()), min_size=1, max_size=5, unique=True))
    k = data.draw(st.sampled_from([1, 2, 4, 8]))
    gpus = [f"{h}/gpu{i}" for h in hosts for i in data.draw(st.permutations(range(8)))[:k]]
    if data.draw(st.booleans()):
        gpus = data.draw(st.permutations(gpus))
    tp = data.draw(st.sampled_from([t for t in (1, 2) if len(gpus) % t == 0]))
    pp = data.draw(st.sampled_from([p for p in (1, 2) if len(gpus) % (tp * p) == 0]))
    spec = JobSpec("j", len(gpus), compute_s=0.05, grad_bytes=data.draw(st.sampled_from([0.0, 1e8, 3.1e9])), tp=tp, pp=pp,
                   algorithm=data.draw(st.sampled_from(["ring", "tree", "hierarchical"])))
    policy = data.draw(st.sampled_from(["rail", "ecmp", "shortest"]))
    try:
        ref_comm_s, ref_rates, ref_bytes = _profile_reference(topo, spec, gpus, policy)
    except InputError:  # hierarchical on a group with unequal hosts
        return
    got = comm_profile(topo, spec, gpus, policy=policy)

    def bits(items):
        return [(e, v.hex()) for e, v in items]

    assert got.comm_s.hex() == ref_comm_s.hex()
    assert bits(got.link_rates.items()) == bits(ref_rates) and bits(got.link_bytes.items()) == bits(ref_bytes)
    assert all(type(v) is float for v in [*got.link_rates.values(), *got.link_bytes.values()])


def test_profile_cache_key_has_the_pipeline_degree():
    """pp splits the gradient into per-stage groups: a placement profiled for pp=1 is not reused for pp=2."""
    for topo in (_SYMMETRIC, topology.default_cluster()):
        cache = ProfileCache(topo)
        g = topo.gpus()
        gpus = g[0:8] + g[16:24]
        for pp in (1, 2):
            spec = JobSpec("x", 16, compute_s=0.05, grad_bytes=1e9, pp=pp)
            got = cache.profile(spec, gpus)
            direct = comm_profile(topo, spec, gpus)
            assert got.comm_s == direct.comm_s and got.link_bytes == direct.link_bytes
        assert cache.misses == 2


_SYMMETRIC = topology.build_cluster(8, hosts_per_su=2)
_TWO_SUS = topology.build_cluster(8, hosts_per_su=4)


def test_replay_is_deterministic_and_cli_runs(tmp_path, capsys):
    topo = topology.default_cluster()
    trace = synthetic_trace(25, seed=2, arrival_rate=1 / 120, mean_duration_s=300)
    r1 = replay(topo, trace, "hived+cassini")
    r2 = replay(topo, trace, "hived+cassini")
    assert [j["jct_s"] for j in r1.jobs] == [j["jct_s"] for j in r2.jobs]
    assert r1.metrics["finished"] == 25
    path = tmp_path / "t.csv"
    path.write_text(dumps_trace(trace))
    out = tmp_path / "r.json"
    assert main(["place", "replay", "--topology", "default", "--trace", str(path), "--policy", "fifo,hived", "--out", str(out), "--fluid-radius", "1",
                 "--plot", str(tmp_path / "jct.png"), "--json"]) == 0
    data = json.loads(out.read_text())
    assert set(data["metrics"]) == {"fifo", "hived"} and (tmp_path / "jct.png").stat().st_size > 1000
    capsys.readouterr()
    assert main(["place", "replay", "--topology", "default", "--trace", str(path), "--policy", "sjf"]) == 2
    # a ball limit that every ball fits gives the unlimited radius model's answers; the output names the limit
    out2 = tmp_path / "r2.json"
    assert main(["place", "replay", "--topology", "default", "--trace", str(path), "--policy", "fifo", "--out", str(out2),
                 "--fluid-radius", "1", "--fluid-max-ball", "1000", "--json"]) == 0
    limited = json.loads(out2.read_text())
    assert limited["fluid_max_ball"] == 1000 and limited["per_job"]["fifo"] == data["per_job"]["fifo"]
    for bad, where in ((["--fluid-max-ball", "4"], "needs --fluid-radius"), (["--fluid-radius", "1", "--fluid-max-ball", "1"], "at least 2")):
        capsys.readouterr()
        assert main(["place", "replay", "--topology", "default", "--trace", str(path), "--policy", "fifo", *bad]) == 2
        assert where in capsys.readouterr().err


def test_phase_shifted_jobs_progress_after_their_shift(cluster):
    rp = Replay(cluster, [_job("a", 0.0, 8, 10.0)], "fifo")
    res = rp.run()
    assert res.jobs[0]["jct_s"] == pytest.approx(10.0)
    assert PlacedJob(comm_profile(cluster, JobSpec("z", 1), cluster.gpus()[:1]), 0.0).name == "z"


def test_comm_profile_cache_belongs_to_its_topology():
    """Profiles are cached per topology graph and dropped with it, so a later topology of the same size (whose graph
    may reuse a freed one's id) never reads another's profiles."""
    import gc
    import weakref

    from placement import profiles

    spec = JobSpec("j", 16, compute_s=0.1, grad_bytes=1e9)
    times = {}
    for gbps in (100, 400, 100, 50):
        topo = topology.build_cluster(4, node_options={"nic_gbps": gbps})
        gpus = sorted(n for n, d in topo.graph.nodes(data=True) if d.get("kind") == "gpu")[:16]
        times.setdefault(gbps, set()).add(comm_profile(topo, spec, gpus).comm_s)
        assert topo.graph in profiles._PROFILE_CACHE
        graph = weakref.ref(topo.graph)
        del topo
        gc.collect()
        assert graph() is None   # nothing (the cache included) keeps a topology alive, so its entries went with it
    assert all(len(v) == 1 for v in times.values())
    # the ring's time is bytes over the NIC rate: a quarter of the NIC rate, four times the time
    assert min(times[100]) == pytest.approx(4 * min(times[400]), rel=0.05) and min(times[50]) == pytest.approx(2 * min(times[100]), rel=0.05)


@pytest.mark.parametrize("collecting", [True, False])
def test_replay_pauses_the_garbage_collector_and_restores_it(collecting):
    import gc

    topo = topology.build_cluster(2)
    seen = []
    rp = Replay(topo, synthetic_trace(5, seed=1), "fifo")
    step = rp._schedule

    def schedule():
        seen.append(gc.isenabled())
        return step()

    rp._schedule = schedule
    (gc.enable if collecting else gc.disable)()
    try:
        rp.run()
        assert seen and not any(seen) and gc.isenabled() is collecting
    finally:
        gc.enable()


HASH_SEED_RUN = """
import json, sys
import topology
from bench.bench_scale import replay_trace
from placement.contention import FluidSlowdown
from placement.replay import Replay
topo = topology.build_cluster(32)
for policy in ("fifo", "las"):
    rp = Replay(topo, replay_trace(800, 256), policy, slowdown=FluidSlowdown(topo, radius=1, max_ball=8))
    rp.overload_cache_limit = 8  # emptied often: what it holds must not depend on the process
    res = rp.run()
    print(json.dumps([res.jobs, {k: v for k, v in res.metrics.items() if k != "wall_s"}]))
"""


def test_replay_is_the_same_in_processes_with_other_string_hashes():
    """Python randomises string hashing per process: no result may follow the order of a set of names or links. (The
    overloaded-link metric did, through the order its cache filled in; seen only at 50,000 jobs, where the cache is
    emptied and rounded keys collide, and not reproduced at this size: the test guards the whole replay.)"""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    outs = [subprocess.run([sys.executable, "-c", HASH_SEED_RUN], capture_output=True, text=True, timeout=300, cwd=root,
                           env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(root)}) for seed in ("1", "2")]
    assert all(o.returncode == 0 for o in outs), outs[0].stderr[-2000:] + outs[1].stderr[-2000:]
    assert outs[0].stdout == outs[1].stdout and outs[0].stdout.count("\n") == 2
