"""Robustness benchmark: how many bad inputs break the one-line error contract, before and after a change.

Runs the harness of :mod:`bench.robustness` (every file-taking CLI verb, in-process) twice, in two child
processes: on a checkout of ``--base`` (``git archive`` into a temporary directory) and on this tree, with the
same seeded mutations (``--per-verb`` per verb) and the same hand-made cases. A case fails when an exception
escapes ``netweave.cli.main``, exit 2 comes without exactly one error line, the case runs past 20 s, or (hand-made
cases) the nonsense is accepted with exit 0 or 1. Each child runs under a 3 GiB data limit (``RLIMIT_DATA``) so
that the memory bombs of the old code fail fast instead of taking the shared machine down; such a failure is
counted like any other.

Run: ``.venv/bin/python bench/bench_robustness.py [--base 654868c] [--per-verb 25]`` (about 10 minutes here, most of
it the old code's hangs running into the 20 s limit); writes
``bench/results/robustness.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import write_results  # noqa: E402

_CHILD = """
import resource, sys
resource.setrlimit(resource.RLIMIT_DATA, (3 << 30, 3 << 30))
sys.path.insert(0, {harness!r})
import robustness
sys.exit(robustness.main(sys.argv[1:]))
"""


def run_checkout(code_dir: Path, per_verb: int, seed: int) -> tuple[dict, float]:
    env = {**os.environ, "PYTHONPATH": str(code_dir), "MPLBACKEND": "Agg"}
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _CHILD.format(harness=str(ROOT / "bench")), "--per-verb", str(per_verb), "--seed", str(seed)],
                         env=env, capture_output=True, text=True, cwd=tempfile.gettempdir(), check=False)
    if out.returncode != 0:
        raise SystemExit(f"harness failed on {code_dir}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout), time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default="654868c", help="commit to compare against (default 654868c, before issue #19's input work)")
    p.add_argument("--per-verb", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="input-base-") as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.base], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        before, before_s = run_checkout(Path(tmp), args.per_verb, args.seed)
    after, after_s = run_checkout(ROOT, args.per_verb, args.seed)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    rows = []
    new_verbs = []
    for verb, a in after["per_verb"].items():
        b = before["per_verb"][verb]
        if b["seed_exit"] != 0:  # the verb does not exist before (or fails on its valid seed): nothing to compare
            new_verbs.append(verb)
        rows.append({"verb": verb, "mutations": a["cases"], "failures_before": None if verb in new_verbs else b["failures"],
                     "failures_after": a["failures"], "exit_2_after": a["exit"].get("2", 0)})
    hand_before = [h for h in before["hand_made"] if h["failure"]]
    hand_after = [h for h in after["hand_made"] if h["failure"]]
    total = {"verb": "all mutations", "mutations": sum(r["mutations"] for r in rows),
             "failures_before": sum(r["failures_before"] or 0 for r in rows),
             "failures_after": sum(r["failures_after"] for r in rows), "exit_2_after": sum(r["exit_2_after"] for r in rows)}
    hand = {"verb": "hand-made cases", "mutations": len(after["hand_made"]), "failures_before": len(hand_before),
            "failures_after": len(hand_after), "exit_2_after": sum(1 for h in after["hand_made"] if h["exit"] == 2)}
    rows += [total, hand]
    kinds: dict[str, int] = {}
    for verb, b in before["per_verb"].items():
        for key, n in ({} if verb in new_verbs else b["kinds"]).items():
            kinds[key] = kinds.get(key, 0) + n
    for h in hand_before:
        key = h["failure"].split(":")[0][:60]
        kinds[key] = kinds.get(key, 0) + 1
    notes = f"""
Base `{args.base}` (before this work) against `{head}`, the same {args.per_verb} seeded mutations per verb (seed {args.seed}) and
{len(after['hand_made'])} hand-made cases (issue #19's list: path traversal, non-UTF-8, unwritable outputs, schema holes,
hostlist/quota/model/iteration bombs, NaN/inf/zero/negative rates, self-loops, `NV99999999`, oversized jobs, injected `--dev`).
A mutation fails when an exception escapes `netweave.cli.main`, exit 2 comes without exactly one `netweave: error:` line, or it
runs past 20 s; a hand-made case also fails when it is accepted (exit 0 or 1). Mutations are bit flips, truncation, invalid
UTF-8, huge numbers (2^31, 1e400, NaN, 5000-digit integers), junk bytes, type swaps, nesting (70 to 100,000 levels), deletions,
duplications and unsafe names. Wall time of the whole harness: {before_s:.0f} s before, {after_s:.0f} s after (noisy, shared machine).

Verbs new in this change (no "before"): {', '.join(new_verbs) or 'none'}; they count in "after" only.

Kinds of failure before (the escaped exception, or why the outcome broke the contract; mutations and hand-made cases):
{chr(10).join(f'- {k}: {n}' for k, n in sorted(kinds.items(), key=lambda kv: -kv[1]))}

Failing after: {', '.join(h['case'] + ' (' + str(h['failure']) + ')' for h in hand_after) or 'none'}.
The same cases run in CI as `tests/test_fuzz_inputs.py` (hypothesis drives the mutations there, 12 examples per verb).
"""
    write_results("robustness", rows, title="Robustness: bad inputs that break the one-line error contract, before and after", notes=notes,
                  extra={"base": args.base, "head": head, "per_verb": args.per_verb, "seed": args.seed,
                         "hand_made_before": before["hand_made"], "hand_made_after": after["hand_made"],
                         "examples_before": before["examples"], "examples_after": after["examples"],
                         "wall_s": {"before": before_s, "after": after_s}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
