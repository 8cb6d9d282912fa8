"""The planner's state file: which GPUs earlier ``place plan`` runs gave to which jobs, kept across runs.

``netweave place plan --state FILE`` loads the HiveD allocator from ``FILE`` (or starts an empty one with the
jobs file's virtual clusters), places the new jobs next to the running ones, and writes the allocator back;
``netweave place release --state FILE JOB...`` frees jobs. Two runs never hand out the same GPUs.

Concurrency and crashes: every reader-writer holds an exclusive ``fcntl.flock`` on ``FILE.lock`` for the whole
load-plan-save cycle, so concurrent runs serialise; the file is replaced atomically
(:func:`topology.io.atomic_write_text`: a temporary file, fsync, rename, fsync of the directory), so a run killed
at any point leaves the old state or the new one. Temporary files a killed writer left (``.FILE.*.tmp``) are
removed under the lock, where no other writer can be using one.

The file is HiveD's own state (``netweave-hived-state``, :meth:`placement.hived.HivedScheduler.to_state`).

>>> import tempfile, pathlib, topology
>>> path = pathlib.Path(tempfile.mkdtemp()) / "cluster.state"
>>> topo = topology.default_cluster()
>>> with locked_scheduler(path, topo, {}) as sched:
...     _ = sched.allocate("a", 8)
>>> with locked_scheduler(path, topo, {}) as sched:
...     sorted(sched.jobs), len(sched.job_gpus("a"))
(['a'], 8)
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from topology.errors import InputError
from topology.model import Topology

from .hived import HivedScheduler, read_state


@contextlib.contextmanager
def locked_scheduler(path: str | os.PathLike[str], topo: Topology, virtual_clusters: Mapping[str, Any] | None = None, *,
                     save: bool = True, must_exist: bool = False) -> Iterator[HivedScheduler]:
    """The allocator stored at ``path``, under an exclusive lock; written back atomically when the block ends without an error.

    A missing file starts an empty allocator with ``virtual_clusters`` (``must_exist`` makes it an error); an
    existing one must have been written for a topology of the same name, and ``virtual_clusters``, when given,
    must equal the stored ones (quotas cannot change under running jobs).
    """
    path = Path(path)
    source = str(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_name(path.name + ".lock"), "a")  # noqa: SIM115 - held for the block
    except OSError as exc:
        raise InputError(f"cannot open the lock file ({exc.strerror or exc})", source=source) from None
    with lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        remove_stale_temp_files(path)
        if path.exists():
            stored = read_state(path)
            if isinstance(stored, dict) and stored.get("topology") != topo.name:
                raise InputError(f"the state was written for topology {stored.get('topology')!r}, not {topo.name!r}", source=source)
            sched = HivedScheduler.from_state(topo, stored, source=source)
            if virtual_clusters and dict(virtual_clusters) != sched.vc_spec:
                raise InputError("the jobs file's virtual clusters differ from the state's; quotas cannot change under running jobs",
                                 source=source, where="virtual_clusters")
        elif must_exist:
            raise InputError("no such state file", source=source)
        else:
            sched = HivedScheduler(topo, virtual_clusters or {})
        yield sched
        if save:
            sched.save(source)


def remove_stale_temp_files(path: str | os.PathLike[str]) -> list[str]:
    """Remove the temporary files an interrupted atomic write of ``path`` left; call only while holding its lock.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / ".s.json.x1.tmp").write_text("half")
    >>> [pathlib.Path(p).name for p in remove_stale_temp_files(d / "s.json")], sorted(d.iterdir())
    (['.s.json.x1.tmp'], [])
    """
    path = Path(path)
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in path.parent.iterdir():
            if entry.name.startswith(f".{path.name}.") and entry.name.endswith(".tmp"):
                with contextlib.suppress(FileNotFoundError):
                    entry.unlink()
                    removed.append(str(entry))
    return removed


__all__ = ["locked_scheduler", "remove_stale_temp_files"]
