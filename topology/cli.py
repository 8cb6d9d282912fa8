"""``netweave topo``: build, import, show, query, draw and export topologies."""

from __future__ import annotations

import argparse
from typing import Any

from .clitools import add_json_flag, emit
from .errors import TopologyError
from .model import Topology


def register(sub: argparse._SubParsersAction) -> None:
    topo = sub.add_parser("topo", help="hardware topologies: build, import, show, path, draw, export")
    tsub = topo.add_subparsers(dest="topo_command", metavar="ACTION", required=True)

    p = tsub.add_parser("build", help="build a node or a cluster from the built-in models")
    p.add_argument("kind", help="a node kind (dgx-h100, dgx-a100, ...) or a fabric (rail-optimized, leaf-spine, fat-tree, ...)")
    p.add_argument("--nodes", type=int, default=None, help="number of servers (cluster builds)")
    p.add_argument("--node", default="dgx-h100", help="node kind for cluster builds (default dgx-h100)")
    p.add_argument("--fabric", default=None, help="fabric when KIND is a node kind and --nodes > 1")
    p.add_argument("--nccl-model", action="store_true", help="use NCCL's bandwidth figures instead of spec-sheet rates")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra builder option, e.g. oversubscription=2")
    p.add_argument("--out", required=True, help="output file (.json)")
    add_json_flag(p)
    p.set_defaults(func=cmd_build)

    p = tsub.add_parser("import", help="convert nvidia-smi / NCCL XML / Slurm files to netweave JSON")
    p.add_argument("file")
    p.add_argument("--format", choices=["nvidia-smi", "nccl-xml", "slurm", "json"], default=None)
    p.add_argument("--out", required=True)
    add_json_flag(p)
    p.set_defaults(func=cmd_import)

    p = tsub.add_parser("show", help="summary: devices, links by type, bisection, GPU bandwidth classes")
    p.add_argument("file")
    add_json_flag(p)
    p.set_defaults(func=cmd_show)

    p = tsub.add_parser("path", help="the path between two GPUs, its NCCL path class and bottleneck bandwidth")
    p.add_argument("file")
    p.add_argument("gpu_a")
    p.add_argument("gpu_b")
    add_json_flag(p)
    p.set_defaults(func=cmd_path)

    p = tsub.add_parser("draw", help="draw the topology to a PNG")
    p.add_argument("file")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_draw)

    p = tsub.add_parser("export", help="write NCCL topology XML, Slurm topology.conf or JSON")
    p.add_argument("file")
    p.add_argument("--format", choices=["nccl-xml", "slurm", "json"], required=True)
    p.add_argument("--out", default=None, help="output file (default: stdout)")
    p.set_defaults(func=cmd_export)


def _parse_sets(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise TopologyError(f"--set {item!r}: expected KEY=VALUE")
        for cast in (int, float):
            try:
                out[key.replace("-", "_")] = cast(value)
                break
            except ValueError:
                continue
        else:
            out[key.replace("-", "_")] = {"true": True, "false": False}.get(value.lower(), value)
    return out


def build_from_args(kind: str, nodes: int | None, node: str, fabric: str | None, nccl_model: bool, options: dict[str, Any]) -> Topology:
    """Dispatch ``netweave topo build`` to the node and fabric builders."""
    from .builders import NODE_BUILDERS, build_node
    from .fabrics import FABRIC_BUILDERS, build_cluster

    node_options = {"nccl_model": True} if nccl_model else {}
    if kind in FABRIC_BUILDERS:
        return build_cluster(nodes or 4, node=node, fabric=kind, node_options=node_options, **options)
    if kind in NODE_BUILDERS:
        if nodes and nodes > 1:
            return build_cluster(nodes, node=kind, fabric=fabric or "rail-optimized", node_options=node_options, **options)
        return build_node(kind, **node_options, **options)
    kinds = ", ".join(sorted(NODE_BUILDERS) + sorted(FABRIC_BUILDERS))
    raise TopologyError(f"unknown KIND {kind!r}; expected one of {kinds}")


def cmd_build(args: argparse.Namespace) -> int:
    from .io import write_topology

    try:
        topo = build_from_args(args.kind, args.nodes, args.node, args.fabric, args.nccl_model, _parse_sets(args.set))
    except TypeError as exc:  # an unknown --set option reaches a builder
        raise TopologyError(f"bad builder option: {exc}") from None
    write_topology(topo, args.out)
    emit(args, {"out": args.out, **topo.summary()}, f"wrote {args.out}: {topo!r}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from .io import read_topology, write_topology

    topo = read_topology(args.file, args.format)
    write_topology(topo, args.out)
    emit(args, {"out": args.out, **topo.summary()}, f"wrote {args.out}: {topo!r}")
    return 0


def describe(topo: Topology) -> dict[str, Any]:
    """Everything ``topo show`` prints: summary, bisection bandwidth and GPU bandwidth classes."""
    from .paths import bandwidth_classes, bisection_bandwidth

    info = topo.summary()
    if info["gpus"] > 1:
        info["bisection"] = bisection_bandwidth(topo)
        info["gpu_bandwidth_classes"] = bandwidth_classes(topo)
    return info


def format_description(info: dict[str, Any]) -> str:
    lines = [f"{info['name']}: {info['hosts']} hosts, {info['gpus']} GPUs ({', '.join(f'{n}x {m}' for m, n in info['gpu_models'].items())})"]
    lines.append("  devices: " + ", ".join(f"{n} {k}" for k, n in info["nodes"].items()))
    if info["switch_tiers"]:
        lines.append("  network switches: " + ", ".join(f"{n} {t}" for t, n in info["switch_tiers"].items()))
    lines.append("  links (per direction):")
    for kind, entry in info["links"].items():
        lines.append(f"    {kind:<8} {entry['directed_links'] // 2:>7} duplex links, {entry['total_bw_gbs'] / 2:>12,.1f} GB/s in total")
    if "bisection" in info:
        b = info["bisection"]
        lines.append(f"  bisection bandwidth: {b['bw']:,.1f} GB/s per direction ({b['cut']})")
    if "gpu_bandwidth_classes" in info:
        lines.append("  GPU-to-GPU bandwidth classes:")
        for c in info["gpu_bandwidth_classes"]:
            lines.append(f"    {c['path_type']:<4} {c['bw']:>8.1f} GB/s  {c['pairs']:>9} ordered pairs")
    return "\n".join(lines)


def cmd_show(args: argparse.Namespace) -> int:
    from .io import read_topology

    info = describe(read_topology(args.file))
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
    from .draw import draw_topology
    from .io import read_topology

    draw_topology(read_topology(args.file), args.out)
    print(f"wrote {args.out}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from .io import dumps, read_topology, write_topology

    topo = read_topology(args.file)
    if args.out:
        write_topology(topo, args.out, args.format)
        print(f"wrote {args.out}")
    else:
        print(dumps(topo, args.format), end="")
    return 0
