"""Emulation test of the aggregate NIC mode on the default cluster: every NIC at its own rate, as the simulator has it (root + Mininet).

Before the NIC subtrees, aggregate mode let one flow use all eight NICs of a
server (a 50 MB transfer took 0.15 ms instead of 1.0 ms, -20 % per job on the
example workload). Here a rail-crossing transfer, a second transfer on another
NIC of the same server and a direct all-to-all (two flows per NIC at once)
run together; each phase must take the simulator's time within 15 % (25 % for the
all-to-all's, whose many TCP flows per NIC start together), the
qdisc trees (with their NIC subtrees) must check out, and the class counters
must hold the bytes.
"""

from __future__ import annotations

import pytest
from conftest import IN_CI

from emu.mininet_backend import run_mininet
from emu.sim import simulate
from emu.workload import Job, P2PPhase, Transfer, Workload
from topology import default_cluster

pytestmark = pytest.mark.emulation


def _workload() -> Workload:
    p2p = Job("p2p", ("node0/gpu1", "node1/gpu0", "node0/gpu2", "node2/gpu2"),
              (P2PPhase("send", (Transfer("node0/gpu1", "node1/gpu0", 50e6), Transfer("node0/gpu2", "node2/gpu2", 50e6))),), iterations=2)
    moe = Job.mixture_of_experts("moe", ["node0/gpu4", "node0/gpu5", "node1/gpu4", "node1/gpu5"], compute_s=0.0005, expert_s=0.0005,
                                 nbytes=100e6, iterations=2)
    return Workload("aggregate-nics", [p2p, moe])


def test_aggregate_mode_shapes_every_nic_at_its_own_rate():
    topo, w = default_cluster(), _workload()
    emu = run_mininet(topo, w, time_scale=8000, byte_scale=50, nic_mode="aggregate", raise_on_fidelity=False)
    fid = emu.meta["fidelity"]
    assert fid["htb_before"]["ok"] and fid["htb_after"]["ok"], fid["htb_before"]["problems"][:4]
    assert fid["class_bytes"]["ok"], fid["class_bytes"]["problems"]
    if not fid["ok"] and not IN_CI and all(p.startswith(("CPU busy", "calibration flow")) for p in fid["problems"]):
        pytest.skip(f"machine saturated by other processes, emulation not trustworthy: {fid['problems']}")
    assert fid["ok"], fid["problems"]
    sim = simulate(topo, w)

    def phase_means(result):
        out = {}
        for p in result.phases:
            out.setdefault((p.job, p.phase), []).append(p.end - p.start)
        return {k: sum(v) / len(v) for k, v in out.items() if k[1] != "compute" and k[1] != "experts"}

    s, e = phase_means(sim), phase_means(emu)
    assert s[("p2p", "send")] == pytest.approx(50e6 / 50e9, rel=0.01)  # one NIC's rate, not the server's eight
    for key in s:
        # the all-to-all's phases start several TCP flows per NIC at once, which the fluid model does not slow
        # (slow start and losses at a 200-packet HTB queue): +4.5 to +10.7 % per job in the agreement suite's MoE
        # mix, +15 % on one CI run here. 25 % still fails NICs shaped at the server's rate (several times faster).
        tolerance = 0.25 if key[0] == "moe" else 0.15
        assert e[key] == pytest.approx(s[key], rel=tolerance), (key, s[key], e[key])
