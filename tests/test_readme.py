"""The README's commands run as written: its ``sh`` blocks, in order, in one temporary directory.

Whatever ``sh`` blocks the README holds are read at collection time, so a section added on another branch is
tested too. ``netweave ...`` lines run in-process through :func:`netweave.cli.main` (the console entry point
without the interpreter start-up) and must exit 0; ``cat > FILE <<'TAG'`` here-documents write their file;
``make`` lines (the set-up) are left out. What needs more than this machine is marked or skipped with the
reason: Mininet runs under the ``emulation`` marker, CUDA runs without a GPU, commands for a cluster host
(``bash``/``sbatch`` of a launch bundle), and runs of minutes (``pipe run`` on the CPU, ``bench`` runs) unless
``NETWEAVE_README_SLOW=1``. The README's ``python`` blocks run too.

The inputs a user brings are supplied: ``nvidia-smi-topo.txt`` is the sample DGX H100 dump of ``tests/data``,
and ``examples/`` (scripts the README names by path) is linked from the checkout.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
SLOW = os.environ.get("NETWEAVE_README_SLOW") == "1"


@dataclass
class Step:
    line: int  # README line of the command
    kind: str  # "netweave", "heredoc", "shell", "python"
    text: str
    path: str = ""  # heredoc: the file written
    body: str = ""  # heredoc: its content; python: the code


def readme_steps(text: str) -> list[Step]:
    """The steps of every ``sh`` and ``python`` block, in order (``make`` lines and comments dropped)."""
    steps: list[Step] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\w+)\s*$", lines[i])
        if not m:
            i += 1
            continue
        lang, start = m.group(1), i + 1
        end = next(j for j in range(start, len(lines)) if lines[j].startswith("```"))
        if lang == "python":
            steps.append(Step(start + 1, "python", "python block", body="\n".join(lines[start:end]) + "\n"))
        elif lang == "sh":
            j = start
            while j < end:
                raw = lines[j]
                command = raw.strip()
                first = j + 1
                while command.endswith("\\") and j + 1 < end:
                    j += 1
                    command = command[:-1] + " " + lines[j].strip()
                j += 1
                words = shlex.split(command, comments=True)
                if not words or words[0] == "make":
                    continue
                here = re.match(r"^cat\s*>\s*(\S+)\s*<<\s*'?(\w+)'?\s*$", " ".join(command.split("#", 1)[:1]).strip())
                if here:
                    tag = here.group(2)
                    stop = next(k for k in range(j, end) if lines[k].strip() == tag)
                    steps.append(Step(first, "heredoc", command, path=here.group(1), body="\n".join(lines[j:stop]) + "\n"))
                    j = stop + 1
                elif words[0] == "netweave":
                    steps.append(Step(first, "netweave", command))
                else:
                    steps.append(Step(first, "shell", command))
        i = end + 1
    return steps


def why_not_here(step: Step) -> tuple[str, str] | None:
    """("emulation" | "skip", reason) for a step this machine cannot or should not run; None to run it."""
    words = shlex.split(step.text, comments=True) if step.kind in ("netweave", "shell") else []
    if step.kind == "shell":
        return "skip", f"{words[0]} runs a training job on a cluster host (torchrun, GPUs), not a netweave command"
    if step.kind == "python" and any(line.strip() == "..." for line in step.body.splitlines()):
        return "skip", "an excerpt of a file ('...' skips lines): tests/test_readme_example.py checks it against the file"
    if step.kind != "netweave":
        return None
    args = words[1:]
    if args[:2] == ["emu", "compare"] or "--backend" in args and args[args.index("--backend") + 1] == "mininet":
        return "emulation", "Mininet emulation needs root and Mininet"
    if args[:2] == ["pipe", "run"] and "cuda" in args:
        import torch

        if not torch.cuda.is_available():
            return "skip", "needs a CUDA GPU"
    elif args[:2] == ["pipe", "run"] and not SLOW:
        return "skip", "minutes of real gloo processes on this CPU; NETWEAVE_README_SLOW=1 runs it"
    if args[:1] == ["bench"] and "--list" not in args and not SLOW:
        return "skip", "a benchmark run takes minutes; NETWEAVE_README_SLOW=1 runs it"
    return None


STEPS = readme_steps(README.read_text(encoding="utf-8"))


def _param(step: Step):
    marks = []
    verdict = why_not_here(step)
    if verdict and verdict[0] == "emulation":
        marks.append(pytest.mark.emulation)
    label = step.text if step.kind != "heredoc" else f"write {step.path}"
    return pytest.param(step, id=f"L{step.line} {label[:60]}", marks=marks)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("readme")
    shutil.copy(REPO / "tests" / "data" / "nvsmi_dgx_h100.txt", d / "nvidia-smi-topo.txt")
    (d / "examples").symlink_to(REPO / "examples", target_is_directory=True)
    return d


def test_readme_has_the_documented_commands():
    kinds = [s.kind for s in STEPS]
    assert kinds.count("netweave") >= 20 and "heredoc" in kinds and "python" in kinds
    texts = " ".join(s.text for s in STEPS)
    for verb in ("topo build", "topo path", "topo export", "place plan", "flow plan", "emu run", "emu compare", "launch"):
        assert f"netweave {verb}" in texts, verb


def _run(step: Step, workdir: Path, capsys) -> None:
    if step.kind == "heredoc":
        (workdir / step.path).write_text(step.body)
    elif step.kind == "python":
        exec(compile(step.body, f"README.md:{step.line}", "exec"), {"__name__": "__readme__"})
    else:
        from netweave.cli import main

        code = main(shlex.split(step.text, comments=True)[1:])
        _, err = capsys.readouterr()
        assert code == 0, f"README.md line {step.line}: `{step.text}` exited {code}\n{err[-2000:]}"


@pytest.mark.parametrize("step", [_param(s) for s in STEPS])
def test_readme_step(step, workdir, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    verdict = why_not_here(step)
    if verdict and verdict[0] == "skip":
        pytest.skip(verdict[1])
    done = workdir / ".steps-done"
    ran = set(done.read_text().split()) if done.exists() else set()
    for earlier in STEPS[: STEPS.index(step)]:  # a step selected alone (-k) first gets what the steps before it write
        if str(earlier.line) not in ran and why_not_here(earlier) is None:
            _run(earlier, workdir, capsys)
            ran.add(str(earlier.line))
    _run(step, workdir, capsys)
    done.write_text(" ".join(sorted({*ran, str(step.line)})))


def test_readme_steps_parser():
    text = "x\n```sh\nmake demo\nnetweave a b  # c\ncat > f.yaml <<'Y'\nk: 1\nY\nbash x.sh\nnetweave d \\\n  e\n```\n```python\nprint(1)\n```\n"
    steps = readme_steps(text)
    assert [(s.kind, s.line) for s in steps] == [("netweave", 4), ("heredoc", 5), ("shell", 8), ("netweave", 9), ("python", 13)]
    assert steps[1].path == "f.yaml" and steps[1].body == "k: 1\n" and shlex.split(steps[3].text) == ["netweave", "d", "e"]


def test_every_command_takes_json():
    """The README says every command takes --json: walk the parser and check each command that runs something."""
    import argparse

    from netweave.cli import build_parser

    missing = []

    def walk(parser: argparse.ArgumentParser, path: list[str]) -> None:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if path and parser.get_default("func") is not None and not any("--json" in a.option_strings for a in parser._actions):
            missing.append(" ".join(path))
        for action in subs:
            for name, sub in action.choices.items():
                walk(sub, [*path, name])

    walk(build_parser(), [])
    assert missing == []
