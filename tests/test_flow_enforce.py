"""flowsched.enforce: generated tc batches (exact), socket marks, and (root) a real HTB tree in a netns pair."""

import json
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from emu.htb import HtbSpec, check_htb_tree, htb_tree_commands, leaf_classid
from emu.net import WIRE_OVERHEAD, plan_network
from emu.workload import Job, Workload
from flowsched.enforce import (
    EnforceError,
    apply_rule_to_socket,
    apply_tc,
    class_bytes,
    class_ceilings,
    host_tc_commands,
    mark_socket,
    network_tc_commands,
    pace_socket,
    socket_marks,
    tc_show,
    verify_tc,
)
from flowsched.plan import MAX_RATE, FlowPlan, FlowPlanError, FlowRule, HostPlan, plan_from_workload, skb_priority

REPO = Path(__file__).resolve().parent.parent


def test_host_batch_is_the_emu_tree_plus_ceilings_and_override_filters():
    plan = FlowPlan({"h0": HostPlan([FlowRule("a", 0, rate=2.5e6, peer="h1"), FlowRule("a", 0, rate=1.25e6, peer="h2"),
                                     FlowRule("b", 2, dscp=46), FlowRule("c", 5)], link_rate=12.5e6)})
    lines = host_tc_commands(plan, "h0", "veth0")
    tree = htb_tree_commands("veth0", 100.0)
    last_pref = max(int(x.split(" prio ")[1].split()[0]) for x in tree if x.startswith("filter add"))
    assert lines[:len(tree)] == tree
    assert lines[len(tree):] == [
        # class 0 carries 3.75e6 B/s = 30000 kbit; floor 1% of 100 Mbit; burst 1 ms of 100 Mbit
        "class change dev veth0 parent 1:1 classid 1:10 htb rate 1000kbit ceil 30000kbit burst 12500 cburst 12500 prio 0 quantum 1514",
        f"filter add dev veth0 parent 1: protocol ip prio {last_pref + 1} u32 match ip tos 0xb8 0xfc flowid 1:12",
    ]
    # an explicit rate and a time scale: 3.75e6 B/s / 10 * 1.0 = 3000 kbit on a 10 Mbit link
    scaled = host_tc_commands(plan, "h0", "veth0", rate_mbit=10.0, time_scale=10.0)
    assert "ceil 3000kbit" in scaled[len(tree)]


def test_ceilings_are_clipped_to_floor_and_link():
    big = FlowPlan({"h": HostPlan([FlowRule("a", 1, rate=1e12)], link_rate=1.25e6)})
    assert host_tc_commands(big, "h", "d") == htb_tree_commands("d", 10.0)  # above the link: no change
    tiny = FlowPlan({"h": HostPlan([FlowRule("a", 1, rate=1.0)], link_rate=1.25e6)})
    assert "ceil 100kbit" in host_tc_commands(tiny, "h", "d")[-1]  # clipped up to the 1% floor (100 kbit of 10 Mbit)


def test_missing_link_rate_names_the_field():
    plan = FlowPlan({"h": HostPlan([FlowRule("a", 1)])})
    with pytest.raises(EnforceError, match="rate_mbit"):
        host_tc_commands(plan, "h", "eth0")


def test_network_batches_scale_split_and_cap_switch_ports(cluster):
    gpus0, gpus1 = cluster.gpus("node0"), cluster.gpus("node1")
    w = Workload("w", [Job.data_parallel("a", gpus0[:4] + gpus1[:4], compute_s=0.01, nbytes=1e9),
                       Job.data_parallel("b", gpus0[4:] + gpus1[4:], compute_s=0.05, nbytes=2e9)])
    plan = plan_from_workload(w, cluster, "parrot").plan
    net = plan_network(cluster, time_scale=1000, hosts=["node0", "node1"])
    batches = network_tc_commands(plan, net)
    assert len(batches) == 2 * len(net.interfaces)
    by_dev = {b.dev: b for b in batches}
    for host, other in (("node0", "node1"), ("node1", "node0")):
        ifaces = net.interfaces_of(net.emu_host(host))
        for iface in ifaces:
            up_spec = HtbSpec(iface.dev, iface.rate_mbit * WIRE_OVERHEAD)
            down_spec = HtbSpec(iface.switch_dev, iface.rate_down_mbit * WIRE_OVERHEAD)
            want_up, want_down = [], []
            for p in (0, 1):
                out_rate = sum(r.rate for r in plan.hosts[host].rules if r.priority == p)
                in_rate = sum(r.rate for r in plan.hosts[other].rules if r.priority == p and r.peer == host)
                for rate, spec, want in ((out_rate, up_spec, want_up), (in_rate, down_spec, want_down)):
                    kbit = round(rate * 8 / 1000 / 1000 * WIRE_OVERHEAD / len(ifaces))  # real B/s -> emulated kbit, split over rails
                    assert 0 < kbit < spec.rate_kbit
                    want.append(f"class change dev {spec.dev} parent 1:1 classid {leaf_classid(p)} htb rate {spec.floor_kbit}kbit "
                                f"ceil {max(kbit, spec.floor_kbit)}kbit burst {spec.burst_bytes} cburst {spec.burst_bytes} prio {p} quantum 1514")
            assert [x for x in by_dev[iface.dev].lines if x.startswith("class change")] == want_up
            assert [x for x in by_dev[iface.switch_dev].lines if x.startswith("class change")] == want_down
            assert by_dev[iface.dev].where == iface.host and by_dev[iface.switch_dev].where is None


def test_socket_marks_and_pacing_read_back():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        assert mark_socket(s, 46, 3) == {"tos": 0xB8, "priority": 3}
        assert pace_socket(s, 1_000_000) == 1_000_000
        assert pace_socket(s, None) == 2**64 - 1
        assert socket_marks(s)["tos"] == 0xB8
    with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as s6:
        assert mark_socket(s6, 8)["tos"] == 32
    with pytest.raises(EnforceError, match="dscp"):
        mark_socket(socket.socket(), 64)


def test_apply_rule_picks_the_most_specific_rule():
    plan = FlowPlan({"h": HostPlan([FlowRule("a", 4), FlowRule("a", 1, rate=5e5, peer="x")])})
    with socket.socket() as s:
        out = apply_rule_to_socket(s, plan, "h", "a", peer="x", so_priority=False)
        assert out["tos"] == 48 << 2 and out["pacing"] == 500_000
    with socket.socket() as s:
        out = apply_rule_to_socket(s, plan, "h", "a", peer="y", so_priority=False)
        assert out["tos"] == 24 << 2 and "pacing" not in out
    with pytest.raises(EnforceError, match="no rule"):
        apply_rule_to_socket(socket.socket(), plan, "h", "zzz")


# -- root: a real tree in a network namespace pair ------------------------------------------------------

_SENDER = """
import json, socket, sys
from flowsched.enforce import mark_socket, pace_socket
dst, plan = sys.argv[1], json.loads(sys.argv[2])
out = {}
for dscp, prio, nbytes in plan:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    marks = mark_socket(s, dscp, prio)
    for _ in range(nbytes // 1000):
        s.sendto(b"x" * 1000, (dst, 9))
    out[str(dscp)] = marks
    s.close()
t = socket.socket(); out["pacing"] = pace_socket(t, 123456); t.close()
print(json.dumps(out))
"""


@pytest.fixture
def netns_pair():
    tag = uuid.uuid4().hex[:6]
    ns_a, ns_b, dev_a, dev_b = f"nwfa{tag}", f"nwfb{tag}", f"nwfa{tag}"[:15], f"nwfb{tag}"[:15]
    try:
        for cmd in (["ip", "netns", "add", ns_a], ["ip", "netns", "add", ns_b],
                    ["ip", "link", "add", dev_a, "netns", ns_a, "type", "veth", "peer", "name", dev_b, "netns", ns_b]):
            subprocess.run(cmd, check=True, capture_output=True)
        for ns, dev, addr in ((ns_a, dev_a, "10.231.0.1/24"), (ns_b, dev_b, "10.231.0.2/24")):
            for cmd in (["ip", "addr", "add", addr, "dev", dev], ["ip", "link", "set", dev, "up"], ["ip", "link", "set", "lo", "up"]):
                subprocess.run(["ip", "netns", "exec", ns, *cmd], check=True, capture_output=True)
        yield ns_a, dev_a, "10.231.0.2"
    finally:
        for ns in (ns_a, ns_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.emulation
def test_tree_applied_in_netns_counts_marked_traffic_per_class(netns_pair):
    ns, dev, dst = netns_pair
    plan = FlowPlan({"h": HostPlan([FlowRule("urgent", 0), FlowRule("paced", 2, rate=1.25e6, peer="x"), FlowRule("bulk", 5, dscp=46)],
                                   link_rate=12.5e6)})
    lines = host_tc_commands(plan, "h", dev)
    apply_tc(lines, dev, netns=ns)
    apply_tc(lines, dev, netns=ns)  # re-applying replaces the tree instead of failing on existing classes
    qdisc, classes, filters = (tc_show(dev, w, netns=ns, stats=False) for w in ("qdisc", "class", "filter"))
    problems = check_htb_tree(HtbSpec(dev, 100.0), qdisc, classes, filters)
    assert problems == [f"{dev}: class 1:12 ceil 10000000 bit/s, expected 100000000"]  # only the paced class differs
    ceil = class_ceilings(dev, netns=ns)
    assert ceil[2] == 10e6 and ceil[0] == ceil[5] == 100e6
    before = class_bytes(dev, netns=ns)
    sends = [[56, skb_priority(0), 30_000], [46, None, 20_000], [0, None, 10_000]]
    res = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", _SENDER, dst, json.dumps(sends)], capture_output=True,
                         text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=30)
    assert res.returncode == 0, res.stderr
    marks = json.loads(res.stdout)
    assert marks["56"] == {"tos": 56 << 2, "priority": skb_priority(0)} and marks["46"]["tos"] == 46 << 2
    assert marks["pacing"] == 123456
    after = class_bytes(dev, netns=ns)
    sent = {p: after[p]["sent_packets"] - before[p]["sent_packets"] for p in after}
    assert sent[0] >= 30 and sent[5] >= 20 and sent[7] >= 10  # CS7 -> class 0, DSCP 46 (override) -> class 5, unmarked -> 7
    assert sent[1] == sent[2] == sent[3] == sent[4] == sent[6] == 0


def test_rates_tc_cannot_install_are_refused_at_plan_time_with_the_limit():
    for where, plan in (("link_rate", FlowPlan({"h": HostPlan([FlowRule("a", 0)], link_rate=1e20)})),
                        ("rules[0].rate", FlowPlan({"h": HostPlan([FlowRule("a", 0, rate=MAX_RATE * 2)], link_rate=1e9)}))):
        with pytest.raises(FlowPlanError, match="<= 1000000000000 \\(the limit\\)") as exc:
            host_tc_commands(plan, "h", "eth0")
        assert exc.value.where.endswith(where)
    host_tc_commands(FlowPlan({"h": HostPlan([FlowRule("a", 0, rate=MAX_RATE)], link_rate=MAX_RATE)}), "h", "eth0")  # the bound itself
    with pytest.raises(EnforceError, match="interface name"):
        host_tc_commands(FlowPlan({"h": HostPlan([FlowRule("a", 0)], link_rate=1e9)}), "h", "lo\nqdisc del dev eth0 root")


def test_cli_apply_refuses_unenforceable_rates_and_device_names_on_one_line(tmp_path, capsys):
    from netweave.cli import main

    data = FlowPlan({"h": HostPlan([FlowRule("a", 0)], link_rate=12.5e6)}).to_dict()
    data["hosts"]["h"]["link_rate"] = 1e20
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    assert main(["flow", "apply", str(path), "--host", "h", "--dev", "eth0", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "link_rate" in err and "at most 1e12" in err and err.count("\n") == 1
    data["hosts"]["h"]["link_rate"] = 12.5e6
    path.write_text(json.dumps(data))
    assert main(["flow", "apply", str(path), "--host", "h", "--dev", "lo\nqdisc del dev eth0 root", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "interface name" in err and err.count("\n") == 1


def test_a_batch_must_name_only_its_device():
    with pytest.raises(EnforceError, match="does not name the device"):
        apply_tc(htb_tree_commands("eth0", 100.0) + ["qdisc del dev eth1 root"], "eth0")


@pytest.mark.emulation
def test_tc_accepts_a_tree_at_the_rate_bound(netns_pair):
    ns, dev, _ = netns_pair
    lines = host_tc_commands(FlowPlan({"h": HostPlan([FlowRule("a", 0, rate=1e9)], link_rate=MAX_RATE)}), "h", dev)
    apply_tc(lines, dev, netns=ns)
    assert verify_tc(lines, dev, netns=ns) == []


@pytest.mark.emulation
def test_a_refused_batch_keeps_the_previous_tree(netns_pair):
    ns, dev, _ = netns_pair
    old = host_tc_commands(FlowPlan({"h": HostPlan([FlowRule("a", 1, rate=2.5e6)], link_rate=12.5e6)}), "h", dev)
    apply_tc(old, dev, netns=ns)
    assert verify_tc(old, dev, netns=ns) == []
    duplicate = htb_tree_commands(dev, 100.0) + [f"class add dev {dev} parent 1:1 classid 1:10 htb rate 1mbit"]
    illegal_burst = [line.replace("burst 12500", "burst 100000000000000000") for line in htb_tree_commands(dev, 100.0)]
    for bad in (duplicate, illegal_burst):
        with pytest.raises(EnforceError, match=f"staging device.*{dev} keeps its previous tree"):
            apply_tc(bad, dev, netns=ns, previous=old)
        assert verify_tc(old, dev, netns=ns) == []  # untouched, ceilings included
    assert "nwstg" not in subprocess.run(["ip", "-n", ns, "link"], capture_output=True, text=True).stdout  # staging device removed


@pytest.mark.emulation
def test_a_failed_swap_restores_the_previous_tree(netns_pair):
    ns, dev, _ = netns_pair
    old = host_tc_commands(FlowPlan({"h": HostPlan([FlowRule("a", 1, rate=2.5e6)], link_rate=12.5e6)}), "h", dev)
    apply_tc(old, dev, netns=ns)
    duplicate = htb_tree_commands(dev, 100.0) + [f"class add dev {dev} parent 1:1 classid 1:10 htb rate 1mbit"]
    with pytest.raises(EnforceError, match="the previous tree is back"):
        apply_tc(duplicate, dev, netns=ns, previous=old, stage=False)  # no staging: the swap itself fails
    assert verify_tc(old, dev, netns=ns) == []
    with pytest.raises(EnforceError, match="has no tree"):
        apply_tc(duplicate, dev, netns=ns, stage=False)
    assert "htb" not in tc_show(dev, "qdisc", netns=ns, stats=False)


@pytest.mark.emulation
def test_cli_apply_installs_and_reads_back(netns_pair, tmp_path, capsys):
    from flowsched.plan import write_plan
    from netweave.cli import main

    ns, dev, _ = netns_pair
    write_plan(FlowPlan({"h": HostPlan([FlowRule("a", 2, rate=1.25e6)], link_rate=12.5e6)}), tmp_path / "p.json")
    assert main(["flow", "apply", str(tmp_path / "p.json"), "--host", "h", "--dev", dev, "--netns", ns]) == 0
    assert "(read back: identical)" in capsys.readouterr().out


@pytest.mark.emulation
def test_verify_sees_every_difference_from_the_batch(netns_pair):
    ns, dev, _ = netns_pair
    lines = host_tc_commands(FlowPlan({"h": HostPlan([FlowRule("a", 2, rate=1.25e6), FlowRule("b", 5, dscp=46)], link_rate=12.5e6)}),
                             "h", dev)
    apply_tc(lines, dev, netns=ns)
    assert verify_tc(lines, dev, netns=ns) == []
    subprocess.run(["ip", "netns", "exec", ns, "tc", "class", "change", "dev", dev, "parent", "1:1", "classid", "1:12", "htb", "rate",
                    "1mbit", "ceil", "50mbit", "prio", "2"], check=True, capture_output=True)
    subprocess.run(["ip", "netns", "exec", ns, "tc", "filter", "del", "dev", dev, "parent", "1:", "prio", "10"], check=True, capture_output=True)
    problems = verify_tc(lines, dev, netns=ns)
    assert len(problems) == 2 and "class 1:12" in problems[0] and "filter pref 10 -> 1:15 missing" in problems[1], problems
    subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], check=True, capture_output=True)
    assert any("root qdisc" in p for p in verify_tc(lines, dev, netns=ns))


class _NetnsNode:
    """The one method of a Mininet node that apply_tc uses, run inside a namespace."""

    def __init__(self, ns):
        self.ns = ns

    def cmd(self, line):
        res = subprocess.run(["ip", "netns", "exec", self.ns, "sh", "-c", line], capture_output=True, text=True)
        return res.stdout + res.stderr


@pytest.mark.emulation
def test_apply_through_a_mininet_style_node(netns_pair):
    ns, dev, _ = netns_pair
    plan = FlowPlan({"h": HostPlan([FlowRule("a", 1, rate=2.5e6)], link_rate=12.5e6)})
    apply_tc(host_tc_commands(plan, "h", dev), dev, node=_NetnsNode(ns))
    assert class_ceilings(dev, netns=ns)[1] == 20e6
    assert verify_tc(host_tc_commands(plan, "h", dev), dev, node=_NetnsNode(ns)) == []
    with pytest.raises(EnforceError, match="keeps its previous tree"):
        apply_tc(htb_tree_commands(dev, 100.0) + [f"class add dev {dev} parent 1:1 classid 1:10 htb rate 1mbit"], dev, node=_NetnsNode(ns))
    assert class_ceilings(dev, netns=ns)[1] == 20e6


@pytest.mark.emulation
def test_any_valid_plan_installs_and_reads_back_identical(netns_pair):
    """Differential: what tc reports after applying a random plan equals what the batch asked for (rates 1e5..1e12 B/s, tc's rounding)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    ns, dev, _ = netns_pair

    @settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(link=st.floats(1e5, MAX_RATE), share=st.floats(1e-4, 1.5), prio=st.integers(0, 7), override=st.booleans())
    def check(link, share, prio, override):
        rules = [FlowRule("a", prio, rate=min(MAX_RATE, link * share))]
        if override:
            rules.append(FlowRule("b", (prio + 1) % 8, dscp=46))
        lines = host_tc_commands(FlowPlan({"h": HostPlan(rules, link_rate=link)}), "h", dev)
        apply_tc(lines, dev, netns=ns)
        assert verify_tc(lines, dev, netns=ns) == []

    check()
