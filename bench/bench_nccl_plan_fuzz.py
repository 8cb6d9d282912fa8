"""Differential fuzz of the NCCL flow-plan grammar: how often the C parser (the plugin) and the Python
path disagree on the same bytes, before (commit 654868c: two hand-written parsers) and now (one C
parser; Python marshals its result, writes it back with ``format_plan`` and mirrors the resolution).

Plans come from ``csrc/tests/plan_fuzz.py`` (grammar-aware mutations of random valid plans, seeded).

* before: the old ``csrc/`` built from ``git archive 654868c`` in a temporary directory and the old
  ``flowsched/ncclhook.py`` of that commit. A disagreement is a different verdict (accept/reject,
  a Python exception other than the checker's own counts as a reject without a line), a different
  error line, or different marks resolved for the plan's communicators (``netweave_plan_resolve_text``
  vs ``FlowPlan.resolve``).
* now: the plugin through ``csrc/build/plan_check`` (dlopen, as NCCL loads it) against
  ``parse_plan``/``format_plan``/``FlowPlan.resolve`` -- the same checks plus the canonical text
  byte for byte and the error message (``plan_fuzz.disagreement``).

Writes ``bench/results/robustness_nccl_plan.{json,md}``. ``python bench/bench_nccl_plan_fuzz.py [--plans N] [--seed S]``.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import io
import random
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from bench._common import write_results
from flowsched import ncclhook

BEFORE = "654868c"


def load_fuzz():
    spec = importlib.util.spec_from_file_location("plan_fuzz", ncclhook.CSRC / "tests" / "plan_fuzz.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def old_tree(tmp: Path) -> tuple[object, Path]:
    """The parsers of commit BEFORE: its ncclhook module and its plugin library, built in tmp."""
    archive = subprocess.run(["git", "-C", str(ncclhook.REPO), "archive", BEFORE, "csrc", "flowsched/ncclhook.py"], capture_output=True,
                             check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tmp, filter="data")
    subprocess.run(["make", "-s", "-C", str(tmp / "csrc"), "build/libnccl-net-netweave.so"], check=True, capture_output=True)
    spec = importlib.util.spec_from_file_location(f"ncclhook_{BEFORE}", tmp / "flowsched" / "ncclhook.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod, tmp / "csrc" / "build" / "libnccl-net-netweave.so"


def before_disagrees(fuzz, old, resolve, data: bytes) -> bool:
    try:
        plan = old.parse_plan(data.decode("utf-8"), source="fuzz")  # the old read_plan: Path.read_text()
        py = None
    except old.NcclHookError as e:
        plan, py = None, e.where if isinstance(e.where, int) else -1
    except Exception:  # UnicodeDecodeError, ValueError...: no line
        plan, py = None, -1
    c_text = data.split(b"\0", 1)[0]  # the old plugin read the file into a C string
    c0 = resolve(c_text, 0, -1, 0)
    if isinstance(c0, str) or plan is None:
        c_line = int(c0.split(":", 1)[0].split()[1]) if isinstance(c0, str) else None
        return not (isinstance(c0, str) and plan is None and c_line == py)
    for comm, order, cls in fuzz.probes(plan):
        mine = plan.resolve(None if cls < 0 else cls, comm_id=comm, order=None if order < 0 else order)
        if resolve(c_text, comm, order, cls) != mine:
            return True
    return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plans", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=19)
    args = ap.parse_args(argv)
    fuzz = load_fuzz()
    rnd = random.Random(args.seed)
    plans = []
    for i in range(args.plans):  # one third from each single mutation, the rest mixed
        only = [list(fuzz.MUTATIONS)[i % len(fuzz.MUTATIONS)]] if i % 3 == 0 else None
        plans.append(fuzz.fuzz_plan(rnd, only))
    build_dir = ncclhook.build()
    now_c = fuzz.check_batch(str(build_dir / "plan_check"), str(build_dir / ncclhook.PLUGIN_LIB), plans)
    now_resolve = fuzz.c_resolver(build_dir / ncclhook.PLUGIN_LIB)
    now_bad = [i for i, (p, c) in enumerate(zip(plans, now_c, strict=True)) if fuzz.disagreement(p, c, now_resolve) is not None]
    accepted_now = sum(c.startswith("OK\n") for c in now_c)
    with tempfile.TemporaryDirectory(prefix="csrc_bench_") as tmp:
        old, old_lib = old_tree(Path(tmp))
        old_resolve = fuzz.c_resolver(old_lib)
        before_bad = [i for i, p in enumerate(plans) if before_disagrees(fuzz, old, old_resolve, p)]
    by_kind: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    for i in range(len(plans)):
        kind = list(fuzz.MUTATIONS)[i % len(fuzz.MUTATIONS)] if i % 3 == 0 else "mixed"
        by_kind[kind][0] += 1
        by_kind[kind][1] += i in set(before_bad)
        by_kind[kind][2] += i in set(now_bad)
    rows = [{"mutation": k, "plans": n, "disagree before": b, "disagree now": a} for k, (n, b, a) in sorted(by_kind.items())]
    rows.append({"mutation": "all", "plans": len(plans), "disagree before": len(before_bad), "disagree now": len(now_bad)})
    notes = (f"{len(plans)} plans from `csrc/tests/plan_fuzz.py` (seed {args.seed}; a third with one named mutation each, the rest "
             f"mixed; {accepted_now} are valid plans now). Before = commit {BEFORE}, a C and a Python parser: a disagreement is a "
             "different verdict, error line or resolved marks. Now = one C parser (the plugin, through `csrc/build/plan_check`) and "
             "the Python path that marshals, re-writes and resolves its result: the same checks plus the canonical text and the "
             f"message.\n\n**{len(before_bad)} of {len(plans)} ({100 * len(before_bad) / len(plans):.0f} %) disagreed before, "
             f"{len(now_bad)} now.**")
    write_results("robustness_nccl_plan", rows, title="Differential fuzz of the NCCL flow-plan grammar (C plugin vs Python path)",
                  notes=notes, extra={"seed": args.seed, "before_commit": BEFORE, "plans": len(plans), "accepted_now": accepted_now,
                                      "disagreements_before": len(before_bad), "disagreements_now": len(now_bad)})
    print(f"{len(plans)} plans: {len(before_bad)} disagreements before, {len(now_bad)} now")
    return 0 if not now_bad else 1


if __name__ == "__main__":
    sys.exit(main())
