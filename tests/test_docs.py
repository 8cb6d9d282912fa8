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


@pytest.mark.parametrize("page", [p for p in GUIDES if ">>> " in p.read_text(encoding="utf-8")], ids=page_id)
def test_guide_examples_run(page):
    """The guide's ``>>>`` examples run as doctests (a code fence ends an example's expected output)."""
    text = re.sub(r"^```.*$", "", page.read_text(encoding="utf-8"), flags=re.MULTILINE)
    test = doctest.DocTestParser().get_doctest(text, {}, page_id(page), str(page), 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(test)
    assert runner.summarize(verbose=False).failed == 0


def test_helpers():
    import sys

    assert doctest.testmod(sys.modules[__name__]).failed == 0


def test_the_checks_catch_what_they_look_for(tmp_path):
    """A broken link, a missing result and a long page are found (the checks can fail)."""
    text = "[x](no/such.md) `bench/results/no_such_result.md` `bench/results/nothing_*.md`\n"
    assert [t for t in relative_links(text) if not (tmp_path / t).exists()] == ["no/such.md"]
    cited = cited_results(text)
    assert [p for _, p in cited if not result_exists(p)] == [
        "bench/results/no_such_result.md", "bench/results/nothing_*.md"]
