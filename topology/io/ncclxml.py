"""NCCL's topology XML (``NCCL_TOPO_DUMP_FILE`` / ``NCCL_TOPO_FILE``): import and export.

The file is the XML that NCCL builds from sysfs and NVML before it searches
rings and trees::

    <system version="1">
      <cpu host_hash="0x..." numaid="0" affinity="..." arch="x86_64" vendor="GenuineIntel" familyid="6" modelid="143">
        <pci busid="0000:18:00.0" class="0x060400" link_speed="32.0 GT/s PCIe" link_width="16">      (a PCIe switch)
          <pci busid="0000:1b:00.0" class="0x030200" link_speed="32.0 GT/s PCIe" link_width="16">    (a GPU)
            <gpu dev="0" sm="90" rank="0" gdr="1">
              <nvlink target="0000:05:00.0" count="5" tclass="0x068000"/>                             (to an NVSwitch)
            </gpu>
          </pci>
          <pci busid="0000:1c:00.0" class="0x020700" link_speed="32.0 GT/s PCIe" link_width="16">    (a NIC)
            <nic><net name="mlx5_0" dev="0" speed="400000" port="1" latency="0.0" guid="0x..." maxconn="131072" gdr="1"/></nic>
          </pci>
        </pci>
      </cpu>
    </system>

Import (:func:`parse_nccl_xml`) follows NCCL's own reading (``src/graph/topo.cc``):

* every ``<cpu>`` is a NUMA node; ``<cpu>`` elements with different
  ``host_hash`` values are different hosts (``node0``, ``node1``... in order of
  appearance; one host takes the ``host=`` name). CPUs of one host are joined
  pairwise by an SMP link at NCCL's inter-socket rate for the CPU model
  (Intel by family/model: Broadwell 6, Skylake 10, Sapphire Rapids 22,
  Emerald Rapids 40 GB/s; AMD 16; POWER9 32; ARM 6; Zhaoxin 6 or 9);
* a ``<pci>`` holding a ``<gpu>`` is a GPU, one holding a ``<nic>`` gives one
  NIC per ``<net>`` (port), any other ``<pci>`` with ``<pci>`` children or a
  bridge class (``0x0604..``) is a PCIe switch. Leaf PCI devices that are none
  of these (NVMe drives...) are left out: no GPU or NIC path crosses them;
* each PCI element's link to its parent runs at NCCL's ``link_width x speed /
  80`` GB/s (Gen4 x16 = 24, Gen5 x16 = 48), speed from ``link_speed`` (an empty
  speed falls back to NCCL's Gen3 value, a width of 0 to 16);
* ``<nvlink>``: ``tclass`` ``0x068000`` (and any class NCCL does not recognise)
  targets an NVSwitch (one node per distinct target bus id; NCCL collapses all
  into one NVS node, which gives the same classes and the same per-GPU NVLink
  bandwidth), ``0x03....`` a peer GPU (a one-way link; the peer lists its own),
  ``0x068001`` the local CPU. Bandwidth is ``count x`` NCCL's per-link figure
  for the GPU's ``sm`` (SM80 20, SM86 12, SM90 20.6, SM100 40.1 GB/s);
* NIC line rate is ``speed`` Mb/s (``speed_gbps = speed / 1000``; NCCL's
  ``speed / 8000`` GB/s is what the fabric builders derive from it). ``<nic>``
  directly under ``<cpu>`` (no PCI device: sockets, virtual NICs) attaches to
  its CPU at NCCL's ``LOC_BW`` of 5000 GB/s and is marked ``virtual``.

Like NCCL (``ncclTopoFlattenBcmSwitches``), the second level of a two-level
Broadcom PEX Gen4/Gen5 switch (recognised by its PCI ids) is merged into the
first, so devices behind it read PIX to each other, not PXB.

Deliberate differences from NCCL: ports of a multi-port NIC are separate NIC
nodes with their own copy of the PCI link (NCCL shares one);
``<pcilink>`` elements are ignored; multi-node NVLink domains are not read
(NVSwitches belong to the host whose GPUs name them). ``<c2c bw count>``
(NVLink-C2C to the local CPU on Grace systems; ``bw x count / 1000`` GB/s) becomes
the GPU's host link, kind ``pcie`` with ``c2c=True`` as in
:mod:`topology.builders`, replacing the PCI link when the GPU sits directly
on its CPU. Everything else the XML says
(bus ids, PCI ids, NCCL's GPU/NET attributes, CPU affinity) is kept on the
nodes (``busid``, ``pci``, ``nccl``) so that an exported file repeats it.

Export (:func:`to_nccl_xml`) writes one host. Rates become ``link_speed`` /
``link_width`` (the PCIe generation and width whose NCCL or spec-sheet rate
matches the link), NVLink ``count`` comes from the link, bus ids are kept or
synthesised in tree order. Because NCCL's XML carries only widths and
speeds, a re-import has NCCL's rates: a topology built with
``nccl_model=True`` round-trips exactly.

>>> from topology import build_node
>>> xml = to_nccl_xml(build_node("dgx-h100", nccl_model=True))
>>> again = parse_nccl_xml(xml)
>>> len(again.gpus()), len(again.nodes("nic")), again.graph.nodes["node0/gpu5"]["numa"]
(8, 8, 1)
"""

from __future__ import annotations

import hashlib
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Any

from .. import hardware as hw
from ..errors import InputError, TopologyError
from ..inputs import check_name
from ..model import LinkKind, NodeKind, Topology

__all__ = ["NCCL_CPU_BW", "NCCL_LOC_BW", "nccl_nvlink_bw", "parse_nccl_xml", "to_nccl_xml"]

# NCCL's inter-CPU bandwidths (src/graph/topo.h: QPI_BW 6, SKL_QPI_BW 10, SRP_QPI_BW 22, ERP_QPI_BW 40,
# AMD_BW 16, P9_BW 32, ARM_BW 6, ZPI_BW 6, YONGFENG_ZPI_BW 9), keyed by our CPU names.
NCCL_CPU_BW = {
    "broadwell": 6.0, "skylake": 10.0, "sapphire-rapids": 22.0, "emerald-rapids": 40.0, "amd": 16.0,
    "power9": 32.0, "arm": 6.0, "zhaoxin": 6.0, "yongfeng": 9.0, "grace": 6.0,
}
NCCL_LOC_BW = 5000.0  # LOC_BW: what NCCL gives a link that is no wire (a NIC without a PCI device)

# Per-lane speed in 100 Mb/s units by transfer rate (kvDictPciGen); 60 (Gen3) is NCCL's fallback.
_PCI_SPEED_BY_GTS = {2.5: 15, 5.0: 30, 8.0: 60, 16.0: 120, 32.0: 240, 64.0: 480}
_NCCL_FALLBACK_SPEED = 60
_GEN_BY_SPEED = {15: 1, 30: 2, 60: 3, 120: 4, 240: 5, 480: 6}

# x86 identity written for our CPU names (family/model at the thresholds NCCL tests: SKL >= 0x55, SRP >= 0x8F, ERP >= 0xCF).
_CPU_IDENTITY = {
    "broadwell": {"arch": "x86_64", "vendor": "GenuineIntel", "familyid": "6", "modelid": "79"},
    "skylake": {"arch": "x86_64", "vendor": "GenuineIntel", "familyid": "6", "modelid": "85"},
    "sapphire-rapids": {"arch": "x86_64", "vendor": "GenuineIntel", "familyid": "6", "modelid": "143"},
    "emerald-rapids": {"arch": "x86_64", "vendor": "GenuineIntel", "familyid": "6", "modelid": "207"},
    "amd": {"arch": "x86_64", "vendor": "AuthenticAMD", "familyid": "23", "modelid": "49"},
    "power9": {"arch": "ppc64"},
    "arm": {"arch": "arm64"},
    "grace": {"arch": "arm64"},
    "zhaoxin": {"arch": "x86_64", "vendor": "CentaurHauls", "familyid": "7", "modelid": "59"},
    "yongfeng": {"arch": "x86_64", "vendor": "CentaurHauls", "familyid": "7", "modelid": "91"},
}
_PCI_DEVICE_IDS = {"H100-SXM5-80GB": "0x2330", "A100-SXM4-80GB": "0x20b2"}
_NVS_CLASS, _CPU_CLASS, _GPU_CLASS, _BRIDGE_CLASS, _IB_CLASS = "0x068000", "0x068001", "0x030200", "0x060400", "0x020700"
_BUSID = re.compile(r"^[0-9a-fA-F]{1,8}:[0-9a-fA-F]{1,2}:[0-9a-fA-F]{1,2}\.[0-9a-fA-F]$")
_PCI_KEYS = ("class", "vendor", "device", "subsystem_vendor", "subsystem_device", "link_speed", "link_width")


def nccl_nvlink_bw(sm: int) -> float:
    """NCCL's NVLink bandwidth per link for a compute capability (``ncclTopoNVLinkBw``).

    >>> nccl_nvlink_bw(90), nccl_nvlink_bw(89), nccl_nvlink_bw(100)
    (20.6, 20.0, 40.1)
    """
    table = hw.NCCL_NVLINK_BW_PER_LINK
    if sm >= 100:
        return table[100]
    if sm >= 90:
        return table[90]
    if sm == 86:
        return table[86]
    for floor in (80, 70, 60):
        if sm >= floor:
            return table[floor]
    return table[80]


def _model_for_sm(sm: int) -> str | None:
    return next((m for m, s in hw.GPU_SPECS.items() if s["sm"] == sm), None)


# --- import ------------------------------------------------------------------------------------


@dataclass
class _Host:
    name: str
    cpus: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    switches: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    gpus: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    nics: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    pcie_links: list[tuple[str, str, float, dict[str, Any]]] = field(default_factory=list)
    nvlinks: list[tuple[str, str, str, int, str]] = field(default_factory=list)  # gpu, target busid, tclass, count, where
    c2c: dict[str, tuple[float, str]] = field(default_factory=dict)  # gpu -> (GB/s, its CPU)
    by_busid: dict[str, str] = field(default_factory=dict)


class _Reader:
    def __init__(self, source: str | None):
        self.source = source

    def fail(self, where: str, message: str) -> InputError:
        return TopologyError(message, source=self.source, where=where)

    def attr(self, el: ET.Element, name: str, where: str) -> str:
        value = el.get(name)
        if value is None:
            raise self.fail(where, f'missing attribute "{name}"')
        return value

    def int_attr(self, el: ET.Element, name: str, where: str, default: int | None = None) -> int:
        value = el.get(name)
        if value is None:
            if default is not None:
                return default
            raise self.fail(where, f'missing attribute "{name}"')
        try:
            return int(value, 0)
        except ValueError:
            raise self.fail(where, f'attribute "{name}" must be an integer, got {value!r}') from None

    def pci_bw(self, el: ET.Element, where: str) -> tuple[float, int, int]:
        width = self.int_attr(el, "link_width", where)
        speed_text = self.attr(el, "link_speed", where).strip()
        if width == 0:
            width = 16  # NCCL: "Manage cases where speed was not indicated in /sys"
        if width < 0:
            raise self.fail(where, f'attribute "link_width" must be positive, got {width}')
        if not speed_text:
            speed = _NCCL_FALLBACK_SPEED
        else:
            m = re.match(r"^([\d.]+)\s*GT/s(\s+PCIe)?$", speed_text)
            speed = _PCI_SPEED_BY_GTS.get(float(m.group(1))) if m else None
            if speed is None:
                raise self.fail(where, f'attribute "link_speed" {speed_text!r} is not a PCIe rate; expected e.g. "32.0 GT/s PCIe"')
        return width * speed / 80.0, _GEN_BY_SPEED[speed], width


def _cpu_arch(reader: _Reader, el: ET.Element, where: str) -> str:
    arch = reader.attr(el, "arch", where)
    if arch == "ppc64":
        return "power9"
    if arch == "arm64":
        return "arm"
    if arch != "x86_64":
        raise reader.fail(where, f'attribute "arch" {arch!r} is not one NCCL knows; expected x86_64, arm64 or ppc64')
    vendor = reader.attr(el, "vendor", where)
    if vendor == "AuthenticAMD":
        return "amd"
    family, model = reader.int_attr(el, "familyid", where), reader.int_attr(el, "modelid", where)
    if vendor == "GenuineIntel":
        if family == 6 and model >= 0xCF:
            return "emerald-rapids"
        if family == 6 and model >= 0x8F:
            return "sapphire-rapids"
        if family == 6 and model >= 0x55:
            return "skylake"
        return "broadwell"
    if vendor.strip() in ("CentaurHauls", "Shanghai"):
        return "yongfeng" if family == 7 and model == 0x5B else "zhaoxin"
    raise reader.fail(where, f'attribute "vendor" {vendor!r} is not one NCCL knows; expected GenuineIntel, AuthenticAMD or CentaurHauls')


def parse_nccl_xml(text: str, source: str | None = None, *, host: str | None = None) -> Topology:
    """Read NCCL topology XML into a :class:`Topology` (see the module docstring for the mapping).

    >>> t = parse_nccl_xml('<system version="1"><cpu numaid="0" arch="arm64"><pci busid="0000:01:00.0" class="0x030200" '
    ...                    'link_speed="16.0 GT/s PCIe" link_width="16"><gpu dev="0" sm="80"/></pci></cpu></system>', host="a")
    >>> t.gpus(), t.graph.nodes["a/gpu0"]["model"], [d["bw"] for _, _, d in t.graph.out_edges("a/gpu0", data=True)]
    (['a/gpu0'], 'A100-SXM4-80GB', [24.0])
    """
    if host is not None:
        check_name(host, what="host name", source=source, where="--host")
    reader = _Reader(source)
    try:
        root = ET.fromstring(text.lstrip("\ufeff"))
    except ET.ParseError as exc:
        line = exc.position[0] if exc.position else None
        msg = str(exc).split(":")[0]
        raise TopologyError(f"not well-formed XML ({msg})", source=source, where=line) from None
    if root.tag != "system":
        raise reader.fail(f"<{root.tag}>", "the root element must be <system> (NCCL topology XML)")
    cpus = [c for c in root if c.tag == "cpu"]
    if not cpus:
        raise reader.fail("<system>", "no <cpu> elements; expected <system><cpu numaid=...>...")
    hashes: list[str] = []
    for c in cpus:
        hh = c.get("host_hash", "0x0")
        if hh not in hashes:
            hashes.append(hh)
    if host is not None and len(hashes) > 1:
        raise reader.fail("<system>", f"host={host!r} names one host but the file has {len(hashes)} host_hash values")
    names = [host or "node0"] if len(hashes) == 1 else [f"node{i}" for i in range(len(hashes))]
    hosts = {hh: _Host(name) for hh, name in zip(hashes, names, strict=True)}

    for c in cpus:
        h = hosts[c.get("host_hash", "0x0")]
        numa = reader.int_attr(c, "numaid", "<cpu>")
        where = f"<cpu numaid={numa}>"
        cpu_id = f"{h.name}/cpu{numa}"
        if any(cid == cpu_id for cid, _ in h.cpus):
            raise reader.fail(where, f"a second <cpu> with numaid {numa} on host_hash {c.get('host_hash', '0x0')}")
        nccl = {k: c.get(k) for k in ("host_hash", "affinity", "arch", "vendor", "familyid", "modelid") if c.get(k) is not None}
        h.cpus.append((cpu_id, {"numa": numa, "arch": _cpu_arch(reader, c, where), "nccl": nccl}))
        for child in c:
            if child.tag == "pci":
                _read_pci(reader, h, child, cpu_id, numa, where)
            elif child.tag == "nic":
                _read_nic(reader, h, child, cpu_id, numa, where, pci=None, busid=None, bw=NCCL_LOC_BW, link={})

    topo = Topology(source or "nccl-topology", imported={"format": "nccl-xml", "source": source, "version": root.get("version")})
    for h in hosts.values():
        _build_host(reader, topo, h)
    return topo


def _pci_attrs(el: ET.Element) -> dict[str, str]:
    return {k: el.get(k) for k in _PCI_KEYS if el.get(k) is not None}


def _read_pci(reader: _Reader, h: _Host, el: ET.Element, parent: str, numa: int, parent_where: str) -> None:
    where = f"<pci> under {parent_where}"
    busid = reader.attr(el, "busid", where).lower()
    if not _BUSID.match(busid):
        raise reader.fail(where, f'attribute "busid" {busid!r} is not a PCI bus id; expected e.g. "0000:1b:00.0"')
    where = f"<pci busid={busid}>"
    pci_class = reader.attr(el, "class", where)
    bw, gen, width = reader.pci_bw(el, where)
    link = {"gen": gen, "width": width}
    gpu = el.find("gpu")
    nic = el.find("nic")
    if gpu is not None:
        gw = f"<gpu> under pci {busid}"
        dev = reader.int_attr(gpu, "dev", gw)
        sm = reader.int_attr(gpu, "sm", gw)
        model = _model_for_sm(sm)
        attrs: dict[str, Any] = {"index": dev, "model": model or f"sm{sm}", "sm": sm, "numa": numa, "busid": busid, "pci": _pci_attrs(el)}
        if model:
            attrs["memory_gib"] = hw.GPU_SPECS[model]["memory_gib"]
            attrs["tflops"] = hw.GPU_SPECS[model]["tflops_bf16"]
        attrs["nccl"] = {k: gpu.get(k) for k in ("dev", "sm", "rank", "gdr") if gpu.get(k) is not None}
        gpu_id = f"{h.name}/gpu{dev}"
        if any(g == gpu_id for g, _ in h.gpus):
            raise reader.fail(gw, f'a second GPU with dev="{dev}"')
        _claim_busid(reader, h, busid, gpu_id, where)
        h.gpus.append((gpu_id, attrs))
        c2c = gpu.findall("c2c")
        if c2c:
            cw = f"<c2c> of <gpu dev={dev}> (pci {busid})"
            c2c_bw = sum(reader.int_attr(c, "bw", cw) * reader.int_attr(c, "count", cw) for c in c2c) / 1000.0
            if not c2c_bw > 0:
                raise reader.fail(cw, "NVLink-C2C bandwidth must be positive")
            h.c2c[gpu_id] = (c2c_bw, f"{h.name}/cpu{numa}")
        if not (c2c and parent == f"{h.name}/cpu{numa}"):
            h.pcie_links.append((gpu_id, parent, bw, link))
        for nv in gpu.findall("nvlink"):
            nw = f"<nvlink> of <gpu dev={dev}> (pci {busid})"
            target = reader.attr(nv, "target", nw).lower()
            tclass = reader.attr(nv, "tclass", nw)
            count = reader.int_attr(nv, "count", nw)
            if count < 1:
                raise reader.fail(nw, f'attribute "count" must be >= 1, got {count}')
            h.nvlinks.append((gpu_id, target, tclass, count, nw))
    elif nic is not None:
        _read_nic(reader, h, nic, parent, numa, where, pci=_pci_attrs(el), busid=busid, bw=bw, link=link)
    elif pci_class.startswith("0x0604") or el.find("pci") is not None:
        sw_id = f"{h.name}/pcie{len(h.switches)}"
        _claim_busid(reader, h, busid, sw_id, where)
        h.switches.append((sw_id, {"index": len(h.switches), "numa": numa, "busid": busid, "pci": _pci_attrs(el)}))
        h.pcie_links.append((sw_id, parent, bw, link))
        gen = _bcm_gen(el, 0)
        for child in el:
            if child.tag != "pci":
                continue
            if gen and _bcm_gen(child, 1) == gen and child.find("gpu") is None and child.find("nic") is None:
                # NCCL's ncclTopoFlattenBcmSwitches: the second level of a Broadcom PEX switch is the same switch.
                for grandchild in child:
                    if grandchild.tag == "pci":
                        _read_pci(reader, h, grandchild, sw_id, numa, where)
                continue
            _read_pci(reader, h, child, sw_id, numa, where)


def _bcm_gen(el: ET.Element, level: int) -> int:
    """NCCL's ``getBcmGen``: 4 or 5 for the given level of a two-level Broadcom PEX switch, else 0."""
    try:
        ident = 0
        for key, shift in (("vendor", 48), ("device", 32), ("subsystem_vendor", 16), ("subsystem_device", 0)):
            ident |= int(el.get(key, "0"), 16) << shift
    except ValueError:
        return 0
    if ident & ~0xFFF == 0x1000C0101000A000:
        return 4
    if ident & ~0xFFF == 0x1000C03010000000 | level * 0x1000:
        return 5
    return 0


def _claim_busid(reader: _Reader, h: _Host, busid: str, node: str, where: str) -> None:
    if busid in h.by_busid:
        raise reader.fail(where, f"bus id {busid} appears twice on host {h.name}")
    h.by_busid[busid] = node


def _read_nic(
    reader: _Reader, h: _Host, nic: ET.Element, parent: str, numa: int, where: str, *, pci: dict | None, busid: str | None, bw: float, link: dict
) -> None:
    nets = nic.findall("net")
    if not nets:
        raise reader.fail(f"<nic> under {where}", "no <net> element; expected <nic><net name=... dev=... speed=.../></nic>")
    for net in nets:
        nw = f"<net> under {where}"
        name = reader.attr(net, "name", nw)
        nw = f"<net name={name}> under {where}"
        dev = reader.int_attr(net, "dev", nw)
        mbps = reader.int_attr(net, "speed", nw)
        if mbps <= 0:
            mbps = 10000  # NCCL: "Some NICs define speed = -1"
        nic_id = f"{h.name}/nic{dev}"
        if any(n == nic_id for n, _ in h.nics):
            raise reader.fail(nw, f'a second <net> with dev="{dev}" on host {h.name}')
        attrs: dict[str, Any] = {"index": dev, "name": name, "numa": numa, "speed_gbps": mbps / 1000.0, "nccl": dict(net.attrib)}
        if pci is None:
            attrs["virtual"] = True
        else:
            attrs["busid"] = busid
            attrs["pci"] = pci
        h.nics.append((nic_id, attrs))
        h.pcie_links.append((nic_id, parent, bw, link))
    if busid is not None:
        _claim_busid(reader, h, busid, h.nics[-1][0], where)


def _build_host(reader: _Reader, topo: Topology, h: _Host) -> None:
    host = h.name
    for cpu_id, attrs in h.cpus:
        topo.add_node(cpu_id, NodeKind.CPU, host=host, **attrs)
    # NVSwitches: one node per distinct target bus id, in order of first mention.
    nvs_ids: dict[str, str] = {}
    resolved = []
    gpu_numa = {g: a["numa"] for g, a in h.gpus}
    gpu_sm = {g: a["sm"] for g, a in h.gpus}
    for gpu, target, tclass, count, where in h.nvlinks:
        if tclass.lower().startswith("0x03"):
            peer = h.by_busid.get(target)
            if peer is None or peer not in gpu_sm:
                raise reader.fail(where, f"target {target} is not a GPU of this host")
            resolved.append((gpu, peer, count, False))
        elif tclass.lower() == _CPU_CLASS:
            resolved.append((gpu, f"{host}/cpu{gpu_numa[gpu]}", count, True))
        else:
            if target not in nvs_ids:
                nvs_ids[target] = f"{host}/nvs{len(nvs_ids)}"
            resolved.append((gpu, nvs_ids[target], count, True))
    for busid, nvs in nvs_ids.items():
        topo.add_node(nvs, NodeKind.NVSWITCH, host=host, index=int(nvs.rsplit("nvs", 1)[1]), domain=host, busid=busid)
    for sw, attrs in h.switches:
        topo.add_node(sw, NodeKind.PCIE_SWITCH, host=host, **attrs)
    nvlinked = {g for g, *_ in resolved}
    for gpu, attrs in sorted(h.gpus, key=lambda item: item[1]["index"]):
        if gpu in nvlinked:
            attrs["domain"] = host
        topo.add_node(gpu, NodeKind.GPU, host=host, **attrs)
    for nic, attrs in sorted(h.nics, key=lambda item: item[1]["index"]):
        topo.add_node(nic, NodeKind.NIC, host=host, **attrs)
    cpu_ids = [c for c, _ in h.cpus]
    arch = dict(h.cpus)
    for a in range(len(cpu_ids)):
        for b in range(a + 1, len(cpu_ids)):
            bw = NCCL_CPU_BW[arch[cpu_ids[a]]["arch"]]
            topo.add_link(cpu_ids[a], cpu_ids[b], LinkKind.CPU, bw, latency_us=hw.LATENCY_US["cpu"])
    for child, parent, bw, link in h.pcie_links:
        topo.add_link(child, parent, LinkKind.PCIE, bw, latency_us=hw.LATENCY_US["pcie"], **link)
    for gpu, (bw, cpu) in h.c2c.items():
        topo.add_link(gpu, cpu, LinkKind.PCIE, bw, latency_us=hw.LATENCY_US["pcie"], c2c=True)
    # NCCL adds up parallel <nvlink> entries to one target into one link.
    merged: dict[tuple[str, str, bool], int] = {}
    for gpu, remote, count, duplex in resolved:
        merged[(gpu, remote, duplex)] = merged.get((gpu, remote, duplex), 0) + count
    for (gpu, remote, duplex), count in merged.items():
        bw = count * nccl_nvlink_bw(gpu_sm[gpu])
        latency = hw.LATENCY_US["nvlink"] / (2 if duplex else 1)
        topo.add_link(gpu, remote, LinkKind.NVLINK, bw, latency_us=latency, duplex=duplex, count=count)


# --- export ------------------------------------------------------------------------------------


def _pcie_gen_width(bw: float) -> tuple[int, int]:
    """The PCIe generation and width whose NCCL or spec-sheet rate is ``bw`` (nearest NCCL rate otherwise)."""
    candidates = [(g, w) for w in (16, 8, 4, 32, 2, 1) for g in sorted(_GEN_BY_SPEED.values())]  # x16 first: 48 is Gen5 x16, not Gen4 x32
    for gen, width in candidates:
        if abs(width * hw.NCCL_PCIE_SPEED[gen] / 80.0 - bw) < 1e-6:
            return gen, width
    for gen, width in candidates:
        if gen in hw.PCIE_X16_BW and abs(hw.pcie_bw(gen, width) - bw) < 1e-6:
            return gen, width
    return min(candidates, key=lambda gw: (abs(gw[1] * hw.NCCL_PCIE_SPEED[gw[0]] / 80.0 - bw), -gw[1]))


def _speed_text(gen: int) -> str:
    gts = {1: "2.5", 2: "5.0", 3: "8.0", 4: "16.0", 5: "32.0", 6: "64.0"}[gen]
    return f"{gts} GT/s PCIe"


def _host_hash(host: str) -> str:
    return "0x" + hashlib.sha1(host.encode()).hexdigest()[:16]


def to_nccl_xml(topo: Topology, host: str | None = None) -> str:
    """NCCL topology XML for one host of ``topo`` (usable as ``NCCL_TOPO_FILE``).

    >>> from topology import build_cluster
    >>> to_nccl_xml(build_cluster(2))
    Traceback (most recent call last):
    ...
    topology.errors.TopologyError: the topology has 2 hosts (node0, node1); choose one with --host
    """
    hosts = topo.hosts()
    if host is None:
        if len(hosts) != 1:
            listed = ", ".join(hosts[:8]) + (", ..." if len(hosts) > 8 else "")
            raise TopologyError(f"the topology has {len(hosts)} hosts ({listed}); choose one with --host")
        host = hosts[0]
    elif host not in hosts:
        raise TopologyError(f"unknown host {host!r}; expected one of {', '.join(hosts[:8])}{', ...' if len(hosts) > 8 else ''}")
    g = topo.graph
    cpus = sorted(topo.nodes(NodeKind.CPU, host), key=lambda c: g.nodes[c].get("numa", 0))
    if not cpus:
        raise TopologyError(f"host {host!r} has no CPU node; NCCL XML hangs every device under a <cpu>")

    # The PCIe tree: breadth-first from each CPU over PCIe links, through PCIe switches only.
    parent: dict[str, str] = {}
    children: dict[str, list[str]] = {c: [] for c in cpus}
    up_bw: dict[str, float] = {}
    c2c_up: set[str] = set()
    frontier = list(cpus)
    while frontier:
        nxt = []
        for u in frontier:
            for _, v, d in g.out_edges(u, data=True):
                if d["kind"] != LinkKind.PCIE or v in parent or v in children or g.nodes[v].get("host") != host:
                    continue
                if g.nodes[v]["kind"] not in (NodeKind.PCIE_SWITCH, NodeKind.GPU, NodeKind.NIC):
                    continue
                parent[v] = u
                children[u].append(v)
                children.setdefault(v, [])
                ups = [dd for _, w, dd in g.out_edges(v, data=True) if w == u and dd["kind"] == LinkKind.PCIE]
                up_bw[v] = max(dd["bw"] for dd in ups)
                if any(dd.get("c2c") for dd in ups):
                    c2c_up.add(v)
                if g.nodes[v]["kind"] is NodeKind.PCIE_SWITCH:
                    nxt.append(v)
        frontier = nxt
    for dev in topo.nodes(NodeKind.GPU, host) + topo.nodes(NodeKind.NIC, host):
        if dev not in parent:
            raise TopologyError(f"{dev} has no PCIe path to a CPU of {host}; NCCL XML places every GPU and NIC in the PCI tree")

    # Bus ids: keep recorded ones, synthesise the rest in tree order.
    busid: dict[str, str] = {}
    taken = {g.nodes[n]["busid"] for n in topo.nodes(host=host) if g.nodes[n].get("busid")}
    counter = [0x10]

    def new_busid() -> str:
        while True:
            domain, bus = divmod(counter[0], 256)
            counter[0] += 1
            candidate = f"{domain:04x}:{bus:02x}:00.0"
            if candidate not in taken:
                taken.add(candidate)
                return candidate

    def busid_of(n: str) -> str:
        if n not in busid:
            busid[n] = g.nodes[n].get("busid") or new_busid()
        return busid[n]

    def order(nodes: list[str]) -> list[str]:
        rank = {NodeKind.PCIE_SWITCH: 0, NodeKind.GPU: 1, NodeKind.NIC: 2}
        return sorted(nodes, key=lambda n: (rank[g.nodes[n]["kind"]], g.nodes[n].get("index", 0)))

    def walk(n: str) -> None:
        busid_of(n)
        for c in order(children.get(n, [])):
            walk(c)

    for c in cpus:
        for child in order(children[c]):
            walk(child)

    root = ET.Element("system", version="1")
    host_hash = next((g.nodes[c]["nccl"]["host_hash"] for c in cpus if (g.nodes[c].get("nccl") or {}).get("host_hash")), None) or _host_hash(host)
    emitted_nics: set[str] = set()
    for c in cpus:
        d = g.nodes[c]
        stored = d.get("nccl") or {}
        arch = d.get("arch") or "sapphire-rapids"
        if arch not in _CPU_IDENTITY:
            raise TopologyError(f"{c}: CPU arch {arch!r} has no NCCL identity; expected one of {', '.join(_CPU_IDENTITY)}")
        attrs = {"host_hash": host_hash, "numaid": str(d.get("numa", 0))}
        if stored.get("affinity"):
            attrs["affinity"] = stored["affinity"]
        identity = {k: stored[k] for k in ("arch", "vendor", "familyid", "modelid") if k in stored} if "arch" in stored else _CPU_IDENTITY[arch]
        attrs.update(identity)
        cpu_el = ET.SubElement(root, "cpu", attrs)
        virtual = [n for n in order(children[c]) if g.nodes[n].get("virtual")]
        for child in order(children[c]):
            if child not in virtual:
                _emit(topo, cpu_el, child, children, up_bw, busid_of, emitted_nics, c2c_up)
        if virtual:
            nic_el = ET.SubElement(cpu_el, "nic")
            for n in virtual:
                _emit_net(topo, nic_el, n, host)
    ET.indent(root, space="  ")
    # NCCL writes empty elements as <x .../>; ElementTree adds a space before the slash.
    return ET.tostring(root, encoding="unicode").replace(" />", "/>") + "\n"


def _pci_element(topo: Topology, parent_el: ET.Element, n: str, bw: float, busid: str, default_class: str, keep_recorded: bool = False) -> ET.Element:
    d = topo.graph.nodes[n]
    stored = dict(d.get("pci") or {})
    attrs = {"busid": busid, "class": stored.get("class", default_class)}
    for k in ("vendor", "device", "subsystem_vendor", "subsystem_device"):
        if k in stored:
            attrs[k] = stored[k]
    if "vendor" not in attrs and d["kind"] is NodeKind.GPU and d.get("model") in _PCI_DEVICE_IDS:
        attrs["vendor"], attrs["device"] = "0x10de", _PCI_DEVICE_IDS[d["model"]]
    # Keep the recorded speed and width when they still give the link's rate; otherwise derive them from it.
    if "link_speed" in stored and "link_width" in stored:
        try:
            reread = _Reader(None).pci_bw(ET.Element("pci", stored), "")[0]
        except InputError:
            reread = None
        if reread is not None and (keep_recorded or abs(reread - bw) < 1e-6):
            attrs["link_speed"], attrs["link_width"] = stored["link_speed"], stored["link_width"]
    if "link_speed" not in attrs:
        gen, width = _pcie_gen_width(bw)
        attrs["link_speed"], attrs["link_width"] = _speed_text(gen), str(width)
    return ET.SubElement(parent_el, "pci", attrs)


def _emit(topo: Topology, parent_el: ET.Element, n: str, children: dict, up_bw: dict, busid_of, emitted_nics: set[str], c2c_up: set[str]) -> None:
    g = topo.graph
    d = g.nodes[n]
    kind = d["kind"]
    if kind is NodeKind.NIC:
        if n in emitted_nics:
            return
        # Ports of one multi-port NIC share a bus id: one <pci><nic> with a <net> per port.
        siblings = [m for m in children.get(_parent_of(children, n), []) if g.nodes[m]["kind"] is NodeKind.NIC and d.get("busid")
                    and g.nodes[m].get("busid") == d.get("busid")] or [n]
        el = _pci_element(topo, parent_el, n, up_bw[n], busid_of(n), _IB_CLASS)
        nic_el = ET.SubElement(el, "nic")
        for m in siblings:
            emitted_nics.add(m)
            _emit_net(topo, nic_el, m, d["host"])
        return
    if kind is NodeKind.PCIE_SWITCH:
        el = _pci_element(topo, parent_el, n, up_bw[n], busid_of(n), _BRIDGE_CLASS)
        rank = {NodeKind.PCIE_SWITCH: 0, NodeKind.GPU: 1, NodeKind.NIC: 2}
        for c in sorted(children.get(n, []), key=lambda m: (rank[g.nodes[m]["kind"]], g.nodes[m].get("index", 0))):
            _emit(topo, el, c, children, up_bw, busid_of, emitted_nics, c2c_up)
        return
    # A GPU. An NVLink-C2C host link is a <c2c> element; its PCI attributes are the recorded ones or Gen5 x16.
    pci_bw = (hw.pcie_bw(5, 16, nccl_model=True) if n in c2c_up else up_bw[n])
    el = _pci_element(topo, parent_el, n, pci_bw, busid_of(n), _GPU_CLASS, keep_recorded=n in c2c_up)
    stored = d.get("nccl") or {}
    sm = d.get("sm") or (hw.GPU_SPECS.get(d.get("model"), {}).get("sm"))
    if sm is None:
        raise TopologyError(f"{n}: cannot tell the GPU's SM version (model {d.get('model')!r}); NCCL XML needs it")
    index = d.get("index", 0)
    gpu_el = ET.SubElement(el, "gpu", {"dev": str(index), "sm": str(sm), "rank": stored.get("rank", str(index)), "gdr": stored.get("gdr", "1")})
    counts: dict[str, tuple[int, str]] = {}
    for _, v, e in g.out_edges(n, data=True):
        if e["kind"] != LinkKind.NVLINK:
            continue
        vk = g.nodes[v]["kind"]
        if vk is NodeKind.NVSWITCH:
            tclass = _NVS_CLASS
        elif vk is NodeKind.GPU:
            tclass = (g.nodes[v].get("pci") or {}).get("class", _GPU_CLASS)
        elif vk is NodeKind.CPU:
            tclass = _CPU_CLASS
        else:
            continue
        count = e.get("count") or max(1, round(e["bw"] / (hw.NVLINK5_BW_PER_LINK if sm >= 100 else hw.NVLINK4_BW_PER_LINK)))
        target = busid_of(v) if vk is not NodeKind.CPU else busid_of(n)
        prev = counts.get(target, (0, tclass))
        counts[target] = (prev[0] + int(count), tclass)
    for target, (count, tclass) in counts.items():
        ET.SubElement(gpu_el, "nvlink", {"target": target, "count": str(count), "tclass": tclass})
    if n in c2c_up:
        ET.SubElement(gpu_el, "c2c", {"bw": str(round(up_bw[n] * 1000)), "count": "1"})


def _parent_of(children: dict[str, list[str]], n: str) -> str | None:
    return next((p for p, cs in children.items() if n in cs), None)


def _emit_net(topo: Topology, nic_el: ET.Element, n: str, host: str) -> None:
    d = topo.graph.nodes[n]
    stored = dict(d.get("nccl") or {})
    index = d.get("index", 0)
    attrs = {
        "name": d.get("name") or f"nic{index}",
        "dev": str(index),
        "speed": str(int(round(float(d.get("speed_gbps", 400)) * 1000))),
        "port": stored.get("port", "1"),
        "latency": stored.get("latency", "0.000000"),
        "guid": stored.get("guid", "0x" + hashlib.sha1(f"{host}/{index}".encode()).hexdigest()[:16]),
        "maxconn": stored.get("maxconn", "131072"),
        "gdr": stored.get("gdr", "1"),
    }
    for k, v in stored.items():
        attrs.setdefault(k, v)
    ET.SubElement(nic_el, "net", attrs)
