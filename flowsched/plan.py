"""The flow plan: which traffic class, DSCP and rate every job's flows get on every host.

A :class:`FlowPlan` is the one artefact the cross-job schedulers produce and the
enforcement layers consume: :mod:`flowsched.enforce` turns it into HTB trees and
socket marks, :mod:`flowsched.control` ships it to the hosts, and
:func:`to_nccl_plan` turns one host's part into the NCCL plugin's plan file.

File format ``netweave-flow-plan`` version 1 (JSON)::

    {
      "format": "netweave-flow-plan", "version": 1,
      "epoch": 3,                      # plan generation, grows with every new plan (staleness check)
      "policy": "sincronia",           # who decided it (free text)
      "order": ["job-b", "job-a"],     # optional: cross-job order, most urgent first
      "hosts": {
        "node0": {
          "link_rate": 5e10,           # optional: egress capacity in bytes/s (the HTB root rate); "400Gb/s" too
          "rules": [
            {"job": "job-a", "priority": 1, "dscp": 48},
            {"job": "job-a", "tensor": "layer3", "priority": 2, "dscp": 40},
            {"job": "job-b", "peer": "node1", "priority": 0, "dscp": 56, "rate": 1.2e9},   # bytes/s, or "9.6Gb/s"
            {"job": "job-b", "comm": "order:1", "priority": 0, "dscp": 56}
          ]
        }
      },
      "meta": {}                       # free-form (decisions, inputs); kept on round trips
    }

Rules
    A rule selects a job's traffic leaving the host, optionally narrowed to one
    ``tensor`` (gradient bucket, Geryon band), one ``comm`` (an NCCL
    communicator: ``"order:N"`` = the N-th communicator the process creates, or
    ``"comm:0x..."`` = NCCL's commId), one ``peer`` host (a flow) or one TCP
    ``port`` (marked by the ``LD_PRELOAD`` marker). ``priority`` is the class,
    **0 = most urgent** .. 7, as in :mod:`emu.htb` and the workload format.
    ``dscp`` defaults to :func:`emu.htb.dscp_for_priority` (CS7 for class 0 ..
    CS0 for class 7); an override must stay one-to-one with the classes across
    the whole plan, because switch ports classify by DSCP alone. ``rate``
    (bytes/s) is a pacing rate for the selected traffic; the HTB class that
    carries it gets the sum of its rules' rates as ceiling (see
    :func:`class_table`).

Builders
    :func:`plan_from_order` (Sincronia's order -> classes via
    :func:`flowsched.coflow.priority_bands`), :func:`plan_from_parrot` (Parrot's
    rates -> per-flow pacing + HTB ceilings), :func:`plan_from_bands` (Geryon's
    per-tensor urgency bands inside a job), and :func:`plan_from_workload`, which
    extracts every job's per-iteration coflow from an emu workload on a topology
    and applies one of the policies.

>>> p = plan_from_order(["b", "a"], {"a": ["node0"], "b": ["node0", "node1"]}, epoch=1)
>>> [(r.job, r.priority, r.dscp) for r in p.hosts["node0"].rules]
[('b', 0, 56), ('a', 4, 24)]
>>> loads_plan(dumps_plan(p)) == p
True
"""

from __future__ import annotations

import json
import os
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from emu.htb import NUM_PRIORITIES, PRIORITY_DSCP, dscp_for_priority
from emu.workload import CollectivePhase, ComputePhase, P2PPhase, Workload
from topology import LinkKind, NodeKind, Topology
from topology.collectives import collective_flows
from topology.errors import InputError
from topology.inputs import check_name, check_number, loads_json, read_text
from topology.io import atomic_write_text
from topology.schema import load_schema, validate
from topology.units import parse_rate

from . import ncclhook
from .coflow import Coflow, Flow, ParrotAllocation, parrot_rates, priority_bands, sincronia_order

FORMAT = "netweave-flow-plan"
VERSION = 1
POLICIES = ("sincronia", "parrot", "geryon", "fair")
_RULE_KEYS = ("job", "priority", "dscp", "rate", "tensor", "comm", "peer", "port")
#: Highest link rate or rule rate a plan may carry (bytes/s): 1e12 B/s = 8 Tb/s, ten times an 800 Gb/s NIC. tc cannot
#: build HTB classes much faster than that (the burst of 1 ms of the link overflows the kernel's 32-bit byte count).
MAX_RATE = 1e12


class FlowPlanError(InputError):
    """A flow plan file or object that does not follow the format."""


def _rate(value: Any, where: str, source: str | None) -> Any:
    """A rate as a plan file may write it: bytes/s as a number (kept as written), or with a unit (``400Gb/s``, ``50 GB/s``)."""
    if not isinstance(value, str):
        return value    # None, or a number that validate_plan checks
    return parse_rate(value, unit="B/s", where=where, source=source, maximum=MAX_RATE, error=FlowPlanError)


@dataclass(frozen=True)
class FlowRule:
    """One job's traffic on one host (optionally one tensor / communicator / peer / port) and its class."""

    job: str
    priority: int
    dscp: int | None = None  # None: dscp_for_priority(priority)
    rate: float | None = None  # bytes/s, None = unpaced
    tensor: str | None = None
    comm: str | None = None
    peer: str | None = None
    port: int | None = None

    def __post_init__(self) -> None:
        if self.dscp is None and isinstance(self.priority, int) and 0 <= self.priority < NUM_PRIORITIES:
            object.__setattr__(self, "dscp", dscp_for_priority(self.priority))

    @property
    def selector(self) -> tuple[str, str | None, str | None, str | None, int | None]:
        return (self.job, self.tensor, self.comm, self.peer, self.port)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"job": self.job, "priority": self.priority, "dscp": self.dscp}
        for k in ("rate", "tensor", "comm", "peer", "port"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        return d


@dataclass
class HostPlan:
    """The rules of one host, and optionally its egress capacity (bytes/s)."""

    rules: list[FlowRule] = field(default_factory=list)
    link_rate: float | None = None


@dataclass
class FlowPlan:
    """Per-host flow rules (see the module docstring for the file format)."""

    hosts: dict[str, HostPlan] = field(default_factory=dict)
    epoch: int = 0
    policy: str = ""
    order: list[str] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def rules(self, host: str) -> list[FlowRule]:
        if host not in self.hosts:
            raise FlowPlanError(f"the plan has no host {host!r}; hosts: {', '.join(sorted(self.hosts)) or '(none)'}", where="hosts")
        return list(self.hosts[host].rules)

    def jobs(self) -> list[str]:
        return list(dict.fromkeys(r.job for h in self.hosts.values() for r in h.rules))

    def job_priority(self) -> dict[str, int]:
        """Each job's most urgent class over all its job-wide rules (rules without tensor/comm/peer/port), else over all rules."""
        wide: dict[str, int] = {}
        narrow: dict[str, int] = {}
        for h in self.hosts.values():
            for r in h.rules:
                into = narrow if (r.tensor or r.comm or r.peer or r.port is not None) else wide
                into[r.job] = min(into.get(r.job, r.priority), r.priority)
        return {j: wide.get(j, narrow.get(j)) for j in self.jobs()}  # type: ignore[misc]

    def for_host(self, host: str) -> FlowPlan:
        """The plan restricted to ``host`` (what its agent receives)."""
        return FlowPlan({host: HostPlan(self.rules(host), self.hosts[host].link_rate)}, self.epoch, self.policy,
                        list(self.order) if self.order is not None else None, dict(self.meta))

    def dscp_table(self) -> dict[int, int]:
        """``{dscp: priority}`` over the whole plan (validated one-to-one)."""
        validate_plan(self)
        return {r.dscp: r.priority for h in self.hosts.values() for r in h.rules}  # type: ignore[misc]

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"format": FORMAT, "version": VERSION, "epoch": self.epoch, "policy": self.policy}
        if self.order is not None:
            d["order"] = list(self.order)
        d["hosts"] = {}
        for name, hp in self.hosts.items():
            hd: dict[str, Any] = {}
            if hp.link_rate is not None:
                hd["link_rate"] = hp.link_rate
            hd["rules"] = [r.to_dict() for r in hp.rules]
            d["hosts"][name] = hd
        d["meta"] = self.meta
        return d

    @classmethod
    def from_dict(cls, data: Any, *, source: str | None = None) -> FlowPlan:
        return plan_from_dict(data, source=source)


# -- validation and (de)serialisation --------------------------------------------------------------


def _err(msg: str, where: str, source: str | None) -> FlowPlanError:
    return FlowPlanError(msg, source=source, where=where)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate_plan(plan: FlowPlan, *, source: str | None = None) -> None:
    """Raise :class:`FlowPlanError` naming the field unless ``plan`` is well formed.

    Checks types and ranges, one rule per selector on a host, and that DSCP
    values and classes correspond one to one over the whole plan, with no
    DSCP that another class uses by default (switch ports classify by DSCP).
    """
    if not _is_int(plan.epoch) or plan.epoch < 0:
        raise _err(f"expected a non-negative integer, got {plan.epoch!r}", "epoch", source)
    if not isinstance(plan.policy, str):
        raise _err(f"expected a string, got {plan.policy!r}", "policy", source)
    if plan.order is not None and (not isinstance(plan.order, list) or not all(isinstance(j, str) for j in plan.order)):
        raise _err("expected a list of job names", "order", source)
    if not isinstance(plan.meta, dict):
        raise _err("expected an object", "meta", source)
    dscp_of: dict[int, tuple[int, str]] = {}
    prio_of: dict[int, tuple[int, str]] = {}
    for host, hp in plan.hosts.items():
        check_name(host, what="host name", source=source, where="hosts", error=FlowPlanError)
        if hp.link_rate is not None:
            check_number(hp.link_rate, what="a rate in bytes/s", source=source, where=f"hosts.{host}.link_rate", positive=True,
                         maximum=MAX_RATE, error=FlowPlanError)
        seen: set[tuple] = set()
        for i, r in enumerate(hp.rules):
            where = f"hosts.{host}.rules[{i}]"
            check_name(r.job, what="job name", source=source, where=f"{where}.job", error=FlowPlanError)
            if not _is_int(r.priority) or not 0 <= r.priority < NUM_PRIORITIES:
                raise _err(f"expected an integer class 0..{NUM_PRIORITIES - 1} (0 = most urgent), got {r.priority!r}", f"{where}.priority", source)
            if not _is_int(r.dscp) or not 0 <= r.dscp <= 63:
                raise _err(f"expected an integer DSCP 0..63, got {r.dscp!r}", f"{where}.dscp", source)
            if r.rate is not None:
                check_number(r.rate, what="a rate in bytes/s", source=source, where=f"{where}.rate", positive=True, maximum=MAX_RATE,
                             error=FlowPlanError)
            if r.peer is not None:
                check_name(r.peer, what="peer host name", source=source, where=f"{where}.peer", error=FlowPlanError)
            if r.tensor is not None and (not isinstance(r.tensor, str) or not r.tensor or not r.tensor.isprintable() or " " in r.tensor
                                         or len(r.tensor) > 256):
                raise _err(f"expected a tensor name of printable characters without spaces (at most 256), got {r.tensor!r}",
                           f"{where}.tensor", source)
            if r.comm is not None:
                _parse_comm(r.comm, f"{where}.comm", source)
            if r.port is not None and (not _is_int(r.port) or not 1 <= r.port <= 65535):
                raise _err(f"expected a TCP port 1..65535, got {r.port!r}", f"{where}.port", source)
            if r.selector in seen:
                raise _err(f"a second rule for the same traffic {r.selector}", where, source)
            seen.add(r.selector)
            default_owner = PRIORITY_DSCP.index(r.dscp) if r.dscp in PRIORITY_DSCP else None
            if default_owner is not None and default_owner != r.priority:
                raise _err(f"DSCP {r.dscp} is class {default_owner}'s default and cannot carry class {r.priority}", f"{where}.dscp", source)
            if r.dscp in dscp_of and dscp_of[r.dscp][0] != r.priority:
                raise _err(f"DSCP {r.dscp} is used for class {dscp_of[r.dscp][0]} at {dscp_of[r.dscp][1]} and for class {r.priority}",
                           f"{where}.dscp", source)
            if r.priority in prio_of and prio_of[r.priority][0] != r.dscp:
                raise _err(f"class {r.priority} is marked DSCP {prio_of[r.priority][0]} at {prio_of[r.priority][1]} and DSCP {r.dscp} here",
                           f"{where}.dscp", source)
            dscp_of.setdefault(r.dscp, (r.priority, where))
            prio_of.setdefault(r.priority, (r.dscp, where))


def _parse_comm(comm: Any, where: str, source: str | None) -> tuple[str, int]:
    if isinstance(comm, str):
        kind, _, num = comm.partition(":")
        if kind in ("order", "comm") and num:
            try:
                ident = int(num, 0)
            except ValueError:
                ident = -1
            if 0 <= ident < 2**64:
                return kind, ident
    raise _err(f"expected 'order:N' or 'comm:0xID', got {comm!r}", where, source)


def plan_from_dict(data: Any, *, source: str | None = None) -> FlowPlan:
    """Parse and validate the JSON object of a plan file; errors name the field.

    The structure is checked against ``flowsched/schemas/flow-plan.schema.json`` first, then what a schema cannot say
    (one rule per selector, DSCPs and classes one to one) by :func:`validate_plan`.
    """
    validate(data, load_schema("flowsched", "flow-plan"), source=source, error=FlowPlanError)
    if not isinstance(data, dict):
        raise _err("expected a JSON object", "(top level)", source)
    if data.get("format") != FORMAT:
        raise _err(f"expected {FORMAT!r}, got {data.get('format')!r}", "format", source)
    if data.get("version") != VERSION:
        raise _err(f"unsupported version {data.get('version')!r}, this reader knows {VERSION}", "version", source)
    unknown = set(data) - {"format", "version", "epoch", "policy", "order", "hosts", "meta"}
    if unknown:
        raise _err("unknown field (expected format, version, epoch, policy, order, hosts, meta)", sorted(unknown)[0], source)
    hosts_raw = data.get("hosts")
    if not isinstance(hosts_raw, dict):
        raise _err("expected an object {host: {rules: [...]}}", "hosts", source)
    hosts: dict[str, HostPlan] = {}
    for host, hd in hosts_raw.items():
        if not isinstance(hd, dict):
            raise _err("expected an object with rules", f"hosts.{host}", source)
        extra = set(hd) - {"rules", "link_rate"}
        if extra:
            raise _err("unknown field (expected rules, link_rate)", f"hosts.{host}.{sorted(extra)[0]}", source)
        rules_raw = hd.get("rules", [])
        if not isinstance(rules_raw, list):
            raise _err("expected a list of rules", f"hosts.{host}.rules", source)
        rules = []
        for i, rd in enumerate(rules_raw):
            where = f"hosts.{host}.rules[{i}]"
            if not isinstance(rd, dict):
                raise _err("expected an object", where, source)
            extra = set(rd) - set(_RULE_KEYS)
            if extra:
                raise _err(f"unknown field (expected {', '.join(_RULE_KEYS)})", f"{where}.{sorted(extra)[0]}", source)
            for req in ("job", "priority"):
                if req not in rd:
                    raise _err("missing", f"{where}.{req}", source)
            if not _is_int(rd["priority"]) or not 0 <= rd["priority"] < NUM_PRIORITIES:
                raise _err(f"expected an integer class 0..{NUM_PRIORITIES - 1} (0 = most urgent), got {rd['priority']!r}",
                           f"{where}.priority", source)
            fields = {k: rd[k] for k in _RULE_KEYS if k in rd}
            if "rate" in fields:
                fields["rate"] = _rate(fields["rate"], f"{where}.rate", source)
            rules.append(FlowRule(**fields))
        hosts[str(host)] = HostPlan(rules, _rate(hd.get("link_rate"), f"hosts.{host}.link_rate", source))
    plan = FlowPlan(hosts, data.get("epoch", 0), data.get("policy", ""), data.get("order"), data.get("meta", {}))
    validate_plan(plan, source=source)
    return plan


def dumps_plan(plan: FlowPlan) -> str:
    validate_plan(plan)
    return json.dumps(plan.to_dict(), indent=1, sort_keys=False, default=str) + "\n"


def loads_plan(text: str, *, source: str | None = None) -> FlowPlan:
    return plan_from_dict(loads_json(text, source=source, error=FlowPlanError), source=source)


def write_plan(plan: FlowPlan, path: str | os.PathLike[str]) -> Path:
    """Write atomically (agents and plugins may be reading the previous version)."""
    atomic_write_text(path, dumps_plan(plan))
    return Path(path)


def read_plan(path: str | os.PathLike[str]) -> FlowPlan:
    return loads_plan(read_text(path, error=FlowPlanError), source=str(path))


# -- per-class view ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClassSpec:
    """One traffic class on one host: its DSCP, its jobs, and its HTB ceiling (bytes/s, None = the link)."""

    priority: int
    dscp: int
    jobs: tuple[str, ...]
    ceil: float | None


def class_table(plan: FlowPlan, host: str) -> dict[int, ClassSpec]:
    """The classes ``host`` uses, most urgent first.

    A class's ceiling is the sum of its rules' rates when *every* rule of the
    class on this host is rate-limited (Parrot), else None: one unpaced rule
    means the class may use the whole link.

    >>> p = FlowPlan({"h": HostPlan([FlowRule("a", 0, rate=1e6, peer="x"), FlowRule("a", 0, rate=2e6, peer="y"), FlowRule("b", 3)])})
    >>> t = class_table(p, "h"); t[0].ceil, t[3].ceil, t[3].dscp
    (3000000.0, None, 32)
    """
    validate_plan(plan)
    by_prio: dict[int, list[FlowRule]] = {}
    for r in plan.rules(host):
        by_prio.setdefault(r.priority, []).append(r)
    out = {}
    for p in sorted(by_prio):
        rules = by_prio[p]
        ceil = float(sum(r.rate for r in rules)) if all(r.rate is not None for r in rules) else None  # type: ignore[misc]
        out[p] = ClassSpec(p, rules[0].dscp, tuple(dict.fromkeys(r.job for r in rules)), ceil)  # type: ignore[arg-type]
    return out


# -- builders from cross-job decisions ---------------------------------------------------------------


def plan_from_order(order: Sequence[Hashable], job_hosts: Mapping[Hashable, Sequence[str]], *, classes: int = NUM_PRIORITIES,
                    epoch: int = 0, link_rates: Mapping[str, float] | None = None, policy: str = "sincronia") -> FlowPlan:
    """Classes from a cross-job order (Sincronia's BSSI, most urgent first) by equal-count bands.

    With more jobs than ``classes`` adjacent jobs share a class, in order
    (:func:`flowsched.coflow.priority_bands`): Sincronia's guarantee needs only
    that the priority order is respected, and merging neighbours keeps it up to
    ties. ``job_hosts`` names the hosts each job's flows leave from.

    >>> p = plan_from_order([f"j{i}" for i in range(10)], {f"j{i}": ["h"] for i in range(10)})
    >>> [r.priority for r in p.hosts["h"].rules]
    [0, 0, 1, 2, 3, 4, 4, 5, 6, 7]
    """
    if not 1 <= classes <= NUM_PRIORITIES:
        raise FlowPlanError(f"classes must be 1..{NUM_PRIORITIES}, got {classes}", where="classes")
    missing = [j for j in order if j not in job_hosts]
    if missing:
        raise FlowPlanError(f"job {missing[0]!r} of the order has no hosts", where="job_hosts")
    bands = priority_bands(list(order), classes)
    hosts: dict[str, HostPlan] = {}
    for job in order:
        for h in job_hosts[job]:
            hp = hosts.setdefault(h, HostPlan(link_rate=(link_rates or {}).get(h)))
            hp.rules.append(FlowRule(str(job), bands[job]))
    plan = FlowPlan(hosts, epoch, policy, [str(j) for j in order], {"classes": {str(j): bands[j] for j in order}})
    validate_plan(plan)
    return plan


def plan_from_parrot(alloc: ParrotAllocation, coflows: Sequence[Coflow], *, epoch: int = 0, link_rates: Mapping[str, float] | None = None,
                     classes: int = 2) -> FlowPlan:
    """Per-flow pacing rates and HTB ceilings from Parrot's allocation (one coflow per job, named by the job).

    Every inter-host flow of job *j* gets rule ``(j, peer=dst)`` with rate
    ``x_j * bytes`` (MADD: a coflow's flows finish together); flows of one job
    between the same hosts are summed. Parrot is a rate allocator, so the
    classes only order the leftover bandwidth: the SRPT job gets class 0, the
    others class ``classes - 1`` (``classes=1`` puts everyone in class 0).
    """
    job_class = {c.name: (0 if c.name == alloc.srpt_job or classes == 1 else min(classes, NUM_PRIORITIES) - 1) for c in coflows}
    per: dict[tuple[str, str, str], float] = {}
    for c in coflows:
        for f in c.flows:
            if f.src == f.dst or f.nbytes <= 0:
                continue
            key = (str(f.src), str(c.name), str(f.dst))
            per[key] = per.get(key, 0.0) + alloc.flow_rate(c.name, f)
    hosts: dict[str, HostPlan] = {}
    for (src, job, dst), rate in per.items():
        hp = hosts.setdefault(src, HostPlan(link_rate=(link_rates or {}).get(src)))
        if rate > 0:
            hp.rules.append(FlowRule(job, job_class[job], rate=rate, peer=dst))
    order = sorted((str(c.name) for c in coflows), key=lambda j: (job_class[j], -alloc.weights.get(j, 0.0)))
    meta = {"rates": {str(k): v for k, v in alloc.rates.items()}, "weights": {str(k): v for k, v in alloc.weights.items()},
            "srpt_job": None if alloc.srpt_job is None else str(alloc.srpt_job), "confidence": alloc.confidence}
    plan = FlowPlan(hosts, epoch, "parrot", order, meta)
    validate_plan(plan)
    return plan


def plan_from_bands(job: str, tensors: Sequence[str], hosts: Sequence[str], *, sizes: Sequence[float] | None = None,
                    classes: int = NUM_PRIORITIES, first_class: int = 0, into: FlowPlan | None = None, epoch: int | None = None) -> FlowPlan:
    """Geryon's per-tensor urgency bands inside one job: ``tensors`` most urgent first (first layers first).

    Equal-bytes bands when ``sizes`` are given (:func:`flowsched.coflow.priority_bands`), shifted to start
    at ``first_class`` and clipped at class 7. The rules are added to ``into`` (replacing its
    rules for the same job and tensor) or to a new plan.

    >>> p = plan_from_bands("a", ["conv1", "conv2", "fc"], ["h0"], sizes=[1, 1, 6], classes=2)
    >>> [(r.tensor, r.priority) for r in p.hosts["h0"].rules]
    [('conv1', 0), ('conv2', 0), ('fc', 1)]
    """
    if not 0 <= first_class < NUM_PRIORITIES:
        raise FlowPlanError(f"first_class must be 0..{NUM_PRIORITIES - 1}, got {first_class}", where="first_class")
    bands = priority_bands(list(tensors), classes, sizes=sizes)
    plan = FlowPlan(policy="geryon") if into is None else FlowPlan({h: HostPlan(list(hp.rules), hp.link_rate) for h, hp in into.hosts.items()},
                                                                     into.epoch, into.policy, into.order, dict(into.meta))
    if epoch is not None:
        plan.epoch = epoch
    for h in hosts:
        hp = plan.hosts.setdefault(h, HostPlan())
        hp.rules = [r for r in hp.rules if not (r.job == job and r.tensor in bands)]
        for t in tensors:
            hp.rules.append(FlowRule(job, min(NUM_PRIORITIES - 1, first_class + bands[t]), tensor=str(t)))
    plan.meta.setdefault("bands", {})[job] = {str(t): min(NUM_PRIORITIES - 1, first_class + bands[t]) for t in tensors}
    validate_plan(plan)
    return plan


# -- from an emu workload on a topology ---------------------------------------------------------------


def host_capacities(topo: Topology) -> tuple[dict[str, float], dict[str, float]]:
    """``(egress, ingress)`` bytes/s of every server: the sum of its NICs' network links."""
    out: dict[str, float] = {}
    inn: dict[str, float] = {}
    for u, v, _k, d in topo.links(LinkKind.NETWORK):
        if topo.kind(u) == NodeKind.NIC and topo.host_of(u):
            out[topo.host_of(u)] = out.get(topo.host_of(u), 0.0) + d["bw"] * 1e9  # type: ignore[index]
        if topo.kind(v) == NodeKind.NIC and topo.host_of(v):
            inn[topo.host_of(v)] = inn.get(topo.host_of(v), 0.0) + d["bw"] * 1e9  # type: ignore[index]
    return out, inn


def phase_flows(workload: Workload, topo: Topology, job: str, phase: str | None = None) -> dict[tuple[str, str], float]:
    """Inter-host bytes ``{(src_host, dst_host): bytes}`` of one iteration of ``job`` (one phase, or all).

    Collectives are decomposed with :func:`topology.collectives.collective_flows`
    (the backends' decomposition); flows inside a server never reach the network.
    """
    j = workload.job(job)
    out: dict[tuple[str, str], float] = {}
    for p in j.phases:
        if phase is not None and p.name != phase:
            continue
        pairs: list[tuple[str, str, float]] = []
        if isinstance(p, CollectivePhase):
            for step in collective_flows(topo, p.op, list(p.group or j.gpus), p.nbytes, p.algorithm):
                pairs.extend((f.src, f.dst, f.nbytes) for f in step)
        elif isinstance(p, P2PPhase):
            pairs.extend((t.src, t.dst, t.nbytes) for t in p.transfers)
        for s, d, b in pairs:
            hs, hd = topo.host_of(s), topo.host_of(d)
            if hs is None or hd is None:
                raise FlowPlanError(f"job {job!r} phase {p.name!r}: {s if hs is None else d} is not on a server", where="workload")
            if hs != hd and b > 0:
                out[(hs, hd)] = out.get((hs, hd), 0.0) + float(b)
    return out


def job_coflows(workload: Workload, topo: Topology) -> list[Coflow]:
    """One coflow per job: its per-iteration inter-host traffic (jobs whose traffic stays inside a server are left out)."""
    out = []
    for j in workload.jobs:
        flows = [Flow(s, d, b) for (s, d), b in phase_flows(workload, topo, j.name).items()]
        if flows:
            out.append(Coflow(j.name, flows, 1.0, {"iterations": j.iterations}))
    return out


def _phase_compute(workload: Workload, job: str) -> float:
    return float(sum(p.duration for p in workload.job(job).phases if isinstance(p, ComputePhase)))


@dataclass
class WorkloadDecision:
    """What :func:`plan_from_workload` decided, for printing: the plan plus the coflows it was derived from."""

    plan: FlowPlan
    coflows: list[Coflow]
    order: list[str]
    classes: dict[str, int]
    rates: dict[str, float] = field(default_factory=dict)  # per job, bytes/s leaving its busiest host
    remaining: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.plan.policy, "order": self.order, "classes": self.classes, "rates": self.rates,
                "remaining_s": self.remaining, "coflow_bytes": {str(c.name): sum(f.nbytes for f in c.flows) for c in self.coflows},
                "plan": self.plan.to_dict()}


def plan_from_workload(workload: Workload, topo: Topology, policy: str = "sincronia", *, epoch: int = 0,
                       classes: int = NUM_PRIORITIES, floor: float = 0.05) -> WorkloadDecision:
    """A cross-job flow plan for ``workload`` on ``topo``.

    Each job's coflow is its per-iteration inter-host traffic; ports are the
    servers' NIC totals (the coflow papers' big-switch model). Policies:

    - ``sincronia``: BSSI order -> classes by equal-count bands (:func:`plan_from_order`);
    - ``parrot``: LP rates (:func:`flowsched.coflow.parrot_rates`) with remaining time =
      iterations x (compute + the coflow's time alone) -> per-flow pacing + ceilings;
    - ``geryon``: the jobs' communication phases as items, in Sincronia's job order
      and each job's phase order, cut into equal-*bytes* bands (Geryon's rule applied
      across jobs; per-tensor bands inside a job come from :func:`plan_from_bands`);
    - ``fair``: every job keeps the class the workload gives it (default 0), no rates.
    """
    if policy not in POLICIES:
        raise FlowPlanError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}", where="policy")
    workload.validate(topo)
    egress, ingress = host_capacities(topo)
    capacity = {**{("out", h): c for h, c in egress.items()}, **{("in", h): c for h, c in ingress.items()}}
    coflows = job_coflows(workload, topo)
    job_hosts = {str(c.name): list(dict.fromkeys(str(f.src) for f in c.flows)) for c in coflows}
    if not coflows:
        return WorkloadDecision(FlowPlan({}, epoch, policy, [], {}), [], [], {})
    order = [str(n) for n in sincronia_order(coflows, capacity)]
    rates: dict[str, float] = {}
    remaining: dict[str, float] = {}
    if policy == "sincronia":
        plan = plan_from_order(order, job_hosts, classes=classes, epoch=epoch, link_rates=egress)
    elif policy == "parrot":
        for c in coflows:
            alone = max(b / capacity[p] for p, b in c.port_bytes().items())
            remaining[str(c.name)] = workload.job(str(c.name)).iterations * (_phase_compute(workload, str(c.name)) + alone)
        alloc = parrot_rates(coflows, remaining, capacity, floor=min(floor, 1.0 / len(coflows)))
        plan = plan_from_parrot(alloc, coflows, epoch=epoch, link_rates=egress, classes=min(classes, 2))
        for c in coflows:
            per_host: dict[str, float] = {}
            for f in c.flows:
                per_host[str(f.src)] = per_host.get(str(f.src), 0.0) + alloc.flow_rate(c.name, f)
            rates[str(c.name)] = max(per_host.values())
        order = list(plan.order or order)
    elif policy == "geryon":
        items, sizes, owner = [], [], {}
        for job in order:
            for p in workload.job(job).phases:
                nbytes = sum(phase_flows(workload, topo, job, p.name).values())
                if nbytes > 0:
                    key = f"{job}/{p.name}"
                    items.append(key)
                    sizes.append(nbytes)
                    owner[key] = (job, p.name)
        bands = priority_bands(items, classes, sizes=sizes)
        hosts: dict[str, HostPlan] = {}
        for key in items:
            job, phase = owner[key]
            for (src, _dst) in phase_flows(workload, topo, job, phase):
                hp = hosts.setdefault(src, HostPlan(link_rate=egress.get(src)))
                if not any(r.job == job and r.tensor == phase for r in hp.rules):
                    hp.rules.append(FlowRule(job, bands[key], tensor=phase))
        plan = FlowPlan(hosts, epoch, "geryon", order, {"bands": bands})
    else:  # fair
        hosts = {}
        for job in order:
            for h in job_hosts[job]:
                hosts.setdefault(h, HostPlan(link_rate=egress.get(h))).rules.append(FlowRule(job, workload.job(job).priority))
        plan = FlowPlan(hosts, epoch, "fair", order, {})
    validate_plan(plan)
    job_class = plan.job_priority()
    plan.meta.setdefault("classes", job_class)
    if rates:
        plan.meta["job_rates"] = rates
    return WorkloadDecision(plan, coflows, order, job_class, rates, remaining)


# -- NCCL plugin plan file ------------------------------------------------------------------------------


def nccl_class(priority: int) -> int:
    """The NCCL ``trafficClass`` whose default mark (CS<k>) is ``priority``'s DSCP: ``7 - priority``."""
    dscp_for_priority(priority)
    return NUM_PRIORITIES - 1 - priority


def skb_priority(priority: int) -> int:
    """``SO_PRIORITY`` value that selects the HTB leaf of ``priority`` directly on the sending host (classid 1:1p)."""
    dscp_for_priority(priority)
    return (1 << 16) | (0x10 + priority)


def to_nccl_plan(plan: FlowPlan, host: str, *, so_priority: bool = True) -> ncclhook.FlowPlan:
    """The NCCL plugin's plan for ``host``: per-class marks, per-communicator rules and marker rules.

    Class ``k = 7 - priority`` (the plugin's "higher class, more urgent") gets
    the class's DSCP, the HTB leaf class id as ``SO_PRIORITY`` when
    ``so_priority`` (host-local shortcut; needs CAP_NET_ADMIN) and, when every
    rated rule of the class has the same rate, that rate as the per-connection
    pacing rate. ``comm`` rules become communicator rules, ``port`` rules
    ``LD_PRELOAD`` marker rules. Tensor rules only contribute their class (the
    DDP hook picks the communicator of the class).
    """
    validate_plan(plan)
    classes: dict[int, ncclhook.ClassMark] = {}
    comms: list[ncclhook.CommRule] = []
    marks: list[ncclhook.MarkRule] = []
    by_prio: dict[int, list[FlowRule]] = {}
    for r in plan.rules(host):
        by_prio.setdefault(r.priority, []).append(r)
    for p, rules in sorted(by_prio.items()):
        rated = {int(r.rate) for r in rules if r.rate is not None and r.comm is None and r.port is None}
        rate = rated.pop() if len(rated) == 1 and all(r.rate is not None for r in rules) else None
        classes[nccl_class(p)] = ncclhook.ClassMark(dscp=rules[0].dscp, prio=skb_priority(p) if so_priority else None, rate=rate)
        for r in rules:
            if r.comm is not None:
                kind, ident = _parse_comm(r.comm, "comm", None)
                comms.append(ncclhook.CommRule(kind, ident, nccl_class(p),
                                               ncclhook.ClassMark(rate=int(r.rate) if r.rate is not None else None)))
            if r.port is not None:
                marks.append(ncclhook.MarkRule(r.port, r.dscp, skb_priority(p) if so_priority else None))
    return ncclhook.FlowPlan(classes=classes, comms=comms, marks=marks)


def write_nccl_plan(plan: FlowPlan, host: str, path: str | os.PathLike[str], **kwargs: Any) -> Path:
    """Write ``host``'s NCCL plugin plan file (``$NETWEAVE_PLAN``) atomically."""
    return ncclhook.write_plan(to_nccl_plan(plan, host, **kwargs), path)


def with_epoch(plan: FlowPlan, epoch: int) -> FlowPlan:
    """A copy of ``plan`` with another epoch."""
    return replace(plan, epoch=epoch, hosts={h: HostPlan(list(hp.rules), hp.link_rate) for h, hp in plan.hosts.items()},
                   meta=dict(plan.meta), order=None if plan.order is None else list(plan.order))


__all__ = [
    "FORMAT", "POLICIES", "VERSION", "ClassSpec", "FlowPlan", "FlowPlanError", "FlowRule", "HostPlan", "WorkloadDecision",
    "class_table", "dumps_plan", "host_capacities", "job_coflows", "loads_plan", "nccl_class", "phase_flows", "plan_from_bands",
    "plan_from_dict", "plan_from_order", "plan_from_parrot", "plan_from_workload", "read_plan", "skb_priority", "to_nccl_plan",
    "validate_plan", "with_epoch", "write_nccl_plan", "write_plan",
]
