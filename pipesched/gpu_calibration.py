"""GPU prediction of a pipeline whose ranks share one GPU: a calibration measured on the device, and the contention model.

Why a plain profile predicts too low (issue #25): the profile times each layer in one process alone on the GPU
(under MPS, with the same share of the SMs), but inside the pipelined run every action meets the other ranks'
kernels (MPS divides the SMs, not the memory bandwidth or the L2; time-slicing divides the whole GPU), the
NCCL kernels of its own and the other ranks' pending sends and receives, and one synchronised launch per action
rather than per layer. :func:`calibrate_gpu` measures each of these on the device, before the runs, in ``ranks``
processes on GPU 0 (each its own ``NCCL_HOSTID``, as :func:`pipesched.runner.run_pipeline` runs them), for every
model / micro-batch it is given:

* ``profile``: :func:`pipesched.profile.measure_profile` in rank 0 while the others wait on the host;
* ``compute{k}``, k = 1..ranks: k processes run the whole chain's forward and backward as one action each (a clock
  reading after a device synchronisation on both sides, as the runner times an action), all at once: the
  slowdown of an action when k ranks compute together (k = 1 also gives the action-versus-per-layer-profile ratio);
* ``wait{j}``, j = 1..ranks-1: rank 0 computes while ranks 1..j wait in an NCCL receive from it (their kernels
  resident on the GPU, as a pipeline rank's while it waits for its input);
* ``pending_recv`` / ``pending_send``: rank 0 computes with one of its own NCCL receives (sends) outstanding;
* ``p2p``: one-way time of an NCCL send between ranks 0 and 1 (ping-pong / 2) at several sizes, the others idle.

:class:`GpuCalibration` reduces that raw data to the model's constants (:meth:`GpuCalibration.from_raw`), and
:func:`predict_contended` predicts a plan with them: every action costs its layers' profile times the measured
action/profile ratio, times the measured slowdown at the action's *load*, the number of other ranks computing
during it plus ``wait_weight`` times the number waiting in a step (both time-averaged over the action in the
simulated timeline); the simulation is repeated until the loads settle (a fixed point, a few rounds). Messages
cost the measured one-way time at their size (latency + bytes / bandwidth, least squares over the sizes).
"""

from __future__ import annotations

import bisect
import math
import os
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any

from .devices import LinkModel
from .plan import Plan
from .profile import ModelProfile
from .simulate import SimResult, StageCost, simulate

P2P_SIZES = (4, 1 << 16, 1 << 20, 4 << 20, 16 << 20)


def _factory(path: str):
    import importlib

    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _calibration_worker(rank: int, world: int, port: int, job: dict[str, Any], queue) -> None:
    cuda = job["device"] == "cuda"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if cuda:   # as in the pipelined runs: every rank a "node" of its own on the one GPU
        os.environ["NCCL_HOSTID"] = f"pipesched-cal{rank}"
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    from .profile import measure_profile
    from .runner import half_round_trip_s

    torch.set_num_threads(1)
    try:
        dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(dev)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        host = dist.new_group(backend="gloo")     # barriers that wait on the host, not in a GPU kernel that holds the GPU

        def barrier() -> None:
            dist.barrier(group=host)

        sync = torch.cuda.synchronize if cuda else (lambda: None)
        # An action's clock waits for the compute stream only (as the runner's): a device-wide sync would also wait
        # for this rank's own pending NCCL operations, which complete only when the peer takes part.
        stream_sync = (lambda: torch.cuda.current_stream().synchronize()) if cuda else (lambda: None)
        small = torch.zeros(1, device=dev)
        for peer in range(1, world):   # NCCL connects a pair at its first message: not inside a timed phase
            if rank == 0:
                dist.send(small, peer)
                dist.recv(small, peer)
            elif rank == peer:
                dist.recv(small, 0)
                dist.send(small, 0)
        sync()
        barrier()
        out: dict[str, Any] = {"rank": rank, "entries": []}
        if rank == 0:
            t = []
            for _ in range(50):
                t0 = time.perf_counter()
                sync()
                t.append(time.perf_counter() - t0)
            out["sync_s"] = statistics.median(t)
        reps = job["reps"]
        built: dict[str, list[Any]] = {}
        for entry in job["entries"]:
            key = repr((entry["model"], sorted(entry["model_kwargs"].items())))
            if key not in built:     # one model per shape: the micro-batch counts share it
                built.clear()
                if cuda:
                    torch.cuda.empty_cache()
                built[key] = [layer.to(dev) for layer in _factory(entry["model"])(**entry["model_kwargs"])]
            layers = built[key]
            gen = torch.Generator().manual_seed(1)
            shape = tuple(entry["input_shape"])
            x = torch.randn(entry["microbatch"], *shape, generator=gen).to(dev)
            y = torch.randn(entry["microbatch"], *shape, generator=gen).to(dev)
            buf = torch.zeros(x.numel(), device=dev)
            for p in (p for lay in layers for p in lay.parameters()):
                p.grad = torch.zeros_like(p)     # a pipelined step's backward accumulates into existing gradients

            def chain_once(layers=layers, x=x, y=y) -> tuple[float, float]:
                stream_sync()
                t0 = time.perf_counter()
                h = x
                for lay in layers:
                    h = lay(h)
                loss = torch.nn.functional.mse_loss(h, y)
                stream_sync()
                t1 = time.perf_counter()
                loss.backward()
                stream_sync()
                return t1 - t0, time.perf_counter() - t1

            for _ in range(3):
                chain_once()
            rec: dict[str, Any] = {"name": entry["name"], "phases": {}}
            barrier()
            if rank == 0:
                rec["profile"] = measure_profile(layers, x, loss_fn=lambda out, y=y: torch.nn.functional.mse_loss(out, y),
                                                 repeats=job["profile_repeats"], warmup=3, name=entry["name"], statistic="median", clock="wall",
                                                 passes=3).to_dict()
            barrier()
            phases = [("compute", k) for k in range(1, world + 1)]
            if job["nccl_phases"]:
                phases += [("wait", j) for j in range(1, world)] + [("pending_recv", 1), ("pending_send", 1)]
            for kind, k in phases:
                barrier()
                samples = None
                if kind == "compute":
                    if rank < k:
                        samples = [chain_once() for _ in range(reps)]
                elif kind == "wait":
                    if rank == 0:
                        samples = [chain_once() for _ in range(reps)]
                        for peer in range(1, k + 1):
                            dist.send(buf, peer)
                    elif rank <= k:
                        dist.recv(buf, 0)
                else:
                    if rank == 0:
                        work = dist.irecv(buf, 1) if kind == "pending_recv" else dist.isend(buf, 1)
                        samples = [chain_once() for _ in range(reps)]
                        barrier()
                        work.wait()
                    else:
                        barrier()
                        if rank == 1:
                            (dist.send if kind == "pending_recv" else dist.recv)(buf, 0)
                sync()
                barrier()
                if samples is not None:
                    rec["phases"][f"{kind}{k}"] = samples
            out["entries"].append(rec)
            for p in (p for lay in layers for p in lay.parameters()):
                p.grad = None
        p2p = []
        for nbytes in sorted(set(job["sizes"])):
            msg = torch.zeros(max(1, nbytes // 4), device=dev)
            barrier()
            times = []
            if rank < 2 and world > 1:   # 3 untimed round trips first
                times = [half_round_trip_s(dist, msg, rank, sync) for _ in range(3 + job["p2p_reps"])][3:]
            if rank == 0:
                p2p.append({"bytes": nbytes, "one_way_s": statistics.median(times) if times else 0.0, "samples_s": times})
        out["p2p"] = p2p
        barrier()
        queue.put(out)
        dist.destroy_process_group()
    except Exception as exc:   # report, do not hang the parent
        import traceback

        queue.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"})


def calibrate_gpu(entries: list[dict[str, Any]], *, ranks: int = 4, reps: int = 8, profile_repeats: int = 15, p2p_reps: int = 10,
                  sizes: tuple[int, ...] = P2P_SIZES, device: str = "cuda", timeout_s: float = 300, nccl_phases: bool = True) -> dict[str, Any]:
    """Measure the contention model's inputs in ``ranks`` processes (NCCL on GPU 0, or gloo on the CPU for a rehearsal).

    ``entries``: one per model and micro-batch, ``{"name", "model": "module:function", "model_kwargs", "input_shape",
    "microbatch"}``. Returns the raw measurements (JSON-ready; see the module docstring for the phases), from
    which :meth:`GpuCalibration.from_raw` takes the constants. Every message size of the entries' activations is
    added to the ping-pong's ``sizes``. ``nccl_phases=False`` leaves out the ``wait`` and ``pending`` phases.
    """
    import socket

    import torch.multiprocessing as mp

    from .runner import gather_results

    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if ranks < 2:
        raise ValueError(f"need at least 2 ranks, got {ranks}")
    act = [4 * e["microbatch"] * math.prod(e["input_shape"]) for e in entries]
    job = {"entries": entries, "reps": reps, "profile_repeats": profile_repeats, "p2p_reps": p2p_reps, "sizes": list(sizes) + act,
           "device": device, "nccl_phases": nccl_phases}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_calibration_worker, args=(r, ranks, port, job, queue), daemon=True) for r in range(ranks)]
    for p in procs:
        p.start()
    results = gather_results(procs, queue, ranks, timeout_s, what="GPU calibration")
    merged = []
    for k, entry in enumerate(entries):
        phases: dict[str, dict[str, list]] = {}
        for r in range(ranks):
            for name, samples in results[r]["entries"][k]["phases"].items():
                phases.setdefault(name, {})[str(r)] = samples
        merged.append({**entry, "profile": results[0]["entries"][k]["profile"], "phases": phases,
                       "message_bytes": act[k]})
    return {"format": "netweave-gpu-calibration", "version": 1, "device": device, "ranks": ranks, "reps": reps,
            "sync_s": results[0]["sync_s"], "p2p": results[0]["p2p"], "entries": merged}


# --------------------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------------------

def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear interpolation, held constant beyond the ends.

    >>> _interp([1, 2, 4], [1.0, 1.1, 1.5], 3)
    1.3
    """
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x)
    a, b = xs[i - 1], xs[i]
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - a) / (b - a)


def _inverse(xs: list[float], ys: list[float], y: float) -> float:
    """The x at which the increasing piecewise-linear curve reaches ``y`` (clipped to the ends).

    >>> _inverse([1, 2, 4], [1.0, 1.1, 1.5], 1.3)
    3.0
    """
    if y <= ys[0]:
        return xs[0]
    for i in range(1, len(xs)):
        if ys[i] >= y and ys[i] > ys[i - 1]:
            return xs[i - 1] + (xs[i] - xs[i - 1]) * (y - ys[i - 1]) / (ys[i] - ys[i - 1])
    return xs[-1]


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares intercept and slope of y on x.

    >>> _line([(0, 1.0), (2, 2.0), (4, 3.0)])
    (1.0, 0.5)
    """
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return my - slope * mx, slope


@dataclass(frozen=True)
class GpuCalibration:
    """The contention model's constants for one model / micro-batch, all from :func:`calibrate_gpu`'s raw data.

    ``action_ratio[kind]``: an action timed as the runner times it (the whole chain, one synchronisation on each
    side) over the sum of the profile's per-layer times, one process alone; ``slowdown[kind][k-1]``: the action's
    time with ``k`` processes computing at once over alone (k = 1..ranks, the first is 1); ``wait_weight``: what
    a rank waiting in an NCCL receive costs a computing one, in computing ranks (the load on the ``slowdown``
    curve that its measured slowdown with 1..ranks-1 waiters corresponds to, per waiter, median; 0 when the curve
    is flat); ``pending[kind]``: the slowdown of an action with one of its own NCCL receives outstanding (the
    runtime posts receives ahead); ``latency_s``/``bandwidth_bps``: one-way NCCL send time = latency + bytes /
    bandwidth, least squares over the measured sizes. ``kinds`` "F" and "B" (I and W use B's).
    """

    action_ratio: dict[str, float]
    slowdown: dict[str, list[float]]
    wait_weight: float
    pending: dict[str, float]
    latency_s: float
    bandwidth_bps: float
    raw_wait: dict[str, list[float]] = field(default_factory=dict)
    gap_s: float = 0.0                 # the runtime's host time between two actions of a rank (probe pipeline)
    hop_s: float | None = None         # producer's end to consumer's start at hop_bytes, consumer idle (probe pipeline)
    hop_bytes: float = 0.0

    @staticmethod
    def from_raw(raw: dict[str, Any], name: str) -> GpuCalibration:
        """The constants of entry ``name`` of :func:`calibrate_gpu`'s output."""
        entry = next((e for e in raw["entries"] if e["name"] == name), None)
        if entry is None:
            raise KeyError(f"no calibration entry {name!r} (have {[e['name'] for e in raw['entries']]})")
        lays = entry["profile"]["layers"]
        prof = {"F": sum(lay["fwd_s"] for lay in lays), "B": sum(lay["bwd_full_s"] for lay in lays)}
        ph = entry["phases"]
        ranks = raw["ranks"]

        def med(phase: str, kind: str, ranks_in: list[str] | None = None) -> float:
            col = 0 if kind == "F" else 1
            per_rank = [statistics.median(s[col] for s in samples) for r, samples in ph[phase].items() if ranks_in is None or r in ranks_in]
            return statistics.median(per_rank)

        solo = {kind: med("compute1", kind) for kind in "FB"}
        ratio = {kind: solo[kind] / prof[kind] for kind in "FB"}
        slow = {kind: [1.0] + [med(f"compute{k}", kind) / solo[kind] for k in range(2, ranks + 1)] for kind in "FB"}
        loads = list(range(1, ranks + 1))
        weights, raw_wait = [], {}
        for kind in "FB":
            raw_wait[kind] = [med(f"wait{j}", kind) / solo[kind] for j in range(1, ranks) if f"wait{j}" in ph]
            if slow[kind][-1] > 1.02:    # a curve that rises: waiters expressed as computing ranks
                weights += [(_inverse(loads, slow[kind], w) - 1.0) / j for j, w in enumerate(raw_wait[kind], start=1)]
        pending = {kind: med("pending_recv", kind) / solo[kind] for kind in "FB"} if "pending_recv" in ph else {"F": 1.0, "B": 1.0}
        pts = [(p["bytes"], p["one_way_s"]) for p in raw["p2p"]]
        lat, slope = _line(pts)
        cal = GpuCalibration(ratio, slow, max(0.0, statistics.median(weights)) if weights else 0.0, pending, max(0.0, lat),
                             1.0 / slope if slope > 0 else math.inf, raw_wait)
        probe = raw.get("probe")
        if probe:
            over = trace_overheads(probe["result"])
            cal = replace(cal, gap_s=over["gap_s"], hop_s=over["hop_s"], hop_bytes=probe["message_bytes"])
        return cal

    def factor(self, kind: str, load: float) -> float:
        """Slowdown of an action of ``kind`` at ``load`` other computing-rank equivalents (1.0 at none)."""
        k = "F" if kind == "F" else "B"
        curve = self.slowdown[k]
        return _interp(list(range(1, len(curve) + 1)), curve, 1.0 + load)

    def link(self, ranks: int) -> LinkModel:
        """Latency + bytes / bandwidth per message: the ping-pong's line, or, with a probe, its hop at ``hop_bytes``
        less the bandwidth term (the hop includes the runtime's posting and the consumer's wake-up)."""
        if self.hop_s is None:
            return LinkModel.uniform(ranks, self.bandwidth_bps, self.latency_s)
        return LinkModel.uniform(ranks, self.bandwidth_bps, max(0.0, self.hop_s - self.hop_bytes / self.bandwidth_bps))

    def to_dict(self) -> dict[str, Any]:
        return {"action_ratio": self.action_ratio, "slowdown": self.slowdown, "wait_weight": self.wait_weight, "pending": self.pending,
                "latency_s": self.latency_s, "bandwidth_bps": self.bandwidth_bps, "raw_wait": self.raw_wait, "gap_s": self.gap_s,
                "hop_s": self.hop_s, "hop_bytes": self.hop_bytes}


def trace_overheads(result: dict[str, Any]) -> dict[str, Any]:
    """The runtime's overheads in a traced run (``run_pipeline(trace=True)``, its ``to_dict()``), on the one host clock.

    ``gap_s``: median time from a rank's action's end to its next action's start when that next action's input
    (from another rank) was there before the first ended, or it has none (the runtime's own host work: posting,
    waiting, launching); ``hop_s``: median time from the end of an action on one rank to the start of the action
    it feeds on another, when the consumer was idle by then (the transfer, posting and wake-up). Stage order: F
    of stage s feeds F of s + 1, B of s feeds B of s - 1 (also I; W needs no message).

    >>> t = [[{"t0": 0.0, "actions": [[0, "F", 0, 0.0, 1.0, 0, None], [0, "F", 1, 1.2, 2.0, 0, None]]}],
    ...      [{"t0": 0.0, "actions": [[1, "F", 0, 1.5, 2.5, 0, None], [1, "F", 1, 2.6, 3.0, 0, None]]}]]
    >>> over = trace_overheads({"traces": t})
    >>> round(over["gap_s"], 3), round(over["hop_s"], 3)
    (0.15, 0.5)
    """
    hops, gaps = [], []
    for k in range(len(result["traces"][0])):
        base = min(t[k]["t0"] for t in result["traces"])
        acts: dict[tuple[int, str, int], tuple[int, float, float, float | None]] = {}
        for q, t in enumerate(result["traces"]):
            off = t[k]["t0"] - base
            prev_end = None
            for s, kind, mb, a, b, *_ in sorted(t[k]["actions"], key=lambda x: x[3]):
                acts[(s, kind, mb)] = (q, off + a, off + b, prev_end)
                prev_end = off + b
        stages = max(s for s, _, _ in acts) + 1
        for (s, kind, mb), (q, a, _b, prev_end) in acts.items():
            dep = (s - 1, "F", mb) if kind == "F" and s > 0 else None
            if kind in ("B", "I") and s < stages - 1:
                dep = next(((s + 1, kk, mb) for kk in ("B", "I") if (s + 1, kk, mb) in acts), None)
            if dep is not None and dep in acts and acts[dep][0] != q:
                sent = acts[dep][2]
                if prev_end is None or prev_end < sent:
                    hops.append(a - sent)
                else:
                    gaps.append(a - prev_end)
            elif prev_end is not None:
                gaps.append(a - prev_end)
    return {"gap_s": statistics.median(gaps) if gaps else 0.0, "hop_s": statistics.median(hops) if hops else None,
            "gaps": len(gaps), "hops": len(hops)}


def rank_loads(sim: SimResult, wait_weight: float) -> dict[tuple[int, int, str, int], float]:
    """Per simulated action (rank, stage, kind, mb): the time-averaged load from the other ranks during it.

    A rank computes during its spans and waits from the step's start (0) to its last span's end outside them (with
    NCCL its receive kernels are resident meanwhile); ``load`` = computing others + ``wait_weight`` * waiting others.

    >>> from pipesched.simulate import Span, SimResult
    >>> from pipesched.schedules import Action
    >>> sp = [Span(0, Action(0, "F", 0), 0.0, 1.0), Span(1, Action(1, "F", 0), 0.5, 2.0)]
    >>> sim = SimResult(2.0, sp, [], [1.0, 1.5], [0.0, 0.0], [[], []], {}, 2)
    >>> loads = rank_loads(sim, 0.5)
    >>> loads[(0, 0, "F", 0)], loads[(1, 1, "F", 0)]
    (0.75, 0.3333333333333333)
    """
    by_rank: dict[int, list[tuple[float, float]]] = {}
    for s in sim.timeline:
        by_rank.setdefault(s.rank, []).append((s.start, s.end))
    ends = {r: max(e for _, e in v) for r, v in by_rank.items()}
    for v in by_rank.values():
        v.sort()
    starts = {r: [a for a, _ in v] for r, v in by_rank.items()}

    def busy(r: int, a: float, b: float) -> float:
        v = by_rank[r]
        i = max(0, bisect.bisect_right(starts[r], a) - 1)
        total = 0.0
        while i < len(v) and v[i][0] < b:
            total += max(0.0, min(b, v[i][1]) - max(a, v[i][0]))
            i += 1
        return total

    out = {}
    for s in sim.timeline:
        a, b = s.start, s.end
        if b <= a:
            out[(s.rank, s.action.stage, s.action.kind, s.action.mb)] = 0.0
            continue
        load = 0.0
        for q in by_rank:
            if q == s.rank:
                continue
            comp = busy(q, a, b)
            waiting = max(0.0, min(b, ends[q]) - a) - comp if a < ends[q] else 0.0
            load += (comp + wait_weight * max(0.0, waiting)) / (b - a)
        out[(s.rank, s.action.stage, s.action.kind, s.action.mb)] = load
    return out


def torch_split_costs(p: Plan, profile: ModelProfile) -> dict[int, StageCost]:
    """``p``'s costs with I and W as torch's runtime splits a stage's backward (zero-bubble families).

    ``stage_backward_input`` computes the input gradient and keeps the gradients of every intermediate tensor, so
    ``stage_backward_weight`` has only the weight-gradient products left: I costs the profile's input-gradient
    time and W the rest of the fused backward (``bwd_full_s - bwd_input_s``). The profile's own ``bwd_weight_s``
    (``autograd.grad`` to the parameters on a fresh graph) also back-propagates through the layer's inside and
    costs about a fused backward (measured on the transformer chain: W 11 ms in the run, about 20 ms by the profile).
    The stage that holds layer 0 has no input gradient: torch's runtime does its whole backward in W, I is empty.
    Families without a split backward keep their costs.

    >>> from pipesched.plan import uniform_plan
    >>> from pipesched.devices import Device
    >>> from pipesched.profile import LayerProfile, ModelProfile
    >>> lay = LayerProfile("l", 1.0, 0.8, 1.9, 4, 4, {"none": 4, "selective": 4, "full": 4}, {"none": 0.0, "selective": 0.0, "full": 1.0},
    ...                    bwd_full_s=2.0)
    >>> prof = ModelProfile("m", (lay,) * 4, "measured", 1)
    >>> q = uniform_plan(prof, [Device("a"), Device("b")], None, microbatches=4, family="zbh1")
    >>> c = torch_split_costs(q, prof)
    >>> (c[0].i, c[0].w, c[1].i, c[1].w)
    (0.0, 4.0, 1.6, 2.4)
    """
    if not p.schedule.split_backward:
        return dict(p.costs)
    lays = profile.layers
    out = {}
    for sid, c in p.costs.items():
        i, j = p.partition.stages[p.schedule.stage_layers[sid]].layers
        speed = p.devices[p.schedule.stage_rank[sid]].speed
        fused = sum(lay.bwd_s for lay in lays[i:j]) / speed
        inp = 0.0 if i == 0 else sum(lay.bwd_input_s for lay in lays[i:j]) / speed
        out[sid] = replace(c, i=inp, w=max(0.0, fused - inp), b=fused)
    return out


def predict_contended(p: Plan, cal: GpuCalibration, *, rounds: int = 8, pending: bool = True,
                      runtime: str = "ideal", add_gap: bool = True, profile: ModelProfile | None = None) -> tuple[Plan, dict[str, Any]]:
    """``p`` predicted with the contention model (module docstring): its costs scaled per action and simulated again.

    Every stage's F and B (I, W) cost starts from the plan's (the profile's) times the calibrated action ratio (and,
    with ``pending``, the own-pending-receive slowdown on ranks that receive anything); then, ``rounds`` times, the
    plan is simulated over the calibrated link and each stage-kind's cost is set to that base times the slowdown at
    its mean load in the last simulation. Returns the plan with the final costs and simulation, and a record of
    the loads and factors. With ``profile``, a zero-bubble plan's I and W are costed as torch's runtime splits the
    backward (:func:`torch_split_costs`). Every action also costs the probe's ``gap_s`` (``add_gap``: the runtime's
    host work between actions; on a time-sliced GPU the probe's gap is mostly the wait for the next time slice,
    which the slowdown factors already hold, so callers leave it out there),
    and messages are posted as ``runtime`` posts them (:func:`pipesched.runtimes.rendezvous_for`: NCCL, like gloo,
    moves a message once both sides have posted it).
    """
    from .runtimes import rendezvous_for

    link = cal.link(p.schedule.ranks)
    rendezvous = rendezvous_for(runtime, p.schedule, None)
    start = torch_split_costs(p, profile) if profile is not None else dict(p.costs)
    gap = cal.gap_s if add_gap else 0.0
    receives = {r for r in range(p.schedule.ranks) if any(p.schedule.cross_rank_messages(a) for a in p.schedule.actions[r])}

    def base(sid: int, kind: str) -> float:
        k = "F" if kind == "F" else "B"
        extra = cal.pending[k] if pending and p.schedule.stage_rank[sid] in receives else 1.0
        return start[sid].duration(kind) * cal.action_ratio[k] * extra + gap

    def costs_for(factors: dict[tuple[int, str], float]) -> dict[int, StageCost]:
        out = {}
        for sid, c in start.items():
            f = base(sid, "F") * factors.get((sid, "F"), 1.0)
            i = base(sid, "I") * factors.get((sid, "I"), factors.get((sid, "B"), 1.0))
            w = base(sid, "W") * factors.get((sid, "W"), factors.get((sid, "B"), 1.0))
            b = base(sid, "B") * factors.get((sid, "B"), 1.0)
            out[sid] = replace(c, f=f, b=b, i=i, w=w)
        return out

    factors: dict[tuple[int, str], float] = {}
    history = []
    sim = None
    for _ in range(rounds):
        costs = costs_for(factors)
        sim = simulate(p.schedule, costs, link, rendezvous=rendezvous)
        loads = rank_loads(sim, cal.wait_weight)
        per: dict[tuple[int, str], list[float]] = {}
        for (_, sid, kind, _), load in loads.items():
            per.setdefault((sid, kind), []).append(load)
        new = {key: cal.factor(key[1], statistics.mean(v)) for key, v in per.items()}
        history.append(sim.makespan)
        if factors and all(abs(new[k] - factors.get(k, 1.0)) < 1e-4 for k in new):
            factors = new
            break
        factors = new
    costs = costs_for(factors)
    sim = simulate(p.schedule, costs, link, rendezvous=rendezvous)
    history.append(sim.makespan)
    out = replace(p, costs=costs, sim=sim, links=link, runtime=runtime)
    return out, {"makespans_s": history, "factors": {f"{s} {k}": v for (s, k), v in sorted(factors.items())}}
