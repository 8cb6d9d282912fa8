"""Benchmark of topology building, all-pairs GPU bandwidth, bisection, routing and collective costs.

1. Build an 8192-GPU rail-optimized cluster (1024 DGX H100, 32 scalable units);
   target under 5 s.
2. All-pairs GPU bandwidth matrix and classes for 1024 GPUs (128 DGX); target
   under 10 s. Baseline: the naive way, one :func:`topology.paths.gpu_path`
   search per ordered pair, measured in this process on 64 GPUs (8 DGX), next
   to the vectorised matrix on the same 64 GPUs; the naive time for 1024 GPUs
   is extrapolated from it (pairs grow as n^2), since running it would take
   minutes.
3. Bisection bandwidth (max-flow) of the 1024- and 8192-GPU clusters.
4. Matrix and ring cost on two GB200 NVL72 racks (big multi-host NVLink islands).
5. Routing and collective cost: a 1024-GPU ring all-reduce priced with
   ``collective_time`` (cold caches), then again through ``alpha_beta`` (warm);
   an all-to-all among 64 GPUs (4032 flows) routed cold and warm.

Every timed call starts from cleared caches unless the row says "warm".
Run: ``.venv/bin/python bench/bench_topology.py [--quick]`` (``--quick``: 2048
GPUs instead of 8192 for the build, 256 instead of 1024 for the matrix).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import write_results  # noqa: E402
from topology import build_cluster  # noqa: E402
from topology.collectives import alpha_beta, collective_flows, collective_time  # noqa: E402
from topology.paths import bandwidth_classes, bandwidth_matrix, bisection_bandwidth, clear_cache, gpu_path  # noqa: E402
from topology.routing import route_flows  # noqa: E402


def timed(fn, repeat: int = 3):
    """Median wall and CPU (process) time of ``repeat`` calls, and the last result.

    The machine is shared (its load average is recorded with the results), so
    CPU time is reported next to wall time: it is what the code costs.
    """
    walls, cpus, result = [], [], None
    for _ in range(repeat):
        w0, c0 = time.perf_counter(), time.process_time()
        result = fn()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus), result


def cold(topo, fn):
    def call():
        clear_cache(topo)
        return fn()

    return call


def naive_matrix(topo, gpus):
    return [[gpu_path(topo, a, b).bw for b in gpus] for a in gpus]


def run(quick: bool) -> None:
    rows: list[dict] = []

    def row(what: str, wall: float, cpu: float, target: float | str = "", ratio: float | str = "") -> None:
        rows.append({"what": what, "seconds": wall, "cpu_s": cpu, "target_s": target, "ratio": ratio})

    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    big_nodes = 256 if quick else 1024
    mid_nodes = 32 if quick else 128

    build_s, build_cpu, big = timed(lambda: build_cluster(big_nodes), repeat=1 if not quick else 2)
    row(f"build rail-optimized cluster, {big_nodes * 8} GPUs", build_s, build_cpu, 5.0)

    mid = build_cluster(mid_nodes)
    n_mid = mid_nodes * 8
    matrix_s, matrix_cpu, m = timed(cold(mid, lambda: bandwidth_matrix(mid)), repeat=3)
    classes_s, classes_cpu, classes = timed(cold(mid, lambda: bandwidth_classes(mid)), repeat=3)

    small = build_cluster(8)
    gpus64 = small.gpus()
    naive_s, naive_cpu, naive = timed(cold(small, lambda: naive_matrix(small, gpus64)), repeat=1)
    vec64_s, vec64_cpu, m64 = timed(cold(small, lambda: bandwidth_matrix(small)), repeat=3)
    assert (m64.bw == naive).all(), "vectorised matrix differs from the per-pair paths"
    scale = (n_mid / 64) ** 2
    row("naive per-pair gpu_path matrix, 64 GPUs (baseline)", naive_s, naive_cpu, ratio=1.0)
    row("vectorised bandwidth_matrix, 64 GPUs", vec64_s, vec64_cpu, ratio=naive_cpu / vec64_cpu)
    row(f"naive matrix, {n_mid} GPUs (extrapolated x{scale:.0f})", naive_s * scale, naive_cpu * scale, ratio=1.0)
    row(f"vectorised bandwidth_matrix, {n_mid} GPUs", matrix_s, matrix_cpu, 10.0, naive_cpu * scale / matrix_cpu)
    row(f"bandwidth_classes, {n_mid} GPUs", classes_s, classes_cpu, 10.0, naive_cpu * scale / classes_cpu)

    racks = build_cluster(36, node="gb200-nvl72", fabric="leaf-spine")
    nvl_s, nvl_cpu, _ = timed(cold(racks, lambda: bandwidth_matrix(racks)), repeat=3)
    row("vectorised bandwidth_matrix, 144 GPUs in 2 GB200 NVL72 racks (72-GPU NVLink islands)", nvl_s, nvl_cpu)
    nvl_ring_s, nvl_ring_cpu, nvl_ring = timed(cold(racks, lambda: collective_time(racks, "all_reduce", racks.gpus(), 2**30)), repeat=1)
    row(f"collective_time ring all-reduce, 144 GB200 GPUs (busbw {nvl_ring.busbw_beta:.1f} GB/s)", nvl_ring_s, nvl_ring_cpu)

    bis_mid_s, bis_mid_cpu, bis_mid = timed(cold(mid, lambda: bisection_bandwidth(mid)), repeat=1)
    row(f"bisection_bandwidth, {n_mid} GPUs ({bis_mid['bw']:.0f} GB/s)", bis_mid_s, bis_mid_cpu)
    bis_big_s, bis_big_cpu, bis_big = timed(cold(big, lambda: bisection_bandwidth(big)), repeat=1)
    row(f"bisection_bandwidth, {big_nodes * 8} GPUs ({bis_big['bw']:.0f} GB/s)", bis_big_s, bis_big_cpu)

    gpus = mid.gpus()
    ring_s, ring_cpu, ring = timed(cold(mid, lambda: collective_time(mid, "all_reduce", gpus, 2**30)), repeat=1)
    row(f"collective_time ring all-reduce, {n_mid} GPUs (busbw {ring.busbw_beta:.1f} GB/s)", ring_s, ring_cpu, ratio=1.0)
    alpha_beta(mid, "all_reduce", gpus)
    warm_s, warm_cpu, _ = timed(lambda: alpha_beta(mid, "all_reduce", gpus).time(2**30), repeat=5)
    row(f"alpha_beta(...).time ring all-reduce, {n_mid} GPUs (warm)", warm_s, warm_cpu, ratio=ring_cpu / warm_cpu)

    a2a = [f for step in collective_flows(small, "all_to_all", gpus64, 2**30) for f in step]
    a2a_cold_s, a2a_cold_cpu, _ = timed(cold(small, lambda: route_flows(small, a2a, "ecmp")), repeat=3)
    route_flows(small, a2a, "ecmp")
    a2a_warm_s, a2a_warm_cpu, _ = timed(lambda: route_flows(small, a2a, "ecmp"), repeat=3)
    row(f"route_flows ecmp, all-to-all of 64 GPUs ({len(a2a)} flows), cold", a2a_cold_s, a2a_cold_cpu, ratio=1.0)
    row("route_flows, same flows, warm route cache", a2a_warm_s, a2a_warm_cpu, ratio=a2a_cold_cpu / a2a_warm_cpu)

    notes = f"""
Timings are medians (build, bisection and the naive baseline: one run): "seconds" is wall time, "cpu_s" the CPU time
of this process (the 2-core machine is shared; load average at the start {load}). "ratio" is the CPU-time speed-up over
the row marked 1.0 above it, measured in the same process. The naive matrix runs one three-pass path search per
ordered GPU pair; the vectorised matrix searches each distinct host structure once and computes all inter-host entries with boolean matrix
products over the few distinct bandwidths, and gives identical numbers (checked on 64 GPUs in this run).
Classes of the {n_mid}-GPU cluster: {classes}.
Bisection cut chosen: {bis_big['cut']}.
"""
    write_results("topology", rows, title="Topology: build, all-pairs bandwidth, bisection, routing, collectives", notes=notes,
                  columns=["what", "seconds", "cpu_s", "target_s", "ratio"],
                  extra={"quick": quick, "load_average": load, "build_gpus": big_nodes * 8, "matrix_gpus": n_mid, "classes": classes,
                         "bisection_gbs": {str(n_mid): bis_mid["bw"], str(big_nodes * 8): bis_big["bw"]},
                         "ring_busbw_gbs": ring.busbw_beta})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes (smoke run)")
    t0 = time.perf_counter()
    run(parser.parse_args().quick)
    print(f"total {time.perf_counter() - t0:.1f} s")
