"""Reading and writing topology files.

Formats: ``json`` (netweave's own, lossless), ``nvidia-smi`` (``nvidia-smi topo -m``
text, import only), ``nccl-xml`` (NCCL's topology XML, as written to
``NCCL_TOPO_DUMP_FILE`` and read from ``NCCL_TOPO_FILE``), ``slurm``
(``topology.conf`` of Slurm's topology/tree plugin). See ``docs/topology.md``.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

from ..errors import InputError, TopologyError
from ..inputs import loads_json, read_text
from ..model import Topology

IMPORT_FORMATS = ("json", "nvidia-smi", "nccl-xml", "slurm")
EXPORT_FORMATS = ("json", "nccl-xml", "slurm")


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old file or the new one, never half of one.

    The file gets the mode an ordinary ``open(path, "w")`` would (``0o666`` less the umask), so
    that a hostfile or plan written by one account can be read by ``srun`` or NCCL running as
    another; the directory is synced after the rename so the new name survives a crash. A path that
    cannot be written raises :class:`~topology.errors.InputError` naming it (the CLI's one line).
    """
    path = Path(path)
    try:
        _atomic_write(path, text)
    except OSError as exc:
        raise InputError(f"cannot write {path} ({exc.strerror or exc})") from None


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fchmod(f.fileno(), 0o666 & ~_umask())
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _umask() -> int:
    """The process's umask (read by setting it and putting it back; no other way exists in POSIX)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def guess_format(path: str | os.PathLike[str], text: str) -> str:
    """Pick a format from the file's name and first characters."""
    name = str(path).lower()
    head = text.lstrip()[:200]
    if name.endswith(".json") or head.startswith("{"):
        return "json"
    if name.endswith(".xml") or head.startswith("<"):
        return "nccl-xml"
    if re.search(r"(?im)^\s*switchname\s*=", text):
        return "slurm"
    if "GPU0" in text and ("Legend" in text or "X " in text):
        return "nvidia-smi"
    raise TopologyError("cannot tell the format; pass --format json|nvidia-smi|nccl-xml|slurm", source=str(path))


def loads(text: str, format: str, *, source: str | None = None, **options) -> Topology:
    """Parse topology ``text`` in ``format``; ``options`` go to the format's parser (see its docs)."""
    if format == "json":
        data = loads_json(text, source=source, error=TopologyError)
        if options:
            raise TopologyError(f"the json format takes no options (got {', '.join(sorted(options))})", source=source)
        return Topology.from_dict(data, source=source)
    if format == "nvidia-smi":
        from .nvsmi import parse_nvidia_smi

        return parse_nvidia_smi(text, source=source, **options)
    if format == "nccl-xml":
        from .ncclxml import parse_nccl_xml

        return parse_nccl_xml(text, source=source, **options)
    if format == "slurm":
        from .slurm import parse_slurm_topology

        return parse_slurm_topology(text, source=source, **options)
    raise TopologyError(f"unknown format {format!r}; expected one of {', '.join(IMPORT_FORMATS)}")


def dumps(topo: Topology, format: str = "json", *, host: str | None = None) -> str:
    """Serialise ``topo`` in ``format``; ``host`` picks the server for NCCL XML (one file per host)."""
    if format == "json":
        return json.dumps(topo.to_dict(), indent=1) + "\n"
    if format == "nccl-xml":
        from .ncclxml import to_nccl_xml

        return to_nccl_xml(topo, host=host)
    if format == "slurm":
        from .slurm import to_slurm_topology

        return to_slurm_topology(topo)
    raise TopologyError(f"cannot export format {format!r}; expected one of {', '.join(EXPORT_FORMATS)}")


def read_topology(path: str | os.PathLike[str], format: str | None = None, **options) -> Topology:
    """Read a topology file; ``format`` is guessed from the name and content when omitted."""
    text = read_text(path, error=TopologyError)
    return loads(text, format or guess_format(path, text), source=str(path), **options)


def write_topology(topo: Topology, path: str | os.PathLike[str], format: str = "json", *, host: str | None = None) -> None:
    """Write ``topo`` to ``path`` atomically."""
    atomic_write_text(path, dumps(topo, format, host=host))


__all__ = ["EXPORT_FORMATS", "IMPORT_FORMATS", "atomic_write_text", "dumps", "guess_format", "loads", "read_topology", "write_topology"]
