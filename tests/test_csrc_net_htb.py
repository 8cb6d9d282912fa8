"""The net plugin's traffic classes enforced by HTB between two network namespaces (root).

Two plugin connections from namespace a to b, NCCL traffic class 6 (DSCP CS6 -> HTB prio 1) and
class 1 (DSCP CS1 -> HTB prio 6), start together on one 20 Mbit/s HTB-shaped veth egress and move
the same bytes. When the class-6 transfer is done, the class-1 one must have sent only a small part
of its data (it lives on its 1 Mbit/s floor plus gaps); afterwards it completes intact."""

from __future__ import annotations

import subprocess
import time

import pytest

from flowsched import ncclhook

pytestmark = pytest.mark.emulation
SIZES, ITERS = "1048576", 4  # 4 MiB per connection


def test_high_class_connection_wins_the_shaped_link(tmp_path):
    build_dir = ncclhook.build()
    harness, lib = str(build_dir / "net_harness"), str(build_dir / ncclhook.PLUGIN_LIB)
    common = ["--sizes", SIZES, "--iters", str(ITERS), "--window", "1", "--split"]
    procs: dict[str, subprocess.Popen] = {}
    with ncclhook.NetnsPair("nwnh", subnet=76) as pair:
        try:
            ncclhook.run_commands(ncclhook.htb_commands(pair.dev_a, 20), netns=pair.ns_a)  # CS k -> prio 7-k
            for tc in (6, 1):
                hf = str(tmp_path / f"handle{tc}")
                procs[f"recv{tc}"] = subprocess.Popen(
                    ["env", f"NETWEAVE_SOCKET_IFNAME={pair.dev_b}", *pair.cmd("b", [harness, lib, "--tc", str(tc), *common, "recv",
                                                                                     "--handle-file", hf])],
                    stdout=subprocess.PIPE, text=True)
            for tc in (6, 1):
                handle_deadline = time.monotonic() + 30
                while not (tmp_path / f"handle{tc}").exists() and time.monotonic() < handle_deadline:
                    time.sleep(0.02)
            for tc in (6, 1):
                procs[f"send{tc}"] = subprocess.Popen(
                    ["env", f"NETWEAVE_SOCKET_IFNAME={pair.dev_a}", *pair.cmd("a", [harness, lib, "--tc", str(tc), *common, "send",
                                                                                     "--handle-file", str(tmp_path / f"handle{tc}")])],
                    stdout=subprocess.PIPE, text=True)
            deadline = time.monotonic() + 120
            while procs["recv6"].poll() is None and time.monotonic() < deadline:  # all of class 6 arrived
                time.sleep(0.05)
            high_done_counts = ncclhook.htb_class_bytes(pair.dev_a, netns=pair.ns_a)
            outs = {name: p.communicate(timeout=120)[0] for name, p in procs.items()}
            final_counts = ncclhook.htb_class_bytes(pair.dev_a, netns=pair.ns_a)
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()
    total = int(SIZES) * ITERS
    for tc in (6, 1):
        assert f"OK receiver bytes={total}" in outs[f"recv{tc}"], outs
        assert f"tos={(8 * tc) << 2} prio={tc}" in outs[f"send{tc}"]
    high, low = high_done_counts.get("1:11", 0), high_done_counts.get("1:16", 0)
    assert high >= total, high_done_counts  # all of class 6's payload (plus headers) went through its leaf
    assert low < 0.35 * high, high_done_counts  # meanwhile class 1 got little of the link
    assert final_counts.get("1:16", 0) >= total  # and it finished afterwards
