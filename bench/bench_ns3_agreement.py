"""Agreement of the flow-level simulator (emu.sim) with ns-3 packet-level TCP (emu.ns3_backend) and with Mininet, and where they part.

Cases, each run on the flow simulator and ns-3 (same workload, same topology), and on Mininet
(:func:`emu.mininet_backend.run_mininet`) where both can run it (``*`` below):

1. ``idle-ring-8`` *: one ring all-reduce on an idle star; the closed form 2(n-1)/n S/B is the reference.
2. ``incast-K``: K senders to one receiver at once (many-to-one) with small switch buffers (``--incast-queue``
   packets per band in ns-3): the fluid model shares the receiver's link perfectly, TCP drops and times out.
   ``incast-8`` *.
3. ``two-tier-16`` *: 16 single-GPU hosts, 4 per leaf, 2 spines (1:1), 4 jobs of 4 GPUs on 4 leaves: rings cross the spines.
   Mininet emulates the fabric as one bridge (``nic_mode="aggregate"``: it has no spines), which is the fluid
   model's fabric exactly when the spines are non-blocking and the flows spread over them, as here.
4. ``two-tier-N``: ``--hosts`` single-GPU hosts on a leaf-spine fabric (16 hosts per leaf, 4 spines,
   10 Gbit/s links), 8-GPU data-parallel jobs whose rings cross the spines (ECMP), compute + all-reduce,
   equal class: per-job mean iteration time, simulator vs ns-3 (sizes Mininet cannot reach on 2 cores).

Mininet runs the fabric's rates divided by the time scale ``--mn-time-scale`` (K, default 1000: 10 Gbit/s links
become 10/K Gbit/s, <= 1 Gbit/s) and stretches compute by K; its times are divided by K back into workload seconds.
Its CPU fidelity check (``--cpu-limit``, as ``bench_emu``) fails a run on a saturated machine; 1.01 records it anyway.

Run: ``sudo .venv/bin/python bench/bench_ns3_agreement.py [--quick] [--hosts 32 128] [--no-mininet]`` (needs the ns3
package; Mininet needs root). ns-3 is imported once (~100 s of C++ header parsing). ``--quick``: the three Mininet
cases only, a few minutes; its table goes to ``--out`` (default: printed only, the committed results are
the full run's).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import markdown_table, write_results  # noqa: E402
from emu.ns3_backend import Ns3Error, Ns3Options, import_ns3, run_ns3  # noqa: E402
from emu.sim import simulate  # noqa: E402
from emu.workload import CollectivePhase, ComputePhase, Job, P2PPhase, Transfer, Workload  # noqa: E402
from topology import LinkKind, NodeKind, Topology  # noqa: E402
from topology.fabrics import leaf_spine, star  # noqa: E402

LINK = 1.25  # GB/s: 10 Gbit/s keeps the packet count of a run small
MN_TIME_SCALE = 1000.0  # Mininet: 10 Gbit/s -> 10 Mbit/s; at K = 200 a CPU-saturated machine added 14 % to an idle ring, at 1000 2 %


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


def _errors(sim, other) -> dict[str, float]:
    """Signed relative error (%) of ``other``'s mean iteration time against the simulator's, per job."""
    out = {}
    for name, js in sim.jobs.items():
        a, b = js.mean_iteration_time(), other.jobs[name].mean_iteration_time()
        out[name] = 100 * (b - a) / a
    return out


def _summary(prefix: str, sim, other, errors: dict[str, float]) -> dict:
    worst = max(errors, key=lambda n: abs(errors[n]))
    return {f"{prefix}_ms": sum(j.mean_iteration_time() for j in other.jobs.values()) / len(other.jobs) * 1e3,
            f"{prefix}_mape_pct": sum(abs(e) for e in errors.values()) / len(errors), f"{prefix}_worst_job": worst,
            f"{prefix}_worst_err_pct": errors[worst]}


def run_mn(topo: Topology, w: Workload, opts: dict, cpu_limit: float):
    """The Mininet run of a case (``opts``: :func:`run_mininet` keywords), or the reason it did not give one."""
    from emu.mininet_backend import run_mininet
    from emu.net import EmulationError

    t0 = time.perf_counter()
    try:
        res = run_mininet(topo, w, cpu_limit=cpu_limit, raise_on_fidelity=False, probe_dscp=False, **opts)
    except EmulationError as exc:  # FidelityError is one; no root, no Mininet, a wedged network
        return None, {"mn_status": f"not run: {str(exc).splitlines()[0][:100]}"}
    fid = res.meta["fidelity"]
    cal = (fid.get("calibration_before") or {}).get("error")
    return res, {"mn_K": res.time_scale, "mn_cpu_busy": fid.get("cpu", {}).get("busy_mean"), "mn_calib_err_pct": None if cal is None else 100 * cal,
                 "mn_wall_s": time.perf_counter() - t0, "mn_status": "ok" if fid.get("ok", True) else "fidelity failed: " +
                 "; ".join(fid.get("problems", []))[:100]}


def compare(case: str, topo: Topology, w: Workload, options: Ns3Options, mn_opts: dict | None, cpu_limit: float,
            mininet: bool) -> tuple[dict, list[dict]]:
    """One case on every backend: the summary row and one row per job (errors against the simulator)."""
    t0 = time.perf_counter()
    sim = simulate(topo, w)
    sim_wall = time.perf_counter() - t0
    row = {"case": case, "hosts": len(topo.hosts()), "jobs": len(w.jobs), "sim_ms": sum(j.mean_iteration_time() for j in sim.jobs.values())
           / len(sim.jobs) * 1e3}
    per_job = {n: {"case": case, "job": n, "sim_ms": js.mean_iteration_time() * 1e3} for n, js in sim.jobs.items()}
    try:
        pkt = run_ns3(topo, w, options)
    except Ns3Error as exc:  # recorded, not hidden: the table says which case ns-3 could not finish and why
        row["ns3_status"] = str(exc)
    else:
        errs = _errors(sim, pkt)
        row.update(_summary("ns3", sim, pkt, errs))
        row.update({"ns3_wall_s": pkt.meta["wall_s"], "ns3_events": pkt.meta["events"]})
        for n, e in errs.items():
            per_job[n].update({"ns3_ms": pkt.jobs[n].mean_iteration_time() * 1e3, "ns3_err_pct": e})
    if mn_opts is not None and mininet:
        emu, fig = run_mn(topo, w, mn_opts, cpu_limit)
        if emu is not None:
            errs = _errors(sim, emu)
            row.update(_summary("mn", sim, emu, errs))
            for n, e in errs.items():
                per_job[n].update({"mn_ms": emu.jobs[n].mean_iteration_time() * 1e3, "mn_err_pct": e})
        row.update(fig)
    row["sim_wall_s"] = sim_wall
    return row, list(per_job.values())


def small_two_tier(hosts: int = 16) -> tuple[Topology, Workload]:
    """``hosts`` single-GPU hosts, 4 per leaf, 2 spines at 1:1; jobs of 4 GPUs, one per leaf (their rings cross the spines)."""
    return two_tier(hosts, per_leaf=4, spines=2), dp_jobs(hosts, size=4)


def cases(args: argparse.Namespace) -> list[tuple]:
    """``(name, topology, workload, ns-3 options, Mininet keywords or None)``, smallest first."""
    k = {"time_scale": args.mn_time_scale}
    ring = Workload("ring", (Job("ring", tuple(f"n{i}/gpu0" for i in range(8)), (CollectivePhase("ar", "all_reduce", 8e6),), iterations=2),))
    out = [("idle-ring-8", star(8, nic_bw=LINK), ring, Ns3Options(), k)]
    out += [(f"incast-{n}", star(n + 1, nic_bw=LINK), incast(n), Ns3Options(queue_packets=args.incast_queue), k if n <= 8 else None)
            for n in args.incast]
    out.append(("two-tier-16", *small_two_tier(16), Ns3Options(), {**k, "nic_mode": "aggregate"}))
    out += [(f"two-tier-{hosts}", two_tier(hosts), dp_jobs(hosts), Ns3Options(), None) for hosts in args.hosts]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the three Mininet cases only; printed, or written to --out")
    ap.add_argument("--hosts", type=int, nargs="+", default=None, help="two-tier sizes for ns-3 (default 32 128; quick: none)")
    ap.add_argument("--incast", type=int, nargs="+", default=None, help="incast fan-ins (default 8 32; quick: 8)")
    ap.add_argument("--incast-queue", type=int, default=64)
    ap.add_argument("--no-mininet", dest="mininet", action="store_false", help="flow simulator and ns-3 only")
    ap.add_argument("--mn-time-scale", type=float, default=MN_TIME_SCALE, help="Mininet time scale K (10 Gbit/s links -> 10/K Gbit/s)")
    ap.add_argument("--cpu-limit", type=float, default=1.01, help="Mininet CPU busy fraction that fails a run (1.01: record it)")
    ap.add_argument("--out", type=Path, default=None, help="results directory (default: $NETWEAVE_BENCH_OUT or bench/results; quick: only if given)")
    args = ap.parse_args()
    args.hosts = args.hosts if args.hosts is not None else ([] if args.quick else [32, 128])
    args.incast = args.incast or ([8] if args.quick else [8, 32])
    # a quick run is a check, not the committed results: it writes only where asked (--out, or netweave bench's directory)
    print_only = args.quick and args.out is None and not os.environ.get("NETWEAVE_BENCH_OUT")
    if args.mininet and os.geteuid() != 0:
        print("Mininet needs root: the Mininet column is left out (--no-mininet to say so)", file=sys.stderr)
        args.mininet = False
    t = time.perf_counter()
    try:
        import_ns3()  # once per process: the C++ headers are parsed here
    except Ns3Error as exc:
        print(f"bench_ns3_agreement: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    import_s = time.perf_counter() - t
    rows: list[dict] = []
    jobs: list[dict] = []
    for case in cases(args):  # results are written after every case: the largest may not finish in the time one has
        row, per_job = compare(*case, args.cpu_limit, args.mininet)
        rows.append(row)
        jobs += per_job
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        both = [r for r in jobs if "mn_ms" in r]
        notes = f"""
Per-job mean iteration time, flow simulator (fluid max-min, exact for its model) vs ns-3 3.44 (packet-level TCP Cubic,
9000-byte MTU, 9 strict-priority bands of 1000 packets, min RTO 5 ms; incast cases {args.incast_queue} packets per band)
vs Mininet (Linux TCP Cubic over veths and bridges, HTB-shaped at K = {args.mn_time_scale:g}: 10 Gbit/s becomes
{10e3 / args.mn_time_scale:g} Mbit/s, compute stretched by K, times divided by K; ~0.1 ms RTT whatever the latency).
Links at 10 Gbit/s (1 us per hop). `two-tier-16`: 4 hosts per leaf, 2 spines (1:1), 4 jobs of 4 GPUs on 4 leaves; Mininet
runs it as one bridge (aggregate: it has no spines), ns-3 with the spines and ECMP. `two-tier-N` (N >= 32): 16 hosts per
leaf, 4 spines at 40 Gbit/s, N/8 jobs of 8 GPUs on 8 leaves; ns-3 only. Jobs: compute (2 ms) + 1 MB ring all-reduce,
2 iterations. `*_mape_pct`: mean over jobs of |backend - sim| / sim; `*_worst_err_pct` signed (backend - sim).
`mn_cpu_busy`: the emulation's CPU fidelity figure (runs recorded with cpu_limit={args.cpu_limit}).
ns-3 import (header parsing) took {import_s:.0f} s; peak RSS of the whole run {peak_mb:.0f} MB. Wall times on a shared
2-core machine (load average {os.getloadavg()[0]:.1f} at the end).

Per job, the cases all three ran (error of each against the simulator, %):

{markdown_table(both, ["case", "job", "sim_ms", "ns3_ms", "ns3_err_pct", "mn_ms", "mn_err_pct"]) if both else "(none ran on Mininet)"}
Where they agree and where they part: docs/validation/emu.md.
"""
        if print_only:
            print(markdown_table(rows, list(dict.fromkeys(k for r in rows for k in r))))
            continue
        columns = list(dict.fromkeys(k for r in rows for k in r))
        write_results("ns3_agreement", rows, title="Flow simulator vs ns-3 packet-level TCP vs Mininet", notes=notes, columns=columns,
                      extra={"import_s": import_s, "peak_rss_mb": peak_mb, "link_gbs": LINK, "mn_time_scale": args.mn_time_scale, "per_job": jobs},
                      out_dir=args.out)
    if print_only:
        print(notes)


if __name__ == "__main__":
    main()
