"""The top-level command: --version, help, and the one-line error contract for a bad job plan."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_version_matches_pyproject():
    want = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    out = subprocess.run([sys.executable, "-m", "netweave", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"netweave {want}"


def test_torch_requirement_is_a_range_and_the_setup_pins_it():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    torch = next(d for d in deps if d.startswith("torch"))
    assert ">=" in torch and "<" in torch and "==" not in torch
    assert "torch==2.13.0" in (REPO / "Makefile").read_text()
