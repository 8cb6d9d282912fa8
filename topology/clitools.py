"""Small helpers shared by every package's command-line module."""

from __future__ import annotations

import argparse
import json
import sys
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
