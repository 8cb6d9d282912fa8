"""Small helpers shared by every package's command-line module."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable JSON on stdout")


def add_output(parser: argparse.ArgumentParser, *flags: str, directory: bool = False, **kwargs: Any) -> argparse.Action:
    """Add an output option (a file, or a ``directory`` to put files in) that :func:`check_outputs` checks before the work."""
    action = parser.add_argument(*flags, **kwargs)
    outputs = dict(parser.get_default("_outputs") or {})
    outputs[action.dest] = (action.option_strings[0] if action.option_strings else action.dest, directory)
    parser.set_defaults(_outputs=outputs)
    return action


def check_outputs(args: argparse.Namespace) -> None:
    """Raise :class:`~topology.errors.InputError` for an output given to the command that cannot be written.

    Runs before the command does any work, so that ``--out /proc/x`` fails at once, not after a simulation.
    """
    from .inputs import check_output

    for dest, (flag, directory) in (getattr(args, "_outputs", None) or {}).items():
        check_output(getattr(args, dest, None), directory=directory, what=flag)


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


def render_table(columns: Sequence[str], rows: Iterable[Sequence[Any]], *, title: str | None = None, indent: int = 0,
                 terminal: bool | None = None) -> str:
    """A text table of ``rows`` under ``columns`` (rich), for a command's human output.

    A column whose name ends in ``>`` is right-aligned (the ``>`` is dropped): numbers. Cells are printed with
    ``str``, so callers format numbers themselves. On a terminal (``terminal=None`` asks whether stdout is one)
    the header is bold and underlined by a rule; otherwise the table is plain text without colour codes or
    box characters, stable for scripts, ``grep`` and tests: columns two spaces apart, no trailing blanks.

    >>> print(render_table(["policy", "avg JCT s>"], [["fifo", "4,136"], ["hived+cassini", "1,208"]], terminal=False))
    policy         avg JCT s
    fifo               4,136
    hived+cassini      1,208
    """
    import io

    from rich import box
    from rich.console import Console
    from rich.table import Table

    if terminal is None:
        terminal = sys.stdout.isatty()
    table = Table(title=title, box=box.SIMPLE_HEAD if terminal else None, show_edge=False, pad_edge=False, padding=(0, 2, 0, 0),
                  header_style="bold" if terminal else "", title_justify="left", title_style="")
    for name in columns:
        right = name.endswith(">")
        table.add_column(name[:-1] if right else name, justify="right" if right else "left", no_wrap=True)
    for row in rows:
        table.add_row(*(str(c) for c in row))
    buffer = io.StringIO()
    Console(file=buffer, width=100_000, force_terminal=terminal, no_color=not terminal, highlight=False, emoji=False,
            markup=False).print(table)
    pad = " " * indent
    return "\n".join(pad + line.rstrip() for line in buffer.getvalue().splitlines() if line.strip())


def eta_progress(label: str, *, every_s: float = 2.0, clock: Callable[[], float] = time.monotonic,
                 write: Callable[[str], None] | None = None) -> Callable[[int, int], None]:
    """A ``progress`` callback that prints ``label: 3/8 done, 4.1 s elapsed, ETA 6.8 s`` on stderr.

    The ETA assumes the items left take as long on average as those done.
    Lines come at most every ``every_s`` seconds, and always for the last item.

    >>> lines, now = [], iter([0.0, 3.0, 6.0]).__next__
    >>> tick = eta_progress("sweep", every_s=0, clock=now, write=lines.append)
    >>> tick(0, 4); tick(1, 4); tick(2, 4)
    >>> lines
    ['sweep: 0/4 done', 'sweep: 1/4 done, 3.0 s elapsed, ETA 9.0 s', 'sweep: 2/4 done, 6.0 s elapsed, ETA 6.0 s']
    """
    if write is None:
        write = progress
    state = {"start": None, "last": -math.inf}

    def tick(done: int, total: int) -> None:
        now = clock()
        if state["start"] is None:
            state["start"] = now
        if done < total and now - state["last"] < every_s:
            return
        state["last"] = now
        elapsed = now - state["start"]
        if done == 0:
            write(f"{label}: 0/{total} done")
        else:
            eta = elapsed / done * (total - done)
            write(f"{label}: {done}/{total} done, {elapsed:.1f} s elapsed" + (f", ETA {eta:.1f} s" if done < total else ""))

    return tick


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


def split_list(value: str) -> list[str]:
    """The items of one flag value written as a comma list (``a,b`` or ``a``); empty items are dropped.

    >>> split_list("node3,node4/gpu2"), split_list("gpu0"), split_list("a,,b,")
    (['node3', 'node4/gpu2'], ['gpu0'], ['a', 'b'])
    """
    return [item.strip() for item in value.split(",") if item.strip()]


def split_settings(value: str) -> list[str]:
    """``KEY=VALUE`` items of one flag value: a comma starts a new item only where the next part has its own ``KEY=``,
    so a value may itself be a comma list.

    >>> split_settings("oversubscription=2,spines=4"), split_settings("bw=1,2,3,iterations=5"), split_settings("k=v")
    (['oversubscription=2', 'spines=4'], ['bw=1,2,3', 'iterations=5'], ['k=v'])
    """
    items: list[str] = []
    for part in value.split(","):
        if items and "=" not in part:
            items[-1] += "," + part
        else:
            items.append(part)
    return [item for item in items if item]


class CommaList(argparse.Action):
    """``action=CommaList`` for a repeatable flag: ``--fail a --fail b``, ``--fail a,b`` and mixes give ``["a", "b"]``."""

    splitter = staticmethod(split_list)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: str | None = None) -> None:
        items = list(getattr(namespace, self.dest, None) or [])
        items.extend(self.splitter(values))
        setattr(namespace, self.dest, items)


class CommaSettings(CommaList):
    """``action=CommaSettings`` for a repeatable ``KEY=VALUE`` flag: ``--set a=1,b=2`` is ``--set a=1 --set b=2`` (see :func:`split_settings`)."""

    splitter = staticmethod(split_settings)


def check_options(function: Any, options: dict[str, Any], *, flag: str, what: str, skip: int) -> None:
    """Refuse keyword options that ``function`` does not take, naming the ones it does (not Python's TypeError).

    ``skip`` positional parameters (the topology, host or NIC lists) are not options.

    >>> def builder(topo, host, *, nic_gbps=400, model="H100"): ...
    >>> check_options(builder, {"nic_gbps": 200}, flag="--set", what="dgx-h100", skip=2)
    >>> check_options(builder, {"foo": 1}, flag="--set", what="dgx-h100", skip=2)
    Traceback (most recent call last):
    ...
    topology.errors.InputError: --set foo: not an option of dgx-h100; known: model, nic_gbps
    """
    import inspect

    from .errors import InputError

    params = list(inspect.signature(function).parameters.values())[skip:]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    known = sorted(p.name for p in params if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD))
    for key in options:
        if key not in known:
            raise InputError(f"{flag} {key}: not an option of {what}; known: {', '.join(known) or '(none)'}")


def load_callable(spec: str, *, where: str, error: type | None = None) -> Any:
    """The object named by ``MODULE:ATTR``, importing ``MODULE`` as ``python -m`` would: the current directory first on the path.

    Any failure (no such module or attribute, the module raising while it is imported) is one ``error``
    (default :class:`~topology.errors.InputError`) naming ``where``.

    >>> load_callable("json:dumps", where="--model") is json.dumps
    True
    >>> load_callable("json", where="--model")
    Traceback (most recent call last):
    ...
    topology.errors.InputError: --model: expected MODULE:CALLABLE, got 'json'
    """
    import importlib
    import os

    from .errors import InputError

    error = error or InputError
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise error(f"expected MODULE:CALLABLE, got {spec!r}", where=where)
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        loaded = importlib.import_module(module)
    except Exception as exc:   # any import-time failure of user code is bad input, reported on one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise error(f"cannot import {module!r}: {first}", where=where) from None
    finally:
        if added:
            sys.path.remove(cwd)
    if not hasattr(loaded, attr):
        raise error(f"module {module!r} has no function {attr!r}", where=where)
    return getattr(loaded, attr)
