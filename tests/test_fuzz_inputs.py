"""Bad input, whatever the bytes: exit 2 with one line and no traceback, before any work; names, bounds and state.

The fuzz part drives :mod:`bench.robustness` (every file-taking CLI verb, run in-process through
``netweave.cli.main``) with hypothesis: mutations of valid files (bit flips, truncation, non-UTF-8, huge numbers,
NaN/inf, deep nesting, wrong types, unsafe names) and the hand-made cases of issue #19. Budget: a fixed number of
derandomised examples per verb, so the file runs in about two minutes on a shared 2-core machine.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.robustness import VERBS, expand, hand_made_cases, make_seeds, mutate, run_cli, run_hand_made
from netweave.cli import main
from topology.errors import InputError
from topology.inputs import check_interface, check_name, check_node_id, check_output, loads_json, loads_yaml, read_text

FUZZ = settings(max_examples=12, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    return make_seeds(tmp_path_factory.mktemp("seeds"))


# -- fuzz: every verb, every mutation kind ----------------------------------------------------------------------


@pytest.mark.parametrize("verb", VERBS, ids=[v.name for v in VERBS])
def test_mutated_inputs_keep_the_one_line_contract(verb, seeds, tmp_path):
    @FUZZ
    @given(rng=st.randoms(use_true_random=False))
    def check(rng):
        kind, data = mutate(seeds[verb.seed].read_bytes(), rng)
        f = tmp_path / f"in{Path(verb.seed).suffix}"
        f.write_bytes(data)
        outcome = run_cli(expand(verb, f, tmp_path / "out", seeds[verb.seed].parent))
        assert outcome.failure is None, f"{verb.name}, {kind} mutation: {outcome.failure}\n{outcome.error or outcome.stderr}"

    check()


@pytest.mark.parametrize("verb", VERBS, ids=[v.name for v in VERBS])
def test_valid_seed_files_run(verb, seeds, tmp_path):
    outcome = run_cli(expand(verb, seeds[verb.seed], tmp_path / "out", seeds[verb.seed].parent))
    assert outcome.code == 0 and outcome.failure is None, outcome.stderr


CASES = hand_made_cases()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_hand_made_bad_input_is_exit_2_and_one_line(case, seeds, tmp_path):
    outcome = run_hand_made(case, tmp_path, seeds["jobs.yaml"].parent)
    assert outcome.failure is None and outcome.code == 2, f"{case[0]}: {outcome.failure or outcome.error}: {outcome.stderr!r}"


# -- the shared validators --------------------------------------------------------------------------------------


@given(st.text(max_size=40))
def test_a_checked_name_stays_inside_its_directory(text):
    try:
        name = check_name(text)
    except InputError as exc:
        assert "\n" not in str(exc).replace("\\n", "")  # the message is one line whatever the name
        return
    d = Path("/netweave-dir")
    assert (d / f"{name}.hostfile").resolve().parent == d
    assert name.strip() == name and not name.startswith(("-", ".")) and name.isprintable()


@given(st.text(max_size=20))
def test_a_checked_interface_is_one_shell_word(text):
    try:
        dev = check_interface(text)
    except InputError:
        return
    assert len(dev) <= 15 and dev.split() == [dev] and "/" not in dev


def test_node_ids_are_names_joined_by_slashes():
    assert check_node_id("node0/gpu3") == "node0/gpu3"
    for bad in ("node0//gpu3", "/x", "x/", "../x", "a/../b", "a\nb", 3, ["a"]):
        with pytest.raises(InputError):
            check_node_id(bad)


finite_json = st.recursive(st.none() | st.booleans() | st.integers(-2**53, 2**53) | st.floats(allow_nan=False, allow_infinity=False)
                           | st.text(max_size=8), lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=5), kids, max_size=4),
                           max_leaves=20)


@given(finite_json)
def test_json_round_trip_through_the_one_reader(doc):
    assert loads_json(json.dumps(doc)) == doc


def test_non_finite_numbers_are_refused_with_their_field():
    for text in ('{"a": {"bw": NaN}}', '{"a": {"bw": Infinity}}', '{"a": {"bw": 1e400}}'):
        with pytest.raises(InputError, match="finite"):
            loads_json(text)
    with pytest.raises(InputError, match=r"a\[1\]: expected a finite number"):
        loads_yaml("a: [1, .inf]")


def test_a_yaml_alias_bomb_costs_nothing():
    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(8))
    t0 = time.perf_counter()
    loads_yaml(bomb)  # 10^9 leaves if expanded
    assert time.perf_counter() - t0 < 5


def test_deep_nesting_is_refused_in_both_formats():
    for loads, text in ((loads_json, "[" * 100_000 + "]" * 100_000), (loads_yaml, "[" * 100_000 + "]" * 100_000),
                        (loads_json, "[" * 65 + "]" * 65)):
        with pytest.raises(InputError, match="deeper|nesting"):
            loads(text)


def test_non_utf8_names_the_line_and_offset(tmp_path):
    f = tmp_path / "x.yaml"
    f.write_bytes(b"jobs:\n  - {name: \xff}\n")
    with pytest.raises(InputError, match=r"line 2: not UTF-8 text \(byte 0xff at offset 17\)"):
        read_text(f)


@pytest.mark.parametrize("path, directory, needle", [
    ("/dev/null/x", False, "is not a directory"), ("/proc/netweave-x", False, "cannot write"), ("/", False, "it is a directory"),
    ("/dev/null", True, "not a directory"),
])
def test_unwritable_outputs(path, directory, needle):
    with pytest.raises(InputError, match=needle):
        check_output(path, directory=directory)


def test_writable_output_leaves_nothing_behind(tmp_path):
    check_output(tmp_path / "new" / "deeper" / "out.json")
    check_output(tmp_path / "dir", directory=True)
    assert list(tmp_path.iterdir()) == []


# -- regressions of issue #19, one per item ---------------------------------------------------------------------


def run(argv, capsys):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("name", ["../../escaped", "/tmp/netweave-input-abs/x", "a\nb", "sub/dir"])
def test_hostfiles_never_leave_their_directory(name, tmp_path, capsys):
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(json.dumps({"jobs": [{"name": name, "gpus": 1}]}))
    hostfiles = tmp_path / "a" / "b" / "hf"
    code, _, err = run(["place", "plan", "--topology", "default", "--jobs", jobs, "--hostfiles", hostfiles], capsys)
    assert code == 2 and err.count("\n") == 1 and "jobs[0].name" in err
    assert not hostfiles.exists() and not (tmp_path / "escaped.hostfile").exists() and not Path("/tmp/netweave-input-abs").exists()
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["jobs.yaml"]  # not even the --hostfiles directory


def test_flow_apply_does_not_print_an_injected_command(tmp_path, capsys, seeds):
    code, out, err = run(["flow", "apply", seeds["flowplan.json"], "--host", "node0", "--dry-run", "--dev", "lo\nqdisc del dev eth0 root"], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1 and "--dev" in err


def test_emu_run_checks_its_output_before_simulating(tmp_path, capsys, seeds, monkeypatch):
    import emu.sim

    def refuse(*args, **kwargs):
        raise AssertionError("the simulation ran before the output was checked")

    monkeypatch.setattr(emu.sim, "simulate", refuse)
    for out in ("/proc/netweave-x", seeds["jobs.yaml"]):
        code, _, err = run(["emu", "run", seeds["workload.yaml"], "--topology", seeds["cluster.json"], "--out", out], capsys)
        assert code == 2 and err.startswith("netweave: error: --out: cannot write") and err.count("\n") == 1


def test_slurm_hostlist_bomb_is_refused_at_once(tmp_path, capsys):
    conf = tmp_path / "t.conf"
    conf.write_text("SwitchName=s0 Nodes=a[0-9999]b[0-9999]\n")
    t0 = time.perf_counter()
    code, _, err = run(["topo", "import", conf, "--format", "slurm", "--out", tmp_path / "o.json"], capsys)
    assert code == 2 and "more than 65536 hosts (the limit)" in err and time.perf_counter() - t0 < 10


def test_quota_of_2_31_cells_is_refused_at_once(tmp_path, capsys):
    jobs = tmp_path / "j.yaml"
    jobs.write_text("virtual_clusters: {v: {host: 2147483648}}\njobs: [{name: a, gpus: 1, vc: v}]\n")
    t0 = time.perf_counter()
    code, _, err = run(["place", "check", "--topology", "default", "--jobs", jobs], capsys)
    assert code == 2 and "virtual_clusters.v.host" in err and "(the limit)" in err and time.perf_counter() - t0 < 10
    jobs.write_text("virtual_clusters: {v: {host: 1000000}}\njobs: [{name: a, gpus: 1, vc: v}]\n")
    code, _, err = run(["place", "check", "--topology", "default", "--jobs", jobs], capsys)
    assert code == 2 and "short of 999996 cell(s)" in err and time.perf_counter() - t0 < 20


def test_place_check_refuses_a_job_larger_than_the_cluster_or_its_quota(tmp_path, capsys):
    jobs = tmp_path / "j.yaml"
    jobs.write_text("jobs: [{name: a, gpus: 1000000000}]\n")
    code, _, err = run(["place", "check", "--topology", "default", "--jobs", jobs], capsys)
    assert code == 2 and "jobs[0].gpus" in err and "1048576 (the limit)" in err
    jobs.write_text("virtual_clusters: {v: {host: 1}}\njobs: [{name: a, gpus: 16, vc: v}]\n")
    code, _, err = run(["place", "check", "--topology", "default", "--jobs", jobs], capsys)
    assert code == 2 and "quota of 8" in err
    jobs.write_text("jobs: [{name: a, gpus: 33}]\n")
    code, _, err = run(["place", "check", "--topology", "default", "--jobs", jobs], capsys)
    assert code == 2 and "the cluster has 32" in err


def test_place_replay_refuses_a_job_larger_than_the_cluster(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text("name,arrival_s,gpus,duration_s\na,0,64,100\n")
    code, out, err = run(["place", "replay", "--topology", "default", "--trace", trace, "--policy", "fifo"], capsys)
    assert code == 2 and "'a' asks for 64 GPUs; the cluster has 32" in err and out == ""


@pytest.mark.parametrize("flag, value", [("--nic-gbps", "0"), ("--nic-gbps", "inf"), ("--nic-gbps", "nan"), ("--nic-gbps", "-400")])
def test_nic_speeds_must_be_positive_and_finite(flag, value, tmp_path, capsys):
    conf = tmp_path / "t.conf"
    conf.write_text("SwitchName=s0 Nodes=a[0-1]\n")
    code, _, err = run(["topo", "import", conf, "--format", "slurm", flag, value, "--out", tmp_path / "o.json"], capsys)
    assert code == 2 and "--nic-gbps: expected a rate in Gb/s" in err  # the flag as typed (topology.units)
    assert not (tmp_path / "o.json").exists()


def test_trace_rows_ending_before_they_start_are_errors(tmp_path, capsys):
    pai = tmp_path / "p.csv"
    pai.write_text("j,t,1,Terminated,100.0,50.0,600.0,29.3,100.0,V100\n")
    code, _, err = run(["place", "trace", "--pai", pai, "--out", tmp_path / "o.csv"], capsys)
    assert code == 2 and "line 1: end_time 50.0 precedes start_time 100.0" in err


def test_topology_schema_errors_name_the_field(tmp_path, capsys):
    bad = tmp_path / "t.json"
    nodes = [{"id": "h/gpu0", "kind": "gpu", "host": "h"}, {"id": "h/gpu0", "kind": "gpu", "host": "h"}]
    bad.write_text(json.dumps({"format": "netweave-topology", "version": 1, "nodes": nodes, "links": []}))
    code, _, err = run(["topo", "show", bad], capsys)
    assert code == 2 and err.strip().endswith("nodes[1].id: node id 'h/gpu0' is used twice")


# -- the planner's state file -----------------------------------------------------------------------------------


def _plan(capsys, state, jobs, tmp_path, *extra):
    f = tmp_path / f"jobs-{jobs[0]['name']}.yaml"
    f.write_text(json.dumps({"jobs": jobs}))
    code, out, err = run(["place", "plan", "--topology", "default", "--jobs", f, "--state", state, "--policy", "hived", "--json", *extra], capsys)
    return code, (json.loads(out) if out else None), err


def test_two_runs_with_a_state_never_share_gpus(tmp_path, capsys):
    state = tmp_path / "s" / "cluster.state"
    code, first, _ = _plan(capsys, state, [{"name": "a", "gpus": 16}], tmp_path)
    assert code == 0
    code, second, _ = _plan(capsys, state, [{"name": "b", "gpus": 16}], tmp_path)
    assert code == 0 and not set(first["jobs"][0]["gpus"]) & set(second["jobs"][0]["gpus"])
    code, third, _ = _plan(capsys, state, [{"name": "c", "gpus": 8}], tmp_path)
    assert code == 1 and third["unplaced"] == 1  # the cluster is full
    code, _, err = _plan(capsys, state, [{"name": "a", "gpus": 8}], tmp_path)
    assert code == 2 and "already holds GPUs" in err
    code, out, _ = run(["place", "release", "--topology", "default", "--state", state, "a", "--json"], capsys)
    assert code == 0 and json.loads(out)["running_jobs"] == ["b"]
    code, again, _ = _plan(capsys, state, [{"name": "c", "gpus": 8}], tmp_path)
    assert code == 0 and set(again["jobs"][0]["gpus"]) <= set(first["jobs"][0]["gpus"])
    code, _, err = run(["place", "release", "--topology", "default", "--state", state, "zzz"], capsys)
    assert code == 2 and "'zzz' holds no GPUs" in err


def test_state_removes_stale_temp_files(tmp_path, capsys):
    state = tmp_path / "cluster.state"
    stale = tmp_path / ".cluster.state.abc123.tmp"
    stale.write_text("half a write")
    code, _, _ = _plan(capsys, state, [{"name": "a", "gpus": 8}], tmp_path)
    assert code == 0 and not stale.exists() and state.exists()


def test_state_refuses_first_fit_and_another_topology(tmp_path, capsys):
    state = tmp_path / "cluster.state"
    code, _, err = _plan(capsys, state, [{"name": "a", "gpus": 8}], tmp_path, "--policy", "first-fit")
    assert code == 2 and "first-fit" in err
    _plan(capsys, state, [{"name": "a", "gpus": 8}], tmp_path)
    small = tmp_path / "small.json"
    run(["topo", "build", "rail-optimized", "--nodes", "2", "--out", small], capsys)
    code, _, err = run(["place", "release", "--topology", small, "--state", state, "a"], capsys)
    assert code == 2 and "written for topology" in err


_CONCURRENT = """
import json, sys
from netweave.cli import main
sys.exit(main(["place", "plan", "--topology", "default", "--jobs", sys.argv[1], "--state", sys.argv[2], "--policy", "hived", "--out", sys.argv[3]]))
"""


def test_concurrent_runs_serialise_on_the_lock(tmp_path):
    state = tmp_path / "cluster.state"
    procs = []
    for k in range(4):
        jobs = tmp_path / f"j{k}.yaml"
        jobs.write_text(json.dumps({"jobs": [{"name": f"job{k}", "gpus": 8}]}))
        procs.append(subprocess.Popen([sys.executable, "-c", _CONCURRENT, str(jobs), str(state), str(tmp_path / f"p{k}.json")],
                                      env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}))
    assert [p.wait(timeout=300) for p in procs] == [0, 0, 0, 0]
    gpus = [set(json.loads((tmp_path / f"p{k}.json").read_text())["jobs"][0]["gpus"]) for k in range(4)]
    assert len(set().union(*gpus)) == 32  # four jobs of 8 on 32 GPUs: all disjoint
    state_jobs = json.loads(state.read_text())["jobs"]
    assert sorted(j["id"] for j in state_jobs) == ["job0", "job1", "job2", "job3"]


def test_state_survives_kill_9_mid_run(tmp_path):
    state = tmp_path / "cluster.state"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    rng = random.Random(7)
    for k in range(4):
        jobs = tmp_path / f"j{k}.yaml"
        jobs.write_text(json.dumps({"jobs": [{"name": f"job{k}", "gpus": 1}]}))
        p = subprocess.Popen([sys.executable, "-c", _CONCURRENT, str(jobs), str(state), str(tmp_path / f"p{k}.json")], env=env)
        time.sleep(rng.uniform(0.5, 3.0))
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
        p.wait()
        if state.exists():  # the old state or the new one, never half of one
            json.loads(state.read_text())
    code = subprocess.run([sys.executable, "-m", "netweave", "place", "release", "--topology", "default", "--state", str(state), "none"],
                          env=env, capture_output=True, text=True)
    assert code.returncode == 2 and ("holds no GPUs" in code.stderr or "no such state file" in code.stderr)
    assert not list(tmp_path.glob(".cluster.state.*.tmp"))
