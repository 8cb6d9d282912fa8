"""The commands of a markdown page, as steps to run in order: shared by ``test_readme.py`` and ``test_docs.py``.

A page's fenced blocks become steps:

- ``sh`` (also ``bash``, ``shell``): every line is a command (``\\`` continues it, ``#`` starts a comment);
  ``cat > FILE <<'TAG'`` writes FILE from the lines up to ``TAG``; ``make`` lines (the set-up) are left out;
- ``console``: lines starting with ``$ `` are commands (here-documents as above), the lines after one, up to the
  next ``$ `` line, are the output it prints, compared as doctest does (``...`` matches anything, runs of
  whitespace are equal);
- ``python``: a block with ``>>>`` runs as a doctest, any other is run as a script;
- any other fence (plain text, ``yaml``, ``json``) is not run.

``netweave ...`` commands run in-process through :func:`netweave.cli.main` and must exit 0; any other command
(and a ``netweave`` line with pipes, redirections or variables) runs with ``bash -c`` in the page's directory,
with ``netweave`` and ``python`` the interpreter that runs the tests, and must exit 0 too.

What a machine without a GPU, or a test suite with a time budget, cannot run is marked in the page, on the line
right before the block's fence, with the reason a reader sees in the source::

    <!-- test: skip REASON -->       never run here (a cluster host, an excerpt of a file)
    <!-- test: gpu REASON -->        run when torch sees a CUDA GPU
    <!-- test: slow REASON -->       minutes: run with NETWEAVE_DOCS_SLOW=1 (or NETWEAVE_README_SLOW=1)
    <!-- test: emulation REASON -->  Mininet: under the ``emulation`` marker (root and Mininet)
    <!-- test: output varies -->     run it, but do not compare the output shown (timings, paths)
"""

from __future__ import annotations

import doctest
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SLOW = os.environ.get("NETWEAVE_DOCS_SLOW") == "1" or os.environ.get("NETWEAVE_README_SLOW") == "1"
MARKERS = ("skip", "gpu", "slow", "emulation", "output")
SHELL_LANGS = ("sh", "bash", "shell")
_MARKER = re.compile(r"^<!--\s*test:\s*(\w+)\s*(.*?)\s*-->\s*$")
_SHELL_SYNTAX = re.compile(r"[|<>;&$`]")
CHECK = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


@dataclass
class Step:
    line: int  # line of the command in its page
    kind: str  # "netweave", "heredoc", "shell", "python", "doctest"
    text: str
    path: str = ""  # heredoc: the file written
    body: str = ""  # heredoc: its content; python, doctest: the code
    expect: str | None = None  # console: the output the page shows
    marker: tuple[str, str] | None = None  # (kind, reason) from a ``<!-- test: ... -->`` line


def _marker_before(lines: list[str], fence: int) -> tuple[str, str] | None:
    """The ``<!-- test: KIND REASON -->`` on the line right before the fence at index ``fence``, if any."""
    if fence == 0:
        return None
    m = _MARKER.match(lines[fence - 1].strip())
    if not m:
        return None
    kind, reason = m.group(1), m.group(2)
    if kind not in MARKERS:
        raise ValueError(f"line {fence}: unknown test marker {kind!r} (expected one of {', '.join(MARKERS)})")
    return kind, reason


def _commands(lines: list[str], start: int, end: int, console: bool, marker) -> list[Step]:
    """The steps of the shell or console block ``lines[start:end]``."""
    steps: list[Step] = []
    j = start
    while j < end:
        raw = lines[j]
        if console and not raw.startswith("$ "):
            if steps and steps[-1].expect is not None:
                steps[-1].expect += raw + "\n"
            j += 1
            continue
        command = raw[2:].strip() if console else raw.strip()
        first = j + 1
        while command.endswith("\\") and j + 1 < end:
            j += 1
            command = command[:-1] + " " + lines[j].strip()
        j += 1
        words = shlex.split(command, comments=True)
        if not words or words[0] == "make":
            continue
        here = re.match(r"^cat\s*>\s*(\S+)\s*<<\s*'?(\w+)'?\s*$", command.split("#", 1)[0].strip())
        if here:
            tag = here.group(2)
            stop = next(k for k in range(j, end) if lines[k].strip() == tag)
            steps.append(Step(first, "heredoc", command, path=here.group(1), body="\n".join(lines[j:stop]) + "\n", marker=marker))
            j = stop + 1
            continue
        kind = "netweave" if words[0] == "netweave" and not _SHELL_SYNTAX.search(command.split("#", 1)[0]) else "shell"
        steps.append(Step(first, kind, command, expect="" if console else None, marker=marker))
    return steps


def page_steps(text: str) -> list[Step]:
    """The steps of every runnable block of a page, in order.

    >>> text = "<!-- test: slow minutes -->\\n```console\\n$ netweave x \\\\\\n   --y\\nout 1\\n...\\n$ ls\\n```\\n"
    >>> [(s.kind, s.line, s.text, s.expect, s.marker) for s in page_steps(text)]
    [('netweave', 3, 'netweave x  --y', 'out 1\\n...\\n', ('slow', 'minutes')), ('shell', 7, 'ls', '', ('slow', 'minutes'))]
    """
    steps: list[Step] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        lang, start = m.group(1), i + 1
        end = next(j for j in range(start, len(lines)) if lines[j].startswith("```"))
        marker = _marker_before(lines, i)
        body = "\n".join(lines[start:end]) + "\n"
        if lang == "python":
            kind = "doctest" if re.search(r"^\s*>>> ", body, flags=re.MULTILINE) else "python"
            steps.append(Step(start + 1, kind, f"{kind} block", body=body, marker=marker))
        elif lang in SHELL_LANGS or lang == "console":
            steps.extend(_commands(lines, start, end, lang == "console", marker))
        i = end + 1
    return steps


def heuristic_verdict(step: Step) -> tuple[str, str] | None:
    """What a ``netweave`` command needs that its name says, unless the page marks it: Mininet, a GPU, minutes.

    >>> heuristic_verdict(Step(1, "shell", "sudo .venv/bin/netweave emu run w.yaml --backend mininet --out r/"))
    ('emulation', 'Mininet emulation needs root and Mininet')
    """
    if step.kind not in ("netweave", "shell"):
        return None
    try:
        words = shlex.split(step.text, comments=True)
    except ValueError:
        return None
    at = next((i for i, w in enumerate(words) if w == "netweave" or w.endswith("/netweave")), None)
    if at is None:
        return None
    args = words[at + 1:]
    if args[:2] == ["emu", "compare"] or "--backend" in args and args[args.index("--backend") + 1:][:1] == ["mininet"]:
        return "emulation", "Mininet emulation needs root and Mininet"
    if "--backend" in args and args[args.index("--backend") + 1:][:1] == ["ns3"]:
        return "slow", "ns-3's Python bindings parse its headers for about 100 s on import"
    if args[:2] == ["pipe", "run"] and "cuda" in args:
        return "gpu", "NCCL ranks on GPU 0"
    if args[:2] == ["pipe", "run"]:
        return "slow", "minutes of real gloo processes on this CPU"
    if args[:1] == ["bench"] and "--list" not in args:
        return "slow", "a benchmark run takes minutes"
    return None


def verdict(step: Step) -> tuple[str, str] | None:
    """("emulation" | "skip", reason) for a step not to run here (or to run under the emulation marker); None: run it.

    The page's marker wins over what the command's name says.
    """
    marked = step.marker if step.marker and step.marker[0] != "output" else None
    kind, reason = marked or heuristic_verdict(step) or (None, "")
    if kind == "skip":
        return "skip", reason or "marked skip in the page"
    if kind == "gpu":
        import torch

        return None if torch.cuda.is_available() else ("skip", f"needs a CUDA GPU ({reason or 'marked gpu'})")
    if kind == "slow":
        return None if SLOW else ("skip", f"{reason}; NETWEAVE_DOCS_SLOW=1 runs it")
    if kind == "emulation":
        return "emulation", reason
    return None


def prepare_workdir(path: Path) -> Path:
    """What a page's commands assume a user has: an ``nvidia-smi topo -m`` dump and the checkout's ``examples/``."""
    shutil.copy(REPO / "tests" / "data" / "nvsmi_dgx_h100.txt", path / "nvidia-smi-topo.txt")
    (path / "examples").symlink_to(REPO / "examples", target_is_directory=True)
    shim = path / ".venv" / "bin"  # the set-up's virtual environment (`make demo`), as the pages call it
    shim.mkdir(parents=True)
    for name, target in (("netweave", f'exec "{sys.executable}" -m netweave "$@"'), ("python", f'exec "{sys.executable}" "$@"')):
        (shim / name).write_text(f"#!/bin/sh\n{target}\n")
        (shim / name).chmod(0o755)
    return path


def _check_output(where: str, step: Step, out: str) -> None:
    if step.expect is None or step.marker and step.marker[0] == "output":
        return
    if not doctest.OutputChecker().check_output(step.expect, out, CHECK):
        raise AssertionError(f"{where}: `{step.text}` printed\n{out[-3000:]}\nbut the page shows\n{step.expect}")


def run_step(step: Step, page: str, workdir: Path, capsys) -> None:
    """Run one step in ``workdir`` (the current directory); an assertion names the page and line on failure."""
    where = f"{page} line {step.line}"
    if step.kind == "heredoc":
        (workdir / step.path).parent.mkdir(parents=True, exist_ok=True)
        (workdir / step.path).write_text(step.body)
    elif step.kind == "python":
        exec(compile(step.body, f"{page}:{step.line}", "exec"), {"__name__": "__doc_page__"})
    elif step.kind == "doctest":
        test = doctest.DocTestParser().get_doctest(step.body, {}, where, page, step.line - 1)
        runner = doctest.DocTestRunner(optionflags=CHECK)
        runner.run(test, out=lambda s: print(s, end=""))
        out, _ = capsys.readouterr()
        assert runner.summarize(verbose=False).failed == 0, f"{where}: doctest failed\n{out[-4000:]}"
    elif step.kind == "netweave":
        from netweave.cli import main

        capsys.readouterr()
        code = main(shlex.split(step.text, comments=True)[1:])
        out, err = capsys.readouterr()
        assert code == 0, f"{where}: `{step.text}` exited {code}\n{err[-2000:]}"
        _check_output(where, step, out)
    else:
        env = {**os.environ, "PATH": os.pathsep.join([str(workdir / ".venv" / "bin"), str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}
        res = subprocess.run(["bash", "-c", step.text], cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, f"{where}: `{step.text}` exited {res.returncode}\n{res.stderr[-2000:]}"
        _check_output(where, step, res.stdout)


def run_in_order(steps: list[Step], step: Step, page: str, workdir: Path, capsys) -> None:
    """Run ``step``, first running the earlier steps of its page that have not run in ``workdir`` (a step selected
    alone with ``-k`` gets the files the steps before it write)."""
    done, failed = workdir / ".steps-done", workdir / ".steps-failed"
    if failed.exists():
        raise AssertionError(f"{page}: an earlier step failed (line {failed.read_text()}); this one depends on it")
    ran = set(done.read_text().split()) if done.exists() else set()
    for earlier in [*steps[: steps.index(step)], step]:
        if earlier is step or str(earlier.line) not in ran and verdict(earlier) is None:
            try:
                run_step(earlier, page, workdir, capsys)
            except BaseException:
                failed.write_text(str(earlier.line))
                raise
            ran.add(str(earlier.line))
    done.write_text(" ".join(sorted(ran)))
