"""``netweave launch``: plan every job of a jobs file and write one launchable bundle per job (see ``docs/launch.md``).

    netweave launch --topology T --jobs J --out DIR [--address HOST=ADDR ...] [--ifname [HOST=]IF ...] [--transport ib|roce|tcp] [--json]
"""

from __future__ import annotations

import argparse
import shutil

from topology.clitools import CommaList, add_json_flag, emit
from topology.errors import InputError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("launch", help="plan jobs end to end and write launch bundles: plan.json, torchrun scripts per host, sbatch, hostfile")
    p.add_argument("--topology", required=True, help="topology file, or 'default' (4 DGX H100, InfiniBand)")
    p.add_argument("--jobs", required=True, help="jobs file (YAML or JSON; see docs/launch.md)")
    p.add_argument("--out", required=True, help="output directory: one sub-directory per job")
    p.add_argument("--policy", default="hived+cassini", choices=["hived+cassini", "hived", "first-fit"], help="placement policy")
    p.add_argument("--routing", default="rail", choices=["rail", "ecmp", "shortest"], help="routing of collectives (default rail)")
    p.add_argument("--candidates", type=int, default=4, help="buddy candidates CASSINI ranks per job (default 4)")
    p.add_argument("--transport", choices=["ib", "roce", "tcp"], default=None,
                   help="the fabric's transport (default: the topology's fabric; ConnectX NICs are InfiniBand)")
    p.add_argument("--base-port", type=int, default=29500, help="first master port; every job gets its own (default 29500)")
    p.add_argument("--address", action=CommaList, default=[], metavar="HOST=ADDR[,...]",
                   help="address a host's torchrun master is reached at (host names need not resolve); repeatable")
    p.add_argument("--ifname", action=CommaList, default=[], metavar="[HOST=]IF[,...]",
                   help="network interface for gloo and NCCL sockets, for one host or (no HOST=) every host; repeatable")
    p.add_argument("--lib-dir", default=None, help="where the scripts find the netweave NCCL plugin and marker (default: this checkout's csrc/build)")
    add_json_flag(p)
    p.set_defaults(func=cmd_launch)


def _pairs(values: list[str], flag: str, kind: str, *, default_key: str | None = None) -> dict[str, str]:
    from placement.planner import check_host_value

    out = {}
    for v in values:
        host, sep, value = v.partition("=")
        if not sep:
            if default_key is None:
                raise InputError(f"expected HOST=VALUE, got {v!r}", where=flag)
            host, value = default_key, v
        if not host or not value:
            raise InputError(f"expected HOST=VALUE, got {v!r}", where=flag)
        why = check_host_value(kind, value)
        if why:
            raise InputError(why, where=f"{flag} {v}")
        out[host] = value
    return out


def cmd_launch(args: argparse.Namespace) -> int:
    from placement.planner import load_jobs_file

    from .launch import check_output, launch_text, plan_launch, staging_dir, write_bundles

    addresses = _pairs(args.address, "--address", "addresses")
    interfaces = _pairs(args.ifname, "--ifname", "interfaces", default_key="*")
    if not 1024 <= args.base_port <= 65535:
        raise InputError(f"expected a port in 1024..65535, got {args.base_port}", where="--base-port")
    out = check_output(args.out)            # before any planning: a bad --out costs nothing and writes nothing
    staging = staging_dir(out)
    try:
        import topology
        from topology.io import read_topology

        topo = topology.default_cluster() if args.topology == "default" else read_topology(args.topology)
        jobs_file = load_jobs_file(args.jobs)
        lp = plan_launch(topo, jobs_file, jobs_source=args.jobs, policy=args.policy, routing=args.routing, candidates=args.candidates,
                         transport=args.transport, base_port=args.base_port, addresses=addresses, interfaces=interfaces, out=out,
                         lib_dir=args.lib_dir)
        written = write_bundles(lp, out, staging=staging)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    data = {"out": str(out), "files": written, **lp.summary()}
    emit(args, data, launch_text(lp, out))
    return 0
