"""``netweave place import-hived`` and ``export-hived``: HiveD's configuration file in and out.

Actions::

    netweave place import-hived hivedscheduler.yaml [--topology T] [--out FILE] [--json]
        read HiveD's configuration, build its cells, quotas and pinned cells, run HiveD's safety check, print them;
        --topology maps its GPUs onto a netweave topology (<host>/gpu<index>); --out rewrites the file (same data)
    netweave place export-hived --topology T [--jobs J] --out hivedscheduler.yaml [--no-forge]
        netweave's derived cells (and the jobs file's virtual clusters) as a HiveD configuration
"""

from __future__ import annotations

import argparse

from topology.clitools import add_json_flag, add_output, emit, render_table
from topology.errors import InputError


def register_hived(psub: argparse._SubParsersAction) -> None:
    p = psub.add_parser("import-hived", help="read HiveD's configuration (physicalCluster, virtualClusters): cells, quotas, safety check")
    p.add_argument("config", help="HiveD configuration file (hivedscheduler.yaml)")
    p.add_argument("--topology", default=None, help="netweave topology whose GPUs the file's cells name (default: the file's hosts alone)")
    add_output(p, "--out", default=None, help="write the configuration back (the same data, canonical YAML)")
    add_json_flag(p)
    p.set_defaults(func=cmd_import_hived)

    p = psub.add_parser("export-hived", help="write netweave's derived cells and a jobs file's quotas as HiveD's configuration")
    p.add_argument("--topology", required=True, help="topology file, or 'default'")
    p.add_argument("--jobs", default=None, help="jobs file whose virtual_clusters become virtualClusters")
    p.add_argument("--no-forge", action="store_true", help="do not add forged binary levels")
    add_output(p, "--out", required=True, help="HiveD configuration file to write (hivedscheduler.yaml)")
    add_json_flag(p)
    p.set_defaults(func=cmd_export_hived)


def cmd_import_hived(args: argparse.Namespace) -> int:
    from .cli import _topology
    from .hived_config import read_hived_config, scheduler_from_config, write_hived_config

    cfg = read_hived_config(args.config)
    topo = _topology(args.topology) if args.topology else None
    sched = scheduler_from_config(cfg, topo)  # raises QuotaError (an InputError) when the quotas are infeasible
    if args.out:
        write_hived_config(cfg, args.out)
    report = sched.guarantee_report()
    data = {"chains": {c: t.describe() for c, t in cfg.trees().items()}, "virtual_clusters": cfg.virtual_clusters(),
            "pinned_cells": {vc: [list(p) for p in ps] for vc, ps in cfg.pinned_cells().items()},
            "pinned_cell_ids": {k: list(v) for k, v in cfg.pinned_ids().items()}, "guarantees": report}
    lines = []
    for chain, d in data["chains"].items():
        lines.append(f"chain {chain}: {d['gpus']} GPUs, {len(cfg.trees()[chain].tops)} top-level cell(s)")
        rows = [(lv["name"], lv["size"], lv["cells"], lv["fanout"], "node level" if lv["node_level"] else "") for lv in reversed(d["levels"])]
        lines.append(render_table(["level", "GPUs per cell>", "cells>", "fan-out>", "note"], rows, indent=2))
    for vc, chains in data["virtual_clusters"].items():
        quota = ", ".join(f"{chain}: {', '.join(f'{t} x{n}' for t, n in q.items())}" for chain, q in chains.items()) or "no quota"
        pins = ", ".join(a for _, a in cfg.pinned_cells().get(vc, []))
        lines.append(f"VC {vc}: {quota}" + (f"; pinned {pins}" if pins else ""))
    lines.append("quotas feasible (HiveD's safety check)" + ("" if report["ok"] else "; guarantees degraded"))
    emit(args, data, "\n".join(lines))
    return 0


def cmd_export_hived(args: argparse.Namespace) -> int:
    from .cells import cell_hierarchy
    from .cli import _topology
    from .hived import HivedScheduler
    from .hived_config import config_from_trees, write_hived_config
    from .planner import load_jobs

    topo = _topology(args.topology)
    trees = cell_hierarchy(topo, forge=not args.no_forge)
    vcs = load_jobs(args.jobs)[1] if args.jobs else {}
    sched = HivedScheduler(topo, vcs, trees=trees)  # checks the quotas first
    quotas = {vc: {chain: {vch.tree.levels[lv].name: n for lv, n in vch.quota.items()} for chain, vch in chains.items()}
              for vc, chains in sched.vcs.items()}
    if any(not c.full for t in trees.values() for c in t.tops):
        raise InputError("the topology has a partial top-level cell (e.g. a partial scalable unit); HiveD's cells are identical buddies. "
                         "export-hived writes full cells only: use a topology whose top-level cells are full", where="--topology")
    data = config_from_trees(trees, quotas)
    write_hived_config(data, args.out)
    vc_names = ", ".join(quotas) or "none"
    emit(args, data, f"wrote {args.out}: {len(trees)} chain(s) of cells, virtual clusters: {vc_names}")  # the file holds the YAML
    return 0
