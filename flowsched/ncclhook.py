"""The Python side of the NCCL hook in ``csrc/``.

``csrc/`` builds one library, ``libnccl-net-netweave.so``, that NCCL loads three times: as the
network plugin (``ncclNetPlugin_v12/v11/v10``: TCP sockets marked with DSCP, ``SO_PRIORITY``
and ``SO_MAX_PACING_RATE`` per communicator), as the tuner (``ncclTunerPlugin_v6/v5``) and as the
profiler (``ncclProfiler_v6/v5``, events into a shared-memory ring); plus ``libnetweave-mark.so``,
an ``LD_PRELOAD`` marker for processes that do not use NCCL (gloo). This module

* builds and locates them (:func:`build`, :func:`plugin_env`, :func:`marker_env`),
* writes and reads the *flow plan* file the plugins follow (:class:`FlowPlan`, :func:`write_plan`,
  :func:`read_plan`; parsing is the plugin's own parser, ``csrc/plan.c``, called through ctypes),
* reads the profiler ring (:class:`ProfilerRing`) and pairs its events (:func:`collective_spans`),
* generates the HTB priority tree that enforces the marks on a Linux egress (:func:`htb_commands`).

Traffic classes map to marks in one place: class ``k`` -> DSCP ``8k`` (class selector CS\\ *k*) and
``SO_PRIORITY k`` unless the plan says otherwise; :func:`htb_commands` gives DSCP CS\\ *k* the HTB
priority ``7 - k`` (higher class, served first). Example (no NCCL needed)::

    >>> plan = FlowPlan(classes={2: ClassMark(dscp=46, prio=6)}, tunes=[TuneRule(selector="class:2", algo="ring", proto="simple")])
    >>> print(format_plan(plan), end="")
    netweave-plan 1
    class 2 dscp=46 prio=6
    tune class:2 algo=ring proto=simple
    >>> parse_plan(format_plan(plan)) == plan
    True
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import fcntl
import json
import mmap
import numbers
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from topology.errors import InputError
from topology.io import atomic_write_text

REPO = Path(__file__).resolve().parent.parent
CSRC = REPO / "csrc"
BUILD = CSRC / "build"
PLUGIN_NAME = "netweave"
PLUGIN_LIB = "libnccl-net-netweave.so"
MARK_LIB = "libnetweave-mark.so"
FLUID_LIB = "libnetweave-fluid.so"  # emu.fluid's C event loop, built by the same Makefile
REPLAY_LIB = "libnetweave-replay.so"  # and placement.replay's LAS walk
NUM_CLASSES = 8

ALGORITHMS = ("tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat")
PROTOCOLS = ("ll", "ll128", "simple")
FUNCS = ("broadcast", "reduce", "allgather", "reducescatter", "allreduce", "sendrecv", "send", "recv",
         "alltoall", "scatter", "gather", "allgatherv")


class NcclHookError(InputError):
    """A bad plan file, ring file or build of the NCCL hook."""


# ----------------------------------------------------------------- building --
def build(*, sanitize: bool = False, force: bool = False, quiet: bool = True) -> Path:
    """Build ``csrc/`` with ``make`` when an output is missing or older than a source; return the build directory.

    ``sanitize=True`` builds the ASan/UBSan variant into ``csrc/build/sanitize``.
    """
    out = BUILD / "sanitize" if sanitize else BUILD
    wanted = [out / PLUGIN_LIB, out / "net_harness", out / "ring_harness", out / "plan_check", out / FLUID_LIB, out / REPLAY_LIB]
    wanted += [] if sanitize else [out / MARK_LIB]
    sources = list(CSRC.glob("*.c")) + list(CSRC.glob("*.h")) + list(CSRC.glob("include/*.h")) + list(CSRC.glob("tests/*.c"))
    newest = max((p.stat().st_mtime for p in sources), default=0.0)
    stale = force or any(not p.exists() or p.stat().st_mtime < newest for p in wanted)
    if stale:
        BUILD.mkdir(parents=True, exist_ok=True)
        with open(BUILD / ".build.lock", "w") as lock:  # parallel test workers: one make at a time
            fcntl.flock(lock, fcntl.LOCK_EX)
            _make(sanitize, quiet)
    return out


def _make(sanitize: bool, quiet: bool) -> None:
    if shutil.which("make") is None or shutil.which(os.environ.get("CC", "cc")) is None:
        raise NcclHookError("building csrc/ needs make and a C compiler (cc)", source=str(CSRC))
    cmd = ["make", "-C", str(CSRC)] + (["sanitize"] if sanitize else ["all"])
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise NcclHookError(f"make failed:\n{res.stdout[-2000:]}{res.stderr[-2000:]}", source=str(CSRC / "Makefile"))
    if not quiet:
        print(res.stdout, end="")


def plugin_env(*, plan: str | os.PathLike[str] | None = None, ring: str | None = None, build_dir: Path | None = None,
               tuner: bool = True, profiler: bool = True) -> dict[str, str]:
    """Environment that makes NCCL load the hook as net (and tuner/profiler) plugin.

    >>> env = plugin_env(plan="/tmp/p.plan", build_dir=Path("/x"))
    >>> env["NCCL_NET_PLUGIN"], env["NCCL_NET"], env["NETWEAVE_PLAN"]
    ('/x/libnccl-net-netweave.so', 'netweave', '/tmp/p.plan')
    """
    lib = str((build_dir or BUILD) / PLUGIN_LIB)
    env = {"NCCL_NET_PLUGIN": lib, "NCCL_NET": PLUGIN_NAME}
    if tuner:
        env["NCCL_TUNER_PLUGIN"] = lib
    if profiler:
        env["NCCL_PROFILER_PLUGIN"] = lib
    if plan is not None:
        env["NETWEAVE_PLAN"] = str(plan)
    if ring is not None:
        env["NETWEAVE_PROF_RING"] = ring
    return env


def marker_env(*, dscp: int | None = None, priority: int | None = None, ports: dict[int, tuple[int, int | None]] | None = None,
               plan: str | os.PathLike[str] | None = None, log: str | None = None, build_dir: Path | None = None) -> dict[str, str]:
    """Environment for ``LD_PRELOAD=libnetweave-mark.so``: mark every TCP socket (``dscp``/``priority``) or per port.

    ``ports`` maps a port (peer port for connect, local port for accept) to ``(dscp, priority or None)``.

    >>> marker_env(dscp=46, priority=1, ports={29500: (48, None)}, build_dir=Path("/x"))["NETWEAVE_MARK_PORTS"]
    '29500:48'
    """
    env = {"LD_PRELOAD": str((build_dir or BUILD) / MARK_LIB)}
    if dscp is not None:
        _check_range("dscp", dscp, 0, 63)
        env["NETWEAVE_DSCP"] = str(dscp)
    if priority is not None:
        _check_range("priority", priority, 0, 2**31 - 1)
        env["NETWEAVE_PRIORITY"] = str(priority)
    if ports:
        items = []
        for port, (d, p) in sorted(ports.items()):
            _check_range("port", port, 1, 65535)
            _check_range("dscp", d, 0, 63)
            items.append(f"{port}:{d}" + (f":{p}" if p is not None else ""))
        env["NETWEAVE_MARK_PORTS"] = ",".join(items)
    if plan is not None:
        env["NETWEAVE_PLAN"] = str(plan)
    if log is not None:
        env["NETWEAVE_MARK_LOG"] = log
    return env


TRANSPORTS = ("ib", "roce", "tcp")


def fabric_transport(topo, override: str | None = None) -> str:
    """How NCCL moves bytes between the hosts of ``topo``: ``ib``, ``roce`` or ``tcp``.

    ``override`` when given; else the topology's ``meta["fabric"]["transport"]``; else ``ib`` when every NIC is a
    ConnectX (named ``mlx5_*``, as the cluster builders name them: NVIDIA's reference designs are InfiniBand),
    and ``tcp`` otherwise (NICs without a model, e.g. the emulation's star topology).

    >>> import topology
    >>> from topology.fabrics import star
    >>> fabric_transport(topology.default_cluster()), fabric_transport(star(2)), fabric_transport(star(2), "roce")
    ('ib', 'tcp', 'roce')
    """
    value = override or ((topo.meta.get("fabric") or {}).get("transport") if hasattr(topo, "meta") else None)
    if value is not None:
        value = {"infiniband": "ib", "ethernet": "tcp", "socket": "tcp"}.get(str(value).lower(), str(value).lower())
        if value not in TRANSPORTS:
            raise NcclHookError(f"unknown transport {value!r}; expected one of {', '.join(TRANSPORTS)}", where="transport")
        return value
    nics = [d for _, d in topo.graph.nodes(data=True) if d.get("kind") == "nic"]
    return "ib" if nics and all(str(d.get("name", "")).startswith("mlx5") for d in nics) else "tcp"


def fabric_env(transport: str, *, traffic_class: int | None = None, dscp: int | None = None, plan: str | os.PathLike[str] | None = None,
               tuner: bool = False, profiler: bool = False, ring: str | None = None, build_dir: Path | None = None) -> dict[str, str]:
    """NCCL's environment for one job on a fabric, carrying the job's traffic class.

    * ``tcp``: the project's net plugin (``NCCL_NET=netweave``) with its plan file, which marks the sockets of the
      job's communicators (NCCL's own socket transport never sets a DSCP).
    * ``ib`` / ``roce``: NCCL's own IB verbs transport (GPUDirect RDMA stays on); the class rides on NCCL's native
      knobs: ``NCCL_IB_TC`` = DSCP << 2 (the GRH traffic class; on RoCE the IP TOS byte) and ``NCCL_IB_SL`` = the
      NCCL traffic class (the IB service level; on RoCE the Ethernet priority). The net plugin is not loaded.

    ``traffic_class``: NCCL's class 0..7 (7 most urgent); ``dscp`` defaults to its class selector CS<k>. The tuner and
    profiler plugins load only when asked (``tuner``, ``profiler``; a ``ring`` file implies the profiler).

    >>> fabric_env("ib", traffic_class=5)
    {'NCCL_IB_TC': '160', 'NCCL_IB_SL': '5'}
    >>> sorted(fabric_env("tcp", traffic_class=5, plan="/p", build_dir=Path("/x")))
    ['NCCL_NET', 'NCCL_NET_PLUGIN', 'NETWEAVE_PLAN']
    """
    if transport not in TRANSPORTS:
        raise NcclHookError(f"unknown transport {transport!r}; expected one of {', '.join(TRANSPORTS)}", where="transport")
    if traffic_class is not None:
        _check_range("traffic class", traffic_class, 0, NUM_CLASSES - 1)
    if dscp is not None:
        _check_range("dscp", dscp, 0, 63)
    profiler = profiler or ring is not None
    if transport == "tcp":
        return plugin_env(plan=plan, ring=ring, build_dir=build_dir, tuner=tuner, profiler=profiler)
    env: dict[str, str] = {}
    if traffic_class is not None or dscp is not None:
        d = dscp if dscp is not None else default_dscp(traffic_class)  # type: ignore[arg-type]
        env["NCCL_IB_TC"] = str(d << 2)
        if traffic_class is not None:
            env["NCCL_IB_SL"] = str(traffic_class)
    lib = str((build_dir or BUILD) / PLUGIN_LIB)
    if tuner:
        env["NCCL_TUNER_PLUGIN"] = lib
    if profiler:
        env["NCCL_PROFILER_PLUGIN"] = lib
    if (tuner or profiler) and plan is not None:
        env["NETWEAVE_PLAN"] = str(plan)
    if ring is not None:
        env["NETWEAVE_PROF_RING"] = ring
    return env


def _check_range(name: str, value: int, lo: int, hi: int, source: str | None = None, where: int | str | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise NcclHookError(f"{name} must be an integer {lo}..{hi}, got {value!r}", source=source, where=where)


# --------------------------------------------------------------------- plan --
def default_dscp(traffic_class: int) -> int:
    """DSCP of a traffic class without a plan entry: the class selector CS<k> = 8k."""
    _check_range("traffic class", traffic_class, 0, NUM_CLASSES - 1)
    return 8 * traffic_class


@dataclasses.dataclass(frozen=True)
class ClassMark:
    """Marks for one traffic class (unset fields keep the default CS<k> / priority k / no pacing)."""

    dscp: int | None = None
    prio: int | None = None
    rate: int | None = None       # bytes/s for a whole connection, split over its data sockets; 0 = unlimited
    nsocks: int | None = None     # data sockets per connection
    sockchunk: int | None = None  # stripe size on one data socket


@dataclasses.dataclass(frozen=True)
class CommRule:
    """Per-communicator override, by NCCL commId (``kind="comm"``) or init order in the process (``kind="order"``)."""

    kind: str
    ident: int
    cls: int | None = None
    mark: ClassMark = ClassMark()


@dataclasses.dataclass(frozen=True)
class TuneRule:
    """Tuner hint: first matching rule wins. ``selector`` is ``*``, ``class:K``, ``comm:ID`` or ``order:N``."""

    selector: str = "*"
    coll: str | None = None
    min_bytes: int | None = None
    max_bytes: int | None = None
    algo: str | None = None
    proto: str | None = None
    channels: int | None = None
    chunk: int | None = None


@dataclasses.dataclass(frozen=True)
class MarkRule:
    """LD_PRELOAD marker rule: ``port`` None = every TCP socket."""

    port: int | None
    dscp: int | None = None
    prio: int | None = None


@dataclasses.dataclass
class FlowPlan:
    """Everything the plugins read from the plan file (``$NETWEAVE_PLAN``); a plain data object."""

    classes: dict[int, ClassMark] = dataclasses.field(default_factory=dict)
    comms: list[CommRule] = dataclasses.field(default_factory=list)
    tunes: list[TuneRule] = dataclasses.field(default_factory=list)
    marks: list[MarkRule] = dataclasses.field(default_factory=list)

    def resolve(self, traffic_class: int | None, *, comm_id: int | None = None, order: int | None = None) -> dict[str, int | None]:
        """The marks the net plugin applies to a communicator (mirror of ``nw_plan_resolve`` in C).

        >>> FlowPlan().resolve(3)["dscp"], FlowPlan().resolve(None)["dscp"]
        (24, None)
        """
        own: dict[str, int | None] = {}
        cls_override = None
        for kind, ident in (("order", order), ("comm", comm_id)):
            for r in self.comms:
                if r.kind == kind and ident is not None and r.ident == ident:
                    if r.cls is not None:
                        cls_override = r.cls
                    own.update({k: v for k, v in dataclasses.asdict(r.mark).items() if v is not None})
        cls = cls_override if cls_override is not None else traffic_class
        out: dict[str, int | None] = {"cls": None, "dscp": None, "prio": None, "rate": None, "nsocks": None, "sockchunk": None}
        if cls is not None and 0 <= cls < NUM_CLASSES:
            out.update(cls=cls, dscp=8 * cls, prio=cls)
            out.update({k: v for k, v in dataclasses.asdict(self.classes.get(cls, ClassMark())).items() if v is not None})
        out.update(own)
        return out


_MARK_KEYS = ("dscp", "prio", "rate", "nsocks", "sockchunk")
_SEL_ANY, _SEL_CLASS, _SEL_COMM, _SEL_ORDER = 0, 1, 2, 3
_UNSET = -1
_PLAN_ABI = 2  # NW_PLAN_ABI in csrc/nw.h: the nw_plan_t layout mirrored below
_TOKEN = re.compile(r"[A-Za-z0-9_]+")  # names written into a plan: no blank, '#', '=' or line break can slip in


class _PlanLib:
    """The C grammar of ``csrc/plan.c`` in this process: the plugin library loaded with ctypes, its
    ``nw_plan_t`` mirrored as ctypes structures, checked against the library's ``netweave_plan_info``."""

    def __init__(self, lib_path: Path):
        lib = ctypes.CDLL(str(lib_path))
        self.lib = lib

        class Info(ctypes.Structure):
            _fields_ = [(n, ctypes.c_uint32) for n in ("abi", "plan_version", "plan_size", "mark_size", "comm_size", "tune_size",
                                                       "port_size", "num_classes", "max_rules", "max_line", "max_fields", "max_bytes")]

        info = Info.in_dll(lib, "netweave_plan_info")
        self.limits = {n: int(getattr(info, n)) for n in ("num_classes", "max_rules", "max_line", "max_fields", "max_bytes")}
        i32, i64, u64 = ctypes.c_int, ctypes.c_int64, ctypes.c_uint64

        class Mark(ctypes.Structure):
            _fields_ = [("cls", i32), ("dscp", i32), ("prio", i32), ("rate", i64), ("nsocks", i32), ("sockchunk", i64)]

        class Comm(ctypes.Structure):
            _fields_ = [("sel", i32), ("id", u64), ("m", Mark), ("line", i32)]

        class Tune(ctypes.Structure):
            _fields_ = [("sel", i32), ("id", u64), ("coll", i32), ("min_bytes", u64), ("max_bytes", u64), ("algo", i32), ("proto", i32),
                        ("channels", i32), ("chunk", i64), ("has_min", i32), ("has_max", i32), ("line", i32)]

        class Port(ctypes.Structure):
            _fields_ = [("port", i32), ("dscp", i32), ("prio", i32), ("line", i32)]

        nc, nr = self.limits["num_classes"], self.limits["max_rules"]

        class Plan(ctypes.Structure):
            _fields_ = [("version", i32), ("cls", Mark * nc), ("cls_own", Mark * nc), ("cls_line", i32 * nc), ("comm", Comm * nr),
                        ("ncomm", i32), ("tune", Tune * nr), ("ntune", i32), ("port", Port * nr), ("nport", i32), ("generation", u64)]

        ours = (_PLAN_ABI, ctypes.sizeof(Plan), ctypes.sizeof(Mark), ctypes.sizeof(Comm), ctypes.sizeof(Tune), ctypes.sizeof(Port))
        theirs = (info.abi, info.plan_size, info.mark_size, info.comm_size, info.tune_size, info.port_size)
        if ours != theirs:
            raise NcclHookError(f"plan layout (abi, sizes) {theirs} of the library, {ours} here: rebuild csrc/ (make -C csrc)", source=str(lib_path))
        self.Plan = Plan
        lib.netweave_plan_check.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(Plan), ctypes.c_char_p, ctypes.c_size_t,
                                            ctypes.POINTER(ctypes.c_int)]
        lib.netweave_plan_check.restype = ctypes.c_int
        lib.netweave_plan_name.argtypes = [ctypes.c_int, ctypes.c_int]
        lib.netweave_plan_name.restype = ctypes.c_char_p
        self.names: list[list[str]] = []  # canonical collective, algorithm and protocol names, by index
        for table in range(3):
            names: list[str] = []
            while (name := lib.netweave_plan_name(table, len(names))) is not None:
                names.append(name.decode())
            self.names.append(names)

    def check(self, data: bytes, source: str) -> FlowPlan:
        plan = self.Plan()
        err = ctypes.create_string_buffer(256)
        line = ctypes.c_int(0)
        if self.lib.netweave_plan_check(data, len(data), ctypes.byref(plan), err, len(err), ctypes.byref(line)) != 0:
            raise NcclHookError(err.value.decode("ascii", "replace"), source=source, where=line.value or None)
        return self._marshal(plan)

    def _marshal(self, p: ctypes.Structure) -> FlowPlan:
        def opt(v: int) -> int | None:
            return None if v == _UNSET else int(v)

        def mark(m: ctypes.Structure) -> ClassMark:
            return ClassMark(**{k: opt(getattr(m, k)) for k in _MARK_KEYS})

        funcs, algos, protos = self.names
        tunes = []
        for r in p.tune[:p.ntune]:
            sel = {_SEL_ANY: "*", _SEL_CLASS: f"class:{r.id}", _SEL_COMM: f"comm:{r.id:#x}", _SEL_ORDER: f"order:{r.id}"}[r.sel]
            tunes.append(TuneRule(sel, funcs[r.coll] if r.coll != _UNSET else None, int(r.min_bytes) if r.has_min else None,
                                  int(r.max_bytes) if r.has_max else None, algos[r.algo] if r.algo != _UNSET else None,
                                  protos[r.proto] if r.proto != _UNSET else None, opt(r.channels), opt(r.chunk)))
        return FlowPlan(classes={k: mark(p.cls_own[k]) for k in range(len(p.cls_line)) if p.cls_line[k]},
                        comms=[CommRule("comm" if r.sel == _SEL_COMM else "order", int(r.id), opt(r.m.cls), mark(r.m)) for r in p.comm[:p.ncomm]],
                        tunes=tunes, marks=[MarkRule(opt(r.port), opt(r.dscp), opt(r.prio)) for r in p.port[:p.nport]])


_plan_libs: list[_PlanLib] = []


def _plan_lib() -> _PlanLib:
    """The grammar of the plugin as built here: built (``make``) and loaded on first use, once per process
    (a loaded library cannot be swapped for a rebuilt one)."""
    if not _plan_libs:
        _plan_libs.append(_PlanLib(build() / PLUGIN_LIB))
    return _plan_libs[0]


def plan_limits() -> dict[str, int]:
    """The grammar's limits, read from the plugin library: rules per kind, bytes per line and file, fields per line.

    >>> plan_limits()["max_rules"], plan_limits()["max_line"]
    (64, 1023)
    """
    return dict(_plan_lib().limits)


def _num(value: object, what: str) -> str:
    """An integer field as plan text; anything else (a bool, a float, a string) is refused before it can reach the file."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise NcclHookError(f"{what} must be an integer, got {value!r}", source="<format_plan>")
    return str(int(value))


def _fmt_mark(m: ClassMark) -> list[str]:
    return [f"{k}={_num(getattr(m, k), k)}" for k in _MARK_KEYS if getattr(m, k) is not None]


def _check_token(value: object, what: str, pattern: re.Pattern[str] = _TOKEN) -> None:
    if value is not None and (not isinstance(value, str) or not pattern.fullmatch(value)):
        raise NcclHookError(f"{what} must be a name of letters, digits and '_', got {value!r}", source="<format_plan>")


def format_plan(plan: FlowPlan) -> str:
    """The plan file text (grammar in ``docs/ncclhook.md``); refuses a plan the plugin would reject.

    The text is checked by the plugin's own parser, so what this writes the plugin loads; rule counts
    are checked first, with the limit in the message.

    >>> format_plan(FlowPlan(marks=[MarkRule(p) for p in range(1, 101)]))
    Traceback (most recent call last):
    ...
    flowsched.ncclhook.NcclHookError: <format_plan>: the plan has 100 mark rules; the NCCL plugin takes at most 64
    """
    limit = plan_limits()["max_rules"]
    for what, n in (("comm/order", len(plan.comms)), ("tune", len(plan.tunes)), ("mark", len(plan.marks))):
        if n > limit:
            raise NcclHookError(f"the plan has {n} {what} rules; the NCCL plugin takes at most {limit}", source="<format_plan>")
    lines = ["netweave-plan 1"]
    for k in plan.classes:
        _check_range("class", k, 0, NUM_CLASSES - 1, "<format_plan>")
    for k in sorted(plan.classes):
        lines.append(" ".join([f"class {k}", *_fmt_mark(plan.classes[k])]))
    for r in plan.comms:
        if r.kind not in ("comm", "order"):
            raise NcclHookError(f"comm rule kind must be 'comm' or 'order', got {r.kind!r}", source="<format_plan>")
        ident = _num(r.ident, f"{r.kind} id")
        ident = f"{int(ident):#x}" if r.kind == "comm" else ident
        lines.append(" ".join([f"{r.kind} {ident}", *([f"class={_num(r.cls, 'class')}"] if r.cls is not None else []), *_fmt_mark(r.mark)]))
    for t in plan.tunes:
        _check_token(t.selector, "tune selector", re.compile(r"\*|(class|comm|order):[0-9A-Za-z]+"))
        for key in ("coll", "algo", "proto"):
            _check_token(getattr(t, key), f"tune {key}")
        parts = [f"tune {t.selector}"]
        for key, val in (("coll", t.coll), ("min", t.min_bytes), ("max", t.max_bytes), ("algo", t.algo), ("proto", t.proto),
                         ("channels", t.channels), ("chunk", t.chunk)):
            if val is not None:
                parts.append(f"{key}={val if key in ('coll', 'algo', 'proto') else _num(val, key)}")
        lines.append(" ".join(parts))
    for m in plan.marks:
        parts = [f"mark {'*' if m.port is None else _num(m.port, 'mark port')}"]
        parts += [f"{key}={_num(getattr(m, key), key)}" for key in ("dscp", "prio") if getattr(m, key) is not None]
        lines.append(" ".join(parts))
    text = "\n".join(lines) + "\n"
    parse_plan(text, source="<format_plan>")  # the plugin's parser: never write what it would reject
    return text


def parse_plan(text: str | bytes, source: str = "<plan>") -> FlowPlan:
    """Parse plan text with the plugin's own parser (``netweave_plan_check`` in ``csrc/plan.c``); errors name the line.

    ``str`` text is encoded as UTF-8; non-ASCII is allowed in comments only. Names come back in the
    canonical spelling (``AllReduce`` -> ``allreduce``), tune selectors as ``comm:0x..``.

    >>> parse_plan("netweave-plan 1\\nclass 9 dscp=1\\n", source="p.plan")
    Traceback (most recent call last):
    ...
    flowsched.ncclhook.NcclHookError: p.plan: line 2: class must be an integer 0..7, got '9'
    """
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    return _plan_lib().check(data, source)


def write_plan(plan: FlowPlan, path: str | os.PathLike[str]) -> Path:
    """Write the plan atomically (the plugins re-read it within 100 ms of a change)."""
    atomic_write_text(path, format_plan(plan))
    return Path(path)


def read_plan(path: str | os.PathLike[str]) -> FlowPlan:
    """Read and check a plan file (its bytes, at most the grammar's ``max_bytes``)."""
    limit = plan_limits()["max_bytes"]
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise NcclHookError(f"cannot read plan: {e.strerror or e}", source=str(path)) from None
    if len(data) > limit:
        raise NcclHookError(f"the plan is larger than {limit} bytes", source=str(path))
    return parse_plan(data, source=str(path))


# ------------------------------------------------------------ profiler ring --
RING_MAGIC = 0x314647505745574E
RING_VERSION = 1
RING_HEADER = 128
RECORD_DTYPE = np.dtype([
    ("seq", "<u8"), ("t_ns", "<u8"), ("comm_id", "<u8"), ("coll_seq", "<u8"), ("bytes", "<u8"),
    ("event_id", "<u4"), ("parent_id", "<u4"), ("kind", "<u2"), ("func", "u1"), ("algo", "u1"), ("proto", "u1"),
    ("channel", "u1"), ("is_send", "u1"), ("traffic_class", "i1"), ("peer", "<i4"), ("step", "<i4"),
])
assert RECORD_DTYPE.itemsize == 64
EVENT_KINDS = {1: "coll_start", 2: "coll_stop", 3: "proxyop_start", 4: "proxyop_stop", 5: "step_start", 6: "step_state",
               7: "step_stop", 8: "net_send", 9: "net_recv", 10: "p2p_start", 11: "p2p_stop", 15: "user"}
# header words (uint64 index): 0 magic, 1 version|header_size, 2 record_size|capacity, 3 write_seq, 4 read_seq, 5 dropped, 6 pid|flags
_W_WRITE, _W_READ, _W_DROPPED = 3, 4, 5


class ProfilerRing:
    """Reader of the profiler ring file written by the plugin (layout in ``csrc/ring.c`` and ``docs/ncclhook.md``).

    The reader is the ring's only consumer: :meth:`read` returns the committed records in order and frees
    their slots. Records the writers could not place because the ring was full are counted in
    :attr:`dropped`, never overwritten. Relies on x86-64 load ordering (TSO) for the commit check.
    """

    def __init__(self, path: str | os.PathLike[str], *, wait_s: float = 0.0):
        self.path = Path(path)
        deadline = time.monotonic() + wait_s
        while True:  # the writer creates the file, sizes it, then publishes the magic: wait for all three
            mm = None
            try:
                fd = os.open(self.path, os.O_RDWR)
                try:
                    size = os.fstat(fd).st_size
                    if size >= RING_HEADER:
                        mm = mmap.mmap(fd, size)
                finally:
                    os.close(fd)
            except FileNotFoundError:
                pass
            if mm is not None and int.from_bytes(mm[:8], "little") == RING_MAGIC:
                break
            if mm is not None and time.monotonic() >= deadline:
                magic = int.from_bytes(mm[:8], "little")
                mm.close()
                raise NcclHookError(f"not a netweave profiler ring (magic {magic:#x})", source=str(self.path))
            if mm is not None:
                mm.close()
            if time.monotonic() >= deadline:
                raise NcclHookError("no profiler ring (is NETWEAVE_PROF_RING set for the NCCL process?)", source=str(self.path))
            time.sleep(0.01)
        self._mm = mm
        self._hdr = np.frombuffer(self._mm, dtype="<u8", count=RING_HEADER // 8)
        head = np.frombuffer(self._mm, dtype="<u4", count=8, offset=8)
        version, header_size, record_size, capacity = (int(x) for x in head[:4])
        if version != RING_VERSION or header_size != RING_HEADER or record_size != RECORD_DTYPE.itemsize:
            raise NcclHookError(f"ring version {version} / header {header_size} / record {record_size} bytes; "
                                f"this reader knows {RING_VERSION} / {RING_HEADER} / {RECORD_DTYPE.itemsize}", source=str(self.path))
        if size < RING_HEADER + capacity * record_size:
            raise NcclHookError(f"ring file is {size} bytes, its header announces {capacity} records", source=str(self.path))
        self.capacity = capacity
        self.pid = int(np.frombuffer(self._mm, dtype="<i4", count=1, offset=48)[0])
        self._recs = np.frombuffer(self._mm, dtype=RECORD_DTYPE, count=capacity, offset=RING_HEADER)

    @property
    def dropped(self) -> int:
        """Records refused since the ring was created because it was full."""
        return int(self._hdr[_W_DROPPED])

    @property
    def pending(self) -> int:
        """Records claimed by writers and not yet read."""
        return int(self._hdr[_W_WRITE]) - int(self._hdr[_W_READ])

    def read(self, max_records: int | None = None) -> np.ndarray:
        """Consume the committed records in order; returns a structured array (dtype :data:`RECORD_DTYPE`)."""
        rd = int(self._hdr[_W_READ])
        n = min(int(self._hdr[_W_WRITE]) - rd, self.capacity)  # never more than the slots, whatever the header says
        if max_records is not None:
            n = min(n, max_records)
        if n <= 0:
            return np.empty(0, dtype=RECORD_DTYPE)
        idx = (rd + np.arange(n, dtype=np.uint64)) % np.uint64(self.capacity)
        out = self._recs[idx.astype(np.intp)]  # copy; seq (offset 0) is read before the payload
        ok = out["seq"] == (np.uint64(rd + 1) + np.arange(n, dtype=np.uint64))
        k = n if ok.all() else int(np.argmin(ok))  # stop at the first slot a writer has not published yet
        self._hdr[_W_READ] = rd + k
        return out[:k]

    def close(self) -> None:
        del self._hdr, self._recs
        self._mm.close()

    def __enter__(self) -> ProfilerRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def events_to_dicts(records: np.ndarray) -> list[dict[str, object]]:
    """Records as plain dicts with names for kind/func/algo/proto (255 = not given)."""
    out = []
    for r in records:
        d = {name: r[name].item() for name in RECORD_DTYPE.names}
        d["kind"] = EVENT_KINDS.get(d["kind"], d["kind"])
        for key, names in (("func", FUNCS), ("algo", ALGORITHMS), ("proto", PROTOCOLS)):
            d[key] = names[d[key]] if d[key] < len(names) else None
        out.append(d)
    return out


def collective_spans(records: np.ndarray) -> list[dict[str, object]]:
    """Pair coll_start/coll_stop records into spans (comm_id, coll_seq, func, bytes, start_ns, end_ns), in start order."""
    starts: dict[int, np.void] = {}
    spans = []
    for r in records:
        kind = int(r["kind"])
        if kind == 1:
            starts[int(r["event_id"])] = r
        elif kind == 2 and int(r["event_id"]) in starts:
            s = starts.pop(int(r["event_id"]))
            f = int(s["func"])
            spans.append({"comm_id": int(s["comm_id"]), "coll_seq": int(s["coll_seq"]), "func": FUNCS[f] if f < len(FUNCS) else None,
                          "bytes": int(s["bytes"]), "traffic_class": int(s["traffic_class"]), "start_ns": int(s["t_ns"]),
                          "end_ns": int(r["t_ns"])})
    spans.sort(key=lambda s: s["start_ns"])
    return spans


# --------------------------------------------------------------------- HTB --
def htb_commands(dev: str, rate_mbit: float, dscp_prio: dict[int, int] | None = None, *, floor_fraction: float = 0.01,
                 disable_offloads: bool = True) -> list[list[str]]:
    """Commands (argv lists) for the strict-priority HTB tree on ``dev``'s egress that serves DSCP marks.

    The tree is the shared one of :func:`emu.htb.htb_tree_commands` (eight leaves, HTB prio 0-7, DSCP CS<7-p>
    -> prio p, i.e. NCCL traffic class k = CS<k> -> prio 7-k), plus u32 filters for any extra DSCP values in
    ``dscp_prio`` (e.g. EF 46 -> prio 1) from :func:`flowsched.enforce.dscp_filter_commands`.

    >>> cmds = htb_commands("eth0", 100, {46: 1})
    >>> " ".join(cmds[-1])
    'tc filter add dev eth0 parent 1: protocol ip prio 10 u32 match ip tos 0xb8 0xfc flowid 1:11'
    """
    from emu.htb import PRIORITY_DSCP, htb_tree_commands

    from .enforce import _next_filter_pref, dscp_filter_commands

    for d, p in (dscp_prio or {}).items():
        _check_range("dscp", d, 0, 63)
        _check_range("htb prio", p, 0, 7)
        if d in PRIORITY_DSCP and PRIORITY_DSCP.index(d) != p:
            raise NcclHookError(f"DSCP {d} is the class selector of priority {PRIORITY_DSCP.index(d)}, not {p}")
    tree = htb_tree_commands(dev, rate_mbit, floor_fraction=floor_fraction)
    lines = tree + dscp_filter_commands(dev, dscp_prio or {}, first_pref=_next_filter_pref(tree))
    cmds: list[list[str]] = []
    if disable_offloads:  # one 64 KB TSO segment would block a slow link for milliseconds
        cmds.append(["ethtool", "-K", dev, "tso", "off", "gso", "off"])
    return cmds + [["tc", *line.split()] for line in lines]


def run_commands(cmds: Iterable[Sequence[str]], *, netns: str | None = None) -> None:
    """Run commands (optionally inside ``ip netns exec``); ethtool failures are ignored (veth may lack offloads)."""
    for cmd in cmds:
        full = (["ip", "netns", "exec", netns] if netns else []) + list(cmd)
        res = subprocess.run(full, capture_output=True, text=True)
        if res.returncode != 0 and cmd[0] != "ethtool":
            raise NcclHookError(f"{' '.join(full)} failed: {res.stderr.strip()}")


def htb_class_bytes(dev: str, *, netns: str | None = None) -> dict[str, int]:
    """Bytes sent per HTB class (``tc -s class show``, read by :func:`emu.htb.parse_tc_classes`), e.g. ``{"1:11": 123456, ...}``."""
    from emu.htb import parse_tc_classes

    cmd = (["ip", "netns", "exec", netns] if netns else []) + ["tc", "-s", "class", "show", "dev", dev]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return {cid: c.sent_bytes for cid, c in parse_tc_classes(out).items()}


class NetnsPair:
    """Two network namespaces joined by one veth pair (``<prefix>a``/``<prefix>b``, devices ``<prefix>a0``/``<prefix>b0``,
    addresses ``10.<subnet>.0.1/24`` and ``.2``); needs root. Always deletes what it created on exit::

        with NetnsPair("nwt", subnet=77) as pair:
            pair.run("a", ["ping", "-c1", pair.addr_b])
    """

    def __init__(self, prefix: str, subnet: int = 77):
        if not prefix.isalnum() or len(prefix) > 10:
            raise NcclHookError(f"netns prefix must be alphanumeric and at most 10 characters, got {prefix!r}")
        _check_range("subnet", subnet, 1, 254)
        self.ns_a, self.ns_b = f"{prefix}a", f"{prefix}b"
        self.dev_a, self.dev_b = f"{prefix}a0", f"{prefix}b0"
        self.addr_a, self.addr_b = f"10.{subnet}.0.1", f"10.{subnet}.0.2"

    def __enter__(self) -> NetnsPair:
        self._cleanup()
        try:
            for cmd in (["ip", "netns", "add", self.ns_a], ["ip", "netns", "add", self.ns_b],
                        ["ip", "link", "add", self.dev_a, "netns", self.ns_a, "type", "veth", "peer", "name", self.dev_b, "netns", self.ns_b]):
                subprocess.run(cmd, check=True, capture_output=True, text=True)
            for ns, dev, addr in ((self.ns_a, self.dev_a, self.addr_a), (self.ns_b, self.dev_b, self.addr_b)):
                for cmd in (["ip", "addr", "add", f"{addr}/24", "dev", dev], ["ip", "link", "set", dev, "up"], ["ip", "link", "set", "lo", "up"]):
                    subprocess.run(["ip", "netns", "exec", ns, *cmd], check=True, capture_output=True, text=True)
        except subprocess.CalledProcessError as e:
            self._cleanup()
            raise NcclHookError(f"{' '.join(e.cmd)} failed: {e.stderr.strip()}") from None
        return self

    def __exit__(self, *exc: object) -> None:
        self._cleanup()

    def _cleanup(self) -> None:
        for ns in (self.ns_a, self.ns_b):  # deleting a namespace removes its end of the veth (and so the pair)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def cmd(self, side: str, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed to run inside namespace ``side`` ('a' or 'b')."""
        return ["ip", "netns", "exec", self.ns_a if side == "a" else self.ns_b, *argv]


SCENARIOS = CSRC / "tests"


def _wait_for(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.05)


def gloo_contention(tmp_path: Path, *, marked: bool, prefix: str = "nwgc", subnet: int = 78, numel: int = 500_000, iters: int = 3,
                    rate_mbit: int = 20, capture: bool = True, dscp: int = 46) -> dict:
    """Emulation scenario (root, torch, iperf3): a 2-rank gloo all-reduce between two namespaces against an unmarked
    iperf3 bulk flow on the same HTB-shaped veth link (``rate_mbit``, DSCP ``dscp`` -> HTB prio 1, rest prio 7).

    With ``marked`` the ranks run under ``libnetweave-mark.so`` (``NETWEAVE_DSCP=dscp``). Returns rank 0's report
    (``elapsed_s``, ``correct``, per-class bytes sent on namespace a's egress during the all-reduces) plus the scapy
    capture on that egress (``capture``: ``"tos sport dport" -> [packets, payload bytes]``) and the marker's log.
    """
    build_dir = build()
    procs: list[subprocess.Popen] = []
    stop = tmp_path / "stop"
    with NetnsPair(prefix, subnet=subnet) as pair:
        try:
            for ns, dev in ((pair.ns_a, pair.dev_a), (pair.ns_b, pair.dev_b)):
                run_commands(htb_commands(dev, rate_mbit, {dscp: 1}), netns=ns)
            if capture:
                cap_cmd = [sys.executable, str(SCENARIOS / "capture_tos.py"), pair.dev_a, str(tmp_path / "cap.json"),
                           str(tmp_path / "ready"), str(stop)]
                procs.append(subprocess.Popen(pair.cmd("a", cap_cmd)))
                _wait_for(tmp_path / "ready", 60)
            procs.append(subprocess.Popen(pair.cmd("b", ["iperf3", "-s", "-1", "-p", "5301"]), stdout=subprocess.DEVNULL))
            time.sleep(0.3)
            procs.append(subprocess.Popen(pair.cmd("a", ["iperf3", "-c", pair.addr_b, "-p", "5301", "-t", "300"]),
                                          stdout=subprocess.DEVNULL))
            env = dict(os.environ)
            if marked:
                env.update(marker_env(dscp=dscp, priority=1, log=str(tmp_path / "mark.log"), build_dir=build_dir))
            ranks = []
            for rank, side, dev in ((0, "a", pair.dev_a), (1, "b", pair.dev_b)):
                argv = [sys.executable, str(SCENARIOS / "gloo_allreduce.py"), str(rank), pair.addr_a, "29511", dev, str(numel), str(iters),
                        str(tmp_path / f"rank{rank}.json")] + ([dev] if rank == 0 else [])
                ranks.append(subprocess.Popen(pair.cmd(side, argv), env=env))
            procs += ranks
            for r in ranks:
                if r.wait(timeout=240) != 0:
                    raise NcclHookError(f"gloo rank exited with {r.returncode}")
        finally:
            stop.touch()
            if capture:  # the capture writes its file once it sees the stop file
                with contextlib.suppress(subprocess.TimeoutExpired):
                    procs[0].wait(timeout=30)
            for p in reversed(procs):  # only the processes started here, by their own handles
                if p.poll() is None:
                    p.terminate()
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    report = json.loads((tmp_path / "rank0.json").read_text())
    report["capture"] = json.loads((tmp_path / "cap.json").read_text()) if capture else {}
    report["mark_log"] = (tmp_path / "mark.log").read_text().splitlines() if (tmp_path / "mark.log").exists() else []
    return report


def loopback_transfer(traffic_class: int | None = None, *, plan: str | os.PathLike[str] | None = None,
                      sizes: Sequence[int] = (1, 4096, 131073, 1 << 20), window: int = 4, build_dir: Path | None = None,
                      timeout: float = 60.0) -> dict:
    """Load the net plugin the way NCCL does and move messages between two processes over ``lo``.

    Runs ``csrc/tests/net_harness`` (dlopen, newest ``ncclNetPlugin_vN`` first, listen/connect/accept,
    ``window`` isend/irecv pairs of every size, every byte checked) with the communicator in ``traffic_class``
    and the plugin reading ``plan``. Returns the table version NCCL would have used, the bytes received
    intact and the marks (IP TOS, SO_PRIORITY, pacing rate) of the sockets on each side; raises
    :class:`NcclHookError` when the transfer fails.
    """
    bdir = build_dir or build()
    if not (bdir / "net_harness").exists():
        raise NcclHookError("no net_harness here: build csrc/ first (make -C csrc)", source=str(bdir))
    env = {k: v for k, v in os.environ.items() if k != "NETWEAVE_PLAN"}
    env["NETWEAVE_SOCKET_IFNAME"] = "lo"
    if plan is not None:
        env["NETWEAVE_PLAN"] = str(plan)
    args = [str(bdir / "net_harness"), str(bdir / PLUGIN_LIB), "--sizes", ",".join(map(str, sizes)), "--iters", "1",
            "--window", str(window)] + (["--tc", str(traffic_class)] if traffic_class is not None else [])
    res = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout)
    ok = re.search(r"OK receiver bytes=(\d+) version=(\d+)", res.stdout)
    if res.returncode != 0 or ok is None:
        raise NcclHookError(f"net_harness failed (exit {res.returncode}): {(res.stdout + res.stderr).strip()[-500:]}",
                            source=str(bdir / "net_harness"))
    marks: dict[str, list[dict[str, int]]] = {"sender": [], "receiver": []}
    for m in re.finditer(r"MARK (\w+) fd=\d+ tos=(\d+) prio=(\d+) pacing=(\d+)", res.stdout):
        marks[m.group(1)].append({"tos": int(m.group(2)), "prio": int(m.group(3)), "pacing": int(m.group(4))})
    return {"version": int(ok.group(2)), "bytes": int(ok.group(1)), "expected_bytes": sum(sizes) * window, "marks": marks}


# ---------------------------------------------------------------------- CLI --
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m flowsched.ncclhook build|check-plan FILE|ring FILE``."""
    ap = argparse.ArgumentParser(prog="python -m flowsched.ncclhook", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build csrc/ (make) and print the library path")
    b.add_argument("--sanitize", action="store_true")
    c = sub.add_parser("check-plan", help="parse a plan file and print it normalised")
    c.add_argument("path")
    r = sub.add_parser("ring", help="print the events in a profiler ring")
    r.add_argument("path")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "build":
            print(build(sanitize=args.sanitize) / PLUGIN_LIB)
        elif args.cmd == "check-plan":
            print(format_plan(read_plan(args.path)), end="")
        else:
            with ProfilerRing(args.path) as ring:
                for ev in events_to_dicts(ring.read()):
                    print(ev)
                print(f"dropped={ring.dropped}")
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
