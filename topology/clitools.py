"""Small helpers shared by every package's command-line module."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable JSON on stdout")


def emit(args: argparse.Namespace, data: Any, text: str) -> None:
    """Print ``data`` as JSON when ``--json`` was given, else the human ``text``."""
    if getattr(args, "json", False):
        json.dump(data, sys.stdout, indent=1, default=str)
        sys.stdout.write("\n")
    else:
        print(text)


def progress(message: str) -> None:
    """A progress line on stderr (stdout stays clean for --json)."""
    print(message, file=sys.stderr, flush=True)


class Stages:
    """A progress bar with an ETA on stderr over weighted stages of one long command (rich).

    ``weights`` maps each stage name to its expected share of the work, so the bar (and the ETA, from the
    rate so far) moves by what a stage costs, not by stage counts. Nothing is shown when ``enabled`` is false
    or stderr is not a terminal (scripts and tests see clean output).

    >>> with Stages({"read": 1.0, "count": 3.0}, enabled=False) as stages:
    ...     with stages.stage("read"):
    ...         pass
    ...     with stages.stage("count"):
    ...         pass
    >>> stages.done
    4.0
    """

    def __init__(self, weights: dict[str, float], *, enabled: bool = True, label: str = "") -> None:
        self.weights = dict(weights)
        self.done = 0.0
        self._progress = None
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn(),
                                      TextColumn("ETA"), TimeRemainingColumn(), console=Console(stderr=True), transient=True)
            self._task = self._progress.add_task(label, total=sum(self.weights.values()))
        self._label = label

    def __enter__(self) -> Stages:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def stage(self, name: str) -> _Stage:
        """A context manager for the stage ``name``: shown while it runs, its weight added when it ends."""
        return _Stage(self, name)


class _Stage:
    def __init__(self, owner: Stages, name: str) -> None:
        self.owner, self.name = owner, name

    def __enter__(self) -> None:
        p = self.owner._progress
        if p is not None:
            p.update(self.owner._task, description=f"{self.owner._label}{self.name}")

    def __exit__(self, *exc: object) -> None:
        weight = self.owner.weights[self.name]
        self.owner.done += weight
        p = self.owner._progress
        if p is not None:
            p.update(self.owner._task, advance=weight)
