"""The mid-size case of ``tests/test_sim_scale.py``: the simulator's answers on it were recorded before the scale changes.

Run as a script to (re)record ``tests/data/sim_scale_golden.json`` from the code checked out now:
``PYTHONPATH=. .venv/bin/python tests/sim_scale_case.py``.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

GOLDEN = Path(__file__).resolve().parent / "data" / "sim_scale_golden.json"


def scale_case():
    """256 GPUs (32 DGX H100, rail-optimised) and 24 data-parallel jobs of 2 to 32 GPUs: whole hosts for 8+, packed below,
    mixed priorities and sizes, 3 iterations, staggered starts (the shape of the scale benchmark, at a size a test can run)."""
    import topology
    from emu.workload import Job, Workload, packed_gpu_groups

    topo = topology.build_cluster(32)
    rng = random.Random(7)
    sizes = [32, 16, 16, 8, 8, 8, 8, 8, 4, 4, 4, 4, 2, 2, 2, 2, 2, 2, 4, 4, 2, 2, 2, 2]
    jobs = [Job.data_parallel(f"job{k:02d}", gpus, compute_s=rng.uniform(0.002, 0.02), nbytes=rng.choice([20e6, 50e6, 100e6]),
                              iterations=3, start_offset=rng.uniform(0, 0.01), priority=rng.choice([0, 0, 1]))
            for k, gpus in enumerate(packed_gpu_groups(topo, sizes))]
    return topo, Workload("scale-case", jobs)


def answers(result) -> dict:
    """What must not change: every job's iteration ends, the phase records, and the bytes carried per link."""
    import numpy as np

    links = result.links
    carried = links.util * np.asarray(links.capacity)[:, None] * 1e9 * np.diff(links.bin_edges)[None, :]
    per_link = {name: float(row.sum()) for name, row in zip(links.links, carried, strict=True)}
    return {"ends": {n: js.iteration_ends for n, js in result.jobs.items()},
            "phases": [[p.job, p.iteration, p.phase, p.start, p.end] for p in result.phases],
            "events": result.meta["events"], "link_bytes": per_link}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from emu.sim import simulate
    from topology.io import atomic_write_text

    topo, work = scale_case()
    atomic_write_text(GOLDEN, json.dumps(answers(simulate(topo, work)), indent=0, sort_keys=True) + "\n")
    print(GOLDEN)
