"""One rank of a NCCL job for the GPU checks (run by gpu_nccl_check.py, often under `ip netns exec`).

The rank reads its settings from a JSON file (argv[1]) and writes a JSON report to its "out" path:

* ``mode: "check"``: one process group per entry of ``classes`` (the first is the default group; an entry
  is the NCCL ``trafficClass`` set through ``ProcessGroupNCCL.Options().config.traffic_class``, or
  ``null`` for none); all-reduces of every size in ``sizes`` on each group, each checked for the exact
  sum; then the IP_TOS / SO_PRIORITY of every connected TCP socket of the process (the plugin's live here).
* ``mode: "latency"``: after ``warmup`` all-reduces of ``sizes[0]`` elements, creates ``ready``, waits for
  ``go``, then times ``iters`` all-reduces (host clock around the call and a sync of the current stream).
* ``mode: "bulk"``: all-reduces of ``sizes[0]`` elements back to back until ``stop`` exists; after each one
  the ranks agree on stopping with a one-element all-reduce, so every rank leaves after the same operation.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path


def socket_marks() -> list[dict[str, int]]:
    """IP_TOS / SO_PRIORITY of every connected TCP socket of this process."""
    out = []
    for fd_name in os.listdir("/proc/self/fd"):
        try:
            s = socket.socket(fileno=os.dup(int(fd_name)))
        except OSError:
            continue
        try:
            if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                peer = s.getpeername()
            except OSError:
                continue
            out.append({"fd": int(fd_name), "tos": s.getsockopt(socket.IPPROTO_IP, socket.IP_TOS),
                        "prio": s.getsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY), "port": s.getsockname()[1],
                        "peer_port": peer[1]})
        finally:
            s.close()
    return out


def _options(traffic_class):
    import torch.distributed as dist

    if traffic_class is None:
        return None
    opts = dist.ProcessGroupNCCL.Options()
    opts.config.traffic_class = int(traffic_class)
    return opts


def _wait_for(path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear in {timeout:.0f} s")
        time.sleep(0.01)


def main() -> None:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    import torch
    import torch.distributed as dist

    # gloo on the CPU rehearses the orchestration (namespaces, HTB, phases) where no GPU is lent
    cpu = cfg.get("cpu_rehearsal", False)
    if cpu:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", os.environ.get("NCCL_SOCKET_IFNAME", "lo"))
    else:
        torch.cuda.set_device(0)
    rank, world = cfg["rank"], cfg["world"]
    classes = cfg.get("classes", [None])
    options = (lambda c: None) if cpu else _options
    t0 = time.perf_counter()
    dist.init_process_group("gloo" if cpu else "nccl", init_method=f"tcp://{cfg['master']}:{cfg['port']}", rank=rank,
                            world_size=world, pg_options=options(classes[0]))
    groups = [None] + [dist.new_group(list(range(world)), pg_options=options(c)) for c in classes[1:]]
    report: dict = {"rank": rank, "classes": classes, "torch": torch.__version__,
                    "nccl_version": None if cpu else ".".join(map(str, torch.cuda.nccl.version())),
                    "device": "cpu" if cpu else torch.cuda.get_device_name(0)}
    want = world * (world + 1) / 2  # rank r contributes r + 1
    dev = "cpu" if cpu else "cuda"
    sync = (lambda: None) if cpu else torch.cuda.current_stream().synchronize
    if cfg["mode"] == "check":
        results = []
        for gi, g in enumerate(groups):
            for n in cfg["sizes"]:
                t = torch.full((n,), float(rank + 1), device=dev)
                dist.all_reduce(t, group=g)
                sync()
                results.append({"group": gi, "traffic_class": classes[gi], "elements": n, "correct": bool(torch.all(t == want).item())})
        report["init_and_check_s"] = time.perf_counter() - t0
        report["allreduce"] = results
        report["marks"] = socket_marks()
    elif cfg["mode"] == "latency":
        t = torch.ones(cfg["sizes"][0], device=dev)
        for _ in range(cfg.get("warmup", 5)):
            dist.all_reduce(t)
        sync()
        Path(cfg["ready"]).touch()
        _wait_for(cfg["go"], 300)
        lat, correct = [], True
        for _ in range(cfg["iters"]):
            t.fill_(float(rank + 1))
            sync()
            start = time.perf_counter()
            dist.all_reduce(t)
            sync()
            lat.append(time.perf_counter() - start)
            correct &= bool(torch.all(t == want).item())
        report.update(latency_s=lat, correct=correct, bytes=4 * cfg["sizes"][0])
    elif cfg["mode"] == "bulk":
        t = torch.ones(cfg["sizes"][0], device=dev)
        flag = torch.zeros(1, device=dev)
        dist.all_reduce(t)
        sync()
        Path(cfg["ready"]).touch()
        ops, start = 0, time.perf_counter()
        while True:
            dist.all_reduce(t)
            ops += 1
            flag.fill_(1.0 if os.path.exists(cfg["stop"]) else 0.0)
            dist.all_reduce(flag)
            if flag.item() > 0:
                break
        report.update(ops=ops, seconds=time.perf_counter() - start, bytes=4 * cfg["sizes"][0])
    else:
        raise SystemExit(f"{sys.argv[1]}: mode must be check, latency or bulk, got {cfg['mode']!r}")
    Path(cfg["out"]).write_text(json.dumps(report))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (NCCL/CUDA atexit hooks can hang with several ranks on one GPU)


if __name__ == "__main__":
    main()
