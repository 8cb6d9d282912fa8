"""``plan(schedule="auto")`` speed (issue #21.2: under 5 s CPU at 1000 layers / 64 devices) without changing its answers.

The reference (``tests/data/pipe_auto_reference.json``) was recorded from the planner before its speed-ups (commit 45be8d4):
for each shape below, the chosen family, its partition and simulated iteration, and the whole candidate list. Every
optimisation must reproduce it exactly. Re-record only for a deliberate change of results:
``PYTHONPATH=. python tests/test_pipe_auto_speed.py --record``.
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
import time
from pathlib import Path

import pytest
from test_pipe_partition import random_profile

from pipesched.devices import Device, LinkModel
from pipesched.partition import PlanError
from pipesched.plan import plan
from pipesched.profile import GPTConfig, ModelProfile, analytic_profile

REFERENCE = Path(__file__).parent / "data" / "pipe_auto_reference.json"
# CPU seconds allowed for auto at 1000 layers / 64 devices. The goal is 5 s (bench/results/pipesched_plan_speed.md
# measures it); on the shared 2-core machine at load 7-11 the same run's CPU time varied 3.6-7.3 s (contention inflates CPU
# time too), so the test guards against regressions of the old kind (78-131 s) with room for that noise.
AUTO_CPU_BOUND_S = 10.0


def perturbed_gpt(layers: int, hidden: int, seed: int) -> ModelProfile:
    """An analytic GPT whose blocks' forward times vary by +-30 % (so stages differ), as in bench/bench_pipesched.py."""
    prof = analytic_profile(GPTConfig(layers=layers, hidden=hidden, heads=hidden // 128, seq_len=2048, vocab=50257))
    rng = random.Random(seed)
    return dataclasses.replace(prof, layers=tuple(dataclasses.replace(lay, fwd_s=lay.fwd_s * rng.uniform(0.7, 1.3)) for lay in prof.layers))


def shapes() -> dict[str, dict]:
    """name -> plan() arguments: GPTs of several sizes, loose and tight memory, heterogeneous devices and random links."""
    out: dict[str, dict] = {}
    for layers, p, m in ((14, 4, 8), (30, 8, 16), (62, 8, 12), (126, 16, 32)):
        prof = perturbed_gpt(layers, 1024, seed=layers)
        for mem_gib in (80, 6):
            devs = [Device(f"g{i}", memory_bytes=mem_gib * 2**30) for i in range(p)]
            out[f"gpt{len(prof.layers)}-p{p}-m{m}-{mem_gib}GiB"] = dict(profile=prof, devices=devs, links=LinkModel.uniform(p, 100e9, 2e-6),
                                                                        microbatches=m)
    for seed in range(6):
        rng = random.Random(seed)
        p = rng.choice([2, 4, 6])
        prof = random_profile(rng, rng.randint(2 * p, 4 * p))
        devs = [Device(f"d{i}", speed=rng.choice([0.5, 1.0, 2.0]), memory_bytes=rng.choice([400, 1500, 10_000])) for i in range(p)]
        bw = [[rng.uniform(5, 50) for _ in range(p)] for _ in range(p)]
        lat = [[rng.uniform(0, 0.2) for _ in range(p)] for _ in range(p)]
        out[f"random{seed}-p{p}"] = dict(profile=prof, devices=devs, links=LinkModel.from_matrices(bw, lat), microbatches=rng.choice([2, 4, 8, 12]),
                                         tie_margin=rng.choice([0.0, 0.05]))
    return out


def outcome(args: dict) -> dict:
    """What auto answers for these arguments, as plain JSON data (floats round-trip exactly)."""
    try:
        best = plan(schedule="auto", **args)
    except PlanError as exc:
        return {"error": str(exc)}
    return {"family": best.family, "makespan_s": best.sim.makespan, "bound_s": best.bound["bound_s"],
            "stages": [[*st.layers, st.recompute, list(st.devices)] for st in best.partition.stages],
            "peak_memory": best.sim.peak_memory, "alternatives": best.alternatives}


def roundtrip(value):
    return json.loads(json.dumps(value))


@pytest.mark.parametrize("name", sorted(shapes()))
def test_auto_answers_as_recorded(name):
    """auto's chosen plan and its whole candidate list equal what the planner answered before its speed-ups."""
    reference = json.loads(REFERENCE.read_text())
    assert roundtrip(outcome(shapes()[name])) == reference[name]


def big_shape() -> dict:
    prof = perturbed_gpt(998, 4096, seed=0)
    devs = [Device(f"g{i}", memory_bytes=80 * 2**30) for i in range(64)]
    return dict(profile=prof, devices=devs, links=LinkModel.uniform(64, 100e9, 2e-6), microbatches=128)


def test_auto_at_1000_layers_64_devices_is_fast_and_unchanged():
    """Issue #21.2: auto at 1000 layers / 64 devices / 128 micro-batches within its CPU bound, with the recorded answer."""
    reference = json.loads(REFERENCE.read_text())
    args = big_shape()
    c0 = time.process_time()
    got = outcome(args)
    cpu_s = time.process_time() - c0
    assert roundtrip(got) == reference["gpt1000-p64-m128"]
    assert cpu_s < AUTO_CPU_BOUND_S, f"auto took {cpu_s:.2f} s CPU"


if __name__ == "__main__" and "--record" in sys.argv:
    from topology.io import atomic_write_text

    ref = {name: roundtrip(outcome(args)) for name, args in shapes().items()}
    ref["gpt1000-p64-m128"] = roundtrip(outcome(big_shape()))
    atomic_write_text(REFERENCE, json.dumps(ref, indent=1, sort_keys=True) + "\n")
    print(f"recorded {len(ref)} shapes in {REFERENCE}")
