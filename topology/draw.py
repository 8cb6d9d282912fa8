"""Draw a topology as PNG, SVG or PDF (matplotlib, Agg backend; the format follows the file extension).

Two pictures, chosen by size:

* **Detailed** (at most :data:`DETAIL_MAX_HOSTS` hosts): network tiers on top
  (core, spine, leaf), then every host as a labelled box holding its NICs, PCIe
  switches, CPUs, GPUs and NVSwitches, and below the hosts the NVSwitch chips
  of multi-host NVLink domains (GB200 NVL72). Links are coloured by kind
  (NVLink, PCIe/C2C, CPU interconnect, network) and their width grows with
  the per-direction bandwidth; parallel links between the same two devices
  are drawn once with their summed bandwidth.
* **Aggregated** (more hosts): hosts collapse into groups by the leaf group
  (scalable unit, ToR or pod) their NICs reach, switches into one box per
  group and tier; each box is labelled with its counts and each line with the
  total bandwidth between the two boxes. At most :data:`MAX_COLUMNS` columns
  are drawn; consecutive groups are merged beyond that.

>>> import tempfile, pathlib
>>> from topology import build_node
>>> path = pathlib.Path(tempfile.mkdtemp()) / "node.png"
>>> draw_topology(build_node("dgx-h100"), path)
>>> path.read_bytes()[:8] == b"\\x89PNG\\r\\n\\x1a\\n"
True
"""

from __future__ import annotations

import math
import os
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.collections import LineCollection  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import FancyBboxPatch, Patch  # noqa: E402

from .errors import InputError  # noqa: E402
from .model import LinkKind, NodeKind, SwitchTier, Topology  # noqa: E402

DETAIL_MAX_HOSTS = 8
MAX_COLUMNS = 9

LINK_STYLE = {
    LinkKind.NVLINK: ("#5b9a00", "NVLink"),
    LinkKind.PCIE: ("#1f6fb4", "PCIe / C2C host link"),
    LinkKind.CPU: ("#8e44ad", "CPU interconnect"),
    LinkKind.NETWORK: ("#e07b00", "network cable"),
}
NODE_STYLE = {  # face colour, label
    NodeKind.GPU: ("#b9e07a", "GPU"),
    NodeKind.NVSWITCH: ("#4d7f00", "NVSwitch"),
    NodeKind.PCIE_SWITCH: ("#a9cdf0", "PCIe switch"),
    NodeKind.CPU: ("#d7b8e8", "CPU / NUMA node"),
    NodeKind.NIC: ("#ffc680", "NIC"),
    NodeKind.SWITCH: ("#c8c8c8", "network switch"),
}
TIER_ORDER = (SwitchTier.CORE, SwitchTier.SPINE, SwitchTier.LEAF)


def link_width(bw: float) -> float:
    """Line width (points) for a per-direction bandwidth in GB/s: logarithmic, 0.4 at 10 GB/s, +1.2 per decade.

    >>> round(link_width(10), 2), round(link_width(100), 2), round(link_width(1000), 2)
    (0.4, 1.6, 2.8)
    """
    return max(0.3, 0.4 + 1.2 * math.log10(max(bw, 1.0) / 10.0))


def format_bw(gbs: float) -> str:
    """``50 GB/s``, ``1.6 TB/s``, ``410 TB/s``.

    >>> format_bw(50.0), format_bw(1600.0), format_bw(409600.0)
    ('50 GB/s', '1.6 TB/s', '410 TB/s')
    """
    if gbs >= 1000:
        tb = gbs / 1000
        return f"{tb:.3g} TB/s"
    return f"{gbs:.3g} GB/s"


FORMATS = ("png", "svg", "pdf")


def image_format(path: str | os.PathLike[str]) -> str:
    """The picture format named by ``path``'s extension: png, svg or pdf.

    >>> image_format("c.svg"), image_format("out/C.PDF"), image_format("node.png")
    ('svg', 'pdf', 'png')
    >>> image_format("c.jpg")
    Traceback (most recent call last):
    ...
    topology.errors.InputError: c.jpg: unknown picture format '.jpg'; expected a file ending in .png, .svg or .pdf
    """
    suffix = os.path.splitext(os.fspath(path))[1]
    if suffix.lower().lstrip(".") not in FORMATS:
        raise InputError(f"{os.fspath(path)}: unknown picture format {suffix!r}; expected a file ending in .png, .svg or .pdf")
    return suffix.lower().lstrip(".")


def draw_topology(topo: Topology, path: str | os.PathLike[str], *, title: str | None = None) -> None:
    """Write a picture of ``topo`` to ``path`` in the format of its extension (png, svg, pdf): detailed for small topologies,
    aggregated for large ones. An unknown extension raises :class:`~topology.errors.InputError` before any drawing."""
    fmt = image_format(path)
    hosts = topo.hosts()
    fig = _draw_detailed(topo, hosts, title) if len(hosts) <= DETAIL_MAX_HOSTS else _draw_aggregated(topo, hosts, title)
    try:
        fig.savefig(os.fspath(path), format=fmt, dpi=110)
    finally:
        plt.close(fig)


# --- helpers shared by both views ----------------------------------------------------------


def _title(topo: Topology, title: str | None) -> str:
    s = topo.summary()
    fabric = (topo.meta.get("fabric") or {}).get("kind")
    models = ", ".join(f"{n}x {m}" for m, n in s["gpu_models"].items())
    parts = [f"{s['hosts']} hosts", f"{s['gpus']} GPUs" + (f" ({models})" if models else "")]
    if fabric:
        parts.append(f"{fabric} fabric")
    return f"{title or topo.name}\n" + ", ".join(parts)


def _pairs(topo: Topology, nodes: Iterable[str] | None = None) -> dict[tuple[str, str], tuple[LinkKind, float, bool]]:
    """Undirected device pairs with link kind, summed per-direction bandwidth, and whether it is C2C."""
    out: dict[tuple[str, str], tuple[LinkKind, float, bool]] = {}
    edges = topo.graph.edges(nodes, data=True) if nodes is not None else topo.graph.edges(data=True)
    for u, v, d in edges:
        if u > v:
            continue  # the reverse direction of a duplex link carries the same figure
        kind, bw, c2c = out.get((u, v), (d["kind"], 0.0, False))
        out[(u, v)] = (kind, bw + d["bw"], c2c or bool(d.get("c2c")))
    return out


DARK_FACES = {NODE_STYLE[NodeKind.NVSWITCH][0]}


def _box(ax, x: float, y: float, w: float, h: float, face: str, text: str, *, fontsize: float = 6.5, z: int = 3):
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02,rounding_size=0.06",
                                facecolor=face, edgecolor="#333333", linewidth=0.6, zorder=z))
    if text:
        ax.text(x, y, text, ha="center", va="center", fontsize=fontsize, zorder=z + 1, color="white" if face in DARK_FACES else "black")


def _width_samples(bws: Iterable[float], most: int = 4) -> list[float]:
    """A few representative bandwidths (2 significant digits) spanning the ones drawn, for the legend."""
    values = sorted({_round_sig(b) for b in bws})
    if len(values) <= most:
        return values
    return [values[round(i * (len(values) - 1) / (most - 1))] for i in range(most)]


def _legend(ax, kinds_present: set[LinkKind], nodes_present: set[NodeKind], widths: list[float]) -> None:
    handles = [Patch(facecolor=NODE_STYLE[k][0], edgecolor="#333333", label=NODE_STYLE[k][1]) for k in NODE_STYLE if k in nodes_present]
    handles += [Line2D([], [], color=LINK_STYLE[k][0], lw=2.2, label=LINK_STYLE[k][1]) for k in LINK_STYLE if k in kinds_present]
    handles += [Line2D([], [], color="#555555", lw=link_width(bw), label=f"{format_bw(bw)} per direction") for bw in widths]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False, title="legend", title_fontsize=9)


def _short(node: str) -> str:
    return node.rsplit("/", 1)[-1]


# --- detailed view ----------------------------------------------------------------------------


@dataclass
class _Layout:
    pos: dict[str, tuple[float, float]] = field(default_factory=dict)
    size: dict[str, tuple[float, float]] = field(default_factory=dict)


ROW = {NodeKind.NIC: 0.0, NodeKind.PCIE_SWITCH: -1.0, NodeKind.CPU: -2.0, NodeKind.GPU: -3.0, NodeKind.NVSWITCH: -4.1}
COL = 1.0  # horizontal pitch of one GPU column


def spread_row(desired: list[float], gap: float) -> list[float]:
    """Positions as close as possible (least squares) to ``desired`` with neighbours at least ``gap`` apart, order kept.

    The constraint ``p[k+1] - p[k] >= gap`` on the sorted items becomes monotonicity of ``p[k] - k * gap``, so the
    exact optimum is the isotonic regression of ``desired[k] - k * gap`` (pool adjacent violators) shifted back.

    >>> spread_row([0.0, 0.0, 0.0], 1.0)
    [-1.0, 0.0, 1.0]
    >>> spread_row([0.0, 5.0, 0.2], 1.0)
    [-0.4, 5.0, 0.6]
    """
    order = sorted(range(len(desired)), key=lambda i: desired[i])
    blocks: list[list[float]] = []  # [sum, count] of pooled values of desired[k] - k * gap
    for k, i in enumerate(order):
        blocks.append([desired[i] - k * gap, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    out = [0.0] * len(desired)
    k = 0
    for total, count in blocks:
        for _ in range(int(count)):
            out[order[k]] = round(total / count + k * gap, 9)
            k += 1
    return out


def _host_layout(topo: Topology, host: str, x0: float, y0: float, lay: _Layout) -> float:
    """Place one host's devices with its left edge at ``x0`` and NIC row at ``y0``; return the host's width.

    GPUs are spaced one column apart; every other device wants to sit over (the mean of) the devices it connects
    to below it, and :func:`spread_row` then moves each row's boxes the least it can so that none overlap. The host
    is as wide as its widest row.
    """
    g = topo.graph
    by_kind: dict[NodeKind, list[str]] = defaultdict(list)
    for n in topo.nodes(host=host):
        by_kind[g.nodes[n]["kind"]].append(n)
    gpus = by_kind[NodeKind.GPU]
    pcie = by_kind[NodeKind.PCIE_SWITCH]
    nics = by_kind[NodeKind.NIC]
    cpus = by_kind[NodeKind.CPU]
    nvs = by_kind[NodeKind.NVSWITCH]
    x: dict[str, float] = {gpu: i * COL for i, gpu in enumerate(gpus)}
    centre = (len(gpus) - 1) * COL / 2 if gpus else 0.0

    def neighbours(n: str, kind: NodeKind) -> list[str]:
        return [v for v in g.successors(n) if g.nodes[v]["kind"] == kind and g.nodes[v].get("host") == host]

    def mean(values: list[float]) -> float | None:
        return sum(values) / len(values) if values else None

    def place_row(items: list[str], desired: dict[str, float | None], gap: float) -> None:
        if not items:
            return
        known = [desired[n] for n in items if desired[n] is not None]
        fallback = mean(known) if known else centre
        # Items with no anchor keep their order around the row's centre (or the anchored items' mean).
        wanted = [desired[n] if desired[n] is not None else fallback + (i - (len(items) - 1) / 2) * gap for i, n in enumerate(items)]
        for n, px in zip(items, spread_row(wanted, gap), strict=True):
            x[n] = px

    # PCIe switches over their GPUs; CPUs over their switches (or GPUs); GPU-less switches next to their CPU.
    place_row(pcie, {sw: mean([x[v] for v in neighbours(sw, NodeKind.GPU)]) for sw in pcie}, COL)
    place_row(cpus, {c: mean([x[v] for v in neighbours(c, NodeKind.PCIE_SWITCH) + neighbours(c, NodeKind.GPU)]) for c in cpus}, 1.5 * COL)
    place_row(pcie, {sw: mean([x[v] for v in neighbours(sw, NodeKind.GPU) or neighbours(sw, NodeKind.CPU)]) for sw in pcie}, COL)
    # NICs sit above their PCIe switch (or CPU), spread over the GPUs that share it.
    parents: dict[str, list[str]] = defaultdict(list)
    for nic in nics:
        ups = neighbours(nic, NodeKind.PCIE_SWITCH) or neighbours(nic, NodeKind.CPU)
        parents[ups[0] if ups else ""].append(nic)
    nic_want: dict[str, float | None] = {}
    for parent, members in parents.items():
        if not parent:
            nic_want.update(dict.fromkeys(members))
            continue
        span = sorted(x[v] for v in neighbours(parent, NodeKind.GPU)) or [x[parent]]
        if len(members) == len(span):
            slots = span
        elif len(members) == 1:
            slots = [x[parent]]
        else:
            lo, hi = (span[0], span[-1]) if span[-1] > span[0] else (x[parent] - 0.35 * COL, x[parent] + 0.35 * COL)
            slots = [lo + (hi - lo) * i / (len(members) - 1) for i in range(len(members))]
        nic_want.update(zip(members, slots, strict=True))
    place_row(nics, nic_want, COL)
    place_row(nvs, dict.fromkeys(nvs), COL * max(1.0, (len(gpus) - 1) / max(len(nvs), 1)))
    widths = {NodeKind.NIC: 0.78, NodeKind.PCIE_SWITCH: 0.78, NodeKind.CPU: 0.9, NodeKind.GPU: 0.82, NodeKind.NVSWITCH: 0.9}
    placed = [n for items in by_kind.values() for n in items]
    lo = min((x[n] for n in placed), default=0.0) - COL / 2
    hi = max((x[n] for n in placed), default=0.0) + COL / 2
    for kind, items in by_kind.items():
        for n in items:
            lay.pos[n] = (x0 + x[n] - lo, y0 + ROW[kind])
            lay.size[n] = (widths.get(kind, 0.8) * COL, 0.42)
    return hi - lo


def _device_label(topo: Topology, n: str) -> str:
    d = topo.graph.nodes[n]
    kind = d["kind"]
    idx = d.get("index", _short(n))
    if kind is NodeKind.GPU:
        return f"GPU{idx}"
    if kind is NodeKind.NIC:
        return f"NIC{idx}" + (f"\nrail {d['rail']}" if d.get("rail") is not None else "")
    if kind is NodeKind.PCIE_SWITCH:
        return f"PCIe{idx}"
    if kind is NodeKind.CPU:
        return f"CPU{d.get('numa', idx)}"
    if kind is NodeKind.NVSWITCH:
        return f"NVS{idx}"
    return _short(n)


def _switch_label(topo: Topology, n: str) -> str:
    d = topo.graph.nodes[n]
    label = n.replace("/", "\n")
    if d.get("rail") is not None and d["tier"] is SwitchTier.LEAF:
        label += f"\nrail {d['rail']}"
    return label


def _draw_detailed(topo: Topology, hosts: list[str], title: str | None):
    g = topo.graph
    lay = _Layout()
    gap = 0.8
    x = 0.0
    host_extent: dict[str, tuple[float, float]] = {}
    has_nvs = any(g.nodes[n]["kind"] is NodeKind.NVSWITCH and g.nodes[n].get("host") for n in g)
    for h in hosts:
        w = _host_layout(topo, h, x, 0.0, lay)
        host_extent[h] = (x, x + w)
        x += w + gap
    total_w = max(x - gap, 4.0)
    host_bottom = ROW[NodeKind.NVSWITCH] if has_nvs else ROW[NodeKind.GPU]

    # Multi-host NVLink domains: their chips form a row under the hosts of the domain.
    domain_chips: dict[str, list[str]] = defaultdict(list)
    for n, d in g.nodes(data=True):
        if d["kind"] is NodeKind.NVSWITCH and not d.get("host"):
            domain_chips[d.get("domain") or "?"].append(n)
    domain_y = host_bottom - 1.5
    for chips in domain_chips.values():
        members = [h for h in hosts if any(g.nodes[v].get("host") == h for c in chips[:1] for v in g.successors(c))]
        lo = min((host_extent[h][0] for h in members), default=0.0)
        hi = max((host_extent[h][1] for h in members), default=total_w)
        pitch = (hi - lo) / len(chips)
        for i, c in enumerate(chips):
            lay.pos[c] = (lo + (i + 0.5) * pitch, domain_y)
            lay.size[c] = (min(0.9, 0.85 * pitch), 0.42)

    # Fabric tiers above the hosts.
    tiers = [t for t in TIER_ORDER if topo.switches(t)]
    tier_y = {t: 1.7 + 1.6 * (len(tiers) - 1 - i) for i, t in enumerate(tiers)}
    for t in tiers:
        sws = topo.switches(t)
        pitch = total_w / len(sws)
        for i, s in enumerate(sws):
            lay.pos[s] = ((i + 0.5) * pitch, tier_y[t])
            lay.size[s] = (min(1.1, 0.86 * pitch), 0.62 if pitch > 0.9 else 0.42)

    top = (max(tier_y.values()) + 0.6) if tiers else 0.7
    bottom = (domain_y - 0.85) if domain_chips else host_bottom - 0.7
    fig_w = min(26.0, max(9.0, 0.62 * total_w + 4.5))
    fig_h = max(4.5, 0.78 * (top - bottom) + 1.6)
    fig, ax = plt.subplots(figsize=(fig_w, fig_h))
    ax.set_xlim(-0.6, total_w + 0.6)
    ax.set_ylim(bottom - 0.2, top + 0.2)
    ax.axis("off")
    ax.set_title(_title(topo, title), fontsize=11, loc="left")

    # Host frames.
    for h, (lo, hi) in host_extent.items():
        ax.add_patch(FancyBboxPatch((lo - 0.3, host_bottom - 0.45), hi - lo + 0.6, 1.2 - host_bottom,
                                    boxstyle="round,pad=0.0,rounding_size=0.15", facecolor="#f6f6f6", edgecolor="#9a9a9a",
                                    linewidth=0.8, zorder=0))
        n_gpu = len(topo.gpus(h))
        model = g.nodes[topo.gpus(h)[0]].get("model", "") if n_gpu else ""
        ax.text(lo - 0.22, 0.52, f"{h}: {n_gpu}x {model}", fontsize=7.5, ha="left", va="center", color="#333333", zorder=5,
                bbox={"boxstyle": "round,pad=0.1", "fc": "#f6f6f6", "ec": "none", "alpha": 0.9})
    for dom, chips in domain_chips.items():
        xs = [lay.pos[c][0] for c in chips]
        ax.add_patch(FancyBboxPatch((min(xs) - 0.55, domain_y - 0.4), max(xs) - min(xs) + 1.1, 0.8,
                                    boxstyle="round,pad=0.0,rounding_size=0.15", facecolor="#eef5e4", edgecolor="#7a9a50",
                                    linewidth=0.8, zorder=0))
        ax.text(min(xs) - 0.5, domain_y - 0.45, f"NVLink domain {dom}: {len(chips)} NVSwitch chips (host-less)", fontsize=7.5, ha="left",
                va="top", color="#3d6600")

    # Links, one line per device pair, grouped by kind into collections.
    segments: dict[tuple[LinkKind, bool], list] = defaultdict(list)
    lws: dict[tuple[LinkKind, bool], list[float]] = defaultdict(list)
    kinds_present: set[LinkKind] = set()
    bws: list[float] = []
    for (u, v), (kind, bw, c2c) in _pairs(topo).items():
        if u not in lay.pos or v not in lay.pos:
            continue
        segments[(kind, c2c)].append([lay.pos[u], lay.pos[v]])
        lws[(kind, c2c)].append(link_width(bw))
        kinds_present.add(kind)
        bws.append(bw)
    for (kind, c2c), segs in segments.items():
        ax.add_collection(LineCollection(segs, colors=LINK_STYLE[kind][0], linewidths=lws[(kind, c2c)], alpha=0.8,
                                         linestyles="dashed" if c2c else "solid", zorder=1 if kind is not LinkKind.NETWORK else 2))

    nodes_present: set[NodeKind] = set()
    for n, (px, py) in lay.pos.items():
        d = g.nodes[n]
        kind = d["kind"]
        nodes_present.add(kind)
        w, h = lay.size[n]
        if kind is NodeKind.SWITCH:
            face = {"core": "#9e9e9e", "spine": "#b5b5b5", "leaf": "#d6d6d6"}[str(d["tier"])]
            label = _switch_label(topo, n) if w >= 0.55 else ""
            _box(ax, px, py, w, h, face, label, fontsize=6)
        else:
            label = _device_label(topo, n) if w >= 0.45 else str(d.get("index", "")) if w >= 0.2 else ""
            _box(ax, px, py, w, h, NODE_STYLE[kind][0], label, fontsize=6)
    for t in tiers:
        ax.text(-0.55, tier_y[t], f"{t}\n({len(topo.switches(t))})", fontsize=8, ha="right", va="center", color="#555555")
    _legend(ax, kinds_present, nodes_present, _width_samples(bws))
    if any(c2c for _, c2c in segments):
        ax.text(1.005, 0.02, "dashed: NVLink-C2C\n(GPU <-> Grace)", transform=ax.transAxes, fontsize=7.5, va="bottom")
    _margins(fig, fig_w, fig_h)
    return fig


def _margins(fig, fig_w: float, fig_h: float) -> None:
    # Fixed margins in inches (title on top, legend on the right) instead of
    # tight_layout, which would render the whole figure once more.
    fig.subplots_adjust(left=0.9 / fig_w, right=1 - 2.3 / fig_w, top=1 - 0.75 / fig_h, bottom=0.15 / fig_h)


def _round_sig(x: float) -> float:
    return float(f"{x:.2g}")


# --- aggregated view ------------------------------------------------------------------------


GROUP_WORD = {"rail-optimized": "SU", "leaf-spine": "ToR", "fat-tree": "pod"}


def _host_groups(topo: Topology, hosts: list[str]) -> dict[str, list[str]]:
    """Hosts keyed by the leaf group of their first NIC's leaf (SU, ToR or pod), in order; without a fabric, one group per host."""
    g = topo.graph
    word = GROUP_WORD.get((topo.meta.get("fabric") or {}).get("kind"), "group")
    first_nic: dict[str, str] = {}
    for n, d in g.nodes(data=True):
        if d["kind"] is NodeKind.NIC and d.get("host") is not None:
            first_nic.setdefault(d["host"], n)
    groups: dict[str, list[str]] = {}
    for h in hosts:
        key = h
        nic = first_nic.get(h)
        if nic is not None:
            for v in g.successors(nic):
                vd = g.nodes[v]
                if vd["kind"] is NodeKind.SWITCH:
                    key = f"{word} {vd.get('pod', _short(v))}"
                    break
        groups.setdefault(key, []).append(h)
    return groups


def _merge(keys: list[str], limit: int) -> dict[str, str]:
    """Map each key to a column label, merging consecutive keys so that at most ``limit`` columns remain."""
    per = math.ceil(len(keys) / limit) if keys else 1
    out = {}
    for i in range(0, len(keys), per):
        chunk = keys[i : i + per]
        if len(chunk) == 1:
            label = chunk[0]
        else:
            head, _, last = chunk[-1].rpartition(" ")
            label = f"{chunk[0]}-{last}" if head and chunk[0].startswith(head + " ") else f"{chunk[0]} .. {chunk[-1]}"
        for k in chunk:
            out[k] = label
    return out


def _draw_aggregated(topo: Topology, hosts: list[str], title: str | None):
    g = topo.graph
    groups = _host_groups(topo, hosts)
    column_of_group = _merge(list(groups), MAX_COLUMNS)
    columns = list(dict.fromkeys(column_of_group.values()))
    col_index = {c: i for i, c in enumerate(columns)}
    host_column = {h: column_of_group[k] for k, hs in groups.items() for h in hs}

    # Map every device to an aggregate box "<row>|<name>".
    box_of: dict[str, str] = {}
    for n, d in g.nodes(data=True):
        h = d.get("host")
        if h is not None:
            box_of[n] = f"hosts|{host_column[h]}"
    leaf_column: dict[str, str] = {}
    for u, v, d in g.edges(data=True):
        if d["kind"] is LinkKind.NETWORK and g.nodes[u]["kind"] is NodeKind.NIC:
            leaf_column.setdefault(v, host_column[g.nodes[u]["host"]])
    pod_column = {g.nodes[leaf].get("pod"): col for leaf, col in leaf_column.items()}
    for t in TIER_ORDER:
        sws = topo.switches(t)
        for s in sws:
            pod = g.nodes[s].get("pod")
            if t is SwitchTier.LEAF and s in leaf_column:
                box_of[s] = f"{t}|{leaf_column[s]}"
            elif t is not SwitchTier.LEAF and pod is not None and pod in pod_column:
                box_of[s] = f"{t}|{pod_column[pod]}"  # pod-local tiers (fat-tree aggregation) follow their pod
            elif len(sws) <= MAX_COLUMNS:
                box_of[s] = f"{t}|{_short(s)}"
            else:
                box_of[s] = f"{t}|all {len(sws)}"
    # NVSwitch chips of multi-host NVLink domains: one box per domain (merged if there are many).
    domains = list(dict.fromkeys(d.get("domain") or "?" for n, d in g.nodes(data=True) if d["kind"] is NodeKind.NVSWITCH and d.get("host") is None))
    domain_box = _merge([f"domain {dom}" for dom in domains], MAX_COLUMNS)
    for n, d in g.nodes(data=True):
        if d["kind"] is NodeKind.NVSWITCH and d.get("host") is None:
            box_of[n] = f"nvlink|{domain_box['domain ' + (d.get('domain') or '?')]}"

    members: dict[str, list[str]] = defaultdict(list)
    for n, b in box_of.items():
        members[b].append(n)
    flows: dict[tuple[str, str], tuple[LinkKind, float]] = {}
    for u, v, d in g.edges(data=True):
        bu, bv = box_of.get(u), box_of.get(v)
        if bu is None or bv is None or bu == bv:
            continue
        if _rank(bu) > _rank(bv):  # count each duplex cable once: key (upper box, lower box)
            kind, bw = flows.get((bu, bv), (d["kind"], 0.0))
            flows[(bu, bv)] = (kind, bw + d["bw"])
    up_of: dict[str, float] = defaultdict(float)  # network bandwidth from a box towards the tier above
    for (_, lower), (kind, bw) in flows.items():
        if kind is LinkKind.NETWORK:
            up_of[lower] += bw

    # Rows top to bottom: switch tiers, hosts, NVLink domains.
    rows = [t for t in TIER_ORDER if any(b.startswith(f"{t}|") for b in members)] + ["hosts"]
    if domains:
        rows.append("nvlink")
    row_y = {r: 2.3 * (len(rows) - 1 - i) for i, r in enumerate(rows)}
    pitch = 2.6
    total_w = max(len(columns), max(sum(1 for b in members if b.startswith(f"{r}|")) for r in rows)) * pitch
    box_w = 0.86 * pitch
    pos: dict[str, tuple[float, float]] = {}
    span: dict[str, float] = {}
    for r in rows:
        boxes = [b for b in members if b.startswith(f"{r}|")]
        if r == "nvlink":
            for b in boxes:  # under the host columns whose GPUs it links
                xs = sorted({pos[hb][0] for (hb, nb) in flows if nb == b})
                pos[b] = ((xs[0] + xs[-1]) / 2 if xs else total_w / 2, row_y[r])
                span[b] = (xs[-1] - xs[0] + box_w) if xs else box_w
        elif boxes and all(b.split("|", 1)[1] in col_index for b in boxes):
            step = total_w / len(columns)
            for b in boxes:
                pos[b] = ((col_index[b.split("|", 1)[1]] + 0.5) * step, row_y[r])
        else:
            step = total_w / max(len(boxes), 1)
            for i, b in enumerate(boxes):
                pos[b] = ((i + 0.5) * step, row_y[r])

    fig_w = min(28.0, max(10.0, 0.95 * total_w + 3.5))
    fig_h = max(5.0, 1.75 * len(rows) + 1.6)
    fig, ax = plt.subplots(figsize=(fig_w, fig_h))
    ax.set_xlim(-0.3, total_w + 0.3)
    ax.set_ylim(row_y[rows[-1]] - 1.0, row_y[rows[0]] + 0.9)
    ax.axis("off")
    ax.set_title(_title(topo, title) + "\naggregated view: each box is a group of devices; line width and labels give total bandwidth per direction",
                 fontsize=11, loc="left")

    kinds_present: set[LinkKind] = set()
    by_kind: dict[LinkKind, tuple[list, list]] = defaultdict(lambda: ([], []))
    for (bu, bv), (kind, bw) in flows.items():
        segs, widths = by_kind[kind]
        segs.append([pos[bu], pos[bv]])
        widths.append(link_width(bw))
        kinds_present.add(kind)
    for kind, (segs, widths) in by_kind.items():
        ax.add_collection(LineCollection(segs, colors=LINK_STYLE[kind][0], linewidths=widths, alpha=0.6, zorder=1))
    for (bu, bv), (_, bw) in flows.items():
        (x1, y1), (x2, y2) = pos[bu], pos[bv]
        # Vertical lines are always labelled; slanted ones only while few (the boxes' "up" figures sum them).
        if x1 == x2 or len(flows) <= 12:
            f = 0.5 if x1 == x2 else 0.7
            ax.text(x1 + f * (x2 - x1), y1 + f * (y2 - y1), format_bw(bw), fontsize=7, ha="center", va="center",
                    bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.85}, zorder=2)

    nodes_present: set[NodeKind] = set()
    for b, (px, py) in pos.items():
        row, name = b.split("|", 1)
        items = members[b]
        kinds = Counter(g.nodes[n]["kind"] for n in items)
        if row == "hosts":
            hs = {g.nodes[n]["host"] for n in items}
            models = ", ".join(str(m) for m in Counter(g.nodes[n].get("model") for n in items if g.nodes[n]["kind"] is NodeKind.GPU))
            text = f"{name}\n{len(hs)} host{'s' if len(hs) > 1 else ''}, {kinds[NodeKind.GPU]} GPUs\n{models}\n{kinds[NodeKind.NIC]} NICs"
            if up_of.get(b):
                text += f"\nto fabric {format_bw(up_of[b])}"
            _box(ax, px, py, box_w, 1.35, NODE_STYLE[NodeKind.GPU][0], text, fontsize=7.5)
            nodes_present.add(NodeKind.GPU)
        elif row == "nvlink":
            doms = {g.nodes[n].get("domain") for n in items}
            text = f"{name}\n{len(items)} NVSwitch chips" + (f" in {len(doms)} domains" if len(doms) > 1 else "")
            _box(ax, px, py, span[b], 0.8, NODE_STYLE[NodeKind.NVSWITCH][0], text, fontsize=7.5)
            nodes_present.add(NodeKind.NVSWITCH)
        else:
            face = {"core": "#9e9e9e", "spine": "#b5b5b5", "leaf": "#d6d6d6"}[row]
            label = f"{name}\n{len(items)} {row} switches" if len(items) > 1 else name
            if up_of.get(b):
                label += f"\nup {format_bw(up_of[b])}"
            _box(ax, px, py, box_w, 0.85, face, label, fontsize=7.5)
            nodes_present.add(NodeKind.SWITCH)
    for r in rows:
        count = {"hosts": len(hosts), "nvlink": sum(len(members[b]) for b in members if b.startswith("nvlink|"))}.get(r)
        count = len(topo.switches(r)) if count is None else count
        label = {"nvlink": "NVSwitch"}.get(r, r)
        ax.text(-0.25, row_y[r], f"{label}\n({count})", fontsize=8.5, ha="right", va="center", color="#555555")
    _legend(ax, kinds_present, nodes_present, _width_samples(bw for _, bw in flows.values()))
    _margins(fig, fig_w, fig_h)
    return fig


def _rank(box: str) -> int:
    return {"nvlink": -1, "hosts": 0, "leaf": 1, "spine": 2, "core": 3}[box.split("|", 1)[0]]
