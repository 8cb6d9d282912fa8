"""Emulation runs: a run id in every name a run creates, a record per run, and removal of what *dead* runs left.

A Mininet emulation creates kernel objects that outlive its driver process
when that process is killed: bridges and veths in the root namespace, one
shell per emulated host holding an unnamed network namespace, the processes
started in those hosts (traffic agents, torch ranks, iperf3), and temporary
files. To find them again, and only them:

- every run has a *prefix* (``nw`` + 4 random letters/digits, :func:`new_prefix`)
  that starts every host, switch and interface name it creates
  (``nwk3x9h0-eth0``, ``nwk3x9s0``);
- every run has a directory ``RUNS_DIR/<prefix>/`` holding ``owner`` (the
  driver's pid and kernel start time), ``pids`` (pid and start time of every
  process the run started in its hosts, host shells included), ``links``
  (the root-namespace links it creates), ``phase`` (what it is doing) and
  ``work/`` (its temporary files: tc batches, agent sockets and logs, rank
  logs);
- :func:`reap_dead_runs`, called by every new run before it builds anything,
  removes a run's leftovers only when its owner is dead (the pid is gone or
  now belongs to a process with another start time): it kills the run's
  recorded processes (pid *and* start time must match) and any process whose
  command line names one of the run's hosts or switches exactly
  (``mininet:<prefix>h0``, ``--name <prefix>h0``) or its directory, deletes
  the root-namespace links whose names follow the run's grammar
  (``<prefix>s<N>``, ``<prefix>s<N>-eth<M>``, ``<prefix>h<N>-eth<M>``), and
  removes the directory. The namespaces go with their last process. A live
  run's objects are never touched, whoever started it.

:func:`sigterm_as_interrupt` makes SIGTERM behave like Ctrl-C (SIGINT) while a
network is up, so ``kill PID`` runs the same clean-up as an interrupt.

>>> p = new_prefix()
>>> len(p), p.startswith("nw"), is_run_name(p + "h0-eth1", p), is_run_name(p + "h0x", p)
(6, True, True, False)
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import signal
import string
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from topology.io import atomic_write_text

log = logging.getLogger(__name__)

#: Where runs keep their records (one directory per run, named by its prefix).
RUNS_DIR = Path(tempfile.gettempdir()) / "netweave-emu-runs"
_ALPHABET = string.ascii_lowercase + string.digits
#: A run directory without an owner file older than this is a run killed while it registered.
_UNOWNED_GRACE_S = 60.0


def new_prefix(tag: str = "nw") -> str:
    """A fresh run prefix: ``tag`` + 4 random lowercase letters/digits, not used by any recorded run."""
    while True:
        prefix = tag + "".join(secrets.choice(_ALPHABET) for _ in range(4))
        if not (RUNS_DIR / prefix).exists():
            return prefix


def is_run_name(name: str, prefix: str) -> bool:
    """Whether ``name`` is a host, switch or interface name of the run ``prefix`` (its exact grammar, nothing else)."""
    return re.fullmatch(re.escape(prefix) + r"[hs]\d+(-eth\d+)?", name) is not None


def process_start(pid: int) -> int | None:
    """The kernel start time (clock ticks since boot) of ``pid``, None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[19])  # field 22; the command name (field 2) may contain spaces


def _alive(pid: int, start: int) -> bool:
    return process_start(pid) == start


def _read_pairs(path: Path) -> list[tuple[int, int]]:
    out = []
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit():
            out.append((int(parts[0]), int(parts[1])))
    return out


class EmuRun:
    """The record of one run (see the module docstring); :meth:`register` creates it, :meth:`close` removes it."""

    def __init__(self, prefix: str, root: Path | None = None):
        if not re.fullmatch(r"[a-z][a-z0-9]{1,9}", prefix):
            raise ValueError(f"a run prefix is 2-10 lowercase letters or digits starting with a letter, got {prefix!r}")
        self.prefix = prefix
        self.dir = (root or RUNS_DIR) / prefix
        self.work = self.dir / "work"
        self._lock = threading.Lock()

    @classmethod
    def register(cls, prefix: str, links: list[str], root: Path | None = None) -> EmuRun:
        """Create the record of a run of this process; raises :class:`RuntimeError` when a live run holds ``prefix``."""
        run = cls(prefix, root)
        run.dir.parent.mkdir(parents=True, exist_ok=True)
        try:
            run.dir.mkdir()
        except FileExistsError:
            owner = run.owner()
            if owner is not None and _alive(*owner):
                raise RuntimeError(f"run prefix {prefix!r} is in use by the live emulation of pid {owner[0]} ({run.dir})") from None
            reap_run(run.dir)
            run.dir.mkdir()
        atomic_write_text(run.dir / "owner", f"{os.getpid()} {process_start(os.getpid())}\n")
        atomic_write_text(run.dir / "links", "".join(f"{name}\n" for name in links))
        run.work.mkdir()
        run.set_phase("building")
        return run

    def owner(self) -> tuple[int, int] | None:
        pairs = _read_pairs(self.dir / "owner")
        return pairs[0] if pairs else None

    def record_pid(self, pid: int) -> None:
        """Remember a process this run started (appended with its start time, so a reused pid is never mistaken for it)."""
        start = process_start(pid)
        if start is None:
            return
        with self._lock, open(self.dir / "pids", "a") as f:
            f.write(f"{pid} {start}\n")
            f.flush()
            os.fsync(f.fileno())

    def set_phase(self, phase: str) -> None:
        atomic_write_text(self.dir / "phase", phase + "\n")

    def close(self) -> None:
        """Remove the record (after the run removed its own objects)."""
        shutil.rmtree(self.dir, ignore_errors=True)


def _proc_cmdlines() -> Iterator[tuple[int, list[str]]]:
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        yield int(entry.name), [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def run_processes(run_dir: Path) -> list[int]:
    """Live processes of the (dead) run recorded in ``run_dir``: recorded pids whose start time matches, and those naming its hosts."""
    prefix = run_dir.name
    found = {pid for pid, start in _read_pairs(run_dir / "pids") if _alive(pid, start)}
    me = os.getpid()
    for pid, args in _proc_cmdlines():
        if pid == me:
            continue
        names = [a.removeprefix("mininet:") for a in args if a.startswith("mininet:")]
        names += [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--name"]
        if any(is_run_name(n, prefix) for n in names) or any(str(run_dir) + "/" in a for a in args):
            found.add(pid)
    return sorted(found)


def _root_links() -> list[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return [m.group(1) for m in re.finditer(r"^\d+: ([^:@\s]+)[@:]", out, re.M)]


def run_links(run_dir: Path) -> list[str]:
    """Root-namespace links that follow the run's name grammar."""
    return [name for name in _root_links() if is_run_name(name, run_dir.name)]


def reap_run(run_dir: Path) -> dict[str, int]:
    """Remove what the dead run of ``run_dir`` left: its processes, its root-namespace links, its directory; returns the counts."""
    procs = run_processes(run_dir)
    for pid in procs:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(process_start(p) is not None and _zombie_or_alive(p) for p in procs):
        time.sleep(0.05)
    links = run_links(run_dir)
    for name in links:
        subprocess.run(["ip", "link", "del", name], capture_output=True)
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"processes": len(procs), "links": len(links), "dirs": 1}


def _zombie_or_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0]
    except OSError:
        return False
    return state != b"Z"  # a zombie has released its namespaces; its parent reaps it


def dead_runs(root: Path | None = None) -> list[Path]:
    """Run directories whose owner process is gone (or, without an owner file, that are older than a minute)."""
    base = root or RUNS_DIR
    if not base.is_dir():
        return []
    out = []
    for d in sorted(base.iterdir()):
        if not d.is_dir():
            continue
        owner = EmuRun(d.name, base).owner() if re.fullmatch(r"[a-z][a-z0-9]{1,9}", d.name) else None
        if owner is not None:
            if not _alive(*owner):
                out.append(d)
        else:
            try:
                if time.time() - d.stat().st_mtime > _UNOWNED_GRACE_S:
                    out.append(d)
            except OSError:
                pass
    return out


def reap_dead_runs(root: Path | None = None) -> dict[str, int]:
    """Remove the leftovers of every dead run (see the module docstring); returns the totals removed."""
    total = {"runs": 0, "processes": 0, "links": 0}
    for d in dead_runs(root):
        counts = reap_run(d)
        log.warning("removed the leftovers of dead emulation run %s: %d processes, %d links", d.name, counts["processes"], counts["links"])
        total["runs"] += 1
        total["processes"] += counts["processes"]
        total["links"] += counts["links"]
    return total


@contextmanager
def sigterm_as_interrupt(stopping: Callable[[], bool] = lambda: False) -> Iterator[None]:
    """Inside the block SIGTERM raises :class:`KeyboardInterrupt`, as Ctrl-C does, so ``finally`` clean-up runs.

    While ``stopping()`` is true (clean-up under way) a SIGTERM is ignored, so
    that a second ``kill`` cannot cut the clean-up short. Only the main thread
    can install handlers; elsewhere the block runs unchanged.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        if stopping():
            log.warning("SIGTERM during clean-up: finishing the clean-up first")
            return
        raise KeyboardInterrupt("SIGTERM")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


__all__ = ["RUNS_DIR", "EmuRun", "dead_runs", "is_run_name", "new_prefix", "process_start", "reap_dead_runs", "reap_run", "run_links",
           "run_processes", "sigterm_as_interrupt"]
