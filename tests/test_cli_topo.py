"""`netweave topo ...` end to end, through the console entry point."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from netweave.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_build_show_path_export_draw(tmp_path, capsys):
    c = str(tmp_path / "c.json")
    assert run(capsys, "topo", "build", "rail-optimized", "--nodes", "2", "--set", "spines=4", "--out", c)[0] == 0
    code, out, _ = run(capsys, "topo", "show", c, "--json")
    info = json.loads(out)
    assert code == 0 and info["gpus"] == 16 and info["switch_tiers"] == {"spine": 4, "leaf": 8}
    assert info["bisection"]["bw"] == pytest.approx(8 * 50.0)
    classes = {c["path_type"]: c["pairs"] for c in info["gpu_bandwidth_classes"]}
    assert classes == {"NVL": 2 * 8 * 7, "NET": 2 * 8 * 8}
    code, out, _ = run(capsys, "topo", "path", c, "node0/gpu2", "9", "--json")
    path = json.loads(out)
    assert code == 0 and path["path_type"] == "NET" and path["bw"] == pytest.approx(50.0)
    code, out, _ = run(capsys, "topo", "export", c, "--format", "slurm")
    assert code == 0 and "Nodes=node[0-1]" in out
    code, out, _ = run(capsys, "topo", "export", c, "--format", "nccl-xml", "--host", "node1")
    assert code == 0 and out.startswith("<system")
    png = tmp_path / "c.png"
    assert run(capsys, "topo", "draw", c, "--out", str(png))[0] == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_import_round_trip_through_cli(tmp_path, capsys):
    c = str(tmp_path / "n.json")
    assert run(capsys, "topo", "build", "dgx-h100", "--nccl-model", "--out", c)[0] == 0
    xml = tmp_path / "n.xml"
    assert run(capsys, "topo", "export", c, "--format", "nccl-xml", "--out", str(xml))[0] == 0
    back = str(tmp_path / "back.json")
    code, out, _ = run(capsys, "topo", "import", str(xml), "--out", back, "--json")
    assert code == 0 and json.loads(out)["gpus"] == 8


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["topo", "build", "toaster", "--out", "x.json"], "unknown KIND 'toaster'"),
        (["topo", "build", "rail-optimized", "--set", "oversubscription", "--out", "x.json"], "expected KEY=VALUE"),
        (["topo", "show", "missing.json"], "missing.json: cannot read file"),
        (["topo", "import", "missing.xml", "--format", "nccl-xml", "--node", "dgx-h100", "--out", "x.json"], "--node does not apply"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch, argv, needle):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err


def test_malformed_json_names_the_field(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "netweave-topology", "version": 1,
                               "nodes": [{"id": "g", "kind": "gpu", "host": "h"}, {"id": "f", "kind": "gpu", "host": "h"}],
                               "links": [{"src": "g", "dst": "f", "kind": "pcie", "bw": -1}]}))
    code, _, err = run(capsys, "topo", "show", str(bad))
    assert code == 2 and err.strip() == f"netweave: error: {bad}: links[0].bw: expected a bandwidth in GB/s > 0, got -1"


def test_console_script_runs_as_module(tmp_path):
    out = subprocess.run([sys.executable, "-m", "netweave", "topo", "show", str(tmp_path / "none.json")], capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.startswith("netweave: error:")


def test_show_progress_bar_with_eta_on_a_terminal_only(tmp_path, capsys, monkeypatch):
    """A big file shows a rich progress bar with an ETA on stderr when stderr is a terminal; stdout stays the same."""
    import io

    import topology.cli as tcli

    c = str(tmp_path / "c.json")
    assert run(capsys, "topo", "build", "rail-optimized", "--nodes", "2", "--out", c)[0] == 0
    monkeypatch.setattr(tcli, "SHOW_PROGRESS_BYTES", 0)  # treat the file as big
    code, plain_out, plain_err = run(capsys, "topo", "show", c)
    assert code == 0 and plain_err == ""  # not a terminal: no bar

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    monkeypatch.setenv("COLUMNS", "160")
    code, out, _ = run(capsys, "topo", "show", c)
    assert code == 0 and out == plain_out
    assert "ETA" in term.getvalue() and "topo show" in term.getvalue()


def test_show_stage_weights_cover_every_stage():
    from topology import build_cluster
    from topology.cli import SHOW_STAGES, describe
    from topology.clitools import Stages

    with Stages(SHOW_STAGES, enabled=False) as stages:
        with stages.stage("reading"):
            topo = build_cluster(2)
        describe(topo, stages)
    assert stages.done == sum(SHOW_STAGES.values())


def test_builder_quantities_take_units(tmp_path, capsys):
    """``--node-set nic_gbps=50GB/s`` goes through topology.units: the same NIC as ``nic_gbps=400``; a bad value is one line."""
    a, b = str(tmp_path / "a.json"), str(tmp_path / "b.json")
    assert run(capsys, "topo", "build", "rail-optimized", "--nodes", "2", "--node-set", "nic_gbps=50GB/s", "--out", a)[0] == 0
    assert run(capsys, "topo", "build", "rail-optimized", "--nodes", "2", "--node-set", "nic_gbps=400", "--out", b)[0] == 0
    assert json.loads(Path(a).read_text()) == json.loads(Path(b).read_text())
    code, out, err = run(capsys, "topo", "build", "rail-optimized", "--nodes", "2", "--node-set", "nic_gbps=fast", "--out", a)
    assert code == 2 and err.count("\n") == 1 and "--node-set nic_gbps: expected a rate in Gb/s" in err
