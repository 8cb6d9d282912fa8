"""The workload description: round trips, defaults, dependencies and error messages."""

from __future__ import annotations

import json

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from emu.workload import (
    CollectivePhase,
    ComputePhase,
    Job,
    P2PPhase,
    Transfer,
    Workload,
    WorkloadError,
    dumps_workload,
    example_workload,
    loads_workload,
    read_workload,
    workload_from_dict,
    write_workload,
)
from topology import default_cluster
from topology.units import parse_duration, parse_size


def sample() -> Workload:
    gpus = ["node0/gpu0", "node0/gpu1", "node1/gpu0", "node1/gpu1"]
    mixed = Job("mixed", tuple(gpus), (
        ComputePhase("fwd", 0.01),
        CollectivePhase("ag", "all_gather", 64e6, algorithm="ring", group=tuple(gpus[:2]), after=("fwd",), priority=2, rate_cap=12.5),
        P2PPhase("act", (Transfer(gpus[0], gpus[2], 1e6), Transfer(gpus[1], gpus[3], 2e6)), after=("fwd",), after_previous=("act",)),
        ComputePhase("bwd", 0.02, after=("ag", "act"), after_previous=()),
    ), iterations=4, arrival=0.5, start_offset=0.001, priority=3, rate_cap=40.0, routing="rail")
    dp = Job.data_parallel("dp", ["node2/gpu0", "node3/gpu0"], compute_s=0.05, nbytes=2**30, iterations=7, priority=1)
    return Workload("sample", (mixed, dp), {"note": "round trip"})


@pytest.mark.parametrize("fmt", ["yaml", "json"])
def test_round_trip_text(fmt):
    w = sample()
    text = dumps_workload(w, fmt)
    back = loads_workload(text, fmt)
    assert back == w and back.meta == w.meta
    assert dumps_workload(back, fmt) == text


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
def test_round_trip_files(tmp_path, suffix):
    w = sample()
    path = tmp_path / f"w{suffix}"
    write_workload(w, path)
    text = path.read_text()
    (json.loads if suffix == ".json" else yaml.safe_load)(text)  # the file is what its name says
    assert read_workload(path) == w


def test_example_round_trips_and_fits_the_default_cluster(tmp_path):
    topo = default_cluster()
    w = example_workload(topo)
    w.validate(topo)
    write_workload(w, tmp_path / "ex.yaml")
    assert read_workload(tmp_path / "ex.yaml") == w


def test_defaults_and_inferred_kinds():
    text = """
jobs:
  - name: a
    gpus: [h/gpu0, h/gpu1]
    phases:
      - {name: c, duration: 5ms}
      - {name: ar, op: all_reduce, bytes: 256MiB, after: [c]}
      - {name: send, src: h/gpu0, dst: h/gpu1, bytes: 1GB, after: [ar]}
"""
    w = loads_workload(text)
    job = w.jobs[0]
    assert job.iterations == 1 and job.priority == 0 and job.start_offset == 0 and job.rate_cap is None
    c, ar, send = job.phases
    assert isinstance(c, ComputePhase) and c.duration == pytest.approx(0.005)
    assert isinstance(ar, CollectivePhase) and ar.nbytes == 2**28 and ar.algorithm == "ring" and ar.group is None
    assert isinstance(send, P2PPhase) and send.transfers == (Transfer("h/gpu0", "h/gpu1", 1e9),)
    assert job.phase_priority(ar) == 0 and job.phase_rate_cap(ar) is None


def test_dependencies_default_to_an_iteration_barrier():
    w = sample()
    within, previous = w.jobs[0].dependencies()
    assert within == [[], [0], [0], [1, 2]]
    # fwd is a root: it waits for every phase of the previous iteration; ag waits through fwd (and for itself);
    # act waits for the previous act only; bwd opted out (after_previous: []) and waits for itself
    assert previous == [[0, 1, 2, 3], [1], [2], [3]]


def test_phase_overrides_job_priority_and_cap():
    job = sample().jobs[0]
    ag, act = job.phases[1], job.phases[2]
    assert job.phase_priority(ag) == 2 and job.phase_rate_cap(ag) == 12.5
    assert job.phase_priority(act) == 3 and job.phase_rate_cap(act) == 40.0


def _bad(mutate, expected: str):
    data = sample().to_dict()
    mutate(data)
    with pytest.raises(WorkloadError) as info:
        workload_from_dict(data, source="w.yaml")
    assert str(info.value).startswith("w.yaml: ")
    assert expected in str(info.value), str(info.value)


def test_errors_name_file_and_field():
    _bad(lambda d: d["jobs"][1]["phases"][1].__setitem__("bytes", -3), "jobs[1].phases[1].bytes: expected a positive number")
    _bad(lambda d: d["jobs"][0]["phases"][0].__setitem__("duration", "soon"), "jobs[0].phases[0].duration: expected a non-negative number")
    _bad(lambda d: d["jobs"][0].__setitem__("priority", 8), "jobs[0].priority: expected a priority class 0..7")
    _bad(lambda d: d["jobs"][0]["phases"][1].__setitem__("op", "allreduce"), "jobs[0].phases[1].op: expected one of all_reduce")
    _bad(lambda d: d["jobs"][0]["phases"][3].__setitem__("after", ["nope"]), "jobs[0].phases[3].after[0]: unknown phase 'nope'")
    _bad(lambda d: d["jobs"][0]["phases"][1].__setitem__("group", ["node9/gpu0"]), "jobs[0].phases[1].group[0]: GPU 'node9/gpu0' is not one")
    _bad(lambda d: d["jobs"][1].__setitem__("name", "mixed"), "jobs[1].name: job name 'mixed' is used twice")
    _bad(lambda d: d["jobs"][0].__setitem__("iterations", 0), "jobs[0].iterations: expected a positive integer")
    _bad(lambda d: d["jobs"][0].__setitem__("rate_cap", 0), "jobs[0].rate_cap: expected a positive number")
    _bad(lambda d: d["jobs"][0].__setitem__("colour", "red"), "jobs[0].colour: unknown field 'colour'")
    _bad(lambda d: d["jobs"][0]["phases"][2]["transfers"][1].pop("dst"), "jobs[0].phases[2].transfers[1].dst: missing required field")
    _bad(lambda d: d.__setitem__("version", 2), "version: unsupported version 2")
    _bad(lambda d: d["jobs"][0]["phases"][0].__setitem__("after", ["bwd"]), "form a cycle: fwd -> bwd")


def test_errors_in_text_and_files(tmp_path):
    with pytest.raises(WorkloadError, match=r"^x.json: line 1: invalid JSON"):
        loads_workload("{nope", "json", source="x.json")
    with pytest.raises(WorkloadError, match=r"^x.yaml: line \d+: invalid YAML"):
        loads_workload("jobs:\n  - [unclosed\n", "yaml", source="x.yaml")
    with pytest.raises(WorkloadError, match="cannot read file"):
        read_workload(tmp_path / "missing.yaml")
    with pytest.raises(WorkloadError, match="jobs: missing required field"):
        loads_workload("name: w\n")


def test_validate_against_topology_names_the_gpu():
    w = Workload("w", [Job.data_parallel("a", ["node0/gpu0", "node7/gpu0"], compute_s=0.1, nbytes=1e6)])
    with pytest.raises(WorkloadError, match=r"jobs\[0\]\.gpus\[1\]: no GPU 'node7/gpu0'"):
        w.validate(default_cluster())
    w2 = Workload("w", [Job.data_parallel("a", ["node0/gpu0", "node0/nic0"], compute_s=0.1, nbytes=1e6)])
    with pytest.raises(WorkloadError, match=r"jobs\[0\]\.gpus\[1\]: 'node0/nic0' is a nic"):
        w2.validate(default_cluster())


def test_helpers_build_valid_jobs():
    dp = Job.data_parallel("dp", ["h/gpu0", "h/gpu1"], compute_s=0.1, nbytes=1e9, iterations=3, start_offset=0.01)
    assert [p.kind for p in dp.phases] == ["compute", "collective"] and dp.phases[1].after == ("compute",)
    pp = Job.pipeline_parallel("pp", [["h/gpu0", "h/gpu1"], ["h/gpu2", "h/gpu3"], ["h/gpu4", "h/gpu5"]], stage_compute_s=0.01,
                               activation_bytes=1e6)
    assert [p.name for p in pp.phases] == ["stage0", "send0", "stage1", "send1", "stage2"]
    assert pp.phases[1].transfers == (Transfer("h/gpu0", "h/gpu2", 1e6), Transfer("h/gpu1", "h/gpu3", 1e6))
    w = Workload("w").add_data_parallel("a", ["h/gpu0", "h/gpu1"], compute_s=0.1, nbytes=1e6).with_job(pp)
    assert [j.name for j in w.jobs] == ["a", "pp"]
    with pytest.raises(WorkloadError, match="expected a positive number"):
        Job.data_parallel("bad", ["h/gpu0", "h/gpu1"], compute_s=0.1, nbytes=0)


def test_units():
    assert parse_size("1.5 GiB") == 1.5 * 2**30 and parse_size("10kB") == 1e4 and parse_size(7) == 7.0
    assert parse_duration("250us") == pytest.approx(250e-6) and parse_duration("2 min") == 120.0
    for bad in ("ten", "5 parsecs", True, None):
        with pytest.raises(ValueError):
            parse_size(bad)


names = st.text("abcdefgh", min_size=1, max_size=6)


@st.composite
def workloads(draw):
    jobs = []
    for j in range(draw(st.integers(1, 3))):
        n = draw(st.integers(2, 4))
        gpus = tuple(f"node{j}/gpu{i}" for i in range(n))
        phase_names = draw(st.lists(names, min_size=1, max_size=5, unique=True))
        phases = []
        for k, name in enumerate(phase_names):
            after = tuple(draw(st.lists(st.sampled_from(phase_names[:k]), unique=True, max_size=2))) if k else ()
            prev = draw(st.one_of(st.none(), st.lists(st.sampled_from(phase_names), unique=True, max_size=2).map(tuple)))
            kind = draw(st.sampled_from(["compute", "collective", "p2p"]))
            prio = draw(st.one_of(st.none(), st.integers(0, 7)))
            cap = draw(st.one_of(st.none(), st.floats(0.5, 400, allow_nan=False)))
            if kind == "compute":
                phases.append(ComputePhase(name, draw(st.floats(0, 1, allow_nan=False)), after, prev))
            elif kind == "collective":
                op = draw(st.sampled_from(["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"]))
                group = draw(st.one_of(st.none(), st.just(gpus[:2])))
                phases.append(CollectivePhase(name, op, float(draw(st.integers(1, 2**34))), "ring", group, after, prev, prio, cap))
            else:
                phases.append(P2PPhase(name, (Transfer(gpus[0], gpus[1], float(draw(st.integers(1, 2**30)))),), after, prev, prio, cap))
        jobs.append(Job(f"job{j}", gpus, tuple(phases), iterations=draw(st.integers(1, 50)), arrival=draw(st.floats(0, 5, allow_nan=False)),
                        start_offset=draw(st.floats(0, 1, allow_nan=False)), priority=draw(st.integers(0, 7)),
                        rate_cap=draw(st.one_of(st.none(), st.floats(1, 100, allow_nan=False))),
                        routing=draw(st.sampled_from([None, "shortest", "ecmp", "rail"]))))
    return Workload(draw(names), tuple(jobs))


@settings(max_examples=40, deadline=None)
@given(workloads(), st.sampled_from(["yaml", "json"]))
def test_round_trip_property(w, fmt):
    assert loads_workload(dumps_workload(w, fmt), fmt) == w


def test_the_documented_example_loads_and_round_trips():
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "workload.md").read_text()
    block = text.split("cat > w.yaml <<'YAML'\n", 1)[1].split("\nYAML\n", 1)[0]  # the guide writes it with a heredoc
    w = loads_workload(block, source="docs/workload.md")
    w.validate(default_cluster())
    b = w.job("dp-b")
    assert b.start_offset == pytest.approx(0.002) and b.rate_cap == 40 and b.phases[1].nbytes == 200e6
    assert b.dependencies()[1] == [[0, 1], [1]]  # compute waits for the previous all-reduce and itself only
    assert w.job("pipe").routing == "rail"
    assert loads_workload(dumps_workload(w, "json"), "json") == w
