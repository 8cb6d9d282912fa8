"""The GPU check of the NCCL hook (csrc/tests/gpu_nccl_check.py) rehearsed on the CPU.

The real check needs a GPU and runs only where one is lent; its results are committed in
bench/results/ncclhook_gpu.*. ``--cpu-rehearsal`` runs the same orchestration with gloo ranks
(no NCCL, so no marks): namespaces, the HTB trees, the capture, the flowsched plan and the three
contention phases. This keeps the script working between GPU runs and checks what the network
alone must show: nobody beats the shaped link, and a bulk job in the same class slows the small one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from emu.htb import HtbSpec

pytestmark = pytest.mark.emulation
SCRIPT = Path(__file__).resolve().parent.parent / "csrc" / "tests" / "gpu_nccl_check.py"


def rehearse(tmp_path: Path, *args: str) -> dict:
    res = subprocess.run([sys.executable, str(SCRIPT), "--cpu-rehearsal", "--out-dir", str(tmp_path), *args],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 1, res.stdout + res.stderr  # the NCCL checks cannot pass without NCCL
    assert (tmp_path / "ncclhook_gpu.md").read_text().startswith("# NCCL hook on a GPU")
    return json.loads((tmp_path / "ncclhook_gpu.json").read_text())


def test_contention_phases_respect_the_link_and_the_shared_class_slows_the_small_job(tmp_path):
    rep = rehearse(tmp_path, "--scenario", "contention", "--iters", "6", "--repeats", "1", "--small-mib", "0.5")
    con = rep["scenarios"]["contention"]
    assert "error" not in con, con.get("error")
    checks = con["checks"]
    assert checks["ranks_exited_0_and_correct"] and checks["sincronia_puts_small_first"]
    by = {p["kind"]: p for p in con["phases"]}
    # a 2-rank all-reduce sends its whole buffer each way, in two halves (reduce-scatter, all-gather): no faster
    # than bytes / link rate, less the head start of a full HTB bucket at the start of each half
    burst = HtbSpec("veth", con["rate_mbit"]).burst_bytes
    floor = (con["small_bytes"] - 2 * burst) * 8 / (con["rate_mbit"] * 1e6)
    assert all(t >= 0.99 * floor for t in by["alone"]["latency_s"])
    assert by["contended_no_plan"]["median_s"] > 1.2 * by["alone"]["median_s"]
    assert by["contended_no_plan"]["bulk_ops"] >= 1
    # gloo is unmarked: without NCCL the planned phase has nothing to classify
    assert set(by["contended_plan"]["htb_bytes_a_egress"]) <= {"1:1", "1:17", "1:20"}
    # each host's plugin plan gives the small job's class (7 = priority 0) CS7 and the bulk job's a lower one
    plan_a = by["contended_plan"]["plan_files"]["nwcona"].splitlines()
    assert plan_a[0] == "netweave-plan 1" and "class 7 dscp=56 prio=65552" in plan_a
    assert con["classes"]["small"]["priority"] < con["classes"]["bulk"]["priority"]


def test_netns_scenario_counts_every_byte_in_the_htb_leaves(tmp_path):
    rep = rehearse(tmp_path, "--scenario", "netns")
    net = rep["scenarios"]["netns"]
    assert net["checks"]["ranks_exited_0"] and net["checks"]["allreduce_correct"]
    group = 4 * sum(net["sizes"])
    # unmarked gloo traffic of both groups lands in the default leaf, both ways, exactly counted by the kernel
    assert net["htb_bytes_a_egress"]["1:17"] >= 2 * group and net["htb_bytes_b_egress"]["1:17"] >= 2 * group
    assert net["payload_by_tos"].get("0", 0) > 0
