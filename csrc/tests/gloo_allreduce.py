"""One rank of a 2-rank gloo all-reduce (run under `ip netns exec`, optionally with the
LD_PRELOAD marker). Rank 0 snapshots the HTB class counters of --tc-dev right before and
after the timed all-reduces and writes a JSON report to --out.
Usage: gloo_allreduce.py RANK MASTER_ADDR PORT IFNAME NUMEL ITERS OUT [TC_DEV]"""

import json
import os
import subprocess
import sys
import time


def class_bytes(dev):
    if not dev:
        return {}
    out = subprocess.run(["tc", "-s", "class", "show", "dev", dev], capture_output=True, text=True).stdout
    result, current = {}, None
    for line in out.splitlines():
        parts = line.split()
        if parts[:2] == ["class", "htb"]:
            current = parts[2]
        elif parts[:1] == ["Sent"] and current:
            result[current] = int(parts[1])
            current = None
    return result


def main():
    rank, master, port, ifname, numel, iters, out = sys.argv[1:8]
    tc_dev = sys.argv[8] if len(sys.argv) > 8 else ""
    rank, numel, iters = int(rank), int(numel), int(iters)
    os.environ["GLOO_SOCKET_IFNAME"] = ifname
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=2)
    t = torch.full((numel,), float(rank + 1))
    dist.barrier()
    before = class_bytes(tc_dev)
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t)
    elapsed = time.perf_counter() - t0
    after = class_bytes(tc_dev)
    expected = 3.0 * 2 ** (iters - 1)
    report = {"rank": rank, "elapsed_s": elapsed, "numel": numel, "iters": iters, "correct": bool(torch.all(t == expected)),
              "class_bytes": {k: after.get(k, 0) - before.get(k, 0) for k in after}}
    dist.barrier()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
