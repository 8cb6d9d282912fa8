"""The ``netweave`` command line: one sub-command per package.

Each package contributes its sub-commands through a ``register(subparsers)``
function in its own ``cli`` module; this file only assembles them and turns
bad input (:class:`topology.errors.InputError`) into one line and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from netweave.runtime.plan import PlanFormatError
from topology.clitools import check_outputs
from topology.errors import InputError

# (module, attribute) pairs; a package whose CLI is not written yet is skipped.
_COMMAND_MODULES = ["topology.cli", "placement.cli", "pipesched.cli", "flowsched.cli", "emu.cli", "netweave.bench", "netweave.launch_cli",
                    "netweave.schema_cli", "netweave.demo"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="netweave",
        description="Network-aware communication and pipeline scheduling for distributed training.",
    )
    parser.add_argument("--version", action="version", version=f"netweave {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue
            raise
        register = getattr(module, "register", None)
        if register is not None:
            register(sub)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("netweave")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except (InputError, PlanFormatError) as exc:  # a flag's value refused by its action (topology.units.flag_action)
        print(f"netweave: error: {exc}", file=sys.stderr)
        return 2
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        check_outputs(args)
        result = args.func(args)
    except (InputError, PlanFormatError) as exc:
        print(f"netweave: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("netweave: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `netweave ... | head`: the reader left; not an error of ours
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
