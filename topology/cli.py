"""``netweave topo``: build, import, show, query, draw and export topologies."""

from __future__ import annotations

import argparse
import os
import warnings
from typing import Any

from .clitools import CommaSettings, Stages, add_json_flag, add_output, check_options, emit, progress, render_table
from .errors import TopologyError
from .inputs import check_number
from .limits import MAX_HOSTS, MAX_TOPOLOGY_NODES
from .model import Topology
from .units import flag_action, parse_rate


def register(sub: argparse._SubParsersAction) -> None:
    topo = sub.add_parser("topo", help="hardware topologies: build, import, show, path, draw, export")
    tsub = topo.add_subparsers(dest="topo_command", metavar="ACTION", required=True)

    p = tsub.add_parser("build", help="build a node or a cluster from the built-in models")
    p.add_argument("kind", help="a node kind (dgx-h100, dgx-a100, ...) or a fabric (rail-optimized, leaf-spine, fat-tree, ...)")
    p.add_argument("--nodes", type=int, default=None, help="number of servers (cluster builds)")
    p.add_argument("--node", default="dgx-h100", help="node kind for cluster builds (default dgx-h100)")
    p.add_argument("--fabric", default=None, help="fabric when KIND is a node kind and --nodes > 1")
    p.add_argument("--nccl-model", action="store_true", help="use NCCL's bandwidth figures instead of spec-sheet rates")
    p.add_argument("--set", action=CommaSettings, default=[], metavar="KEY=VALUE[,...]", help="fabric option, e.g. oversubscription=2 (repeatable)")
    p.add_argument("--node-set", action=CommaSettings, default=[], metavar="KEY=VALUE[,...]",
                   help="node option in cluster builds, e.g. nic_gbps=200 (repeatable)")
    add_output(p, "--out", required=True, help="output file (.json)")
    add_json_flag(p)
    p.set_defaults(func=cmd_build)

    p = tsub.add_parser("import", help="convert nvidia-smi / NCCL XML / Slurm files to netweave JSON")
    p.add_argument("file", help="the file to import: an nvidia-smi topo -m dump, NCCL topology XML, a Slurm topology.conf or JSON")
    p.add_argument("--format", choices=["nvidia-smi", "nccl-xml", "slurm", "json"], default=None,
                   help="the file's format (default: guessed from its name and content)")
    add_output(p, "--out", required=True, help="output file (netweave JSON)")
    p.add_argument("--host", default=None, help="host name for the imported server (nvidia-smi, nccl-xml)")
    p.add_argument("--node", default=None, help="slurm: populate every Slurm node with a full server of this kind (e.g. dgx-h100)")
    p.add_argument("--gpu-model", default=None,
                   help="nvidia-smi: GPU model (e.g. H100-SXM5-80GB); default: the dump's nvidia-smi -L lines, "
                        "else guessed from NV# (NV18 H100, NV12 A100), else H100 with a note")
    p.add_argument("--pcie-gen", type=int, default=None,
                   help="nvidia-smi: PCIe generation of the x16 links (default by GPU model: 5 for H100/B200, 4 for A100/L40S)")
    p.add_argument("--nic-gbps", action=flag_action(parse_rate, unit="Gb/s"), default=None,
                   help="nvidia-smi, slurm: NIC line rate in Gb/s, or with a unit (400Gb/s, 50GB/s) (default 400)")
    p.add_argument("--nccl-model", action="store_true", help="nvidia-smi: use NCCL's bandwidth figures")
    add_json_flag(p)
    p.set_defaults(func=cmd_import)

    p = tsub.add_parser("show", help="summary: devices, links by type, bisection, GPU bandwidth classes")
    p.add_argument("file", help="topology file: netweave JSON, or any format topo import reads (guessed)")
    add_json_flag(p)
    p.set_defaults(func=cmd_show)

    p = tsub.add_parser("path", help="the path between two GPUs, its NCCL path class and bottleneck bandwidth")
    p.add_argument("file", help="topology file: netweave JSON, or any format topo import reads (guessed)")
    p.add_argument("gpu_a", help="a GPU id (node0/gpu3) or global GPU number (11 or gpu11)")
    p.add_argument("gpu_b", help="the other GPU, the same way")
    add_json_flag(p)
    p.set_defaults(func=cmd_path)

    p = tsub.add_parser("draw", help="draw the topology: PNG, SVG or PDF by the extension of --out")
    p.add_argument("file", help="topology file: netweave JSON, or any format topo import reads (guessed)")
    add_output(p, "--out", required=True, help="picture file: .png, .svg or .pdf")
    add_json_flag(p)
    p.set_defaults(func=cmd_draw)

    p = tsub.add_parser("export", help="write NCCL topology XML, Slurm topology.conf or JSON")
    p.add_argument("file", help="topology file: netweave JSON, or any format topo import reads (guessed)")
    p.add_argument("--format", choices=["nccl-xml", "slurm", "json"], required=True, help="the format to write")
    p.add_argument("--host", default=None, help="nccl-xml: which server to write (NCCL reads one file per host)")
    add_output(p, "--out", default=None, help="output file (default: stdout)")
    add_json_flag(p)
    p.set_defaults(func=cmd_export)


#: A builder option whose name ends in a unit suffix is read with the one quantity parser in that unit, so
#: ``--set nic_gbps=50GB/s`` is 400 and ``--set latency_us=2ms`` is 2000 (a bare number is already in that unit).
_UNIT_SUFFIXES: dict[str, tuple[str, str]] = {"_gbps": ("rate", "Gb/s"), "_bw": ("rate", "GB/s"), "_us": ("duration", "us"),
                                              "_ms": ("duration", "ms"), "_bytes": ("size", "B")}


def _parse_sets(items: list[str], flag: str = "--set") -> dict[str, Any]:
    """``KEY=VALUE`` builder options: quantities through :mod:`topology.units`, other numbers, booleans, strings.

    >>> _parse_sets(["nic_gbps=50GB/s", "latency_us=2ms", "oversubscription=2", "rails=true", "model=H200"])
    {'nic_gbps': 400.0, 'latency_us': 2000.0, 'oversubscription': 2, 'rails': True, 'model': 'H200'}
    >>> _parse_sets(["nic_gbps=fast"])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    topology.errors.TopologyError: --set nic_gbps: expected a rate...
    """
    from .units import parse_duration, parse_rate, parse_size

    parsers = {"rate": parse_rate, "duration": parse_duration, "size": parse_size}
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise TopologyError(f"{flag} {item!r}: expected KEY=VALUE")
        name = key.replace("-", "_")
        suffix = next((s for s in _UNIT_SUFFIXES if name.endswith(s)), None)
        if suffix is not None:
            kind, unit = _UNIT_SUFFIXES[suffix]
            out[name] = parsers[kind](value, unit=unit, where=f"{flag} {key}", positive=False, error=TopologyError)
            continue
        for cast in (int, float):
            try:
                number = cast(value)
            except ValueError:
                continue
            check_number(number, what=f"a value <= {MAX_TOPOLOGY_NODES}", where=f"{flag} {key}", maximum=MAX_TOPOLOGY_NODES, error=TopologyError)
            out[name] = number
            break
        else:
            out[name] = {"true": True, "false": False}.get(value.lower(), value)
    return out


def build_from_args(
    kind: str, nodes: int | None, node: str, fabric: str | None, nccl_model: bool, options: dict[str, Any], node_options: dict[str, Any] | None = None
) -> Topology:
    """Dispatch ``netweave topo build`` to the node and fabric builders."""
    from .builders import NODE_BUILDERS, build_node
    from .fabrics import FABRIC_BUILDERS, build_cluster

    node_options = dict(node_options or {})
    if nccl_model:
        node_options["nccl_model"] = True
    if kind in FABRIC_BUILDERS:
        check_options(FABRIC_BUILDERS[kind], options, flag="--set", what=f"the {kind} fabric", skip=2)
        if node in NODE_BUILDERS:
            check_options(NODE_BUILDERS[node], node_options, flag="--node-set", what=f"node kind {node}", skip=2)
        return build_cluster(nodes or 4, node=node, fabric=kind, node_options=node_options, **options)
    if kind in NODE_BUILDERS:
        if nodes and nodes > 1:
            fabric = fabric or "rail-optimized"
            if fabric in FABRIC_BUILDERS:
                check_options(FABRIC_BUILDERS[fabric], options, flag="--set", what=f"the {fabric} fabric", skip=2)
            check_options(NODE_BUILDERS[kind], node_options, flag="--node-set", what=f"node kind {kind}", skip=2)
            return build_cluster(nodes, node=kind, fabric=fabric, node_options=node_options, **options)
        check_options(NODE_BUILDERS[kind], {**node_options, **options}, flag="--set", what=f"node kind {kind}", skip=2)
        return build_node(kind, **{**node_options, **options})
    kinds = ", ".join(sorted(NODE_BUILDERS) + sorted(FABRIC_BUILDERS))
    raise TopologyError(f"unknown KIND {kind!r}; expected one of {kinds}")


def cmd_build(args: argparse.Namespace) -> int:
    from .io import write_topology

    if args.nodes is not None:
        check_number(args.nodes, what="a number of servers", where="--nodes", integer=True, minimum=1, maximum=MAX_HOSTS, error=TopologyError)
    try:
        topo = build_from_args(args.kind, args.nodes, args.node, args.fabric, args.nccl_model, _parse_sets(args.set),
                               _parse_sets(args.node_set, "--node-set"))
    except TypeError as exc:  # an unknown --set option reaches a builder
        raise TopologyError(f"bad builder option: {exc}") from None
    write_topology(topo, args.out)
    emit(args, {"out": args.out, **topo.summary()}, f"wrote {args.out}: {topo!r}")
    return 0


def import_options(args: argparse.Namespace) -> dict[str, Any]:
    """The importer options given on the command line, checked against the format."""
    from .inputs import read_text
    from .io import guess_format

    fmt = args.format
    if fmt is None:
        fmt = guess_format(args.file, read_text(args.file, error=TopologyError))
    given = {
        "host": args.host,
        "node": args.node,
        "gpu_model": args.gpu_model,
        "pcie_gen": args.pcie_gen,
        "nic_gbps": args.nic_gbps,
        "nccl_model": True if args.nccl_model else None,
    }
    allowed = {
        "nvidia-smi": {"host", "gpu_model", "pcie_gen", "nic_gbps", "nccl_model"},
        "nccl-xml": {"host"},
        "slurm": {"node", "nic_gbps"},
        "json": set(),
    }[fmt]
    options = {k: v for k, v in given.items() if v is not None}
    for key in options:
        if key not in allowed:
            raise TopologyError(f"--{key.replace('_', '-')} does not apply to the {fmt} format")
    return options


def cmd_import(args: argparse.Namespace) -> int:
    from .io import read_topology, write_topology

    options = import_options(args)
    with warnings.catch_warnings(record=True) as caught:  # e.g. a GPU model the dump does not name: one note line each
        warnings.simplefilter("always")
        topo = read_topology(args.file, args.format, **options)
    for w in caught:
        progress(f"note: {w.message}")
    write_topology(topo, args.out)
    emit(args, {"out": args.out, **topo.summary()}, f"wrote {args.out}: {topo!r}")
    return 0


# Shares of `topo show`'s time by stage (profiled on 8,192 GPUs), for the progress bar's ETA.
SHOW_STAGES = {"reading": 13.0, "summary": 3.0, "bisection": 16.0, "bandwidth classes": 10.0}
SHOW_PROGRESS_BYTES = 4_000_000  # files above this (about 1,300 GPUs) take seconds: show the bar


def describe(topo: Topology, stages: Stages | None = None) -> dict[str, Any]:
    """Everything ``topo show`` prints: summary, bisection bandwidth and GPU bandwidth classes."""
    from .paths import bandwidth_classes, bisection_bandwidth

    stages = stages or Stages(SHOW_STAGES, enabled=False)
    with stages.stage("summary"):
        info = topo.summary()
    if info["gpus"] > 1:
        with stages.stage("bisection"):
            info["bisection"] = bisection_bandwidth(topo)
        with stages.stage("bandwidth classes"):
            info["gpu_bandwidth_classes"] = bandwidth_classes(topo)
    return info


def format_description(info: dict[str, Any]) -> str:
    lines = [f"{info['name']}: {info['hosts']} hosts, {info['gpus']} GPUs ({', '.join(f'{n}x {m}' for m, n in info['gpu_models'].items())})"]
    lines.append("  devices: " + ", ".join(f"{n} {k}" for k, n in info["nodes"].items()))
    if info["switch_tiers"]:
        lines.append("  network switches: " + ", ".join(f"{n} {t}" for t, n in info["switch_tiers"].items()))
    lines.append("  links:")
    link_rows = [(kind, f"{e['directed_links'] // 2:,}", f"{e['total_bw_gbs'] / 2:,.1f}") for kind, e in info["links"].items()]
    lines.append(render_table(["kind", "duplex links>", "GB/s in total, per direction>"], link_rows, indent=4))
    if "bisection" in info:
        b = info["bisection"]
        lines.append(f"  bisection bandwidth: {b['bw']:,.1f} GB/s per direction ({b['cut']})")
    if "gpu_bandwidth_classes" in info:
        lines.append("  GPU-to-GPU bandwidth classes:")
        lines.append(render_table(["path", "GB/s>", "ordered pairs>"], [(c["path_type"], f"{c['bw']:.1f}", f"{c['pairs']:,}")
                                                                     for c in info["gpu_bandwidth_classes"]], indent=4))
    return "\n".join(lines)


def cmd_show(args: argparse.Namespace) -> int:
    from .io import read_topology

    try:
        big = os.path.getsize(args.file) > SHOW_PROGRESS_BYTES
    except OSError:
        big = False  # read_topology names the problem
    with Stages(SHOW_STAGES, enabled=big, label=f"topo show {os.path.basename(args.file)}: ") as stages:
        with stages.stage("reading"):
            topo = read_topology(args.file)
        info = describe(topo, stages)
    emit(args, info, format_description(info))
    return 0


def cmd_path(args: argparse.Namespace) -> int:
    from .io import read_topology
    from .paths import gpu_path

    topo = read_topology(args.file)
    path = gpu_path(topo, topo.resolve_gpu(args.gpu_a), topo.resolve_gpu(args.gpu_b))
    text = f"{path.src} -> {path.dst}: {path.path_type.name}, {path.bw:.1f} GB/s, {path.latency_us:.2f} us\n  via " + " -> ".join(path.nodes)
    emit(args, path.to_dict(), text)
    return 0


def cmd_draw(args: argparse.Namespace) -> int:
    from .draw import draw_topology, image_format
    from .io import read_topology

    draw_topology(read_topology(args.file), args.out)
    emit(args, {"out": args.out, "format": image_format(args.out)}, f"wrote {args.out}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from .io import dumps, read_topology, write_topology

    topo = read_topology(args.file)
    if args.host and args.format != "nccl-xml":
        raise TopologyError("--host applies to --format nccl-xml only")
    if args.out:
        write_topology(topo, args.out, args.format, host=args.host)
        emit(args, {"out": args.out, "format": args.format, "host": args.host}, f"wrote {args.out}")
    else:  # the file itself on stdout; with --json, inside a JSON object
        text = dumps(topo, args.format, host=args.host)
        if args.json:
            emit(args, {"out": None, "format": args.format, "host": args.host, "text": text}, text)
        else:
            print(text, end="")
    return 0
