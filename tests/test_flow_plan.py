"""flowsched.plan: file format round trips, malformed files, builders, workload extraction, NCCL plugin plan conversion."""

import json
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emu.htb import dscp_for_priority
from emu.workload import Job, Workload
from flowsched import ncclhook
from flowsched.coflow import Coflow, Flow, parrot_rates, sincronia_order
from flowsched.plan import (
    FlowPlan,
    FlowPlanError,
    FlowRule,
    HostPlan,
    class_table,
    dumps_plan,
    host_capacities,
    job_coflows,
    loads_plan,
    nccl_class,
    phase_flows,
    plan_from_bands,
    plan_from_order,
    plan_from_parrot,
    plan_from_workload,
    read_plan,
    skb_priority,
    to_nccl_plan,
    write_nccl_plan,
    write_plan,
)


@st.composite
def plans(draw):
    hosts = {}
    for h in range(draw(st.integers(0, 3))):
        rules, seen = [], set()
        for _ in range(draw(st.integers(0, 5))):
            r = FlowRule(
                job=draw(st.sampled_from(["a", "b", "job-c"])), priority=draw(st.integers(0, 7)),
                rate=draw(st.one_of(st.none(), st.floats(1.0, 1e12))), tensor=draw(st.one_of(st.none(), st.sampled_from(["l0", "l1"]))),
                comm=draw(st.one_of(st.none(), st.sampled_from(["order:0", "order:3", "comm:0x1f"]))),
                peer=draw(st.one_of(st.none(), st.sampled_from(["node1", "node2"]))), port=draw(st.one_of(st.none(), st.integers(1, 65535))),
            )
            if r.selector not in seen:
                seen.add(r.selector)
                rules.append(r)
        hosts[f"node{h}"] = HostPlan(rules, draw(st.one_of(st.none(), st.floats(1e6, 1e12))))
    return FlowPlan(hosts, draw(st.integers(0, 10**6)), draw(st.sampled_from(["sincronia", "parrot", ""])),
                    draw(st.one_of(st.none(), st.just(["a", "b"]))), {"note": draw(st.text(max_size=5))})


@settings(max_examples=40, deadline=None)
@given(plans())
def test_json_round_trip(plan):
    text = dumps_plan(plan)
    assert loads_plan(text) == plan
    assert dumps_plan(loads_plan(text)) == text


def test_file_round_trip_and_default_dscp(tmp_path):
    plan = plan_from_order(["x", "y", "z"], {"x": ["n0"], "y": ["n0", "n1"], "z": ["n1"]}, classes=3, epoch=4, link_rates={"n0": 5e10})
    path = write_plan(plan, tmp_path / "p.json")
    back = read_plan(path)
    assert back == plan and back.hosts["n0"].link_rate == 5e10 and back.hosts["n1"].link_rate is None
    assert all(r.dscp == dscp_for_priority(r.priority) for hp in back.hosts.values() for r in hp.rules)
    assert json.loads(path.read_text())["format"] == "netweave-flow-plan"


GOOD = {"format": "netweave-flow-plan", "version": 1, "epoch": 1, "policy": "p",
        "hosts": {"n0": {"link_rate": 1e9, "rules": [{"job": "a", "priority": 0, "dscp": 56}, {"job": "b", "priority": 1}]}}}


@pytest.mark.parametrize(("mutate", "field"), [
    (lambda d: d.update(format="other"), "format"),
    (lambda d: d.update(version=2), "version"),
    (lambda d: d.update(epoch=-1), "epoch"),
    (lambda d: d.update(extra=1), "extra"),
    (lambda d: d.update(hosts=[]), "hosts"),
    (lambda d: d["hosts"]["n0"].update(link_rate=0), "hosts.n0.link_rate"),
    (lambda d: d["hosts"]["n0"].update(rules={}), "hosts.n0.rules"),
    (lambda d: d["hosts"]["n0"]["rules"][0].update(priority=8), "hosts.n0.rules[0].priority"),
    (lambda d: d["hosts"]["n0"]["rules"][0].update(priority=True), "hosts.n0.rules[0].priority"),
    (lambda d: d["hosts"]["n0"]["rules"][0].pop("job"), "hosts.n0.rules[0].job"),
    (lambda d: d["hosts"]["n0"]["rules"][0].update(dscp=64), "hosts.n0.rules[0].dscp"),
    (lambda d: d["hosts"]["n0"]["rules"][1].update(dscp=56), "hosts.n0.rules[1].dscp"),  # class 0's DSCP on class 1
    (lambda d: d["hosts"]["n0"]["rules"][0].update(rate=-5), "hosts.n0.rules[0].rate"),
    (lambda d: d["hosts"]["n0"]["rules"][0].update(comm="order:x"), "hosts.n0.rules[0].comm"),
    (lambda d: d["hosts"]["n0"]["rules"][0].update(port=70000), "hosts.n0.rules[0].port"),
    (lambda d: d["hosts"]["n0"]["rules"][0].update(colour="red"), "hosts.n0.rules[0].colour"),
    (lambda d: d["hosts"]["n0"]["rules"].append({"job": "a", "priority": 3}), "hosts.n0.rules[2]"),  # duplicate selector
    (lambda d: d["hosts"].update(n1={"rules": [{"job": "c", "priority": 0, "dscp": 46}]}), "hosts.n1.rules[0].dscp"),  # 2 DSCPs, 1 class
])
def test_malformed_files_name_the_field(tmp_path, mutate, field):
    data = json.loads(json.dumps(GOOD))
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(FlowPlanError) as exc:
        read_plan(path)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"{path}: {field}")


def test_not_json_names_the_line(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{\n "format": \n')
    with pytest.raises(FlowPlanError, match=r"x\.json: line \d+: invalid JSON"):
        read_plan(path)


def test_order_bands_share_classes_in_order():
    for n in range(1, 20):
        jobs = [f"j{i}" for i in range(n)]
        plan = plan_from_order(jobs, {j: ["h"] for j in jobs})
        prios = [r.priority for r in plan.hosts["h"].rules]
        assert prios == sorted(prios) and prios[0] == 0 and max(prios) <= 7
        assert len(set(prios)) == min(n, 8)  # as many classes as possible, never inverting the order
    with pytest.raises(FlowPlanError, match="job_hosts"):
        plan_from_order(["a"], {})


def test_parrot_plan_rates_respect_ports_and_make_class_ceilings():
    rng = random.Random(3)
    for _ in range(20):
        coflows = []
        for j in range(rng.randint(2, 5)):
            flows = [Flow(f"h{s}", f"h{t}", float(rng.randint(1, 9))) for s, t in (rng.sample(range(4), 2) for _ in range(rng.randint(1, 3)))]
            coflows.append(Coflow(f"job{j}", flows))
        remaining = {c.name: rng.uniform(1, 10) for c in coflows}
        alloc = parrot_rates(coflows, remaining, 10.0, floor=0.05)
        plan = plan_from_parrot(alloc, coflows, link_rates={f"h{i}": 10.0 for i in range(4)})
        for h, hp in plan.hosts.items():
            out = sum(r.rate for r in hp.rules)
            assert out <= 10.0 * (1 + 1e-6)  # no egress port is oversubscribed
            for p, spec in class_table(plan, h).items():
                assert math.isclose(spec.ceil, sum(r.rate for r in hp.rules if r.priority == p))
            for r in hp.rules:
                want = sum(alloc.flow_rate(r.job, f) for c in coflows if c.name == r.job for f in c.flows if f.src == h and f.dst == r.peer)
                assert math.isclose(r.rate, want)
                assert r.priority == (0 if r.job == alloc.srpt_job else 1)
        ins = {}
        for hp in plan.hosts.values():
            for r in hp.rules:
                ins[r.peer] = ins.get(r.peer, 0.0) + r.rate
        assert all(v <= 10.0 * (1 + 1e-6) for v in ins.values())


def test_geryon_bands_are_monotone_equal_bytes_and_merge():
    sizes = [1, 1, 2, 4, 8, 16]
    tensors = [f"l{i}" for i in range(6)]
    plan = plan_from_bands("a", tensors, ["h0", "h1"], sizes=sizes, classes=4, first_class=2)
    prios = [r.priority for r in plan.hosts["h0"].rules]
    assert prios == sorted(prios) and prios[0] == 2 and max(prios) <= 7
    base = plan_from_order(["b"], {"b": ["h0"]})
    merged = plan_from_bands("a", tensors, ["h0"], sizes=sizes, into=base, epoch=9)
    assert merged.epoch == 9 and {r.job for r in merged.hosts["h0"].rules} == {"a", "b"} and base.hosts["h0"].rules == [FlowRule("b", 0)]


def test_workload_flows_match_ring_closed_form(cluster):
    g = {h: cluster.gpus(h) for h in cluster.hosts()}
    w = Workload("w", [Job.data_parallel("two", g["node0"][:4] + g["node1"][:4], compute_s=0.01, nbytes=8e8),
                       Job.data_parallel("three", g["node0"][4:] + g["node1"][4:] + g["node2"][:4], compute_s=0.01, nbytes=2.4e9),
                       Job.data_parallel("local", g["node3"], compute_s=0.01, nbytes=1e9)])
    # ring all-reduce: every ring edge carries 2(n-1)/n x S; one edge crosses each host boundary
    assert phase_flows(w, cluster, "two") == {("node0", "node1"): 2 * 7 / 8 * 8e8, ("node1", "node0"): 2 * 7 / 8 * 8e8}
    assert all(math.isclose(b, 2 * 11 / 12 * 2.4e9) for b in phase_flows(w, cluster, "three").values())
    assert phase_flows(w, cluster, "local") == {}
    coflows = job_coflows(w, cluster)
    assert [c.name for c in coflows] == ["two", "three"]  # the single-server job never reaches the network
    egress, ingress = host_capacities(cluster)
    assert egress["node0"] == ingress["node0"] == 8 * 50e9  # 8 x 400 Gb/s NICs
    d = plan_from_workload(w, cluster, "sincronia", epoch=2)
    cap = {**{("out", h): c for h, c in egress.items()}, **{("in", h): c for h, c in ingress.items()}}
    assert d.order == sincronia_order(coflows, cap) == ["two", "three"]
    assert set(d.plan.hosts) == {"node0", "node1", "node2"} and d.plan.epoch == 2
    assert {r.job for r in d.plan.hosts["node2"].rules} == {"three"}
    for policy in ("parrot", "geryon", "fair"):
        dd = plan_from_workload(w, cluster, policy)
        assert loads_plan(dumps_plan(dd.plan)) == dd.plan and set(dd.plan.jobs()) == {"two", "three"}
    geryon = plan_from_workload(w, cluster, "geryon").plan
    assert all(r.tensor == "allreduce" for hp in geryon.hosts.values() for r in hp.rules)
    with pytest.raises(FlowPlanError, match="policy"):
        plan_from_workload(w, cluster, "random")


def test_nccl_plan_marks_agree_with_the_htb_classes(tmp_path):
    plan = FlowPlan({"h": HostPlan([FlowRule("a", 0), FlowRule("b", 2, rate=3e6, peer="x"), FlowRule("b", 2, rate=3e6, peer="y"),
                                    FlowRule("c", 5, dscp=46, comm="order:2", rate=1e6), FlowRule("g", 6, port=29500),
                                    FlowRule("d", 3, rate=1e6, peer="x"), FlowRule("d", 3, rate=2e6, peer="y")])})
    nccl = to_nccl_plan(plan, "h")
    for p in (0, 2, 3, 5, 6):
        k = nccl_class(p)
        assert k == 7 - p and nccl.classes[k].prio == skb_priority(p) == 0x10010 + p
    for p, dscp in ((0, 56), (2, 40), (5, 46), (6, 8)):
        # the plugin resolves trafficClass 7-p to the same DSCP the HTB filters send to class p
        assert nccl.resolve(nccl_class(p))["dscp"] == dscp
    assert ncclhook.FlowPlan().resolve(nccl_class(0))["dscp"] == dscp_for_priority(0)
    assert nccl.classes[nccl_class(2)].rate == 3_000_000 and nccl.classes[nccl_class(3)].rate is None  # unequal rates: HTB ceiling only
    assert nccl.comms == [ncclhook.CommRule("order", 2, nccl_class(5), ncclhook.ClassMark(rate=1_000_000))]
    assert nccl.marks == [ncclhook.MarkRule(29500, 8, skb_priority(6))]
    path = write_nccl_plan(plan, "h", tmp_path / "h.plan")
    assert ncclhook.read_plan(path) == nccl
    assert to_nccl_plan(plan, "h", so_priority=False).classes[7].prio is None
    with pytest.raises(FlowPlanError, match="no host"):
        to_nccl_plan(plan, "other")


# -- command line ----------------------------------------------------------------------------------------


def test_cli_plan_apply_profile_schedule(tmp_path, capsys, cluster):
    from emu.workload import write_workload
    from flowsched.demo import contending_workload
    from netweave.cli import main
    from topology.io import write_topology

    write_topology(cluster, tmp_path / "topo.json")
    write_workload(contending_workload(cluster), tmp_path / "w.yaml")
    out = tmp_path / "p.json"
    assert main(["flow", "plan", "--workload", str(tmp_path / "w.yaml"), "--topology", str(tmp_path / "topo.json"), "--policy", "sincronia",
                 "--out", str(out), "--nccl-plan", str(tmp_path / "nccl"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    plan = read_plan(out)
    assert data["order"] == plan.order and data["classes"] == plan.job_priority()
    assert ncclhook.read_plan(tmp_path / "nccl" / "node0.plan") == to_nccl_plan(plan, "node0")
    assert main(["flow", "apply", str(out), "--host", "node0", "--dev", "veth9", "--rate-mbit", "100", "--dry-run"]) == 0
    from flowsched.enforce import host_tc_commands

    assert capsys.readouterr().out.splitlines() == [f"tc {x}" for x in host_tc_commands(plan, "node0", "veth9", rate_mbit=100)]
    assert main(["flow", "apply", str(out), "--host", "nope", "--dry-run"]) == 2
    assert "no host 'nope'" in capsys.readouterr().err
    prof = tmp_path / "prof.json"
    assert main(["flow", "profile", "--out", str(prof), "--iterations", "1", "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)
    assert measured["format"] == "netweave-gradient-profile" and len(measured["names"]) == 6
    results = {}
    for policy in ("ddp", "prophet", "bytescheduler"):
        assert main(["flow", "schedule", "--profile", str(prof), "--policy", policy, "--bandwidth", "0.5", "--json"]) == 0
        results[policy] = json.loads(capsys.readouterr().out)
        assert results[policy]["iteration_s"] >= results[policy]["lower_bound_s"] * (1 - 1e-9)
    assert len({r["lower_bound_s"] for r in results.values()}) == 1
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "netweave-flow-plan", "version": 1, "hosts": {"h": {"rules": [{"job": "a", "priority": 12}]}}}')
    assert main(["flow", "apply", str(bad), "--host", "h", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "hosts.h.rules[0].priority" in err


def test_demo_writes_plans_and_orders_policies_against_bounds(tmp_path, cluster):
    from flowsched.demo import demo

    report, text = demo(cluster, tmp_path)
    json.dumps(report)
    in_job = report["in_job"]
    for d in in_job["policies"].values():
        assert d["iteration_s"] >= in_job["lower_bound_s"] * (1 - 1e-9)
    cross = report["cross_job"]["sincronia"]
    assert cross["total_cct_s"] >= cross["lower_bound_s"] * (1 - 1e-9)
    plan = read_plan(tmp_path / "flow_plan.json")
    assert plan.order == cross["order"] and plan.policy == "sincronia"
    assert read_plan(tmp_path / "flow_plan_parrot.json").policy == "parrot"
    host = report["cross_job"]["tc_host"]
    assert ncclhook.read_plan(tmp_path / f"{host}.nccl.plan") == to_nccl_plan(plan, host)
    assert "Sincronia order" in text and "tc qdisc replace" in text
    # the host's plan loaded into the plugin: every socket of its most urgent job carries that class's marks
    hook = report["nccl_hook"]
    t = hook["transfer"]
    assert t["bytes"] == t["expected_bytes"] > 0
    urgent = min(plan.rules(host), key=lambda r: r.priority)
    assert hook["traffic_class"] == 7 - urgent.priority
    assert {(m["tos"] >> 2, m["prio"]) for m in t["marks"]["sender"] + t["marks"]["receiver"]} == {(urgent.dscp, 0x10010 + urgent.priority)}
    assert "NCCL hook" in text


def test_documented_example_is_a_valid_plan():
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "flowsched.md").read_text()
    example = text.split("```json\n", 1)[1].split("```", 1)[0]
    plan = loads_plan(example, source="docs/flowsched.md")
    assert loads_plan(dumps_plan(plan)) == plan
    assert class_table(plan, "node0")[0].ceil == 3.8e11 and class_table(plan, "node0")[3].ceil is None
