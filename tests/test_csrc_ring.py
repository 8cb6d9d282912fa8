"""The profiler plugin's shared-memory ring, written by the library (driven through its
ncclProfiler_v6 table by csrc/tests/ring_harness.c) and read by flowsched.ncclhook.

Documented rate: with a reader that polls at least every 10 ms, a ring of C records loses
nothing while writers produce fewer than C / 10 ms events (65536 records: 6.5 M events/s).
The test holds the ratio with margin: 4096 records, 100 k events/s, polls every ~2 ms."""

from __future__ import annotations

import os
import struct
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


# ------------------------------------------------------------------ the ring's safety rules --
SAN_ENV = {"ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0", "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}


def paused_harness(build_dir, ring_path, ncolls=20, capacity=64, env_extra=None):
    """The ring harness stopped after the ring exists (it prints READY and waits for a line on stdin)."""
    env = {**os.environ, "NETWEAVE_PROF_RING": str(ring_path), "NETWEAVE_PROF_CAPACITY": str(capacity), **(env_extra or {})}
    proc = subprocess.Popen([str(build_dir / "ring_harness"), str(build_dir / ncclhook.PLUGIN_LIB), str(ncolls), "1", "1", "0", "pause"],
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "READY", proc.communicate(timeout=60)
    return proc


def poke(path, offset: int, fmt: str, value: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack(fmt, value))


@pytest.mark.parametrize("capacity_word", [0xFFFF0000, 1 << 20, 0])
def test_corrupted_capacity_disables_the_ring_under_the_sanitizer(tmp_path, capacity_word):
    """Another process rewrites the header's capacity (and the sequence numbers) while the writer runs: the writer
    keeps its own capacity, notices the changed header and refuses to write (before: ASan out-of-bounds in nw_ring_put)."""
    san = ncclhook.build(sanitize=True)
    ring = tmp_path / "ring"
    proc = paused_harness(san, ring, env_extra=SAN_ENV)
    size = ring.stat().st_size
    poke(ring, 20, "<I", capacity_word)
    for offset in (24, 32):  # write_seq, read_seq: far past the 64 slots
        poke(ring, offset, "<Q", 1 << 20)
    out, err = proc.communicate("go\n", timeout=120)
    assert proc.returncode == 0 and "EMITTED" in out, out + err
    assert "AddressSanitizer" not in err and "runtime error" not in err, err
    assert "profiler ring header changed" in err and err.count("header changed") == 1  # warned once
    assert ring.stat().st_size == size
    with open(ring, "rb") as f:
        head = f.read(40)
    assert struct.unpack_from("<QQ", head, 24) == (1 << 20, 1 << 20)  # nothing claimed after the change


def test_corrupted_sequence_numbers_stay_inside_the_ring(tmp_path):
    """Garbage write/read positions (capacity intact) only move where records go, never outside the mapped slots."""
    san = ncclhook.build(sanitize=True)
    ring = tmp_path / "ring"
    proc = paused_harness(san, ring, ncolls=3, capacity=64, env_extra=SAN_ENV)
    start = (1 << 63) + 61  # wraps the 64 slots during the run
    for offset in (24, 32):
        poke(ring, offset, "<Q", start)
    out, err = proc.communicate("go\n", timeout=120)
    assert proc.returncode == 0 and "AddressSanitizer" not in err and "runtime error" not in err, err
    with ncclhook.ProfilerRing(ring) as r:
        records = r.read()
    assert len(records) == 3 * events_per_coll(1, 1) and list(records["seq"]) == [start + 1 + i for i in range(len(records))]
    check_structure(records, 3, 1, 1)


def refused(build_dir, ring_path) -> str:
    res = subprocess.run([str(build_dir / "ring_harness"), str(build_dir / ncclhook.PLUGIN_LIB), "2", "1", "1"], capture_output=True, text=True,
                         env={**os.environ, "NETWEAVE_PROF_RING": str(ring_path), "NETWEAVE_PROF_CAPACITY": "64"}, timeout=60)
    assert res.returncode == 1 and "profiler asked for no events" in res.stdout, res.stdout + res.stderr
    return res.stderr


def test_symlink_and_foreign_files_are_never_written(build_dir, tmp_path):
    precious = tmp_path / "precious"
    precious.write_bytes(b"keep me\n" * 100)
    link = tmp_path / "ring.link"
    link.symlink_to(precious)
    assert "is a symbolic link" in refused(build_dir, link)
    dangling = tmp_path / "ring.dangling"
    dangling.symlink_to(tmp_path / "created-through-the-link")
    assert "is a symbolic link" in refused(build_dir, dangling) and not (tmp_path / "created-through-the-link").exists()
    assert "is not a netweave profiler ring" in refused(build_dir, precious)
    assert precious.read_bytes() == b"keep me\n" * 100 and link.is_symlink()
    assert "Is a directory" in refused(build_dir, tmp_path)
    os.mkfifo(tmp_path / "fifo")
    assert "is not a regular file" in refused(build_dir, tmp_path / "fifo")


def test_stale_ring_is_reused_live_or_linked_ring_refused(build_dir, tmp_path):
    ring = tmp_path / "ring"
    for _ in range(2):  # the second run finds the first one's ring: stale (no live writer), reused from scratch
        start_harness(build_dir, ring, 4, 1, 1, 0, 64).communicate(timeout=60)
        with ncclhook.ProfilerRing(ring) as r:
            assert len(r.read()) == 4 * events_per_coll(1, 1) and r.dropped == 0
    live = paused_harness(build_dir, ring)
    try:
        assert f"process {live.pid} still writes it" in refused(build_dir, ring)
    finally:
        live.communicate("go\n", timeout=60)
    os.link(ring, tmp_path / "second-name")
    assert "with 2 links" in refused(build_dir, ring)
