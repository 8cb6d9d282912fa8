"""Differential fuzz of the flow-plan grammar: the plugin's C parser, loaded as NCCL loads it
(``csrc/build/plan_check`` dlopens the library; also its ASan/UBSan build), against the Python path
that remains (``parse_plan`` marshalling the C result into ``FlowPlan``, ``format_plan`` writing it back,
``FlowPlan.resolve`` mirroring ``nw_plan_resolve``). They must agree on every verdict, error line and
message, on the canonical text byte for byte and on the resolved marks (``plan_fuzz.disagreement``).

Budget: 400 hypothesis examples of 8 plans (3,200 plans) plus a seeded corpus of 3,000 plans through
the sanitizer build, about 20 s here. ``bench/bench_nccl_plan_fuzz.py`` runs the same comparison against the two
parsers of commit 654868c."""

from __future__ import annotations

import importlib.util
import os
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowsched import ncclhook

BUILD = ncclhook.build()
_spec = importlib.util.spec_from_file_location("plan_fuzz", ncclhook.CSRC / "tests" / "plan_fuzz.py")
plan_fuzz = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plan_fuzz)
c_resolve = plan_fuzz.c_resolver(BUILD / ncclhook.PLUGIN_LIB)


def disagreements(plans: list[bytes], build_dir, env=None) -> list[tuple[bytes, str, str]]:
    results = plan_fuzz.check_batch(str(build_dir / "plan_check"), str(build_dir / ncclhook.PLUGIN_LIB), plans, env=env)
    out = []
    for plan, c in zip(plans, results, strict=True):
        why = plan_fuzz.disagreement(plan, c, c_resolve)
        if why is not None:
            out.append((plan, c, why))
    return out


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**64 - 1))
def test_plugin_and_python_path_agree_on_fuzzed_plans(seed):
    rnd = random.Random(seed)  # hypothesis picks the seeds (st.randoms() is ~10x slower for this many draws)
    plans = [plan_fuzz.fuzz_plan(rnd) for _ in range(8)]
    assert disagreements(plans, BUILD) == []


def test_sanitized_plugin_parser_on_a_seeded_corpus():
    """Every named mutation 100 times plus 1,600 mixed plans through the ASan/UBSan build: no report, no disagreement."""
    san = ncclhook.build(sanitize=True)
    rnd = random.Random(1919)
    plans = [plan_fuzz.fuzz_plan(rnd, [m]) for m in plan_fuzz.MUTATIONS for _ in range(100)]
    plans += [plan_fuzz.fuzz_plan(rnd) for _ in range(1600)]
    env = {**os.environ, "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0", "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}
    assert disagreements(plans, san, env) == []


def test_the_fuzzer_reaches_both_sides_of_the_grammar():
    """Not a vacuous comparison: the corpus holds valid plans and plans refused for each kind of reason."""
    rnd = random.Random(7)
    plans = [plan_fuzz.fuzz_plan(rnd) for _ in range(600)]
    results = plan_fuzz.check_batch(str(BUILD / "plan_check"), str(BUILD / ncclhook.PLUGIN_LIB), plans)
    assert sum(r.startswith("OK\n") for r in results) > 60
    errors = " ".join(r for r in results if r.startswith("ERROR"))
    for reason in ("no leading zeros", "given twice", "already given on line", "NUL byte", "not allowed outside a comment",
                   "more than 1023", "more than 24 fields", "more than 64", "must be a byte count"):
        assert reason in errors, reason
