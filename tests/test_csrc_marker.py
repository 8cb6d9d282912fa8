"""libnetweave-mark.so (LD_PRELOAD) on a real gloo all-reduce between two network namespaces.

Two namespaces joined by one veth pair; an HTB priority tree on both egresses (20 Mbit/s,
DSCP 46 -> HTB prio 1, everything else -> prio 7); an unmarked iperf3 bulk flow competes on
the same link. The gloo ranks run with the marker (NETWEAVE_DSCP=46): a scapy capture shows
every gloo packet (data, store, handshakes) carrying DSCP 46 and iperf's carrying 0, and the
HTB counters show the marked job took the link while both were sending."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flowsched import ncclhook

HERE = Path(__file__).resolve().parent.parent / "csrc" / "tests"
PY = sys.executable
pytestmark = pytest.mark.emulation


def wait_for(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.05)


def run_gloo_contention(tmp_path: Path, *, marked: bool, prefix: str, subnet: int, numel: int = 500_000, iters: int = 3,
                        rate_mbit: int = 20, capture: bool = True) -> dict:
    """Run the scenario; returns rank 0's report plus the capture and marker log."""
    build_dir = ncclhook.build()
    procs: list[subprocess.Popen] = []
    stop = tmp_path / "stop"
    with ncclhook.NetnsPair(prefix, subnet=subnet) as pair:
        try:
            for ns, dev in ((pair.ns_a, pair.dev_a), (pair.ns_b, pair.dev_b)):
                ncclhook.run_commands(ncclhook.htb_commands(dev, rate_mbit, {46: 1}), netns=ns)
            if capture:
                procs.append(subprocess.Popen(pair.cmd("a", [PY, str(HERE / "capture_tos.py"), pair.dev_a, str(tmp_path / "cap.json"),
                                                              str(tmp_path / "ready"), str(stop)])))
                wait_for(tmp_path / "ready", 60)
            procs.append(subprocess.Popen(pair.cmd("b", ["iperf3", "-s", "-1", "-p", "5301"]), stdout=subprocess.DEVNULL))
            time.sleep(0.3)
            procs.append(subprocess.Popen(pair.cmd("a", ["iperf3", "-c", pair.addr_b, "-p", "5301", "-t", "300"]),
                                          stdout=subprocess.DEVNULL))
            env = dict(os.environ)
            if marked:
                env.update(ncclhook.marker_env(dscp=46, priority=1, log=str(tmp_path / "mark.log"), build_dir=build_dir))
            ranks = [subprocess.Popen(pair.cmd(side, [PY, str(HERE / "gloo_allreduce.py"), str(rank), pair.addr_a, "29511", dev, str(numel),
                                                      str(iters), str(tmp_path / f"rank{rank}.json")] + ([dev] if rank == 0 else [])), env=env)
                     for rank, side, dev in ((0, "a", pair.dev_a), (1, "b", pair.dev_b))]
            procs += ranks
            for r in ranks:
                assert r.wait(timeout=240) == 0
        finally:
            stop.touch()
            if capture:  # the capture writes its file once it sees the stop file
                with contextlib.suppress(subprocess.TimeoutExpired):
                    procs[0].wait(timeout=30)
            for p in reversed(procs):  # only the processes started here, by their own handles
                if p.poll() is None:
                    p.terminate()
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    report = json.loads((tmp_path / "rank0.json").read_text())
    report["capture"] = json.loads((tmp_path / "cap.json").read_text()) if capture else {}
    report["mark_log"] = (tmp_path / "mark.log").read_text().splitlines() if (tmp_path / "mark.log").exists() else []
    return report


def test_marked_gloo_allreduce_carries_dscp_and_wins_the_htb_link(tmp_path):
    rep = run_gloo_contention(tmp_path, marked=True, prefix="nwmk", subnet=77)
    assert rep["correct"]
    # the marker marked sockets in both ranks (connect and accept sides)
    log = rep["mark_log"]
    assert {line.split()[0] for line in log} and all("dscp=46" in line and "rc=0" in line for line in log)
    assert {"how=connect", "how=accept"} <= {w for line in log for w in line.split() if w.startswith("how=")}
    # on the wire: every non-iperf TCP packet carries DSCP 46, iperf's carry 0
    gloo_tos, iperf_tos, gloo_bytes = set(), set(), 0
    for key, (_npkts, nbytes) in rep["capture"].items():
        tos, sport, dport = (int(x) for x in key.split())
        if 5301 in (sport, dport):
            iperf_tos.add(tos)
        else:
            gloo_tos.add(tos)
            gloo_bytes += nbytes
    unmarked = {k: v for k, v in rep["capture"].items() if int(k.split()[0]) != 46 << 2 and "5301" not in k.split()[1:]}
    assert gloo_tos == {46 << 2} and iperf_tos == {0}, unmarked
    assert gloo_bytes >= rep["numel"] * 4 * rep["iters"] // 2  # at least half of the reduced data left through this port
    # while the all-reduces ran, the marked class took most of the link from the unmarked bulk flow
    cb = rep["class_bytes"]
    marked, bulk = cb.get("1:11", 0), cb.get("1:27", 0)
    assert marked > 0 and marked / (marked + bulk) >= 0.75, cb
