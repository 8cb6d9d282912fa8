"""Pipeline devices and the links between them.

A pipeline runs on an ordered list of :class:`Device` (position = pipeline rank). Each has a ``speed``
(profile time divided by ``speed`` is its time) and a ``memory_bytes`` limit, so heterogeneous GPUs are plain
data. A :class:`LinkModel` gives the bandwidth (bytes/s) and latency (s) between two ranks; built from a
Topology it uses ``topology.paths.gpu_path`` (NCCL-style path classes and bottleneck bandwidth).

>>> import topology
>>> topo = topology.default_cluster()
>>> devs, links = devices_from_topology(topo, count=2)
>>> [d.name for d in devs]
['node0/gpu0', 'node0/gpu1']
>>> links.bandwidth(0, 1) > 100e9    # NVLink, not the network
True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx
import numpy as np

from topology.errors import InputError

GIB = 1024**3


@dataclass(frozen=True)
class Device:
    """One pipeline rank: relative ``speed`` (1.0 = the profile's reference device) and memory in bytes."""

    name: str
    speed: float = 1.0
    memory_bytes: float = math.inf

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "speed": self.speed, "memory_bytes": None if math.isinf(self.memory_bytes) else self.memory_bytes}


class LinkModel:
    """Point-to-point cost between pipeline ranks: ``time(a, b, nbytes) = latency + nbytes / bandwidth``.

    ``resolve(a, b) -> (bytes/s, seconds)`` is called lazily and cached, so a 64-rank pipeline only looks up
    the pairs its schedule uses. Same-rank transfers are free.
    """

    def __init__(self, ranks: int, resolve: Callable[[int, int], tuple[float, float]], names: Sequence[str] | None = None):
        self.ranks = ranks
        self._resolve = resolve
        self._cache: dict[tuple[int, int], tuple[float, float]] = {}
        self.names = list(names) if names is not None else [str(i) for i in range(ranks)]

    @classmethod
    def uniform(cls, ranks: int, bw_bytes_per_s: float, latency_s: float) -> LinkModel:
        """Every pair of distinct ranks joined by the same link (e.g. a calibrated CPU transport)."""
        return cls(ranks, lambda a, b: (float(bw_bytes_per_s), float(latency_s)))

    @classmethod
    def from_matrices(cls, bw: Any, latency: Any) -> LinkModel:
        bw, latency = np.asarray(bw, dtype=float), np.asarray(latency, dtype=float)
        return cls(len(bw), lambda a, b: (float(bw[a][b]), float(latency[a][b])))

    def link(self, a: int, b: int) -> tuple[float, float]:
        """(bandwidth bytes/s, latency s) from rank ``a`` to rank ``b``."""
        if a == b:
            return math.inf, 0.0
        key = (a, b)
        if key not in self._cache:
            self._cache[key] = self._resolve(a, b)
        return self._cache[key]

    def bandwidth(self, a: int, b: int) -> float:
        return self.link(a, b)[0]

    def time(self, a: int, b: int, nbytes: float) -> float:
        if a == b or nbytes <= 0:
            return 0.0
        bw, lat = self.link(a, b)
        return lat + nbytes / bw

    def to_dict(self) -> dict[str, Any]:
        pairs = sorted(self._cache)
        return {"names": self.names, "pairs": [{"src": a, "dst": b, "bw_bytes_per_s": self._cache[(a, b)][0],
                                                "latency_s": self._cache[(a, b)][1]} for a, b in pairs]}


def _fallback_path(topo, a: str, b: str) -> tuple[float, float]:
    """Bottleneck bandwidth (GB/s) and latency (us) of the lowest-latency route that does not pass through other GPUs.

    Used only when ``topology.paths`` is not available; the planner prefers ``gpu_path``.
    """
    g = topo.graph
    gpus = set(topo.gpus())

    def weight(u, v, data):
        if v in gpus and v != b:
            return None
        return min(d.get("latency_us", 0.0) for d in data.values()) + 1e-6

    try:
        path = nx.shortest_path(g, a, b, weight=weight)
    except nx.NetworkXNoPath:
        raise InputError(f"no path between {a} and {b}", source="topology") from None
    bw, lat = math.inf, 0.0
    for u, v in zip(path, path[1:], strict=False):
        edges = g.get_edge_data(u, v)
        bw = min(bw, max(d["bw"] for d in edges.values()))
        lat += min(d.get("latency_us", 0.0) for d in edges.values())
    return bw, lat


def gpu_link(topo, a: str, b: str) -> tuple[float, float]:
    """(bandwidth GB/s, latency us) between two GPUs, from ``topology.paths.gpu_path`` when present."""
    try:
        from topology.paths import gpu_path
    except ImportError:
        return _fallback_path(topo, a, b)
    path = gpu_path(topo, a, b)
    return float(path.bw), float(path.latency_us)


def devices_from_topology(topo, gpus: Sequence[str] | None = None, count: int | None = None,
                          reference_tflops: float | None = None, memory_reserve: float = 0.0) -> tuple[list[Device], LinkModel]:
    """Pipeline devices (canonical GPU order unless ``gpus`` is given) and the links between them.

    ``speed`` = GPU TFLOP/s / ``reference_tflops`` (the profile's reference; default: the first GPU, so a
    homogeneous cluster has speed 1). ``memory_bytes`` = ``memory_gib`` minus ``memory_reserve`` (a fraction
    kept for the allocator, communication buffers and fragmentation).
    """
    all_gpus = topo.gpus()
    if gpus is None:
        if count is not None and count > len(all_gpus):
            raise InputError(f"{count} pipeline stages need {count} GPUs but the topology has {len(all_gpus)}", where="--stages")
        gpus = all_gpus[: count or len(all_gpus)]
    else:
        gpus = [topo.resolve_gpu(g) for g in gpus]
    nodes = topo.graph.nodes
    ref = reference_tflops or float(nodes[gpus[0]].get("tflops") or 1.0)
    devices = []
    for g in gpus:
        attrs = nodes[g]
        tflops = float(attrs.get("tflops") or ref)
        mem = attrs.get("memory_gib")
        devices.append(Device(g, speed=tflops / ref, memory_bytes=float(mem) * GIB * (1 - memory_reserve) if mem else math.inf))
    cache: dict[tuple[str, str], tuple[float, float]] = {}

    def resolve(i: int, j: int) -> tuple[float, float]:
        key = (gpus[i], gpus[j])
        if key not in cache:
            gbs, us = gpu_link(topo, *key)
            cache[key] = (gbs * 1e9, us * 1e-6)
        return cache[key]

    return devices, LinkModel(len(gpus), resolve, gpus)
