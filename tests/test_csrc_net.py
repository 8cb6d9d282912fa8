"""The net plugin of csrc/ driven through its function tables by csrc/tests/net_harness.c.

The harness dlopens the library like NCCL (newest ncclNetPlugin_vN first, or a forced
version), forks a sender and a receiver and moves messages of many sizes over loopback;
it checks every byte and reports the marks of the plugin's sockets (getsockopt in each
process). Wire-level marks are checked with a scapy capture on ``lo`` (root only).
"""

from __future__ import annotations

import os
import re
import subprocess
import time

import pytest

from flowsched import ncclhook

SIZES = "0,1,7,4096,65535,65536,131071,131072,131073,262145,1000000,4194304,16777219"


@pytest.fixture(scope="module")
def build_dir():
    return ncclhook.build()


def run_harness(build_dir, *args, env=None, timeout=120, sanitize=False):
    lib = build_dir / ncclhook.PLUGIN_LIB
    full_env = {**os.environ, "NETWEAVE_SOCKET_IFNAME": "lo", **(env or {})}
    full_env.pop("NETWEAVE_PLAN", None) if "NETWEAVE_PLAN" not in (env or {}) else None
    res = subprocess.run([str(build_dir / "net_harness"), str(lib), *map(str, args)], capture_output=True, text=True,
                         env=full_env, timeout=timeout)
    return res


def marks(out: str) -> dict[str, list[dict[str, int]]]:
    result: dict[str, list[dict[str, int]]] = {"sender": [], "receiver": []}
    for m in re.finditer(r"MARK (\w+) fd=\d+ tos=(\d+) prio=(\d+) pacing=(\d+) lport=(\d+) rport=(\d+)", out):
        result[m.group(1)].append({"tos": int(m.group(2)), "prio": int(m.group(3)), "pacing": int(m.group(4)),
                                   "lport": int(m.group(5)), "rport": int(m.group(6))})
    return result


def expected_bytes(sizes: str, iters: int, window: int) -> int:
    return sum(int(s) for s in sizes.split(",")) * iters * window


@pytest.mark.parametrize("version", ["auto", "12", "11", "10"])
def test_all_sizes_intact_and_marked_per_version(build_dir, version):
    res = run_harness(build_dir, "--version", version, "--tc", 5, "--sizes", SIZES, "--iters", 1, "--window", 4)
    assert res.returncode == 0, res.stdout + res.stderr
    want = 12 if version == "auto" else int(version)
    assert f"VERSION {want}" in res.stdout
    assert f"OK receiver bytes={expected_bytes(SIZES, 1, 4)} version={want}" in res.stdout
    m = marks(res.stdout)
    # control socket + 2 data sockets on each side, all in class 5: DSCP CS5 (TOS 0xa0) and SO_PRIORITY 5
    assert len(m["sender"]) == 3 and len(m["receiver"]) == 3
    for sock in m["sender"] + m["receiver"]:
        assert (sock["tos"], sock["prio"]) == (5 * 8 << 2, 5)


def test_undefined_traffic_class_leaves_sockets_unmarked(build_dir):
    res = run_harness(build_dir, "--sizes", "1,70000", "--iters", 1)
    assert res.returncode == 0, res.stdout + res.stderr
    assert all(s["tos"] == 0 and s["prio"] == 0 for s in marks(res.stdout)["sender"])


def test_plan_sets_dscp_priority_pacing_and_socket_count(build_dir, tmp_path):
    plan = ncclhook.FlowPlan(classes={3: ncclhook.ClassMark(dscp=46, prio=6, rate=40_000_000, nsocks=4, sockchunk=65536)})
    path = ncclhook.write_plan(plan, tmp_path / "p.plan")
    res = run_harness(build_dir, "--tc", 3, "--sizes", "0,5,300000,1048577", "--iters", 2, env={"NETWEAVE_PLAN": str(path)})
    assert res.returncode == 0, res.stdout + res.stderr
    m = marks(res.stdout)
    assert len(m["sender"]) == 5 and len(m["receiver"]) == 5  # 1 control + 4 data sockets
    data = [s for s in m["sender"] if s["pacing"] != 2**64 - 1]
    assert len(data) == 4 and all(s["pacing"] == 10_000_000 for s in data)  # the rate is split over the data sockets
    for s in m["sender"] + m["receiver"]:
        assert (s["tos"], s["prio"]) == (46 << 2, 6)


def test_order_rule_overrides_the_nccl_class(build_dir, tmp_path):
    # both harness processes initialise exactly one communicator: order 0
    plan = ncclhook.FlowPlan(comms=[ncclhook.CommRule("order", 0, cls=6)])
    path = ncclhook.write_plan(plan, tmp_path / "p.plan")
    res = run_harness(build_dir, "--tc", 1, "--sizes", "100", "--iters", 1, env={"NETWEAVE_PLAN": str(path)})
    assert res.returncode == 0, res.stdout + res.stderr
    assert all((s["tos"], s["prio"]) == (48 << 2, 6) for s in marks(res.stdout)["sender"])


@pytest.mark.parametrize("n", [2, 8])
def test_grouped_receive_matches_tags(build_dir, n):
    res = run_harness(build_dir, "--multi", n, "--sizes", "0,3,131073,600000", "--iters", 2)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"OK receiver bytes={expected_bytes('0,3,131073,600000', 2, n)}" in res.stdout


def test_message_larger_than_buffer_fails_cleanly(build_dir):
    res = run_harness(build_dir, "--oversize", "--sizes", "10,3000000", "--iters", 1, "--window", 1)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "OVERSIZE rejected with 3" in res.stdout  # ncclInternalError on the receiver
    # the sender returns (no hang): its send either fit in the kernel's socket buffers before the receiver
    # closed (completed) or hit the reset (failed) - both are correct completion semantics for TCP
    assert re.search(r"SENDER last send (completed|failed)", res.stdout)


def test_sanitizer_build_runs_the_same_harness(tmp_path):
    san = ncclhook.build(sanitize=True)
    env = {"ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0", "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}
    for args in (["--tc", 2, "--sizes", SIZES, "--iters", 1, "--window", 4], ["--multi", 4, "--sizes", "0,9,200001", "--version", 11],
                 ["--oversize", "--sizes", "10,3000000", "--window", 1, "--version", 10]):
        res = run_harness(san, *args, env=env, timeout=180)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "ERROR: AddressSanitizer" not in res.stderr and "runtime error" not in res.stderr, res.stderr


@pytest.mark.emulation
def test_dscp_on_the_wire_in_both_directions(build_dir):
    """A scapy capture on lo: every packet of the plugin's connections carries TOS 0x98 (DSCP 38)."""
    from scapy.all import IP, TCP, AsyncSniffer

    pytest.importorskip("scapy")
    plan_env = {}
    sniffer = AsyncSniffer(iface="lo", store=True, lfilter=lambda p: IP in p and TCP in p and p[IP].src == "127.0.0.1")
    sniffer.start()
    time.sleep(0.5)
    try:
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            plan = ncclhook.write_plan(ncclhook.FlowPlan(classes={4: ncclhook.ClassMark(dscp=38)}), os.path.join(d, "p.plan"))
            plan_env["NETWEAVE_PLAN"] = str(plan)
            res = run_harness(build_dir, "--tc", 4, "--sizes", "0,1000,20000", "--iters", 2, "--window", 2, env=plan_env)
    finally:
        time.sleep(0.3)
        packets = sniffer.stop()
    assert res.returncode == 0, res.stdout + res.stderr
    m = marks(res.stdout)
    ports = {s["lport"] for s in m["sender"]} | {s["lport"] for s in m["receiver"]}
    ours = [p for p in packets if p[TCP].sport in ports or p[TCP].dport in ports]
    payload = sum(len(p[TCP].payload) for p in ours)
    # data of both rounds plus message headers and handshakes went through, every packet marked
    assert payload >= expected_bytes("0,1000,20000", 2, 2)
    unmarked = [(p[TCP].sport, p[TCP].dport, str(p[TCP].flags), len(p[TCP].payload)) for p in ours if p[IP].tos >> 2 != 38]
    assert not unmarked
    directions = {(p[TCP].sport in {s["lport"] for s in m["sender"]}) for p in ours}
    assert directions == {True, False}  # sender's data and the receiver's ACKs


def test_library_exports_the_symbols_nccl_looks_for(build_dir):
    out = subprocess.run(["nm", "-D", "--defined-only", str(build_dir / ncclhook.PLUGIN_LIB)], capture_output=True, text=True).stdout
    for sym in ("ncclNetPlugin_v12", "ncclNetPlugin_v11", "ncclNetPlugin_v10", "ncclTunerPlugin_v6", "ncclTunerPlugin_v5",
                "ncclProfiler_v6", "ncclProfiler_v5"):
        assert re.search(rf"\b{sym}\b", out), sym
    # nothing else leaks into NCCL's namespace but our own prefixed helpers
    names = {line.split()[-1] for line in out.splitlines() if line.strip()}
    assert all(n.startswith(("nccl", "netweave_")) for n in names if not n.startswith("_")), names
    for alias in ("libnccl-tuner-netweave.so", "libnccl-profiler-netweave.so"):
        assert os.path.realpath(build_dir / alias) == os.path.realpath(build_dir / ncclhook.PLUGIN_LIB)




def test_plan_change_remarks_a_live_connection(build_dir, tmp_path):
    """The sender rewrites the plan between iterations; its next isend re-marks every socket of the connection."""
    path = ncclhook.write_plan(ncclhook.FlowPlan(classes={3: ncclhook.ClassMark(dscp=10, prio=1)}), tmp_path / "p.plan")
    new = ncclhook.format_plan(ncclhook.FlowPlan(classes={3: ncclhook.ClassMark(dscp=34, prio=4, rate=50_000_000)}))
    res = run_harness(build_dir, "--tc", 3, "--sizes", "1000,200000", "--iters", 2, "--rewrite-plan", path,
                      env={"NETWEAVE_PLAN": str(path), "HARNESS_NEW_PLAN": new})
    assert res.returncode == 0, res.stdout + res.stderr
    before = marks(res.stdout)["sender"]
    after = [{"tos": int(t), "prio": int(p), "pacing": int(r)}
             for t, p, r in re.findall(r"MARKEND sender fd=\d+ tos=(\d+) prio=(\d+) pacing=(\d+)", res.stdout)]
    assert len(before) == len(after) == 3
    assert all((s["tos"], s["prio"]) == (10 << 2, 1) for s in before)
    assert all((s["tos"], s["prio"]) == (34 << 2, 4) for s in after)
    assert sorted(s["pacing"] for s in after) == [25_000_000, 25_000_000, 2**64 - 1]  # control socket unpaced


def test_loopback_transfer_carries_the_plans_marks(build_dir, tmp_path):
    plan = ncclhook.write_plan(ncclhook.FlowPlan(classes={7: ncclhook.ClassMark(dscp=46, prio=6)}), tmp_path / "p.plan")
    t = ncclhook.loopback_transfer(7, plan=plan, sizes=(1, 65537), window=2, build_dir=build_dir)
    assert t["version"] == 12 and t["bytes"] == t["expected_bytes"] == 2 * (1 + 65537)
    sockets = t["marks"]["sender"] + t["marks"]["receiver"]
    assert len(sockets) == 6 and {(m["tos"], m["prio"]) for m in sockets} == {(46 << 2, 6)}
    with pytest.raises(ncclhook.NcclHookError, match="net_harness"):
        ncclhook.loopback_transfer(7, build_dir=tmp_path)
