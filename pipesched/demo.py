"""``netweave demo`` part for the pipeline planner: plan a GPT model on the default cluster.

>>> import pathlib, tempfile, topology
>>> report, text = demo(topology.default_cluster(), pathlib.Path(tempfile.mkdtemp()))
>>> from pipesched.plan import AUTO_FAMILIES
>>> report["plan"]["schedule"] in AUTO_FAMILIES, report["plan"]["exportable"], report["predicted_s"] >= report["lower_bound_s"]
(True, True, True)
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from .devices import devices_from_topology
from .partition import PlanError
from .plan import plan, uniform_plan
from .profile import GPTConfig, analytic_profile
from .simulate import gantt_png, write_chrome_trace

RESULTS = pathlib.Path(__file__).resolve().parent.parent / "bench" / "results"

# A GPT-3 2.7B-class model (Brown et al. 2020, Table 2.1: 32 layers, d_model 2560, 32 heads, 2048 tokens).
DEMO_MODEL = GPTConfig(layers=32, hidden=2560, heads=32, seq_len=2048, vocab=50257, microbatch_size=2, name="gpt3-2.7b")


def demo(topo: Any, out: pathlib.Path, *, stages: int = 8, microbatches: int = 32) -> tuple[dict[str, Any], str]:
    """Plan :data:`DEMO_MODEL` over the first ``stages`` GPUs of ``topo``; write the Gantt PNG and a trace under ``out``."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    prof = analytic_profile(DEMO_MODEL)
    gpus = topo.gpus()
    if len(gpus) < stages:
        raise PlanError(f"the demo needs {stages} GPUs, the topology has {len(gpus)}")
    # Spread the pipeline over all servers when there are several, so stage boundaries cross the network.
    hosts = topo.hosts()
    per_host = max(1, stages // max(1, len(hosts)))
    chosen = [g for h in hosts for g in topo.gpus(host=h)[:per_host]][:stages]
    if len(chosen) < stages:
        chosen = gpus[:stages]
    devices, links = devices_from_topology(topo, gpus=chosen, reference_tflops=prof.reference.get("tflops"))
    best = plan(prof, devices, links, microbatches=microbatches, schedule="auto")
    base = uniform_plan(prof, devices, links, microbatches=microbatches, family="1f1b")
    png = gantt_png(best.sim, out / "pipeline_gantt.png",
                    title=f"{prof.name}: {best.family}, {best.sim.makespan * 1e3:.1f} ms (bound {best.bound['bound_s'] * 1e3:.1f} ms)")
    trace = write_chrome_trace(out / "pipeline_trace.json", ("predicted", best.sim))
    report = {
        "model": prof.name, "gpus": chosen, "plan": best.to_dict() | {"actions": None}, "predicted_s": best.sim.makespan,
        "lower_bound_s": best.bound["bound_s"], "uniform_1f1b_s": base.sim.makespan, "speedup_vs_uniform_1f1b": base.sim.makespan / best.sim.makespan,
        "files": {"gantt": str(png), "trace": str(trace)},
    }
    text = best.text() + (f"\nuniform split + 1F1B: {base.sim.makespan * 1e3:.4g} ms -> planned {best.sim.makespan * 1e3:.4g} ms "
                          f"({base.sim.makespan / best.sim.makespan:.2f}x)\nGantt chart: {png}\nChrome trace: {trace}")
    recorded = recorded_runs()
    report["recorded_runs"] = recorded
    for r in recorded:
        text += (f"\nrecorded real run ({r['file']}, {r['where']}): our plan {r['speedup']} faster than uniform + torch 1F1B, "
                 f"prediction error {r['errors']}")
    return report, text


ARM_LABELS = {"ours": "our plan", "uniform_torch_1f1b": "uniform + torch 1F1B"}


def recorded_runs() -> list[dict[str, str]]:
    """One line per committed real-run benchmark (CPU with gloo, GPU with NCCL): where, speed-up, prediction errors."""
    out = []
    for name in ("pipesched_cpu_validation", "pipesched_gpu_validation"):
        path = RESULTS / f"{name}.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        reports = data.get("reports") or [data.get("report", {})]
        if isinstance(reports, dict):   # the CPU benchmark keys its cases ("4-auto", "2-auto", ...)
            reports = list(reports.values())
        errors: dict[str, list[float]] = {}
        for rep in reports:
            for rnd in rep.get("rounds", []):
                for arm in rnd.get("order", []):
                    errors.setdefault(arm, []).append(rnd[arm]["error"])
        speedups = [x for rep in reports for x in rep.get("summary", {}).get("speedups", [])]
        if not errors or not speedups:
            continue
        where = f"{reports[0]['device']}, NCCL" if "device" in reports[0] else f"{data['machine']['cpus']} CPUs, gloo"
        where += f", {data['machine']['date']}"
        # Our plan's predictions (the planner's promise) first, the baseline's (a check of the simulator) after.
        parts = [f"{ARM_LABELS.get(arm, arm)} {100 * min(e):+.1f}..{100 * max(e):+.1f} % ({sum(abs(x) <= 0.10 for x in e)} of {len(e)} "
                 "within 10 %)" for arm, e in sorted(errors.items(), key=lambda kv: kv[0] != "ours")]
        out.append({"file": f"bench/results/{name}.md", "where": where,
                    "speedup": f"{min(speedups):.2f}-{max(speedups):.2f}x", "errors": "; ".join(parts)})
    return out
