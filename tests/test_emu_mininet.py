"""Emulation tests: real Mininet networks, real TCP and gloo traffic (root + Mininet; see tests/conftest.py).

Topologies are small stars (one 200 Gb/s NIC per server on one leaf) emulated at
time scale K = 2000, i.e. 100 Mbit/s links, so that the 2-core CI machine has
CPU headroom. Every run carries its fidelity report; when the only failed
check is CPU saturation and we are not in CI, the test is skipped (the
machine is shared with other work), otherwise a failed check fails the test.

Run: ``sudo .venv/bin/python -m pytest -q tests/test_emu_mininet.py``.
"""

from __future__ import annotations

import subprocess

import pytest
from conftest import IN_CI

from emu.mininet_backend import run_mininet, run_torch_job
from emu.net import EmulatedNetwork, FidelityError, plan_network
from emu.results import compare_results, format_comparison
from emu.sim import simulate
from emu.workload import ComputePhase, Job, P2PPhase, Transfer, Workload
from topology.fabrics import star

pytestmark = pytest.mark.emulation

K = 2000  # 25 GB/s (200 Gb/s) NICs -> 100 Mbit/s emulated links




def _our_root_links(plan) -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    ours = {s.name for s in plan.switches} | {i.switch_dev for i in plan.interfaces}
    return {name for name in ours if f": {name}:" in out or f": {name}@" in out}


def _fidelity(fn, *args, **kwargs):
    """Call a backend; outside CI, skip when the CPU was saturated (by other work on a shared machine).

    A saturated CPU also explains a calibration flow that missed its rate; any
    other failed check (qdisc tree, DSCP marks, class counters) fails the test.
    """
    try:
        return fn(*args, **kwargs)
    except FidelityError as exc:
        problems = exc.report.get("problems", [])
        saturated = any(p.startswith("CPU busy") for p in problems)
        explained = all(p.startswith(("CPU busy", "calibration flow")) for p in problems)
        if saturated and explained and not IN_CI:
            pytest.skip(f"machine saturated by other processes, emulation not trustworthy: {problems}")
        raise


def test_network_trees_calibration_and_cleanup():
    plan = plan_network(star(3), time_scale=K)
    with EmulatedNetwork(plan) as net:
        report = net.verify_htb()
        assert report["ok"] and report["interfaces"] == 6
        assert "0% packet loss" in net.host_cmd(plan.interfaces[0].host, f"ping -c1 -W2 {plan.interfaces[2].ip}")
        cal = net.calibrate(seconds=1.0, raise_on_error=False)
        assert cal["expected_mbit"] == pytest.approx(100.0)
        if not IN_CI and not cal["ok"]:
            pytest.skip(f"calibration off on a shared machine: {cal['problems']}")
        assert cal["ok"], cal
        shells = [net.host(h).shell.pid for h in plan.hosts]
        port = plan.interfaces[1].switch_dev
        net.remove_htb(port)
        with pytest.raises(FidelityError, match=port):
            net.verify_htb()
    assert _our_root_links(plan) == set()
    for pid in shells:  # the hosts' shells (and so their namespaces) are gone
        assert subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode != 0


def test_cleanup_after_an_exception_inside_the_run():
    plan = plan_network(star(2), time_scale=K)
    with pytest.raises(RuntimeError, match="boom"), EmulatedNetwork(plan) as net:
        assert net.verify_htb()["ok"]
        raise RuntimeError("boom")
    assert _our_root_links(plan) == set()


def test_gloo_ring_allreduce_meets_the_bandwidth_bound():
    """4 ranks all-reducing S bytes through links of rate B take 2(n-1)/n * S/B (within 15%)."""
    r = _fidelity(run_torch_job, star(4), "allreduce", time_scale=K, nbytes=8e6, iterations=3, warmup=1)
    assert r["correct"] and r["world"] == 4
    assert r["bound_s_emulated"] == pytest.approx(1.5 * 8e6 / (100e6 / 8))
    assert 0.95 <= r["ratio_to_bound"] <= 1.15, r["iteration_s_emulated"]
    assert r["link_gbs"] == pytest.approx(25.0)  # reported in real-fabric units


def test_ddp_training_runs_over_the_emulated_links():
    """A real DistributedDataParallel loop (gloo) on 3 emulated servers: it trains, and its gradients crossed the links."""
    r = _fidelity(run_torch_job, star(3), "ddp", time_scale=K, iterations=4, warmup=1, width=256)
    losses = r["report"]["loss"]
    assert len(losses) == 4 and losses[-1] < losses[0]
    grad = r["report"]["grad_bytes"]
    floor = 2 * (3 - 1) / 3 * grad / (r["link_mbit_emulated"] * 1e6 / 8)  # all-reduce of the gradients at link rate
    assert all(t >= 0.9 * floor for t in r["iteration_s_emulated"])  # no step beat the network


def _two_jobs(prio_a: int, prio_b: int, compute_b: float) -> Workload:
    topo_gpus = [f"n{i}/gpu0" for i in range(3)]

    def job(name: str, src: str, compute: float, prio: int) -> Job:
        phases = (ComputePhase("compute", compute), P2PPhase("send", (Transfer(src, topo_gpus[2], 2.5e6),), after=("compute",)))
        return Job(name, (src, topo_gpus[2]), phases, iterations=3, priority=prio)

    return Workload(f"two-jobs-p{prio_a}{prio_b}", [job("a", topo_gpus[0], 5e-5, prio_a), job("b", topo_gpus[1], compute_b, prio_b)])


CASES = {
    # one data-parallel job: 4-rank ring all-reduce of 10 MB (6 steps of 2.5 MB flows) after 0.1 s (emulated) of compute
    "single-job": (4, Workload("dp", [Job.data_parallel("a", [f"n{i}/gpu0" for i in range(4)], compute_s=5e-5, nbytes=10e6,
                                                        iterations=3)])),
    # two jobs sending into the same server: they share its downlink equally (both class 0)
    "shared-equal": (3, _two_jobs(0, 0, 1.5e-4)),
    # the same bottleneck with job a in class 0 and job b in class 1: a is served first
    "shared-strict": (3, _two_jobs(0, 1, 5e-5)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_simulator_agrees_with_emulation(case, tmp_path):
    hosts, workload = CASES[case]
    topo = star(hosts)
    emu = _fidelity(run_mininet, topo, workload, time_scale=K, out_dir=tmp_path)
    sim = simulate(topo, workload)
    cmp = compare_results(sim, emu)
    fidelity = emu.meta["fidelity"]
    assert fidelity["ok"] and fidelity["dscp"]["ok"] and fidelity["class_bytes"]["ok"]
    assert (tmp_path / "fidelity.json").exists() and (tmp_path / "result-mininet.json").exists()
    assert cmp["mape"] <= 10.0, format_comparison(cmp)
    if case == "shared-strict":  # priority made a difference in both backends
        a, b = emu.jobs["a"].mean_iteration_time(), emu.jobs["b"].mean_iteration_time()
        assert a < b and sim.jobs["a"].mean_iteration_time() < sim.jobs["b"].mean_iteration_time()
        assert fidelity["class_bytes"]["per_priority"][1]["class_bytes"] >= 7.5e6  # job b's bytes went through class 1
