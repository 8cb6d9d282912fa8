"""Planner output, jobs files, traces and their importers, the CLI (placement.planner/traces/cli)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import topology
from netweave.cli import main
from placement.planner import launch_lines, loads_jobs, plan_jobs, rank_order
from placement.profiles import JobSpec
from placement.traces import TraceJob, dumps_trace, loads_trace, read_pai, read_philly, synthetic_trace
from topology.errors import InputError

DATA = Path(__file__).resolve().parents[1] / "placement" / "data"


def test_rank_order_is_host_major_and_rail_aligned(cluster):
    gpus = ["node1/gpu3", "node0/gpu7", "node1/gpu0", "node0/gpu0"]
    assert rank_order(cluster, gpus) == ["node1/gpu0", "node1/gpu3", "node0/gpu0", "node0/gpu7"]


def test_plan_places_jobs_with_launch_lines(cluster):
    jobs = [JobSpec("a", 16, tp=8, grad_bytes=1e9), JobSpec("b", 8, grad_bytes=1e8), JobSpec("c", 4)]
    plan = plan_jobs(cluster, jobs, policy="hived+cassini")
    assert plan["placed"] == 3 and plan["unplaced"] == 0
    a = plan["jobs"][0]
    assert a["hosts"] == ["node0", "node1"] and a["cuda_visible_devices"] == {"node0": "0,1,2,3,4,5,6,7", "node1": "0,1,2,3,4,5,6,7"}
    # tensor-parallel groups = consecutive ranks on one host; data-parallel peers share a local index (rail)
    ranks = a["ranks"]
    assert {g.split("/")[0] for g, r in ranks.items() if r < 8} == {"node0"}
    per_host = a["launch"]["per_host"]
    assert [h["node_rank"] for h in per_host] == [0, 1]
    assert "--nnodes=2" in per_host[1]["command"] and "--master-addr=node0" in per_host[1]["command"]
    assert a["launch"]["slurm_hostfile"].splitlines() == ["node0"] * 8 + ["node1"] * 8
    all_gpus = [g for j in plan["jobs"] for g in j["gpus"]]
    assert len(all_gpus) == len(set(all_gpus)) == 28


def test_unplaceable_job_gets_a_reason(cluster):
    plan = plan_jobs(cluster, [JobSpec("big", 24), JobSpec("huge", 16)], policy="hived")
    assert plan["jobs"][1]["placed"] is False
    assert plan["jobs"][1]["reason"]["resource"] == "gpus" and plan["jobs"][1]["reason"]["level"] == "hostx2"
    # first-fit reports the idle count; TP wider than a host is refused naming the NVLink domain
    plan = plan_jobs(cluster, [JobSpec("wide", 16, tp=16)], policy="first-fit")
    assert plan["jobs"][0]["reason"]["resource"] == "nvlink-domain"


def test_cassini_shifts_interleave_jobs_that_share_uplinks():
    topo = topology.build_cluster(4, hosts_per_su=2, oversubscription=4)
    jobs = [JobSpec("a", 12, compute_s=0.02, grad_bytes=1e9), JobSpec("b", 12, compute_s=0.02, grad_bytes=1e9)]
    plan = plan_jobs(topo, jobs, policy="hived+cassini")
    assert plan["placed"] == 2
    shifts = [j["start_offset_s"] for j in plan["jobs"]]
    if plan["cassini"]["shared_links"]:
        assert shifts[0] != shifts[1]
    assert plan["cassini"]["min_link_score"] <= 1.0


def test_launch_lines_for_uneven_hosts(cluster):
    ordered = cluster.gpus()[:12]
    out = launch_lines(cluster, JobSpec("x", 12), ordered, 0.005)
    assert [h["cuda_visible_devices"] for h in out["per_host"]] == ["0,1,2,3,4,5,6,7", "0,1,2,3"]
    assert "NETWEAVE_START_OFFSET_S=0.005000" in out["per_host"][0]["command"]


@pytest.mark.parametrize("text, where", [
    ("jobs: [{name: a}]", "jobs[0].gpus"),
    ("jobs: [{name: a, gpus: 4, tp: 3}]", "jobs[0].tp"),
    ("jobs: [{name: a, gpus: 4, grad_bytes: lots}]", "jobs[0].grad_bytes"),
    ("jobs: [{name: a, gpus: 4, colour: red}]", "jobs[0].colour"),
    ("jobs: [{name: a, gpus: 4}, {name: a, gpus: 2}]", "jobs[1].name"),
    ("jobs: [{name: a, gpus: 4, vc: nope}]", "jobs[0].vc"),
    ("jobs: []", "jobs"),
    ("jobs: [{name: a, gpus: 4, compute_ms: -1}]", "jobs[0].compute_ms"),
])
def test_jobs_file_errors_name_the_field(text, where):
    with pytest.raises(InputError) as exc:
        loads_jobs(text, source="jobs.yaml")
    assert where in str(exc.value) and "jobs.yaml" in str(exc.value)


def test_jobs_file_units_and_defaults():
    jobs, vcs = loads_jobs('{"virtual_clusters": {"v": {"host": 1}}, "defaults": {"compute_ms": 50}, '
                           '"jobs": [{"name": "a", "gpus": 8, "grad_bytes": "2GB", "vc": "v"}, {"name": "b", "gpus": 1, "compute_s": "5ms"}]}')
    assert vcs == {"v": {"host": 1}}
    assert jobs[0].grad_bytes == 2e9 and jobs[0].compute_s == pytest.approx(0.05) and jobs[0].vc == "v"
    assert jobs[1].compute_s == pytest.approx(0.005)


def test_trace_round_trip_csv_and_json():
    jobs = synthetic_trace(30, seed=4, network_heavy=0.3)
    for fmt in ("csv", "json"):
        assert loads_trace(dumps_trace(jobs, fmt)) == sorted(jobs, key=lambda j: (j.arrival_s, j.name))


def test_trace_errors_name_line_and_column():
    with pytest.raises(InputError, match="line 3.gpus"):
        loads_trace("name,arrival_s,gpus,duration_s\na,0,1,10\nb,1,x,10\n", source="t.csv")
    with pytest.raises(InputError, match="lacks duration_s"):
        loads_trace("name,arrival_s,gpus\na,0,1\n")
    with pytest.raises(InputError, match="tp=3 must divide"):
        loads_trace('[{"name": "a", "arrival_s": 0, "gpus": 4, "duration_s": 1, "tp": 3}]')


def test_philly_and_pai_importers():
    philly = read_philly(DATA / "philly_sample.json", seed=1)
    # the job killed in the queue has no attempt and is skipped; the retried job uses its last attempt (2 hosts x 8)
    assert [j.gpus for j in philly] == [4, 16, 2, 8]
    assert philly[0].arrival_s == 0.0 and philly[1].duration_s == 7200.0 and philly[1].vc == "6214e9"
    pai = read_pai(DATA / "pai_task_sample.csv", seed=1)
    # 50% of one GPU rounds up to 1; 8 x 100% = 8; 2 x 400% = 8; a task without plan_gpu or end_time is skipped
    assert [j.gpus for j in pai] == [1, 8, 8, 16]
    assert pai[1].duration_s == 4200.0


def test_synthetic_trace_is_seeded():
    assert synthetic_trace(50, seed=7) == synthetic_trace(50, seed=7)
    assert synthetic_trace(50, seed=7) != synthetic_trace(50, seed=8)
    assert isinstance(synthetic_trace(1)[0], TraceJob)


def test_cli_plan_cells_check_trace(tmp_path, capsys):
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text("virtual_clusters: {r: {host: 2}}\njobs:\n  - {name: a, gpus: 16, grad_bytes: 1GB, vc: r}\n  - {name: b, gpus: 4}\n")
    out = tmp_path / "plan.json"
    assert main(["place", "--topology", "default", "--jobs", str(jobs), "--out", str(out), "--json", "--hostfiles", str(tmp_path / "hf")]) == 0
    plan = json.loads(out.read_text())
    assert plan["placed"] == 2 and json.loads(capsys.readouterr().out)["placed"] == 2
    assert (tmp_path / "hf" / "a.hostfile").read_text().count("\n") == 16
    assert main(["place", "cells", "--topology", "default", "--json"]) == 0
    assert "H100-SXM5-80GB" in json.loads(capsys.readouterr().out)
    assert main(["place", "check", "--topology", "default", "--jobs", str(jobs), "--fail", "node0", "--fail", "node1", "--fail", "node2"]) == 1
    assert "DEGRADED" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("virtual_clusters: {r: {host: 5}}\njobs: [{name: a, gpus: 1}]\n")
    assert main(["place", "check", "--topology", "default", "--jobs", str(bad)]) == 2
    assert "level 'host' is short of 1 cell(s)" in capsys.readouterr().err
    trace = tmp_path / "t.csv"
    assert main(["place", "trace", "--synthetic", "20", "--out", str(trace)]) == 0
    assert len(loads_trace(trace.read_text())) == 20
    assert main(["place", "trace", "--philly", str(DATA / "philly_sample.json"), "--out", str(tmp_path / "p.json")]) == 0


def test_demo_places_jobs_and_shifts_help(tmp_path, cluster):
    from placement.demo import demo

    report, text = demo(cluster, tmp_path)
    assert report["plan"]["placed"] == 4 and "torchrun" in text
    assert (tmp_path / "plan.json").exists() and "gpt.hostfile" in report["files"]
    for e in report["iteration_times"].values():
        assert e["shifted_ms"] <= e["unshifted_ms"] + 1e-9 and e["shifted_ms"] >= e["solo_ms"] - 1e-9
    # the replay: every policy finishes every job that fits the cluster; LAS (preemptive) queues least, HiveD fragments less than first-fit
    rep = report["replay"]
    assert set(rep) == {"fifo", "las", "hived", "hived+cassini"}
    assert len({m["finished"] for m in rep.values()}) == 1 and rep["fifo"]["finished"] >= 110
    assert all(m["finished"] + m["unfinished"] == 120 for m in rep.values())
    assert rep["las"]["avg_queue_s"] <= rep["fifo"]["avg_queue_s"] and rep["hived"]["fragmentation"] < rep["fifo"]["fragmentation"]
    assert "replay_jct.png" in report["files"]
    json.dumps(report, default=str)
