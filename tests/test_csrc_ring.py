"""The profiler plugin's shared-memory ring, written by the library (driven through its
ncclProfiler_v6 table by csrc/tests/ring_harness.c) and read by flowsched.ncclhook.

Documented rate: with a reader that polls at least every 10 ms, a ring of C records loses
nothing while writers produce fewer than C / 10 ms events (65536 records: 6.5 M events/s).
The test holds the ratio with margin: 4096 records, 100 k events/s, polls every ~2 ms."""

from __future__ import annotations

import os
import subprocess
import time

import numpy as np
import pytest

from flowsched import ncclhook


@pytest.fixture(scope="module")
def build_dir():
    return ncclhook.build()


def start_harness(build_dir, ring_path, ncolls, proxyops, steps, rate, capacity):
    env = {**os.environ, "NETWEAVE_PROF_RING": str(ring_path), "NETWEAVE_PROF_CAPACITY": str(capacity)}
    return subprocess.Popen([str(build_dir / "ring_harness"), str(build_dir / ncclhook.PLUGIN_LIB), str(ncolls), str(proxyops),
                             str(steps), str(rate)], env=env, stdout=subprocess.PIPE, text=True)


def events_per_coll(proxyops, steps):
    return 2 + proxyops * (2 + 3 * steps)


def check_structure(records: np.ndarray, ncolls: int, proxyops: int, steps: int) -> None:
    kinds = [ncclhook.EVENT_KINDS[int(k)] for k in records["kind"]]
    per = events_per_coll(proxyops, steps)
    assert len(records) == ncolls * per
    one = ["coll_start"] + (["proxyop_start"] + ["step_start", "step_state", "step_stop"] * steps + ["proxyop_stop"]) * proxyops + ["coll_stop"]
    for c in range(ncolls):
        block = records[c * per:(c + 1) * per]
        assert kinds[c * per:(c + 1) * per] == one
        assert (block["coll_seq"] == c).all()  # children inherit their collective's sequence number
        assert block[0]["bytes"] == (1024 + c) * 4  # count x sizeof(float32)
        assert ncclhook.FUNCS[block[0]["func"]] == "allreduce" and ncclhook.ALGORITHMS[block[0]["algo"]] == "ring"
        states = block[block["kind"] == 6]
        assert list(states["bytes"]) == [65536 - s for s in range(steps)] * proxyops  # transSize of each step
    assert (np.diff(records["t_ns"].astype(np.int64)) >= 0).all()


def test_no_loss_in_order_at_the_documented_rate(build_dir, tmp_path):
    ncolls, proxyops, steps = 2000, 2, 4
    total = ncolls * events_per_coll(proxyops, steps)  # 60000 records at 100 k/s: 0.6 s
    proc = start_harness(build_dir, tmp_path / "ring", ncolls, proxyops, steps, 100_000, 4096)
    chunks = []
    with ncclhook.ProfilerRing(tmp_path / "ring", wait_s=10) as ring:
        assert ring.capacity == 4096 and ring.pid == proc.pid
        while proc.poll() is None or ring.pending:
            chunks.append(ring.read())
            time.sleep(0.002)
        chunks.append(ring.read())
        assert ring.dropped == 0
    out = proc.communicate()[0]
    assert proc.returncode == 0 and f"EMITTED {total}" in out
    records = np.concatenate(chunks)
    check_structure(records, ncolls, proxyops, steps)


def test_full_ring_counts_overflow_and_keeps_the_oldest(build_dir, tmp_path):
    ncolls, proxyops, steps = 50, 1, 2
    total = ncolls * events_per_coll(proxyops, steps)  # 500 records into 64 slots, nobody reading
    proc = start_harness(build_dir, tmp_path / "ring", ncolls, proxyops, steps, 0, 64)
    assert f"EMITTED {total}" in proc.communicate()[0]
    with ncclhook.ProfilerRing(tmp_path / "ring") as ring:
        assert ring.dropped == total - 64
        first = ring.read()
        assert len(first) == 64 and ring.pending == 0
        # the 64 kept records are exactly the first 64 produced: 6 whole collectives (10 records each) + 4
        check_structure(first[:60], 6, proxyops, steps)
        assert [ncclhook.EVENT_KINDS[int(k)] for k in first[60:]["kind"]] == ["coll_start", "proxyop_start", "step_start", "step_state"]
        assert (first[60:]["coll_seq"] == 6).all()


def test_spans_and_dicts(build_dir, tmp_path):
    proc = start_harness(build_dir, tmp_path / "ring", 5, 1, 1, 0, 256)
    proc.communicate()
    with ncclhook.ProfilerRing(tmp_path / "ring") as ring:
        records = ring.read()
    spans = ncclhook.collective_spans(records)
    assert [s["coll_seq"] for s in spans] == [0, 1, 2, 3, 4]
    assert all(s["end_ns"] >= s["start_ns"] and s["func"] == "allreduce" for s in spans)
    d = ncclhook.events_to_dicts(records[:1])[0]
    assert d["kind"] == "coll_start" and d["proto"] == "simple" and d["comm_id"] == 0xC0FFEE


def test_reader_rejects_foreign_files(tmp_path):
    bad = tmp_path / "bad"
    bad.write_bytes(b"\0" * 4096)
    with pytest.raises(ncclhook.NcclHookError, match="not a netweave profiler ring"):
        ncclhook.ProfilerRing(bad)
    with pytest.raises(ncclhook.NcclHookError, match="no profiler ring"):
        ncclhook.ProfilerRing(tmp_path / "missing")


def test_net_plugin_reports_messages_into_the_ring(build_dir, tmp_path):
    """Each process of the net harness writes its own ring (%p); the receiver's records sum to the bytes received."""
    env = {**os.environ, "NETWEAVE_SOCKET_IFNAME": "lo", "NETWEAVE_PROF_RING": str(tmp_path / "ring.%p")}
    sizes = "0,5,70000,300001"
    res = subprocess.run([str(build_dir / "net_harness"), str(build_dir / ncclhook.PLUGIN_LIB), "--sizes", sizes, "--iters", "2",
                          "--window", "3"], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    rings = sorted(tmp_path.glob("ring.*"))
    assert len(rings) == 2
    by_kind: dict[str, list[int]] = {"net_send": [], "net_recv": []}
    for path in rings:
        with ncclhook.ProfilerRing(path) as ring:
            for r in ring.read():
                by_kind[ncclhook.EVENT_KINDS[int(r["kind"])]].append(int(r["bytes"]))
    msgs = [int(s) for s in sizes.split(",")] * 2 * 3
    assert sorted(by_kind["net_send"]) == sorted(msgs) and sorted(by_kind["net_recv"]) == sorted(msgs)
