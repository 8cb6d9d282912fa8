"""Slurm topology/tree ``topology.conf``: hostlists, import, export, round trips and errors."""

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from topology import InputError, NodeKind, SwitchTier, build_cluster
from topology.io import loads, read_topology
from topology.io.slurm import compress_hostlist, expand_hostlist, parse_slurm_topology, to_slurm_topology

DATA = Path(__file__).parent / "data"


# --- hostlists -------------------------------------------------------------------------------


def test_expand_hostlist_examples():
    assert expand_hostlist("tux[0-3,7,010-012]") == ["tux0", "tux1", "tux2", "tux3", "tux7", "tux010", "tux011", "tux012"]
    assert expand_hostlist("a,b[1-2]c,d[8-10]") == ["a", "b1c", "b2c", "d8", "d9", "d10"]
    assert expand_hostlist("r[0-1]n[00-01]") == ["r0n00", "r0n01", "r1n00", "r1n01"]
    assert expand_hostlist("x[1-2],x[2-3]") == ["x1", "x2", "x3"]  # duplicates collapse


def test_compress_hostlist_examples():
    assert compress_hostlist(["tux0", "tux1", "tux2", "tux3", "tux7"]) == "tux[0-3,7]"
    assert compress_hostlist(["n9", "n10", "n11"]) == "n[9-11]"
    assert compress_hostlist(["n009", "n010", "n100", "n7"]) == "n7,n[009-010,100]"
    assert compress_hostlist([f"node{i:02d}" for i in range(70)]) == "node[00-69]"
    assert compress_hostlist(["login"]) == "login"
    assert compress_hostlist(["node5"]) == "node5"


@pytest.mark.parametrize("expr", ["tux[3-1]", "tux[0-2", "tux0-2]", "tux[a]", "tux[[1]]", "a,,b"])
def test_expand_hostlist_rejects(expr):
    with pytest.raises(InputError):
        expand_hostlist(expr)


names = st.builds(
    lambda prefix, number, pad: f"{prefix}{str(number).zfill(pad)}" if number is not None else prefix,
    st.sampled_from(["tux", "n", "gpu-a", "r1n", "login"]),
    st.one_of(st.none(), st.integers(0, 130)),
    st.sampled_from([0, 0, 2, 3]),
)


@settings(max_examples=80, deadline=None)
@given(st.sets(names, min_size=1, max_size=40))
def test_hostlist_round_trip(hosts):
    text = compress_hostlist(hosts)
    expanded = expand_hostlist(text)
    assert len(expanded) == len(set(expanded))
    assert set(expanded) == hosts
    assert compress_hostlist(expanded) == text  # canonical


# --- import ----------------------------------------------------------------------------------


def test_sample_file_import():
    topo = read_topology(DATA / "slurm_tree.conf")
    tiers = {s: str(topo.graph.nodes[s]["tier"]) for s in topo.switches()}
    assert tiers == {"leaf0": "leaf", "leaf1": "leaf", "leaf2": "leaf", "spine0": "spine", "spine1": "spine", "core": "core"}
    assert topo.graph.nodes["leaf0"]["link_speed"] == "900"
    assert topo.hosts() == ["tux0", "tux1", "tux2", "tux3", "tux7", "tux010", "tux011", "tux012", "gpu-a1", "gpu-a2"]
    # Every host: one NIC cabled to its leaf at 400 Gb/s = 50 GB/s.
    nic = "tux010/nic0"
    assert [(v, d["bw"]) for _, v, d in topo.graph.out_edges(nic, data=True)] == [("leaf1", 50.0)]
    # Non-blocking uplinks: a switch's uplink carries all its downlink capacity.
    up = [d["bw"] for _, v, d in topo.graph.out_edges("leaf0", data=True) if v == "spine0"]
    assert up == [5 * 50.0]
    assert sum(d["bw"] for _, v, d in topo.graph.out_edges("spine0", data=True) if v == "core") == 8 * 50.0


def test_import_with_servers_and_oversubscription():
    text = "SwitchName=l0 Nodes=dgx[1-2]\nSwitchName=l1 Nodes=dgx3\nSwitchName=s Switches=l[0-1]\n"
    topo = parse_slurm_topology(text, node="dgx-h100", oversubscription=2)
    assert len(topo.gpus()) == 24 and topo.hosts() == ["dgx1", "dgx2", "dgx3"]
    leaf_nics = [u for u, v in topo.graph.in_edges("l0") if topo.kind(u) is NodeKind.NIC]
    assert len(leaf_nics) == 16  # all eight NICs of both servers
    up = sum(d["bw"] for _, v, d in topo.graph.out_edges("l0", data=True) if v == "s")
    assert up == pytest.approx(16 * 50.0 / 2)


def test_import_format_details():
    text = "# comment only\nswitchname=a NODES=\"n[1-2]\" # trailing\nSWITCHNAME=b \\\n   switches=a\n\n"
    topo = loads(text, "slurm", source="t.conf")
    assert topo.graph.nodes["b"]["tier"] is SwitchTier.SPINE
    assert topo.hosts() == ["n1", "n2"]


# --- export ----------------------------------------------------------------------------------


def test_export_rail_optimized_groups_scalable_units():
    topo = build_cluster(6, hosts_per_su=4)
    text = to_slurm_topology(topo)
    assert text.splitlines() == ["SwitchName=su0 Nodes=node[0-3]", "SwitchName=su1 Nodes=node[4-5]", "SwitchName=spinegroup0 Switches=su[0-1]"]
    again = parse_slurm_topology(text)
    assert again.hosts() == topo.hosts()


def test_export_round_trip_sample():
    first = to_slurm_topology(read_topology(DATA / "slurm_tree.conf"))
    assert first == to_slurm_topology(parse_slurm_topology(first))
    assert "SwitchName=leaf0 Nodes=tux[0-3,7] LinkSpeed=900" in first.splitlines()


def test_export_needs_switches():
    from topology import build_node

    with pytest.raises(InputError, match="no network switches"):
        to_slurm_topology(build_node("dgx-h100"))


@st.composite
def trees(draw):
    """A random switch tree in Slurm text, each leaf with its own hosts."""
    lines, counter, next_host = [], [0], [0]

    def make(depth: int) -> str:
        name = f"sw{counter[0]}"
        counter[0] += 1
        if depth == 0 or draw(st.booleans()) and depth < 3:
            count = draw(st.integers(1, 4))
            hosts = [f"h{next_host[0] + i}" for i in range(count)]
            next_host[0] += count + draw(st.integers(0, 3))
            lines.append(f"SwitchName={name} Nodes={','.join(hosts)}")
        else:
            kids = [make(depth - 1) for _ in range(draw(st.integers(1, 3)))]
            lines.append(f"SwitchName={name} Switches={','.join(kids)}")
        return name

    make(draw(st.integers(0, 3)))
    return "\n".join(lines) + "\n"


def _structure(topo):
    g = topo.graph
    out = {}
    for s in topo.switches():
        below = sorted(u for u, _ in g.in_edges(s) if topo.kind(u) is NodeKind.SWITCH and g.nodes[u]["level"] < g.nodes[s]["level"])
        hosts = sorted(topo.host_of(u) for u, _ in g.in_edges(s) if topo.kind(u) is NodeKind.NIC)
        out[s] = (str(g.nodes[s]["tier"]), below, hosts)
    return out


@settings(max_examples=40, deadline=None)
@given(trees())
def test_tree_round_trip(text):
    topo = parse_slurm_topology(text)
    exported = to_slurm_topology(topo)
    again = parse_slurm_topology(exported)
    assert _structure(again) == _structure(topo)
    assert to_slurm_topology(again) == exported


# --- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, line, fragment",
    [
        ("SwitchName=s0 Nodes=a[0-3]\nSwitchName=s0 Nodes=b1\n", 2, "defined twice"),
        ("SwitchName=s0 Nodes=a1\nSwitchName=s1 Switches=s[0,2]\n", 2, "unknown child switch 's2'"),
        ("SwitchName=s0 Nodes=a1 Bandwidth=10\n", 1, "unknown key 'Bandwidth'"),
        ("SwitchName=s0 Nodes=a[3-1]\n", 1, "descending range"),
        ("Nodes=a1\n", 1, "expected a line starting with SwitchName"),
        ("SwitchName=a Switches=b\nSwitchName=b Switches=a\n", 1, "cycle"),
        ("SwitchName=s0 Nodes=a1 Switches=s1\nSwitchName=s1 Nodes=a2\n", 1, "both Nodes= and Switches="),
        ("BlockName=b1 Nodes=a[1-4]\n", 1, "topology/block"),
        ("SwitchName=s0 Nodes\n", 1, "expected KEY=VALUE"),
        ("# nothing\n", None, "no SwitchName= lines"),
    ],
)
def test_errors_name_file_and_line(text, line, fragment):
    with pytest.raises(InputError) as exc:
        parse_slurm_topology(text, source="topology.conf")
    message = str(exc.value)
    prefix = "topology.conf: " + (f"line {line}: " if line else "")
    assert message.startswith(prefix), message
    assert fragment in message
    assert "\n" not in message


@pytest.mark.parametrize("fabric", ["rail-optimized", "leaf-spine", "fat-tree"])
def test_every_fabric_exports_a_valid_tree(fabric):
    topo = build_cluster(8, fabric=fabric)
    text = to_slurm_topology(topo)
    again = parse_slurm_topology(text)
    leaves_of = {}
    for nic in again.nodes(NodeKind.NIC):
        leaves_of.setdefault(again.host_of(nic), []).extend(v for _, v in again.graph.out_edges(nic))
    assert sorted(leaves_of) == sorted(topo.hosts())
    assert all(len(v) == 1 for v in leaves_of.values())  # one leaf per node, as topology/tree wants
    level = {s: again.graph.nodes[s]["level"] for s in again.switches()}
    roots = [s for s in again.switches() if not any(level.get(v, -1) > level[s] for _, v in again.graph.out_edges(s))]
    assert len(roots) == 1  # every fabric is connected, so one tree


def test_byte_order_mark_is_ignored():
    text = (DATA / "slurm_tree.conf").read_text()
    assert parse_slurm_topology("\ufeff" + text).to_dict() == parse_slurm_topology(text).to_dict()
