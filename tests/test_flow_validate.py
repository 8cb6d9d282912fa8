"""Scenario builders of flowsched.validate (pure), the per-rank torch script on loopback, and one lean emulation test."""

from __future__ import annotations

import json
import math
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from emu.sim import simulate
from flowsched.coflow import Coflow, Flow, cct_lower_bound, priority_cct, sincronia_order, weighted_cct
from flowsched.validate import (
    IntrajobSetup,
    alone_iteration_time,
    contention_scenario,
    contention_workload,
    iteration_coflow,
    mean_jct,
    policy_plan,
    port_capacity,
    random_coflows,
    sebf_order,
    simulate_policies,
    star_topology,
    summarize_intrajob,
)
from topology.errors import InputError

REPO = Path(__file__).resolve().parent.parent


# -- topology and coflows ------------------------------------------------------------------------------------


def test_star_topology_ports():
    topo = star_topology(3, 2, nic_gbps=80)
    cap = port_capacity(topo)
    assert set(cap) == {(d, f"host{h}") for d in ("in", "out") for h in range(3)}
    assert all(v == pytest.approx(10e9) for v in cap.values())
    with pytest.raises(InputError):
        star_topology(0)


@pytest.mark.parametrize("hosts", [2, 3, 4])
def test_iteration_coflow_carries_ring_allreduce_bytes(hosts):
    topo, jobs = contention_scenario(2, hosts=hosts, base_bytes=6e6, iterations=3)
    for j in jobs:
        load = iteration_coflow(topo, j, iterations=j.iterations).port_bytes()
        # ring all-reduce: every rank sends and receives 2(n-1)/n of the buffer per iteration
        want = 2 * (hosts - 1) / hosts * j.nbytes * j.iterations
        assert all(v == pytest.approx(want) for v in load.values()) and len(load) == 2 * hosts


def test_alone_iteration_time_closed_form():
    topo, jobs = contention_scenario(1, nic_gbps=100, base_bytes=125e6, compute_s=0.01)
    assert alone_iteration_time(topo, jobs[0]) == pytest.approx(0.01 + 125e6 / 12.5e9)


# -- policies ------------------------------------------------------------------------------------------------


def test_policy_classes():
    topo, jobs = contention_scenario(3)
    fair = policy_plan(topo, jobs, "fair")
    assert set(fair["priority"].values()) == {0}
    sinc = policy_plan(topo, jobs, "sincronia")
    assert sinc["order"] == ["jobA", "jobB", "jobC"]  # one shared bottleneck: smallest first
    assert sinc["priority"] == {"jobA": 0, "jobB": 1, "jobC": 2}
    ger = policy_plan(topo, jobs, "geryon", classes=2)
    assert ger["priority"] == {"jobA": 0, "jobB": 0, "jobC": 1}
    for plan in (fair, sinc, ger):
        assert all(len(row) == j.iterations and len(set(row)) == 1 for j, row in zip(jobs, plan["classes"].values(), strict=True))
    with pytest.raises(InputError):
        policy_plan(topo, jobs, "edf")


def test_parrot_prefers_the_shortest_job_and_promotes_survivors():
    topo, jobs = contention_scenario(3)
    plan = policy_plan(topo, jobs, "parrot")
    first = plan["epochs"][0]
    assert first["srpt_job"] == "jobA" and first["class"]["jobA"] == 0
    # rates respect every port and the starvation floor
    coflows = {j.name: iteration_coflow(topo, j) for j in jobs}
    cap = port_capacity(topo)
    for epoch in plan["epochs"]:
        use: dict = {}
        for name, rate in epoch["coflows_per_s"].items():
            for port, b in coflows[name].port_bytes().items():
                use[port] = use.get(port, 0.0) + rate * b / cap[port]
        assert max(use.values()) <= 1 + 1e-6
    # once a job is done, the next-shortest job's later iterations move up to class 0
    assert plan["classes"]["jobB"][-1] == 0 and plan["classes"]["jobC"][-1] == 0
    assert plan["refinement"], "the epochs were refined with the simulator"


def test_workload_unrolls_iterations_with_classes():
    topo, jobs = contention_scenario(2, iterations=3)
    w = contention_workload(jobs, policy_plan(topo, jobs, "sincronia"))
    w.validate(topo)
    assert [p.name for p in w.jobs[0].phases] == ["c0", "ar0", "c1", "ar1", "c2", "ar2"]
    assert [p.priority for p in w.jobs[1].phases if p.kind == "collective"] == [1, 1, 1]


def test_simulated_jcts_match_closed_forms():
    """No compute: strict priority finishes jobs one after another; fair sharing is processor sharing on the ports."""
    topo, jobs = contention_scenario(3, compute_s=0.0, iterations=2, base_bytes=100e6)
    alone = [j.iterations * j.nbytes / 12.5e9 for j in jobs]  # n=2 ring: S per direction per iteration
    res = simulate_policies(topo, jobs, ("fair", "sincronia"), sim_options={"latency": False})
    prio = res["sincronia"]["jct_s"]
    assert [prio[j.name] for j in jobs] == pytest.approx(np.cumsum(alone).tolist(), rel=1e-3)
    a, b, c = alone
    fair = res["fair"]["jct_s"]
    assert [fair[j.name] for j in jobs] == pytest.approx([3 * a, 3 * a + 2 * (b - a), 3 * a + 2 * (b - a) + (c - b)], rel=1e-3)
    assert res["fair"]["mean_jct_s"] > res["sincronia"]["mean_jct_s"]


def test_mean_jct():
    topo, jobs = contention_scenario(2)
    r = simulate(topo, contention_workload(jobs, policy_plan(topo, jobs, "fair")))
    assert mean_jct(r) == pytest.approx(np.mean([j.jct for j in r.jobs.values()]))


# -- scenario 3 helpers ----------------------------------------------------------------------------------------


def _bssi_reference(coflows, capacity):
    """The loop form of BSSI (as first written in flowsched.coflow), to check the vectorised one against."""
    from flowsched.coflow import _demands

    _, d = _demands(coflows, capacity)
    weights = np.array([c.weight for c in coflows], dtype=float)
    remaining = list(range(len(coflows)))
    placed = []
    while remaining:
        load = d[remaining].sum(axis=0)
        if load.max() <= 0:
            placed.extend(reversed(remaining))
            break
        b = int(np.argmax(load))
        best, best_ratio = None, math.inf
        for c in remaining:
            if d[c, b] > 0 and weights[c] / d[c, b] <= best_ratio:
                best, best_ratio = c, weights[c] / d[c, b]
        for c in remaining:
            if c != best:
                weights[c] -= weights[best] * d[c, b] / d[best, b]
        remaining.remove(best)
        placed.append(best)
    return [coflows[i].name for i in reversed(placed)]


@pytest.mark.parametrize("seed", range(12))
def test_vectorised_bssi_equals_loop_form(seed):
    rng = random.Random(seed)
    cs = random_coflows(rng.randint(1, 40), rng.randint(2, 8), seed=rng, weighted=bool(seed % 2))
    if seed % 3 == 0:  # equal coflows and an empty one exercise the tie rules
        cs += [Coflow("dup1", [Flow("h0", "h1", 5e6)]), Coflow("dup2", [Flow("h0", "h1", 5e6)]), Coflow("empty", [])]
    assert sincronia_order(cs, 1e9) == _bssi_reference(cs, 1e9)


def test_random_coflows_and_sebf():
    cs = random_coflows(30, 6, seed=4, max_width=3)
    assert len(cs) == 30 and all(c.flows and all(f.src != f.dst and f.nbytes > 0 for f in c.flows) for c in cs)
    assert random_coflows(30, 6, seed=4, max_width=3)[7].flows == cs[7].flows  # seeded
    order = sebf_order(cs, 1e9)
    gamma = {c.name: max(c.port_bytes().values()) / 1e9 for c in cs}
    assert [gamma[n] for n in order] == sorted(gamma.values())
    # BSSI never loses to the lower bound and here beats arrival order
    lb = cct_lower_bound(cs, 1e9)
    bssi = weighted_cct(cs, priority_cct(cs, sincronia_order(cs, 1e9), 1e9))
    fifo = weighted_cct(cs, priority_cct(cs, [c.name for c in cs], 1e9))
    assert lb <= bssi * (1 + 1e-9) and bssi < fifo
    with pytest.raises(InputError):
        random_coflows(3, 1)


# -- scenario 1 helpers ----------------------------------------------------------------------------------------


def test_intrajob_setup_and_summary():
    s = IntrajobSetup(world=3, layers=4, width=256)
    assert s.gradient_bytes == 4 * (256 * 256 + 256) * 4
    topo = s.topology()
    assert len(topo.hosts()) == 3 and port_capacity(topo)[("out", "host0")] == pytest.approx(s.rate_mbit * 1e6 / 8)
    for bad in ({"world": 1}, {"rate_mbit": 500}, {"iters": 0}):
        with pytest.raises(InputError):
            IntrajobSetup(**bad)
    rep = {"median_s": {"compute": 1.0, "ddp": 3.0, "prophet": 2.0, "bytescheduler": 2.4}, "lower_bound_s": 1.6, "compute_s": 1.0,
           "comm_s": 1.6}
    summ = summarize_intrajob(rep)
    assert summ["speedup_vs_ddp"] == pytest.approx({"ddp": 1.0, "prophet": 1.5, "bytescheduler": 1.25})
    assert summ["over_bound"]["prophet"] == pytest.approx(0.25)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_job_on_loopback(tmp_path):
    """The per-rank script end to end with two ranks over loopback (tiny model): every method trains, plans cover the model."""
    port, out = _free_port(), tmp_path / "r.json"
    args = ["--world", "2", "--master-addr", "127.0.0.1", "--master-port", str(port), "--ifname", "lo", "--layers", "3", "--width", "32",
            "--batch", "16", "--iters", "2", "--warmup", "1", "--rounds", "1", "--profile-iters", "2", "--probe-bytes", "4096",
            "--probe-repeats", "2", "--timeout", "60", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-m", "flowsched.torchrun_job", "--rank", str(r), *args], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    logs = [p.communicate(timeout=120)[0].decode() for p in procs]
    assert all(p.returncode == 0 for p in procs), logs
    rep = json.loads(out.read_text())
    assert set(rep["iteration_s"]) == {"compute", "ddp", "prophet", "bytescheduler"}
    assert all(len(v) == 2 for v in rep["iteration_s"].values())
    assert rep["profile"]["nbytes"] == [float((32 * 32 + 32) * 4)] * 3
    for plan in rep["plans"].values():
        sent = [0.0] * 3
        for t in plan["transfers"]:
            for layer, b in t:
                sent[layer] += b
        assert sent == pytest.approx(rep["profile"]["nbytes"])
    assert rep["lower_bound_s"] == max(rep["compute_s"], rep["comm_s"])
    assert all(math.isfinite(x) for v in rep["loss_first_last"].values() for x in v)


# -- emulation ---------------------------------------------------------------------------------------------------


@pytest.mark.emulation
def test_priority_protects_the_small_job_in_mininet():
    """Two jobs on one bottleneck in Mininet: under strict priority the small job finishes close to its solo time,
    far earlier than under fair sharing, and the flow-level simulator agrees with the emulator."""
    from flowsched.validate import emulate_policy

    topo, jobs = contention_scenario(2, iterations=2, base_bytes=200e6, growth=3.0, compute_s=2e-3)
    solo = 2 * alone_iteration_time(topo, jobs[0])
    sim = simulate_policies(topo, jobs, ("fair", "sincronia"))
    def emulate(policy: str) -> dict[str, float]:
        result, fidelity = emulate_policy(topo, jobs, sim[policy]["plan"], time_scale=1000, byte_scale=40, probe_dscp=False,
                                          calibrate_seconds=1.0)
        assert fidelity["htb_before"]["ok"] and fidelity["calibration_before"]["ok"], fidelity
        return {n: j.jct for n, j in result.jobs.items()}

    def off(policy: str, jcts: dict[str, float]) -> float:
        return abs(float(np.mean(list(jcts.values()))) / sim[policy]["mean_jct_s"] - 1.0)

    emu = {}
    for policy in ("fair", "sincronia"):
        emu[policy] = emulate(policy)
        if off(policy, emu[policy]) > 0.15:
            # One re-measurement: on a quiet machine the emulator lands 0-9 % above the simulator, but a shared
            # 2-core host slows Mininet at times (once +18 % in a fresh-clone CI run); a real disagreement repeats.
            emu[policy] = emulate(policy)
    small = jobs[0].name
    assert emu["sincronia"][small] <= 1.25 * solo
    assert emu["sincronia"][small] < 0.7 * emu["fair"][small]
    for policy in ("fair", "sincronia"):
        assert off(policy, emu[policy]) <= 0.15, (policy, emu[policy], sim[policy]["mean_jct_s"])


@pytest.mark.emulation
def test_failed_fidelity_check_keeps_the_run(tmp_path):
    """A fidelity failure (here forced: a CPU limit of -1 cannot hold) is reported, not raised, and the measured
    result and the report on disk survive; the emulated names carry flowsched's prefix."""
    import json

    from flowsched.validate import EMU_PREFIX, emulate_policy

    topo, jobs = contention_scenario(2, iterations=1, base_bytes=50e6, compute_s=2e-3)
    plan = simulate_policies(topo, jobs, ("fair",))["fair"]["plan"]
    result, fidelity = emulate_policy(topo, jobs, plan, time_scale=1000, byte_scale=40, probe_dscp=False, calibrate_seconds=0.5,
                                      cpu_limit=-1.0, out_dir=tmp_path)
    assert not fidelity["ok"] and any("CPU busy" in p for p in fidelity["problems"])
    assert set(result.jobs) == {j.name for j in jobs} and all(j.jct > 0 for j in result.jobs.values())
    assert json.loads((tmp_path / "fidelity.json").read_text())["ok"] is False
    assert all(h.startswith(EMU_PREFIX) for h in result.meta["plan"]["hosts"])
