"""Two jobs from one ``netweave launch`` output, started at the same time by their written launch scripts alone inside
Mininet hosts: real torchrun, real gloo traffic through HTB-shaped emulated links (root + Mininet; tests/conftest.py).

The cluster: three one-NIC servers on one leaf; ``n0`` and ``n2`` hold one "GPU", ``n1`` two. The GPUs carry two
models (HiveD chains ``a`` and ``b``), so the data-parallel job (chain ``a``) lands on ``n0, n1`` and the pipeline job
(chain ``b``) on ``n1, n2``: the jobs share ``n1``'s link, and CASSINI shifts the pipeline's start. The NICs are
10 Mbit/s (0.00125 GB/s) and the emulation runs at time scale 1 (:func:`emu.net.plan_network` maps 0.00125 GB/s to a
10 Mbit/s HTB tree), so the plan's seconds are wall seconds. The model descriptions say what the jobs run
(``examples/train_transformer.py``: fp32, the rows per micro-batch, a CPU of about 4 GFLOP/s at half efficiency).

Shown: job ``dp`` (the example transformer with ``nn.MultiheadAttention`` through the runtime's Prophet hook) ends
with every parameter equal to plain DDP's from the same seed and data; job ``pipe`` (2 stages, the first recomputed)
lowers its loss; the packets each job's hosts send carry the job's DSCP (scapy on the switch side of each host's
veth: ``n0``'s link carries ``dp`` only, ``n2``'s ``pipe`` only, ``n1``'s both, told apart by the peer's address)
and the bytes go through the job's HTB class; the pipeline's first activation crosses the wire after its start
offset, within the tolerance stated at the check.

Run: ``sudo .venv/bin/python -m pytest -q tests/test_launch_emulation.py``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from emu.htb import NUM_PRIORITIES
from emu.mininet_backend import stop_processes, wait_for_ranks
from emu.net import EmulatedNetwork, plan_network
from netweave.cli import main
from netweave.runtime import plan as jp
from topology import LinkKind, NodeKind, SwitchTier, Topology
from topology.io import write_topology

pytestmark = pytest.mark.emulation

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "train_transformer.py"
NIC_GBS = 0.00125            # 10 Mbit/s: bandwidth-bound for the 120 kB of gradients per step
PREFIX = "nwl"               # names of the emulated hosts, bridges and veths (nwlh0, nwls0-eth1, ...)
DP_STEPS, PIPE_STEPS = 4, 5
DP_ARGS = ["--width", "32", "--batch", "8"]
PIPE_ARGS = ["--width", "128", "--batch", "16"]
#: the example's models as the planner sees them: fp32, the rows of one micro-batch, the CPU's speed
DP_MODEL = "{layers: 2, hidden: 32, heads: 4, seq_len: 16, vocab: 64, dtype: fp32, tflops: 0.004, microbatch_size: 8}"
PIPE_MODEL = "{layers: 2, hidden: 128, heads: 4, seq_len: 16, vocab: 64, dtype: fp32, tflops: 0.004, microbatch_size: 4}"


def shared_link_cluster(nic_gbs: float = NIC_GBS) -> Topology:
    """Three servers on one leaf: ``n0`` (GPU of chain a), ``n1`` (a and b), ``n2`` (b)."""
    t = Topology("launch-emu3", builder={"kind": "custom", "note": "tests/test_launch_emulation.py"})
    t.add_node("leaf", NodeKind.SWITCH, tier=SwitchTier.LEAF)
    for host, chains in {"n0": ["a"], "n1": ["a", "b"], "n2": ["b"]}.items():
        t.add_node(f"{host}/nic0", NodeKind.NIC, host=host, index=0, rail=0)
        t.add_link(f"{host}/nic0", "leaf", LinkKind.NETWORK, nic_gbs)
        for k, chain in enumerate(chains):
            t.add_node(f"{host}/gpu{k}", NodeKind.GPU, host=host, index=k, model=chain)
            t.add_link(f"{host}/gpu{k}", f"{host}/nic0", LinkKind.PCIE, 64.0)
    return t


def jobs_yaml(results: Path, addresses: dict[str, str], interfaces: dict[str, str]) -> str:
    """The jobs file: both jobs run ``examples/train_transformer.py``; address map and interfaces per host (docs/launch.md)."""
    def flow(d: dict[str, str]) -> str:
        return "{" + ", ".join(f"{k}: {v}" for k, v in d.items()) + "}"

    def args(extra: list[str], steps: int, name: str, params: bool) -> str:
        a = [*extra, "--steps", str(steps), "--out", f"{results}/{name}-{{rank}}.json"]
        if params:
            a += ["--params-out", f"{results}/{name}-params-{{rank}}.pt"]
        return "[" + ", ".join(json.dumps(x) for x in a) + "]"

    return f"""
addresses: {flow(addresses)}
interfaces: {flow(interfaces)}
jobs:
  - name: dp
    gpus: 2
    gpu_model: a
    backend: gloo
    script: {EXAMPLE}
    args: {args(DP_ARGS, DP_STEPS, "dp", True)}
    model: {DP_MODEL}
    data_parallel: {{policy: prophet}}
  - name: pipe
    gpus: 2
    gpu_model: b
    pp: 2
    microbatches: 4
    schedule: 1f1b
    memory: 4000000         # bytes per device: the planner recomputes the first stage (full), not the second
    backend: gloo
    script: {EXAMPLE}
    args: {args(PIPE_ARGS, PIPE_STEPS, "pipe", False)}
    model: {PIPE_MODEL}
"""


def plain_ddp_reference(steps: int, world: int, *, width: int = 32, rows: int = 8, lr: float = 0.1, seed: int = 0) -> dict:
    """What plain DDP computes for the example: the same initial model on every rank, each rank's gradient on its own
    batch, averaged over the ranks (DDP's all-reduce hook), one SGD step; here the ranks' gradients are summed in one
    process and divided by the world size."""
    import torch

    spec = importlib.util.spec_from_file_location("train_transformer", EXAMPLE)
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    model = ex.build_model(width=width, depth=2, vocab=64, seq=16, seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        for r in range(world):
            x, y = ex.batch(step, rows=rows, seq=16, vocab=64, seed=seed, rank=r)
            ex.loss_fn(model(x), y).backward()
        for p in model.parameters():
            p.grad /= world
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class Capture:
    """Every TCP packet on the given switch-side veths: (time, device, src, dst, DSCP, payload bytes), kept small."""

    def __init__(self, devices: list[str]):
        from scapy.all import AsyncSniffer, conf

        conf.ifaces.reload()  # this run's veths are new
        self.rows: list[tuple[float, str, str, str, int, int]] = []
        self.sniffer = AsyncSniffer(iface=devices, store=False, prn=self._keep)

    def _keep(self, pkt) -> None:
        from scapy.all import IP, TCP

        if IP in pkt and TCP in pkt:
            ip = pkt[IP]
            self.rows.append((float(pkt.time), pkt.sniffed_on, ip.src, ip.dst, ip.tos >> 2, len(pkt[TCP].payload)))

    def __enter__(self) -> Capture:
        self.sniffer.start()
        time.sleep(1.0)  # the sniffer's thread opens the sockets
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(1.0)  # scapy decodes in Python and lags behind the wire
        if self.sniffer.running:
            self.sniffer.stop()


def test_two_jobs_from_one_launch_in_mininet(tmp_path):
    import torch

    topo = shared_link_cluster()
    write_topology(topo, tmp_path / "cluster.json")
    net_plan = plan_network(topo, time_scale=1, prefix=PREFIX)
    assert {i.topo_host: i.rate_mbit for i in net_plan.interfaces} == pytest.approx({"n0": 10.0, "n1": 10.0, "n2": 10.0})
    ip = {i.topo_host: i.ip for i in net_plan.interfaces}
    res = tmp_path / "results"
    res.mkdir()
    (tmp_path / "jobs.yaml").write_text(jobs_yaml(res, ip, {i.topo_host: i.dev for i in net_plan.interfaces}))
    assert main(["launch", "--topology", str(tmp_path / "cluster.json"), "--jobs", str(tmp_path / "jobs.yaml"), "--out", str(tmp_path / "out")]) == 0
    plans = {j: jp.load(tmp_path / "out" / j / "plan.json") for j in ("dp", "pipe")}
    assert [h.host for h in plans["dp"].hosts] == ["n0", "n1"] and [h.host for h in plans["pipe"].hosts] == ["n1", "n2"]
    assert [s.recompute for s in plans["pipe"].pipeline.stages] == ["full", "none"]
    assert plans["dp"].start_offset_s == 0.0 and plans["pipe"].start_offset_s > 0.1   # CASSINI shifted the second job
    assert plans["dp"].traffic.dscp != plans["pipe"].traffic.dscp

    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("LD_PRELOAD", None)
    emu_host = {i.topo_host: i.host for i in net_plan.interfaces}
    procs, logs = [], []
    with EmulatedNetwork(net_plan) as net:
        assert net.verify_htb()["ok"]
        before = net.class_counters()
        with Capture([i.switch_dev for i in net_plan.interfaces]) as cap, contextlib.ExitStack() as files:
            try:
                for job, plan in plans.items():   # all four scripts at once, as written; nothing else is passed
                    for h in plan.hosts:
                        logs.append(tmp_path / f"{job}-{h.host}.log")
                        log = files.enter_context(open(logs[-1], "w"))
                        procs.append(net.popen(emu_host[h.host], ["bash", str(tmp_path / "out" / job / f"launch-{h.host}.sh")],
                                               env=env, stdout=log, stderr=subprocess.STDOUT))
                wait_for_ranks(procs, logs, 300, what="the two launched jobs")
            finally:
                stop_processes(procs)
        after = net.class_counters()
    (tmp_path / "capture.json").write_text(json.dumps(cap.rows))   # for a failed run's post-mortem

    # job dp: trained through the runtime's hook, every parameter equals plain DDP's
    dp = [json.loads((res / f"dp-{r}.json").read_text()) for r in range(2)]
    assert all(r["mode"] == "data_parallel" and r["comm_plan"] == "prophet" for r in dp)
    want = plain_ddp_reference(DP_STEPS, 2)
    for r in range(2):
        got = torch.load(res / f"dp-params-{r}.pt")
        assert sorted(got) == sorted(want) and any("in_proj_weight" in n for n in got)
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=1e-5, msg=f"rank {r}: {name}")
    # job pipe: two stages, the first recomputed, the loss falls
    pipe = [json.loads((res / f"pipe-{r}.json").read_text()) for r in range(2)]
    assert all(r["mode"] == "pipeline" for r in pipe)
    losses = next(r["losses"] for r in pipe if r["losses"] and r["losses"][0] is not None)
    assert losses[-1] < losses[0]

    # each job's packets carry its class: on n0's link only dp talks, on n2's only pipe, on n1's both (told by the peer)
    job_of = {frozenset((ip["n0"], ip["n1"])): "dp", frozenset((ip["n1"], ip["n2"])): "pipe"}
    seen: dict[str, dict[int, int]] = {"dp": {}, "pipe": {}}
    for _t, _dev, src, dst, dscp, _n in cap.rows:
        job = job_of.get(frozenset((src, dst)))
        assert job is not None, f"a packet between {src} and {dst}: no job talks there"
        seen[job][dscp] = seen[job].get(dscp, 0) + 1
    for job, plan in plans.items():
        assert set(seen[job]) == {plan.traffic.dscp}, f"{job}: DSCPs {seen[job]} on the wire, plan says {plan.traffic.dscp}"
        assert sum(seen[job].values()) > 200
    # ... and went through the job's HTB class on each host's egress
    prio = {job: plan.traffic.priority for job, plan in plans.items()}

    def sent(host: str, p: int) -> int:
        dev = net_plan.interfaces_of(emu_host[host])[0].dev
        return after[dev][p]["sent_bytes"] - before.get(dev, {}).get(p, {}).get("sent_bytes", 0)

    assert sent("n0", prio["dp"]) > 2 * 60_000 and sent("n2", prio["pipe"]) > 60_000
    assert all(sent("n0", p) < 20_000 for p in range(NUM_PRIORITIES) if p != prio["dp"])
    assert all(sent("n2", p) < 20_000 for p in range(NUM_PRIORITIES) if p != prio["pipe"])

    # the shifted job starts at its offset. The runtime takes t0 (rank 0's wall clock, broadcast to the job's ranks: a
    # few small packets within milliseconds), then waits out start_offset_s; on the wire, the pipeline's link (n1 <-> n2)
    # is silent from t0 + 50 ms until the offset, and the first iteration's first packet (the schedule's shape
    # exchange, then the activations) follows the offset within 0.1 s: the sleep's wake-up and the first send of a
    # process on this loaded 2-core machine (measured 15 ms on a quiet one). Without the shift it would come at
    # t0 + ~10 ms, so the window tells an applied offset from none. Capture stamps and time.time() read the same
    # kernel clock (1 ms allowed for where each is taken).
    offset = plans["pipe"].start_offset_s
    t0 = pipe[0]["timing"]["t0"]
    assert all(r["timing"]["t0"] == t0 for r in pipe)
    assert offset <= pipe[0]["timing"]["first_start_s"] <= offset + 0.05
    after_t0 = sorted((t - t0, n) for t, _d, src, dst, _c, n in cap.rows if {src, dst} == {ip["n1"], ip["n2"]} and t > t0 + 0.05)
    assert after_t0, "no packet of the pipeline job after its t0"
    start = after_t0[0][0]
    assert offset - 0.001 <= start <= offset + 0.1, f"first packet {start:.3f} s after t0, offset {offset:.3f} s"
    first_activation = next(t for t, n in after_t0 if n > 1000)
    assert start <= first_activation <= pipe[0]["timing"]["first_start_s"] + max(r["iteration_s"][0] for r in pipe)
