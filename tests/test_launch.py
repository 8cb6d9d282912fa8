"""``netweave launch`` end to end: bundles on the default (InfiniBand) cluster and on a TCP-only one, the scripts run
with torchrun and srun replaced by stubs, modes, atomic replacement, and every bad input as one line and exit 2."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from flowsched import ncclhook
from netweave.cli import main
from netweave.runtime import plan as jp
from topology.fabrics import star
from topology.io import write_topology

GPT_SMALL = {"layers": 8, "hidden": 1024, "heads": 8, "seq_len": 1024, "vocab": 32000}


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture
def work(tmp_path):
    write(tmp_path / "train.py", "print('hello')\n")
    return tmp_path


def launch(capsys, *argv: str) -> dict:
    assert main(["launch", *argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` and beside it (a leftover staging directory would show), with its bytes."""
    out = {}
    for p in sorted(root.parent.rglob("*")):
        if p.is_file():
            out[str(p.relative_to(root.parent))] = p.read_bytes()
        elif p.is_dir():
            out[str(p.relative_to(root.parent)) + "/"] = b""
    return out


def stub_bin(tmp_path: Path) -> Path:
    """A PATH directory whose ``torchrun`` prints its argv and the launch environment as one JSON line."""
    d = tmp_path / "stubbin"
    d.mkdir(exist_ok=True)
    keys = ["NETWEAVE_JOB_PLAN", "CUDA_VISIBLE_DEVICES", "NCCL_NET", "NCCL_NET_PLUGIN", "NETWEAVE_PLAN", "NCCL_IB_TC", "NCCL_IB_SL",
            "LD_PRELOAD", "NETWEAVE_DSCP", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_TUNER_PLUGIN", "SLURMD_NODENAME"]
    write(d / "torchrun", f"""#!{sys.executable}
import json, os, sys
print(json.dumps({{"argv": sys.argv[1:], "env": {{k: os.environ[k] for k in {keys!r} if k in os.environ}}}}))
""")
    os.chmod(d / "torchrun", 0o755)
    return d


def run_script(script: Path, tmp_path: Path, **env: str) -> dict:
    full = {**os.environ, "PATH": f"{stub_bin(tmp_path)}:{os.environ['PATH']}", **env}
    full.pop("LD_PRELOAD", None)
    res = subprocess.run(["bash", str(script)], env=full, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------ default (IB) --
def test_default_cluster_two_jobs_sharing_a_first_host(work, capsys):
    """Two 4-GPU jobs land on node0: one master host, two ports. IB fabric: NCCL keeps its transport, class on NCCL_IB_TC/SL."""
    jobs = write(work / "jobs.yaml", f"""
jobs:
  - {{name: a, gpus: 4, script: train.py, args: [--lr, "3e-4", --name, "two words"], grad_bytes: 1GB}}
  - {{name: b, gpus: 4, script: train.py, model: {json.dumps(GPT_SMALL)}, data_parallel: prophet}}
""")
    old = os.umask(0o027)
    try:
        data = launch(capsys, "--topology", "default", "--jobs", str(jobs), "--out", str(work / "out"))
    finally:
        os.umask(old)
    out = work / "out"
    plans = {j: jp.load(out / j / "plan.json") for j in ("a", "b")}
    assert [plans[j].hosts[0].host for j in "ab"] == ["node0", "node0"]
    assert plans["a"].rendezvous.addr == plans["b"].rendezvous.addr == "node0"
    assert plans["a"].rendezvous.port != plans["b"].rendezvous.port
    assert {j["job"] for j in data["jobs"]} == {"a", "b"} and data["transport"] == "ib"
    # the file modes follow the umask (027): plans 0640, scripts 0750, directories 0750
    assert stat.S_IMODE((out / "a" / "plan.json").stat().st_mode) == 0o640
    assert stat.S_IMODE((out / "a" / "launch-node0.sh").stat().st_mode) == 0o750
    assert stat.S_IMODE((out / "a").stat().st_mode) == stat.S_IMODE(out.stat().st_mode) == 0o750
    for script in out.rglob("*.sh"):
        assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    assert subprocess.run(["bash", "-n", str(out / "a" / "job.sbatch")]).returncode == 0
    # plan.json round-trips; the in-job plan was tuned on the model; both jobs got a class, the DSCP is the class's
    b = plans["b"]
    assert jp.loads(jp.dumps(b)) == b
    assert b.data_parallel.policy == "prophet" and b.data_parallel.params["tuned"] and b.data_parallel.partition_bytes > 0
    assert b.traffic.dscp == 8 * b.traffic.traffic_class and b.traffic.traffic_class == 7 - b.traffic.priority
    assert b.period_s > 0 and b.prediction["iteration_s"] == b.period_s and b.provenance["transport"] == "ib"
    assert plans["a"].period_s is None and plans["a"].prediction["iteration_s"] > 0   # no model, no compute time: not paced
    # running a launch script: the exact torchrun argv and environment
    ran = run_script(out / "a" / "launch-node0.sh", work)
    assert ran["argv"] == ["--nnodes=1", "--nproc-per-node=4", "--node-rank=0", "--master-addr=node0",
                           f"--master-port={plans['a'].rendezvous.port}", str(work / "train.py"), "--lr", "3e-4", "--name", "two words"]
    env = ran["env"]
    assert env["NETWEAVE_JOB_PLAN"] == str(out / "a" / "plan.json") and env["CUDA_VISIBLE_DEVICES"] == plans["a"].hosts[0].cuda_visible_devices
    assert env["NCCL_IB_TC"] == str(plans["a"].traffic.dscp << 2) and env["NCCL_IB_SL"] == str(plans["a"].traffic.traffic_class)
    assert "NCCL_NET" not in env and "NCCL_NET_PLUGIN" not in env and "LD_PRELOAD" not in env


def test_bundle_can_be_copied_and_overridden(work, capsys):
    jobs = write(work / "jobs.yaml", "jobs: [{name: a, gpus: 16, script: train.py, compute_ms: 40, grad_bytes: 1GB}]\n")
    launch(capsys, "--topology", "default", "--jobs", str(jobs), "--out", str(work / "out"), "--address", "node0=10.1.0.1",
           "--ifname", "ib0")
    moved = work / "elsewhere" / "a"
    shutil.copytree(work / "out" / "a", moved)
    ran = run_script(moved / "launch-node1.sh", work)
    assert ran["env"]["NETWEAVE_JOB_PLAN"] == str(moved / "plan.json")     # found relative to the script
    assert "--master-addr=10.1.0.1" in ran["argv"] and "--node-rank=1" in ran["argv"]
    assert ran["env"]["GLOO_SOCKET_IFNAME"] == "ib0" and ran["env"]["NCCL_SOCKET_IFNAME"] == "=ib0"
    ran = run_script(moved / "launch-node1.sh", work, NETWEAVE_MASTER_ADDR="127.0.0.1", NETWEAVE_MASTER_PORT="40000", NETWEAVE_IFNAME="")
    assert "--master-addr=127.0.0.1" in ran["argv"] and "--master-port=40000" in ran["argv"] and "GLOO_SOCKET_IFNAME" not in ran["env"]
    plan = jp.load(moved / "plan.json")
    assert plan.rendezvous.addr == "10.1.0.1"
    assert plan.period_s == pytest.approx(0.040 + plan.prediction["comm_s"]) and plan.prediction["comm_s"] > 0   # compute, then the all-reduce


def test_sbatch_under_fake_slurm_gives_the_plans_node_ranks(work, capsys):
    """srun (a stub) starts the tasks in Slurm's sorted node order, reversed here: each host still gets its plan node rank."""
    jobs = write(work / "jobs.yaml", "jobs: [{name: big, gpus: 24, script: train.py, args: [--x]}]\n")
    launch(capsys, "--topology", "default", "--jobs", str(jobs), "--out", str(work / "out"))
    plan = jp.load(work / "out" / "big" / "plan.json")
    bindir = stub_bin(work)
    write(bindir / "srun", """#!/usr/bin/env bash
# fake srun: one task per --nodelist host (in reverse order), SLURMD_NODENAME/SLURM_NODEID set as slurmstepd does
nodes=""; args=()
for a in "$@"; do case "$a" in --nodelist=*) nodes="${a#--nodelist=}";; --*) ;; *) args+=("$a");; esac; done
IFS=, read -ra hosts <<< "$nodes"
for ((i=${#hosts[@]}-1; i>=0; i--)); do SLURMD_NODENAME="${hosts[$i]}" SLURM_NODEID=$i SLURM_PROCID=$i "${args[@]}" || exit $?; done
""")
    os.chmod(bindir / "srun", 0o755)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "SLURM_NNODES": str(len(plan.hosts))}
    copy = shutil.copy(work / "out" / "big" / "job.sbatch", work / "spool-copy.sbatch")   # sbatch runs a copy from its spool
    res = subprocess.run(["bash", copy], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    runs = [json.loads(line) for line in res.stdout.splitlines()]
    got = {r["env"]["SLURMD_NODENAME"]: r["argv"] for r in runs}
    assert set(got) == {h.host for h in plan.hosts}
    for h in plan.hosts:
        assert f"--node-rank={h.node_rank}" in got[h.host] and f"--nnodes={len(plan.hosts)}" in got[h.host]
    assert all(r["env"]["NETWEAVE_JOB_PLAN"] == str(work / "out" / "big" / "plan.json") for r in runs)
    # Slurm giving another node count is refused on one line
    res = subprocess.run(["bash", copy], env={**env, "SLURM_NNODES": "2"}, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "needs 3 nodes" in res.stderr
    assert (work / "out" / "big" / "hostfile").read_text().splitlines() == [r.host for r in plan.ranks]


# ------------------------------------------------------------------------------------------ TCP fabric --
def test_tcp_cluster_uses_the_net_plugin_and_the_marker(work, capsys):
    """On a TCP-only cluster (no ConnectX NICs) NCCL jobs load the netweave net plugin with a plan carrying the job's class;
    gloo jobs get the LD_PRELOAD marker with the job's DSCP. Two jobs, each on two hosts."""
    write_topology(star(4), work / "star.json")
    jobs = write(work / "jobs.yaml", """
addresses: {n0: 127.0.0.1}
jobs:
  - {name: nccljob, gpus: 2, script: train.py, grad_bytes: 500MB}
  - {name: gloojob, gpus: 2, script: train.py, grad_bytes: 50MB, backend: gloo}
""")
    data = launch(capsys, "--topology", str(work / "star.json"), "--jobs", str(jobs), "--out", str(work / "out"))
    assert data["transport"] == "tcp"
    out = work / "out"
    nccl_plan, gloo_plan = jp.load(out / "nccljob" / "plan.json"), jp.load(out / "gloojob" / "plan.json")
    assert len(nccl_plan.hosts) == len(gloo_plan.hosts) == 2
    assert nccl_plan.traffic.priority != gloo_plan.traffic.priority    # Sincronia: the smaller coflow first, in its own class
    assert gloo_plan.traffic.priority < nccl_plan.traffic.priority
    host = nccl_plan.hosts[1].host
    env = run_script(out / "nccljob" / f"launch-{host}.sh", work)["env"]
    assert env["NCCL_NET"] == "netweave" and env["NCCL_NET_PLUGIN"].endswith(ncclhook.PLUGIN_LIB)
    assert os.path.exists(env["NCCL_NET_PLUGIN"]) and "NCCL_IB_TC" not in env
    plugin_plan = ncclhook.read_plan(env["NETWEAVE_PLAN"])
    cls = nccl_plan.traffic.traffic_class
    assert plugin_plan.resolve(None, order=0) == plugin_plan.resolve(cls) and plugin_plan.resolve(cls)["dscp"] == nccl_plan.traffic.dscp
    genv = run_script(out / "gloojob" / f"launch-{gloo_plan.hosts[0].host}.sh", work)["env"]
    assert genv["LD_PRELOAD"].endswith(ncclhook.MARK_LIB) and genv["NETWEAVE_DSCP"] == str(gloo_plan.traffic.dscp)
    assert "NCCL_NET" not in genv
    assert json.loads((out / "flows.json").read_text())["order"] == ["gloojob", "nccljob"]
    for script in [*out.rglob("*.sh"), *out.rglob("*.sbatch")]:
        assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0


# ------------------------------------------------------------------------------------------ pipelines --
def test_pipeline_job_carries_stages_recompute_and_schedule(work, capsys):
    jobs = write(work / "jobs.yaml", f"""
jobs:
  - {{name: p1, gpus: 4, pp: 2, microbatches: 4, schedule: 1f1b, script: train.py, model: {json.dumps(GPT_SMALL)}}}
  - {{name: p2, gpus: 4, pp: 4, microbatches: 8, schedule: zbh1, script: train.py, model: {json.dumps(GPT_SMALL)}}}
""")
    launch(capsys, "--topology", "default", "--jobs", str(jobs), "--out", str(work / "out"))
    p1, p2 = (jp.load(work / "out" / j / "plan.json") for j in ("p1", "p2"))
    assert p1.parallelism == jp.Parallelism(2, 1, 2) and p1.pipeline.torch_class == "Schedule1F1B" and p1.pipeline.actions_csv is None
    assert [s.rank for s in p1.pipeline.stages] == [0, 1] and p1.pipeline.stages[-1].layers[1] == GPT_SMALL["layers"] + 2
    assert p2.pipeline.torch_class is None and len(p2.pipeline.actions_csv.splitlines()) == 4   # ZB-H1: torch's CSV, a row per rank
    assert all(s.recompute in jp.RECOMPUTE for s in p2.pipeline.stages)
    assert p1.period_s >= p1.pipeline.predicted_iteration_s > 0


def test_parallelism_auto_picks_the_smallest_pipeline_that_fits(work, capsys):
    """A 16-layer, 8192-wide GPT has ~206 GB of model states: it fits on no single H100, so auto pipelines it."""
    from netweave.launch import _pipeline_plan
    from placement.planner import load_jobs_file
    from topology import default_cluster

    big = {"layers": 16, "hidden": 8192, "heads": 64, "seq_len": 2048, "vocab": 32000}
    jobs = write(work / "jobs.yaml", f"jobs: [{{name: big, gpus: 16, parallelism: auto, microbatches: 16, script: train.py, "
                                     f"model: {json.dumps(big)}}}]\n")
    launch(capsys, "--topology", "default", "--jobs", str(jobs), "--out", str(work / "out"))
    p = jp.load(work / "out" / "big" / "plan.json")
    assert p.parallelism.pp > 1 and p.parallelism.dp * p.parallelism.pp == 16 and p.provenance["parallelism"] == "auto"
    spec = load_jobs_file(jobs).jobs[0]
    from pipesched.profile import analytic_profile, config_from_dict

    prof = analytic_profile(config_from_dict(big))
    topo = default_cluster()
    for smaller in (d for d in range(1, p.parallelism.pp) if 16 % d == 0):   # brute force: every smaller depth fails
        with pytest.raises(Exception, match="cannot be split"):
            _pipeline_plan(topo, spec, prof, topo.gpus()[:smaller], 0, str(jobs), pp=smaller)


# ------------------------------------------------------------------------------------------ atomic writes --
def test_second_run_replaces_a_job_directory(work, capsys):
    jobs = write(work / "jobs.yaml", "jobs: [{name: a, gpus: 8, script: train.py}, {name: b, gpus: 8, script: train.py}]\n")
    launch(capsys, "--topology", "default", "--jobs", str(jobs), "--out", str(work / "out"))
    write(work / "out" / "a" / "stale-file", "from an older plan")
    write(work / "jobs.yaml", "jobs: [{name: a, gpus: 16, script: train.py}]\n")
    launch(capsys, "--topology", "default", "--jobs", str(jobs), "--out", str(work / "out"))
    assert not (work / "out" / "a" / "stale-file").exists() and jp.load(work / "out" / "a" / "plan.json").world_size == 16
    assert (work / "out" / "b" / "plan.json").exists()                       # other jobs' bundles are left alone
    assert sorted(p.name for p in work.iterdir() if p.name.startswith(".")) == []   # no staging directory left beside DIR


def test_exchange_swaps_two_directories(tmp_path):
    from netweave.launch import _replace

    (tmp_path / "new").mkdir()
    write(tmp_path / "new" / "f", "new")
    (tmp_path / "old").mkdir()
    write(tmp_path / "old" / "f", "old")
    _replace(tmp_path / "new", tmp_path / "old")
    assert (tmp_path / "old" / "f").read_text() == "new" and not (tmp_path / "new").exists()


# ------------------------------------------------------------------------------------------ bad input --
BAD = [
    ("jobs: [{name: a, gpus: 8, dp: 3, script: train.py}]", "jobs[0].dp: dp*tp*pp = 3*1*1 = 3, expected gpus=8"),
    ("jobs: [{name: a, gpus: 8, pp: 3, script: train.py}]", "jobs[0].pp: tp*pp = 1*3 = 3 does not divide gpus=8"),
    ("jobs: [{name: a, gpus: 8, script: missing.py}]", "jobs[0].script: no such file"),
    ("jobs: [{name: a, gpus: 8}]", "jobs[0].script: expected the training script"),
    ("jobs: [{name: a, gpus: 16, pp: 16, script: train.py, model: {layers: 4, hidden: 256, heads: 4, seq_len: 128, vocab: 1000}}]",
     "jobs[0].pp: pp = 16 stages but the model has 6 layers"),
    ("jobs: [{name: a, gpus: 8, pp: 2, script: train.py}]", "jobs[0].model: pp = 2 needs the job's model"),
    ("jobs: [{name: a, gpus: 8, script: train.py, model: {layers: 4}}]", "jobs[0].model"),
    ("jobs: [{name: ../evil, gpus: 8, script: train.py}]", "jobs[0].name: expected a job name of letters, digits"),
    ("jobs: [{name: a, gpus: 8, script: train.py, data_parallel: {policy: magic}}]", "jobs[0].data_parallel.policy"),
    ("jobs: [{name: a, gpus: 64, script: train.py}]", "jobs[0].gpus: job 'a' cannot be placed"),
    ("addresses: {node0: 'a b'}\njobs: [{name: a, gpus: 8, script: train.py}]", "addresses.node0"),
]


@pytest.mark.parametrize("text,message", BAD)
def test_bad_jobs_file_is_one_line_exit_2_and_leaves_dir_as_it_was(work, capsys, text, message):
    good = write(work / "good.yaml", "jobs: [{name: a, gpus: 8, script: train.py}]\n")
    launch(capsys, "--topology", "default", "--jobs", str(good), "--out", str(work / "out"))
    jobs = write(work / "jobs.yaml", text + "\n")
    before = snapshot(work / "out")
    assert main(["launch", "--topology", "default", "--jobs", str(jobs), "--out", str(work / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("netweave: error: ") and message in err and "Traceback" not in err
    assert str(jobs) in err or "--out" in err or "addresses" in err
    assert snapshot(work / "out") == before


def test_bad_output_location_is_refused_before_planning(work, capsys):
    jobs = write(work / "jobs.yaml", "jobs: [{name: a, gpus: 8, script: train.py}]\n")
    write(work / "afile", "x")
    before = snapshot(work / "afile")
    for out, msg in ((work / "afile", "exists and is not a directory"), (work / "afile" / "sub", "does not exist or is not a directory"),
                     (work / "no" / "such" / "dir", "does not exist")):
        assert main(["launch", "--topology", "default", "--jobs", str(jobs), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--out" in err and msg in err
    assert snapshot(work / "afile") == before


def test_output_on_a_read_only_file_system_is_refused(work, capsys):
    """As root, permission bits do not stop a write; /proc does (read-only for new files)."""
    jobs = write(work / "jobs.yaml", "jobs: [{name: a, gpus: 8, script: train.py}]\n")
    assert main(["launch", "--topology", "default", "--jobs", str(jobs), "--out", "/proc/netweave-launch-out"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out" in err


# ------------------------------------------------------------------------------------------ place plan --
def test_place_plan_script_with_arguments_and_distinct_ports(work, capsys):
    jobs = write(work / "jobs.yaml", "jobs: [{name: a, gpus: 4}, {name: b, gpus: 4}, {name: c, gpus: 8, port: 29501}]\n")
    assert main(["place", "plan", "--topology", "default", "--jobs", str(jobs), "--script", "train.py --lr 3e-4 --tag 'x y'", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    ports = {j["name"]: j["launch"]["master_port"] for j in plan["jobs"]}
    assert len(set(ports.values())) == 3 and ports["c"] == 29501
    cmd = plan["jobs"][0]["launch"]["per_host"][0]["command"]
    assert cmd.endswith("train.py --lr 3e-4 --tag 'x y'") and f"--master-port={ports['a']}" in cmd


def test_demo_writes_one_launch_and_shows_its_scripts(tmp_path, capsys):
    assert main(["demo", "--only", "launch", "--out", str(tmp_path / "demo")]) == 0
    text = capsys.readouterr().out
    bundles = tmp_path / "demo" / "launch" / "bundles"
    plans = [jp.load(p) for p in sorted(bundles.glob("*/plan.json"))]
    assert len(plans) == 3 and "exec \"${NETWEAVE_TORCHRUN:-torchrun}\"" in text and "#SBATCH --nodelist=" in text
    by_host: dict[str, set[int]] = {}
    for p in plans:   # the demo's first two jobs share node0: distinct ports
        by_host.setdefault(p.rendezvous.addr, set()).add(p.rendezvous.port)
    assert sum(len(v) for v in by_host.values()) == 3 and len(by_host["node0"]) == 2
    assert any(p.pipeline is not None for p in plans)


# ------------------------------------------------------------------------------------------ fuzz --
_VALUES = [None, True, -1, 0, 3, 2.5, "", "x", "../x", "train.py", "4MiB", [], ["a"], [[1]], {}, {"layers": 2}, {"policy": "prophet"},
           {"policy": 7}, {"partition": "zz"}, "auto", "gloo", ["tuner", "nope"], 70000, "a b", b"\xff".decode("latin-1")]
_FIELDS = ["name", "gpus", "script", "args", "model", "dp", "tp", "pp", "parallelism", "microbatches", "schedule", "chunks",
           "data_parallel", "backend", "nccl_plugins", "port", "memory", "grad_bytes", "compute", "bogus"]


def test_any_jobs_file_is_planned_or_refused_with_an_input_error(tmp_path):
    """Random jobs-file entries (every launch field, values of every type): plan_launch succeeds or raises InputError; no other error."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    import topology
    from netweave.launch import plan_launch
    from placement.planner import loads_jobs_file
    from topology.errors import InputError

    write(tmp_path / "train.py", "")
    write(tmp_path / "bin.yaml", "\x00\xff\xfe garbage")
    topo = topology.default_cluster()
    base = {"name": "a", "gpus": 2, "script": "train.py"}
    entry = st.dictionaries(st.sampled_from(_FIELDS), st.sampled_from([*_VALUES, "bin.yaml"]), max_size=4).map(lambda d: {**base, **d})
    top = st.fixed_dictionaries({"jobs": st.lists(entry, min_size=1, max_size=2)},
                                optional={"addresses": st.sampled_from([{"node0": "10.0.0.1"}, {"node0": "a;b"}, [1], "x"]),
                                          "interfaces": st.sampled_from([{"*": "lo"}, {"*": "$(x)"}, 5])})

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(top)
    def check(doc):
        text = json.dumps(doc, default=str)
        try:
            plan_launch(topo, loads_jobs_file(text, source=str(tmp_path / "jobs.yaml")), jobs_source=str(tmp_path / "jobs.yaml"))
        except InputError as exc:
            assert "\n" not in str(exc)

    check()


def test_launch_carries_placements_cassini_shift_and_rank_order(work, capsys):
    """Differential: with link sharing forced (one buddy candidate), the bundles hold exactly what `place plan` computes
    for the same jobs file: GPUs in rank order, CASSINI's non-zero shift, the master host and port."""
    jobs = write(work / "jobs.yaml", """
jobs:
  - {name: gpt, gpus: 12, compute_s: 0.030, grad_bytes: 3e9, script: train.py}
  - {name: bert, gpus: 12, compute_s: 0.030, grad_bytes: 3e9, script: train.py}
  - {name: resnet, gpus: 4, compute_s: 0.050, grad_bytes: 1e8, script: train.py}
""")
    assert main(["place", "plan", "--topology", "default", "--jobs", str(jobs), "--candidates", "1", "--json"]) == 0
    placed = {j["name"]: j for j in json.loads(capsys.readouterr().out)["jobs"]}
    launch(capsys, "--topology", "default", "--jobs", str(jobs), "--out", str(work / "out"), "--candidates", "1")
    shifts = []
    for name, row in placed.items():
        p = jp.load(work / "out" / name / "plan.json")
        assert [r.device for r in p.ranks] == row["gpus"] and p.start_offset_s == pytest.approx(row["start_offset_s"])
        assert (p.rendezvous.addr, p.rendezvous.port) == (row["launch"]["master_addr"], row["launch"]["master_port"])
        assert p.period_s == pytest.approx(row["iteration_s"])
        shifts.append(p.start_offset_s)
    assert max(shifts) > 0
