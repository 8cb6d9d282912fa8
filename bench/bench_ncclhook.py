"""Benchmark of the NCCL hook (csrc/): net-plugin throughput over loopback, profiler-ring rates, and the
LD_PRELOAD marker's effect on a gloo all-reduce competing with bulk traffic on an HTB-shaped link.

Run: ``.venv/bin/python bench/bench_ncclhook.py [--quick]`` (the contention rows need root, iperf3 and torch).
Ratios are against baselines measured in the same run: a plain blocking TCP socket (one stream, no framing)
for the plugin, and the unmarked run of the same gloo job for the marker.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import write_results  # noqa: E402
from flowsched import ncclhook  # noqa: E402


def socket_baseline(size: int, count: int) -> float:
    """MB/s of ``count`` messages of ``size`` bytes through one blocking loopback TCP socket (forked sender)."""
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    port = ls.getsockname()[1]
    pid = os.fork()
    if pid == 0:
        c = socket.create_connection(("127.0.0.1", port))
        buf = bytearray(size)
        for _ in range(count):
            c.sendall(buf)
        c.close()
        os._exit(0)
    s, _ = ls.accept()
    buf = bytearray(size)
    mv = memoryview(buf)
    t0 = time.perf_counter()
    for _ in range(count):
        got = 0
        while got < size:
            got += s.recv_into(mv[got:], size - got)
    elapsed = time.perf_counter() - t0
    os.waitpid(pid, 0)
    s.close()
    ls.close()
    return size * count / elapsed / 1e6


def plugin_throughput(build_dir: Path, size: int, iters: int, window: int, nsocks: int, plan: Path | None = None, tc: int = -1) -> float:
    env = {**os.environ, "NETWEAVE_SOCKET_IFNAME": "lo", "NETWEAVE_NSOCKS": str(nsocks)}
    if plan is not None:
        env["NETWEAVE_PLAN"] = str(plan)
    res = subprocess.run([str(build_dir / "net_harness"), str(build_dir / ncclhook.PLUGIN_LIB), "--nocheck", "--sizes", str(size),
                          "--iters", str(iters), "--window", str(window), "--tc", str(tc)], capture_output=True, text=True, env=env,
                         timeout=300)
    if res.returncode != 0:
        raise RuntimeError(res.stdout + res.stderr)
    seconds = float(re.search(r"TIME ([\d.]+)", res.stdout).group(1))
    return size * iters * window / seconds / 1e6


def ring_rates(build_dir: Path, ncolls: int) -> dict[str, float]:
    """Unpaced writer (30 records per collective) with the Python reader draining concurrently."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "ring"
        env = {**os.environ, "NETWEAVE_PROF_RING": str(path)}
        proc = subprocess.Popen([str(build_dir / "ring_harness"), str(build_dir / ncclhook.PLUGIN_LIB), str(ncolls), "2", "4", "0"],
                                env=env, stdout=subprocess.PIPE, text=True)
        got, read_time = 0, 0.0
        with ncclhook.ProfilerRing(path, wait_s=10) as ring:
            while proc.poll() is None or ring.pending:
                t0 = time.perf_counter()
                n = len(ring.read())
                read_time += time.perf_counter() - t0
                got += n
                if n == 0:
                    time.sleep(0.001)
            dropped = ring.dropped
        out = proc.communicate()[0]
    m = re.search(r"EMITTED (\d+) in ([\d.]+) s", out)
    emitted, seconds = int(m.group(1)), float(m.group(2))
    return {"emitted": emitted, "read": got, "dropped": dropped, "writer_events_per_s": emitted / seconds,
            "reader_events_per_s": got / read_time if read_time > 0 else float("inf")}


def contention_rows(iters: int) -> list[dict]:
    rows = []
    results = {}
    for marked in (False, True):
        with tempfile.TemporaryDirectory() as d:
            rep = ncclhook.gloo_contention(Path(d), marked=marked, prefix="nwbench", subnet=79, iters=iters, capture=False)
        cb = rep["class_bytes"]
        share = cb.get("1:11", 0) / max(1, cb.get("1:11", 0) + cb.get("1:27", 0)) if marked else None
        results[marked] = rep["elapsed_s"]
        rows.append({"case": "gloo all-reduce vs iperf3, 20 Mbit/s HTB", "variant": "marked DSCP 46" if marked else "unmarked",
                     "value": rep["elapsed_s"], "unit": "s", "baseline": None, "ratio": None,
                     "note": f"marked-class share of link bytes {share:.2f}" if share is not None else "same class as the bulk flow"})
    rows[-1]["baseline"] = results[False]
    rows[-1]["ratio"] = results[False] / results[True]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller transfers, 1 repetition")
    args = ap.parse_args()
    build_dir = ncclhook.build()
    reps = 1 if args.quick else 3
    rows = []
    for label, size, iters, window in (("64 MiB messages", 64 << 20, 2 if args.quick else 4, 2),
                                       ("4 KiB messages", 4096, 200 if args.quick else 1000, 32)):
        count = iters * window
        base = statistics.median(socket_baseline(size, count) for _ in range(reps))
        for nsocks in (1, 2, 4):
            val = statistics.median(plugin_throughput(build_dir, size, iters, window, nsocks) for _ in range(reps))
            rows.append({"case": f"net plugin loopback, {label}", "variant": f"nsocks={nsocks}", "value": val, "unit": "MB/s",
                         "baseline": base, "ratio": val / base, "note": "baseline: one blocking Python socket"})
    with tempfile.TemporaryDirectory() as d:
        for rate in (2_000_000, 8_000_000):  # bytes/s per connection, SO_MAX_PACING_RATE split over 2 data sockets
            plan = ncclhook.write_plan(ncclhook.FlowPlan(classes={1: ncclhook.ClassMark(rate=rate)}), Path(d) / "pace.plan")
            val = plugin_throughput(build_dir, 1 << 20, 2 if args.quick else 4, 2, 2, plan=plan, tc=1) * 1e6
            rows.append({"case": "pacing from the plan (class rate)", "variant": f"rate={rate / 1e6:g} MB/s", "value": val / 1e6, "unit": "MB/s",
                         "baseline": rate / 1e6, "ratio": val / rate, "note": "ratio = measured / configured rate"})
    r = ring_rates(build_dir, 5000 if args.quick else 20000)
    rows.append({"case": "profiler ring (65536 records)", "variant": "writer, unpaced", "value": r["writer_events_per_s"], "unit": "events/s",
                 "baseline": None, "ratio": None, "note": f"{r['emitted']} records, dropped {r['dropped']}, read {r['read']}"})
    rows.append({"case": "profiler ring (65536 records)", "variant": "Python reader drain", "value": r["reader_events_per_s"],
                 "unit": "events/s", "baseline": r["writer_events_per_s"], "ratio": r["reader_events_per_s"] / r["writer_events_per_s"],
                 "note": "ratio > 1: the reader outpaces the writer"})
    skipped = ""
    if os.geteuid() == 0 and shutil.which("iperf3"):
        rows += contention_rows(2 if args.quick else 3)
    else:
        skipped = "The gloo/HTB contention rows need root and iperf3 and were skipped."
    notes = f"""
Machine: 2 shared cores under load from other jobs; loopback numbers are CPU-bound. The plugin polls
non-blocking sockets from test() (NCCL's proxy model), which costs CPU the blocking baseline does not spend.
Contention: two network namespaces on one veth pair, HTB 20 Mbit/s on both egresses (DSCP 46 -> prio 1,
rest -> prio 7, 1 Mbit/s floors), iperf3 bulk unmarked; ratio = unmarked / marked all-reduce time. {skipped}
GPU (real NCCL) runs: not measured here (no GPU in this session); run csrc/tests/gpu_nccl_check.py on a GPU machine.
"""
    write_results("ncclhook", rows, title="NCCL hook: net plugin, profiler ring, DSCP marking under HTB",
                  columns=["case", "variant", "value", "unit", "baseline", "ratio", "note"], notes=notes)


if __name__ == "__main__":
    main()
