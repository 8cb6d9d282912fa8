"""The runtime's GPU check (tests/gpu_runtime_check.py) rehearsed on the CPU with gloo.

The real check needs a GPU and runs where one is lent (results: bench/results/runtime_gpu.*). The rehearsal
runs the same scenarios with gloo: everything but the NCCL checks must pass, so the script keeps working
between GPU runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "gpu_runtime_check.py"


def test_rehearsal_passes_all_but_the_nccl_checks(tmp_path):
    res = subprocess.run([sys.executable, str(SCRIPT), "--cpu-rehearsal", "--out-dir", str(tmp_path), "--steps", "8", "--width", "32",
                          "--depth", "2", "--batch", "4"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 1, res.stdout + res.stderr      # NCCL checks cannot pass without NCCL
    rep = json.loads((tmp_path / "runtime_gpu.json").read_text())
    assert (tmp_path / "runtime_gpu.md").read_text().startswith("# netweave.runtime on a GPU")
    nccl_only = {"backend_is_nccl", "traffic_class_in_communicator"}
    for name in ("ddp", "pipeline"):
        sc = rep["scenarios"][name]
        assert "error" not in sc, sc.get("error")
        assert {k for k, v in sc["checks"].items() if not v} <= nccl_only, sc["checks"]
    assert set(rep["scenarios"]["ddp"]["policies"]) == {"ddp", "bytescheduler", "prophet"}
