"""HiveD's configuration file (placement.hived_config), pinned cells, lazy preemption, pod groups, HiveD's node rule."""

from __future__ import annotations

import json

import pytest
import yaml

import topology
from netweave.cli import main
from placement.cells import cell_hierarchy
from placement.hived import HivedScheduler, QuotaError
from placement.hived_config import (
    EXAMPLE,
    config_from_trees,
    dumps_hived_config,
    loads_hived_config,
    read_hived_config,
    scheduler_from_config,
)
from topology.errors import InputError

# HiveD's own design example (example/config/design/hivedscheduler.yaml), the DGX-1 and DGX-2 parts, with skuTypes
DESIGN = """\
kubeApiServerAddress: http://10.10.10.10:8080
physicalCluster:
  skuTypes:
    DGX1-P100: {gpu: 1, cpu: 8, memory: 64Gi}
  cellTypes:
    DGX1-P100-PCI-SWITCH: {childCellType: DGX1-P100, childCellNumber: 2}
    DGX1-P100-CPU-SOCKET: {childCellType: DGX1-P100-PCI-SWITCH, childCellNumber: 2}
    DGX1-P100-NODE: {childCellType: DGX1-P100-CPU-SOCKET, childCellNumber: 2, isNodeLevel: true}
    3-DGX1-P100-NODE: {childCellType: DGX1-P100-NODE, childCellNumber: 3}
    DGX2-V100-NODE-2-GPU: {childCellType: DGX2-V100, childCellNumber: 2}
    DGX2-V100-NODE-4-GPU: {childCellType: DGX2-V100-NODE-2-GPU, childCellNumber: 2}
    DGX2-V100-NODE-8-GPU: {childCellType: DGX2-V100-NODE-4-GPU, childCellNumber: 2}
    DGX2-V100-NODE: {childCellType: DGX2-V100-NODE-8-GPU, childCellNumber: 2, isNodeLevel: true}
    2-DGX2-V100-NODE: {childCellType: DGX2-V100-NODE, childCellNumber: 2}
    4-DGX2-V100-NODE: {childCellType: 2-DGX2-V100-NODE, childCellNumber: 2}
  physicalCells:
  - cellType: 3-DGX1-P100-NODE
    cellChildren:
    - cellAddress: 1.0.0.2
    - cellAddress: 1.0.0.1
      cellChildren:
      - cellAddress: 0
        cellChildren:
        - cellAddress: 0
          cellChildren: [{cellAddress: 0}, {cellAddress: 1}]
        - cellAddress: 1
          cellChildren: [{cellAddress: 2}, {cellAddress: 3}]
      - cellAddress: 1
    - cellAddress: 1.0.0.0
  - cellType: DGX2-V100-NODE
    cellAddress: 0.0.1.0
  - cellType: 4-DGX2-V100-NODE
    cellChildren:
    - pinnedCellId: VC1-YQW-DGX2
      cellChildren: [{cellAddress: 0.0.3.0}, {cellAddress: 0.0.3.1}]
    - cellChildren: [{cellAddress: 0.0.3.2}, {cellAddress: 0.0.3.3}]
virtualClusters:
  VC1:
    virtualCells:
    - {cellType: 4-DGX2-V100-NODE.2-DGX2-V100-NODE.DGX2-V100-NODE, cellNumber: 1}
    - {cellType: DGX2-V100-NODE, cellNumber: 1}
    pinnedCells:
    - {pinnedCellId: VC1-YQW-DGX2}
  VC2:
    virtualCells:
    - {cellType: 3-DGX1-P100-NODE.DGX1-P100-NODE, cellNumber: 2}
    - {cellType: 3-DGX1-P100-NODE.DGX1-P100-NODE.DGX1-P100-CPU-SOCKET, cellNumber: 2}
"""


def test_hived_design_config_reads_into_chains_quotas_and_pinned_cells():
    cfg = loads_hived_config(DESIGN)
    trees = cfg.trees()
    assert list(trees) == ["3-DGX1-P100-NODE", "DGX2-V100-NODE", "4-DGX2-V100-NODE"]
    p100 = trees["3-DGX1-P100-NODE"]
    assert [lv.name for lv in p100.levels] == ["DGX1-P100", "DGX1-P100-PCI-SWITCH", "DGX1-P100-CPU-SOCKET", "DGX1-P100-NODE", "3-DGX1-P100-NODE"]
    assert [lv.size for lv in p100.levels] == [1, 2, 4, 8, 24] and [lv.node_level for lv in p100.levels] == [False] * 3 + [True, False]
    # explicit addresses are kept, unspecified ones default to the index (a GPU's: its index in the node)
    assert p100.leaves[:10] == ["1.0.0.2/gpu0", "1.0.0.2/gpu1", "1.0.0.2/gpu2", "1.0.0.2/gpu3", "1.0.0.2/gpu4", "1.0.0.2/gpu5",
                                "1.0.0.2/gpu6", "1.0.0.2/gpu7", "1.0.0.1/gpu0", "1.0.0.1/gpu1"]
    assert "1.0.0.1/0/1" in p100.by_address and p100.by_address["1.0.0.1/1"].size == 4
    assert cfg.virtual_clusters() == {
        "VC1": {"4-DGX2-V100-NODE": {"DGX2-V100-NODE": 1}, "DGX2-V100-NODE": {"DGX2-V100-NODE": 1}},
        "VC2": {"3-DGX1-P100-NODE": {"DGX1-P100-NODE": 2, "DGX1-P100-CPU-SOCKET": 2}}}
    assert cfg.pinned_cells() == {"VC1": [("4-DGX2-V100-NODE", "4-DGX2-V100-NODE.0/0")]}
    assert cfg.data["physicalCluster"]["skuTypes"] == {"DGX1-P100": {"gpu": 1, "cpu": 8, "memory": "64Gi"}}


def test_round_trips_are_exact(tmp_path):
    for text in (DESIGN, EXAMPLE):
        cfg = loads_hived_config(text)
        written = dumps_hived_config(cfg)
        again = loads_hived_config(written)
        assert again.data == cfg.data == yaml.safe_load(text)  # every key, skuTypes and unknown top-level keys included
        assert dumps_hived_config(again) == written
        assert again.virtual_clusters() == cfg.virtual_clusters() and again.pinned_cells() == cfg.pinned_cells()
        def addresses(c):
            return {chain: [x.address for x in t.cells] for chain, t in c.trees().items()}

        assert addresses(again) == addresses(cfg)
    path = tmp_path / "h.yaml"
    path.write_text(DESIGN)
    assert read_hived_config(str(path)).data == yaml.safe_load(DESIGN)


@pytest.mark.parametrize("topo", [topology.default_cluster(), topology.build_cluster(2, node="dgx-a100"), topology.build_cluster(64)])
def test_exported_derived_cells_read_back_as_the_same_trees(topo):
    trees = cell_hierarchy(topo)
    cfg = loads_hived_config(dumps_hived_config(config_from_trees(trees)))
    for a, b in zip(trees.values(), cfg.trees().values(), strict=True):
        assert b.leaves == a.leaves
        assert [(c.level, c.lo, c.hi) for c in b.cells] == [(c.level, c.lo, c.hi) for c in a.cells]
        assert [lv.size for lv in b.levels] == [lv.size for lv in a.levels]
        assert [lv.node_level for lv in b.levels] == [lv.node_level for lv in a.levels]


def test_scheduler_from_config_runs_hived_on_the_files_cells():
    cfg = loads_hived_config(DESIGN)
    s = scheduler_from_config(cfg)
    r = s.allocate("j", 16, vc="VC1", chain="DGX2-V100-NODE")
    assert r.ok and {g.split("/")[0] for g in r.gpus} == {"0.0.1.0"}
    pin = "4-DGX2-V100-NODE.0/0"
    r = s.allocate("p", 32, vc="VC1", pinned=pin)
    assert r.ok and {g.split("/")[0] for g in r.gpus} == {"0.0.3.0", "0.0.3.1"}
    # the pinned cell is VC1's alone: its ordinary quota lands elsewhere, and VC2 never sees it
    r = s.allocate("q", 16, vc="VC1", chain="4-DGX2-V100-NODE")
    assert r.ok and {g.split("/")[0] for g in r.gpus} <= {"0.0.3.2", "0.0.3.3"}
    assert not s.allocate("more", 1, vc="VC1", pinned=pin).ok
    with pytest.raises(InputError, match="pins no cell"):
        s.allocate("x", 1, vc="VC2", pinned=pin)
    # the same GPUs on a netweave topology: the file's GPU ids must exist there
    with pytest.raises(InputError, match="is not in topology"):
        scheduler_from_config(cfg, topology.default_cluster())


@pytest.mark.parametrize(("text", "where"), [
    ("physicalCluster: {cellTypes: {A: {childCellType: G, childCellNumber: 0}}}", "childCellNumber"),
    ("physicalCluster: {cellTypes: {A: {childCellType: A, childCellNumber: 2}}, physicalCells: [{cellType: A}]}", "forest"),
    ("physicalCluster: {cellTypes: {N: {childCellType: G, childCellNumber: 2, isNodeLevel: true}}, physicalCells: [{cellType: N}]}",
     "cellAddress"),
    ("physicalCluster: {cellTypes: {N: {childCellType: G, childCellNumber: 2, isNodeLevel: true}}, physicalCells: [{cellType: X}]}",
     "cellType"),
    ("physicalCluster: {cellTypes: {N: {childCellType: G, childCellNumber: 1, isNodeLevel: true}}, "
     "physicalCells: [{cellType: N, cellAddress: h, cellChildren: [{}, {}]}]}", "cellChildren"),
    ("physicalCluster: {cellTypes: {N: {childCellType: G, childCellNumber: 1, isNodeLevel: true}}, physicalCells: [{cellType: N, cellAddress: h}]}\n"
     "virtualClusters: {v: {virtualCells: [{cellType: N.Q, cellNumber: 1}]}}", "virtualCells[0].cellType"),
    ("physicalCluster: {cellTypes: {N: {childCellType: G, childCellNumber: 1, isNodeLevel: true}}, physicalCells: [{cellType: N, cellAddress: h}]}\n"
     "virtualClusters: {v: {pinnedCells: [{pinnedCellId: nope}]}}", "pinnedCellId"),
    ("physicalCluster: [1, 2", "invalid YAML"),
])
def test_bad_configs_name_the_field(text, where):
    with pytest.raises(InputError, match=where.replace("[", r"\[").replace("]", r"\]")):
        loads_hived_config(text, source="h.yaml")


def test_infeasible_quota_in_a_config_is_refused():
    text = EXAMPLE.replace("cellNumber: 1}]", "cellNumber: 2}]")  # two nodes of quota plus a pinned node: three of two
    with pytest.raises(QuotaError, match="short of"):
        scheduler_from_config(loads_hived_config(text))


def test_cli_import_and_export(tmp_path, capsys):
    src = tmp_path / "hived.yaml"
    src.write_text(DESIGN)
    out = tmp_path / "again.yaml"
    assert main(["place", "import-hived", str(src), "--out", str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["virtual_clusters"]["VC2"] == {"3-DGX1-P100-NODE": {"DGX1-P100-NODE": 2, "DGX1-P100-CPU-SOCKET": 2}}
    assert data["guarantees"]["ok"] and yaml.safe_load(out.read_text()) == yaml.safe_load(DESIGN)
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text("virtual_clusters: {a: {host: 2}}\njobs: [{name: x, gpus: 1}]\n")
    exported = tmp_path / "export.yaml"
    assert main(["place", "export-hived", "--topology", "default", "--jobs", str(jobs), "--out", str(exported)]) == 0
    capsys.readouterr()
    assert main(["place", "import-hived", str(exported), "--topology", "default", "--json"]) == 0
    back = json.loads(capsys.readouterr().out)
    assert back["virtual_clusters"] == {"a": {"H100-SXM5-80GB/su": {"H100-SXM5-80GB/host": 2}}}
    bad = tmp_path / "bad.yaml"
    bad.write_text("physicalCluster: {cellTypes: {}}\n")
    assert main(["place", "import-hived", str(bad)]) == 2
    assert "bad.yaml" in capsys.readouterr().err


# -- pinned cells, lazy preemption, pod groups, HiveD's node rule (placement.hived) ---------------------------
def test_pinned_cell_is_bound_for_good_and_only_pinned_requests_use_it(cluster):
    s = HivedScheduler(cluster, {"a": {"host": 1}}, pinned={"a": ["node3"]})
    assert "node3" not in str(s.free_lists()["H100-SXM5-80GB"]["binding"])
    r = s.allocate("p", 8, vc="a", pinned="node3")
    assert r.ok and {g.split("/")[0] for g in r.gpus} == {"node3"}
    s.free("p")
    assert s.vcs["a"]["H100-SXM5-80GB"].pinned["node3"].physical.address == "node3"  # still bound when idle
    r = s.allocate("q", 8, vc="a")
    assert r.ok and "node3" not in r.gpus[0]
    assert s.allocate("r", 8, vc="a").reason["resource"] == "quota"
    t = HivedScheduler.from_state(cluster, s.to_state())
    assert t.to_state() == s.to_state()
    with pytest.raises(InputError, match="no cell"):
        HivedScheduler(cluster, {}, pinned={"a": ["node9"]})


def test_lazy_preemption_downgrades_the_victim_when_free_cells_exist_elsewhere(cluster):
    s = HivedScheduler(cluster, {"a": {"host": 1, "numa": 1}})
    low = s.allocate("low", 8, vc="a", priority=1, lazy=True)
    assert low.ok
    r = s.allocate("high", 8, vc="a", priority=5)
    assert r.ok and r.preempted == [] and r.downgraded == ["low"]
    assert s.jobs["low"].vc is None and s.job_gpus("low") == low.gpus  # still running, same GPUs, now opportunistic
    assert not set(r.gpus) & set(low.gpus)
    # without the flag the victim is stopped
    s2 = HivedScheduler(cluster, {"a": {"host": 1}})
    s2.allocate("low", 8, vc="a", priority=1)
    r2 = s2.allocate("high", 8, vc="a", priority=5)
    assert r2.preempted == ["low"] and "low" not in s2.jobs


def test_pod_group_keeps_each_pod_in_one_node_and_the_group_in_one_cell(cluster):
    s = HivedScheduler(cluster, {"a": {"hostx2": 1}})
    r = s.allocate_group("g", [6, 6, 2], vc="a", within="hostx2")
    assert r.ok and len(r.gpus) == 14
    pods = [s.job_gpus(f"g/pod{i}") for i in range(3)]
    assert all(len({g.split("/")[0] for g in p}) == 1 for p in pods)
    hostx2 = {g.split("/")[0] for g in r.gpus}
    assert hostx2 in ({"node0", "node1"}, {"node2", "node3"})
    before = s.to_state()
    assert not s.allocate_group("too-big", [8, 8, 8], vc="a").ok and s.to_state() == before  # all or nothing
    assert HivedScheduler.from_state(cluster, before).groups == {"g": ["g/pod0", "g/pod1", "g/pod2"]}
    assert s.free("g/pod1")  # a preempted or freed pod releases its whole gang
    assert not any(j.startswith("g/") for j in s.jobs) and not s.groups


def test_hived_node_rule_keeps_pieces_at_or_below_the_node_whole(cluster):
    relaxed = HivedScheduler(cluster, {})
    strict = HivedScheduler(cluster, {}, relax="node")
    for s in (relaxed, strict):
        s.fail([f"node{h}/gpu{k}" for h in range(4) for k in range(4)])  # half of every host out of service
    assert relaxed.allocate("eight", 8).ok  # split into two numa pieces on two hosts
    r = strict.allocate("eight", 8)
    assert not r.ok and r.reason["level"] == "host"  # HiveD: a pod stays within one node
    with pytest.raises(InputError, match="relax"):
        HivedScheduler(cluster, {}, relax="sometimes")
