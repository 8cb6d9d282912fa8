"""Cell hierarchies derived from topologies (placement.cells)."""

from __future__ import annotations

import pytest

import topology
from placement.cells import cell_hierarchy, lowest_common_level
from topology.errors import InputError


def _check_tree(tree):
    for c in tree.cells:
        if c.children:
            assert c.children[0].lo == c.lo and c.children[-1].hi == c.hi
            for a, b in zip(c.children, c.children[1:], strict=False):
                assert a.hi == b.lo
            assert all(k.parent is c and k.level < c.level for k in c.children)
        else:
            assert c.level == 0 and c.size == 1
    assert sorted(tree.leaves) == sorted(set(tree.leaves))
    assert sum(t.size for t in tree.tops) == len(tree.leaves)


def test_dgx_h100_levels_follow_numa_host_and_su(cluster):
    tree = cell_hierarchy(cluster)["H100-SXM5-80GB"]
    _check_tree(tree)
    names = [lv.name for lv in tree.levels]
    assert names == ["gpu", "gpux2", "numa", "host", "hostx2", "su"]
    assert [lv.forged for lv in tree.levels] == [False, True, False, False, True, False]
    host = tree.by_address["node1"]
    assert tree.gpus_of(host) == cluster.gpus(host="node1")
    # a NUMA cell holds the GPUs of one CPU socket
    numa = tree.by_address["node1/numa1"]
    assert {cluster.graph.nodes[g]["numa"] for g in tree.gpus_of(numa)} == {1}
    assert all(c.full for c in tree.cells)


def test_dgx_a100_has_pcie_switch_pairs():
    topo = topology.build_cluster(2, node="dgx-a100")
    tree = cell_hierarchy(topo)["A100-SXM4-80GB"]
    _check_tree(tree)
    assert [lv.name for lv in tree.levels] == ["gpu", "pcie", "numa", "host", "su"]
    pair = tree.cells_at(1)[0]
    switches = {next(n for n in topo.graph.successors(g) if topo.kind(n) == "pcie_switch") for g in tree.gpus_of(pair)}
    assert len(switches) == 1


def test_partial_su_is_not_full_and_mixed_chains_split():
    topo = topology.build_cluster(6, hosts_per_su=4)
    tree = cell_hierarchy(topo)["H100-SXM5-80GB"]
    _check_tree(tree)
    names = [lv.name for lv in tree.levels]
    assert names[-1] == "cluster" and "su" in names
    su_level = names.index("su")
    sus = tree.cells_at(su_level)
    assert [s.size for s in sus] == [32, 16] and [s.full for s in sus] == [True, False]
    assert not tree.tops[0].full


def test_forging_can_be_disabled(cluster):
    tree = cell_hierarchy(cluster, forge=False)["H100-SXM5-80GB"]
    assert [lv.name for lv in tree.levels] == ["gpu", "numa", "host", "su"]
    assert tree.levels[1].fanout == 4


def test_lowest_common_level(cluster):
    tree = cell_hierarchy(cluster)["H100-SXM5-80GB"]
    assert lowest_common_level(tree, [0, 1]) == 1
    assert lowest_common_level(tree, [0, 5]) == 3
    assert lowest_common_level(tree, [0, 31]) == 5


def test_no_gpus_is_an_input_error():
    t = topology.Topology("empty")
    t.add_node("h/cpu0", "cpu", host="h")
    with pytest.raises(InputError, match="no GPUs"):
        cell_hierarchy(t)
