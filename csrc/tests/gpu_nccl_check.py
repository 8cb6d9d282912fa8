"""GPU checks of the NCCL hook with real NCCL (a CUDA build of torch; root for the namespaces; not run in CI).

Every rank runs on GPU 0 with its own NCCL_HOSTID, so NCCL takes the ranks for separate nodes and sends all
their traffic through our network plugin (research digest §3.7). Scenarios:

* ``loopback``: 2 ranks on ``lo``, one process group in traffic class 5. NCCL loads our net, tuner and
  profiler plugins (its NCCL_DEBUG=INFO log says so), the all-reduces are exact, the plugin's sockets carry
  DSCP 40 / SO_PRIORITY 5, and the profiler ring holds the all-reduces with their byte counts.
* ``netns``: 2 ranks, each in its own network namespace, joined by a veth whose ends carry the HTB priority
  tree; two process groups per rank, in classes 5 and 2. The all-reduces are exact, and both the packets
  captured on the veth (scapy) and the HTB class counters put each group's bytes in its own class.
* ``contention``: two 2-rank jobs through the same shaped veth. Job "small" times all-reduces of
  ``--small-mib`` while job "bulk" runs all-reduces of ``--bulk-mib`` back to back. Three phases: small
  alone; both with no plan (no traffic class: every packet in the default HTB leaf); both with the flow
  plan (``flowsched``: Sincronia order of the two coflows -> priority classes -> each host's plugin plan,
  and each job's process group in its class). Goal: with the plan the small job's median latency stays
  within 1.2x of its value alone; without the plan it degrades.

Usage: python csrc/tests/gpu_nccl_check.py [--scenario all|loopback|netns|contention] [--out-dir bench/results]
Writes ncclhook_gpu.json and ncclhook_gpu.md there (NCCL logs with --keep-logs DIR). Exit status 0 only if
every check passed; 2 when no CUDA GPU is available (nothing written).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
HERE = Path(__file__).resolve().parent
RANK_SCRIPT = HERE / "nccl_rank.py"
LOOPBACK_SIZES = [1024, 1 << 20, 16 << 20]  # elements (float32)
NETNS_SIZES = [1024, 1 << 18]
NETNS_RATE_MBIT = 20.0  # slow enough for scapy to see every packet
GOAL_RATIO = 1.2
CPU_REHEARSAL = False  # --cpu-rehearsal: gloo ranks on the CPU exercise everything but NCCL (the NCCL checks then fail)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nccl_env(hostid: str, ifname: str, log: Path, *, plan: Path | None, ring: Path | None, build_dir: Path) -> dict[str, str]:
    from flowsched import ncclhook

    return {**os.environ, **ncclhook.plugin_env(plan=plan, ring=str(ring) if ring else None, build_dir=build_dir),
            "NCCL_HOSTID": hostid, "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET,TUNING,ENV",
            "NCCL_DEBUG_FILE": str(log), "NETWEAVE_SOCKET_IFNAME": ifname, "NCCL_SOCKET_IFNAME": ifname,
            "NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_MAX_CTAS": "2", "NCCL_NET_GDR_LEVEL": "LOC",
            "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}


def launch(cfg: dict, env: dict[str, str], tmp: Path, prefix: list[str]) -> subprocess.Popen:
    path = tmp / f"{Path(cfg['out']).stem}.cfg.json"
    path.write_text(json.dumps({**cfg, "cpu_rehearsal": CPU_REHEARSAL}))
    return subprocess.Popen([*prefix, sys.executable, str(RANK_SCRIPT), str(path)], env=env)


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    """Exit codes; processes still running at the deadline are killed (code None)."""
    deadline = time.monotonic() + timeout
    codes: list[int | None] = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            codes.append(None)
    return codes


def wait_files(paths: list[Path], procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if any(p.poll() not in (None, 0) for p in procs):
            raise RuntimeError(f"a rank exited with {[p.poll() for p in procs]} before {[str(p) for p in paths]} appeared")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{[str(p) for p in paths if not p.exists()]} did not appear in {timeout:.0f} s")
        time.sleep(0.05)


def read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def log_lines(logs: list[Path], needle: str = "netweave") -> list[str]:
    lines = []
    for log in logs:
        if log.exists():
            lines += [line for line in log.read_text(errors="replace").splitlines() if needle in line.lower()]
    return lines


def keep_logs(logs: list[Path], keep: Path | None, scenario: str) -> None:
    if keep is None:
        return
    keep.mkdir(parents=True, exist_ok=True)
    for log in logs:
        if log.exists():   # logs a scenario names after itself keep their name; the others get it as a prefix
            name = log.name if log.name.startswith(f"{scenario}.") else f"{scenario}.{log.name}"
            (keep / name).write_text(log.read_text(errors="replace"))


# ------------------------------------------------------------------------------------------ loopback --
def scenario_loopback(tmp: Path, build_dir: Path, keep: Path | None) -> dict:
    from flowsched import ncclhook

    tc = 5
    plan = ncclhook.write_plan(ncclhook.FlowPlan(tunes=[ncclhook.TuneRule("*", channels=2)]), tmp / "loopback.plan")
    port, procs, logs = free_port(), [], []
    for rank in (0, 1):
        logs.append(tmp / f"loopback.nccl.{rank}.log")
        env = nccl_env(f"netweave-host{rank}", "lo", logs[-1], plan=plan, ring=tmp / f"ring.{rank}", build_dir=build_dir)
        cfg = {"mode": "check", "rank": rank, "world": 2, "master": "127.0.0.1", "port": port, "classes": [tc],
               "sizes": LOOPBACK_SIZES, "out": str(tmp / f"loopback.rank{rank}.json")}
        procs.append(launch(cfg, env, tmp, []))
    codes = wait_all(procs, 240)
    ranks = [read_json(tmp / f"loopback.rank{r}.json") for r in (0, 1)]
    lines = log_lines(logs)
    keep_logs(logs, keep, "loopback")
    spans = []
    for rank in (0, 1):
        with contextlib.suppress(ncclhook.NcclHookError), ncclhook.ProfilerRing(tmp / f"ring.{rank}") as ring:
            spans += [sp for sp in ncclhook.collective_spans(ring.read()) if sp["func"] == "allreduce"]
    ok = [r for r in ranks if r]
    tos = (8 * tc) << 2
    checks = {
        "ranks_exited_0": codes == [0, 0],
        "allreduce_correct": len(ok) == 2 and all(x["correct"] for r in ok for x in r["allreduce"]),
        "net_plugin_loaded": any("loaded net plugin netweave" in line.lower() for line in lines),
        "tuner_plugin_loaded": any("tuner/plugin: using netweave" in line.lower() for line in lines),
        "profiler_plugin_loaded": any("profiler/plugin: loaded netweave" in line.lower() for line in lines),
        "sockets_marked": len(ok) == 2 and all(any(m["tos"] == tos and m["prio"] == tc for m in r["marks"]) for r in ok),
        # each rank's ring holds its own all-reduces (torch may add others, e.g. for barriers)
        "profiler_saw_allreduces": all(sum(sp["bytes"] == 4 * n for sp in spans) >= 2 for n in LOOPBACK_SIZES),
    }
    return {"checks": checks, "exit_codes": codes, "ranks": ranks, "plugin_log": lines[:40],
            "profiler_allreduce_spans": spans}


# --------------------------------------------------------------------------------------------- netns --
def scenario_netns(tmp: Path, build_dir: Path, keep: Path | None, rate_mbit: float) -> dict:
    from emu.htb import leaf_classid, priority_for_dscp
    from flowsched import ncclhook

    classes = [5, 2]
    report: dict = {"rate_mbit": rate_mbit, "classes": classes, "sizes": NETNS_SIZES}
    logs = [tmp / f"netns.nccl.{r}.log" for r in (0, 1)]
    stop, procs = tmp / "netns.stop", []
    with ncclhook.NetnsPair("nwgpu", subnet=79) as pair:
        try:
            for ns, dev in ((pair.ns_a, pair.dev_a), (pair.ns_b, pair.dev_b)):
                ncclhook.run_commands(ncclhook.htb_commands(dev, rate_mbit), netns=ns)
            cap = subprocess.Popen(pair.cmd("a", [sys.executable, str(HERE / "capture_tos.py"), pair.dev_a,
                                                  str(tmp / "netns.cap.json"), str(tmp / "netns.cap.ready"), str(stop)]))
            procs.append(cap)
            wait_files([tmp / "netns.cap.ready"], procs, 60)
            egress = ((pair.dev_a, pair.ns_a), (pair.dev_b, pair.ns_b))
            before = [ncclhook.htb_class_bytes(dev, netns=ns) for dev, ns in egress]
            port = free_port()
            ranks = []
            for rank, side, dev in ((0, "a", pair.dev_a), (1, "b", pair.dev_b)):
                env = nccl_env(f"netweave-ns{side}", dev, logs[rank], plan=None, ring=None, build_dir=build_dir)
                cfg = {"mode": "check", "rank": rank, "world": 2, "master": pair.addr_a, "port": port, "classes": classes,
                       "sizes": NETNS_SIZES, "out": str(tmp / f"netns.rank{rank}.json")}
                ranks.append(launch(cfg, env, tmp, pair.cmd(side, [])))
            procs += ranks
            codes = wait_all(ranks, 240)
            after = [ncclhook.htb_class_bytes(dev, netns=ns) for dev, ns in egress]
        finally:
            stop.touch()
            if procs:  # the capture writes its file once it sees the stop file
                with contextlib.suppress(subprocess.TimeoutExpired):
                    procs[0].wait(timeout=30)
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    keep_logs(logs, keep, "netns")
    ranks_rep = [read_json(tmp / f"netns.rank{r}.json") for r in (0, 1)]
    capture = read_json(tmp / "netns.cap.json") or {}
    payload_by_tos: dict[int, int] = {}
    conn_tos: dict[tuple[int, int], set[int]] = {}  # a TCP connection (unordered port pair) -> the TOS values it carried
    for key, (_, nbytes) in capture.items():
        tos, sport, dport = (int(x) for x in key.split())
        payload_by_tos[tos] = payload_by_tos.get(tos, 0) + nbytes
        conn_tos.setdefault((min(sport, dport), max(sport, dport)), set()).add(tos)
    delta = [{c: a.get(c, 0) - b.get(c, 0) for c in a} for b, a in zip(before, after, strict=True)]
    group_bytes = 4 * sum(NETNS_SIZES)  # a 2-rank ring all-reduce sends S bytes each way
    ok = [r for r in ranks_rep if r]
    class_tos = {(8 * k) << 2 for k in classes}
    total = sum(payload_by_tos.values())
    checks = {
        "ranks_exited_0": codes == [0, 0],
        "allreduce_correct": len(ok) == 2 and all(x["correct"] for r in ok for x in r["allreduce"]),
        "net_plugin_used": all(any("using network netweave" in line.lower() for line in log_lines([log], "using network"))
                               for log in logs),
        # every connection that carried a class carried only that class (SYN, data and ACKs alike)
        "one_class_per_connection": all(len(t) == 1 for t in conn_tos.values() if t & class_tos),
        # only NCCL's bootstrap and torch's store travel unmarked
        "unmarked_payload_below_5pct": total > 0 and payload_by_tos.get(0, 0) <= 0.05 * total,
    }
    per_class = {}
    for k in classes:
        tos, prio = (8 * k) << 2, priority_for_dscp(8 * k)
        leaf = leaf_classid(prio)
        per_class[k] = {"tos": tos, "htb_leaf": leaf, "captured_payload": payload_by_tos.get(tos, 0),
                        "htb_leaf_bytes_a_egress": delta[0].get(leaf, 0), "htb_leaf_bytes_b_egress": delta[1].get(leaf, 0),
                        "group_bytes_each_way": group_bytes,
                        "connections": sum(1 for t in conn_tos.values() if t == {tos})}
        checks[f"class{k}_sockets_marked"] = len(ok) == 2 and all(any(m["tos"] == tos and m["prio"] == k for m in r["marks"]) for r in ok)
        # exact: the kernel's u32 filters classified the group's bytes by their DSCP into the class's leaf, both ways
        checks[f"class{k}_htb_leaf_bytes_both_ways"] = min(delta[0].get(leaf, 0), delta[1].get(leaf, 0)) >= group_bytes
        # sampled: scapy misses packets when it falls behind (it saw 69-90 % of the payload on the GPU machine at 20 Mbit/s)
        checks[f"class{k}_packets_on_wire"] = per_class[k]["connections"] > 0 and payload_by_tos.get(tos, 0) >= 0.5 * 2 * group_bytes
    report.update(checks=checks, exit_codes=codes, ranks=ranks_rep, per_class=per_class, payload_by_tos=payload_by_tos,
                  htb_bytes_a_egress=delta[0], htb_bytes_b_egress=delta[1])
    return report


# ---------------------------------------------------------------------------------------- contention --
def _flow_plan(small_bytes: int, bulk_bytes: int, rate_mbit: float, hosts: tuple[str, str]):
    """The flowsched plan for the two jobs: Sincronia order of their coflows, then priority bands."""
    from flowsched.coflow import coflows_from_matrix, sincronia_order
    from flowsched.plan import plan_from_order

    a, b = hosts
    coflows = [coflows_from_matrix(job, [(a, b, float(n)), (b, a, float(n))]) for job, n in (("bulk", bulk_bytes), ("small", small_bytes))]
    order = sincronia_order(coflows, rate_mbit * 1e6 / 8)
    return order, plan_from_order(order, {"small": list(hosts), "bulk": list(hosts)})


def _contention_phase(name: str, pair, tmp: Path, build_dir: Path, *, with_bulk: bool, plan, small_elems: int, bulk_elems: int,
                      iters: int, logs: list[Path]) -> dict:
    from flowsched import ncclhook
    from flowsched.plan import nccl_class, write_nccl_plan

    procs: list[subprocess.Popen] = []
    go, stop = tmp / f"{name}.go", tmp / f"{name}.stop"
    sides = (("a", pair.dev_a, pair.ns_a), ("b", pair.dev_b, pair.ns_b))
    plan_files = {}
    if plan is not None:
        for _, _, ns in sides:
            plan_files[ns] = write_nccl_plan(plan, ns, tmp / f"{name}.{ns}.plan")

    def start(job: str, mode: str, elems: int) -> list[Path]:
        port, ready = free_port(), []
        cls = None
        if plan is not None:
            cls = nccl_class(next(r.priority for r in plan.hosts[pair.ns_a].rules if r.job == job))
        for rank, (side, dev, ns) in enumerate(sides):
            log = tmp / f"{name}.{job}.nccl.{rank}.log"
            logs.append(log)
            env = nccl_env(f"{job}-{side}", dev, log, plan=plan_files.get(ns), ring=None, build_dir=build_dir)
            ready.append(tmp / f"{name}.{job}.ready{rank}")
            cfg = {"mode": mode, "rank": rank, "world": 2, "master": pair.addr_a, "port": port, "classes": [cls],
                   "sizes": [elems], "iters": iters, "warmup": 5, "ready": str(ready[-1]), "go": str(go), "stop": str(stop),
                   "out": str(tmp / f"{name}.{job}.rank{rank}.json")}
            procs.append(launch(cfg, env, tmp, pair.cmd(side, [])))
        return ready

    try:
        if with_bulk:
            wait_files(start("bulk", "bulk", bulk_elems), procs, 180)
            time.sleep(1.0)  # let the bulk flows fill the link
        small_ready = start("small", "latency", small_elems)
        wait_files(small_ready, procs, 180)
        before = ncclhook.htb_class_bytes(pair.dev_a, netns=pair.ns_a)
        go.touch()
        small_codes = wait_all(procs[-2:], 240)
        after = ncclhook.htb_class_bytes(pair.dev_a, netns=pair.ns_a)
        stop.touch()
        codes = wait_all(procs[:-2], 120) + small_codes
    finally:
        stop.touch()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    small = read_json(tmp / f"{name}.small.rank0.json") or {}
    bulk = read_json(tmp / f"{name}.bulk.rank0.json") if with_bulk else None
    lat = small.get("latency_s", [])
    rep = {"phase": name, "with_bulk": with_bulk, "planned": plan is not None, "exit_codes": codes,
           "small_correct": bool(small.get("correct")), "latency_s": lat,
           "median_s": statistics.median(lat) if lat else None,
           "p90_s": sorted(lat)[int(0.9 * (len(lat) - 1))] if lat else None,
           "htb_bytes_a_egress": {c: after.get(c, 0) - before.get(c, 0) for c in after if after.get(c, 0) != before.get(c, 0)},
           "plan_files": {ns: p.read_text() for ns, p in plan_files.items()}}
    if bulk:
        rep["bulk_ops"] = bulk["ops"]
        rep["bulk_goodput_mbit"] = 8 * bulk["bytes"] * bulk["ops"] / bulk["seconds"] / 1e6
    return rep


def scenario_contention(tmp: Path, build_dir: Path, keep: Path | None, rate_mbit: float, small_mib: float, bulk_mib: float,
                        iters: int, repeats: int) -> dict:
    from emu.htb import leaf_classid
    from flowsched import ncclhook
    from flowsched.plan import dumps_plan, nccl_class

    small_elems, bulk_elems = int(small_mib * (1 << 18)), int(bulk_mib * (1 << 18))
    logs: list[Path] = []
    phases = []
    with ncclhook.NetnsPair("nwcon", subnet=80) as pair:
        for ns, dev in ((pair.ns_a, pair.dev_a), (pair.ns_b, pair.dev_b)):
            ncclhook.run_commands(ncclhook.htb_commands(dev, rate_mbit), netns=ns)
        order, plan = _flow_plan(4 * small_elems, 4 * bulk_elems, rate_mbit, (pair.ns_a, pair.ns_b))
        for rep in range(repeats):
            for kind, with_bulk, planned in (("alone", False, True), ("contended_no_plan", True, False), ("contended_plan", True, True)):
                name = f"{kind}.{rep}"
                print(f"[contention] phase {name}", flush=True)
                ph = _contention_phase(name, pair, tmp, build_dir, with_bulk=with_bulk, plan=plan if planned else None,
                                       small_elems=small_elems, bulk_elems=bulk_elems, iters=iters, logs=logs)
                phases.append({**ph, "kind": kind, "repeat": rep})
    keep_logs(logs, keep, "contention")
    classes = {r.job: {"priority": r.priority, "nccl_class": nccl_class(r.priority), "dscp": r.dscp}
               for r in plan.hosts["nwcona"].rules}
    small_leaf, bulk_leaf = leaf_classid(classes["small"]["priority"]), leaf_classid(classes["bulk"]["priority"])
    ratios = []
    for rep in range(repeats):
        by = {p["kind"]: p for p in phases if p["repeat"] == rep}
        alone, noplan, planned = (by[k]["median_s"] for k in ("alone", "contended_no_plan", "contended_plan"))
        ratios.append({"repeat": rep, "plan": planned / alone if alone and planned else None,
                       "no_plan": noplan / alone if alone and noplan else None,
                       "small_leaf_bytes": by["contended_plan"]["htb_bytes_a_egress"].get(small_leaf, 0),
                       "bulk_leaf_bytes": by["contended_plan"]["htb_bytes_a_egress"].get(bulk_leaf, 0)})
    ok_runs = all(c == 0 for p in phases for c in p["exit_codes"]) and all(p["small_correct"] for p in phases)
    checks = {
        "ranks_exited_0_and_correct": ok_runs,
        "sincronia_puts_small_first": order == ["small", "bulk"],
        "plan_separates_classes_on_wire": all(r["small_leaf_bytes"] >= iters * 4 * small_elems and r["bulk_leaf_bytes"] > 0 for r in ratios),
        "with_plan_within_goal": all(r["plan"] is not None and r["plan"] <= GOAL_RATIO for r in ratios),
        "without_plan_degrades": all(r["no_plan"] is not None and r["no_plan"] > GOAL_RATIO for r in ratios),
    }
    return {"checks": checks, "rate_mbit": rate_mbit, "small_bytes": 4 * small_elems, "bulk_bytes": 4 * bulk_elems, "iters": iters,
            "repeats": repeats, "order": order, "classes": classes, "plan": dumps_plan(plan), "ratios": ratios, "phases": phases}


# ------------------------------------------------------------------------------------------------ report --
def markdown(report: dict) -> str:
    lines = [f"# NCCL hook on a GPU ({report['date']})", "",
             f"Device: {report['device']}; NCCL {report['nccl_version']}; torch {report['torch']}; "
             f"command: `{report['command']}`.", "", "| scenario | check | result |", "|---|---|---|"]
    for name, sc in report["scenarios"].items():
        for k, v in sc.get("checks", {}).items():
            lines.append(f"| {name} | {k} | {'pass' if v else 'FAIL'} |")
        if "error" in sc:
            lines.append(f"| {name} | ran | FAIL: {sc['error']} |")
    net = report["scenarios"].get("netns")
    if net and "per_class" in net:
        lines += ["", f"Two namespaces, veth shaped to {net['rate_mbit']:g} Mbit/s; one process group per class, each all-reducing "
                  f"{4 * sum(net['sizes'])} bytes (sent once each way):", "",
                  "| class | TOS | connections | payload captured (both ways) | HTB leaf | leaf bytes, a's egress | leaf bytes, b's egress |",
                  "|---|---|---|---|---|---|---|"]
        for k, c in net["per_class"].items():
            lines.append(f"| {k} | {c['tos']} | {c['connections']} | {c['captured_payload']} | {c['htb_leaf']} | "
                         f"{c['htb_leaf_bytes_a_egress']} | {c['htb_leaf_bytes_b_egress']} |")
    con = report["scenarios"].get("contention")
    if con and "phases" in con:
        lines += ["", f"Contention: small job {con['small_bytes'] / 2**20:g} MiB all-reduces, bulk job "
                  f"{con['bulk_bytes'] / 2**20:g} MiB, one veth shaped to {con['rate_mbit']:g} Mbit/s each way by the HTB tree; "
                  f"Sincronia order {con['order']}, classes {json.dumps(con['classes'])}.", "",
                  "| phase | small median (ms) | p90 (ms) | / alone | bulk goodput (Mbit/s) |", "|---|---|---|---|---|"]
        for p in con["phases"]:
            med = next(q["median_s"] for q in con["phases"] if q["repeat"] == p["repeat"] and q["kind"] == "alone")
            med, alone = p["median_s"], med
            bulk = f"{p['bulk_goodput_mbit']:.1f}" if "bulk_goodput_mbit" in p else "-"
            lines.append(f"| {p['phase']} | {1e3 * med:.1f} | {1e3 * p['p90_s']:.1f} | {med / alone:.2f} | {bulk} |"
                         if med and alone else f"| {p['phase']} | - | - | - | - |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", choices=["all", "loopback", "netns", "contention"], default="all")
    ap.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    ap.add_argument("--keep-logs", help="copy the ranks' NCCL_DEBUG logs into this directory")
    ap.add_argument("--rate-mbit", type=float, default=100.0, help="HTB link rate of the shaped veth")
    ap.add_argument("--small-mib", type=float, default=1.0)
    ap.add_argument("--bulk-mib", type=float, default=32.0)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3, help="rounds of the three contention phases")
    ap.add_argument("--cpu-rehearsal", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    global CPU_REHEARSAL
    CPU_REHEARSAL = args.cpu_rehearsal
    try:
        import torch
    except ImportError:
        print("torch is not installed", file=sys.stderr)
        return 2
    if not CPU_REHEARSAL and not torch.cuda.is_available():
        print("no CUDA GPU / CUDA build of torch: nothing to check", file=sys.stderr)
        return 2
    from flowsched import ncclhook

    build_dir = ncclhook.build()
    keep = Path(args.keep_logs) if args.keep_logs else None
    gpu = not CPU_REHEARSAL
    report: dict = {"date": datetime.date.today().isoformat(),
                    "device": torch.cuda.get_device_name(0) if gpu else "CPU rehearsal (gloo, no NCCL)",
                    "nccl_version": ".".join(map(str, torch.cuda.nccl.version())) if gpu else "none", "torch": torch.__version__,
                    "command": "python csrc/tests/gpu_nccl_check.py " + " ".join(sys.argv[1:]), "scenarios": {}}
    wanted = ["loopback", "netns", "contention"] if args.scenario == "all" else [args.scenario]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for name in wanted:
            print(f"[gpu_nccl_check] {name}", flush=True)
            t0 = time.monotonic()
            try:
                if name == "loopback":
                    sc = scenario_loopback(tmp, build_dir, keep)
                elif name == "netns":
                    sc = scenario_netns(tmp, build_dir, keep, NETNS_RATE_MBIT)
                else:
                    sc = scenario_contention(tmp, build_dir, keep, args.rate_mbit, args.small_mib, args.bulk_mib, args.iters, args.repeats)
            except (RuntimeError, TimeoutError, OSError, ncclhook.NcclHookError) as e:
                sc = {"error": f"{type(e).__name__}: {e}", "checks": {}}
            sc["seconds"] = round(time.monotonic() - t0, 1)
            report["scenarios"][name] = sc
            for k, v in sc["checks"].items():
                print(f"{'PASS' if v else 'FAIL'} {name}.{k}", flush=True)
            if "error" in sc:
                print(f"FAIL {name}: {sc['error']}", flush=True)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ncclhook_gpu.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "ncclhook_gpu.md").write_text(markdown(report))
    print(markdown(report))
    passed = all(sc["checks"] and all(sc["checks"].values()) and "error" not in sc for sc in report["scenarios"].values())
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
