"""``netweave bench`` writes to an output directory; the committed ``bench/results/`` change only on request."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

import netweave.bench as nb
from netweave.cli import main

REPO = Path(__file__).resolve().parents[1]

# A benchmark script written as the real ones are: it imports bench._common and calls write_results.
PROBE = f"""
import sys
sys.path.insert(0, {str(REPO)!r})
from bench._common import write_results
write_results("probe", [{{"argv": " ".join(sys.argv[1:])}}], title="probe")
"""


def _digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.fixture
def probe(tmp_path, monkeypatch):
    script = tmp_path / "bench_probe.py"
    script.write_text(PROBE)
    monkeypatch.setattr(nb, "available", lambda: {"probe": script})
    monkeypatch.delenv(nb.OUT_ENV, raising=False)
    return script


def test_default_out_is_netweave_bench_in_the_current_directory_and_results_stay(probe, tmp_path, monkeypatch, capsys):
    committed = _digest(nb.COMMITTED_RESULTS)
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "probe", "--json", "--extra", "--quick", "--only", "x"]) == 0
    report = json.loads(capsys.readouterr().out)
    out = tmp_path / "netweave-bench"
    assert report == [{"name": "probe", "exit": 0, "seconds": report[0]["seconds"], "out": str(out)}]
    assert json.loads((out / "probe.json").read_text())["rows"] == [{"argv": "--quick --only x"}]
    assert (out / "probe.md").read_text().startswith("# probe")
    assert _digest(nb.COMMITTED_RESULTS) == committed


def test_out_directory_and_repeated_extra(probe, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "probe", "--out", "mine", "--extra=--quick", "--extra", "--seed", "3"]) == 0
    assert json.loads((tmp_path / "mine" / "probe.json").read_text())["rows"] == [{"argv": "--quick --seed 3"}]


def test_update_results_targets_the_committed_directory():
    from types import SimpleNamespace

    assert nb.output_directory(SimpleNamespace(update_results=True, out=None)) == REPO / "bench" / "results"
    assert nb.output_directory(SimpleNamespace(update_results=False, out=None)) == Path.cwd() / "netweave-bench"


def test_bad_output_choices_exit_2(probe, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "probe", "--out", "x", "--update-results"]) == 2
    assert "exclude each other" in capsys.readouterr().err
    (tmp_path / "afile").write_text("")
    assert main(["bench", "probe", "--out", "afile"]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert main(["bench", "nosuch"]) == 2


def test_no_stale_copies_in_results():
    """One current file per benchmark: the numbered / labelled copies of the CPU validation are gone (git keeps them)."""
    stale = sorted(p.name for p in nb.COMMITTED_RESULTS.glob("pipesched_cpu_validation.*.*"))
    assert stale == []
    assert (nb.COMMITTED_RESULTS / "README.md").is_file()
