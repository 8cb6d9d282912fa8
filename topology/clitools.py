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
