"""Small things users hit on the command line: comma lists, builder options, --model from the current directory, pipe export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from netweave.cli import build_parser, main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(("argv", "dest", "expected"), [
    (["place", "plan", "--topology", "t", "--jobs", "j", "--fail", "node1,node2/gpu3", "--fail", "node3"], "fail", ["node1", "node2/gpu3", "node3"]),
    (["place", "check", "--topology", "t", "--jobs", "j", "--fail", "a,b"], "fail", ["a", "b"]),
    (["demo", "--only", "topology,placement", "--only", "flows"], "only", ["topology", "placement", "flows"]),
    (["launch", "--topology", "t", "--jobs", "j", "--out", "o", "--address", "node0=10.0.0.1,node1=10.0.0.2"], "address",
     ["node0=10.0.0.1", "node1=10.0.0.2"]),
    (["launch", "--topology", "t", "--jobs", "j", "--out", "o", "--ifname", "node0=eth1,eth0"], "ifname", ["node0=eth1", "eth0"]),
    (["topo", "build", "rail-optimized", "--set", "oversubscription=2,spines=4", "--set", "hosts_per_su=2", "--out", "c.json"], "set",
     ["oversubscription=2", "spines=4", "hosts_per_su=2"]),
    (["emu", "sweep", "w.yaml", "--set", "jobs.a.start_offset=0,0.001,config.sharing=strict,weighted"], "set",
     ["jobs.a.start_offset=0,0.001", "config.sharing=strict,weighted"]),
])
def test_comma_lists_equal_repeated_flags(argv, dest, expected):
    assert getattr(build_parser().parse_args(argv), dest) == expected


def test_place_plan_fail_keeps_jobs_off_bad_hardware(tmp_path, capsys):
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text("jobs:\n  - {name: a, gpus: 8}\n  - {name: b, gpus: 8}\n")
    for policy in ("hived", "first-fit"):
        code, out, _ = run(capsys, "place", "plan", "--topology", "default", "--jobs", str(jobs), "--policy", policy,
                           "--fail", "node0,node1/gpu0", "--json")
        plan = json.loads(out)
        used = {g for j in plan["jobs"] for g in j["gpus"]}
        assert code == 0 and len(used) == 16, policy
        assert not any(g.startswith("node0/") or g == "node1/gpu0" for g in used), policy
    code, _, err = run(capsys, "place", "plan", "--topology", "default", "--jobs", str(jobs), "--fail", "node9")
    assert code == 2 and "node9" in err and err.count("\n") == 1


@pytest.mark.parametrize(("argv", "message"), [
    (["--set", "foo=1"], "--set foo: not an option of the rail-optimized fabric; known: hosts_per_su, oversubscription, spines"),
    (["--node-set", "foo=1"], "--node-set foo: not an option of node kind dgx-h100; known: model, nccl_model, nic_gbps"),
])
def test_unknown_builder_option_names_the_known_ones(tmp_path, capsys, argv, message):
    code, _, err = run(capsys, "topo", "build", "rail-optimized", "--nodes", "2", *argv, "--out", str(tmp_path / "c.json"))
    assert code == 2 and message in err and "unexpected keyword" not in err and err.count("\n") == 1
    code, _, err = run(capsys, "topo", "build", "dgx-h100", "--set", "foo=1", "--out", str(tmp_path / "n.json"))
    assert code == 2 and "--set foo: not an option of node kind dgx-h100" in err


def test_flow_profile_model_imports_from_the_current_directory(tmp_path, capsys, monkeypatch):
    pkg = tmp_path / "mymodels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mlp.py").write_text("import torch\n\n\ndef make():\n"
                                "    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    code, _, err = run(capsys, "flow", "profile", "--model", "mymodels.mlp:make", "--input-shape", "4,8", "--iterations", "1", "--out", "p.json")
    assert code == 0, err
    assert json.loads(Path("p.json").read_text())
    code, _, err = run(capsys, "flow", "profile", "--model", "mymodels.nope:make", "--input-shape", "4,8", "--out", "q.json")
    assert code == 2 and "--model" in err and "mymodels.nope" in err


def test_pipe_profile_model_imports_from_the_current_directory(tmp_path, capsys, monkeypatch):
    pkg = tmp_path / "mypipe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "chain.py").write_text("import torch\n\n\ndef make():\n"
                                  "    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))\n"
                                  "    return net, (torch.randn(4, 8),)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    code, _, err = run(capsys, "pipe", "profile", "--model", "mypipe.chain:make", "--split", "2", "--repeats", "1", "--out", "p.json")
    assert code == 0, err
    assert json.loads(Path("p.json").read_text())
    code, _, err = run(capsys, "pipe", "profile", "--model", "mypipe.absent:make", "--out", "q.json")
    assert code == 2 and "cannot import 'mypipe.absent'" in err and err.count("\n") == 1


def test_pipe_export_prints_paths_one_per_line(tmp_path, capsys):
    gpt = tmp_path / "gpt.yaml"
    gpt.write_text("name: gpt\nlayers: 4\nhidden: 256\nheads: 4\nseq_len: 128\nvocab: 1000\n")
    out_dir = tmp_path / "exp"
    code, out, err = run(capsys, "pipe", "export", "--model", str(gpt), "--stages", "2", "--microbatches", "4", "--schedule", "1f1b",
                         "--out", str(out_dir))
    assert code == 0
    assert out.splitlines() == [str(out_dir / n) for n in ("schedule.csv", "stages.json", "plan.json")]
    assert all(Path(p).is_file() for p in out.splitlines())
    assert "1f1b plan for gpt" in err and "[" not in out
    code, out, _ = run(capsys, "pipe", "export", "--model", str(gpt), "--stages", "2", "--microbatches", "4", "--schedule", "1f1b",
                       "--out", str(out_dir), "--json")
    data = json.loads(out)
    assert code == 0 and data["files"] == [str(out_dir / n) for n in ("schedule.csv", "stages.json", "plan.json")]
    assert [s["stage"] for s in data["stages"]] == [0, 1]
