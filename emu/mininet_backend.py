"""The Mininet backend: run a workload as real TCP traffic through a time-scaled emulated fabric.

:func:`run_mininet` builds the network (:mod:`emu.net`), starts one traffic
agent (:mod:`emu.agent`) per emulated host, and walks every job's phase graph
in a controller that lives in this process:

- a ``compute`` phase is a timer of ``duration * K`` seconds (K = time scale);
- a ``collective`` phase is decomposed with
  :func:`topology.collectives.collective_flows` into sequential steps of
  concurrent point-to-point flows (step *s+1* starts when every flow of step
  *s* has arrived); a ``p2p`` phase is one step;
- a flow between GPUs of different servers is a real TCP connection from the
  source server's agent to the destination's, over the interface and
  addresses that :func:`emu.net.flow_endpoints` picks (the NICs of the
  simulator's route under the job's ``routing``), marked with the DSCP of the phase's
  priority (``IP_TOS``) and paced with ``SO_MAX_PACING_RATE`` when the phase
  has a ``rate_cap``; its end is the receiver's stamp of the last byte;
- a flow between GPUs of one server is *modelled*, not emulated: a timer of
  ``nbytes / bw * K`` where ``bw`` is the bottleneck of the intra-server path
  (:func:`topology.paths.gpu_path`); concurrent intra-server flows do not
  slow each other down in this backend.

Every measured time is divided by K, so the :class:`~emu.results.RunResult`
is in workload (real-fabric) seconds, comparable with the simulator's.

Fidelity: before and after the run the HTB tree of every port is checked and
a calibration flow is measured against the configured rate; a DSCP probe
(one small flow per priority, captured with scapy on the switch side of the
sender's veth) checks the marks on the wire; during the run /proc/stat must
show CPU headroom; after it, the tc class counters must hold each priority's
bytes in that priority's class. The report is stored in
``result.meta["fidelity"]`` (and ``fidelity.json`` in ``out_dir``); any failed
check raises :class:`~emu.net.FidelityError` after the report is written.
Compute phases are timers here; the torch.distributed jobs of
:mod:`emu.torchjob` (:func:`run_torch_job`) run real gloo collectives instead.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from topology import Topology
from topology.errors import InputError

from .htb import NUM_PRIORITIES, tos_for_priority
from .net import WIRE_OVERHEAD, CpuMonitor, EmulatedNetwork, EmulationError, FidelityError, NetworkPlan, flow_endpoints, plan_network
from .results import FlowRecord, JobResult, PhaseRecord, RunResult
from .sim import SimConfig, phase_flows
from .workload import ComputePhase, Job, Workload

log = logging.getLogger(__name__)

AGENT_PORT = 7000
PROBE_FLOW_BASE = 10**9  # flow ids of the DSCP probes (the executor numbers its flows from 1)
DEFAULT_CPU_LIMIT = 0.95
#: Niceness of agents, torch ranks and the controller during a run. The emulator's timing depends on its processes being
#: scheduled promptly (a starved receiver stalls its TCP flow); raising their priority keeps the emulation faithful while
#: other work shares the machine. Root may lower niceness; the driver's own niceness is restored after the run.
EMULATION_NICE = -10
#: Routing of jobs without their own ``routing``: the simulator's default, so both backends use the same NICs.
DEFAULT_ROUTING = SimConfig().routing


# -- control plane ----------------------------------------------------------------------------------------


class Controller:
    """The driver's end of the agents' control channel (a zmq ROUTER on an ipc:// endpoint)."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.agents: set[str] = set()

    def close(self) -> None:
        self.sock.close(linger=0)

    def send(self, agent: str, msg: dict[str, Any]) -> None:
        self.sock.send_multipart([agent.encode(), json.dumps(msg).encode()])

    def poll(self, timeout_s: float) -> list[dict[str, Any]]:
        """Messages that arrive within ``timeout_s`` (all that are queued, at least one unless the time runs out)."""
        out = []
        if self.sock.poll(max(0, int(timeout_s * 1000))):
            while True:
                try:
                    _ident, payload = self.sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                out.append(json.loads(payload))
        return out

    def wait_for(self, kind: str, agents: set[str], timeout_s: float) -> dict[str, dict[str, Any]]:
        got: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while set(got) < agents:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EmulationError(f"agents {sorted(agents - set(got))} sent no {kind!r} within {timeout_s:g} s")
            for msg in self.poll(left):
                if msg.get("type") == "error":
                    raise EmulationError(f"agent {msg.get('agent')}: {msg.get('error')}")
                if msg.get("type") == kind:
                    got[msg["agent"]] = msg
        return got


class AgentSet:
    """Start one agent per emulated host; stop them (politely, then by pid) on exit."""

    def __init__(self, net: EmulatedNetwork, port: int = AGENT_PORT):
        self.net = net
        self.port = port
        self.dir = net.workdir / "agents"  # inside the run's directory: removed with it, also after a SIGKILL (emu.runs)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.controller = Controller(f"ipc://{self.dir}/control")
        self.procs: dict[str, subprocess.Popen] = {}

    def __enter__(self) -> AgentSet:
        try:
            for name in self.net.plan.hosts:
                logf = open(self.dir / f"{name}.log", "w")  # noqa: SIM115 - the child owns it
                self.procs[name] = self.net.popen(
                    name, ["nice", "-n", str(EMULATION_NICE), sys.executable, "-m", "emu.agent", "--name", name,
                           "--control", self.controller.endpoint, "--port", str(self.port)],
                    stdout=logf, stderr=subprocess.STDOUT, cwd=str(Path(__file__).resolve().parent.parent),
                )
                logf.close()
            self.controller.wait_for("hello", set(self.procs), timeout_s=60)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def logs(self) -> dict[str, str]:
        return {p.stem: p.read_text()[-2000:] for p in self.dir.glob("*.log")}

    def stop(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is None:
                self.controller.send(name, {"type": "stop"})
        deadline = time.monotonic() + 5
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.controller.close()
        shutil.rmtree(self.dir, ignore_errors=True)


# -- the executor -----------------------------------------------------------------------------------------


@dataclass
class _Flow:
    id: int
    job: str
    iteration: int
    phase: str
    step: int
    src: str
    dst: str
    nbytes: float
    priority: int
    start: float = math.nan
    end: float = math.nan
    emulated: bool = True


@dataclass
class _PhaseRun:
    job: Job
    iteration: int
    index: int
    steps: list[list[tuple[str, str, float]]] = field(default_factory=list)
    step: int = -1
    pending: set[int] = field(default_factory=set)
    start: float = math.nan
    end: float = math.nan
    done: bool = False
    step_end: float = math.nan


class _Executor:
    """Walks the phase graphs of all jobs in real (dilated) time, driving the agents."""

    def __init__(self, topo: Topology, workload: Workload, plan: NetworkPlan, agents: AgentSet, *, timeout_s: float, byte_scale: float = 1.0,
                 monitor: FidelityMonitor | None = None, progress: Callable[[int, int], None] | None = None):
        self.topo, self.workload, self.plan, self.agents = topo, workload, plan, agents
        self.monitor = monitor
        self.progress = progress  # hears (phase instances done, total) whenever the count changes
        self.t0: float | None = None  # monotonic start of the workload, once it started
        # Emulated bytes are nbytes / byte_scale at rate / time_scale, so emulated time is workload time * K with
        # K = time_scale / byte_scale: compute phases, modelled flows and the conversion back all use K.
        self.byte_scale = byte_scale
        self.K = plan.time_scale / byte_scale
        self.timeout_s = timeout_s
        self.ids = itertools.count(1)
        self.flows: dict[int, _Flow] = {}
        self.runs: dict[tuple[str, int, int], _PhaseRun] = {}
        self.timers: list[tuple[float, str, Any]] = []  # (due, kind, payload)
        self.intra_bw: dict[tuple[str, str], float] = {}

    def _intra_seconds(self, src: str, dst: str, nbytes: float) -> float:
        key = (src, dst)
        if key not in self.intra_bw:
            from topology.paths import gpu_path

            self.intra_bw[key] = gpu_path(self.topo, src, dst).bw
        return nbytes / (self.intra_bw[key] * 1e9)

    # -- readiness
    def _ready(self, job: Job, i: int, p: int, now: float, t0: float) -> bool:
        if now < t0 + (job.arrival + job.start_offset) * self.K:
            return False
        within, previous = self._deps[job.name]
        if any(not self._done(job, i, q) for q in within[p]):
            return False
        return i == 0 or all(self._done(job, i - 1, q) for q in previous[p])

    def _ready_time(self, job: Job, i: int, p: int, t0: float) -> float:
        """When (phase i, p) became ready: its release or the last stamped end among its dependencies."""
        within, previous = self._deps[job.name]
        ends = [t0 + (job.arrival + job.start_offset) * self.K]
        ends += [self.runs[(job.name, i, q)].end for q in within[p]]
        if i > 0:
            ends += [self.runs[(job.name, i - 1, q)].end for q in previous[p]]
        return max(ends)

    def _done(self, job: Job, i: int, p: int) -> bool:
        r = self.runs.get((job.name, i, p))
        return r is not None and r.done

    # -- starting work
    def _start_phase(self, run: _PhaseRun, now: float, ready: float) -> None:
        phase = run.job.phases[run.index]
        run.start = now
        if isinstance(phase, ComputePhase):
            # A compute phase is a modelled delay: it starts when its dependencies were done (their stamps), not
            # when the controller noticed, so control-plane latency does not leak into compute time.
            run.start = min(now, ready)
            self.timers.append((run.start + phase.duration * self.K, "compute", run))
            return
        run.steps = phase_flows(self.topo, run.job, phase)
        self._next_step(run, now)

    def _next_step(self, run: _PhaseRun, now: float) -> None:
        run.step += 1
        while run.step < len(run.steps) and not run.steps[run.step]:
            run.step += 1
        if run.step >= len(run.steps):
            self._finish(run, run.step_end if not math.isnan(run.step_end) else now)
            return
        job, phase = run.job, run.job.phases[run.index]
        prio = job.phase_priority(phase)
        cap = job.phase_rate_cap(phase)
        run.step_end = math.nan
        for src, dst, nbytes in run.steps[run.step]:
            flow = _Flow(next(self.ids), job.name, run.iteration, phase.name, run.step, src, dst, nbytes, prio)
            self.flows[flow.id] = flow
            run.pending.add(flow.id)
            route = flow_endpoints(self.plan, self.topo, src, dst, job.routing or DEFAULT_ROUTING)
            if route is None or nbytes <= 0:
                flow.emulated = False
                flow.start = now
                seconds = 0.0 if nbytes <= 0 else self._intra_seconds(src, dst, nbytes)
                self.timers.append((now + seconds * self.K, "flow", flow))
                continue
            tx, src_ip, _rx, dst_ip = route
            order = {"type": "send", "flow": flow.id, "nbytes": max(1, int(round(nbytes / self.byte_scale))), "tos": tos_for_priority(prio),
                     "src_ip": src_ip, "dst_ip": dst_ip, "port": self.agents.port}
            if cap:
                order["pacing_bytes_per_s"] = int(cap * 1e9 / self.plan.time_scale * WIRE_OVERHEAD)
            self.agents.controller.send(tx.host, order)

    def _flow_done(self, flow: _Flow, end: float, now: float) -> None:
        flow.end = end
        run = self.runs[(flow.job, flow.iteration, self._phase_index[flow.job][flow.phase])]
        run.pending.discard(flow.id)
        run.step_end = end if math.isnan(run.step_end) else max(run.step_end, end)
        if not run.pending:
            self._next_step(run, now)

    def _finish(self, run: _PhaseRun, end: float) -> None:
        run.end = end
        run.done = True

    # -- the loop
    def run(self) -> tuple[float, float]:
        jobs = list(self.workload.jobs)
        self._deps = {j.name: j.dependencies() for j in jobs}
        self._phase_index = {j.name: j.phase_index() for j in jobs}
        self.t0 = t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        total = sum(j.iterations * len(j.phases) for j in jobs)
        finished = reported = 0
        if self.progress is not None:
            self.progress(0, total)
        while True:
            now = time.monotonic()
            # start every phase instance whose dependencies are met
            progress = True
            while progress:
                progress = False
                for job in jobs:
                    for i in range(job.iterations):
                        if i > 0 and not any(self._done(job, i - 1, q) for q in range(len(job.phases))):
                            break
                        for p in range(len(job.phases)):
                            key = (job.name, i, p)
                            if key not in self.runs and self._ready(job, i, p, now, t0):
                                self.runs[key] = run = _PhaseRun(job, i, p)
                                self._start_phase(run, now, self._ready_time(job, i, p, t0))
                                progress = True
            finished = sum(r.done for r in self.runs.values())
            if self.progress is not None and finished != reported:
                reported = finished
                self.progress(finished, total)
            if finished == total:
                return t0, time.monotonic()
            failure = self.monitor.failure if self.monitor is not None else None
            if failure is not None:
                raise FidelityError(f"emulation stopped after {now - t0:.1f} s of the {self.timeout_s:g} s allowed, because it can no longer "
                                    f"pass its fidelity checks: {failure}", {"stopped_early": failure, "problems": [failure], "ok": False})
            if now > deadline:
                raise EmulationError(f"workload {self.workload.name!r} did not finish within {self.timeout_s:g} s of emulated time "
                                     f"({finished}/{total} phase instances done); agent logs: {self.agents.logs()}")
            # next timer or release
            due = [t for t, _, _ in self.timers]
            due += [t0 + (j.arrival + j.start_offset) * self.K for j in jobs if (t0 + (j.arrival + j.start_offset) * self.K) > now]
            wait = max(0.0, min(due) - now) if due else 0.05
            for msg in self.agents.controller.poll(min(wait, 0.05)):
                kind = msg.get("type")
                if kind in ("recv_done", "send_done") and msg["flow"] not in self.flows:
                    continue  # a late report of a DSCP probe
                if kind == "recv_done":
                    self._flow_done(self.flows[msg["flow"]], msg["t_end"], time.monotonic())
                elif kind == "send_done":
                    self.flows[msg["flow"]].start = msg["t_start"]
                elif kind == "error":
                    raise EmulationError(f"agent {msg.get('agent')}: {msg.get('error')}")
            now = time.monotonic()
            fired = [t for t in self.timers if t[0] <= now]
            self.timers = [t for t in self.timers if t[0] > now]
            for due_t, kind, payload in sorted(fired, key=lambda t: t[0]):
                if kind == "compute":
                    self._finish(payload, due_t)
                else:
                    self._flow_done(payload, due_t, now)

    def result(self, t0: float) -> RunResult:
        """The measured result, in workload seconds; of a run that stopped early, what had finished.

        A job keeps its leading iterations whose every phase finished (an
        iteration's time needs the previous end), the phases that finished and
        the flows with both stamps (sent and arrived), nothing that was still running.
        """
        K = self.K

        def w(t: float) -> float:
            return (t - t0) / K

        jobs: dict[str, JobResult] = {}
        phases: list[PhaseRecord] = []
        for job in self.workload.jobs:
            ends = []
            for i in range(job.iterations):
                runs = [self.runs.get((job.name, i, p)) for p in range(len(job.phases))]
                done = [r for r in runs if r is not None and r.done]
                for r in done:
                    phases.append(PhaseRecord(job.name, i, job.phases[r.index].name, job.phases[r.index].kind, w(r.start), w(r.end)))
                if len(done) == len(runs) and len(ends) == i:
                    ends.append(max(w(r.end) for r in done))
            jobs[job.name] = JobResult(job.name, job.arrival, job.arrival + job.start_offset, ends)
        flows = [FlowRecord(f.job, f.iteration, f.phase, f.step, f.src, f.dst, f.nbytes, w(f.start), w(f.end))
                 for f in sorted(self.flows.values(), key=lambda f: f.id) if not (math.isnan(f.start) or math.isnan(f.end))]
        return RunResult("mininet", self.workload.name, self.topo.name, jobs, phases, flows, None, K)

    def expected_class_bytes(self) -> dict[int, float]:
        out = dict.fromkeys(range(NUM_PRIORITIES), 0.0)
        for f in self.flows.values():
            if f.emulated and f.nbytes > 0:
                out[f.priority] += max(1, round(f.nbytes / self.byte_scale))
        return out


# -- fidelity checks --------------------------------------------------------------------------------------


class FidelityMonitor:
    """Checks during the workload what the run must pass at its end and can already fail: every port's HTB tree.

    A run whose tree changed (a class throttled or its ceiling lowered by
    someone's ``tc``, a qdisc deleted) fails ``htb_after`` whatever happens
    next, and a throttled class may never finish its flows, so the executor
    stops the run as soon as this monitor reports a difference (:attr:`failure`,
    checked every loop) instead of waiting for the workload timeout. A thread
    re-checks every ``interval_s`` seconds, or every 10 times the check's own
    duration when that is longer, so that it costs at most ~10% of one core.
    """

    def __init__(self, net: EmulatedNetwork, interval_s: float = 1.0):
        self.net, self.interval_s = net, interval_s
        self.failure: str | None = None
        self.checks = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            t = time.monotonic()
            try:
                problems = self.net.verify_htb(raise_on_error=False)["problems"]
            except Exception as exc:  # an unreadable port is a broken port
                problems = [f"cannot read the qdisc trees: {exc}"]
            self.checks += 1
            if problems:
                self.failure = f"qdisc tree changed during the run: {'; '.join(problems[:4])}"
                return
            self.interval_s = max(self.interval_s, 10 * (time.monotonic() - t))

    def __enter__(self) -> FidelityMonitor:
        self._thread = threading.Thread(target=self._loop, name="fidelity-monitor", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def check_class_bytes(expected_payload: dict[int, float], host_egress: dict[int, int], *, slack_bytes: float = 2e6) -> dict[str, Any]:
    """Compare tc class counters (summed over host egress ports) with the payload each priority should have carried.

    A priority that carried ``B`` payload bytes must show between ``B`` and
    ``1.25 B + slack`` wire bytes in its class (frames add 4.6%, the reverse
    direction's ACKs ~2-3%); a priority that carried nothing may show only
    ``slack`` bytes (ARP, handshakes, the probes). Returns a report with
    ``problems``.

    >>> check_class_bytes({0: 1e7, 7: 0.0}, {0: 10_700_000, 7: 300})["problems"]
    []
    >>> check_class_bytes({0: 1e7, 7: 0.0}, {0: 0, 7: 10_700_300})["problems"][0]
    'priority 0: 0 bytes in its class, expected >= 10000000 (payload)'
    """
    problems = []
    rows = {}
    for p in sorted(set(expected_payload) | set(host_egress)):
        want, got = expected_payload.get(p, 0.0), host_egress.get(p, 0)
        rows[p] = {"payload_bytes": want, "class_bytes": got}
        if want > 0 and got < want:
            problems.append(f"priority {p}: {got} bytes in its class, expected >= {want:.0f} (payload)")
        elif got > 1.25 * want + slack_bytes:
            problems.append(f"priority {p}: {got} bytes in its class, expected <= {1.25 * want + slack_bytes:.0f}")
    return {"per_priority": rows, "problems": problems, "ok": not problems}


def dscp_probe(net: EmulatedNetwork, agents: AgentSet, priorities: Sequence[int] = tuple(range(NUM_PRIORITIES)), *,
               nbytes: int = 60_000) -> dict[str, Any]:
    """Send one small flow per priority from the first host to its neighbour, capture them with scapy, check the DSCP marks.

    The capture runs on the switch side of the sender's veth (root namespace),
    which carries exactly the frames the sender's interface emits.
    """
    from scapy.all import IP, TCP, AsyncSniffer, conf  # scapy is slow to import; only here

    conf.ifaces.reload()  # scapy caches interface indices; this run's veths are new

    plan = net.plan
    src = plan.interfaces[0]
    dst = next((i for i in plan.interfaces if i.switch == src.switch and i.host != src.host), None)
    if dst is None:
        return {"skipped": "fewer than two emulated hosts", "ok": True}
    port = agents.port

    def ours(pkt: Any) -> bool:
        return IP in pkt and TCP in pkt and pkt[TCP].dport == port and pkt[IP].src == src.ip

    last_tos = tos_for_priority(priorities[-1])

    def last_probe_closed(pkt: Any) -> bool:  # the sender's FIN of the last probe: everything before it was seen
        return ours(pkt) and bool(pkt[TCP].flags.F) and (pkt[IP].tos & 0xFC) == last_tos

    sniffer = AsyncSniffer(iface=src.switch_dev, lfilter=ours, store=True, stop_filter=last_probe_closed)
    sniffer.start()
    time.sleep(1.0)  # the capture socket is opened by the sniffer's thread
    try:
        for k, p in enumerate(priorities):
            fid = PROBE_FLOW_BASE + k
            agents.controller.send(src.host, {"type": "send", "flow": fid, "nbytes": nbytes, "tos": tos_for_priority(p),
                                              "src_ip": src.ip, "dst_ip": dst.ip, "port": port})
            deadline = time.monotonic() + 20
            while True:
                if time.monotonic() > deadline:
                    raise EmulationError(f"DSCP probe flow {fid} (priority {p}) did not arrive within 20 s")
                msgs = agents.controller.poll(0.5)
                for msg in msgs:
                    if msg.get("type") == "error":
                        raise EmulationError(f"agent {msg.get('agent')}: {msg.get('error')}")
                if any(m.get("type") == "recv_done" and m.get("flow") == fid for m in msgs):
                    break
    finally:
        # scapy decodes packets in Python and lags behind the wire on a busy machine: wait for the last FIN.
        sniffer.join(timeout=15)
        packets = (sniffer.stop() if sniffer.running else sniffer.results) or []
    by_conn: dict[int, list[int]] = {}
    for pkt in packets:
        by_conn.setdefault(pkt[TCP].sport, []).append(pkt[IP].tos)
    conns = list(by_conn.values())  # in order of first packet = order of the probes
    rows, problems = [], []
    for k, p in enumerate(priorities):
        toss = conns[k] if k < len(conns) else []
        want = tos_for_priority(p)
        wrong = sum(1 for t in toss if (t & 0xFC) != want)
        rows.append({"priority": p, "dscp": want >> 2, "packets": len(toss), "wrong": wrong})
        if not toss or wrong:
            problems.append(f"priority {p}: {len(toss)} packets captured, {wrong} without DSCP {want >> 2}")
    return {"interface": src.switch_dev, "probes": rows, "problems": problems, "ok": not problems}


@contextmanager
def _niceness(value: int) -> Iterator[None]:
    """Run the block at niceness ``value`` (this thread's process), then restore the old one."""
    old = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, value)
    except PermissionError:
        yield
        return
    try:
        yield
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, old)


# -- the entry point --------------------------------------------------------------------------------------


def run_mininet(topo: Topology, workload: Workload, *, time_scale: float, out_dir: str | os.PathLike[str] | None = None,
                nic_mode: str = "per-leaf", byte_scale: float = 1.0, calibrate_seconds: float = 1.0, calibration_tolerance: float = 0.10,
                cpu_limit: float = DEFAULT_CPU_LIMIT, probe_dscp: bool = True, timeout_s: float = 600.0, prefix: str | None = None,
                raise_on_fidelity: bool = True, monitor_s: float = 1.0, progress: Callable[[int, int], None] | None = None,
                result_file: str = "result-mininet.json", meta: dict[str, Any] | None = None) -> RunResult:
    """Run ``workload`` on an emulated ``topo`` scaled by ``time_scale`` (K) and return the measured :class:`RunResult`.

    Needs root and Mininet (raises :class:`~emu.net.EmulationError` otherwise);
    raises :class:`~emu.net.FidelityError` when a fidelity check fails (the
    report is in ``out_dir/fidelity.json`` and on the exception), or, with
    ``raise_on_fidelity=False``, returns the result anyway with the failed
    report in ``result.meta["fidelity"]`` (``ok`` false). ``timeout_s``
    bounds the emulated (wall-clock) run time; a :class:`FidelityMonitor`
    checks the qdisc trees every ``monitor_s`` seconds meanwhile and stops the
    run early, with the reason, when one changed. ``prefix`` names the
    emulated hosts, switches and interfaces (default: a fresh run id, see
    :func:`~emu.net.plan_network`), so that concurrent users of the machine do
    not collide. SIGTERM stops the run like Ctrl-C, with the same clean-up.

    ``byte_scale`` (M >= 1) additionally divides every emulated flow's bytes
    by M, so that workloads with realistic (GB) collectives finish in seconds:
    emulated time is then workload time * K/M, and compute phases and
    modelled flows are stretched by K/M. The result's ``time_scale`` is K/M.
    It keeps rates, hence queueing and fair sharing, exact, but shortens each
    flow in packets, so TCP slow start weighs M times more.

    The result is kept whatever happens once the workload started: with
    ``out_dir``, ``fidelity.json`` and ``result_file`` are written at the end
    of the run, and also when the run stops early (Ctrl-C, SIGTERM, a
    fidelity check that can no longer pass, an agent error, the timeout) —
    then the result holds the iterations that finished, ``meta["partial"]``
    is true and ``meta["verdict"]`` says why it stopped — before the
    exception goes on. ``meta`` is merged into the result's ``meta`` (the CLI
    records its byte-scale choice there); ``progress`` hears ``(phase
    instances done, total)`` while the workload runs (e.g.
    :func:`emu.sweep.eta_progress`). ``result.meta["verdict"]`` is
    :func:`fidelity_verdict` of the report.
    """
    if not byte_scale >= 1:
        raise InputError(f"byte_scale must be >= 1, got {byte_scale!r}", where="byte_scale")
    workload.validate(topo)
    if not workload.jobs:
        raise InputError("the workload has no jobs", where="jobs")
    plan = plan_network(topo, time_scale=time_scale, nic_mode=nic_mode, hosts=workload_hosts(topo, workload), prefix=prefix)
    out = Path(out_dir) if out_dir is not None else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    fidelity: dict[str, Any] = {"time_scale": time_scale, "byte_scale": byte_scale, "nic_mode": nic_mode, "cpu_limit": cpu_limit}
    failures: list[str] = []
    t_wall = time.monotonic()
    with EmulatedNetwork(plan) as net:
        fidelity["lock_wait_s"] = net.lock_wait_s  # waiting for another emulation to finish: part of wall_s, not of this run's work
        fidelity["htb_before"] = net.verify_htb()  # a broken tree is fatal before anything runs
        fidelity["calibration_before"] = net.calibrate(seconds=calibrate_seconds, tolerance=calibration_tolerance, raise_on_error=False)
        with AgentSet(net) as agents:
            net.set_phase("probe")  # agents are up (emu.runs: operators and tests read the phase)
            if probe_dscp:
                used = sorted({j.phase_priority(p) for j in workload.jobs for p in j.phases if not isinstance(p, ComputePhase)})
                fidelity["dscp"] = dscp_probe(net, agents, priorities=sorted(set(used) | {0, NUM_PRIORITIES - 1}))
                if not fidelity["dscp"]["ok"]:
                    failures += fidelity["dscp"]["problems"]
            counters_before = net.class_counters()
            net.set_phase("workload")
            executor = _Executor(topo, workload, plan, agents, timeout_s=timeout_s, byte_scale=byte_scale, progress=progress)
            cpu = CpuMonitor()
            try:
                with cpu, FidelityMonitor(net, monitor_s) as monitor, _niceness(EMULATION_NICE):
                    executor.monitor = monitor
                    t0, t1 = executor.run()
            except BaseException as exc:  # Ctrl-C, SIGTERM, stopped early, an agent error, the timeout: keep what finished
                if isinstance(exc, FidelityError):
                    fidelity.update(exc.report)  # what passed before, and why it stopped
                else:
                    reason = "interrupted (Ctrl-C or SIGTERM)" if isinstance(exc, KeyboardInterrupt) else f"{type(exc).__name__}: {exc}"[:2000]
                    fidelity.update(ok=False, stopped_early=reason, problems=[f"the run stopped early: {reason}"])
                fidelity["cpu"] = cpu.report()
                fidelity["wall_s"] = time.monotonic() - t_wall
                if out is not None:
                    _keep(out, result_file, fidelity, executor, plan, meta, partial=True)
                raise
            net.set_phase("checks")
            fidelity["monitor_checks"] = monitor.checks
            counters_after = net.class_counters()
        fidelity["cpu"] = cpu.report()
        busy = fidelity["cpu"]["busy_mean"]
        if busy is not None and busy > cpu_limit:
            failures.append(f"CPU busy {busy:.0%} on average during the run (limit {cpu_limit:.0%}): the emulator was saturated")
        host_devs = {i.dev for i in plan.interfaces}
        egress = dict.fromkeys(range(NUM_PRIORITIES), 0)
        for dev in host_devs:
            for p, c in counters_after.get(dev, {}).items():
                egress[p] += c["sent_bytes"] - counters_before.get(dev, {}).get(p, {}).get("sent_bytes", 0)
        fidelity["class_bytes"] = check_class_bytes(executor.expected_class_bytes(), egress)
        failures += fidelity["class_bytes"]["problems"]
        drops = sum(c["dropped"] for dev in counters_after.values() for c in dev.values())
        fidelity["drops"] = drops
        fidelity["htb_after"] = net.verify_htb(raise_on_error=False)
        fidelity["calibration_after"] = net.calibrate(seconds=calibrate_seconds, tolerance=calibration_tolerance, raise_on_error=False)
        for key in ("htb_after", "calibration_before", "calibration_after"):
            failures += fidelity[key].get("problems", [])
    fidelity["wall_s"] = time.monotonic() - t_wall
    fidelity["run_wall_s"] = t1 - t0
    fidelity["ok"] = not failures
    fidelity["problems"] = failures
    result = _keep(out, result_file, fidelity, executor, plan, meta, partial=False)
    if failures and raise_on_fidelity:
        raise FidelityError("emulation fidelity check failed: " + "; ".join(failures), fidelity)
    return result


def workload_hosts(topo: Topology, workload: Workload) -> list[str] | None:
    """The servers an emulation of ``workload`` builds (those holding its GPUs), or None for all when it uses one server."""
    hosts = sorted({topo.host_of(g) for g in workload.gpus()}, key=topo.hosts().index)
    return hosts if len(hosts) > 1 else None


def _keep(out: Path | None, result_file: str, fidelity: dict[str, Any], executor: _Executor, plan: NetworkPlan, meta: dict[str, Any] | None,
          *, partial: bool) -> RunResult:
    """The result of ``executor`` so far, with its fidelity report and verdict; written to ``out`` (with ``fidelity.json``) when given."""
    result = executor.result(executor.t0 if executor.t0 is not None else time.monotonic())
    result.meta = {**(meta or {}), "fidelity": fidelity, "verdict": fidelity_verdict(fidelity), "partial": partial, "plan": plan.to_dict(),
                   "emulated_flows": sum(f.emulated for f in executor.flows.values()),
                   "modelled_flows": sum(not f.emulated for f in executor.flows.values())}
    if out is not None:
        from topology.io import atomic_write_text

        atomic_write_text(out / "fidelity.json", json.dumps(fidelity, indent=1, default=str) + "\n")
        result.write(out / result_file)
    return result


def fidelity_verdict(fidelity: dict[str, Any]) -> dict[str, Any]:
    """A fidelity report (``result.meta["fidelity"]``) in brief: ``ok``, the checks that ``failed``, and the figures behind them.

    ``failed`` names checks: ``stopped`` (the run did not finish),
    ``cpu`` (busy on average above ``cpu_limit``), ``calibration_before`` /
    ``calibration_after`` (the iperf3 flow off its rate), ``dscp``,
    ``class_bytes``, ``htb_after``.

    >>> v = fidelity_verdict({"ok": False, "cpu_limit": 0.95, "cpu": {"busy_mean": 0.97}, "calibration_before": {"ok": True, "error": -0.02},
    ...                       "problems": ["CPU busy 97% on average during the run (limit 95%): the emulator was saturated"]})
    >>> v["ok"], v["failed"], v["cpu_busy_mean"], v["calibration_error_before"]
    (False, ['cpu'], 0.97, -0.02)
    """
    def part(key: str) -> dict[str, Any]:
        value = fidelity.get(key)
        return value if isinstance(value, dict) else {}

    busy = part("cpu").get("busy_mean")
    limit = fidelity.get("cpu_limit", DEFAULT_CPU_LIMIT)
    failed = ["stopped"] if fidelity.get("stopped_early") else []
    if busy is not None and busy > limit:
        failed.append("cpu")
    failed += [key for key in ("calibration_before", "calibration_after", "dscp", "class_bytes", "htb_after") if part(key).get("ok") is False]
    return {"ok": bool(fidelity.get("ok")) and not failed, "failed": failed, "problems": list(fidelity.get("problems", [])),
            "stopped_early": fidelity.get("stopped_early"), "cpu_busy_mean": busy, "cpu_busy_p90": part("cpu").get("busy_p90"), "cpu_limit": limit,
            "calibration_error_before": part("calibration_before").get("error"), "calibration_error_after": part("calibration_after").get("error"),
            "drops": fidelity.get("drops"), "wall_s": fidelity.get("wall_s"), "lock_wait_s": fidelity.get("lock_wait_s")}


# -- torch.distributed jobs -------------------------------------------------------------------------------


def stop_processes(procs: Sequence[subprocess.Popen]) -> None:
    """Kill and reap whichever of ``procs`` still run (only these processes, by their own handles)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def wait_for_ranks(procs: Sequence[subprocess.Popen], logs: Sequence[Path], timeout_s: float, *, what: str = "torch job") -> None:
    """Wait for every rank of a job started in emulated hosts; raise with the log of a failed or late rank."""
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise EmulationError(f"{what} did not finish within {timeout_s:g} s; rank 0 log: {logs[0].read_text()[-1500:]}") from None
    finally:
        stop_processes(procs)
    bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    if bad:
        raise EmulationError(f"{what}: ranks failed {bad}; rank {bad[0][0]} log: {logs[bad[0][0]].read_text()[-1500:]}")


def run_torch_job(topo: Topology, mode: str = "allreduce", *, time_scale: float, hosts: Sequence[str] | None = None, nbytes: float = 8e6,
                  iterations: int = 3, warmup: int = 1, width: int = 256, nic_mode: str = "per-leaf",
                  out_dir: str | os.PathLike[str] | None = None, calibrate_seconds: float = 1.0, calibration_tolerance: float = 0.10,
                  cpu_limit: float = DEFAULT_CPU_LIMIT, timeout_s: float = 300.0, master_port: int = 29500) -> dict[str, Any]:
    """Run a real torch.distributed (gloo) job, one rank per emulated server, and report its times.

    ``mode`` is ``allreduce`` (a benchmark of ``nbytes`` float32 all-reduces)
    or ``ddp`` (a small MLP trained with DistributedDataParallel). Ranks use
    each server's interface on the leaf that rank 0's first interface is
    cabled to (rail 0 on rail-optimized fabrics). The report holds emulated
    and workload-time (divided by K) iteration times; for ``allreduce`` also
    the bandwidth-optimal bound ``2(n-1)/n * S / B`` (B = the slowest ring
    link's payload rate) and the bus bandwidth in real-fabric GB/s. Fidelity
    checks as in :func:`run_mininet` (no DSCP probe: gloo does not mark).
    """
    if mode not in ("allreduce", "ddp"):
        raise InputError(f"mode must be 'allreduce' or 'ddp', got {mode!r}", where="mode")
    if iterations < 1 or warmup < 0:
        raise InputError(f"iterations must be >= 1 and warmup >= 0, got {iterations}, {warmup}", where="iterations")
    plan = plan_network(topo, time_scale=time_scale, nic_mode=nic_mode, hosts=list(hosts) if hosts else None)
    names = list(plan.hosts)
    if len(names) < 2:
        raise InputError("a torch.distributed job needs at least two emulated servers", where="hosts")
    switch = plan.interfaces_of(names[0])[0].switch
    ifaces = [plan.interface(h, switch) for h in names]
    n = len(names)
    out = Path(out_dir) if out_dir is not None else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    fidelity: dict[str, Any] = {"time_scale": time_scale, "nic_mode": nic_mode, "cpu_limit": cpu_limit}
    failures: list[str] = []
    with EmulatedNetwork(plan) as net:
        fidelity["htb_before"] = net.verify_htb()
        fidelity["calibration_before"] = net.calibrate(seconds=calibrate_seconds, tolerance=calibration_tolerance, raise_on_error=False)
        report_path = net.workdir / "torch-report.json"
        procs, logs = [], []
        try:
            with CpuMonitor() as cpu:
                for rank, (h, iface) in enumerate(zip(names, ifaces, strict=True)):
                    logf = open(net.workdir / f"rank{rank}.log", "w")  # noqa: SIM115 - the child owns it
                    logs.append(net.workdir / f"rank{rank}.log")
                    args = ["nice", "-n", str(EMULATION_NICE), sys.executable, "-m", "emu.torchjob", mode, "--rank", str(rank), "--world", str(n),
                            "--master-addr", ifaces[0].ip,
                            "--master-port", str(master_port), "--ifname", iface.dev, "--bytes", str(nbytes), "--width", str(width),
                            "--iters", str(iterations), "--warmup", str(warmup), "--timeout", str(timeout_s), "--out", str(report_path)]
                    procs.append(net.popen(h, args, stdout=logf, stderr=subprocess.STDOUT, cwd=str(Path(__file__).resolve().parent.parent)))
                    logf.close()
                wait_for_ranks(procs, logs, timeout_s, what="torch job")
        finally:
            stop_processes(procs)
        report = json.loads(report_path.read_text())
        fidelity["htb_after"] = net.verify_htb(raise_on_error=False)
        fidelity["calibration_after"] = net.calibrate(seconds=calibrate_seconds, tolerance=calibration_tolerance, raise_on_error=False)
    fidelity["cpu"] = cpu.report(window=tuple(report["window"]))  # the timed iterations, not torch's start-up
    busy = fidelity["cpu"]["busy_mean"]
    if busy is not None and busy > cpu_limit:
        failures.append(f"CPU busy {busy:.0%} on average during the run (limit {cpu_limit:.0%}): the emulator was saturated")
    for key in ("htb_after", "calibration_before", "calibration_after"):
        failures += fidelity[key].get("problems", [])
    K = plan.time_scale
    link_mbit = min(min(i.rate_mbit, i.rate_down_mbit) for i in ifaces)
    link_bytes_per_s = link_mbit * 1e6 / 8
    emulated = list(report["iteration_s"])
    result: dict[str, Any] = {
        "mode": mode, "world": n, "hosts": [plan.hosts[h] for h in names], "interfaces": [i.dev for i in ifaces], "time_scale": K,
        "link_mbit_emulated": link_mbit, "link_gbs": link_bytes_per_s * K / 1e9, "iteration_s_emulated": emulated,
        "iteration_s": [t / K for t in emulated], "report": report, "fidelity": fidelity,
    }
    if mode == "allreduce":
        factor = 2 * (n - 1) / n
        bound = factor * report["bytes"] / link_bytes_per_s
        mean = sum(emulated) / len(emulated)
        result.update({"bytes": report["bytes"], "bound_s_emulated": bound, "bound_s": bound / K, "ratio_to_bound": mean / bound,
                       "busbw_gbs": factor * report["bytes"] / (mean / K) / 1e9, "correct": report["correct"]})
    fidelity["ok"] = not failures
    fidelity["problems"] = failures
    if out is not None:
        from topology.io import atomic_write_text

        atomic_write_text(out / f"torch-{mode}.json", json.dumps(result, indent=1, default=str) + "\n")
    if failures:
        raise FidelityError("emulation fidelity check failed: " + "; ".join(failures), fidelity)
    return result
