"""The README's "Launch a job" example is the file that the tests run.

The README shows the lines of ``examples/train_transformer.py`` that adopt the runtime; here every run of lines
between ``...`` markers must be that file's text (whitespace included, up to a common indentation), in the file's
order. The README's jobs file, planned as the README says, writes launch scripts that run that file; so do the jobs
files of the launch test (tests/test_launch_run.py) and the emulation test (tests/test_launch_emulation.py).
"""

from __future__ import annotations

import re
import shlex
import textwrap
from pathlib import Path

import pytest
import test_launch_emulation
import test_launch_run

from netweave.cli import main
from topology.io import write_topology

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
EXAMPLE = REPO / "examples" / "train_transformer.py"


def launch_section(text: str) -> str:
    m = re.search(r"^## Launch a job\n(.*?)(?=^## )", text, re.M | re.S)
    assert m, "README has no '## Launch a job' section"
    return m.group(1)


def code_block(section: str, lang: str) -> str:
    blocks = re.findall(rf"^```{lang}\n(.*?)^```", section, re.M | re.S)
    assert len(blocks) == 1, f"expected one {lang} block in the README's 'Launch a job' section, found {len(blocks)}"
    return blocks[0]


def excerpts_in_file(block: str, source: str) -> list[int]:
    """The first line (0-based) in ``source`` of each ``...``-separated excerpt of ``block``, in order; AssertionError
    naming the excerpt that is not a run of ``source``'s lines after the previous one."""
    lines = source.splitlines()
    chunks, cur = [], []
    for line in block.splitlines():
        if line.strip() == "...":
            chunks.append(cur)
            cur = []
        else:
            cur.append(line)
    chunks.append(cur)
    found, start = [], 0
    for chunk in (c for c in chunks if c):
        want = textwrap.dedent("\n".join(chunk))
        at = next((i for i in range(start, len(lines) - len(chunk) + 1)
                   if textwrap.dedent("\n".join(lines[i:i + len(chunk)])) == want), None)
        assert at is not None, f"README excerpt is not in the file (after line {start + 1}):\n{want}"
        found.append(at)
        start = at + len(chunk)
    return found


def test_readme_adoption_lines_are_the_example_file():
    block = code_block(launch_section(README.read_text()), "python")
    source = EXAMPLE.read_text()
    at = excerpts_in_file(block, source)
    assert len(at) >= 2 and "import netweave.runtime as nw" in block and "job.data_parallel(model)" in block
    assert "job.pipeline(model, loss_fn)" in block and "job.iterations(" in block


def test_the_check_notices_a_changed_line():
    block = code_block(launch_section(README.read_text()), "python")
    source = EXAMPLE.read_text()
    with pytest.raises(AssertionError, match="not in the file"):
        excerpts_in_file(block.replace("lr=args.lr", "lr=0.1"), source)
    with pytest.raises(AssertionError, match="not in the file"):   # the file's order counts
        parts = block.split("...\n")
        excerpts_in_file("...\n".join([parts[0], parts[2], parts[1]]), source)


def _exec_script(launch_sh: Path) -> Path:
    """The training script a launch script runs (the first argument after torchrun's options)."""
    line = next(x for x in launch_sh.read_text().splitlines() if x.startswith("exec "))
    words = shlex.split(line)
    return Path(next(w for w in words[2:] if not w.startswith("--")))


def test_readme_jobs_file_and_the_tests_run_the_example(tmp_path, capsys):
    # the README's own commands: its jobs file (script relative to the jobs file: the checkout's examples/)
    sh = code_block(launch_section(README.read_text()), "sh")
    jobs = re.search(r"<<'YAML'\n(.*?)^YAML$", sh, re.M | re.S).group(1)
    (tmp_path / "examples").symlink_to(REPO / "examples")
    (tmp_path / "jobs.yaml").write_text(jobs)
    cmd = next(x for x in sh.splitlines() if x.startswith("netweave launch"))
    argv = shlex.split(cmd)[1:]
    argv[argv.index("--jobs") + 1] = str(tmp_path / "jobs.yaml")
    argv[argv.index("--out") + 1] = str(tmp_path / "bundles")
    assert main(argv) == 0
    scripts = sorted((tmp_path / "bundles").glob("*/launch-*.sh"))
    assert scripts and all(_exec_script(s).resolve() == EXAMPLE for s in scripts)
    # the launch test and the emulation test run the same file, through scripts that name it
    assert test_launch_run.EXAMPLE == EXAMPLE == test_launch_emulation.EXAMPLE
    write_topology(test_launch_emulation.shared_link_cluster(), tmp_path / "c.json")
    hosts = {"n0": "10.0.1.1", "n1": "10.0.1.2", "n2": "10.0.1.3"}
    (tmp_path / "emu.yaml").write_text(test_launch_emulation.jobs_yaml(tmp_path, hosts, dict.fromkeys(hosts, "lo")))
    assert main(["launch", "--topology", str(tmp_path / "c.json"), "--jobs", str(tmp_path / "emu.yaml"), "--out", str(tmp_path / "emu")]) == 0
    capsys.readouterr()
    scripts = sorted((tmp_path / "emu").glob("*/launch-*.sh"))
    assert len(scripts) == 4 and all(_exec_script(s) == EXAMPLE for s in scripts)
