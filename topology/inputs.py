"""The one place where user input is read and checked: files, documents, names, numbers and output paths.

Every reader of every package goes through these functions, so that the error
contract holds whatever the bytes: bad input raises an
:class:`~topology.errors.InputError` (or the subclass the caller passes as
``error``) naming the file, the line or field and what was expected, and the
CLI prints it on one line with exit code 2.

- :func:`read_text` reads a file of at most :data:`~topology.limits.MAX_INPUT_BYTES`
  as strict UTF-8 (a bad byte is reported with its line and offset).
- :func:`loads_json` / :func:`loads_yaml` parse a document and refuse NaN and
  infinities anywhere (``1e400``, ``.nan``, ``Infinity``) and nesting deeper than
  :data:`~topology.limits.MAX_NESTING`; YAML aliases are walked once, so an alias
  bomb costs nothing.
- :func:`check_name`, :func:`check_node_id` and :func:`check_interface` validate
  every name that becomes a file name, a host in a hostfile, an interface, a tc
  argument or a shell word: no path separators, no ``..``, no whitespace or
  control characters, no leading ``-``.
- :func:`check_number` checks a count or a quantity against its bounds.
- :func:`check_output` checks before the work that an output file or directory
  can be written.

>>> check_name("llm-7b.v2", what="job name")
'llm-7b.v2'
>>> check_name("../../escaped", what="job name", source="jobs.yaml", where="jobs[0].name")
Traceback (most recent call last):
...
topology.errors.InputError: jobs.yaml: jobs[0].name: expected a job name of letters, digits and . _ - + @ : (...), got '../../escaped'
>>> loads_json('{"bw": 1e400}', source="t.json")
Traceback (most recent call last):
...
topology.errors.InputError: t.json: bw: expected a finite number, got 1e400
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from .errors import InputError
from .limits import MAX_INPUT_BYTES, MAX_INTERFACE_LENGTH, MAX_NAME_LENGTH, MAX_NESTING

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+@:-]*")
_INTERFACE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
NAME_RULE = f"letters, digits and . _ - + @ : (not starting with . or -, at most {MAX_NAME_LENGTH} characters)"


def check_name(value: Any, *, what: str = "name", source: str | None = None, where: str | int | None = None,
               error: type[InputError] = InputError) -> str:
    """``value`` if it is a safe name (a file name, a hostfile line, a shell word, a tc argument), else ``error``.

    >>> check_name("node0"), check_name("application_1506638472019_10238")
    ('node0', 'application_1506638472019_10238')
    >>> check_name("a\\nb")
    Traceback (most recent call last):
    ...
    topology.errors.InputError: expected a name of letters, digits and . _ - + @ : (...), got 'a\\nb'
    """
    if not isinstance(value, str) or len(value) > MAX_NAME_LENGTH or not _NAME.fullmatch(value):
        raise error(f"expected a {what} of {NAME_RULE}, got {_show(value)}", source=source, where=where)
    return value


def check_node_id(value: Any, *, what: str = "node id", source: str | None = None, where: str | int | None = None,
                  error: type[InputError] = InputError) -> str:
    """A topology node id: names joined by ``/`` (``node0/gpu3``, ``su0/leaf2``, ``spine1``).

    >>> check_node_id("node0/gpu3")
    'node0/gpu3'
    >>> check_node_id("node0//gpu3")
    Traceback (most recent call last):
    ...
    topology.errors.InputError: expected a node id of names joined by '/', each of letters, digits and . _ - + @ : (...), got 'node0//gpu3'
    """
    if not isinstance(value, str) or len(value) > 2 * MAX_NAME_LENGTH or not all(
            len(part) <= MAX_NAME_LENGTH and _NAME.fullmatch(part) for part in value.split("/")):
        raise error(f"expected a {what} of names joined by '/', each of {NAME_RULE}, got {_show(value)}", source=source, where=where)
    return value


def check_interface(value: Any, *, what: str = "network interface name", source: str | None = None, where: str | int | None = None,
                    error: type[InputError] = InputError) -> str:
    """A Linux network interface name as ``ip`` and ``tc`` take it (at most 15 characters, no ``/`` or spaces).

    >>> check_interface("eth0"), check_interface("h1-eth0")
    ('eth0', 'h1-eth0')
    >>> check_interface("lo\\nqdisc del dev eth0 root")
    Traceback (most recent call last):
    ...
    topology.errors.InputError: expected a network interface name of letters, digits and . _ - (...), got 'lo\\nqdisc del dev eth0 root'
    """
    if not isinstance(value, str) or len(value) > MAX_INTERFACE_LENGTH or not _INTERFACE.fullmatch(value):
        raise error(f"expected a {what} of letters, digits and . _ - (not starting with . or -, at most {MAX_INTERFACE_LENGTH} characters), "
                    f"got {_show(value)}", source=source, where=where)
    return value


def check_number(value: Any, *, what: str = "a number", source: str | None = None, where: str | int | None = None,
                 minimum: float | None = None, maximum: float | None = None, positive: bool = False, integer: bool = False,
                 error: type[InputError] = InputError) -> Any:
    """``value`` if it is a finite number (an ``int`` when ``integer``) within the bounds, else ``error`` naming them.

    >>> check_number(8, integer=True, minimum=1, maximum=64)
    8
    >>> check_number(2**31, what="a cell count", integer=True, minimum=0, maximum=1_048_576, where="quota")
    Traceback (most recent call last):
    ...
    topology.errors.InputError: quota: expected a cell count <= 1048576 (the limit), got 2147483648
    """
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, int | float) or (integer and not isinstance(value, int)):
        raise error(f"expected {what if what != 'a number' else kind}, got {_show(value)}", source=source, where=where)
    if not math.isfinite(value):
        raise error(f"expected a finite number, got {_show(value)}", source=source, where=where)
    if positive and not value > 0:
        raise error(f"expected {what} > 0, got {_show(value)}", source=source, where=where)
    if minimum is not None and value < minimum:
        raise error(f"expected {what} >= {_bound(minimum)}, got {_show(value)}", source=source, where=where)
    if maximum is not None and value > maximum:
        raise error(f"expected {what} <= {_bound(maximum)} (the limit), got {_show(value)}", source=source, where=where)
    return value


def _bound(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def _show(value: Any) -> str:
    """A value as an error message shows it: ``repr``, cut to a readable length (no raw control characters)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# -- files and documents ----------------------------------------------------------------------


def read_text(path: str | os.PathLike[str], *, error: type[InputError] = InputError) -> str:
    """The text of an input file: at most :data:`MAX_INPUT_BYTES`, strict UTF-8 (a leading byte-order mark is dropped).

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "x.txt"
    >>> _ = p.write_bytes(b"ok\\n\\xff")
    >>> read_text(p)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    topology.errors.InputError: .../x.txt: line 2: not UTF-8 text (byte 0xff at offset 3)
    """
    source = str(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_INPUT_BYTES + 1)
    except OSError as exc:
        raise error(f"cannot read file ({exc.strerror or exc})", source=source) from None
    except ValueError as exc:  # an embedded NUL in the path
        raise error(f"cannot read file ({exc})", source=source) from None
    if len(data) > MAX_INPUT_BYTES:
        raise error(f"file larger than {MAX_INPUT_BYTES} bytes (the limit)", source=source)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise error(f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})", source=source, where=line) from None
    return text.removeprefix("\ufeff")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"expected a finite number, got {name}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {text}")
    return value


def loads_json(text: str, *, source: str | None = None, error: type[InputError] = InputError) -> Any:
    """Parse JSON: no NaN or infinities (``NaN``, ``Infinity``, ``1e400``), nesting at most :data:`MAX_NESTING`."""
    try:
        data = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except json.JSONDecodeError as exc:
        raise error(f"invalid JSON ({exc.msg}, column {exc.colno})", source=source, where=exc.lineno) from None
    except RecursionError:
        raise error(f"invalid JSON (nested deeper than {MAX_NESTING} levels, the limit)", source=source) from None
    except ValueError as exc:  # parse hooks, or an integer of more than 4300 digits
        path = _locate_bad_number(text)
        raise error(str(exc) if "finite" in str(exc) else f"invalid JSON ({exc})", source=source, where=path) from None
    check_document(data, source=source, error=error)
    return data


def _locate_bad_number(text: str) -> str | None:
    """Where a non-finite number sits, re-parsed leniently (the strict parser cannot say)."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return None
    try:
        check_document(data)
    except InputError as exc:
        return exc.where if isinstance(exc.where, str) else None
    return None


def loads_yaml(text: str, *, source: str | None = None, error: type[InputError] = InputError) -> Any:
    """Parse YAML (JSON is YAML too) with the safe loader; the same checks as :func:`loads_json`."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        data = yaml.load(text, Loader=loader)  # noqa: S506 - a safe loader
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise error(f"invalid YAML ({problem})", source=source, where=None if mark is None else mark.line + 1) from None
    except RecursionError:
        raise error(f"invalid YAML (nested deeper than {MAX_NESTING} levels, the limit)", source=source) from None
    except (ValueError, TypeError, OverflowError) as exc:  # a constructor's own error (a timestamp out of range, ...)
        raise error(f"invalid YAML ({exc})", source=source) from None
    check_document(data, source=source, error=error)
    return data


def check_document(data: Any, *, source: str | None = None, error: type[InputError] = InputError) -> None:
    """Raise ``error`` on a non-finite float anywhere in ``data`` or nesting deeper than :data:`MAX_NESTING`.

    Shared containers (YAML aliases) are visited once.

    >>> check_document({"a": [1, {"b": float("nan")}]})
    Traceback (most recent call last):
    ...
    topology.errors.InputError: a[1].b: expected a finite number, got nan
    """
    seen: set[int] = set()
    stack: list[tuple[Any, int, tuple | None]] = [(data, 0, None)]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, float):
            if not math.isfinite(value):
                raise error(f"expected a finite number, got {value!r}", source=source, where=_path_text(path))
            continue
        if not isinstance(value, dict | list):
            continue
        if id(value) in seen:
            continue
        seen.add(id(value))
        if depth >= MAX_NESTING:
            raise error(f"nested deeper than {MAX_NESTING} levels (the limit)", source=source, where=_path_text(path))
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, child in items:
            if isinstance(child, float | dict | list):
                stack.append((child, depth + 1, (path, key, isinstance(value, list))))


def _path_text(path: tuple | None) -> str:
    parts: list[str] = []
    while path is not None:
        path, key, index = path
        parts.append(f"[{key}]" if index else f".{key}")
    text = "".join(reversed(parts)).lstrip(".") or "(top level)"
    return text if len(text) <= 80 else text[:77] + "..."


# -- outputs ----------------------------------------------------------------------------------


def check_output(path: str | os.PathLike[str] | None, *, directory: bool = False, what: str = "--out",
                 error: type[InputError] = InputError) -> None:
    """Raise ``error`` unless ``path`` can be written (as a file, or as a directory to put files in); before the work.

    The nearest existing ancestor must be a directory in which a file can be created: a probe file is
    created there and removed, which catches read-only mounts, ``/proc`` and missing permissions alike.

    >>> check_output("/dev/null/x")
    Traceback (most recent call last):
    ...
    topology.errors.InputError: --out: cannot write /dev/null/x (/dev/null is not a directory)
    """
    if path is None:
        return
    try:
        p = Path(path)
        if str(path) == "" or "\x00" in str(path):
            raise error(f"expected a file name, got {_show(str(path))}", where=what)
        if p.exists():
            if directory and not p.is_dir():
                raise error(f"cannot write into {path} (not a directory)", where=what)
            if not directory and p.is_dir():
                raise error(f"cannot write {path} (it is a directory)", where=what)
            probe_dir = p if directory else p.parent
        else:
            probe_dir = p.parent
            while not probe_dir.exists() and probe_dir != probe_dir.parent:
                probe_dir = probe_dir.parent
            if not probe_dir.is_dir():
                raise error(f"cannot write {path} ({probe_dir} is not a directory)", where=what)
        if not directory and p.exists() and not os.access(p, os.W_OK):
            raise error(f"cannot write {path} (permission denied)", where=what)
        fd, probe = tempfile.mkstemp(dir=probe_dir, prefix=".netweave-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise error(f"cannot write {path} ({exc.strerror or exc})", where=what) from None


__all__ = [
    "NAME_RULE",
    "check_document",
    "check_interface",
    "check_name",
    "check_node_id",
    "check_number",
    "check_output",
    "loads_json",
    "loads_yaml",
    "read_text",
]
