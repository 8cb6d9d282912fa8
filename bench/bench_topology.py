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
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import timed, write_results  # noqa: E402
from topology import build_cluster  # noqa: E402
from topology.collectives import alpha_beta, collective_flows, collective_time  # noqa: E402
from topology.paths import bandwidth_classes, bandwidth_matrix, bisection_bandwidth, clear_cache, gpu_path  # noqa: E402
from topology.routing import route_flows  # noqa: E402


def cold(topo, fn):
    def call():
        clear_cache(topo)
        return fn()

    return call


def naive_matrix(topo, gpus):
    return [[gpu_path(topo, a, b).bw for b in gpus] for a in gpus]


def run(quick: bool) -> None:
    rows = []
    big_nodes = 256 if quick else 1024
    mid_nodes = 32 if quick else 128

    build_s, big = timed(lambda: build_cluster(big_nodes), repeat=1 if not quick else 2)
    rows.append({"what": f"build rail-optimized cluster, {big_nodes * 8} GPUs", "seconds": build_s, "target_s": 5.0, "ratio": ""})

    mid = build_cluster(mid_nodes)
    n_mid = mid_nodes * 8
    matrix_s, m = timed(cold(mid, lambda: bandwidth_matrix(mid)), repeat=3)
    classes_s, classes = timed(cold(mid, lambda: bandwidth_classes(mid)), repeat=3)

    small = build_cluster(8)
    gpus64 = small.gpus()
    naive_s, naive = timed(cold(small, lambda: naive_matrix(small, gpus64)), repeat=1)
    vec64_s, m64 = timed(cold(small, lambda: bandwidth_matrix(small)), repeat=3)
    assert (m64.bw == naive).all(), "vectorised matrix differs from the per-pair paths"
    extrapolated = naive_s * (n_mid / 64) ** 2
    rows.append({"what": "naive per-pair gpu_path matrix, 64 GPUs (baseline)", "seconds": naive_s, "target_s": "", "ratio": 1.0})
    rows.append({"what": "vectorised bandwidth_matrix, 64 GPUs", "seconds": vec64_s, "target_s": "", "ratio": naive_s / vec64_s})
    rows.append({"what": f"naive matrix, {n_mid} GPUs (extrapolated x{(n_mid // 64) ** 2})", "seconds": extrapolated, "target_s": "", "ratio": 1.0})
    rows.append({"what": f"vectorised bandwidth_matrix, {n_mid} GPUs", "seconds": matrix_s, "target_s": 10.0, "ratio": extrapolated / matrix_s})
    rows.append({"what": f"bandwidth_classes, {n_mid} GPUs", "seconds": classes_s, "target_s": 10.0, "ratio": extrapolated / classes_s})

    racks = build_cluster(36, node="gb200-nvl72", fabric="leaf-spine")
    nvl_s, _ = timed(cold(racks, lambda: bandwidth_matrix(racks)), repeat=3)
    rows.append({"what": "vectorised bandwidth_matrix, 144 GPUs in 2 GB200 NVL72 racks (72-GPU NVLink islands)", "seconds": nvl_s,
                 "target_s": "", "ratio": ""})
    nvl_ring_s, nvl_ring = timed(cold(racks, lambda: collective_time(racks, "all_reduce", racks.gpus(), 2**30)), repeat=1)
    rows.append({"what": f"collective_time ring all-reduce, 144 GB200 GPUs (busbw {nvl_ring.busbw_beta:.1f} GB/s)", "seconds": nvl_ring_s,
                 "target_s": "", "ratio": ""})

    bis_mid_s, bis_mid = timed(cold(mid, lambda: bisection_bandwidth(mid)), repeat=1)
    rows.append({"what": f"bisection_bandwidth, {n_mid} GPUs ({bis_mid['bw']:.0f} GB/s)", "seconds": bis_mid_s, "target_s": "", "ratio": ""})
    bis_big_s, bis_big = timed(cold(big, lambda: bisection_bandwidth(big)), repeat=1)
    rows.append({"what": f"bisection_bandwidth, {big_nodes * 8} GPUs ({bis_big['bw']:.0f} GB/s)", "seconds": bis_big_s, "target_s": "", "ratio": ""})

    gpus = mid.gpus()
    ring_s, ring = timed(cold(mid, lambda: collective_time(mid, "all_reduce", gpus, 2**30)), repeat=1)
    rows.append({"what": f"collective_time ring all-reduce, {n_mid} GPUs (busbw {ring.busbw_beta:.1f} GB/s)", "seconds": ring_s,
                 "target_s": "", "ratio": 1.0})
    alpha_beta(mid, "all_reduce", gpus)
    warm_s, _ = timed(lambda: alpha_beta(mid, "all_reduce", gpus).time(2**30), repeat=5)
    rows.append({"what": f"alpha_beta(...).time ring all-reduce, {n_mid} GPUs (warm)", "seconds": warm_s, "target_s": "",
                 "ratio": ring_s / warm_s})

    a2a = [f for step in collective_flows(small, "all_to_all", gpus64, 2**30) for f in step]
    a2a_cold_s, _ = timed(cold(small, lambda: route_flows(small, a2a, "ecmp")), repeat=3)
    route_flows(small, a2a, "ecmp")
    a2a_warm_s, _ = timed(lambda: route_flows(small, a2a, "ecmp"), repeat=3)
    rows.append({"what": f"route_flows ecmp, all-to-all of 64 GPUs ({len(a2a)} flows), cold", "seconds": a2a_cold_s, "target_s": "", "ratio": 1.0})
    rows.append({"what": "route_flows, same flows, warm route cache", "seconds": a2a_warm_s, "target_s": "", "ratio": a2a_cold_s / a2a_warm_s})

    notes = f"""
Timings are medians (build, bisection and the naive baseline: one run). "ratio" is the speed-up over the row marked 1.0
above it, measured in the same process. The naive matrix runs one three-pass path search per ordered GPU pair; the
vectorised matrix searches each distinct host structure once and computes all inter-host entries with boolean matrix
products over the few distinct bandwidths, and gives identical numbers (checked on 64 GPUs in this run).
Classes of the {n_mid}-GPU cluster: {classes}.
Bisection cut chosen: {bis_big['cut']}.
"""
    write_results("topology", rows, title="Topology: build, all-pairs bandwidth, bisection, routing, collectives", notes=notes,
                  columns=["what", "seconds", "target_s", "ratio"],
                  extra={"quick": quick, "build_gpus": big_nodes * 8, "matrix_gpus": n_mid, "classes": classes,
                         "bisection_gbs": {str(n_mid): bis_mid["bw"], str(big_nodes * 8): bis_big["bw"]},
                         "ring_busbw_gbs": ring.busbw_beta})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes (smoke run)")
    t0 = time.perf_counter()
    run(parser.parse_args().quick)
    print(f"total {time.perf_counter() - t0:.1f} s")
