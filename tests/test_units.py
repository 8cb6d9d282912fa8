"""topology.units: the one parser of sizes, durations and rates, against the parsers it replaced and on the user's paths."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from topology.errors import InputError
from topology.units import parse_duration, parse_rate, parse_size

# What the replaced parsers returned, recorded by running them before they were deleted (commit 45be8d4):
# emu.workload.parse_size (workload files, jobs files, data_parallel knobs, launch memory), pipesched.cli.parse_bytes
# (--memory), emu.workload.parse_duration, placement.traces._num (trace CSV/JSON: Python's float()), and the jobs file's
# compute_ms (float()). None: that parser refused the input.
OLD_SIZES = [  # input, workload parse_size, pipe parse_bytes
    ("2GB", 2e9, 2e9), ("1.5 GiB", 1610612736.0, 1610612736.0), ("500MB", 5e8, 5e8), ("4KiB", 4096.0, 4096.0),
    ("4096", 4096.0, 4096.0), ("0", 0.0, None), ("1.5GB", 1.5e9, 1.5e9), ("2 MB", 2e6, 2e6), ("256MiB", 268435456.0, 268435456.0),
    ("10kB", 1e4, 1e4), ("1TB", 1e12, 1e12), ("2TiB", 2199023255552.0, 2199023255552.0), ("64", 64.0, 64.0),
    ("80GiB", 85899345920.0, 85899345920.0), ("40GB", 4e10, 4e10), (" 3 gb ", 3e9, 3e9), ("7b", 7.0, 7.0), ("7B", 7.0, 7.0),
    ("1e3", 1000.0, None), ("2.5e6KB", 2.5e9, None), (".5MiB", 524288.0, 524288.0), ("5mib", 5242880.0, 5242880.0),
    ("1tb", 1e12, 1e12), ("100", 100.0, 100.0), (3e6, 3e6, 3e6), (7, 7.0, 7.0), (0.5, 0.5, 0.5), ("1KB", 1e3, 1e3),
    ("1kb", 1e3, 1e3), ("2gib", 2147483648.0, 2147483648.0),
]
OLD_DURATIONS = [  # input, workload parse_duration (seconds)
    ("5ms", 0.005), ("120ms", 0.12), ("1.5s", 1.5), ("100us", 1e-4), ("2 min", 120.0), ("250us", 0.00025), ("20µs", 2e-5),
    ("3ns", 3e-9), ("0.1", 0.1), ("2", 2.0), (2, 2.0), (0.25, 0.25), ("1S", 1.0), ("5MS", 0.005), ("1MIN", 60.0), ("7 s", 7.0),
    ("0", 0.0),
]
OLD_TRACE_NUMBERS = [  # input, placement.traces float() (grad_bytes in bytes, arrival_s/duration_s in s, compute_ms in ms)
    ("2e9", 2e9), ("1000", 1000.0), (" 5 ", 5.0), ("+5", 5.0), ("1E5", 1e5), ("0", 0.0), ("0.25", 0.25),
]
# Accepted by an old parser, refused now on purpose: bit symbols in a size (the old parsers read "1Gb" as 10^9 bytes, 8x a
# gigabit), and Python's digit grouping that float() took in a trace.
NOW_REFUSED = [("size", "1Gb"), ("size", "3Mb"), ("size", "1_000")]


@pytest.mark.parametrize(("text", "workload", "pipe"), OLD_SIZES)
def test_sizes_agree_with_the_replaced_parsers(text, workload, pipe):
    new = parse_size(text)
    for old in (workload, pipe):
        if old is not None:
            assert new == pytest.approx(old, rel=1e-12)


@pytest.mark.parametrize(("text", "old"), OLD_DURATIONS)
def test_durations_agree_with_the_replaced_parser(text, old):
    assert parse_duration(text) == pytest.approx(old, rel=1e-12)
    if isinstance(text, str) and any(c.isalpha() for c in text):  # a plain number is in the field's unit
        assert parse_duration(text, unit="ms") == pytest.approx(old * 1e3, rel=1e-12)


@pytest.mark.parametrize(("text", "old"), OLD_TRACE_NUMBERS)
def test_trace_numbers_agree_with_float(text, old):
    assert parse_size(text) == old
    if old <= 3.2e8:  # within the duration limit
        assert parse_duration(text) == old and parse_duration(text, unit="ms") == old


@pytest.mark.parametrize(("kind", "text"), NOW_REFUSED)
def test_deliberately_refused(kind, text):
    with pytest.raises(InputError, match="expected a size"):
        parse_size(text)


def test_the_issue_examples():
    assert [parse_size(x) for x in ("2GB", "1.5 GiB", "500MB", "4KiB")] == [2e9, 1.5 * 2**30, 5e8, 4096.0]
    assert [parse_duration(x) for x in ("120ms", "1.5s", "100us")] == [0.12, 1.5, 1e-4]
    assert [parse_rate(x) for x in ("400Gb/s", "50 GB/s", "100Gbps")] == [50.0, 50.0, 12.5]


@pytest.mark.parametrize("text", ["2G", "5M", "1k", "3Gi"])
def test_ambiguous_size_suffixes(text):
    with pytest.raises(InputError, match=r"grad_bytes: expected a size .*B, kB, MB.*KiB.*ambiguous|iB"):
        parse_size(text, where="grad_bytes")


@pytest.mark.parametrize(("text", "reason"), [("5m", "min or ms"), ("10GBps", "GB/s or Gb/s"), ("100G", "per second"), ("100Gb", "per second")])
def test_ambiguous_duration_and_rate_suffixes(text, reason):
    parse = parse_duration if reason == "min or ms" else parse_rate
    with pytest.raises(InputError, match=reason) as info:
        parse(text, where="f", source="x.yaml")
    assert str(info.value).startswith("x.yaml: f: expected a ") and "\n" not in str(info.value)


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf", "1e400", float("nan"), float("inf"), -1, "-2GB", "-5ms", True, None, [], "", "GB",
                                 "2 GB GB", "0x10", "½GB"])
def test_refuses_nonsense_in_one_line(bad):
    for parse in (parse_size, parse_duration, parse_rate):
        with pytest.raises(InputError) as info:
            parse(bad, where="field")
        assert str(info.value).startswith("field: expected a ") and "\n" not in str(info.value)


def test_zero_and_limits():
    assert parse_size(0) == 0.0 and parse_duration("0ms") == 0.0
    with pytest.raises(InputError, match="> 0"):
        parse_rate(0)
    with pytest.raises(InputError, match="> 0"):
        parse_size("0GB", positive=True)
    with pytest.raises(InputError, match="the limit"):
        parse_size("2000PB")
    with pytest.raises(InputError, match="the limit"):
        parse_duration("1e9 h")
    with pytest.raises(InputError, match="the limit"):
        parse_rate("2000 TB/s")


def test_units_of_rates():
    assert parse_rate("400Gb/s", unit="Gb/s") == 400.0 and parse_rate("400 Gbit/s", unit="B/s") == 5e10
    assert parse_rate("104558Kbit", unit="bit/s") == 104_558_000 and parse_rate("1 GiB/s", unit="B/s") == 2**30
    assert parse_rate("8 Mb/s", unit="MB/s") == 1.0 and parse_rate("100mbit", unit="Mbit/s") == 100.0


@given(st.floats(min_value=0, max_value=1e6, allow_nan=False), st.sampled_from(["B", "kB", "MB", "GB", "KiB", "MiB", "GiB"]),
       st.sampled_from(["B", "MiB", "GB"]))
def test_size_round_trip(x, written, unit):
    """A value written in one unit and read in another is the same quantity (round trip through repr)."""
    got = parse_size(f"{x!r} {written}", unit=unit)
    assert math.isclose(got * parse_size(f"1{unit}"), x * parse_size(f"1{written}"), rel_tol=1e-12, abs_tol=1e-300)


@given(st.floats(min_value=0, max_value=8e4, allow_nan=False), st.sampled_from(["ns", "us", "ms", "s", "min", "h"]))
def test_duration_scales(x, written):
    assert math.isclose(parse_duration(f"{x!r}{written}", unit="ms"), parse_duration(f"{x!r}{written}") * 1e3, rel_tol=1e-12, abs_tol=1e-300)


# -- every reader and flag takes the same forms; every public API the documented units ------------------------------------

def test_trace_csv_takes_what_the_jobs_file_takes():
    """The issue's case: a trace refused grad_bytes 2GB that a jobs file accepted; both now read it, and compute_ms may carry a unit."""
    from placement.profiles import parse_job
    from placement.traces import dumps_trace, loads_trace

    head = "name,arrival_s,gpus,duration_s,compute_ms,grad_bytes\n"
    with_units = loads_trace(head + "a,2min,8,1h,0.1s,2GB\n", source="t.csv")[0]
    plain = loads_trace(head + "a,120,8,3600,100,2000000000\n", source="t.csv")[0]
    assert with_units == plain and loads_trace(dumps_trace([plain]))[0] == plain
    job = parse_job({"name": "a", "gpus": 8, "compute_ms": "100ms", "grad_bytes": "2GB", "arrival": "2min"}, "jobs[0]")
    assert (job.compute_s, job.grad_bytes, job.arrival) == (plain.compute_ms / 1e3, plain.grad_bytes, plain.arrival_s)
    assert parse_job({"name": "a", "gpus": 8, "compute_ms": 100}, "jobs[0]").compute_s == 0.1
    with pytest.raises(InputError, match=r"^t.csv: line 2.grad_bytes: expected a size in bytes .* \('G' is ambiguous"):
        loads_trace(head + "a,0,8,60,100,2G\n", source="t.csv")


def test_data_parallel_knobs_and_memory_in_a_jobs_file():
    from placement.profiles import parse_job

    job = parse_job({"name": "a", "gpus": 8, "memory": "80GiB", "data_parallel": {"policy": "prophet", "partition": "4MiB", "credit": 0}}, "jobs[0]")
    assert job.launch.memory == 80 * 2**30 and job.launch.data_parallel["partition"] == 4 * 2**20 and job.launch.data_parallel["credit"] == 0
    with pytest.raises(InputError, match=r"^jobs.yaml: jobs\[0\].data_parallel.partition: expected a positive size"):
        parse_job({"name": "a", "gpus": 8, "data_parallel": {"policy": "prophet", "partition": "0MB"}}, "jobs[0]", "jobs.yaml")


def test_workload_rate_cap_and_sizes_take_units():
    from emu.workload import example_workload, loads_workload, workload_to_dict

    data = workload_to_dict(example_workload())
    data["jobs"][0]["rate_cap"] = "100Gb/s"
    data["jobs"][0]["phases"][1]["bytes"] = "200MB"
    data["jobs"][0]["phases"][0]["duration"] = "4ms"
    import yaml

    w = loads_workload(yaml.safe_dump(data))
    assert w.jobs[0].rate_cap == 12.5 and w.jobs[0].phases[1].nbytes == 2e8 and w.jobs[0].phases[0].duration == pytest.approx(0.004)


def test_flow_plan_rates_take_units():
    from flowsched.plan import FlowPlanError, loads_plan

    text = ('{"format": "netweave-flow-plan", "version": 1, "hosts": {"node0": {"link_rate": "400Gb/s", '
            '"rules": [{"job": "a", "priority": 0, "rate": "9.6Gb/s"}, {"job": "b", "priority": 1, "rate": 5e8}]}}}')
    hp = loads_plan(text).hosts["node0"]
    assert hp.link_rate == 5e10 and [r.rate for r in hp.rules] == [1.2e9, 5e8]
    with pytest.raises(FlowPlanError, match=r"hosts.node0.link_rate: expected a rate: a number of bytes/s .*400Gb/s"):
        loads_plan(text.replace('"400Gb/s"', '"400G"'))


def test_gradient_profiles_take_gb_per_s():
    """measure_gradient_profile(bandwidth=1.0) is 1 GB/s: the issue's 1.0 gave a 558,632 s iteration (read as 1 byte/s)."""
    torch = pytest.importorskip("torch")
    from flowsched.gradients import GradientProfile, analytic_gradient_profile, measure_gradient_profile
    from flowsched.intrajob import ddp_plan, simulate_iteration

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    p = measure_gradient_profile(model, lambda: (torch.randn(8, 64), torch.randint(0, 10, (8,))), torch.nn.functional.cross_entropy,
                                 bandwidth=1.0, warmup=1, iterations=2)
    assert p.bandwidth == 1.0 and p.bytes_per_s == 1e9
    assert p.comm_time(1) == pytest.approx(p.total_bytes / 1e9)           # 4,810 float32 gradients: ~19 us, not hours
    assert simulate_iteration(p, ddp_plan(p)).iteration_time < 1.0
    a = analytic_gradient_profile(["x"], [1e9], [0.0], [0.0], bandwidth=50.0)          # 1 GB at 50 GB/s
    assert a.comm_time(1) == pytest.approx(0.02) and a.with_bandwidth(100.0).comm_time(1) == pytest.approx(0.01)
    v1 = {**a.to_dict(), "version": 1, "bandwidth": 5e10}                       # version 1 files kept bytes/s
    assert GradientProfile.from_dict(v1).bandwidth == 50.0 and GradientProfile.from_dict(a.to_dict()) == a


def _cli(capsys, *argv):
    from netweave.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_flags_take_units(capsys, tmp_path):
    """--bandwidth, --nic-gbps and --duration read through topology.units: one value, every spelling."""
    import json
    import pathlib

    from flowsched.gradients import analytic_gradient_profile

    prof = tmp_path / "g.json"
    analytic_gradient_profile(["a", "b"], [4e6, 4e6], [1e-3, 1e-3], [2e-3, 2e-3], bandwidth=10.0).save(prof)
    outs = []
    for bw in ("12.5", "100Gb/s", "12.5 GB/s", "100Gbps"):
        code, out, _ = _cli(capsys, "flow", "schedule", "--profile", str(prof), "--policy", "ddp", "--bandwidth", bw, "--json")
        assert code == 0
        outs.append(json.loads(out))
    assert all(o == outs[0] for o in outs)
    code, out, err = _cli(capsys, "flow", "schedule", "--profile", str(prof), "--bandwidth", "100G")
    assert code == 2 and out == "" and err.startswith("netweave: error: --bandwidth: expected a rate in GB/s") and err.count("\n") == 1
    conf = pathlib.Path(__file__).parent / "data" / "slurm_tree.conf"
    sizes = []
    for nic in ("200", "200Gb/s", "25GB/s"):
        code, out, _ = _cli(capsys, "topo", "import", str(conf), "--format", "slurm", "--nic-gbps", nic, "--out", str(tmp_path / "t.json"))
        assert code == 0
        sizes.append((tmp_path / "t.json").read_text())
    assert sizes[0] == sizes[1] == sizes[2]
