"""``netweave schema``: the published JSON Schema of every file format, for editors and scripts.

``netweave schema list`` names the formats and their schema files, ``netweave schema show FORMAT`` prints one
schema, and ``netweave schema check FORMAT FILE`` checks a file against it (exit 0, or one line and exit 2).
The schemas are the files the readers validate through (:mod:`topology.schema`); ``docs/formats.md`` shows how
to wire them into VS Code. ``check`` applies the schema only: what a schema cannot say (a job's ``vc`` among
the virtual clusters, a workload's GPUs in the topology) is checked by the command that reads the file.

>>> [f.name for f in FORMATS][:8]
['topology', 'jobs', 'workload', 'hived-config', 'flow-plan', 'model-config', 'pipeline-stages', 'job-plan']
>>> [f.name for f in FORMATS][8:]
['pipe-profile', 'gradient-profile', 'flow-control', 'flow-agent-state', 'hived-state']
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

from topology.clitools import add_json_flag, emit
from topology.errors import InputError
from topology.inputs import loads_json, loads_yaml, read_text
from topology.schema import load_schema, schema_file, validate


@dataclass(frozen=True)
class FileFormat:
    """A file format users write or read, the package whose ``schemas/`` holds its schema, and who reads and writes it."""

    name: str
    package: str
    files: str          # what such files are usually called
    read_by: str
    written_by: str


FORMATS: tuple[FileFormat, ...] = (
    FileFormat("topology", "topology", "*.json (netweave-topology)", "every --topology, topo show/path/draw/export",
               "topo build/import --out"),
    FileFormat("jobs", "placement", "jobs.yaml / jobs.json", "place plan/check --jobs, launch --jobs", "you"),
    FileFormat("workload", "emu", "*.yaml / *.json (netweave-workload)", "emu run/compare, flow plan/profile", "emu example, you"),
    FileFormat("hived-config", "placement", "hivedscheduler.yaml", "place import-hived", "place export-hived, place import-hived --out"),
    FileFormat("flow-plan", "flowsched", "flowplan.json (netweave-flow-plan)", "flow apply/agent, the NCCL plugin", "flow plan --out"),
    FileFormat("model-config", "pipesched", "gpt.yaml (a GPT or Llama model)", "pipe profile/plan/export --model, a job's model:", "you"),
    FileFormat("pipeline-stages", "pipesched", "stages.json", "your launcher (beside torch's schedule.csv)", "pipe export --out"),
    FileFormat("job-plan", "netweave.runtime", "bundle/<job>/plan.json (netweave-job-plan)", "netweave.runtime in the training script",
               "launch --out"),
    FileFormat("pipe-profile", "pipesched", "p.json (netweave-pipe-profile)", "pipe plan/simulate/export --profile, a job's model: file",
               "pipe profile --out"),
    FileFormat("gradient-profile", "flowsched", "prof.json (netweave-gradient-profile)", "flow schedule --profile", "flow profile --out"),
    FileFormat("flow-control", "flowsched", "control.yaml (netweave-flow-control)", "flow serve/agent --config", "you"),
    FileFormat("flow-agent-state", "flowsched", "agent-HOST.state.json (netweave-flow-agent-state)", "flow agent, at start",
               "flow agent"),
    FileFormat("hived-state", "placement", "cluster.state (netweave-hived-state)", "place plan/release --state", "place plan/release --state"),
)


def find_format(name: str) -> FileFormat:
    """The format called ``name``; an :class:`InputError` naming the known ones otherwise."""
    for f in FORMATS:
        if f.name == name:
            return f
    raise InputError(f"unknown format {name!r}; expected one of {', '.join(f.name for f in FORMATS)}", where="FORMAT")


def format_schema(fmt: FileFormat) -> dict[str, Any]:
    """The parsed schema of ``fmt``."""
    return load_schema(fmt.package, fmt.name)


def check_file(fmt: FileFormat, path: str) -> Any:
    """Parse ``path`` (``.json`` as JSON, anything else as YAML unless it is JSON) and validate it against ``fmt``'s schema; the data.

    A JSON document in a file not named ``.json`` (a planner state ``cluster.state``) is read as JSON all the same: YAML 1.1
    would read its ``1e-05`` as a string.
    """
    text = read_text(path)
    if path.lower().endswith(".json"):
        data = loads_json(text, source=path)
    else:
        try:
            data = loads_json(text, source=path) if text.lstrip()[:1] in ("{", "[") else loads_yaml(text, source=path)
        except InputError:
            data = loads_yaml(text, source=path)
    validate(data, format_schema(fmt), source=path)
    return data


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("schema", help="the JSON Schema of every file format: list, show, check (for editors and scripts)")
    ssub = p.add_subparsers(dest="schema_command", metavar="ACTION", required=True)

    q = ssub.add_parser("list", help="the file formats and their schema files")
    add_json_flag(q)
    q.set_defaults(func=cmd_list)

    q = ssub.add_parser("show", help="print a format's schema (JSON Schema draft 2020-12)")
    q.add_argument("format", metavar="FORMAT", help=", ".join(f.name for f in FORMATS))
    add_json_flag(q)
    q.set_defaults(func=cmd_show)

    q = ssub.add_parser("check", help="check a file against its format's schema: exit 0, or one line and exit 2")
    q.add_argument("format", metavar="FORMAT", help=", ".join(f.name for f in FORMATS))
    q.add_argument("file", metavar="FILE", help="the file to check (JSON, or YAML)")
    add_json_flag(q)
    q.set_defaults(func=cmd_check)


def cmd_list(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    rows = [{"format": f.name, "title": format_schema(f)["title"], "schema": schema_file(f.package, f.name), "files": f.files,
             "read_by": f.read_by, "written_by": f.written_by} for f in FORMATS]
    if args.json:
        emit(args, rows, "")
        return 0
    table = Table("format", "files", "read by", "schema file", box=None, pad_edge=False)
    for r in rows:
        table.add_row(r["format"], r["files"], r["read_by"], r["schema"])
    Console(width=200, soft_wrap=True).print(table)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    fmt = find_format(args.format)
    schema = format_schema(fmt)
    emit(args, {"format": fmt.name, "schema_file": schema_file(fmt.package, fmt.name), "schema": schema}, json.dumps(schema, indent=1))
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    fmt = find_format(args.format)
    check_file(fmt, args.file)
    emit(args, {"file": args.file, "format": fmt.name, "valid": True}, f"{args.file}: a valid {fmt.name} file ({format_schema(fmt)['title']})")
    return 0
