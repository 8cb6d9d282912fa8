"""Two jobs from one ``netweave launch`` output, started by their written launch scripts alone: real torchrun, gloo on
this CPU, each job's two "hosts" on 127.0.0.1 through the address override. One job trains the example transformer
through the runtime's DDP hook (Prophet, split buckets), the other is a 2-stage pipeline whose first stage the planner
recomputes (a small memory budget). The LD_PRELOAD marker of each gloo job sets that job's DSCP on its sockets."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from netweave.cli import main
from netweave.runtime import plan as jp
from topology.fabrics import star
from topology.io import write_topology

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "train_transformer.py"
MODEL = '{layers: 2, hidden: 32, heads: 4, seq_len: 16, vocab: 64}'   # the example's --depth 2 --width 32


def two_free_ports() -> int:
    """A port p with p and p + 1 free on 127.0.0.1 (the launch gives consecutive ports)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p >= 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        return p
    raise RuntimeError("no two consecutive free ports")


@pytest.mark.skipif(not EXAMPLE.exists() or shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None,
                    reason="needs examples/train_transformer.py and torchrun")
def test_two_jobs_run_from_their_launch_scripts(tmp_path, capsys):
    write_topology(star(4), tmp_path / "star.json")     # 4 hosts, one "GPU" each, TCP fabric
    res = tmp_path / "results"
    res.mkdir()
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(f"""
addresses: {{n0: 127.0.0.1, n1: 127.0.0.1, n2: 127.0.0.1, n3: 127.0.0.1}}
interfaces: {{"*": lo}}
jobs:
  - name: dp
    gpus: 2
    backend: gloo
    script: {EXAMPLE}
    args: [--steps, "5", --out, "{res}/dp-{{rank}}.json"]
    model: {MODEL}
    data_parallel: {{policy: prophet, partition: 2KiB}}
  - name: pipe
    gpus: 2
    pp: 2
    microbatches: 4
    schedule: 1f1b
    memory: 275000          # bytes per GPU: the planner recomputes the first stage (full) and not the second
    backend: gloo
    script: {EXAMPLE}
    args: [--steps, "6", --out, "{res}/pipe-{{rank}}.json"]
    model: {MODEL}
""")
    port = two_free_ports()
    assert main(["launch", "--topology", str(tmp_path / "star.json"), "--jobs", str(jobs), "--out", str(tmp_path / "out"),
                 "--base-port", str(port)]) == 0
    capsys.readouterr()
    plans = {j: jp.load(tmp_path / "out" / j / "plan.json") for j in ("dp", "pipe")}
    assert {len(p.hosts) for p in plans.values()} == {2}
    assert [s.recompute for s in plans["pipe"].pipeline.stages] == ["full", "none"]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("LD_PRELOAD", None)
    procs = []
    with contextlib.ExitStack() as logs:
        try:
            for job, plan in plans.items():
                for h in plan.hosts:
                    log = logs.enter_context(open(tmp_path / f"{job}-{h.host}.log", "w"))
                    script = tmp_path / "out" / job / f"launch-{h.host}.sh"
                    job_env = {**env, "NETWEAVE_MARK_LOG": str(tmp_path / f"mark-{job}.log")}   # the socket marker's record
                    procs.append((job, h.host, subprocess.Popen(["bash", str(script)], env=job_env, stdout=log, stderr=subprocess.STDOUT)))
            for job, host, p in procs:
                rc = p.wait(timeout=300)
                assert rc == 0, f"{job} on {host}:\n" + (tmp_path / f"{job}-{host}.log").read_text()[-3000:]
        finally:
            for *_, p in procs:
                if p.poll() is None:
                    p.kill()
    dp = [json.loads((res / f"dp-{r}.json").read_text()) for r in range(2)]
    pipe = [json.loads((res / f"pipe-{r}.json").read_text()) for r in range(2)]
    assert all(r["mode"] == "data_parallel" and r["backend"] == "gloo" and r["comm_plan"] == "prophet" for r in dp)
    assert dp[0]["losses"][-1] < dp[0]["losses"][0]
    assert all(r["mode"] == "pipeline" for r in pipe)
    last = [r for r in pipe if r["losses"] and r["losses"][0] is not None][0]
    assert last["losses"][-1] < last["losses"][0]
    # each job's sockets (gloo, the TCPStore) carry that job's class: the marker set the plan's DSCP on every one of them
    assert plans["dp"].traffic.dscp != plans["pipe"].traffic.dscp
    for job, plan in plans.items():
        marks = [dict(kv.split("=") for kv in line.split()) for line in (tmp_path / f"mark-{job}.log").read_text().splitlines()]
        assert len(marks) >= 4 and {(m["dscp"], m["rc"]) for m in marks} == {(str(plan.traffic.dscp), "0")}
    for r, plan in ((dp[0], plans["dp"]), (pipe[0], plans["pipe"])):   # the runtime ran on the bundle's plan: offset and period
        t = r["timing"]
        assert t["start_offset_s"] == pytest.approx(plan.start_offset_s) and t["period_s"] == pytest.approx(plan.period_s)
        assert t["first_start_s"] >= plan.start_offset_s - 0.01
