"""The Ray executor for real: a local Ray instance started here (2 CPUs), sweeps and replay sets against the local executor.

One Ray instance serves the module (starting one costs seconds); it is shut down in ``finally`` whatever happens.
The CLI case connects to it by address from a second process, as ``--address`` on another machine would, so the
driver-joins-a-cluster path (code shipped as runtime_env py_modules) runs too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_sweep import star3, two_jobs

from emu import sweep as sw
from emu.workload import write_workload
from placement.replay_set import replay_many
from placement.traces import synthetic_trace
from topology import default_cluster
from topology.io import write_topology

ray = pytest.importorskip("ray")

AXES = {"jobs.b.start_offset": [0.0, 0.5, 1.0], "config.sharing": ["strict", "weighted"]}


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def test_sweep_rows_are_the_local_rows(ray_cluster):
    ticks = []
    on_ray = sw.sweep(star3(), two_jobs(), AXES, executor=sw.RayExecutor(), progress=lambda d, t: ticks.append((d, t)))
    local = sw.sweep(star3(), two_jobs(), AXES, executor=sw.LocalExecutor(1))
    assert on_ray["executor"] == "ray" and on_ray["rows"] == local["rows"] and on_ray["best"] == local["best"]
    assert ticks == [(d, 6) for d in range(7)]
    assert ray.is_initialized()  # a Ray the caller started is left running


def test_a_task_error_comes_back_as_raised(ray_cluster):
    with pytest.raises(sw.SweepError, match=r"config\.colour: not a simulator setting"):
        sw.sweep(star3(), two_jobs(), {"config.colour": ["red"]}, executor=sw.RayExecutor())


def test_replay_set_matches_the_local_executor(ray_cluster):
    topo = default_cluster()
    traces = {"s1": synthetic_trace(12, seed=1, arrival_rate=1 / 120, mean_duration_s=300),
              "s2": synthetic_trace(12, seed=2, arrival_rate=1 / 120, mean_duration_s=300)}
    policies = ["fifo", "las", "hived+cassini"]
    on_ray = replay_many(topo, traces, policies, executor=sw.RayExecutor(), fluid_radius=None)
    local = replay_many(topo, traces, policies, executor=sw.LocalExecutor(1), fluid_radius=None)
    assert list(on_ray) == list(local) == [(t, p) for t in traces for p in policies]
    for key, r in local.items():
        assert on_ray[key].jobs == r.jobs
        assert {k: v for k, v in on_ray[key].metrics.items() if k != "wall_s"} == {k: v for k, v in r.metrics.items() if k != "wall_s"}


def test_cli_sweep_joins_the_cluster_by_address(ray_cluster, tmp_path):
    write_topology(star3(), tmp_path / "t.json")
    write_workload(two_jobs(), tmp_path / "w.yaml")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "netweave", "emu", "sweep", str(tmp_path / "w.yaml"), "--topology", str(tmp_path / "t.json"),
           "--set", "jobs.b.start_offset=0,0.5,1", "--address", ray_cluster, "--out", str(tmp_path), "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr
    table = json.loads(done.stdout)
    local = sw.sweep(star3(), two_jobs(), {"jobs.b.start_offset": [0, 0.5, 1]}, executor=sw.LocalExecutor(1))
    assert table["executor"] == "ray" and table["rows"] == json.loads(json.dumps(local["rows"]))
    assert f"on the ray executor at {ray_cluster}" in done.stderr and "emu: sweep: 3/3 done" in done.stderr


def test_cli_bad_address_is_one_line_and_exit_2(tmp_path):
    write_workload(two_jobs(), tmp_path / "w.yaml")
    write_topology(star3(), tmp_path / "t.json")
    for address in ("127.0.0.1:1", "not-an-address"):
        cmd = [sys.executable, "-m", "netweave", "emu", "sweep", str(tmp_path / "w.yaml"), "--topology", str(tmp_path / "t.json"),
               "--set", "jobs.b.start_offset=0,1", "--address", address]
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and address in done.stderr, done.stderr
