"""The ns-3 backend: a workload simulated packet by packet with TCP on the topology's links (``emu run --backend ns3``).

It takes the same workload file and topology as the flow simulator (:mod:`emu.sim`)
and the Mininet emulator, walks every job's phase graph the same way, and returns
the same :class:`~emu.results.RunResult`, in workload seconds (no time scale:
ns-3 runs the fabric's real rates in simulated time).

The network (built by :func:`run_ns3` from the ``ns3`` wheel on PyPI, ``from ns import ns``):

- one ns-3 node per topology node that some flow crosses (GPUs, NICs, NVSwitches,
  leaves, spines) and one point-to-point link per topology link those flows use,
  at the link's rate (GB/s x 8e9 bit/s; the ``u -> v`` direction's rate for both)
  and its ``latency_us`` as propagation delay (``min_latency_us`` when the topology says 0);
- **routes as the topology routes**: every flow is split as
  :func:`topology.routing.flow_paths` splits it (an ECMP split gives one TCP
  connection per path, carrying that path's fraction of the bytes) and each
  connection is pinned to its path: the destination holds one /32 address per
  path and every hop has a host route for it (ns-3 static routing); ACKs come back
  by ns-3 global routing;
- **priority queues for the HTB classes**: the root queue discipline of every
  device is a ``PrioQueueDisc`` with 9 FIFO bands (``queue_packets`` each), served
  in strict priority like HTB's ``prio`` between classes whose 1 % guarantees are
  negligible: band 0 for pure TCP ACKs (the Mininet backend's control leaf), band
  1 + p for workload priority p, read by a packet filter (``nwns3::DscpBandFilter``,
  C++ compiled at import) from the DSCP the sender sets, CS(7-p) as in Mininet;
- TCP (``tcp``: ns-3's ``TcpCubic`` by default, or ``TcpNewReno``, ``TcpDctcp``
  with ECN off...) over 9000-byte jumbo frames (8948-byte segments), an ACK per two
  segments, 8 MiB socket buffers, an initial window of 10 and ``min_rto_ms`` (5 ms)
  as the minimum RTO. The ``ns3`` wheel has no RDMA
  model, so there is no DCQCN nor PFC: a full band drops (tail drop) and TCP recovers.

Compute phases are delays; communication phases are split into steps with
:func:`emu.sim.phase_flows` (step *s+1* starts when every flow of step *s* has
arrived, its end the last byte's arrival at the receiver). The driver lives in
this process: ns-3 runs until a flow completes or a timer is due, Python starts
whatever became ready, and ns-3 runs on.

Differences from the flow simulator that are the point of running it: slow start
and ACK clocking (short flows take longer than bytes / rate), queueing delay,
tail drops and retransmission timeouts under incast, per-packet store-and-forward
(one packet's serialisation per hop), ACKs sharing the reverse direction with data,
and IP/TCP header overhead (8948 payload bytes per 9002 on the wire: goodput 0.6 %
below the link rate; :data:`PACKET_OVERHEAD`). Rate caps are not enforced here
(the run refuses a workload that sets them).
"""

from __future__ import annotations

import heapq
import importlib.util
import itertools
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from topology import Topology
from topology.errors import InputError
from topology.routing import flow_paths

from .mininet_backend import _PhaseRun as _Phase  # the same walk of a phase instance, in simulated time
from .results import FlowRecord, JobResult, PhaseRecord, RunResult
from .sim import phase_flows
from .workload import ComputePhase, Job, Workload

TCP_VARIANTS = ("TcpCubic", "TcpNewReno", "TcpDctcp", "TcpBic", "TcpHighSpeed", "TcpVegas")
TIME_RESOLUTION_S = 1e-9  # ns-3's clock ticks in nanoseconds: a timer due within one tick is due now
MTU = 9000  # jumbo frames, as data-centre fabrics for training run (RoCE uses 4096)
SEGMENT_BYTES = MTU - 52  # IPv4 20 + TCP 20 + timestamps 12
PACKET_OVERHEAD = (MTU + 2) / SEGMENT_BYTES  # and 2 bytes of PPP framing on the wire


# Bands of every port's PrioQueueDisc, served in strict order: 0 for pure ACKs, 1 + p for workload priority p. A packet
# filter (DscpBandFilter) classifies every packet; the priomap only catches what it cannot (non-IPv4), into the last band.
BANDS = 9
PRIOMAP = " ".join(["8"] * 16)


def band_of_priority(priority: int) -> int:
    """The strict-priority band (0 first) of data of workload priority 0..7 (band 0 carries pure ACKs).

    >>> [band_of_priority(p) for p in range(8)]
    [1, 2, 3, 4, 5, 6, 7, 8]
    """
    return 1 + priority


class Ns3Error(InputError):
    """The ns-3 backend cannot run here or was given options it does not take."""


@dataclass(frozen=True)
class Ns3Options:
    """Settings of the packet-level run; :func:`check_options` says what is wrong with a bad one."""

    tcp: str = "TcpCubic"
    routing: str = "ecmp"
    queue_packets: int = 1000
    min_rto_ms: float = 5.0
    min_latency_us: float = 1.0
    timeout_s: float = 3600.0  # simulated seconds before the run is declared stuck


def check_options(options: Ns3Options) -> None:
    """Raise :class:`Ns3Error` naming the first bad field.

    >>> check_options(Ns3Options(tcp="TcpReno"))
    Traceback (most recent call last):
    ...
    emu.ns3_backend.Ns3Error: --ns3-tcp: expected one of TcpCubic, TcpNewReno, TcpDctcp, TcpBic, TcpHighSpeed, TcpVegas, got 'TcpReno'
    """
    if options.tcp not in TCP_VARIANTS:
        raise Ns3Error(f"expected one of {', '.join(TCP_VARIANTS)}, got {options.tcp!r}", where="--ns3-tcp")
    if options.routing not in ("shortest", "ecmp", "rail"):
        raise Ns3Error(f"expected shortest, ecmp or rail, got {options.routing!r}", where="--routing")
    if not isinstance(options.queue_packets, int) or options.queue_packets < 2:
        raise Ns3Error(f"expected an integer >= 2, got {options.queue_packets!r}", where="--ns3-queue")
    for name, value in (("--ns3-min-rto-ms", options.min_rto_ms), ("min_latency_us", options.min_latency_us), ("timeout_s", options.timeout_s)):
        if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
            raise Ns3Error(f"expected a positive number, got {value!r}", where=name)


def import_ns3() -> Any:
    """``ns`` from the ``ns3`` package (imported once; slow: its C++ headers are parsed at import)."""
    if importlib.util.find_spec("ns") is None:
        raise Ns3Error("the ns-3 backend needs the 'ns3' package (pip install 'netweave[ns3]', ns3==3.44.post0); use --backend sim")
    try:
        from ns import ns
    except Exception as exc:  # cppyy raises many kinds when the wheel does not fit this machine
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise Ns3Error(f"the 'ns3' package is installed but does not load here: {first}") from None
    _define_helpers(ns)
    return ns


_HELPERS = r"""
#include "ns3/core-module.h"
#include "ns3/network-module.h"
#include "ns3/internet-module.h"
#include "ns3/traffic-control-module.h"
#include <map>
#include <vector>

namespace nwns3 {
using namespace ns3;

// Band 0 for pure TCP ACKs (they must not queue behind data on a busy reverse path); band 1 + p for data of workload
// priority p, which travels as DSCP CS(7-p) (ToS (7-p) << 5), as in the Mininet backend.
class DscpBandFilter : public Ipv4PacketFilter {
public:
  static TypeId GetTypeId() {
    static TypeId tid = TypeId("nwns3::DscpBandFilter").SetParent<Ipv4PacketFilter>().SetGroupName("netweave").AddConstructor<DscpBandFilter>();
    return tid;
  }
private:
  bool CheckProtocol(Ptr<QueueDiscItem> item) const override { return DynamicCast<Ipv4QueueDiscItem>(item) != nullptr; }
  int32_t DoClassify(Ptr<QueueDiscItem> item) const override {
    Ptr<Ipv4QueueDiscItem> ip = DynamicCast<Ipv4QueueDiscItem>(item);
    const Ipv4Header& h = ip->GetHeader();
    if (h.GetProtocol() == 6) {
      TcpHeader t;
      Ptr<Packet> p = ip->GetPacket();
      p->PeekHeader(t);
      if (p->GetSize() <= t.GetSerializedSize()) return 0;
    }
    return 1 + (7 - (h.GetTos() >> 5));
  }
};

struct Flow { uint64_t id; uint64_t bytes; uint64_t sent = 0; uint64_t rcvd = 0; bool done = false; };

class Driver {
public:
  std::vector<uint64_t> doneIds;
  std::vector<double> doneTimes;
  uint64_t completed = 0;

  // Scheduled, not done at once: a socket must not send before the simulation has initialised the nodes.
  void Start(uint64_t id, Ptr<Node> src, Ptr<Node> dst, Ipv4Address dstAddr, uint16_t port, uint64_t bytes, uint8_t tos) {
    Simulator::ScheduleNow(&Driver::DoStart, this, id, src, dst, dstAddr, port, bytes, tos);
  }
  void Take() { doneIds.clear(); doneTimes.clear(); }

private:
  void DoStart(uint64_t id, Ptr<Node> src, Ptr<Node> dst, Ipv4Address dstAddr, uint16_t port, uint64_t bytes, uint8_t tos) {
    Flow* f = new Flow(); f->id = id; f->bytes = bytes;
    Ptr<Socket> listener = Socket::CreateSocket(dst, TcpSocketFactory::GetTypeId());
    listener->Bind(InetSocketAddress(Ipv4Address::GetAny(), port));
    listener->Listen();
    listener->SetAcceptCallback(MakeNullCallback<bool, Ptr<Socket>, const Address&>(), MakeCallback(&Driver::Accepted, this));
    m_byListener[PeekPointer(listener)] = f;
    m_listenerOfPort[std::make_pair(dst->GetId(), port)] = f;
    Ptr<Socket> tx = Socket::CreateSocket(src, TcpSocketFactory::GetTypeId());
    tx->Bind();
    tx->SetIpTos(tos);
    m_bySender[PeekPointer(tx)] = f;
    tx->SetConnectCallback(MakeCallback(&Driver::Connected, this), MakeCallback(&Driver::Failed, this));
    tx->SetSendCallback(MakeCallback(&Driver::Fill, this));
    tx->Connect(InetSocketAddress(dstAddr, port));
    m_keep.push_back(listener); m_keep.push_back(tx);
  }
  std::map<Socket*, Flow*> m_byListener, m_bySender, m_byReceiver;
  std::map<std::pair<uint32_t, uint16_t>, Flow*> m_listenerOfPort;
  std::vector<Ptr<Socket>> m_keep;

  void Connected(Ptr<Socket> s) { Fill(s, s->GetTxAvailable()); }
  void Failed(Ptr<Socket> s) { NS_FATAL_ERROR("netweave ns-3 flow could not connect"); }
  void Fill(Ptr<Socket> s, uint32_t) {
    Flow* f = m_bySender[PeekPointer(s)];
    while (f->sent < f->bytes) {
      uint32_t room = s->GetTxAvailable();
      if (room == 0) return;
      uint64_t n = std::min<uint64_t>(std::min<uint64_t>(room, f->bytes - f->sent), 65536);
      int r = s->Send(Create<Packet>(n));
      if (r <= 0) return;
      f->sent += r;
    }
    s->SetSendCallback(MakeNullCallback<void, Ptr<Socket>, uint32_t>());
    s->Close();
  }
  void Accepted(Ptr<Socket> s, const Address&) {
    Address local; s->GetSockName(local);
    uint16_t port = InetSocketAddress::ConvertFrom(local).GetPort();
    m_byReceiver[PeekPointer(s)] = m_listenerOfPort[std::make_pair(s->GetNode()->GetId(), port)];
    s->SetRecvCallback(MakeCallback(&Driver::Received, this));
    m_keep.push_back(s);
  }
  void Received(Ptr<Socket> s) {
    Flow* f = m_byReceiver[PeekPointer(s)];
    Ptr<Packet> p;
    while ((p = s->Recv())) f->rcvd += p->GetSize();
    if (!f->done && f->rcvd >= f->bytes) {
      f->done = true; completed++;
      doneIds.push_back(f->id); doneTimes.push_back(Simulator::Now().GetSeconds());
      Simulator::Stop();
    }
  }
};
}  // namespace nwns3
"""


def _define_helpers(ns: Any) -> None:
    import cppyy

    if not hasattr(cppyy.gbl, "nwns3"):
        cppyy.cppdef(_HELPERS)
        cppyy.gbl.nwns3.DscpBandFilter.GetTypeId()  # registers the TypeId, so that TrafficControlHelper finds it by name


# -- the network ------------------------------------------------------------------------------------


@dataclass
class _Net:
    ns: Any
    nodes: dict[str, Any]
    # (u, v) -> (device index at u, address of v on that link)
    hop: dict[tuple[str, str], tuple[int, str]]
    alias: dict[tuple[str, ...], str] = field(default_factory=dict)


def _ip(i: int, base: int) -> str:
    return f"{base + (i >> 16)}.{(i >> 8) & 255}.{i & 255}"


def _build_network(ns: Any, topo: Topology, paths: Iterable[tuple[str, ...]], options: Ns3Options) -> _Net:
    paths = list(dict.fromkeys(paths))
    names = sorted({n for p in paths for n in p})
    edges = sorted({tuple(sorted((a, b))) for p in paths for a, b in itertools.pairwise(p)})
    ns.Config.SetDefault("ns3::TcpL4Protocol::SocketType", ns.StringValue(f"ns3::{options.tcp}"))
    ns.Config.SetDefault("ns3::TcpSocket::SegmentSize", ns.UintegerValue(SEGMENT_BYTES))
    ns.Config.SetDefault("ns3::TcpSocket::SndBufSize", ns.UintegerValue(8 << 20))
    ns.Config.SetDefault("ns3::TcpSocket::RcvBufSize", ns.UintegerValue(8 << 20))
    ns.Config.SetDefault("ns3::TcpSocket::InitialCwnd", ns.UintegerValue(10))
    ns.Config.SetDefault("ns3::TcpSocket::DelAckCount", ns.UintegerValue(2))
    ns.Config.SetDefault("ns3::TcpSocketBase::MinRto", ns.TimeValue(ns.Seconds(options.min_rto_ms / 1e3)))
    ns.Config.SetDefault("ns3::TcpSocketBase::ClockGranularity", ns.TimeValue(ns.MicroSeconds(10)))
    ns.Config.SetDefault("ns3::TcpSocketBase::UseEcn", ns.StringValue("Off"))
    nodes: dict[str, Any] = {}
    container = ns.NodeContainer()
    container.Create(len(names))
    for i, n in enumerate(names):
        nodes[n] = container.Get(i)
    stack = ns.InternetStackHelper()
    stack.Install(container)
    tch = ns.TrafficControlHelper()
    handle = tch.SetRootQueueDisc("ns3::PrioQueueDisc", "Priomap", ns.StringValue(PRIOMAP))
    classes = tch.AddQueueDiscClasses(handle, BANDS, "ns3::QueueDiscClass")
    for band in range(BANDS):
        tch.AddChildQueueDisc(handle, classes[band], "ns3::FifoQueueDisc", "MaxSize", ns.QueueSizeValue(ns.QueueSize(f"{options.queue_packets}p")))
    tch.AddPacketFilter(handle, "nwns3::DscpBandFilter")
    hop: dict[tuple[str, str], tuple[int, str]] = {}
    g = topo.graph
    for i, (a, b) in enumerate(edges):
        data = min(g[a][b].values(), key=lambda d: -d["bw"])
        p2p = ns.PointToPointHelper()
        p2p.SetDeviceAttribute("Mtu", ns.UintegerValue(MTU))
        p2p.SetDeviceAttribute("DataRate", ns.DataRateValue(ns.DataRate(int(round(data["bw"] * 8e9)))))
        delay_us = max(float(data.get("latency_us", 0.0)), options.min_latency_us)
        p2p.SetChannelAttribute("Delay", ns.TimeValue(ns.NanoSeconds(int(round(delay_us * 1e3)))))
        p2p.SetQueue("ns3::DropTailQueue", "MaxSize", ns.QueueSizeValue(ns.QueueSize("1p")))
        devices = p2p.Install(nodes[a], nodes[b])
        tch.Install(devices)
        address = ns.Ipv4AddressHelper()
        address.SetBase(ns.Ipv4Address(f"{_ip(i, 10)}.0"), ns.Ipv4Mask("255.255.255.0"))
        ifaces = address.Assign(devices)
        hop[(a, b)] = (int(ifaces.Get(0).second), str(ifaces.GetAddress(1)))
        hop[(b, a)] = (int(ifaces.Get(1).second), str(ifaces.GetAddress(0)))
    net = _Net(ns, nodes, hop)
    static = ns.Ipv4StaticRoutingHelper()
    for k, path in enumerate(paths):  # one /32 per path at its destination, a host route for it at every hop
        alias = f"{_ip(k, 100)}.1"
        dst = path[-1]
        ipv4 = nodes[dst].GetObject[ns.Ipv4]()
        ipv4.AddAddress(hop[(dst, path[-2])][0], ns.Ipv4InterfaceAddress(ns.Ipv4Address(alias), ns.Ipv4Mask("255.255.255.255")))
        for a, b in itertools.pairwise(path):
            iface, next_ip = hop[(a, b)]
            static.GetStaticRouting(nodes[a].GetObject[ns.Ipv4]()).AddHostRouteTo(ns.Ipv4Address(alias), ns.Ipv4Address(next_ip), iface)
        net.alias[path] = alias
    ns.Ipv4GlobalRoutingHelper.PopulateRoutingTables()
    return net


# -- the driver ---------------------------------------------------------------------------------------


def _node_path(edges: list[tuple[str, str, Any]]) -> tuple[str, ...]:
    return (edges[0][0], *(v for _, v, _ in edges))


def run_ns3(topo: Topology, workload: Workload, options: Ns3Options | None = None) -> RunResult:
    """Simulate ``workload`` on ``topo`` packet by packet in ns-3; see the module docstring for the model.

    Raises :class:`Ns3Error` (one line) when the package is missing, an option is bad,
    or the workload asks for what this backend does not model (rate caps).
    """
    options = options or Ns3Options()
    check_options(options)
    for job in workload.jobs:
        for phase in job.phases:
            if not isinstance(phase, ComputePhase) and job.phase_rate_cap(phase):
                raise Ns3Error(f"job {job.name!r} phase {phase.name!r}: rate caps are not modelled by the ns-3 backend; use --backend sim or mininet")
    ns = import_ns3()
    wall0 = time.perf_counter()
    # Every flow's paths are known before the run (routes do not depend on time): build exactly what they cross.
    split: dict[tuple[str, str], list[tuple[float, tuple[str, ...]]]] = {}
    for job in workload.jobs:
        policy = job.routing or options.routing
        for phase in job.phases:
            if isinstance(phase, ComputePhase):
                continue
            for step in phase_flows(topo, job, phase):
                for src, dst, _ in step:
                    if (src, dst, policy) not in split and src != dst:
                        split[(src, dst, policy)] = [(f, _node_path(p)) for f, p in flow_paths(topo, src, dst, policy) if p]
    net = _build_network(ns, topo, (p for ps in split.values() for _, p in ps), options)
    import cppyy

    driver = cppyy.gbl.nwns3.Driver()
    ports: dict[str, int] = {}
    ids = itertools.count(1)
    flows: dict[int, list[Any]] = {}  # id -> [phase run, src, dst, nbytes, start, end, connections left]
    conn_of: dict[int, int] = {}  # connection id -> flow id
    runs: dict[tuple[str, int, int], _Phase] = {}
    timers: list[tuple[float, int, str, Any]] = []
    seq = itertools.count()
    deps = {j.name: j.dependencies() for j in workload.jobs}
    now = 0.0

    def release(job: Job) -> float:
        return job.arrival + job.start_offset

    def ready_time(job: Job, i: int, p: int) -> float | None:
        within, previous = deps[job.name]
        ends = [release(job)]
        for key in [(job.name, i, q) for q in within[p]] + ([(job.name, i - 1, q) for q in previous[p]] if i > 0 else []):
            r = runs.get(key)
            if r is None or not r.done:
                return None
            ends.append(r.end)
        return max(ends)

    def finish(run: _Phase, end: float) -> None:
        run.end, run.done = end, True

    def next_step(run: _Phase, t: float) -> None:
        run.step += 1
        while run.step < len(run.steps) and not run.steps[run.step]:
            run.step += 1
        if run.step >= len(run.steps):
            finish(run, t)
            return
        job, phase = run.job, run.job.phases[run.index]
        tos = (7 - job.phase_priority(phase)) << 5  # DSCP CS(7-p)
        policy = job.routing or options.routing
        for src, dst, nbytes in run.steps[run.step]:
            fid = next(ids)
            run.pending.add(fid)
            parts = split.get((src, dst, policy), [])
            flows[fid] = [run, src, dst, nbytes, t, math.nan, 0, run.step]
            if nbytes <= 0 or not parts:
                heapq.heappush(timers, (t, next(seq), "flow", fid))
                continue
            for frac, path in parts:
                cbytes = max(1, int(round(nbytes * frac)))
                cid = next(ids)
                conn_of[cid] = fid
                flows[fid][6] += 1
                dst_node = path[-1]
                ports[dst_node] = port = ports.get(dst_node, 999) + 1
                if port > 65535:
                    raise Ns3Error(f"more than 64,535 connections end at {dst_node!r}; run fewer iterations")
                driver.Start(cid, net.nodes[path[0]], net.nodes[dst_node], ns.Ipv4Address(net.alias[path]), port, cbytes, tos)

    def flow_done(fid: int, t: float) -> None:
        rec = flows[fid]
        rec[5] = t
        run = rec[0]
        run.pending.discard(fid)
        if not run.pending:
            next_step(run, t)

    total = sum(j.iterations * len(j.phases) for j in workload.jobs)
    while True:
        progress = True
        while progress:  # start every phase instance whose dependencies are met
            progress = False
            for job in workload.jobs:
                for i in range(job.iterations):
                    if i > 0 and not any(runs.get((job.name, i - 1, q)) is not None for q in range(len(job.phases))):
                        break
                    for p in range(len(job.phases)):
                        key = (job.name, i, p)
                        if key in runs:
                            continue
                        ready = ready_time(job, i, p)
                        if ready is None or ready > now + TIME_RESOLUTION_S:
                            continue
                        runs[key] = run = _Phase(job, i, p)
                        phase = job.phases[p]
                        progress = True
                        if isinstance(phase, ComputePhase):
                            run.start = ready
                            heapq.heappush(timers, (ready + phase.duration, next(seq), "compute", run))
                        else:
                            run.start = now
                            run.steps = phase_flows(topo, job, phase)
                            next_step(run, now)
        if sum(r.done for r in runs.values()) == total:
            break
        candidates = [release(j) for j in workload.jobs if release(j) > now + TIME_RESOLUTION_S] + ([timers[0][0]] if timers else [])
        due = min(candidates) if candidates else None
        if timers and timers[0][0] <= now + TIME_RESOLUTION_S:
            _, _, kind, payload = heapq.heappop(timers)
            if kind == "compute":
                finish(payload, due)
            else:
                flow_done(payload, due)
            continue
        if due is None and not conn_of:
            raise Ns3Error(f"workload {workload.name!r}: nothing left to run but {total - sum(r.done for r in runs.values())} phases are not done")
        stop_at = due if due is not None else options.timeout_s
        if stop_at > options.timeout_s:
            raise Ns3Error(f"workload {workload.name!r} did not finish within {options.timeout_s:g} simulated seconds")
        stop = ns.Simulator.Stop(ns.NanoSeconds(max(1, math.ceil((stop_at - now) * 1e9))))
        ns.Simulator.Run()
        if stop is not None:  # a flow completed first: cancel this round's stop, or it would end a later round early
            ns.Simulator.Cancel(stop)
        now = ns.Simulator.Now().GetSeconds()
        finished = list(zip(list(driver.doneIds), list(driver.doneTimes), strict=True))
        driver.Take()
        for cid, t in finished:
            fid = conn_of.pop(int(cid))
            flows[fid][6] -= 1
            if flows[fid][6] == 0:
                flow_done(fid, float(t))
        # Run() returned with no flow finished and nothing due: ns-3 ran out of events (or time) with connections open.
        if not finished and due is None:
            raise Ns3Error(f"workload {workload.name!r} did not finish within {options.timeout_s:g} simulated seconds "
                           f"({len(conn_of)} TCP connections still open at {now:.6g} s)")
    events = int(ns.Simulator.GetEventCount()) if hasattr(ns.Simulator, "GetEventCount") else None
    ns.Simulator.Destroy()
    jobs: dict[str, JobResult] = {}
    phases: list[PhaseRecord] = []
    for job in workload.jobs:
        ends = []
        for i in range(job.iterations):
            rs = [runs[(job.name, i, p)] for p in range(len(job.phases))]
            ends.append(max(r.end for r in rs))
            phases += [PhaseRecord(job.name, i, job.phases[r.index].name, job.phases[r.index].kind, r.start, r.end) for r in rs]
        jobs[job.name] = JobResult(job.name, job.arrival, release(job), ends)
    records = [FlowRecord(r[0].job.name, r[0].iteration, r[0].job.phases[r[0].index].name, r[7], r[1], r[2], r[3], r[4], r[5])
               for _, r in sorted(flows.items())]
    meta = {"tcp": options.tcp, "routing": options.routing, "queue_packets": options.queue_packets, "min_rto_ms": options.min_rto_ms,
            "nodes": len(net.nodes), "links": len(net.hop) // 2, "paths": len(net.alias), "events": events, "wall_s": time.perf_counter() - wall0}
    return RunResult("ns3", workload.name, topo.name, jobs, phases, records, None, 1.0, meta)


__all__ = ["PACKET_OVERHEAD", "TCP_VARIANTS", "Ns3Error", "Ns3Options", "check_options", "import_ns3", "run_ns3"]
