"""``netweave demo``: the whole stack, end to end, on the embedded default cluster.

Each finished capability adds one section here, so that a newcomer sees every
piece work on the same ``Topology``. Sections print what they did and write
their files (JSON, PNG) under ``--out``.
"""

from __future__ import annotations

import argparse
import importlib
import time
from collections.abc import Callable
from pathlib import Path

from topology import Topology
from topology.clitools import CommaList, add_output, emit
from topology.errors import InputError


def section_topology(topo: Topology, out: Path) -> tuple[dict, str]:
    from topology.cli import describe, format_description
    from topology.draw import draw_topology
    from topology.io import write_topology

    write_topology(topo, out / "cluster.json")
    draw_topology(topo, out / "cluster.png")
    info = describe(topo)
    return info, format_description(info) + f"\n  wrote {out / 'cluster.json'} and {out / 'cluster.png'}"


DEMO_JOBS = """\
# two jobs whose first host is the same (each gets its own master port) and a 2-stage pipeline
jobs:
  - name: dp-prophet
    gpus: 4
    script: {script}
    args: [--steps, "20"]
    model: {{layers: 2, hidden: 32, heads: 4, seq_len: 16, vocab: 64}}
    data_parallel: prophet
  - name: dp-plain
    gpus: 4
    script: {script}
    grad_bytes: 2GB
  - name: pipe2
    gpus: 16
    pp: 2
    microbatches: 8
    script: {script}
    model: {{layers: 22, hidden: 4096, heads: 32, seq_len: 4096, vocab: 50257}}
"""


def section_launch(topo: Topology, out: Path) -> tuple[dict, str]:
    """``netweave launch`` on the demo cluster: three jobs into bundles; show one host's script and the sbatch head."""
    from netweave.launch import launch_text, plan_launch, staging_dir, write_bundles
    from placement.planner import load_jobs_file

    script = Path(__file__).resolve().parent.parent / "examples" / "train_transformer.py"
    if not script.exists():  # a checkout without the example: a script that shows the plan it was given
        script = (out / "show_plan.py").absolute()
        script.write_text("import os\nfrom netweave.runtime.plan import load\nprint(load(os.environ['NETWEAVE_JOB_PLAN']))\n")
    jobs = out / "jobs.yaml"
    jobs.write_text(DEMO_JOBS.format(script=script))
    bundles = out / "bundles"
    lp = plan_launch(topo, load_jobs_file(jobs), jobs_source=str(jobs), out=bundles)
    written = write_bundles(lp, bundles, staging=staging_dir(bundles.absolute()))
    first = lp.bundles[0]
    host = first.plan.hosts[0].host
    shown = [ln for ln in first.host_scripts[host].splitlines() if not ln.startswith("#") or ln.startswith("# InfiniBand")]
    sb = [ln for ln in first.sbatch.splitlines() if ln.startswith("#SBATCH") or ln.startswith("exec srun")]
    text = "\n".join([launch_text(lp, bundles), f"  {first.plan.job}/launch-{host}.sh:", *(f"    {ln}" for ln in shown),
                      f"  {first.plan.job}/job.sbatch:", *(f"    {ln}" for ln in sb)])
    return {"out": str(bundles), "files": written, **lp.summary()}, text


def _package_demo(module: str) -> Callable[[Topology, Path], tuple[dict, str]]:
    def run(topo: Topology, out: Path) -> tuple[dict, str]:
        return importlib.import_module(module).demo(topo, out)

    return run


# (key, title, function): each returns a JSON-able report and the text to print.
SECTIONS: list[tuple[str, str, Callable[[Topology, Path], tuple[dict, str]]]] = [
    ("topology", "Topology: 4 DGX H100 nodes on a rail-optimized 400 Gb/s fabric", section_topology),
    ("placement", "Placement: HiveD cells and virtual clusters, CASSINI time shifts, launch lines", _package_demo("placement.demo")),
    ("pipeline", "Pipeline planner: partition, recomputation, schedule, simulation", _package_demo("pipesched.demo")),
    ("flows", "Flow scheduler: in-job gradient order, cross-job coflow order, rates and classes", _package_demo("flowsched.demo")),
    ("validation", "Validation: the flow-level simulator on the same cluster", _package_demo("emu.demo")),
    ("launch", "Launch: plans to bundles (plan.json, torchrun per host, sbatch, NCCL environment by fabric)", section_launch),
]


def run_demo(out: Path, *, verbose: bool = True, only: list[str] | None = None) -> dict:
    from topology import default_cluster

    out.mkdir(parents=True, exist_ok=True)
    topo = default_cluster()
    report: dict = {"out": str(out), "sections": []}
    chosen = [s for s in SECTIONS if not only or s[0] in only]
    for i, (key, title, fn) in enumerate(chosen, 1):
        started = time.perf_counter()
        if verbose:
            print(f"\n== [{i}/{len(chosen)}] {title}", flush=True)
        section_out = out if key == "topology" else out / key
        section_out.mkdir(parents=True, exist_ok=True)
        data, text = fn(topo, section_out)
        elapsed = time.perf_counter() - started
        report[key] = data
        report["sections"].append({"key": key, "title": title, "seconds": round(elapsed, 3)})
        if verbose:
            print(text)
            print(f"  ({elapsed:.1f} s)")
    return report


def cmd_demo(args: argparse.Namespace) -> int:
    keys = [k for k, _, _ in SECTIONS]
    for k in args.only or []:
        if k not in keys:
            raise InputError(f"--only {k!r}: expected one of {', '.join(keys)}")
    report = run_demo(Path(args.out), verbose=not args.json, only=args.only)
    if args.json:
        emit(args, report, "")
    else:
        print(f"\ndemo finished; files in {args.out}/")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the whole stack end to end on the embedded default cluster")
    add_output(p, "--out", default="netweave-demo", help="directory for the demo's files (default netweave-demo)", directory=True)
    p.add_argument("--only", action=CommaList, metavar="SECTION[,...]",
                   help="run only these sections (repeatable, or a comma list): " + ", ".join(k for k, _, _ in SECTIONS))
    p.add_argument("--json", action="store_true", help="print the demo's report as JSON")
    p.set_defaults(func=cmd_demo)
