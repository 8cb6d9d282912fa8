"""HiveD buddy allocation, VC safety, preemption, bad hardware, state files (placement.hived)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import topology
from placement.cells import cell_hierarchy
from placement.hived import HivedScheduler, QuotaError
from topology.errors import InputError

CHAIN = "H100-SXM5-80GB"


# -- invariant checks shared by the example and property tests ---------------------------
def check_invariants(s: HivedScheduler, *, vc_guarantee: bool = True) -> None:
    for _name, ch in s.chains.items():
        tree = ch.tree
        # binding free list: disjoint maximal cells, no bound cell inside or above, and with the bound roots a partition
        covered = [0] * len(tree.leaves)
        bound_roots = [c for c in tree.cells if ch.bound[c.index] is not None]
        for lv, d in enumerate(ch.bind_free):
            for c in d.values():
                assert c.level == lv
                assert ch.bound_in[c.index] == 0
                assert all(ch.bound[a.index] is None for a in ch.ancestors(c))
                if c.parent is not None:
                    assert not all(k.index in ch.bind_free[k.level] for k in c.parent.children), f"unmerged buddies under {c.parent}"
                for leaf in range(c.lo, c.hi):
                    covered[leaf] += 1
        for c in bound_roots:
            for leaf in range(c.lo, c.hi):
                covered[leaf] += 1
        # every leaf is either in a free cell, a bound cell, or inside a split partially-bound region: no double cover
        assert max(covered) <= 1
        split_region = [i for i, n in enumerate(covered) if n == 0]
        assert not split_region, f"leaves neither free nor bound: {split_region[:4]}"
        # occupancy free list: exactly the idle healthy leaves, as maximal idle cells
        idle = [0] * len(tree.leaves)
        for lv, d in enumerate(ch.occ_free):
            for c in d.values():
                assert c.level == lv and ch.busy[c.index] == 0
                assert c.parent is None or ch.busy[c.parent.index] > 0
                for leaf in range(c.lo, c.hi):
                    idle[leaf] += 1
        for leaf in range(len(tree.leaves)):
            expect = ch.leaf_job[leaf] is None and not ch.leaf_bad[leaf]
            assert idle[leaf] == int(expect)
            assert not (ch.leaf_bad[leaf] and ch.leaf_job[leaf] is not None)
    # jobs: disjoint GPUs; guaranteed jobs only inside their VC's bound cells
    seen = set()
    for j in s.jobs.values():
        gpus = s.job_gpus(j.id)
        assert not seen & set(gpus)
        seen |= set(gpus)
        if j.vc is not None:
            ch = s.chains[j.chain]
            for leaf in j.leaves:
                owner = [ch.bound[a.index] for a in ch.ancestors(ch.leaf_cell[leaf]) if ch.bound[a.index] is not None]
                assert len(owner) == 1 and owner[0].vc == j.vc
    # the safety walk ignoring health never fails (buddy allocation keeps HiveD's invariant)
    for report in s._walk(healthy=False).values():
        assert not report["deficits"], report
    if vc_guarantee:
        assert_each_vc_can_use_its_whole_quota(s)


def assert_each_vc_gets_all_its_quota_cells_at_once(s: HivedScheduler) -> None:
    """On a copy: with every job of one VC stopped, each of its quota cells is allocated at once, whole, preempting only opportunistic work.

    "Whole": the GPUs of a probe for a level-L quota cell are exactly one
    physical level-L cell (no quota cell is split). With bad hardware the
    guarantee may be degraded, but then :meth:`guarantee_report` says so, and the check is skipped.
    """
    if not s.guarantee_report()["ok"]:
        return  # bad hardware degrades guarantees: visibly (the report), which test_bad_hardware_degrades_guarantees_visibly covers
    state = s.to_state()
    for vc, chains in s.vcs.items():
        copy = HivedScheduler.from_state(s.topo, state, trees=s.trees)
        for j in [j.id for j in copy.jobs.values() if j.vc == vc]:
            copy.free(j)
        guaranteed = {j.id for j in copy.jobs.values() if j.vc is not None}
        for chain, vch in chains.items():
            tree = vch.tree
            for i, root in enumerate(sorted(vch.roots, key=lambda r: -r.level)):
                lv = root.level
                res = copy.allocate(f"quota-{vc}-{i}", tree.levels[lv].size, vc=vc, chain=chain, pinned=root.pid)
                assert res.ok, (vc, tree.levels[lv].name, res.reason)
                assert not set(res.preempted) & guaranteed
                leaves = sorted(tree.leaf_of_gpu[g] for g in res.gpus)
                whole = [c for c in tree.cells_at(lv) if c.lo == leaves[0] and c.hi == leaves[-1] + 1]
                assert len(res.cells) == 1 and whole, (vc, tree.levels[lv].name, res.cells)


def assert_opportunistic_pieces_avoid_bound_cells(s: HivedScheduler, job: str) -> None:
    """A piece of an opportunistic job lies inside a VC-bound cell only when no idle cell of its level lies outside every bound cell.

    Checked right after the job's placement: an idle, unbound cell that exists
    now existed when the piece was chosen (an opportunistic placement binds
    nothing and only makes cells busier).
    """
    j = s.jobs[job]
    ch = s.chains[j.chain]
    for c in j.physical:
        if ch.covered[c.index]:
            spare = [k for k in ch.tree.cells_at(c.level)
                     if k.full and ch.busy[k.index] == 0 and not ch.covered[k.index] and not ch.bound_in[k.index]]
            assert not spare, f"{job}: piece {c.address} inside a bound cell while {spare[0].address} is idle and unbound"


def assert_each_vc_can_use_its_whole_quota(s: HivedScheduler) -> None:
    """The guarantee itself: on a copy, every free virtual cell of one VC can be allocated at once (opportunistic jobs preempted)."""
    healthy = all(not any(ch.leaf_bad) for ch in s.chains.values())
    if not healthy:
        return
    if not s.guarantee_report()["ok"]:
        return  # bad hardware degrades guarantees: visibly (the report), which test_bad_hardware_degrades_guarantees_visibly covers
    state = s.to_state()
    for vc, chains in s.vcs.items():
        copy = HivedScheduler.from_state(s.topo, state, trees=s.trees)
        for chain, vch in chains.items():
            sizes = [(vch.tree.levels[lv].size, v.pid or "") for lv in range(len(vch.free)) for v in vch.free[lv].values()]
            for i, (n, pid) in enumerate(sorted(sizes, reverse=True)):
                res = copy.allocate(f"probe-{vc}-{i}", n, vc=vc, chain=chain, priority=0, pinned=pid or None)
                assert res.ok, (vc, n, res.reason)
                assert not set(res.preempted) & {j.id for j in copy.jobs.values() if j.vc is not None}


# -- examples ---------------------------------------------------------------------------
def test_infeasible_quota_names_level_and_missing_cells(cluster):
    with pytest.raises(QuotaError, match=r"level 'host' is short of 1 cell\(s\)"):
        HivedScheduler(cluster, {"a": {"host": 3}, "b": {"hostx2": 1}})
    with pytest.raises(InputError, match="unknown cell level 'rack'"):
        HivedScheduler(cluster, {"a": {"rack": 1}})
    with pytest.raises(InputError, match="non-negative integer"):
        HivedScheduler(cluster, {"a": {"host": -1}})
    # exactly full is fine
    HivedScheduler(cluster, {"a": {"host": 2}, "b": {"hostx2": 1}})


def test_buddy_split_and_merge_restore_the_free_lists(cluster):
    s = HivedScheduler(cluster, {"a": {"su": 1}})
    before = s.free_lists()
    assert before[CHAIN]["binding"] == {"su": ["su0"]}
    r = s.allocate("j", 2, vc="a")
    assert r.ok and r.cells == ["node0/numa0/gpux2.0"]
    # the VC's su cell is bound whole; the physical binding list is empty, the occupancy list split down to the pair
    assert s.free_lists()[CHAIN]["binding"] == {}
    occ = s.free_lists()[CHAIN]["occupancy"]
    assert occ == {"gpux2": ["node0/numa0/gpux2.1"], "numa": ["node0/numa1"], "host": ["node1"], "hostx2": ["su0/hostx2.1"]}
    s.free("j")
    assert s.free_lists() == before


def test_gang_is_all_or_nothing_and_reason_names_level(cluster):
    s = HivedScheduler(cluster, {"a": {"host": 1, "numa": 1}})
    r = s.allocate("big", 16, vc="a")
    assert not r.ok and r.reason["level"] == "hostx2" and r.reason["resource"] == "quota"
    r = s.allocate("mix", 12, vc="a")
    assert r.ok and len(r.gpus) == 12
    r2 = s.allocate("one", 1, vc="a")
    assert not r2.ok and "quota exhausted" in r2.reason["message"]
    before = s.free_lists()
    r3 = s.allocate("too-big", 40)
    assert not r3.ok and s.free_lists() == before and "too-big" not in s.jobs
    check_invariants(s)


def test_opportunistic_jobs_are_preempted_by_guaranteed_ones(cluster):
    s = HivedScheduler(cluster, {"a": {"host": 4}})
    for i in range(4):
        assert s.allocate(f"opp{i}", 8).ok
    assert s.idle_gpus() == 0
    r = s.allocate("g", 8, vc="a", priority=10)
    assert r.ok and len(r.preempted) == 1 and r.preempted[0].startswith("opp")
    assert r.preempted[0] not in s.jobs
    check_invariants(s)


def test_opportunistic_jobs_avoid_bound_cells(cluster):
    s = HivedScheduler(cluster, {"a": {"host": 1}})
    s.allocate("g", 4, vc="a")
    bound_host = s.job_gpus("g")[0].split("/")[0]
    r = s.allocate("o", 4)
    assert r.ok and not any(g.startswith(bound_host + "/") for g in r.gpus)


def test_priority_preemption_inside_a_vc(cluster):
    s = HivedScheduler(cluster, {"a": {"host": 1}, "b": {"host": 1}})
    assert s.allocate("low", 8, vc="a", priority=1).ok
    assert s.allocate("other", 8, vc="b", priority=1).ok
    r = s.allocate("high", 8, vc="a", priority=5)
    assert r.ok and r.preempted == ["low"] and "other" in s.jobs
    # equal priority never preempts, and the state is restored exactly
    before = s.to_state()
    r = s.allocate("peer", 8, vc="a", priority=5)
    assert not r.ok and s.to_state() == before


def test_bad_hardware_degrades_guarantees_visibly(cluster):
    s = HivedScheduler(cluster, {"a": {"host": 2}, "b": {"host": 2}})
    assert s.guarantee_report()["ok"]
    s.allocate("g", 8, vc="a")
    victim_host = s.job_gpus("g")[0].split("/")[0]
    out = s.fail([victim_host])
    assert out["stopped_jobs"] == ["g"] and len(out["failed_gpus"]) == 8
    rep = out["guarantees"]
    assert not rep["ok"]
    d = rep["chains"][CHAIN]["deficits"]
    assert d == [{"level": "host", "missing": 1, "demand": 4, "available": 3}]
    # the free hosts are still usable; the fourth host request fails naming bad hardware
    for i in range(3):
        assert s.allocate(f"h{i}", 8, vc="a" if i < 2 else "b").ok
    r = s.allocate("h3", 8, vc="b")
    assert not r.ok and r.reason["resource"] in ("bad_hardware", "quota")
    back = s.recover([victim_host])
    assert back["recovered_gpus"] and s.allocate("h3", 8, vc="b").ok
    assert s.guarantee_report()["ok"]
    check_invariants(s)


def test_single_bad_gpu_leaves_rest_of_host_usable(cluster):
    s = HivedScheduler(cluster, {"a": {"host": 1}})
    s.fail(["node0/gpu0"])
    r = s.allocate("g", 4, vc="a")
    assert r.ok and "node0/gpu0" not in r.gpus
    r = s.allocate("o", 4)
    assert r.ok and "node0/gpu0" not in r.gpus
    check_invariants(s, vc_guarantee=False)


def test_state_round_trip_is_exact(tmp_path, cluster):
    s = HivedScheduler(cluster, {"a": {"host": 1, "numa": 2}, "b": {"numa": 2}})
    s.allocate("g1", 4, vc="a")
    s.allocate("g2", 2, vc="b")
    s.allocate("o1", 8)
    s.fail(["node3/gpu7"])
    s.free("g1")
    s.allocate("g3", 8, vc="a")
    path = tmp_path / "state.json"
    s.save(str(path))
    t = HivedScheduler.load(cluster, str(path))
    assert t.free_lists() == s.free_lists()
    assert t.to_state() == s.to_state()
    assert {j: t.job_gpus(j) for j in t.jobs} == {j: s.job_gpus(j) for j in s.jobs}
    # identical behaviour after reload
    assert t.allocate("n", 4, vc="b").gpus == s.allocate("n", 4, vc="b").gpus


def test_bad_state_files_are_input_errors(tmp_path, cluster):
    p = tmp_path / "s.json"
    p.write_text("{not json")
    with pytest.raises(InputError, match="invalid JSON"):
        HivedScheduler.load(cluster, str(p))
    p.write_text(json.dumps({"format": "other"}))
    with pytest.raises(InputError, match="netweave-hived-state"):
        HivedScheduler.load(cluster, str(p))
    s = HivedScheduler(cluster, {"a": {"host": 1}})
    s.allocate("g", 8, vc="a")
    state = s.to_state()
    state["jobs"][0]["pieces"][0][2] = "node9"
    with pytest.raises(InputError):
        HivedScheduler.from_state(cluster, state)


def test_candidates_are_distinct_and_committable(cluster):
    s = HivedScheduler(cluster, {"a": {"host": 2}})
    s.allocate("o", 8)
    before = s.to_state()
    cands = s.candidates("new", 4, vc="a", limit=4)
    assert s.to_state() == before  # dry runs change nothing
    assert len(cands) >= 2 and len({frozenset(c.gpus) for c in cands}) == len(cands)
    pick = cands[-1]
    r = s.allocate("new", 4, vc="a", plan=pick.plan)
    assert r.ok and r.gpus == pick.gpus
    check_invariants(s)


# -- property test: random allocate/free/fail/recover sequences ---------------------------
TOPOLOGIES = {
    "dgx-h100x4": (topology.default_cluster(), {"a": {"host": 1, "numa": 1}, "b": {"hostx2": 1}, "c": {"gpux2": 1, "gpu": 1}}),
    "dgx-a100x6-partial-su": (topology.build_cluster(6, node="dgx-a100", hosts_per_su=4),
                              {"a": {"host": 2}, "b": {"numa": 3, "pcie": 1}, "c": {"hostx2": 1}}),
    "dgx-h100x4-pinned": (topology.default_cluster(), {"a": {"host": 1}, "b": {"numa": 2}, "c": {"gpux2": 2}}),
}
TREES = {k: cell_hierarchy(t) for k, (t, _) in TOPOLOGIES.items()}
PINNED = {"dgx-h100x4-pinned": {"a": ["node3"], "c": ["node2/numa1"]}}  # HiveD's pinned cells: bound for good


def _as_sets(lists):
    return {chain: {kind: {lv: set(cells) for lv, cells in d.items()} for kind, d in kinds.items()} for chain, kinds in lists.items()}


class HivedMachine(RuleBasedStateMachine):
    @initialize(which=st.sampled_from(sorted(TOPOLOGIES)))
    def setup(self, which):
        topo, vcs = TOPOLOGIES[which]
        self.s = HivedScheduler(topo, vcs, trees=TREES[which], pinned=PINNED.get(which))
        self.pins = [(vc, addr) for vc, addrs in PINNED.get(which, {}).items() for addr in addrs]
        self.n = 0
        self.gpus = topo.gpus()

    @rule(vc=st.sampled_from(["a", "b", "c", None]), size=st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]), prio=st.integers(0, 3),
          lazy=st.booleans())
    def allocate(self, vc, size, prio, lazy):
        self.n += 1
        before = self.s.to_state()
        res = self.s.allocate(f"j{self.n}", size, vc=vc, priority=prio, lazy=lazy)
        if res.ok:
            assert len(res.gpus) == size
            if vc is None:
                assert_opportunistic_pieces_avoid_bound_cells(self.s, res.job)
            for d in res.downgraded:  # lazily preempted: still running, now opportunistic, on GPUs the new job does not use
                assert self.s.jobs[d].vc is None and not set(self.s.job_gpus(d)) & set(res.gpus)
        else:
            assert res.reason and res.reason["level"] is not None
            assert _as_sets(self.s.to_state()["free_lists"]) == _as_sets(before["free_lists"])  # a failed gang changes nothing

    @precondition(lambda self: getattr(self, "pins", None))
    @rule(data=st.data(), size=st.sampled_from([1, 2, 4, 8]), prio=st.integers(0, 3))
    def allocate_pinned(self, data, size, prio):
        vc, addr = data.draw(st.sampled_from(self.pins))
        self.n += 1
        res = self.s.allocate(f"j{self.n}", size, vc=vc, priority=prio, pinned=addr)
        cell = self.s.vcs[vc]["H100-SXM5-80GB"].pinned[addr].physical
        assert cell.address == addr  # a pinned cell never unbinds
        if res.ok:
            tree = self.s.trees["H100-SXM5-80GB"]
            assert all(cell.lo <= tree.leaf_of_gpu[g] < cell.hi for g in res.gpus)

    @precondition(lambda self: self.s.jobs)
    @rule(data=st.data())
    def free(self, data):
        job = data.draw(st.sampled_from(sorted(self.s.jobs)))
        self.s.free(job)

    @rule(i=st.integers(0, 10_000))
    def fail(self, i):
        self.s.fail([self.gpus[i % len(self.gpus)]])

    @rule()
    def recover_all(self):
        self.s.recover(self.gpus)

    @invariant()
    def buddy_and_vc_invariants(self):
        if hasattr(self, "s"):
            check_invariants(self.s)
            assert_each_vc_gets_all_its_quota_cells_at_once(self.s)


TestHivedMachine = HivedMachine.TestCase
TestHivedMachine.settings = settings(max_examples=25, stateful_step_count=20, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])
