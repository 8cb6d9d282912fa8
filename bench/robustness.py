"""The robustness harness: every file-taking CLI verb fed mutated and hand-made bad inputs, in-process.

The contract under test (``docs/architecture.md``): whatever the bytes of an input file, ``netweave`` ends with
exit code 0, 1 (a plan that leaves jobs unplaced, degraded guarantees) or 2, and exit 2 comes with exactly one
line on stderr, ``netweave: error: ...``, and no traceback. A case fails when an exception escapes
``netweave.cli.main``, when exit 2 comes with more or less than one line, or when it runs past ``CASE_TIMEOUT_S``.

Used by ``tests/test_fuzz_inputs.py`` (hypothesis drives the mutations) and by ``bench/bench_robustness.py``
(fixed seeded mutations, counted before and after a change). It imports only ``netweave.cli`` and the
builders that make the valid seed files, so it runs against older checkouts too.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import signal
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CASE_TIMEOUT_S = 20

TESTS_DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
PLACEMENT_DATA = Path(__file__).resolve().parent.parent / "placement" / "data"


# -- valid seed files ------------------------------------------------------------------------------------------


def make_seeds(root: Path) -> dict[str, Path]:
    """Small valid inputs, one per format, written under ``root`` (each verb runs in well under a second on them)."""
    import topology
    from topology.io import dumps

    root.mkdir(parents=True, exist_ok=True)
    seeds: dict[str, Path] = {}

    def put(name: str, data: str | bytes) -> None:
        path = root / name
        path.write_bytes(data.encode() if isinstance(data, str) else data)
        seeds[name] = path

    node = topology.build_node("dgx-h100", host="n0") if _accepts_host() else topology.build_node("dgx-h100")
    put("topo.json", dumps(node, "json"))
    put("cluster.json", dumps(topology.build_cluster(2, node="dgx-h100", fabric="rail-optimized"), "json"))
    put("nvsmi.txt", (TESTS_DATA / "nvsmi_dgx_h100.txt").read_bytes())
    put("nccl.xml", (TESTS_DATA / "nccl_two_hosts_a100.xml").read_bytes())
    put("slurm.conf", (TESTS_DATA / "slurm_tree.conf").read_bytes())
    put("jobs.yaml", "virtual_clusters: {research: {host: 1}}\n"
                     "jobs:\n  - {name: llm, gpus: 8, tp: 8, compute_ms: 150, grad_bytes: 2GB, vc: research, priority: 10}\n"
                     "  - {name: cnn, gpus: 4, compute_s: 0.08, grad_bytes: 500MB}\n")
    put("trace.csv", "name,arrival_s,gpus,duration_s,compute_ms,grad_bytes,tp,vc,priority\n"
                     "a,0.0,8,600.0,100.0,1e9,1,,0\nb,10.0,4,300.0,80.0,5e8,1,,0\nc,20.0,2,120.0,50.0,0,1,,0\n")
    put("philly.json", (PLACEMENT_DATA / "philly_sample.json").read_bytes())
    put("pai.csv", (PLACEMENT_DATA / "pai_task_sample.csv").read_bytes())
    put("workload.yaml", "name: w\njobs:\n"
                         "  - name: a\n    gpus: [node0/gpu0, node1/gpu0]\n    iterations: 2\n"
                         "    phases:\n      - {name: compute, duration: 1ms}\n"
                         "      - {name: allreduce, op: all_reduce, bytes: 10MB, after: [compute]}\n"
                         "  - name: b\n    gpus: [node0/gpu1, node1/gpu1]\n    iterations: 2\n    priority: 1\n"
                         "    phases:\n      - {name: compute, duration: 1ms}\n"
                         "      - {name: allreduce, op: all_reduce, bytes: 10MB, after: [compute]}\n")
    put("model.yaml", "layers: 4\nhidden: 1024\nheads: 16\nseq_len: 512\nvocab: 32000\ntflops: 989\n")
    from pipesched.profile import analytic_profile, config_from_dict, dumps_profile

    put("profile.json", dumps_profile(analytic_profile(config_from_dict({"layers": 4, "hidden": 512, "heads": 8, "seq_len": 256,
                                                                           "vocab": 1000}))))
    put("flowplan.json", json.dumps({"format": "netweave-flow-plan", "version": 1, "epoch": 1, "policy": "sincronia",
                                     "hosts": {"node0": {"link_rate": 5e10, "rules": [{"job": "a", "priority": 0, "dscp": 46},
                                                                                     {"job": "b", "priority": 3}]}}}, indent=1))
    from flowsched.gradients import analytic_gradient_profile

    analytic_gradient_profile(["l0", "l1", "l2"], [4e6, 8e6, 2e6], [1e-3, 1e-3, 1e-3], [2e-3, 2e-3, 2e-3],
                              bandwidth=10.0, overhead=1e-5).save(root / "gradients.json")
    seeds["gradients.json"] = root / "gradients.json"
    from placement.hived import HivedScheduler

    sched = HivedScheduler(topology.default_cluster(), {"research": {"host": 1}})
    sched.allocate("a", 8, vc="research", priority=1)
    sched.allocate("b", 4)
    put("state.json", json.dumps(sched.to_state(), indent=1))
    put("nccl.plan", "netweave-plan 1\nclass 5 dscp=46 prio=6 rate=125000000 nsocks=4\n"
                     "comm 1 class=5\nmark 29500 dscp=48 prio=6\nmark * dscp=8\n")
    put("train.py", "print('a training script')\n")
    put("launch.yaml", "jobs:\n"
                       f"  - {{name: dp, gpus: 8, backend: gloo, script: {root / 'train.py'}, args: [--steps, '3'],\n"
                       "     model: {layers: 4, hidden: 256, heads: 4, seq_len: 128, vocab: 1000},\n"
                       "     data_parallel: {policy: prophet, partition: 1MiB}}\n"
                       f"  - {{name: pp, gpus: 4, pp: 2, microbatches: 4, schedule: 1f1b, script: {root / 'train.py'},\n"
                       "     model: {layers: 4, hidden: 256, heads: 4, seq_len: 128, vocab: 1000}}\n")
    from flowsched.control import generate_keys

    generate_keys(root / "keys", ["h0"])
    put("control.yaml", "format: netweave-flow-control\nversion: 1\nkeys: keys\nscheduler: {bind: 'tcp://127.0.0.1:1'}\n"
                        "agents:\n  h0: {bind: 'tcp://127.0.0.1:2', dev: lo, rate_mbit: 100}\nheartbeat_s: 0.5\n")
    return seeds


def _accepts_host() -> bool:
    import inspect

    import topology

    return "host" in inspect.signature(topology.build_node).parameters


# -- the verbs --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verb:
    """A CLI verb that reads file ``seed``; ``argv`` has ``{f}`` for the (mutated) file, ``{out}`` for a fresh output path
    and ``{seeds}`` for the directory of valid seed files."""

    name: str
    seed: str
    argv: tuple[str, ...]


VERBS: tuple[Verb, ...] = (
    Verb("topo show", "topo.json", ("topo", "show", "{f}")),
    Verb("topo path", "topo.json", ("topo", "path", "{f}", "0", "1")),
    Verb("topo export", "cluster.json", ("topo", "export", "{f}", "--format", "slurm")),
    Verb("topo import nvidia-smi", "nvsmi.txt", ("topo", "import", "{f}", "--format", "nvidia-smi", "--out", "{out}.json")),
    Verb("topo import nccl-xml", "nccl.xml", ("topo", "import", "{f}", "--format", "nccl-xml", "--out", "{out}.json")),
    Verb("topo import slurm", "slurm.conf", ("topo", "import", "{f}", "--format", "slurm", "--out", "{out}.json")),
    Verb("place plan (jobs)", "jobs.yaml", ("place", "plan", "--topology", "default", "--jobs", "{f}", "--policy", "hived",
                                            "--hostfiles", "{out}-hostfiles")),
    Verb("place plan (topology)", "cluster.json", ("place", "plan", "--topology", "{f}", "--jobs", "{seeds}/jobs.yaml", "--policy", "hived")),
    Verb("place cells", "cluster.json", ("place", "cells", "--topology", "{f}")),
    Verb("place check", "jobs.yaml", ("place", "check", "--topology", "default", "--jobs", "{f}")),
    Verb("place replay", "trace.csv", ("place", "replay", "--topology", "default", "--trace", "{f}", "--policy", "fifo")),
    Verb("place trace --philly", "philly.json", ("place", "trace", "--philly", "{f}", "--out", "{out}.csv")),
    Verb("place trace --pai", "pai.csv", ("place", "trace", "--pai", "{f}", "--out", "{out}.csv")),
    Verb("place release (state)", "state.json", ("place", "release", "--topology", "default", "--state", "{f}", "a")),
    Verb("pipe plan (model)", "model.yaml", ("pipe", "plan", "--model", "{f}", "--stages", "2", "--microbatches", "4")),
    Verb("pipe profile (model)", "model.yaml", ("pipe", "profile", "--model", "{f}", "--out", "{out}.json")),
    Verb("pipe export (model)", "model.yaml", ("pipe", "export", "--model", "{f}", "--stages", "2", "--microbatches", "2",
                                               "--out", "{out}-export")),
    Verb("pipe simulate (profile)", "profile.json", ("pipe", "simulate", "--profile", "{f}", "--stages", "2", "--microbatches", "2")),
    Verb("flow apply", "flowplan.json", ("flow", "apply", "{f}", "--host", "node0", "--dry-run")),
    Verb("flow schedule", "gradients.json", ("flow", "schedule", "--profile", "{f}")),
    Verb("flow plan (workload)", "workload.yaml", ("flow", "plan", "--workload", "{f}", "--topology", "{seeds}/cluster.json",
                                                    "--out", "{out}.json")),
    Verb("emu example (topology)", "cluster.json", ("emu", "example", "--topology", "{f}", "--out", "{out}.yaml")),
    Verb("emu run (workload)", "workload.yaml", ("emu", "run", "{f}", "--topology", "{seeds}/cluster.json", "--out", "{out}-run",
                                                  "--no-flows")),
    Verb("emu sweep (workload)", "workload.yaml", ("emu", "sweep", "{f}", "--topology", "{seeds}/cluster.json", "--set",
                                                    "jobs.a.start_offset=0,0.001", "--executor", "local", "--out", "{out}-sweep")),
    Verb("topo draw", "cluster.json", ("topo", "draw", "{f}", "--out", "{out}.png")),
    Verb("flow nccl check-plan", "nccl.plan", ("flow", "nccl", "check-plan", "{f}")),
    Verb("flow agent (config)", "control.yaml", ("flow", "agent", "--config", "{f}", "--host", "h0", "--dry-run", "--duration", "0.05")),
    Verb("launch (jobs)", "launch.yaml", ("launch", "--topology", "default", "--jobs", "{f}", "--out", "{out}-bundles")),
    Verb("launch (topology)", "cluster.json", ("launch", "--topology", "{f}", "--jobs", "{seeds}/launch.yaml", "--out", "{out}-bundles")),
)


# -- mutations --------------------------------------------------------------------------------------------------

HUGE = (b"0", b"-1", b"2147483648", b"9223372036854775808", b"1e300", b"1e400", b"-1e400", b"NaN", b"Infinity", b".nan", b".inf",
        b"99999999999999999999", b"1" + b"0" * 5000, b"0.0", b"1e-320")
JUNK = (b"\xff", b"\xfe\xff", b"\x00", b"\xc3\x28", b"\xed\xa0\x80", b"\n", b"\r\n", b"\t", b"[", b"{", b"]", b"}", b"\"", b"'",
        b",", b":", b"=", b"#", b"*", b"&a", b"!!binary", b"\\", b"..", b"/", b"\xe2\x80\xa8", b"\xef\xbb\xbf")
TYPE_SWAPS = (b"[]", b"{}", b"null", b"true", b"\"x\"", b"[1, 2]", b"{\"a\": 1}", b"-", b"~")


def _numbers(data: bytes) -> list[tuple[int, int]]:
    import re

    return [(m.start(), m.end()) for m in re.finditer(rb"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?", data)]


def _tokens(data: bytes) -> list[tuple[int, int]]:
    import re

    return [(m.start(), m.end()) for m in re.finditer(rb"[A-Za-z_][\w./-]*|-?\d+(?:\.\d+)?", data)]


def mutate(data: bytes, rng: random.Random) -> tuple[str, bytes]:
    """One mutation of ``data``, chosen by ``rng``: its kind and the new bytes."""
    kind = rng.choice(("flip", "truncate", "non-utf8", "huge-number", "junk", "type-swap", "nest", "delete", "duplicate", "name"))
    n = len(data)
    if kind == "flip" and n:
        out = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(n)
            out[i] ^= 1 << rng.randrange(8)
        return kind, bytes(out)
    if kind == "truncate":
        return kind, data[: rng.randrange(n + 1)]
    if kind == "non-utf8":
        i = rng.randrange(n + 1)
        return kind, data[:i] + rng.choice((b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\x80")) + data[i:]
    if kind == "huge-number":
        spans = _numbers(data)
        if spans:
            a, b = rng.choice(spans)
            return kind, data[:a] + rng.choice(HUGE) + data[b:]
    if kind == "junk":
        i = rng.randrange(n + 1)
        return kind, data[:i] + rng.choice(JUNK) * rng.randint(1, 3) + data[i:]
    if kind == "type-swap":
        spans = _tokens(data)
        if spans:
            a, b = rng.choice(spans)
            return kind, data[:a] + rng.choice(TYPE_SWAPS) + data[b:]
    if kind == "nest":
        depth = rng.choice((70, 1000, 100_000))
        spans = _numbers(data) or [(0, 0)]
        a, b = rng.choice(spans)
        return kind, data[:a] + b"[" * depth + data[a:b] + b"]" * depth + data[b:]
    if kind == "delete" and n:
        a = rng.randrange(n)
        return kind, data[:a] + data[a + rng.randint(1, 40):]
    if kind == "duplicate" and n:
        a = rng.randrange(n)
        b = min(n, a + rng.randint(1, 200))
        return kind, data[:b] + data[a:b] + data[b:]
    if kind == "name":
        spans = _tokens(data)
        if spans:
            a, b = rng.choice(spans)
            bad = rng.choice((b"../../escaped", b"/tmp/x/abs", b"a\\nb", b"-rf", b"a b", b"x" * 300, b"$(id)", b"a;b", b""))
            return kind, data[:a] + bad + data[b:]
    return "flip", data[:-1] + bytes([data[-1] ^ 0x20]) if n else b"\xff"


# -- running one case -------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    code: int | None
    stderr: str
    error: str | None  # an escaped exception's traceback, or "timeout"

    @property
    def failure(self) -> str | None:
        """Why the outcome breaks the contract, or None."""
        if self.error is not None:
            return self.error.strip().splitlines()[-1][:300] if self.error != "timeout" else f"no result within {CASE_TIMEOUT_S} s"
        if "Traceback" in self.stderr:
            return "a traceback on stderr"
        if self.code not in (0, 1, 2):
            return f"exit code {self.code}"
        if self.code == 2:
            lines = [line for line in self.stderr.splitlines() if line.strip()]
            errors = [line for line in lines if line.startswith("netweave: error:")]
            if len(errors) != 1 or len(lines) - _progress_lines(lines) != 1:
                return f"exit 2 with {len(errors)} error line(s) among {len(lines)}: {self.stderr.strip()[:200]!r}"
        return None


def _progress_lines(lines: list[str]) -> int:
    """Progress messages commands print before they fail (``emu: running ...``, ``replaying ...``) are not errors."""
    return sum(1 for line in lines if not line.startswith("netweave: error:"))


class _Timeout(BaseException):
    pass


@contextlib.contextmanager
def _alarm(seconds: int) -> Iterator[None]:
    def handler(signum: int, frame: Any) -> None:
        raise _Timeout

    old = signal.signal(signal.SIGALRM, handler)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def run_cli(argv: list[str], timeout_s: int = CASE_TIMEOUT_S) -> Outcome:
    """``netweave.cli.main(argv)`` in this process with stdout and stderr captured."""
    from netweave.cli import main

    out, err = io.StringIO(), io.StringIO()
    code: int | None = None
    error = None
    try:
        with _alarm(timeout_s), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    except _Timeout:
        error = "timeout"
    except SystemExit as exc:  # argparse: not a file-content problem, but must still be one line
        code = exc.code if isinstance(exc.code, int) else 2
    except BaseException:  # noqa: BLE001 - anything that escapes main is what we count
        error = traceback.format_exc()
    return Outcome(code, err.getvalue(), error)


def expand(verb: Verb, file: Path, out: Path, seeds: Path) -> list[str]:
    return [a.replace("{f}", str(file)).replace("{out}", str(out)).replace("{seeds}", str(seeds)) for a in verb.argv]


def mutation_cases(seeds: dict[str, Path], *, per_verb: int, seed: int = 0) -> Iterator[tuple[Verb, str, bytes]]:
    """``per_verb`` seeded mutations of each verb's seed file."""
    rng = random.Random(seed)
    for verb in VERBS:
        data = seeds[verb.seed].read_bytes()
        for _ in range(per_verb):
            kind, mutated = mutate(data, rng)
            yield verb, kind, mutated


# -- hand-made cases --------------------------------------------------------------------------------------------


def _topo(nodes: list[dict[str, Any]], links: list[dict[str, Any]]) -> bytes:
    return json.dumps({"format": "netweave-topology", "version": 1, "meta": {"name": "t"}, "nodes": nodes, "links": links}).encode()


_G = [{"id": "h/gpu0", "kind": "gpu", "host": "h", "index": 0}, {"id": "h/gpu1", "kind": "gpu", "host": "h", "index": 1}]


def _link(bw: Any, src: str = "h/gpu0", dst: str = "h/gpu1") -> dict[str, Any]:
    return {"src": src, "dst": dst, "kind": "nvlink", "bw": bw}


def hand_made_cases() -> list[tuple[str, str, bytes, tuple[str, ...]]]:
    """(name, file name, bytes, argv with ``{f}``, ``{out}`` and ``{seeds}``): each must end in exit 2 with one line."""
    topo_show = ("topo", "show", "{f}")
    cases: list[tuple[str, str, bytes, tuple[str, ...]]] = [
        ("topology: duplicate node id", "t.json", _topo([_G[0], _G[0]], []), topo_show),
        ("topology: a list as node id", "t.json", _topo([{**_G[0], "id": ["h", "gpu0"]}, _G[1]], []), topo_show),
        ("topology: a GPU without host", "t.json", _topo([{"id": "g0", "kind": "gpu"}, {"id": "g1", "kind": "gpu"}], []), topo_show),
        ("topology: infinite bandwidth", "t.json", _topo(_G, [_link(1)]).replace(b'"bw": 1', b'"bw": Infinity'), topo_show),
        ("topology: 1e400 bandwidth", "t.json", _topo(_G, [_link(1)]).replace(b'"bw": 1', b'"bw": 1e400'), topo_show),
        ("topology: NaN bandwidth", "t.json", _topo(_G, [_link(1)]).replace(b'"bw": 1', b'"bw": NaN'), topo_show),
        ("topology: zero bandwidth", "t.json", _topo(_G, [_link(0)]), topo_show),
        ("topology: negative bandwidth", "t.json", _topo(_G, [_link(-5)]), topo_show),
        ("topology: self-loop", "t.json", _topo(_G, [_link(10, "h/gpu0", "h/gpu0")]), topo_show),
        ("topology: string bandwidth", "t.json", _topo(_G, [_link("10")]), topo_show),
        ("topology: nodes not a list", "t.json", b'{"format": "netweave-topology", "version": 1, "nodes": {}, "links": []}', topo_show),
        ("topology: deep nesting", "t.json", b'{"format": "netweave-topology", "version": 1, "meta": ' + b"[" * 100000 + b"]" * 100000 + b"}",
         topo_show),
        ("topology: node id with a newline", "t.json", _topo([{**_G[0], "id": "h/gpu0\nx"}, _G[1]], []), topo_show),
        ("topology: host ../..", "t.json", _topo([{**_G[0], "host": "../.."}, _G[1]], []), topo_show),
        ("topology: non-UTF-8", "t.json", b'{"format": "netweave-topology\xff"}', topo_show),
        ("topology: all-infinite bandwidths in emu run", "t.json",
         _topo(_G, [_link(1)]).replace(b'"bw": 1', b'"bw": 1e999'),
         ("emu", "run", "{seeds}/workload.yaml", "--topology", "{f}", "--out", "{out}-run")),
        ("slurm: a[0-9999]b[0-9999]", "s.conf", b"SwitchName=s0 Nodes=a[0-9999]b[0-9999]\n",
         ("topo", "import", "{f}", "--format", "slurm", "--out", "{out}.json")),
        ("slurm: a[0-99999999999]", "s.conf", b"SwitchName=s0 Nodes=a[0-99999999999]\n",
         ("topo", "import", "{f}", "--format", "slurm", "--out", "{out}.json")),
        ("slurm: --nic-gbps 0", "s.conf", b"SwitchName=s0 Nodes=a[0-1]\n",
         ("topo", "import", "{f}", "--format", "slurm", "--nic-gbps", "0", "--out", "{out}.json")),
        ("slurm: --nic-gbps inf", "s.conf", b"SwitchName=s0 Nodes=a[0-1]\n",
         ("topo", "import", "{f}", "--format", "slurm", "--nic-gbps", "inf", "--out", "{out}.json")),
        ("slurm: --nic-gbps -8", "s.conf", b"SwitchName=s0 Nodes=a[0-1]\n",
         ("topo", "import", "{f}", "--format", "slurm", "--nic-gbps", "-8", "--out", "{out}.json")),
        ("slurm: node name with a slash", "s.conf", b"SwitchName=s0 Nodes=../x\n",
         ("topo", "import", "{f}", "--format", "slurm", "--out", "{out}.json")),
        ("nvidia-smi: NV99999999", "n.txt", (TESTS_DATA / "nvsmi_dgx_h100.txt").read_bytes().replace(b"NV18", b"NV99999999"),
         ("topo", "import", "{f}", "--format", "nvidia-smi", "--out", "{out}.json")),
        ("nvidia-smi: --nic-gbps 0", "n.txt", (TESTS_DATA / "nvsmi_dgx_h100.txt").read_bytes(),
         ("topo", "import", "{f}", "--format", "nvidia-smi", "--nic-gbps", "0", "--out", "{out}.json")),
        ("nvidia-smi: --host with a slash", "n.txt", (TESTS_DATA / "nvsmi_dgx_h100.txt").read_bytes(),
         ("topo", "import", "{f}", "--format", "nvidia-smi", "--host", "../../x", "--out", "{out}.json")),
        ("jobs: name ../../escaped", "j.yaml", b"jobs: [{name: ../../escaped, gpus: 1}]\n",
         ("place", "plan", "--topology", "default", "--jobs", "{f}", "--hostfiles", "{out}-hf")),
        ("jobs: name /tmp/x/abs", "j.yaml", b"jobs: [{name: /tmp/x/abs, gpus: 1}]\n",
         ("place", "plan", "--topology", "default", "--jobs", "{f}", "--hostfiles", "{out}-hf")),
        ("jobs: name with a newline", "j.yaml", b'jobs: [{name: "a\\nb", gpus: 1}]\n',
         ("place", "plan", "--topology", "default", "--jobs", "{f}", "--hostfiles", "{out}-hf")),
        ("jobs: VC quota of 2^31 cells", "j.yaml", b"virtual_clusters: {v: {host: 2147483648}}\njobs: [{name: a, gpus: 1, vc: v}]\n",
         ("place", "check", "--topology", "default", "--jobs", "{f}")),
        ("jobs: a 1e9-GPU job", "j.yaml", b"jobs: [{name: a, gpus: 1000000000}]\n", ("place", "check", "--topology", "default", "--jobs", "{f}")),
        ("jobs: 33 GPUs on 32", "j.yaml", b"jobs: [{name: a, gpus: 33}]\n", ("place", "check", "--topology", "default", "--jobs", "{f}")),
        ("jobs: iterations 1e9", "j.yaml", b"jobs: [{name: a, gpus: 1, iterations: 1000000000}]\n",
         ("place", "plan", "--topology", "default", "--jobs", "{f}")),
        ("jobs: NaN compute", "j.yaml", b"jobs: [{name: a, gpus: 1, compute_s: .nan}]\n",
         ("place", "plan", "--topology", "default", "--jobs", "{f}")),
        ("jobs: non-UTF-8", "j.yaml", b"jobs: [{name: \xff, gpus: 1}]\n", ("place", "plan", "--topology", "default", "--jobs", "{f}")),
        ("trace: job larger than the cluster", "t.csv", b"name,arrival_s,gpus,duration_s\na,0,64,100\n",
         ("place", "replay", "--topology", "default", "--trace", "{f}", "--policy", "fifo")),
        ("trace: non-UTF-8", "t.csv", b"name,arrival_s,gpus,duration_s\n\xff,0,1,100\n",
         ("place", "replay", "--topology", "default", "--trace", "{f}", "--policy", "fifo")),
        ("pai: end before start", "p.csv", b"j,t,1,Terminated,100.0,50.0,600.0,29.3,100.0,V100\n",
         ("place", "trace", "--pai", "{f}", "--out", "{out}.csv")),
        ("pai: NaN plan_gpu", "p.csv", b"j,t,1,Terminated,0,50.0,600.0,29.3,nan,V100\n", ("place", "trace", "--pai", "{f}", "--out", "{out}.csv")),
        ("philly: end before start", "p.json",
         b'[{"jobid": "a", "vc": "v", "submitted_time": "2017-10-03 04:55:58", "attempts": [{"start_time": "2017-10-03 05:56:12", '
         b'"end_time": "2017-10-03 04:56:12", "detail": [{"ip": "m", "gpus": ["gpu0"]}]}]}]',
         ("place", "trace", "--philly", "{f}", "--out", "{out}.csv")),
        ("philly: attempts not a list of objects", "p.json", b'[{"jobid": "a", "attempts": [1]}]',
         ("place", "trace", "--philly", "{f}", "--out", "{out}.csv")),
        ("model: 10^6 layers", "m.yaml", b"layers: 1000000\nhidden: 1024\nheads: 16\nseq_len: 512\nvocab: 32000\n",
         ("pipe", "plan", "--model", "{f}", "--stages", "2", "--microbatches", "4")),
        ("model: tflops .nan", "m.yaml", b"layers: 4\nhidden: 1024\nheads: 16\nseq_len: 512\nvocab: 32000\ntflops: .nan\n",
         ("pipe", "simulate", "--model", "{f}", "--stages", "2", "--microbatches", "4")),
        ("model: hidden 10^300", "m.yaml", b"layers: 4\nhidden: 1" + b"0" * 300 + b"\nheads: 16\nseq_len: 512\nvocab: 32000\n",
         ("pipe", "plan", "--model", "{f}", "--stages", "2", "--microbatches", "4")),
        ("workload: iterations 1e9", "w.yaml", b"jobs:\n  - {name: a, gpus: [node0/gpu0, node1/gpu0], iterations: 1000000000, phases: "
         b"[{name: c, duration: 1ms}]}\n", ("emu", "run", "{f}", "--topology", "{seeds}/cluster.json", "--out", "{out}-run")),
        ("workload: job name with a newline", "w.yaml", b'jobs:\n  - {name: "a\\nb", gpus: [node0/gpu0], phases: [{name: c, duration: 1ms}]}\n',
         ("emu", "run", "{f}", "--topology", "{seeds}/cluster.json", "--out", "{out}-run")),
        ("flow apply: --dev with an injected line", "p.json", b"", ("flow", "apply", "{seeds}/flowplan.json", "--host", "node0", "--dry-run",
                                                                   "--dev", "lo\nqdisc del dev eth0 root")),
        ("flow apply: --host ../x", "p.json", b"", ("flow", "apply", "{seeds}/flowplan.json", "--host", "../x", "--dry-run")),
        ("flow plan: host with a space", "p.json",
         b'{"format": "netweave-flow-plan", "version": 1, "hosts": {"node0 x": {"rules": [{"job": "a", "priority": 0}]}}}',
         ("flow", "apply", "{f}", "--host", "node0", "--dry-run")),
        ("flow plan: rate 1e20 B/s", "p.json",
         b'{"format": "netweave-flow-plan", "version": 1, "hosts": {"node0": {"link_rate": 1e20, "rules": [{"job": "a", "priority": 0}]}}}',
         ("flow", "apply", "{f}", "--host", "node0", "--dry-run")),
        ("flow keys: agent ../x", "k", b"", ("flow", "keys", "--out", "{out}-keys", "--agents", "../x")),
        ("gradients: names not a list", "g.json",
         b'{"format": "netweave-gradient-profile", "version": 1, "names": 3, "nbytes": [], "ready": [], "forward": [], "backward": 0, '
         b'"bandwidth": 1}', ("flow", "schedule", "--profile", "{f}")),
        ("topo build: --nodes 10^8", "x", b"", ("topo", "build", "rail-optimized", "--nodes", "100000000", "--out", "{out}.json")),
        ("topo build: --set oversubscription=nan", "x", b"", ("topo", "build", "rail-optimized", "--set", "oversubscription=nan",
                                                              "--out", "{out}.json")),
    ]
    for out in ("/dev/null/x", "{seeds}", "/proc/netweave-x"):
        cases += [
            (f"output {out}: topo build", "x", b"", ("topo", "build", "dgx-h100", "--out", out)),
            (f"output {out}: topo import", "x", b"", ("topo", "import", "{seeds}/slurm.conf", "--out", out)),
            (f"output {out}: place plan", "x", b"", ("place", "plan", "--topology", "default", "--jobs", "{seeds}/jobs.yaml", "--out", out)),
            (f"output {out}: place trace", "x", b"", ("place", "trace", "--synthetic", "3", "--out", out)),
            (f"output {out}: pipe plan", "x", b"", ("pipe", "plan", "--model", "{seeds}/model.yaml", "--stages", "2", "--microbatches", "2",
                                                   "--out", out)),
            (f"output {out}: flow plan", "x", b"", ("flow", "plan", "--workload", "{seeds}/workload.yaml", "--topology", "{seeds}/cluster.json",
                                                   "--out", out)),
            (f"output {out}: emu example", "x", b"", ("emu", "example", "--out", out)),
        ]
    cases += [
        ("output a file as directory: emu run", "x", b"", ("emu", "run", "{seeds}/workload.yaml", "--topology", "{seeds}/cluster.json",
                                                            "--out", "{seeds}/jobs.yaml")),
        ("output /proc: emu run", "x", b"", ("emu", "run", "{seeds}/workload.yaml", "--topology", "{seeds}/cluster.json",
                                             "--out", "/proc/netweave-x")),
        ("output a file as directory: place plan --hostfiles", "x", b"", ("place", "plan", "--topology", "default", "--jobs", "{seeds}/jobs.yaml",
                                                                          "--hostfiles", "{seeds}/jobs.yaml")),
    ]
    return cases


def run_hand_made(case: tuple[str, str, bytes, tuple[str, ...]], work: Path, seeds: Path) -> Outcome:
    """Run one hand-made case; it must exit 2 (a 0 or 1 is a failure: the nonsense was accepted)."""
    name, file_name, data, argv = case
    work.mkdir(parents=True, exist_ok=True)
    f = work / file_name
    if data:
        f.write_bytes(data)
    outcome = run_cli([a.replace("{f}", str(f)).replace("{out}", str(work / "out")).replace("{seeds}", str(seeds)) for a in argv])
    if outcome.failure is None and outcome.code != 2:
        outcome.error = f"accepted: exit {outcome.code}"
    return outcome


def main(argv: list[str] | None = None) -> int:
    """Print JSON counts for this checkout (used by bench_robustness.py, also against an older checkout)."""
    import argparse
    import tempfile

    p = argparse.ArgumentParser()
    p.add_argument("--per-verb", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="input-robustness-") as tmp:
        root = Path(tmp)
        seeds = make_seeds(root / "seeds")
        per_verb: dict[str, dict[str, Any]] = {}
        for verb in VERBS:  # does the verb exist here and run on its valid seed? (an older checkout may lack it)
            seed_run = run_cli(expand(verb, seeds[verb.seed], root / "seed-out", root / "seeds"))
            per_verb[verb.name] = {"cases": 0, "failures": 0, "exit": {}, "seed_exit": seed_run.code, "kinds": {}}
        examples: list[dict[str, str]] = []
        for i, (verb, kind, data) in enumerate(mutation_cases(seeds, per_verb=args.per_verb, seed=args.seed)):
            f = root / f"case{i}{Path(verb.seed).suffix}"
            f.write_bytes(data)
            outcome = run_cli(expand(verb, f, root / f"out{i}", root / "seeds"))
            row = per_verb[verb.name]
            row["cases"] += 1
            row["exit"][str(outcome.code)] = row["exit"].get(str(outcome.code), 0) + 1
            if outcome.failure:
                row["failures"] += 1
                first = outcome.failure.split(":")[0][:60]
                row["kinds"][first] = row["kinds"].get(first, 0) + 1
                if len(examples) < 40:
                    examples.append({"verb": verb.name, "mutation": kind, "failure": outcome.failure})
            f.unlink(missing_ok=True)
        hand = []
        for k, case in enumerate(hand_made_cases()):
            outcome = run_hand_made(case, root / f"hand{k}", root / "seeds")
            hand.append({"case": case[0], "exit": outcome.code, "failure": outcome.failure or (outcome.error or None)})
    json.dump({"per_verb": per_verb, "hand_made": hand, "examples": examples}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
