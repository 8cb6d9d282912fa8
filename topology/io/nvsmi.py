"""Import the ``nvidia-smi topo -m`` matrix as a one-host :class:`~topology.model.Topology`.

The matrix gives, for every pair of GPUs and NICs, the *class* of the
connection between them (the legend printed under the matrix)::

    X    = self
    SYS  = PCIe plus the SMP interconnect between NUMA nodes (QPI/UPI); older drivers print SOC
    NODE = PCIe plus the interconnect between PCIe host bridges inside one NUMA node
    PHB  = PCIe plus a PCIe host bridge (typically the CPU)
    PXB  = several PCIe bridges, no host bridge
    PIX  = at most one PCIe bridge
    NV#  = a bonded set of # NVLinks

plus ``CPU Affinity``, ``NUMA Affinity`` and (newer drivers) ``GPU NUMA ID``
columns, and a ``NIC Legend`` (``NIC0: mlx5_0``) when NIC columns are named
``NIC#``. Older drivers name NIC columns by device (``mlx5_0``) directly.

What the importer builds (host name: ``host=`` option, else ``user@HOST`` from
a pasted shell prompt or a ``# host: NAME`` line, else ``node0``):

* one CPU node per NUMA node, all pairs joined by an SMP link. NUMA nodes are
  the groups of devices that are not ``SYS`` to each other, labelled by the
  ``NUMA Affinity`` column (or matched by ``CPU Affinity`` when it is absent);
* the PCIe tree: devices that are ``PIX`` to each other share a PCIe switch;
  groups of such switches that are ``PXB`` to each other hang under a common
  parent switch; a device with no ``PIX``/``PXB`` partner sits directly on its
  CPU's root complex. Host bridges are not nodes: ``PHB`` and ``NODE`` both
  become "through the CPU", which is how NCCL models them too (NCCL has no
  NODE class; its ``PHB`` covers both). The host-bridge grouping is kept as
  the ``host_bridge`` attribute of the top PCIe node of each device;
* NVLink: when every GPU pair shows the same ``NV#`` and that many links to
  every peer would exceed what one GPU has (``#`` x (GPUs-1) > links per GPU;
  DGX H100: NV18 between 8 GPUs), the GPUs hang off one NVSwitch node (NCCL
  also collapses NVSwitches into one node) with ``count=#``; otherwise each
  ``NV#`` cell is a direct GPU-GPU link with ``count=#`` (``nvlink=`` forces
  either).

The importer checks the result: the PCIe tree it built must reproduce every
non-NVLink cell of the matrix, else the matrix is inconsistent and the error
names the pair. With :mod:`topology.paths` the NCCL class of every GPU pair is
then the matrix code mapped by :data:`NVSMI_TO_NCCL` (``NV#`` -> ``NVL``,
``NODE`` -> ``PHB``).

Bandwidths are not in the matrix and come from :mod:`topology.hardware`:

* ``gpu_model``: the matrix does not name it. Default from the ``nvidia-smi -L``
  lines in the same file if there are any (``nvidia-smi -L; nvidia-smi topo -m``:
  ``GPU 0: NVIDIA L40S (UUID: ...)``; a model not in
  :data:`topology.hardware.GPU_SPECS` is refused), else from ``NV#`` (NV18 ->
  H100-SXM5-80GB, NV12 -> A100-SXM4-80GB), else H100-SXM5-80GB with a
  :class:`UserWarning` (``netweave topo import`` prints it as a note). The
  topology's ``imported`` metadata records where it came from (``gpu_model_from``);
* ``pcie_gen``: default by model (5 for H100/B200, 4 for A100/L40S), x16;
* ``cpu``: inter-socket link, default by model (sapphire-rapids for H100,
  amd for A100, emerald-rapids for B200);
* ``nic_gbps``: NIC line rate, default 400;
* ``nccl_model``: use NCCL's figures (NVLink per link by SM, PCIe
  width x speed / 80) instead of spec-sheet rates.

>>> text = '''
...         GPU0    GPU1    NIC0    CPU Affinity    NUMA Affinity
... GPU0     X      NV4     PIX     0-15            0
... GPU1    NV4      X      SYS     16-31           1
... NIC0    PIX     SYS      X
...
... NIC Legend:
...
...   NIC0: mlx5_0
... '''
>>> topo = parse_nvidia_smi(text, host="box", gpu_model="H100-SXM5-80GB")
>>> topo.gpus(), topo.graph.nodes["box/nic0"]["name"], topo.graph.nodes["box/gpu1"]["numa"]
(['box/gpu0', 'box/gpu1'], 'mlx5_0', 1)
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from typing import Any

from .. import hardware as hw
from ..errors import InputError, TopologyError
from ..inputs import check_name
from ..limits import MAX_NVLINK_LANES
from ..model import LinkKind, NodeKind, Topology

__all__ = ["NVSMI_TO_NCCL", "nvsmi_to_nccl", "parse_nvidia_smi", "read_matrix"]

# nvidia-smi code -> NCCL path type name (topology.paths.PathType).
NVSMI_TO_NCCL = {"X": "LOC", "NV": "NVL", "PIX": "PIX", "PXB": "PXB", "PHB": "PHB", "NODE": "PHB", "SYS": "SYS", "SOC": "SYS"}

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_CODE = re.compile(r"\s*(X|NV\d+|PIX|PXB|PHB|NODE|SYS|SOC)")  # \s: tabs, spaces, and the no-break spaces of web pastes
_AFFINITY_COLUMNS = (("GPU", "NUMA", "ID"), ("CPU", "Affinity"), ("NUMA", "Affinity"))
_PCIE_CODES = ("PIX", "PXB", "PHB", "NODE", "SYS")

# Per GPU architecture (SM): PCIe generation, CPU of the usual HGX host, spec NVLink rate per link, NVLinks per GPU.
_ARCH_DEFAULTS = {
    80: (4, "amd", hw.NVLINK3_BW_PER_LINK, hw.NVLINK3_LINKS_PER_A100),
    89: (4, "amd", None, 0),
    90: (5, "sapphire-rapids", hw.NVLINK4_BW_PER_LINK, hw.NVLINK4_LINKS_PER_H100),
    100: (5, "emerald-rapids", hw.NVLINK5_BW_PER_LINK, hw.NVLINK5_LINKS_PER_B200),
}
_MODEL_BY_NVLINKS = {18: "H100-SXM5-80GB", 12: "A100-SXM4-80GB"}
_LISTED_GPU = re.compile(r"^\s*GPU\s+(\d+):\s*(.+?)\s*\(UUID:", re.M)  # a line of `nvidia-smi -L`
# Words of nvidia-smi's product names -> GPU_SPECS keys; the first rule whose words all occur wins.
_MODEL_BY_NAME = (
    (("GB200",), "B200-GB200-186GB"),
    (("B200",), "B200-180GB"),
    (("H100", "HBM3"), "H100-SXM5-80GB"),
    (("H100", "SXM"), "H100-SXM5-80GB"),
    (("A100", "SXM4", "80GB"), "A100-SXM4-80GB"),
    (("L40S",), "L40S-48GB"),
)


def listed_gpu_model(text: str, source: str | None = None) -> str | None:
    """The GPU model named by ``nvidia-smi -L`` lines in ``text``, as a :data:`~topology.hardware.GPU_SPECS` key (None without such lines).

    >>> listed_gpu_model("GPU 0: NVIDIA L40S (UUID: GPU-1)\\nGPU 1: NVIDIA L40S (UUID: GPU-2)")
    'L40S-48GB'
    >>> listed_gpu_model("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1)"), listed_gpu_model("no list here")
    ('H100-SXM5-80GB', None)
    >>> listed_gpu_model("GPU 0: NVIDIA GeForce RTX 4090 (UUID: GPU-1)")
    Traceback (most recent call last):
    ...
    topology.errors.InputError: line 1: GPU model 'NVIDIA GeForce RTX 4090' is not in the hardware table; ...
    """
    names = {m.group(2): text.count("\n", 0, m.start()) + 1 for m in _LISTED_GPU.finditer(text)}
    models = set()
    for name, line in names.items():
        words = name.upper().replace("-", " ").split()
        model = next((key for need, key in _MODEL_BY_NAME if all(any(w.startswith(n) for w in words) for n in need)), None)
        if model is None:
            raise InputError(f"GPU model {name!r} is not in the hardware table; pass gpu_model (--gpu-model), one of {', '.join(hw.GPU_SPECS)}",
                             source=source, where=line)
        models.add(model)
    if len(models) > 1:
        raise InputError(f"the nvidia-smi -L lines name several GPU models ({', '.join(sorted(models))}); one model per host: "
                         "pass gpu_model (--gpu-model)", source=source)
    return models.pop() if models else None


def nvsmi_to_nccl(code: str) -> str:
    """The NCCL path type name for an nvidia-smi matrix code.

    >>> nvsmi_to_nccl("NV18"), nvsmi_to_nccl("NODE"), nvsmi_to_nccl("PIX")
    ('NVL', 'PHB', 'PIX')
    """
    return NVSMI_TO_NCCL["NV" if code.startswith("NV") and code != "NODE" else code]


@dataclass
class Matrix:
    """The parsed matrix: device labels in column order, codes, affinities and the line of each row."""

    devices: list[str]
    codes: dict[tuple[str, str], str]
    affinity: dict[str, dict[str, str]] = field(default_factory=dict)
    nic_names: dict[str, str] = field(default_factory=dict)
    row_line: dict[str, int] = field(default_factory=dict)
    host: str | None = None

    def is_gpu(self, dev: str) -> bool:
        return re.fullmatch(r"GPU\d+", dev) is not None


def _header_columns(tokens: list[str]) -> tuple[list[str], list[str]]:
    devices, extra = [], []
    i = 0
    while i < len(tokens):
        for name in _AFFINITY_COLUMNS:
            if tuple(tokens[i : i + len(name)]) == name:
                extra.append(" ".join(name))
                i += len(name)
                break
        else:
            if extra:
                raise InputError(f"device column {tokens[i]!r} after the affinity columns")
            devices.append(tokens[i])
            i += 1
    return devices, extra


def read_matrix(text: str, source: str | None = None) -> Matrix:
    """Parse the text of ``nvidia-smi topo -m`` into a :class:`Matrix` (no topology yet).

    Tolerates ANSI escapes, tabs or spaces, and cells printed without a
    separator (``PIXNODE``, ``NV18SYS``).
    """
    text = text.lstrip("\ufeff")  # a byte-order mark from Windows editors
    lines = [_ANSI.sub("", raw).replace("\r", "") for raw in text.splitlines()]
    host = None
    for line in lines:
        m = re.match(r"^\s*(?:\[)?[\w.-]+@([\w.-]+)[^\n]*nvidia-smi", line) or re.match(r"^\s*#\s*host(?:name)?\s*[:=]\s*(\S+)", line, re.I)
        if m:
            host = m.group(1)
            break
    header_at = next((i for i, line in enumerate(lines) if "GPU0" in line.split()), None)
    if header_at is None:
        raise InputError("no matrix header (a line naming GPU0 ...); expected the output of `nvidia-smi topo -m`", source=source)
    try:
        devices, extra = _header_columns(lines[header_at].split())
    except InputError as exc:
        raise InputError(exc.message, source=source, where=header_at + 1) from None
    if len(set(devices)) != len(devices):
        raise InputError("a device column appears twice in the header", source=source, where=header_at + 1)
    matrix = Matrix(devices, {}, host=host)
    wanted = set(devices)
    for i in range(header_at + 1, len(lines)):
        line = lines[i]
        tokens = line.split()
        if not tokens:
            continue
        label = tokens[0]
        if label not in wanted:
            if len(matrix.row_line) == len(devices) or label.rstrip(":") in ("Legend", "NIC"):
                break
            pending = ", ".join(sorted(wanted - set(matrix.row_line)))
            raise InputError(f"expected a matrix row for one of {pending}, got {label!r}", source=source, where=i + 1)
        if label in matrix.row_line:
            raise InputError(f"second row for {label} (first on line {matrix.row_line[label]})", source=source, where=i + 1)
        matrix.row_line[label] = i + 1
        rest = line.split(label, 1)[1]
        pos = 0
        for col in devices:
            m = _CODE.match(rest, pos)
            if not m:
                got = rest[pos:].split()
                raise InputError(
                    f"row {label}, column {col}: expected X, NV#, PIX, PXB, PHB, NODE or SYS, got {got[0] if got else 'end of line'!r}",
                    source=source, where=i + 1,
                )
            code = m.group(1)
            if code.startswith("NV") and code != "NODE" and not 1 <= int(code[2:]) <= MAX_NVLINK_LANES:
                raise InputError(f"row {label}, column {col}: expected NV1..NV{MAX_NVLINK_LANES} (bonded NVLinks), got {code}",
                                 source=source, where=i + 1)
            matrix.codes[(label, col)] = code
            pos = m.end()
        values = rest[pos:].split()
        if len(values) > len(extra):
            raise InputError(
                f"row {label}: {len(values) - len(extra)} cell(s) more than the header has columns: {values[len(extra):]}", source=source, where=i + 1
            )
        matrix.affinity[label] = dict(zip(extra, values, strict=False))
    missing = [d for d in devices if d not in matrix.row_line]
    if missing:
        raise InputError(f"no matrix row for {', '.join(missing)}", source=source)
    for m in re.finditer(r"^\s*(NIC\d+)\s*:\s*(\S+)\s*$", "\n".join(lines), re.M):
        matrix.nic_names[m.group(1)] = m.group(2)
    _check_matrix(matrix, source)
    return matrix


def _check_matrix(matrix: Matrix, source: str | None) -> None:
    for a in matrix.devices:
        line = matrix.row_line[a]
        if a.startswith("GPU") and not matrix.is_gpu(a):
            raise InputError(f"bad GPU column name {a!r}; expected GPU<number>", source=source, where=line)
        for b in matrix.devices:
            code = matrix.codes[(a, b)]
            if (a == b) != (code == "X"):
                raise InputError(f"row {a}, column {b}: {code!r} {'on' if a == b else 'off'} the diagonal (X means self)", source=source, where=line)
            if code.startswith("NV") and code != "NODE":
                if not (matrix.is_gpu(a) and matrix.is_gpu(b)):
                    raise InputError(f"row {a}, column {b}: NVLink code {code} between a GPU and a NIC", source=source, where=line)
                if int(code[2:]) < 1:
                    raise InputError(f"row {a}, column {b}: {code} names no NVLinks", source=source, where=line)
            other = matrix.codes[(b, a)]
            if _canon(other) != _canon(code):
                raise InputError(f"row {a}, column {b} says {code} but row {b}, column {a} says {other}", source=source, where=line)


def _canon(code: str) -> str:
    return "SYS" if code == "SOC" else code


class _UF:
    def __init__(self, items: list[str]):
        self.p = {x: x for x in items}

    def find(self, x: str) -> str:
        while self.p[x] != x:
            self.p[x] = self.p[self.p[x]]
            x = self.p[x]
        return x

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.p[rb] = ra

    def groups(self, items: list[str]) -> list[list[str]]:
        out: dict[str, list[str]] = {}
        for x in items:
            out.setdefault(self.find(x), []).append(x)
        return list(out.values())


def _grouped(devices: list[str], codes: dict[tuple[str, str], str], joining: tuple[str, ...]) -> list[list[str]]:
    uf = _UF(devices)
    for a in devices:
        for b in devices:
            if a < b and _canon(codes[(a, b)]) in joining:
                uf.union(a, b)
    return uf.groups(devices)


def _int_or_none(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() else None


def _assign_numa(matrix: Matrix, source: str | None) -> dict[str, int]:
    """NUMA node of every device: groups not SYS-separated, labelled by NUMA (or CPU) affinity."""
    codes = matrix.codes
    groups = _grouped(matrix.devices, codes, ("PIX", "PXB", "PHB", "NODE"))
    labels: list[int | str | None] = []
    for g in groups:
        found: dict[int | str, str] = {}
        for dev in g:
            aff = matrix.affinity.get(dev, {})
            numa = _int_or_none(aff.get("NUMA Affinity"))
            key: int | str | None = numa if numa is not None else (f"cpus:{aff['CPU Affinity']}" if aff.get("CPU Affinity", "N/A") != "N/A" else None)
            if key is not None:
                found.setdefault(key, dev)
        numeric = {k: d for k, d in found.items() if isinstance(k, int)}
        if len(numeric) > 1:
            (n1, d1), (n2, d2) = list(numeric.items())[:2]
            raise TopologyError(
                f"{d1} and {d2} share a NUMA node by the matrix ({_canon(codes[(d1, d2)])}) but report NUMA affinity {n1} and {n2}",
                source=source, where=matrix.row_line[d2],
            )
        labels.append(next(iter(numeric)) if numeric else (next(iter(found)) if found else None))
    sys_between = set()
    for i, gi in enumerate(groups):
        for j, gj in enumerate(groups):
            if i < j and any(_canon(codes[(a, b)]) == "SYS" for a in gi for b in gj):
                sys_between.add((i, j))
                sys_between.add((j, i))
    numa_of_group: dict[int, int] = {}
    used_numbers = {lab for lab in labels if isinstance(lab, int)}
    by_label: dict[int | str, int] = {}
    next_free = 0
    for i, lab in enumerate(labels):
        if isinstance(lab, int):
            numa_of_group[i] = lab
        elif isinstance(lab, str):
            if lab not in by_label:
                while next_free in used_numbers:
                    next_free += 1
                by_label[lab] = next_free
                used_numbers.add(next_free)
            numa_of_group[i] = by_label[lab]
    for i, lab in enumerate(labels):
        if lab is None:
            # No affinity at all: join the first NUMA node it is not SYS-separated from.
            taken = sorted(set(numa_of_group.values()))
            for numa in taken:
                if not any(numa_of_group.get(j) == numa and (i, j) in sys_between for j in range(len(groups))):
                    numa_of_group[i] = numa
                    break
            else:
                numa_of_group[i] = max(taken, default=-1) + 1
    for i, j in sys_between:
        if numa_of_group[i] == numa_of_group[j]:
            a, b = next((a, b) for a in groups[i] for b in groups[j] if _canon(codes[(a, b)]) == "SYS")
            raise TopologyError(
                f"{a} and {b} are SYS (different NUMA nodes) but report the same NUMA affinity {numa_of_group[i]}",
                source=source, where=matrix.row_line[b],
            )
    return {dev: numa_of_group[i] for i, g in enumerate(groups) for dev in g}


def _natural(label: str) -> tuple:
    return tuple((0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", label) if t)


def parse_nvidia_smi(
    text: str,
    source: str | None = None,
    *,
    host: str | None = None,
    gpu_model: str | None = None,
    pcie_gen: int | None = None,
    cpu: str | None = None,
    nic_gbps: float = 400,
    nccl_model: bool = False,
    nvlink: str = "auto",
) -> Topology:
    """Build a one-host topology from ``nvidia-smi topo -m`` text (see the module docstring for the rules).

    ``nvlink`` is ``"auto"``, ``"nvswitch"`` or ``"direct"``.
    """
    if nvlink not in ("auto", "nvswitch", "direct"):
        raise InputError(f"nvlink must be auto, nvswitch or direct, got {nvlink!r}", source=source)
    hw.nic_bw(nic_gbps)  # the line rate is checked even though one host has no network link to give it
    matrix = read_matrix(text, source)
    host = check_name(host or matrix.host or "node0", what="host name", source=source, where="host")
    codes = matrix.codes
    gpus = sorted((d for d in matrix.devices if matrix.is_gpu(d)), key=_natural)
    nics = [d for d in matrix.devices if not matrix.is_gpu(d)]
    if not gpus:
        raise InputError("the matrix has no GPU rows", source=source)
    nv_counts = {(a, b): int(codes[(a, b)][2:]) for a in gpus for b in gpus if a != b and codes[(a, b)].startswith("NV") and codes[(a, b)] != "NODE"}

    model_from = "given"
    if gpu_model is None:
        uniform = set(nv_counts.values())
        gpu_model, model_from = listed_gpu_model(text, source), "nvidia-smi -L"
        if gpu_model is None and len(uniform) == 1 and next(iter(uniform)) in _MODEL_BY_NVLINKS:
            count = next(iter(uniform))
            gpu_model, model_from = _MODEL_BY_NVLINKS[count], f"NV{count} links"
        if gpu_model is None:
            gpu_model, model_from = "H100-SXM5-80GB", "default"
            warnings.warn(f"{source or 'nvidia-smi matrix'}: the GPU model is not in the dump; assumed {gpu_model}. Pass --gpu-model "
                          "(gpu_model=) or put the output of `nvidia-smi -L` in the same file", UserWarning, stacklevel=2)
    if gpu_model not in hw.GPU_SPECS:
        raise InputError(f"unknown gpu_model {gpu_model!r}; expected one of {', '.join(hw.GPU_SPECS)}", source=source)
    spec = hw.GPU_SPECS[gpu_model]
    default_gen, default_cpu, nvlink_spec, links_per_gpu = _ARCH_DEFAULTS.get(spec["sm"], (5, "sapphire-rapids", hw.NVLINK4_BW_PER_LINK, 18))
    pcie_gen = pcie_gen or default_gen
    cpu = cpu or default_cpu
    if cpu not in hw.CPU_INTERCONNECT_BW:
        raise InputError(f"unknown cpu {cpu!r}; expected one of {', '.join(hw.CPU_INTERCONNECT_BW)}", source=source)
    if pcie_gen not in hw.PCIE_X16_BW:
        raise InputError(f"unsupported pcie_gen {pcie_gen!r}; expected one of {', '.join(map(str, hw.PCIE_X16_BW))}", source=source)
    per_link = hw.NCCL_NVLINK_BW_PER_LINK.get(spec["sm"]) if nccl_model else nvlink_spec
    if nv_counts and not per_link:
        raise InputError(f"the matrix shows NVLink but gpu_model {gpu_model} has none", source=source)
    pcie = hw.pcie_bw(pcie_gen, 16, nccl_model=nccl_model)

    uniform_nv = len(set(nv_counts.values())) == 1 and len(nv_counts) == len(gpus) * (len(gpus) - 1)
    if nvlink == "auto":
        count = next(iter(nv_counts.values()), 0)
        use_switch = uniform_nv and len(gpus) >= 3 and count * (len(gpus) - 1) > links_per_gpu
    else:
        use_switch = nvlink == "nvswitch"
        if use_switch and nv_counts and not uniform_nv:
            raise InputError("nvlink='nvswitch' needs every GPU pair to show the same NV# code", source=source)

    numa = _assign_numa(matrix, source)
    topo = Topology(
        f"{host}-nvidia-smi",
        imported={"format": "nvidia-smi", "source": source, "gpu_model": gpu_model, "gpu_model_from": model_from, "pcie_gen": pcie_gen, "cpu": cpu,
                  "nic_gbps": nic_gbps, "nccl_model": nccl_model, "nvlink": ("nvswitch" if use_switch else "direct") if nv_counts else "none"},
    )
    cpu_ids = {}
    for n in sorted(set(numa.values())):
        cpu_ids[n] = topo.add_node(f"{host}/cpu{n}", NodeKind.CPU, host=host, numa=n, arch=cpu)
    nvs = topo.add_node(f"{host}/nvs0", NodeKind.NVSWITCH, host=host, index=0, domain=host) if use_switch and nv_counts else None

    # PCIe tree, NUMA node by NUMA node: host-bridge groups > PXB groups > PIX groups.
    parent: dict[str, str] = {}  # device or switch -> its PCIe parent
    host_bridge: dict[str, int] = {}
    switch_ids: list[tuple[str, int]] = []
    for n in sorted(set(numa.values())):
        members = [d for d in matrix.devices if numa[d] == n]
        for hb, bridge_group in enumerate(_grouped(members, codes, ("PIX", "PXB", "PHB"))):
            for pxb_group in _grouped(bridge_group, codes, ("PIX", "PXB")):
                pix_groups = _grouped(pxb_group, codes, ("PIX",))
                if len(pix_groups) == 1 and len(pix_groups[0]) == 1:
                    parent[pix_groups[0][0]] = cpu_ids[n]
                    host_bridge[pix_groups[0][0]] = hb
                    continue
                top = f"{host}/pcie{len(switch_ids)}"
                switch_ids.append((top, n))
                parent[top] = cpu_ids[n]
                host_bridge[top] = hb
                if len(pix_groups) == 1:
                    for dev in pix_groups[0]:
                        parent[dev] = top
                    continue
                for group in pix_groups:
                    sw = f"{host}/pcie{len(switch_ids)}"
                    switch_ids.append((sw, n))
                    parent[sw] = top
                    for dev in group:
                        parent[dev] = sw
    for k, (sw, n) in enumerate(switch_ids):
        attrs: dict[str, Any] = {"index": k, "numa": n}
        if sw in host_bridge:
            attrs["host_bridge"] = host_bridge[sw]
        topo.add_node(sw, NodeKind.PCIE_SWITCH, host=host, **attrs)

    node_id: dict[str, str] = {}
    for g in gpus:
        i = int(g[3:])
        aff = matrix.affinity.get(g, {})
        attrs = {"index": i, "model": gpu_model, "numa": numa[g], "memory_gib": spec["memory_gib"], "tflops": spec["tflops_bf16"]}
        if nv_counts:
            attrs["domain"] = host
        if aff.get("CPU Affinity") not in (None, "N/A"):
            attrs["cpu_affinity"] = aff["CPU Affinity"]
        if g in host_bridge:
            attrs["host_bridge"] = host_bridge[g]
        node_id[g] = topo.add_node(f"{host}/gpu{i}", NodeKind.GPU, host=host, **attrs)
    for j, nic in enumerate(nics):
        index = int(nic[3:]) if re.fullmatch(r"NIC\d+", nic) else j
        name = matrix.nic_names.get(nic, nic)
        attrs = {"index": index, "name": name, "numa": numa[nic], "speed_gbps": float(nic_gbps)}
        if nic in host_bridge:
            attrs["host_bridge"] = host_bridge[nic]
        if f"{host}/nic{index}" in topo.graph:
            raise InputError(f"two NIC columns map to {host}/nic{index}", source=source, where=matrix.row_line[nic])
        node_id[nic] = topo.add_node(f"{host}/nic{index}", NodeKind.NIC, host=host, **attrs)

    cpus = list(cpu_ids.values())
    for a in range(len(cpus)):
        for b in range(a + 1, len(cpus)):
            topo.add_link(cpus[a], cpus[b], LinkKind.CPU, hw.CPU_INTERCONNECT_BW[cpu], latency_us=hw.LATENCY_US["cpu"])
    for child, up in parent.items():
        topo.add_link(node_id.get(child, child), up, LinkKind.PCIE, pcie, latency_us=hw.LATENCY_US["pcie"])
    if nvs is not None:
        count = next(iter(nv_counts.values()))
        for g in gpus:
            topo.add_link(node_id[g], nvs, LinkKind.NVLINK, count * per_link, latency_us=hw.LATENCY_US["nvlink"] / 2, count=count)
    else:
        for (a, b), count in nv_counts.items():
            if _natural(a) < _natural(b):
                topo.add_link(node_id[a], node_id[b], LinkKind.NVLINK, count * per_link, latency_us=hw.LATENCY_US["nvlink"], count=count)

    _verify_tree(matrix, parent, numa, host_bridge, cpu_ids, source)
    return topo


def _verify_tree(
    matrix: Matrix, parent: dict[str, str], numa: dict[str, int], host_bridge: dict[str, int], cpu_ids: dict[int, str], source: str | None
) -> None:
    """The built PCIe tree must give back every PCIe cell of the matrix; a mismatch means the matrix is no tree."""
    roots = set(cpu_ids.values())

    def chain(dev: str) -> list[str]:
        out = [dev]
        while out[-1] not in roots:
            out.append(parent[out[-1]])
        return out

    chains = {d: chain(d) for d in matrix.devices}
    for a in matrix.devices:
        for b in matrix.devices:
            code = _canon(matrix.codes[(a, b)])
            if a >= b or code not in _PCIE_CODES:
                continue
            if numa[a] != numa[b]:
                implied = "SYS"
            else:
                ca, cb = chains[a], chains[b]
                common = next(x for x in ca if x in cb)
                if common in roots:
                    implied = "PHB" if host_bridge[ca[-2]] == host_bridge[cb[-2]] else "NODE"
                else:
                    bridges = ca.index(common) + cb.index(common) - 1
                    implied = "PIX" if bridges <= 1 else "PXB"
            if implied != code:
                raise TopologyError(
                    f"{a}-{b} is {code} in the matrix, but the PCIe tree implied by the other cells gives {implied}; the matrix is inconsistent",
                    source=source, where=matrix.row_line[a],
                )
