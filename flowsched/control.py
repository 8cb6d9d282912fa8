"""Control plane: a scheduler service ships flow plans to one agent per host over ZeroMQ, with CURVE.

Channels (both authenticated with CURVE, keys from :func:`generate_keys`)
    *Command*: every agent binds a ROUTER (CURVE server, its own key pair) on its
    configured address; the scheduler connects one DEALER per agent (CURVE
    client with the scheduler's key pair). The agent's ZAP handler admits only
    the scheduler's public key. The scheduler sends ``plan`` messages; the agent
    answers each with ``ack`` (applied, or already applied) or ``nack`` (refused,
    with the reason).
    *Report*: the scheduler binds a ROUTER (CURVE server); agents connect DEALERs
    with their own key pairs. The scheduler's ZAP handler admits only the agents'
    public keys of the configuration, and every message must name the host whose
    key sent it (the ZAP ``User-Id``), so one agent cannot speak for another.
    Agents send ``hello`` at start and ``heartbeat`` every ``heartbeat_s``,
    both with the epoch *in force* (-1: none), ``report`` (measured bytes/s
    per class or job) and ``done`` (a job's completion).

Consistency
    A plan carries an ``epoch`` that grows with every publication. An agent
    validates a message completely (JSON, schema, host, epoch, the whole plan
    via :func:`flowsched.plan.plan_from_dict`) before it touches the kernel,
    and refuses messages for another host and epochs below the highest it
    ever had in force (stale). It applies a plan with one applier call,
    which is transactional (:func:`flowsched.enforce.apply_tc`: a tree tc
    refuses leaves the previous one in place, and the nack says so).
    *The acked state is what the kernel has*: after every apply, on every
    repeated push of the epoch in force, at start and every ``verify_s``, an
    applier that can read the kernel back (``applier.verify(plan, host)``,
    :class:`flowsched.enforce.TcApplier`) compares the device with the plan;
    on a difference the agent applies the plan again (and says so in the ack:
    ``repaired``), and when that does not help it nacks and reports epoch -1
    (nothing in force). *The epoch survives restarts*: with a ``state`` file
    the agent writes the epoch in force, the highest epoch it ever had in
    force and that plan atomically after every change and reads them at
    start, so after a restart it refuses older plans, and a push of the
    current one is verified, not applied again. Refusals are logged and kept
    in ``rejected`` (the newest :data:`MAX_KEPT`). Whenever a hello or
    heartbeat shows an agent behind the current epoch, the scheduler pushes
    the plan again: that is how a push lost while an agent was down, or a
    tree the agent could not keep, is repaired. Sends to unreachable agents
    are dropped, not queued (``ZMQ_IMMEDIATE``), so no old plan is delivered
    late. The scheduler keeps the newest :data:`MAX_KEPT` reports, completions
    and nacks per host (a deque; older ones are dropped and counted).

Messages are JSON objects with ``"proto": 1``. Every socket binds only to its
configured address; wildcard addresses (``*``, ``0.0.0.0``, ``::``) are refused
unless the configuration sets ``allow_wildcard``.

Configuration file (JSON or YAML)::

    {"format": "netweave-flow-control", "version": 1,
     "keys": "keys/",                               # relative to the file
     "heartbeat_s": 1.0,
     "scheduler": {"bind": "tcp://10.0.0.1:5710"},
     "agents": {"node0": {"bind": "tcp://10.0.0.10:5711", "dev": "eth0", "rate_mbit": 1000,
                          "state": "node0.state.json"}}}   # default: agent-HOST.state.json beside the file

Agent state file (``netweave-flow-agent-state`` version 1, JSON, written with
:func:`topology.io.atomic_write_text`): ``{"host", "epoch", "floor", "plan"}``
with ``epoch`` the epoch in force (-1: none), ``floor`` the highest epoch ever
in force (older pushes are stale) and ``plan`` the plan in force (or null).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from topology.errors import InputError
from topology.inputs import check_interface, check_name, check_number, loads_json, loads_yaml, read_text
from topology.io import atomic_write_text
from topology.schema import load_schema, validate

from .plan import FlowPlan, FlowPlanError, plan_from_dict, validate_plan

log = logging.getLogger(__name__)

PROTO = 1
CONFIG_FORMAT = "netweave-flow-control"
CONFIG_VERSION = 1
SCHEDULER_KEY = "scheduler"
_POLL_MS = 10
_WILDCARD_HOSTS = {"*", "0.0.0.0", "::", "[::]", ""}
STATE_FORMAT = "netweave-flow-agent-state"
STATE_VERSION = 1
#: How many reports, completions and nacks the scheduler keeps per host, and refusals each service keeps (the newest).
#: A report is ~1 kB in memory, so a host costs at most ~1 MB however long the scheduler runs.
MAX_KEPT = 1000


class ControlError(InputError):
    """A bad control-plane configuration, key directory or address."""


# -- keys -------------------------------------------------------------------------------------------------


def agent_key_name(host: str) -> str:
    return f"agent-{host}"


def generate_keys(out: str | os.PathLike[str], agents: list[str] | tuple[str, ...] = ()) -> dict[str, tuple[Path, Path]]:
    """Create CURVE key pairs for the scheduler and each agent in ``out`` (``NAME.key`` public, ``NAME.key_secret`` secret).

    Existing pairs are kept (re-running adds missing agents). Secret files are
    made readable by the owner only. Returns ``{name: (public, secret)}``.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    made = {}
    for name in [SCHEDULER_KEY, *(agent_key_name(a) for a in agents)]:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise ControlError(f"key name {name!r} must use letters, digits, '.', '_' or '-'", where="agents")
        pub, sec = out / f"{name}.key", out / f"{name}.key_secret"
        if not (pub.exists() and sec.exists()):
            pub_s, sec_s = zmq.auth.create_certificates(str(out), name)
            pub, sec = Path(pub_s), Path(sec_s)
        os.chmod(sec, 0o600)
        made[name] = (pub, sec)
    return made


def load_keypair(keys: str | os.PathLike[str], name: str) -> tuple[bytes, bytes]:
    """``(public, secret)`` z85 keys of ``name`` from its secret file."""
    path = Path(keys) / f"{name}.key_secret"
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise ControlError(f"cannot load key pair ({exc})", source=str(path)) from None
    if not secret:
        raise ControlError("no secret key in the file", source=str(path))
    return public, secret


def load_public(keys: str | os.PathLike[str], name: str) -> bytes:
    path = Path(keys) / f"{name}.key"
    try:
        public, _ = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise ControlError(f"cannot load public key ({exc})", source=str(path)) from None
    return public


class _KeySet:
    """ZAP credentials provider: admit exactly the given public keys."""

    def __init__(self, keys: Mapping[bytes, str]):
        self.keys = dict(keys)

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key in self.keys
        if not ok:
            log.warning("refused a CURVE client with an unknown key (domain %r)", domain)
        return ok


# -- configuration -------------------------------------------------------------------------------------------


def check_endpoint(endpoint: str, *, allow_wildcard: bool = False, where: str = "bind") -> str:
    """Accept ``tcp://HOST:PORT`` (or ``ipc://``, ``inproc://``); refuse wildcard hosts unless ``allow_wildcard``."""
    if not isinstance(endpoint, str):
        raise ControlError(f"expected an endpoint string, got {endpoint!r}", where=where)
    if endpoint.startswith(("ipc://", "inproc://")):
        return endpoint
    m = re.fullmatch(r"tcp://(\[[^\]]*\]|[^:]*):(\d+|\*)", endpoint)
    if not m:
        raise ControlError(f"expected tcp://HOST:PORT, got {endpoint!r}", where=where)
    if m.group(1) in _WILDCARD_HOSTS and not allow_wildcard:
        raise ControlError(f"{endpoint!r} binds every interface; give an address (or set allow_wildcard: true)", where=where)
    return endpoint


@dataclass
class AgentConfig:
    bind: str
    dev: str | None = None
    rate_mbit: float | None = None
    netns: str | None = None
    state: Path | None = None  # the agent's state file (None: the epoch is kept in memory only)


@dataclass
class ControlConfig:
    keys: Path
    scheduler_bind: str
    agents: dict[str, AgentConfig]
    heartbeat_s: float = 1.0
    allow_wildcard: bool = False
    source: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        check_endpoint(self.scheduler_bind, allow_wildcard=self.allow_wildcard, where="scheduler.bind")
        for h, a in self.agents.items():
            check_endpoint(a.bind, allow_wildcard=self.allow_wildcard, where=f"agents.{h}.bind")
        if not self.heartbeat_s > 0:
            raise ControlError(f"expected a positive number of seconds, got {self.heartbeat_s!r}", where="heartbeat_s")


def load_config(path: str | os.PathLike[str]) -> ControlConfig:
    """Read a control-plane configuration (JSON or YAML); errors name the field.

    The structure is checked against ``flowsched/schemas/flow-control.schema.json`` first; wildcard addresses after it.
    """
    src = str(path)
    data = loads_yaml(read_text(path, error=ControlError), source=src, error=ControlError)
    validate(data, load_schema("flowsched", "flow-control"), source=src, error=ControlError)
    if not isinstance(data, dict):
        raise ControlError("expected an object", source=src)
    if data.get("format") != CONFIG_FORMAT or data.get("version") != CONFIG_VERSION:
        raise ControlError(f"expected format {CONFIG_FORMAT!r} version {CONFIG_VERSION}", source=src, where="format")
    for key in ("keys", "scheduler", "agents"):
        if key not in data:
            raise ControlError("missing", source=src, where=key)
    sched = data["scheduler"]
    if not isinstance(sched, dict) or not isinstance(sched.get("bind"), str):
        raise ControlError("expected {bind: tcp://HOST:PORT}", source=src, where="scheduler")
    agents = {}
    if not isinstance(data["agents"], dict) or not data["agents"]:
        raise ControlError("expected {host: {bind: ...}, ...}", source=src, where="agents")
    for h, a in data["agents"].items():
        where = f"agents.{h}"
        if not isinstance(a, dict) or not isinstance(a.get("bind"), str):
            raise ControlError("expected {bind: tcp://HOST:PORT, dev: IFACE, rate_mbit: N}", source=src, where=where)
        extra = set(a) - {"bind", "dev", "rate_mbit", "netns", "state"}
        if extra:
            raise ControlError("unknown field (expected bind, dev, rate_mbit, netns, state)", source=src, where=f"{where}.{sorted(extra)[0]}")
        if not isinstance(a.get("state", ""), str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", str(h)):
            raise ControlError("expected a host name of letters, digits, '.', '_' or '-' and a state file path", source=src, where=where)
        dev = None if a.get("dev") is None else check_interface(a["dev"], source=src, where=f"{where}.dev", error=ControlError)
        rate = None if a.get("rate_mbit") is None else check_number(a["rate_mbit"], what="a rate in Mbit/s", source=src,
                                                                     where=f"{where}.rate_mbit", positive=True, maximum=8e6,
                                                                     error=ControlError)
        netns = None if a.get("netns") is None else check_name(a["netns"], what="network namespace", source=src, where=f"{where}.netns",
                                                               error=ControlError)
        if a.get("state") == "":   # "" would make the config's own directory the state file
            raise ControlError("expected a file name", source=src, where=f"{where}.state")
        state = Path(path).resolve().parent / a.get("state", f"agent-{h}.state.json")
        agents[str(h)] = AgentConfig(a["bind"], dev, rate, netns, state)
    if not isinstance(data["keys"], str) or not data["keys"]:
        raise ControlError("expected the key directory's path", source=src, where="keys")
    keys = Path(data["keys"])
    if not keys.is_absolute():
        keys = Path(path).resolve().parent / keys
    heartbeat = check_number(data.get("heartbeat_s", 1.0), what="seconds", source=src, where="heartbeat_s", positive=True, maximum=3600,
                             error=ControlError)
    wildcard = data.get("allow_wildcard", False)
    if not isinstance(wildcard, bool):
        raise ControlError(f"expected true or false, got {wildcard!r}", source=src, where="allow_wildcard")
    try:
        return ControlConfig(keys, sched["bind"], agents, float(heartbeat), wildcard, src)
    except ControlError as exc:
        raise ControlError(exc.message, source=src, where=exc.where) from None


# -- messages --------------------------------------------------------------------------------------------


class MessageError(ValueError):
    """A message that is malformed, stale, for another host, or from the wrong key."""


def encode(msg: dict[str, Any]) -> bytes:
    return json.dumps({"proto": PROTO, **msg}, separators=(",", ":")).encode()


_SCHEMA: dict[str, dict[str, type | tuple[type, ...]]] = {
    "plan": {"host": str, "epoch": int, "plan": dict},
    "ack": {"host": str, "epoch": int, "commands": int},
    "nack": {"host": str, "reason": str},
    "hello": {"host": str, "epoch": int},
    "heartbeat": {"host": str, "epoch": int, "seq": int, "time": (int, float)},
    "report": {"host": str, "epoch": int, "rates": dict},
    "done": {"host": str, "job": str, "time": (int, float)},
}


def decode(payload: bytes) -> dict[str, Any]:
    """Parse and schema-check one message; raises :class:`MessageError` naming what is wrong."""
    try:
        msg = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MessageError(f"not JSON ({exc})") from None
    if not isinstance(msg, dict):
        raise MessageError("not a JSON object")
    if msg.get("proto") != PROTO:
        raise MessageError(f"proto: expected {PROTO}, got {msg.get('proto')!r}")
    kind = msg.get("type")
    if kind not in _SCHEMA:
        raise MessageError(f"type: expected one of {', '.join(_SCHEMA)}, got {kind!r}")
    for key, typ in _SCHEMA[kind].items():
        v = msg.get(key)
        if not isinstance(v, typ) or isinstance(v, bool):
            raise MessageError(f"{kind}.{key}: expected {getattr(typ, '__name__', typ)}, got {v!r}")
    if kind == "report" and not all(isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
                                    for k, v in msg["rates"].items()):
        raise MessageError("report.rates: expected {name: bytes/s}")
    return msg


def _user_id(frame: zmq.Frame) -> str | None:
    try:
        return frame.get("User-Id")
    except zmq.ZMQError:
        return None


# -- the scheduler -----------------------------------------------------------------------------------------


class _Service:
    """A component that runs a poll loop in its own thread with its own context and ZAP authenticator."""

    name = "service"

    def __init__(self) -> None:
        self._ops: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.cond = threading.Condition()
        self.rejected: deque[str] = deque(maxlen=MAX_KEPT)

    def start(self) -> _Service:
        self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def __enter__(self) -> _Service:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(predicate, timeout)

    def _reject(self, reason: str) -> None:
        log.warning("%s: rejected message: %s", self.name, reason)
        with self.cond:
            self.rejected.append(reason)
            self.cond.notify_all()

    def _main(self) -> None:
        ctx = zmq.Context()
        auth = ThreadAuthenticator(ctx, log=logging.getLogger(f"{__name__}.zap"))
        sockets: list[zmq.Socket] = []
        try:
            auth.start()
            self._setup(ctx, auth, sockets)
        except BaseException as exc:  # reported to start()
            self._error = exc if isinstance(exc, InputError) else ControlError(f"{self.name} cannot start: {exc}")
            self._ready.set()
            self._close(ctx, auth, sockets)
            return
        self._ready.set()
        poller = zmq.Poller()
        for s in sockets:
            poller.register(s, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(_POLL_MS):
                    while True:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        try:
                            self._on_message(sock, frames)
                        except Exception as exc:  # one bad message must not stop the service
                            log.exception("%s: error while handling a message", self.name)
                            self._reject(f"internal error: {exc}")
                while True:
                    try:
                        op, arg = self._ops.get_nowait()
                    except queue.Empty:
                        break
                    self._on_op(op, arg)
                self._tick()
        finally:
            self._close(ctx, auth, sockets)

    @staticmethod
    def _close(ctx: zmq.Context, auth: ThreadAuthenticator, sockets: list[zmq.Socket]) -> None:
        for s in sockets:
            s.close(linger=0)
        if auth.is_alive():
            auth.stop()
        ctx.term()

    # hooks
    def _setup(self, ctx: zmq.Context, auth: ThreadAuthenticator, sockets: list[zmq.Socket]) -> None:
        raise NotImplementedError

    def _on_message(self, sock: zmq.Socket, frames: list[zmq.Frame]) -> None:
        raise NotImplementedError

    def _on_op(self, op: str, arg: Any) -> None:
        raise NotImplementedError

    def _tick(self) -> None:
        pass


@dataclass
class AgentState:
    """What the scheduler knows of one agent."""

    epoch: int = -1  # the epoch in force on the agent, as it last acknowledged or announced
    last_seen: float | None = None
    heartbeats: int = 0
    pushed: float = 0.0  # monotonic time of the last push
    reports: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=MAX_KEPT))  # the newest MAX_KEPT
    done: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=MAX_KEPT))
    nacks: deque[str] = field(default_factory=lambda: deque(maxlen=MAX_KEPT))
    received: int = 0  # reports received in all (``len(reports)`` stops at MAX_KEPT)


class Scheduler(_Service):
    """The scheduler service: publishes plans, collects acks, heartbeats, reports and completions.

    Example (needs running agents)::

        with Scheduler(load_config("control.yaml")) as s:
            s.publish(read_plan("plan.json"))
            s.wait_acked(plan.epoch, timeout=5)
    """

    name = "flow-scheduler"

    def __init__(self, config: ControlConfig, *, repush_s: float | None = None):
        super().__init__()
        self.config = config
        self.repush_s = config.heartbeat_s if repush_s is None else repush_s
        self.plan: FlowPlan | None = None
        self.agents = {h: AgentState() for h in config.agents}
        self._agent_keys = {load_public(config.keys, agent_key_name(h)): h for h in config.agents}
        self._cmd: dict[str, zmq.Socket] = {}
        self._cmd_host: dict[zmq.Socket, str] = {}
        self._report: zmq.Socket | None = None

    def _setup(self, ctx: zmq.Context, auth: ThreadAuthenticator, sockets: list[zmq.Socket]) -> None:
        public, secret = load_keypair(self.config.keys, SCHEDULER_KEY)
        auth.configure_curve_callback("*", _KeySet(self._agent_keys))
        rep = ctx.socket(zmq.ROUTER)
        sockets.append(rep)
        rep.curve_server = True
        rep.curve_publickey, rep.curve_secretkey = public, secret
        rep.bind(self.config.scheduler_bind)
        self._report = rep
        for h, a in self.config.agents.items():
            s = ctx.socket(zmq.DEALER)
            sockets.append(s)
            s.curve_publickey, s.curve_secretkey = public, secret
            s.curve_serverkey = load_public(self.config.keys, agent_key_name(h))
            s.setsockopt(zmq.IMMEDIATE, 1)  # never queue a plan for an agent that is not connected
            s.setsockopt(zmq.SNDHWM, 16)
            s.connect(a.bind)
            self._cmd[h], self._cmd_host[s] = s, h

    # public API (any thread)
    def publish(self, plan: FlowPlan) -> int:
        """Make ``plan`` current and push each host's part to its agent; returns the epoch.

        The epoch must grow: publishing an epoch not above the current one raises.
        """
        validate_plan(plan)
        with self.cond:
            if self.plan is not None and plan.epoch <= self.plan.epoch:
                raise ControlError(f"epoch {plan.epoch} is not newer than the current {self.plan.epoch}", where="epoch")
            unknown = sorted(set(plan.hosts) - set(self.agents))
            if unknown:
                raise ControlError(f"the plan names host {unknown[0]!r}, which has no agent in the configuration", where="hosts")
            self.plan = plan
        self._ops.put(("push_all", None))
        return plan.epoch

    def wait_acked(self, epoch: int, hosts: list[str] | None = None, timeout: float = 5.0) -> bool:
        """Wait until every host of the plan (or ``hosts``) acknowledged ``epoch`` or later."""
        want = hosts if hosts is not None else (list(self.plan.hosts) if self.plan else [])
        return self.wait_for(lambda: all(self.agents[h].epoch >= epoch for h in want), timeout)

    def alive(self, timeout_s: float | None = None) -> dict[str, bool]:
        """Hosts whose last message came within ``timeout_s`` (default 3 heartbeats)."""
        limit = 3 * self.config.heartbeat_s if timeout_s is None else timeout_s
        now = time.monotonic()
        return {h: a.last_seen is not None and now - a.last_seen <= limit for h, a in self.agents.items()}

    def status(self) -> dict[str, Any]:
        alive = self.alive()
        return {"epoch": None if self.plan is None else self.plan.epoch,
                "agents": {h: {"epoch": a.epoch, "alive": alive[h], "heartbeats": a.heartbeats, "reports": a.received,
                               "done": [d["job"] for d in a.done]} for h, a in self.agents.items()},
                "rejected": list(self.rejected)}

    # loop internals
    def _push(self, host: str) -> None:
        plan = self.plan
        if plan is None or host not in plan.hosts:
            return
        msg = encode({"type": "plan", "host": host, "epoch": plan.epoch, "plan": plan.for_host(host).to_dict()})
        self.agents[host].pushed = time.monotonic()
        try:
            self._cmd[host].send(msg, zmq.NOBLOCK)
        except zmq.Again:
            log.info("agent %s not connected; it will get epoch %d when it says hello", host, plan.epoch)

    def _on_op(self, op: str, arg: Any) -> None:
        if op == "push_all":
            for h in list(self.plan.hosts if self.plan else []):
                self._push(h)

    def _on_message(self, sock: zmq.Socket, frames: list[zmq.Frame]) -> None:
        if sock is self._report:
            if len(frames) != 2:
                return self._reject(f"report channel: expected 2 frames, got {len(frames)}")
            payload = frames[1]
            sender = self._agent_keys.get((_user_id(payload) or "").encode())
        else:
            if len(frames) != 1:
                return self._reject(f"command channel: expected 1 frame, got {len(frames)}")
            payload = frames[0]
            sender = self._cmd_host[sock]  # the agent's server key authenticated this connection
        try:
            msg = decode(payload.bytes)
            if sender is None:
                raise MessageError("sender key is not an agent's")
            if msg["host"] != sender:
                raise MessageError(f"host {msg['host']!r} sent with the key of {sender!r}")
            if sock is self._report and msg["type"] not in ("hello", "heartbeat", "report", "done"):
                raise MessageError(f"type {msg['type']!r} is not allowed on the report channel")
            if sock is not self._report and msg["type"] not in ("ack", "nack"):
                raise MessageError(f"type {msg['type']!r} is not allowed on the command channel")
        except MessageError as exc:
            return self._reject(str(exc))
        a = self.agents[sender]
        behind = False
        with self.cond:
            a.last_seen = time.monotonic()
            kind = msg["type"]
            if kind == "ack":
                a.epoch = msg["epoch"]
            elif kind == "nack":
                a.nacks.append(msg["reason"])
                if isinstance(msg.get("epoch"), int) and not isinstance(msg["epoch"], bool):
                    a.epoch = msg["epoch"]  # what the agent still has in force
                log.warning("agent %s refused a plan: %s", sender, msg["reason"])
            elif kind in ("hello", "heartbeat"):
                if kind == "heartbeat":
                    a.heartbeats += 1
                a.epoch = msg["epoch"]  # the agent's word on what is in force (-1 after it lost its tree)
                cur = self.plan.epoch if self.plan else -1
                behind = msg["epoch"] < cur and sender in (self.plan.hosts if self.plan else {}) and (
                    kind == "hello" or time.monotonic() - a.pushed >= self.repush_s)
            elif kind == "report":
                a.reports.append(msg)
                a.received += 1
            elif kind == "done":
                a.done.append(msg)
            self.cond.notify_all()
        if behind:
            self._push(sender)


# -- the agent -----------------------------------------------------------------------------------------------


def read_agent_state(path: str | os.PathLike[str], host: str) -> dict[str, Any] | None:
    """The state an agent left in ``path`` (None when there is no file); :class:`ControlError` names what is wrong.

    The structure is checked against ``flowsched/schemas/flow-agent-state.schema.json`` first, the stored plan against
    the flow plan's, then that the host is this agent's and that epoch, floor and plan agree.
    """
    src = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise ControlError(f"cannot read the agent state ({exc})", source=src) from None
    data = loads_json(text, source=src, error=ControlError)
    validate(data, load_schema("flowsched", "flow-agent-state"), source=src, error=ControlError)
    if not isinstance(data, dict) or data.get("format") != STATE_FORMAT or data.get("version") != STATE_VERSION:
        raise ControlError(f"expected format {STATE_FORMAT!r} version {STATE_VERSION}", source=src, where="format")
    if data.get("host") != host:
        raise ControlError(f"the state is host {data.get('host')!r}'s, not {host!r}'s", source=src, where="host")
    for key in ("epoch", "floor"):
        if not isinstance(data.get(key), int) or isinstance(data.get(key), bool) or data[key] < -1:
            raise ControlError(f"expected an integer >= -1, got {data.get(key)!r}", source=src, where=key)
    plan = None
    if data.get("plan") is not None:
        try:
            plan = plan_from_dict(data["plan"], source=src)
        except FlowPlanError as exc:
            raise ControlError(f"the stored plan is invalid: {exc.message}", source=src, where=f"plan.{exc.where or ''}") from None
    if (plan is None) != (data["epoch"] == -1) or (plan is not None and plan.epoch != data["epoch"]) or data["epoch"] > data["floor"]:
        raise ControlError("epoch, floor and plan disagree (expected epoch = plan.epoch <= floor, or epoch -1 and no plan)", source=src,
                           where="epoch")
    return {"epoch": data["epoch"], "floor": data["floor"], "plan": plan}


class Agent(_Service):
    """One host's agent: applies the plans the scheduler sends, checks that the kernel holds them, reports, heartbeats.

    ``applier(plan, host)`` installs the plan's whole batch or raises, leaving
    the previous tree in place (:class:`flowsched.enforce.TcApplier`);
    :class:`flowsched.enforce.DryRunApplier` records instead. When the applier
    has ``verify(plan, host) -> problems`` the agent checks the kernel after
    every apply, on repeated pushes, at start and every ``verify_s`` seconds
    (default: 5 heartbeats), and applies again on a difference.
    ``state_path``: the state file that keeps the epoch across restarts (see
    the module docstring); None keeps it in memory only.
    ``meter()``, when given, returns cumulative bytes per class (e.g. from
    :func:`flowsched.enforce.class_bytes`); the agent then reports per-class
    rates with each heartbeat.

    Attributes: ``epoch`` (in force, -1 none), ``floor`` (highest epoch ever in
    force), ``applied`` (epochs this process installed, repairs included) and
    ``verified`` (epochs found intact in the kernel without installing).
    """

    name = "flow-agent"

    def __init__(self, host: str, config: ControlConfig, applier: Callable[[FlowPlan, str], list[str]], *,
                 meter: Callable[[], Mapping[str, float]] | None = None, state_path: str | os.PathLike[str] | None = None,
                 verify_s: float | None = None):
        super().__init__()
        if host not in config.agents:
            raise ControlError(f"host {host!r} is not among the configured agents ({', '.join(config.agents)})", where="host")
        self.host, self.config, self.applier, self.meter = host, config, applier, meter
        self.name = f"flow-agent-{host}"
        self.state_path = Path(state_path) if state_path is not None else None
        self.verify_s = 5 * config.heartbeat_s if verify_s is None else verify_s
        self.epoch = -1
        self.floor = -1
        self.plan: FlowPlan | None = None
        stored = read_agent_state(self.state_path, host) if self.state_path is not None else None
        if stored is not None:
            self.epoch, self.floor, self.plan = stored["epoch"], stored["floor"], stored["plan"]
        self.applied: list[int] = []
        self.verified: list[int] = []
        self._scheduler_key = load_public(config.keys, SCHEDULER_KEY)
        self._seq = 0
        self._next_beat = 0.0
        self._next_verify = 0.0
        self._last_meter: tuple[float, dict[str, float]] | None = None
        self._cmd: zmq.Socket | None = None
        self._rep: zmq.Socket | None = None

    def _setup(self, ctx: zmq.Context, auth: ThreadAuthenticator, sockets: list[zmq.Socket]) -> None:
        public, secret = load_keypair(self.config.keys, agent_key_name(self.host))
        auth.configure_curve_callback("*", _KeySet({self._scheduler_key: SCHEDULER_KEY}))
        cmd = ctx.socket(zmq.ROUTER)
        sockets.append(cmd)
        cmd.curve_server = True
        cmd.curve_publickey, cmd.curve_secretkey = public, secret
        cmd.bind(self.config.agents[self.host].bind)
        rep = ctx.socket(zmq.DEALER)
        sockets.append(rep)
        rep.curve_publickey, rep.curve_secretkey = public, secret
        rep.curve_serverkey = self._scheduler_key
        rep.setsockopt(zmq.SNDHWM, 64)
        rep.connect(self.config.scheduler_bind)
        self._cmd, self._rep = cmd, rep
        if self.plan is not None:  # a restart: is the stored plan still what the kernel has?
            self._keep_in_force("start")
        self._send({"type": "hello", "host": self.host, "epoch": self.epoch})
        self._next_beat = time.monotonic() + self.config.heartbeat_s
        self._next_verify = time.monotonic() + self.verify_s

    # public API (any thread)
    def report(self, rates: Mapping[str, float]) -> None:
        """Send measured rates (bytes/s per class or job)."""
        self._ops.put(("send", {"type": "report", "host": self.host, "epoch": self.epoch, "rates": {str(k): float(v) for k, v in rates.items()}}))

    def complete(self, job: str) -> None:
        """Tell the scheduler that ``job`` finished on this host."""
        self._ops.put(("send", {"type": "done", "host": self.host, "job": str(job), "time": time.time()}))

    # state
    def _set_in_force(self, plan: FlowPlan | None) -> None:
        """Record what the kernel holds now (``None``: nothing of ours), persist it, wake waiters."""
        with self.cond:
            self.plan = plan
            self.epoch = -1 if plan is None else plan.epoch
            self.floor = max(self.floor, self.epoch)
            self.cond.notify_all()
        if self.state_path is not None:
            state = {"format": STATE_FORMAT, "version": STATE_VERSION, "host": self.host, "epoch": self.epoch, "floor": self.floor,
                     "plan": None if plan is None else plan.to_dict()}
            atomic_write_text(self.state_path, json.dumps(state, indent=1) + "\n")

    def _verify(self, plan: FlowPlan) -> list[str] | None:
        """The applier's differences between the kernel and ``plan`` (None: the applier cannot read the kernel)."""
        verify = getattr(self.applier, "verify", None)
        if verify is None:
            return None
        try:
            return list(verify(plan, self.host))
        except Exception as exc:  # reading the kernel failed: that is a difference too
            return [f"cannot read the kernel back: {exc}"]

    def _install(self, plan: FlowPlan) -> tuple[int, list[str]]:
        """Apply ``plan`` and check it, applying once more on a difference: ``(tc lines, problems left)``; raises if tc refuses."""
        lines = self.applier(plan, self.host)
        problems = self._verify(plan) or []
        if problems:
            log.warning("%s: the kernel differs from epoch %d after applying it (%s); applying again", self.name, plan.epoch, problems[0])
            lines = self.applier(plan, self.host)
            problems = self._verify(plan) or []
        with self.cond:
            self.applied.append(plan.epoch)
        return len(lines), problems

    def _keep_in_force(self, why: str) -> tuple[int, list[str]]:
        """Verify the plan in force and repair it if the kernel lost it: ``(tc lines run, problems left)``."""
        plan = self.plan
        assert plan is not None
        problems = self._verify(plan)
        if problems is None or not problems:
            if problems is not None:
                with self.cond:
                    self.verified.append(plan.epoch)
            return 0, []
        log.warning("%s: %s: the kernel no longer holds epoch %d (%s); applying it again", self.name, why, plan.epoch, problems[0])
        try:
            n, left = self._install(plan)
        except Exception as exc:
            n, left = 0, [f"applying it again failed: {exc}"]
        if left:
            self._reject(f"epoch {plan.epoch} is not in force and could not be restored: {left[0]}")
            self._set_in_force(None)
        return n, left

    # loop internals
    def _send(self, msg: dict[str, Any]) -> None:
        assert self._rep is not None
        try:
            self._rep.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            log.info("%s: scheduler unreachable, dropped a %s", self.name, msg["type"])

    def _on_op(self, op: str, arg: Any) -> None:
        if op == "send":
            self._send(arg)

    def _tick(self) -> None:
        now = time.monotonic()
        if self.plan is not None and now >= self._next_verify:
            self._next_verify = now + self.verify_s
            self._keep_in_force("periodic check")
        if now < self._next_beat:
            return
        self._next_beat = now + self.config.heartbeat_s
        self._seq += 1
        self._send({"type": "heartbeat", "host": self.host, "epoch": self.epoch, "seq": self._seq, "time": time.time()})
        if self.meter is not None:
            try:
                counts = {str(k): float(v) for k, v in self.meter().items()}
            except Exception as exc:  # e.g. the interface went away; keep heartbeating
                log.warning("%s: meter failed: %s", self.name, exc)
                return
            if self._last_meter is not None:
                t0, c0 = self._last_meter
                rates = {k: (v - c0.get(k, 0.0)) / (now - t0) for k, v in counts.items()}
                self._send({"type": "report", "host": self.host, "epoch": self.epoch, "rates": rates})
            self._last_meter = (now, counts)

    def _reply(self, ident: zmq.Frame, msg: dict[str, Any]) -> None:
        assert self._cmd is not None
        self._cmd.send_multipart([ident, encode(msg)], zmq.NOBLOCK)

    def _nack(self, ident: zmq.Frame, reason: str) -> None:
        self._reject(reason)
        self._reply(ident, {"type": "nack", "host": self.host, "reason": reason, "epoch": self.epoch})

    def _on_message(self, sock: zmq.Socket, frames: list[zmq.Frame]) -> None:
        if len(frames) != 2:
            return self._reject(f"expected 2 frames, got {len(frames)}")
        ident, payload = frames
        try:
            if (_user_id(payload) or "").encode() != self._scheduler_key:
                raise MessageError("sender is not the scheduler")
            msg = decode(payload.bytes)
            if msg["type"] != "plan":
                raise MessageError(f"type {msg['type']!r} is not allowed on the command channel")
            if msg["host"] != self.host:
                raise MessageError(f"plan for host {msg['host']!r} sent to {self.host!r}")
            if msg["epoch"] < self.floor:
                raise MessageError(f"stale plan: epoch {msg['epoch']} is older than epoch {self.floor}, which was in force")
            try:
                plan = plan_from_dict(msg["plan"], source="message")
            except FlowPlanError as exc:
                raise MessageError(f"invalid plan: {exc}") from None
            if plan.epoch != msg["epoch"]:
                raise MessageError(f"message epoch {msg['epoch']} differs from the plan's {plan.epoch}")
            if set(plan.hosts) != {self.host}:
                raise MessageError(f"the plan must hold exactly this host, it holds {sorted(plan.hosts)}")
            if msg["epoch"] == self.epoch and self.plan is not None and plan.to_dict() != self.plan.to_dict():
                raise MessageError(f"epoch {msg['epoch']} is in force with a different plan; a changed plan needs a new epoch")
        except MessageError as exc:
            return self._nack(ident, str(exc))
        if msg["epoch"] == self.epoch:  # a repeated push of the plan in force: check the kernel, repair if needed
            n, left = self._keep_in_force("repeated push")
            if left:
                return self._nack(ident, f"epoch {plan.epoch} could not be kept in force: {left[0]}")
            self._reply(ident, {"type": "ack", "host": self.host, "epoch": self.epoch, "commands": n, "verified": self._verify_known(),
                                "repaired": n > 0})
            return
        try:
            n, left = self._install(plan)
        except Exception as exc:  # the applier left the previous tree in place (enforce.apply_tc) and says so
            if self.plan is not None:
                self._keep_in_force("after a failed apply")
            kept = f"epoch {self.epoch} stays in force" if self.plan is not None else "no plan is in force"
            return self._nack(ident, f"apply failed: {exc}; {kept}")
        if left:
            self._set_in_force(None)
            return self._nack(ident, f"epoch {plan.epoch} was applied but the kernel does not hold it ({'; '.join(left[:3])}); "
                                     "no plan is in force")
        self._set_in_force(plan)
        log.info("%s: applied epoch %d (%d tc lines)", self.name, plan.epoch, n)
        self._reply(ident, {"type": "ack", "host": self.host, "epoch": plan.epoch, "commands": n,
                            "verified": self._verify_known(), "repaired": False})

    def _verify_known(self) -> bool:
        return getattr(self.applier, "verify", None) is not None


__all__ = [
    "CONFIG_FORMAT", "MAX_KEPT", "PROTO", "STATE_FORMAT", "Agent", "AgentConfig", "AgentState", "ControlConfig", "ControlError", "MessageError",
    "Scheduler", "agent_key_name", "check_endpoint", "decode", "encode", "generate_keys", "load_config", "load_keypair", "load_public",
    "read_agent_state",
]
