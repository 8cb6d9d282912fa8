"""Pure tests of the emulation plumbing: HTB tree generation and checking, network plans, flow routing (no root needed).

``tests/data/tc_htb_100mbit.txt`` is the real output of ``tc qdisc/class/filter show``
for the tree ``htb_tree_commands("nwh0-eth0", 104.558)`` (100 Mbit/s payload +
framing) as installed by the emulator, captured on the project's kernel.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emu.htb import (
    ACK_CLASSID,
    ACK_MATCHES,
    DEFAULT_PRIORITY,
    NUM_PRIORITIES,
    PRIORITY_DSCP,
    HtbError,
    HtbSpec,
    check_htb_tree,
    class_counters,
    dscp_for_priority,
    htb_tree_commands,
    leaf_classid,
    parse_rate,
    parse_tc_classes,
    parse_tc_filters,
    parse_tc_qdiscs,
    priority_for_dscp,
    tos_for_priority,
)
from emu.mininet_backend import check_class_bytes
from emu.net import WIRE_OVERHEAD, CpuMonitor, EmulationError, NetworkPlan, plan_network, route_flow, scaled_rate_mbit
from topology import build_cluster, default_cluster
from topology.errors import InputError
from topology.fabrics import star

SAMPLE = (Path(__file__).parent / "data" / "tc_htb_100mbit.txt").read_text()
SAMPLE_QDISC, SAMPLE_CLASS, SAMPLE_FILTER = SAMPLE.split("@@\n")
SAMPLE_SPEC = HtbSpec("nwh0-eth0", 100 * WIRE_OVERHEAD)


# -- priorities and DSCP ----------------------------------------------------------------------------------


def test_dscp_table_is_a_bijection_onto_class_selectors():
    assert len(set(PRIORITY_DSCP)) == NUM_PRIORITIES
    for p in range(NUM_PRIORITIES):
        d = dscp_for_priority(p)
        assert d % 8 == 0 and 0 <= d < 64  # CSx code points
        assert priority_for_dscp(d) == p
        assert tos_for_priority(p) == d << 2 and tos_for_priority(p) & 0x3 == 0  # ECN bits clear
    assert dscp_for_priority(0) > dscp_for_priority(7)  # higher precedence = more urgent
    assert priority_for_dscp(46) == DEFAULT_PRIORITY  # EF is not in the table: default leaf
    assert priority_for_dscp(0) == DEFAULT_PRIORITY  # unmarked traffic is lowest priority


@pytest.mark.parametrize("bad", [-1, 8, 99])
def test_bad_priority_raises(bad):
    with pytest.raises(HtbError, match="priority"):
        dscp_for_priority(bad)


# -- generation -------------------------------------------------------------------------------------------


def test_tree_commands_structure():
    cmds = htb_tree_commands("s0-eth1", 400)
    assert cmds[0] == "qdisc replace dev s0-eth1 root handle 1: htb default 17 r2q 10"
    classes = [c for c in cmds if c.startswith("class add")]
    filters = [c for c in cmds if c.startswith("filter add")]
    pfifos = [c for c in cmds if c.startswith("qdisc add") and "pfifo" in c]
    # 8 priority leaves + the control leaf for pure ACKs, each with a pfifo; 8 DSCP filters + the ACK filter
    assert len(classes) == 2 + NUM_PRIORITIES and len(filters) == NUM_PRIORITIES + 1 and len(pfifos) == NUM_PRIORITIES + 1
    ack = [c for c in filters if "protocol 6" in c]
    assert len(ack) == 1 and " prio 1 " in ack[0] and ack[0].endswith(f"flowid {ACK_CLASSID}")  # evaluated first
    ack_class = [c for c in classes if f"classid {ACK_CLASSID} " in c]
    assert len(ack_class) == 1 and "rate 20000kbit ceil 400000kbit" in ack_class[0] and " prio 0 " in ack_class[0]
    plain = htb_tree_commands("s0-eth1", 400, ack_fraction=0)
    assert sum(c.startswith("filter") for c in plain) == NUM_PRIORITIES and ACK_CLASSID not in " ".join(plain)
    assert "rate 400000kbit ceil 400000kbit" in classes[0]
    for p in range(NUM_PRIORITIES):
        leaf = [c for c in classes if f"classid {leaf_classid(p)} " in c]
        assert len(leaf) == 1 and f" prio {p} " in leaf[0] and "rate 4000kbit ceil 400000kbit" in leaf[0]
        f = [c for c in filters if c.endswith(f"flowid {leaf_classid(p)}") and "tos" in c]
        assert len(f) == 1 and f"match ip tos {tos_for_priority(p):#04x} 0xfc" in f[0]
    # the default names an existing leaf (an inner or missing default sends traffic to the unshaped direct queue)
    default = int(cmds[0].split("default ")[1].split()[0], 16)
    assert f"1:{default:x}" == leaf_classid(DEFAULT_PRIORITY)


@settings(max_examples=60, deadline=None)
@given(rate=st.floats(1, 1000), floor=st.floats(0.001, 0.1), queue=st.integers(1, 5000))
def test_generated_tree_is_consistent(rate, floor, queue):
    spec = HtbSpec("x", rate, floor_fraction=floor, queue_packets=queue)
    cmds = htb_tree_commands("x", rate, floor_fraction=floor, queue_packets=queue)
    rates = [int(m) for c in cmds for m in re.findall(r" rate (\d+)kbit", c)]
    ceils = [int(m) for c in cmds for m in re.findall(r" ceil (\d+)kbit", c)]
    assert rates[0] == spec.rate_kbit and all(c == spec.rate_kbit for c in ceils)
    assert sum(rates[1:]) <= spec.rate_kbit + (NUM_PRIORITIES + 1) * 8  # floors + ACK share fit under the link (8 kbit minimum each)
    assert spec.burst_bytes >= 2 * spec.mtu  # HTB must be able to send a full packet
    assert all(f"limit {queue}" in c for c in cmds if "pfifo" in c)


@pytest.mark.parametrize("kwargs", [{"rate_mbit": 0}, {"rate_mbit": -5}, {"rate_mbit": 10, "floor_fraction": 0.5},
                                    {"rate_mbit": 10, "floor_fraction": 0.12}, {"rate_mbit": 10, "queue_packets": 0},
                                    {"rate_mbit": 10, "ack_fraction": 0.9}])
def test_bad_spec_raises(kwargs):
    with pytest.raises(HtbError):
        HtbSpec("dev0", **kwargs)


# -- parsing real tc output -------------------------------------------------------------------------------


def test_parse_rate_units():
    assert parse_rate("104558Kbit") == 104_558_000
    assert parse_rate("1Gbit") == 1e9 and parse_rate("12bit") == 12 and parse_rate("2Mbps") == 16e6
    with pytest.raises(ValueError):
        parse_rate("fast")


def test_parse_sample_output():
    qdiscs = parse_tc_qdiscs(SAMPLE_QDISC)
    assert [q.kind for q in qdiscs].count("pfifo") == 9 and qdiscs[0].parent is None and qdiscs[0].options["default"] == "0x17"
    classes = parse_tc_classes(SAMPLE_CLASS)
    assert set(classes) == {"1:1", ACK_CLASSID} | {leaf_classid(p) for p in range(8)}
    assert classes["1:13"].prio == 3 and classes["1:13"].parent == "1:1" and classes["1:13"].rate_bps == 1_046_000
    assert classes["1:17"].sent_bytes > 0 and classes["1:17"].sent_packets >= 1  # IPv6 router solicitations etc.
    filters = parse_tc_filters(SAMPLE_FILTER)
    assert len(filters) == 9
    assert [f.matches for f in filters if f.pref == 1] == [list(ACK_MATCHES)]
    dscp = [f for f in filters if f.pref > 1]
    assert {f.flowid: f.matches[0][0] >> 16 for f in dscp} == {leaf_classid(p): tos_for_priority(p) for p in range(8)}
    assert class_counters(SAMPLE_CLASS)[7] == {"sent_bytes": classes["1:17"].sent_bytes, "sent_packets": classes["1:17"].sent_packets,
                                               "dropped": 0}


def test_check_accepts_the_installed_tree():
    assert check_htb_tree(SAMPLE_SPEC, SAMPLE_QDISC, SAMPLE_CLASS, SAMPLE_FILTER) == []


def test_check_reports_each_kind_of_damage():
    def problems(q=SAMPLE_QDISC, c=SAMPLE_CLASS, f=SAMPLE_FILTER, spec=SAMPLE_SPEC):
        return check_htb_tree(spec, q, c, f)

    assert any("root qdisc" in p for p in problems(q="qdisc noqueue 0: root refcnt 2\n"))
    assert any("default" in p for p in problems(q=SAMPLE_QDISC.replace("default 0x17", "default 0x1")))
    assert any("1:14" in p and "missing" in p for p in problems(c=re.sub(r"class htb 1:14 .*\n", "", SAMPLE_CLASS)))
    assert any("prio" in p for p in problems(c=SAMPLE_CLASS.replace("leaf 12: prio 2", "leaf 12: prio 5")))
    assert any("no pfifo" in p for p in problems(q=SAMPLE_QDISC.replace("qdisc pfifo 16: parent 1:16 limit 200p\n", "")))
    assert any("TOS 0xa0" in p for p in problems(f=SAMPLE_FILTER.replace("00a00000/00fc0000", "00b80000/00fc0000")))
    assert any("ceil" in p for p in problems(spec=HtbSpec("nwh0-eth0", 200)))  # the tree shapes at the wrong rate
    assert any("ACK" in p for p in problems(f=SAMPLE_FILTER.replace("0000ff80 at 0", "0000ffc0 at 0")))
    assert any("control leaf" in p for p in problems(c=SAMPLE_CLASS.replace("leaf 20: prio 0", "leaf 20: prio 3")))


def test_class_bytes_check():
    ok = check_class_bytes({0: 1e7, 3: 2e6}, {0: 10_700_000, 3: 2_100_000, 7: 5000})
    assert ok["ok"] and ok["problems"] == []
    swapped = check_class_bytes({0: 1e7, 3: 2e7}, {0: 20_900_000, 3: 10_500_000})
    assert not swapped["ok"] and any("priority 3" in p for p in swapped["problems"])
    leaked = check_class_bytes({0: 1e7}, {0: 10_500_000, 7: 9_000_000})
    assert any("priority 7" in p for p in leaked["problems"])


def test_cpu_monitor_reads_proc_stat():
    busy, total = CpuMonitor.read()
    assert 0 <= busy <= total
    with CpuMonitor(interval_s=0.01) as mon:
        sum(i * i for i in range(200_000))
    rep = mon.report()
    assert rep["busy_mean"] is None or 0 <= rep["busy_mean"] <= 1
    mon.samples, mon.stamps = [0.2, 0.9, 0.4], [1.0, 2.0, 3.0]  # a window keeps only the samples that end inside it
    assert mon.report(window=(1.5, 2.5))["busy_mean"] == pytest.approx(0.9) and mon.report(window=(5, 6))["busy_mean"] is None


# -- network plans ----------------------------------------------------------------------------------------




def test_plan_default_cluster_per_leaf_is_one_interface_per_rail():
    topo = default_cluster()
    plan = plan_network(topo, time_scale=1000)
    assert isinstance(plan, NetworkPlan)
    assert len(plan.hosts) == 4 and len(plan.switches) == 8 and len(plan.interfaces) == 32
    assert all(i.rate_mbit == pytest.approx(400.0) and i.rate_down_mbit == pytest.approx(400.0) for i in plan.interfaces)
    for s in plan.switches:  # one subnet per leaf, every host on it once
        ifs = [i for i in plan.interfaces if i.switch == s.name]
        assert len(ifs) == 4 and len({i.ip.rsplit(".", 1)[0] for i in ifs}) == 1 and len({i.ip for i in ifs}) == 4
    assert len({i.ip for i in plan.interfaces}) == 32 and len({i.switch_dev for i in plan.interfaces}) == 32
    assert all(len(i.dev) <= 15 and len(i.switch_dev) <= 15 for i in plan.interfaces)  # Linux IFNAMSIZ
    assert len(plan.htb_specs()) == 64  # both directions of every cable


def test_plan_aggregate_sums_nics():
    plan = plan_network(default_cluster(), time_scale=8000, nic_mode="aggregate")
    assert len(plan.switches) == 1 and len(plan.interfaces) == 4
    assert all(i.rate_mbit == pytest.approx(8 * 50 * 8e3 / 8000) and len(i.nics) == 8 for i in plan.interfaces)


def test_rates_scale_inversely_with_time_scale():
    assert scaled_rate_mbit(50, 1000) == pytest.approx(400)
    for k in (500, 2000, 4000):
        plan = plan_network(star(3, nic_bw=25), time_scale=k)
        assert plan.interfaces[0].rate_mbit * k == pytest.approx(25 * 8e3)
    wire = dict(plan_network(star(2, nic_bw=25), time_scale=2000).htb_specs()[0:1])
    assert next(iter(wire.values())).rate_mbit == pytest.approx(100 * WIRE_OVERHEAD)


def test_time_scale_out_of_range_names_a_fitting_one():
    with pytest.raises(InputError, match=r"time_scale.*at least 418"):
        plan_network(default_cluster(), time_scale=100)
    with pytest.raises(InputError, match="at most"):
        plan_network(default_cluster(), time_scale=1e7)
    with pytest.raises(InputError, match="nic_mode"):
        plan_network(default_cluster(), time_scale=1000, nic_mode="bonded")


def test_servers_without_a_shared_leaf_are_refused():
    topo = build_cluster(4, hosts_per_su=2)  # two scalable units: hosts of different SUs share no leaf
    with pytest.raises(EmulationError, match="share no leaf"):
        plan_network(topo, time_scale=1000)
    assert len(plan_network(topo, time_scale=1000, hosts=topo.hosts()[:2]).hosts) == 2
    assert len(plan_network(topo, time_scale=8000, nic_mode="aggregate").interfaces) == 4


def test_routes_are_rail_aligned():
    topo = default_cluster()
    plan = plan_network(topo, time_scale=1000)
    for k in range(8):
        tx, rx = route_flow(plan, topo, f"node0/gpu{k}", f"node2/gpu{k}")
        assert tx.leaf == rx.leaf == f"su0/leaf{k}" and tx.topo_host == "node0" and rx.topo_host == "node2"
    tx, rx = route_flow(plan, topo, "node0/gpu1", "node3/gpu6")  # cross-rail: the source GPU's rail
    assert tx.leaf == "su0/leaf1" == rx.leaf
    assert route_flow(plan, topo, "node1/gpu0", "node1/gpu5") is None  # inside a server: modelled, not emulated
    agg = plan_network(topo, time_scale=8000, nic_mode="aggregate", prefix="nw")
    tx, rx = route_flow(agg, topo, "node0/gpu1", "node3/gpu6")
    assert tx.dev == "nwh0-eth0" and rx.dev == "nwh3-eth0"
