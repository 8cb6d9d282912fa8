"""GPU check of the NCCL hook with real NCCL (needs a CUDA build of torch; not run in CI).

Two ranks on one GPU, each with its own NCCL_HOSTID so NCCL treats them as two nodes and
routes everything through the network plugin (research digest §3.7). Each rank loads
libnccl-net-netweave.so as net, tuner and profiler plugin, runs all-reduces of several
sizes on a process group with traffic class 5 (where torch exposes
``ProcessGroupNCCL.Options().config.traffic_class``; else a plan ``order 0 class=5`` rule
gives the same class), and reports:
  * whether NCCL loaded our net/tuner/profiler (NCCL_DEBUG=INFO log lines naming netweave),
  * correctness of every all-reduce,
  * the marks of the plugin's TCP sockets in the rank's own process (IP_TOS, SO_PRIORITY),
  * the collective events found in the profiler ring and their byte counts.
Usage: python csrc/tests/gpu_nccl_check.py [--out bench/results/ncclhook_gpu.json]
Exit status 0 only if every check passed; 2 when no CUDA GPU is available."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
SIZES = [1024, 1 << 20, 16 << 20]  # elements (float32)
TRAFFIC_CLASS = 5


def socket_marks() -> list[dict[str, int]]:
    """IP_TOS / SO_PRIORITY of every connected TCP socket of this process (the plugin's live here)."""
    out = []
    for fd_name in os.listdir("/proc/self/fd"):
        fd = int(fd_name)
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                s.getpeername()
            except OSError:
                continue
            out.append({"fd": fd, "tos": s.getsockopt(socket.IPPROTO_IP, socket.IP_TOS),
                        "prio": s.getsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY), "port": s.getsockname()[1]})
        finally:
            s.close()
    return out


def rank_main(rank: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    opts = None
    tc_via = "plan order rule"
    try:
        opts = dist.ProcessGroupNCCL.Options()
        opts.config.traffic_class = TRAFFIC_CLASS
        tc_via = "pg_options.config.traffic_class"
    except (AttributeError, RuntimeError):
        opts = None
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, pg_options=opts,
                            device_id=torch.device("cuda", 0))
    results = []
    for n in SIZES:
        t = torch.full((n,), float(rank + 1), device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        results.append({"elements": n, "correct": bool(torch.all(t == 3.0).item())})
    marks = socket_marks()
    dist.destroy_process_group()
    Path(out).write_text(json.dumps({"rank": rank, "allreduce": results, "marks": marks, "traffic_class_via": tc_via}))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "ncclhook_gpu.json"))
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--rank-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.port, args.rank_out)
        return 0
    try:
        import torch
    except ImportError:
        print("torch is not installed", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("no CUDA GPU / CUDA build of torch: nothing to check", file=sys.stderr)
        return 2
    from flowsched import ncclhook

    build_dir = ncclhook.build()
    with tempfile.TemporaryDirectory() as d:
        plan = ncclhook.write_plan(ncclhook.FlowPlan(comms=[ncclhook.CommRule("order", 0, cls=TRAFFIC_CLASS)],
                                                     tunes=[ncclhook.TuneRule("*", channels=2)]), Path(d) / "gpu.plan")
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        procs, logs = [], []
        for rank in (0, 1):
            log = Path(d) / f"nccl.{rank}.log"
            logs.append(log)
            env = {**os.environ, **ncclhook.plugin_env(plan=plan, ring=str(Path(d) / f"ring.{rank}"), build_dir=build_dir),
                   "NCCL_HOSTID": f"netweave-host{rank}", "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET,TUNING,ENV",
                   "NCCL_DEBUG_FILE": str(log), "NETWEAVE_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo",
                   "NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_MAX_CTAS": "2", "NCCL_NET_GDR_LEVEL": "LOC",
                   "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
            procs.append(subprocess.Popen([sys.executable, __file__, "--rank", str(rank), "--port", str(port),
                                           "--rank-out", str(Path(d) / f"rank{rank}.json")], env=env))
        codes = [p.wait(timeout=500) for p in procs]
        report: dict = {"exit_codes": codes, "ranks": [], "checks": {}}
        for rank in (0, 1):
            f = Path(d) / f"rank{rank}.json"
            report["ranks"].append(json.loads(f.read_text()) if f.exists() else None)
        text = "\n".join(log.read_text(errors="replace") for log in logs if log.exists())
        report["nccl_log_netweave_lines"] = [line for line in text.splitlines() if "netweave" in line.lower()][:40]
        coll = []
        for rank in (0, 1):
            try:
                with ncclhook.ProfilerRing(Path(d) / f"ring.{rank}") as ring:
                    coll += [sp for sp in ncclhook.collective_spans(ring.read()) if sp["func"] == "allreduce"]
            except ncclhook.NcclHookError as e:
                report.setdefault("ring_errors", []).append(str(e))
        report["ring_allreduce_spans"] = coll
    ranks = [r for r in report["ranks"] if r]
    want_tos = (8 * TRAFFIC_CLASS) << 2
    checks = {
        "ranks_exited_0": codes == [0, 0],
        "allreduce_correct": len(ranks) == 2 and all(x["correct"] for r in ranks for x in r["allreduce"]),
        "net_plugin_loaded": any("netweave" in line and ("net" in line.lower()) for line in report["nccl_log_netweave_lines"]),
        "sockets_marked": len(ranks) == 2 and all(any(m["tos"] == want_tos and m["prio"] == TRAFFIC_CLASS for m in r["marks"]) for r in ranks),
        # each rank's ring holds its own all-reduces (torch may add others, e.g. for barriers)
        "profiler_saw_allreduces": all(sum(sp["bytes"] == 4 * n for sp in coll) >= 2 for n in SIZES),
    }
    report["checks"] = checks
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    for k, v in checks.items():
        print(f"{'PASS' if v else 'FAIL'} {k}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
