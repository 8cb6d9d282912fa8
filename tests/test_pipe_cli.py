"""``netweave pipe`` actions and the demo hook."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from netweave.cli import main
from pipesched.export import TORCH_CLASSES
from pipesched.partition import FAMILIES

GPT = "model:\n  kind: gpt\n  layers: 12\n  hidden: 1024\n  heads: 16\n  seq_len: 1024\n  vocab: 50257\n"


@pytest.fixture()
def gpt(tmp_path):
    path = tmp_path / "gpt.yaml"
    path.write_text(GPT)
    return path


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_json_and_files(capsys, gpt, tmp_path):
    code, out, _ = run(capsys, "pipe", "plan", "--model", str(gpt), "--stages", "4", "--microbatches", "8", "--memory", "80GiB",
                       "--schedule", "auto", "--json", "--gantt", str(tmp_path / "g.png"), "--trace", str(tmp_path / "t.json"),
                       "--out", str(tmp_path / "plan.json"))
    assert code == 0
    data = json.loads(out)
    assert data["predicted"]["makespan_s"] >= data["lower_bound"]["bound_s"] * (1 - 1e-9)
    assert data["partition"]["stages"][0]["layers"][0] == 0 and data["partition"]["stages"][-1]["layers"][1] == 14
    assert {a["schedule"] for a in data["alternatives"]} == set(FAMILIES)
    assert data["exportable"] and data["torch_class"] == TORCH_CLASSES[data["schedule"]]
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert json.loads((tmp_path / "plan.json").read_text())["schedule"] == data["schedule"]


def test_plan_text_shows_the_lower_bound(capsys, gpt):
    code, out, _ = run(capsys, "pipe", "plan", "--model", str(gpt), "--stages", "2", "--microbatches", "4", "--schedule", "1f1b")
    assert code == 0 and "lower bound (1f1b" in out and "predicted iteration" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["--stages", "20", "--microbatches", "8"], "--stages: 20 stages but the model has only 14 layers"),
    (["--stages", "4", "--microbatches", "8", "--memory", "100MiB"], "--memory: layer 0 (embedding) needs"),
    (["--stages", "4", "--microbatches", "8", "--memory", "80 parsecs"], "--memory: expected a size"),
    (["--stages", "3", "--microbatches", "8", "--schedule", "chimera"], "even number"),
    (["--stages", "4", "--microbatches", "8", "--schedule", "zigzag"], "unknown schedule"),
])
def test_impossible_requests_get_one_line(capsys, gpt, argv, message):
    code, out, err = run(capsys, "pipe", "plan", "--model", str(gpt), *argv)
    assert code == 2 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1


def test_missing_model_file(capsys, tmp_path):
    code, _, err = run(capsys, "pipe", "plan", "--model", str(tmp_path / "nope.yaml"), "--stages", "2", "--microbatches", "2")
    assert code == 2 and "nope.yaml: cannot read" in err


def test_profile_simulate_export(capsys, gpt, tmp_path):
    code, out, _ = run(capsys, "pipe", "profile", "--model", str(gpt), "--out", str(tmp_path / "p.json"), "--json")
    assert code == 0 and json.loads(out)["format"] == "netweave-pipe-profile"
    code, out, _ = run(capsys, "pipe", "simulate", "--profile", str(tmp_path / "p.json"), "--stages", "2", "--microbatches", "4",
                       "--schedule", "gpipe", "--spans", "0:7,7:14", "--json")
    data = json.loads(out)
    assert code == 0 and [s["layers"] for s in data["partition"]["stages"]] == [[0, 7], [7, 14]]
    code, _, err = run(capsys, "pipe", "simulate", "--profile", str(tmp_path / "p.json"), "--stages", "2", "--microbatches", "4",
                       "--spans", "0:5,6:14")
    assert code == 2 and "--spans: spans must be contiguous" in err
    code, out, _ = run(capsys, "pipe", "export", "--model", str(gpt), "--stages", "4", "--microbatches", "8", "--schedule", "zbh1",
                       "--out", str(tmp_path / "exp"), "--json")
    assert code == 0
    rows = (tmp_path / "exp" / "schedule.csv").read_text().splitlines()
    assert len(rows) == 4 and rows[3].startswith("3F0,3I0")
    code, _, err = run(capsys, "pipe", "export", "--model", str(gpt), "--stages", "4", "--microbatches", "8", "--schedule", "chimera",
                       "--out", str(tmp_path / "exp2"))
    assert code == 2 and "two ranks" in err


def test_auto_plans_what_torch_runs_and_its_numbers_agree(capsys, gpt, tmp_path):
    """Issue #21.3: auto ranks only exportable families, `pipe export` exports the plan `pipe plan` chose, and the candidate
    list shows the chosen plan's own predicted iteration; a plan that cannot run says so where it is chosen."""
    args = ["--model", str(gpt), "--stages", "4", "--microbatches", "8", "--schedule", "auto", "--json"]
    code, out, _ = run(capsys, "pipe", "plan", *args)
    planned = json.loads(out)
    assert code == 0 and planned["exportable"]
    mine = [a for a in planned["alternatives"] if a["schedule"] == planned["schedule"]]
    assert mine[0]["makespan_s"] == planned["predicted"]["makespan_s"]
    assert [a for a in planned["alternatives"] if a["schedule"] == "chimera"][0]["error"].startswith("not ranked by auto")
    code, out, _ = run(capsys, "pipe", "export", *args, "--out", str(tmp_path / "exp"))
    exported = json.loads((tmp_path / "exp" / "plan.json").read_text())
    assert code == 0 and exported["schedule"] == planned["schedule"]
    assert exported["predicted"]["makespan_s"] == planned["predicted"]["makespan_s"]
    code, out, _ = run(capsys, "pipe", "plan", "--model", str(gpt), "--stages", "4", "--microbatches", "8", "--schedule", "chimera")
    assert code == 0 and "cannot run in torch.distributed.pipelining" in out


@pytest.mark.parametrize("family", ["zbv", "dualpipev", "interleaved_zb", "looped_bfs"])
def test_new_families_plan_and_export(capsys, gpt, tmp_path, family):
    code, out, _ = run(capsys, "pipe", "export", "--model", str(gpt), "--stages", "2", "--microbatches", "4", "--schedule", family,
                       "--out", str(tmp_path / family), "--json")
    assert code == 0
    plan_json = json.loads((tmp_path / family / "plan.json").read_text())
    assert plan_json["schedule"] == family and plan_json["torch_class"] == TORCH_CLASSES[family] and plan_json["memory_ok"]
    assert len((tmp_path / family / "schedule.csv").read_text().splitlines()) == 2


def test_memory_flag_takes_every_size_form(capsys, gpt):
    """--memory goes through topology.units: 80GiB and 85899345920 are the same; 80G (GB or GiB?) is refused on one line."""
    plans = []
    for memory in ("80GiB", "85899345920"):
        code, out, _ = run(capsys, "pipe", "plan", "--model", str(gpt), "--stages", "2", "--microbatches", "4", "--memory", memory, "--json")
        assert code == 0
        plans.append(json.loads(out))
    assert plans[0] == plans[1]
    code, _, err = run(capsys, "pipe", "plan", "--model", str(gpt), "--stages", "2", "--microbatches", "4", "--memory", "80G")
    assert code == 2 and "error: --memory: expected a size in bytes" in err and "ambiguous" in err and err.count("\n") == 1


def test_demo(tmp_path, cluster):
    from pipesched.demo import demo

    report, text = demo(cluster, pathlib.Path(tmp_path))
    assert report["predicted_s"] >= report["lower_bound_s"] * (1 - 1e-9)
    assert pathlib.Path(report["files"]["gantt"]).read_bytes()[:4] == b"\x89PNG"
    assert "lower bound" in text and json.dumps(report)
    # the committed real runs are summarised from their result files, numbers and all
    for rec in report["recorded_runs"]:
        data = json.loads((pathlib.Path(__file__).resolve().parent.parent / rec["file"]).with_suffix(".json").read_text())
        reports = data.get("reports") or [data.get("report")]
        reports = list(reports.values()) if isinstance(reports, dict) else reports
        n = sum(len(rnd["order"]) for rep in reports for rnd in rep["rounds"])
        counts = [int(c) for c in re.findall(r"of (\d+) within 10 %", rec["errors"])]
        assert sum(counts) == n and rec["errors"].startswith("our plan") and rec["file"] in text
        ours = [rnd["ours"]["error"] for rep in reports for rnd in rep["rounds"]]
        assert f"our plan {100 * min(ours):+.1f}..{100 * max(ours):+.1f} % ({sum(abs(e) <= 0.10 for e in ours)} of {len(ours)}" in rec["errors"]
