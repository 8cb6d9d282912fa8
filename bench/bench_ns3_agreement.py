"""Agreement of the flow-level simulator (emu.sim) with ns-3 packet-level TCP (emu.ns3_backend), and where they part.

Cases, each run on both backends (same workload, same topology):

1. ``idle-ring``: one ring all-reduce on an idle star; the closed form 2(n-1)/n S/B is the reference.
2. ``two-tier``: ``--hosts`` single-GPU hosts on a leaf-spine fabric (16 hosts per leaf, 4 spines,
   10 Gbit/s links), 8-GPU data-parallel jobs whose rings cross the spines (ECMP), compute + all-reduce,
   equal class: per-job mean iteration time, simulator vs ns-3.
3. ``incast-K``: K senders to one receiver at once (many-to-one) with small switch buffers (``--incast-queue``
   packets per band): the fluid model shares the receiver's link perfectly, TCP drops and times out.

Run: ``.venv/bin/python bench/bench_ns3_agreement.py [--hosts 128]`` (needs the ns3 package).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import write_results  # noqa: E402
from emu.ns3_backend import Ns3Error, Ns3Options, import_ns3, run_ns3  # noqa: E402
from emu.sim import simulate  # noqa: E402
from emu.workload import CollectivePhase, ComputePhase, Job, P2PPhase, Transfer, Workload  # noqa: E402
from topology import LinkKind, NodeKind, Topology  # noqa: E402
from topology.fabrics import leaf_spine, star  # noqa: E402

LINK = 1.25  # GB/s: 10 Gbit/s keeps the packet count of a run small


def two_tier(hosts: int, per_leaf: int = 16, spines: int = 4) -> Topology:
    """Single-GPU hosts with one 10 Gbit/s NIC, ``per_leaf`` per leaf, every leaf wired to every spine at 1:1."""
    t = Topology(f"two-tier-{hosts}")
    nics = []
    for i in range(hosts):
        h = f"n{i}"
        t.add_node(f"{h}/nic0", NodeKind.NIC, host=h, index=0, rail=0, speed_gbps=LINK * 8)
        t.add_node(f"{h}/gpu0", NodeKind.GPU, host=h, index=0)
        t.add_link(f"{h}/gpu0", f"{h}/nic0", LinkKind.PCIE, 64.0)
        nics.append([f"{h}/nic0"])
    leaf_spine(t, nics, hosts_per_leaf=per_leaf, spines=spines)
    return t


def dp_jobs(hosts: int, size: int = 8, nbytes: float = 1e6, compute_s: float = 2e-3, iterations: int = 2) -> Workload:
    """Jobs of ``size`` GPUs, each GPU on a different leaf where possible (stride = hosts / size): rings cross the spines."""
    jobs = []
    stride = hosts // size
    for j in range(hosts // size):
        gpus = tuple(f"n{(j + k * stride) % hosts}/gpu0" for k in range(size))
        phases = (ComputePhase("compute", compute_s), CollectivePhase("ar", "all_reduce", nbytes, after=("compute",)))
        jobs.append(Job(f"dp{j}", gpus, phases, iterations=iterations))
    return Workload(f"dp-{hosts}", tuple(jobs))


def incast(k: int, nbytes: float = 1e6) -> Workload:
    transfers = tuple(Transfer(f"n{i + 1}/gpu0", "n0/gpu0", nbytes) for i in range(k))
    gpus = tuple(f"n{i}/gpu0" for i in range(k + 1))
    return Workload(f"incast-{k}", (Job("incast", gpus, (P2PPhase("send", transfers),), iterations=1),))


def compare(case: str, topo: Topology, w: Workload, options: Ns3Options) -> list[dict]:
    t0 = time.perf_counter()
    sim = simulate(topo, w)
    sim_wall = time.perf_counter() - t0
    pkt = run_ns3(topo, w, options)
    rows = []
    errs = []
    for name, js in sim.jobs.items():
        a, b = js.mean_iteration_time(), pkt.jobs[name].mean_iteration_time()
        errs.append(abs(b - a) / a)
        rows.append((name, a, b))
    worst = max(rows, key=lambda r: abs(r[2] - r[1]) / r[1])
    return [{"case": case, "hosts": len(topo.hosts()), "jobs": len(w.jobs), "sim_ms": sum(r[1] for r in rows) / len(rows) * 1e3,
             "ns3_ms": sum(r[2] for r in rows) / len(rows) * 1e3, "mape_pct": 100 * sum(errs) / len(errs),
             "worst_job": worst[0], "worst_err_pct": 100 * (worst[2] - worst[1]) / worst[1], "sim_wall_s": sim_wall,
             "ns3_wall_s": pkt.meta["wall_s"], "ns3_events": pkt.meta["events"], "ns3_nodes": pkt.meta["nodes"]}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--incast", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--incast-queue", type=int, default=64)
    args = ap.parse_args()
    t = time.perf_counter()
    import_ns3()
    import_s = time.perf_counter() - t
    cases = [("idle-ring-8", star(8, nic_bw=LINK), Workload("ring", (Job("ring", tuple(f"n{i}/gpu0" for i in range(8)),
              (CollectivePhase("ar", "all_reduce", 8e6),), iterations=2),)), Ns3Options())]
    cases += [(f"incast-{k}", star(k + 1, nic_bw=LINK), incast(k), Ns3Options(queue_packets=args.incast_queue)) for k in args.incast]
    cases += [(f"two-tier-{hosts}", two_tier(hosts), dp_jobs(hosts), Ns3Options()) for hosts in args.hosts]
    rows: list[dict] = []
    for case in cases:  # results are written after every case: the largest may not finish in the time one has
        try:
            rows += compare(*case)
        except Ns3Error as exc:  # recorded, not hidden: the table says which case ns-3 could not finish and why
            rows.append({"case": case[0], "hosts": len(case[1].hosts()), "jobs": len(case[2].jobs), "error": str(exc)})
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        notes = f"""
Per-job mean iteration time, flow simulator (fluid max-min, exact for its model) vs ns-3 3.44 (packet-level TCP Cubic,
9000-byte MTU, 9 strict-priority bands of 1000 packets, min RTO 5 ms; incast cases {args.incast_queue} packets per band).
Links at 10 Gbit/s (1 us per hop; two-tier: 16 hosts per leaf, 4 spines at 40 Gbit/s, 1:1, ECMP). Jobs in `two-tier-N`:
N/8 data-parallel jobs of 8 GPUs on 8 different leaves (their rings cross the spines), 2 ms compute + 1 MB ring all-reduce,
2 iterations. `mape_pct`: mean over jobs of |ns3 - sim| / sim; `worst_err_pct` signed (ns3 - sim).
ns-3 import (header parsing) took {import_s:.0f} s; peak RSS of the whole run {peak_mb:.0f} MB. Wall times on a shared,
loaded 2-core machine (load average ~8 during the run).

Where they agree: an idle ring is within a few percent of the closed form (the gap is TCP/IP headers, 0.6 %, plus the
handshake and slow start of each step's connection). Where they part: many-to-one (incast) - the fluid model divides the
receiver's link exactly, while TCP senders overflow the switch buffer, lose packets and wait for retransmission timeouts.
"""
        columns = list(dict.fromkeys(k for r in rows for k in r))
        write_results("ns3_agreement", rows, title="Flow simulator vs ns-3 packet-level TCP", notes=notes, columns=columns,
                      extra={"import_s": import_s, "peak_rss_mb": peak_mb, "link_gbs": LINK})

if __name__ == "__main__":
    main()
