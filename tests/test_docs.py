"""The documentation holds together: its links resolve, the results it cites exist, guides stay short, examples run.

Guides are ``README.md`` and ``docs/*.md``; validation histories live in ``docs/validation/`` and may be long. A
result cited as ``git show <commit>:bench/results/...`` (an older run; the repository keeps one current file per
benchmark) is checked in git's history when the checkout has one. A path right after "writes" is where a script
puts its output, not a citation.
"""

from __future__ import annotations

import doctest
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from doc_steps import Step, page_steps, prepare_workdir, run_in_order, verdict

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
PAGES = sorted([REPO / "README.md", *DOCS.glob("*.md"), *DOCS.glob("validation/*.md")])
GUIDES = [p for p in PAGES if p.parent != DOCS / "validation"]
GUIDE_MAX_LINES = 400

LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
RESULT = re.compile(r"(git show ([0-9a-f]{7,40}):)?(bench/results/[A-Za-z0-9_.*{},/-]*)")


def page_id(path: Path) -> str:
    return str(path.relative_to(REPO))


def relative_links(text: str) -> list[str]:
    """Targets of markdown links that point into the repository (no scheme, not a bare anchor).

    >>> relative_links("see [a](docs/a.md#x), [b](https://x.org) and [c](#here)")
    ['docs/a.md#x']
    """
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def expand_braces(path: str) -> list[str]:
    """``a.{json,md}`` -> ``a.json``, ``a.md`` (one brace group, as the docs write it).

    >>> expand_braces("bench/results/x.{json,md}")
    ['bench/results/x.json', 'bench/results/x.md']
    >>> expand_braces("bench/results/x.md")
    ['bench/results/x.md']
    """
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [path[: m.start()] + alt + path[m.end():] for alt in m.group(1).split(",")]


def cited_results(text: str) -> list[tuple[str | None, str]]:
    """``(commit or None, path)`` for every ``bench/results/...`` the text cites, outputs after "writes" excluded.

    >>> cited_results("in `bench/results/a.md`; `git show 0af25be:bench/results/b.md`; it writes bench/results/c.md.")
    [(None, 'bench/results/a.md'), ('0af25be', 'bench/results/b.md')]
    """
    found = []
    for m in RESULT.finditer(text):
        before = text[max(0, m.start() - 12): m.start()]
        if m.group(1) is None and re.search(r"writes\W*$", before):
            continue
        path = m.group(3).rstrip(".,")
        found.extend((m.group(2), p) for p in expand_braces(path))
    return found


def result_exists(path: str) -> bool:
    """A cited result file exists; a glob (``pipesched_*.md``) matches at least one file."""
    return any(REPO.glob(path)) if "*" in path else (REPO / path).exists()


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_relative_link_resolves(page):
    missing = []
    for target in relative_links(page.read_text(encoding="utf-8")):
        path = target.split("#", 1)[0]
        if path and not (page.parent / path).exists():
            missing.append(target)
    assert not missing, f"{page_id(page)}: links to missing files: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_cited_result_exists(page):
    missing = []
    has_git = (REPO / ".git").exists() and shutil.which("git") is not None
    for commit, path in cited_results(page.read_text(encoding="utf-8")):
        if commit is not None:
            if has_git:
                res = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{commit}:{path}"], capture_output=True)
                if res.returncode != 0:
                    missing.append(f"{commit}:{path}")
        elif not result_exists(path):
            missing.append(path)
    assert not missing, f"{page_id(page)}: cites results that do not exist: {missing}"


@pytest.mark.parametrize("page", GUIDES, ids=page_id)
def test_guides_are_short(page):
    lines = page.read_text(encoding="utf-8").count("\n")
    assert lines <= GUIDE_MAX_LINES, (f"{page_id(page)} has {lines} lines; a guide reads in ten minutes "
                                      f"(at most {GUIDE_MAX_LINES}): move histories to docs/validation/")


# Every guide's steps run, in order (the README has its own test, tests/test_readme.py); a block that cannot run
# here says why with a marker before its fence.
GUIDE_STEPS = [(page, step) for page in GUIDES if page.name != "README.md" for step in page_steps(page.read_text(encoding="utf-8"))]


def _step_param(page: Path, step: Step):
    why = verdict(step)
    label = step.text if step.kind != "heredoc" else f"write {step.path}"
    marks = [pytest.mark.emulation] if why and why[0] == "emulation" else []
    return pytest.param(page, step, id=f"{page.name}:L{step.line} {label[:50]}", marks=marks)


@pytest.fixture(scope="module")
def page_dirs(tmp_path_factory):
    """One working directory per guide, shared by its steps (they run in order)."""
    dirs: dict[Path, Path] = {}

    def get(page: Path) -> Path:
        if page not in dirs:
            dirs[page] = prepare_workdir(tmp_path_factory.mktemp(page.stem))
        return dirs[page]

    return get


@pytest.mark.parametrize(("page", "step"), [_step_param(p, s) for p, s in GUIDE_STEPS])
def test_guide_step(page, step, page_dirs, monkeypatch, capsys):
    """Each guide's commands run as written, in order, in the guide's own empty directory; a ``console`` block's
    output is what the command prints; ``>>>`` examples run as doctests; python blocks run."""
    why = verdict(step)
    if why and why[0] == "skip":
        pytest.skip(why[1])
    workdir = page_dirs(page)
    monkeypatch.chdir(workdir)
    steps = [s for p, s in GUIDE_STEPS if p == page]
    run_in_order(steps, step, page_id(page), workdir, capsys)


def test_helpers():
    import sys

    import doc_steps

    assert doctest.testmod(sys.modules[__name__]).failed == 0
    assert doctest.testmod(doc_steps).failed == 0


def test_the_checks_catch_what_they_look_for(tmp_path):
    """A broken link, a missing result and a long page are found (the checks can fail)."""
    text = "[x](no/such.md) `bench/results/no_such_result.md` `bench/results/nothing_*.md`\n"
    assert [t for t in relative_links(text) if not (tmp_path / t).exists()] == ["no/such.md"]
    cited = cited_results(text)
    assert [p for _, p in cited if not result_exists(p)] == [
        "bench/results/no_such_result.md", "bench/results/nothing_*.md"]


def netweave_mentions(text: str) -> list[tuple[int, str]]:
    """``(line, command)`` for every ``netweave VERB ...`` a page writes: in code spans, indented lines and fenced blocks.

    >>> netweave_mentions("netweave is a tool: run `netweave topo show c.json` or\\n\\n    netweave pipe plan --stages 4  # x\\n")
    [(1, 'netweave topo show c.json'), (3, 'netweave pipe plan --stages 4')]
    """
    found, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        spans = [line.split("#")[0]] if fenced or line.startswith("    ") else re.findall(r"`([^`]*)`", line)
        for span in spans:
            for m in re.finditer(r"(?:^|[\s$(])(netweave(?: [^#`]*)?)", span):
                found.append((n, m.group(1).split(" # ")[0].strip()))
    return found


def _subcommands(parser) -> dict:
    import argparse

    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return subs[0].choices if subs else {}


def check_mention(parser, command: str) -> str | None:
    """What is wrong with a command a page mentions: an unknown sub-command or a flag its sub-command lacks.

    Words after the sub-commands are not checked (placeholders); ``--flags`` after them are, up to ``--extra`` (whose
    arguments go to another program). Synopses may list alternatives: ``serve/agent``, and ``| env [--plan F]``
    (a sibling sub-command after ``|``).
    """
    words = command.split()[1:]
    if "--extra" in words:
        words = words[: words.index("--extra")]
    segments, current = [], []
    for word in words:
        if word == "|":
            segments.append(current)
            current = []
        else:
            current.append(word)
    segments.append(current)
    parent, path, at = None, ["netweave"], parser
    for k, segment in enumerate(segments):
        if k and segment and parent is not None and segment[0] in _subcommands(parent):
            at, path = parent, path[:-1]
        elif k:
            pass  # an alternative value of the same command (`--model a | --model b`)
        leaves = [at]
        for i, word in enumerate(segment):
            names = word.split("/")
            subs = _subcommands(leaves[0])
            if not subs or word.startswith("-") or not all(n in subs for n in names):
                if k == 0 and i == 0 and subs and re.fullmatch(r"[a-z][a-z-]*", word):
                    return f"no command 'netweave {word}'"
                segment = segment[i:]
                break
            parent, leaves = leaves[0], [subs[n] for n in names]
            path.append(word)
        else:
            segment = []
        at = leaves[0]
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", " ".join(segment)):
            for leaf in leaves:
                if flag not in {o for a in leaf._actions for o in a.option_strings}:
                    return f"'{' '.join(path)}' has no {flag}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_command_a_page_mentions_exists(page):
    """Every ``netweave ...`` a page mentions, even in prose and synopses, names sub-commands and flags that exist."""
    from netweave.cli import build_parser

    parser = build_parser()
    wrong = [f"line {n}: `{cmd}`: {why}" for n, cmd in netweave_mentions(page.read_text(encoding="utf-8"))
             if (why := check_mention(parser, cmd))]
    assert not wrong, f"{page_id(page)}:\n" + "\n".join(wrong)


def test_mention_check_can_fail():
    from netweave.cli import build_parser

    parser = build_parser()
    assert check_mention(parser, "netweave topo show c.json --json") is None
    assert check_mention(parser, "netweave topo show c.json --no-such-flag") == "'netweave topo show' has no --no-such-flag"
    assert check_mention(parser, "netweave topology show") == "no command 'netweave topology'"
    assert check_mention(parser, "netweave flow serve/agent --config F") is None
    assert check_mention(parser, "netweave flow serve/agent --host H") == "'netweave flow serve/agent' has no --host"
    assert check_mention(parser, "netweave flow nccl build [--sanitize] | env [--plan F] | loopback [--class K]") is None
    assert check_mention(parser, "netweave flow nccl build | env [--sanitize]") == "'netweave flow nccl env' has no --sanitize"
    assert check_mention(parser, "netweave bench sim --extra --quick") is None


def test_step_runner_can_fail(tmp_path, monkeypatch, capsys):
    """A console block's shown output is compared (a wrong line fails), a failing command fails, markers are read."""
    import doc_steps

    monkeypatch.chdir(prepare_workdir(tmp_path))
    right, wrong, failing = page_steps(
        "```console\n$ netweave flow nccl env --class 5\n# ib fabric: ...\nexport NCCL_IB_TC=160\nexport NCCL_IB_SL=5\n"
        "$ netweave flow nccl env --class 4\nexport NCCL_IB_TC=999\n...\n$ netweave topo show no-such-file.json\n```\n")
    doc_steps.run_step(right, "page.md", tmp_path, capsys)
    with pytest.raises(AssertionError, match="but the page shows"):
        doc_steps.run_step(wrong, "page.md", tmp_path, capsys)
    with pytest.raises(AssertionError, match="exited 2"):
        doc_steps.run_step(failing, "page.md", tmp_path, capsys)
    marked = page_steps("<!-- test: skip a cluster host -->\n```sh\nsbatch x\n```\n<!-- test: output varies -->\n```console\n$ ls\nx\n```\n")
    assert verdict(marked[0]) == ("skip", "a cluster host") and verdict(marked[1]) is None
    with pytest.raises(ValueError, match="unknown test marker"):
        page_steps("<!-- test: skp typo -->\n```sh\nls\n```\n")
