"""One parser for the quantities users write: sizes, durations and rates, in every file and flag.

Every reader (jobs files, trace CSVs, workload files, model configurations, ``data_parallel`` knobs) and every
command-line flag that takes a size, a duration or a rate goes through :func:`parse_size`, :func:`parse_duration`
or :func:`parse_rate`. Each takes the value as it was written (a number, or a string with or without a unit) and
the field's documented ``unit``: a plain number is in that unit, and the result is returned in it.

- **Sizes**: ``B``; ``kB``/``KB``, ``MB``, ``GB``, ``TB``, ``PB`` (powers of 1000); ``KiB``, ``MiB``, ``GiB``,
  ``TiB``, ``PiB`` (powers of 1024). Letters are case-insensitive (``2gb`` is 2 GB), except the bit symbols
  ``Kb``, ``Mb``, ``Gb``, ``Tb``, ``Pb`` and ``...bit``: a size is in bytes, so these are refused.
- **Durations**: ``ns``, ``us`` (``µs``), ``ms``, ``s``, ``min``, ``h``.
- **Rates**: bits per second ``bit/s``, ``b/s``, ``bps``, ``Kb/s`` ... ``Tb/s``, ``Gbps``, ``Gbit/s`` and tc's
  ``Gbit``; bytes per second ``B/s``, ``kB/s`` ... ``TB/s``, ``KiB/s`` ... ``TiB/s``. Here the case of ``b``/``B``
  matters (``b`` is a bit, ``B`` a byte); prefixes are case-insensitive (``mbit`` is tc's megabit).

Refused, with one line that names the field and the accepted forms: NaN, infinities, negative numbers (zero
only where the field allows it), values above the limits of :mod:`topology.limits`, and ambiguous suffixes
(``2G``: GB or GiB?; ``5m``: minutes or milliseconds?; ``10GBps``: GB/s or Gb/s?; a rate without ``/s``).

>>> parse_size("2GB"), parse_size("1.5 GiB"), parse_size("500MB"), parse_size("4KiB"), parse_size(4096)
(2000000000.0, 1610612736.0, 500000000.0, 4096.0, 4096.0)
>>> parse_duration("120ms"), parse_duration("1.5s"), parse_duration("100us"), parse_duration(2)
(0.12, 1.5, 0.0001, 2.0)
>>> parse_duration("120ms", unit="ms"), parse_duration(80, unit="ms")      # a field documented in ms
(120.0, 80.0)
>>> parse_rate("400Gb/s"), parse_rate("50 GB/s"), parse_rate("100Gbps"), parse_rate(25)   # GB/s by default
(50.0, 50.0, 12.5, 25.0)
>>> parse_rate("400Gb/s", unit="Gb/s"), parse_rate("1 GB/s", unit="B/s"), parse_rate("100Mbit", unit="Mbit/s")
(400.0, 1000000000.0, 100.0)
>>> parse_size("2G", where="jobs[0].grad_bytes", source="jobs.yaml")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
topology.errors.InputError: jobs.yaml: jobs[0].grad_bytes: expected a size in bytes ... got '2G' ('G' is ambiguous: GB (10^9) or GiB (2^30)?)
>>> parse_duration("nan", where="compute")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
topology.errors.InputError: compute: expected a duration in s ... got 'nan'
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any

from .errors import InputError
from .limits import MAX_BANDWIDTH_GBS, MAX_BYTES, MAX_SECONDS

_NUMBER = re.compile(r"\s*([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)\s*(\S*(?:\s*/\s*s)?)\s*")

# factors are exact rationals, so that 100us is 1e-4 s and not 9.999999999999999e-05
_DECIMAL = {"": Fraction(1), "k": Fraction(10**3), "m": Fraction(10**6), "g": Fraction(10**9), "t": Fraction(10**12), "p": Fraction(10**15)}
_BINARY = {"ki": Fraction(2**10), "mi": Fraction(2**20), "gi": Fraction(2**30), "ti": Fraction(2**40), "pi": Fraction(2**50)}
_PREFIX_NAME = {"k": "K", "m": "M", "g": "G", "t": "T", "p": "P"}
_SECONDS = {"ns": Fraction(1, 10**9), "us": Fraction(1, 10**6), "µs": Fraction(1, 10**6), "μs": Fraction(1, 10**6), "ms": Fraction(1, 1000),
            "s": Fraction(1), "sec": Fraction(1), "min": Fraction(60), "h": Fraction(3600)}

SIZE_FORMS = ("a number and a unit: B, kB, MB, GB, TB, PB (powers of 1000) or KiB, MiB, GiB, TiB, PiB (powers of 1024), "
              "e.g. 2GB, 1.5 GiB, 4KiB")
DURATION_FORMS = "a number and a unit: ns, us, ms, s, min, h, e.g. 120ms, 1.5s, 100us"
RATE_FORMS = "a number and a unit: Gb/s, Gbps, Gbit/s, Mbit (bits per second) or GB/s, MB/s, GiB/s (bytes per second), e.g. 400Gb/s, 50 GB/s"


class _Refused(ValueError):
    """A unit that is not one of the kind's, with the reason when it is a near miss."""


def _size_factor(unit: str) -> Fraction:
    """Bytes per ``unit`` (``""``: bytes)."""
    if "bit" in unit.lower() or (len(unit) == 2 and unit[0] in "KMGTP" and unit[1] == "b"):
        raise _Refused(f"{unit!r} is bits; a size is in bytes: {unit[0]}B or {unit[0]}iB")
    u = unit.lower()
    if u in ("", "b", "byte", "bytes"):
        return Fraction(1)
    if u.endswith("b") and u[:-1] in _DECIMAL:
        return _DECIMAL[u[:-1]]
    if u.endswith("b") and u[:-1] in _BINARY:
        return _BINARY[u[:-1]]
    if u in _DECIMAL or u in _BINARY:
        p = _PREFIX_NAME[u[0]]
        raise _Refused(f"{unit!r} is ambiguous: {p}B (10^{3 * ' kmgtp'.index(u[0])}) or {p}iB (2^{10 * ' kmgtp'.index(u[0])})?")
    raise _Refused("")


def _duration_factor(unit: str) -> Fraction:
    """Seconds per ``unit`` (``""``: seconds)."""
    u = unit.lower()
    if u in ("", "s"):
        return Fraction(1)
    if u in _SECONDS:
        return _SECONDS[u]
    if u == "m":
        raise _Refused("'m' is ambiguous: min or ms?")
    raise _Refused("")


def _rate_factor(unit: str) -> Fraction:
    """Bytes/s per ``unit`` (bits are 1/8 byte; ``b`` is a bit and ``B`` a byte)."""
    compact = unit.replace(" ", "")
    if compact.endswith("/s") or compact.endswith("bps"):
        body = compact[:-2]
    elif compact.endswith("Bps"):
        raise _Refused(f"{unit!r} is ambiguous: {compact[:-3]}B/s or {compact[:-3]}b/s?")
    elif compact.lower().endswith("bit"):
        body = compact          # tc's spelling: 400Mbit
    else:
        raise _Refused(f"{unit!r} is not a rate: write it per second, e.g. Gb/s or GB/s")
    for base, per_byte in (("bit", Fraction(1, 8)), ("byte", Fraction(1)), ("b", Fraction(1, 8)), ("B", Fraction(1))):
        if body.lower().endswith(base) if len(base) > 1 else body.endswith(base):
            prefix = body[: -len(base)].lower()
            if prefix in _DECIMAL:
                return per_byte * _DECIMAL[prefix]
            if prefix in _BINARY and per_byte == 1.0:
                return _BINARY[prefix]
            break
    raise _Refused("")


_KINDS = {
    "size": (_size_factor, SIZE_FORMS, MAX_BYTES, "bytes"),
    "duration": (_duration_factor, DURATION_FORMS, MAX_SECONDS, "s"),
    "rate": (_rate_factor, RATE_FORMS, MAX_BANDWIDTH_GBS * 1e9, "B/s"),
}


def _parse(kind: str, value: Any, unit: str, what: str | None, where: str | int | None, source: str | None, positive: bool,
           maximum: float | None, error: type[InputError]) -> float:
    factor_of, forms, limit, base = _KINDS[kind]
    scale = factor_of(unit)    # the field's unit is the programmer's: a bad one is a bug, not input
    what = what or f"a {kind} in {'bytes' if unit == 'B' else unit}"

    def refuse(reason: str = "") -> InputError:
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        return error(f"expected {what} (a plain number is in {unit}) or {forms}; got {shown}" + (f" ({reason})" if reason else ""),
                     source=source, where=where)

    if isinstance(value, bool):
        raise refuse()
    if isinstance(value, int | float):
        number, factor = float(value), scale
    elif isinstance(value, str):
        m = _NUMBER.fullmatch(value)
        if not m:
            raise refuse()
        try:
            factor = factor_of(m.group(2)) if m.group(2) else scale
        except _Refused as exc:
            raise refuse(str(exc)) from None
        number = float(m.group(1))
    else:
        raise refuse()
    in_base = number * factor.numerator / factor.denominator
    if not math.isfinite(in_base):
        raise refuse("not a finite number")
    if in_base < 0 or (positive and in_base == 0):
        raise refuse(f"must be {'> 0' if positive else '>= 0'}")
    cap = limit if maximum is None else maximum * float(scale)
    if in_base > cap:
        raise error(f"expected {what} <= {cap / float(scale):g} {unit} (the limit), got {value!r}", source=source, where=where)
    ratio = factor / scale
    return number * ratio.numerator / ratio.denominator


def parse_size(value: Any, *, unit: str = "B", what: str | None = None, where: str | int | None = None, source: str | None = None,
               positive: bool = False, maximum: float | None = None, error: type[InputError] = InputError) -> float:
    """A size as written (``2GB``, ``"1.5 GiB"``, ``4096``) in ``unit`` (bytes by default; a plain number is in ``unit``).

    At most :data:`~topology.limits.MAX_BYTES` (or ``maximum``, in ``unit``); ``positive`` refuses 0.

    >>> parse_size("64MiB", unit="MiB"), parse_size("2gb")
    (64.0, 2000000000.0)
    >>> parse_size("2Gb", where="--memory")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    topology.errors.InputError: --memory: expected a size in bytes ... got '2Gb' ('Gb' is bits; a size is in bytes: GB or GiB)
    """
    return _parse("size", value, unit, what, where, source, positive, maximum, error)


def parse_duration(value: Any, *, unit: str = "s", what: str | None = None, where: str | int | None = None, source: str | None = None,
                   positive: bool = False, maximum: float | None = None, error: type[InputError] = InputError) -> float:
    """A duration as written (``120ms``, ``"1.5s"``, ``0.1``) in ``unit`` (seconds by default; a plain number is in ``unit``).

    At most :data:`~topology.limits.MAX_SECONDS` (or ``maximum``, in ``unit``); ``positive`` refuses 0.

    >>> parse_duration("2 min"), parse_duration("250us", unit="us")
    (120.0, 250.0)
    """
    return _parse("duration", value, unit, what, where, source, positive, maximum, error)


def parse_rate(value: Any, *, unit: str = "GB/s", what: str | None = None, where: str | int | None = None, source: str | None = None,
               positive: bool = True, maximum: float | None = None, error: type[InputError] = InputError) -> float:
    """A rate as written (``400Gb/s``, ``"50 GB/s"``, ``100Gbps``, ``12.5``) in ``unit`` (GB/s by default, the project's unit
    of bandwidth; a plain number is in ``unit``). Positive unless ``positive=False``; at most
    :data:`~topology.limits.MAX_BANDWIDTH_GBS` GB/s (or ``maximum``, in ``unit``).

    >>> parse_rate("3999Kbit", unit="bit/s"), parse_rate("200Gb/s", unit="B/s")
    (3999000.0, 25000000000.0)
    >>> parse_rate("10GBps")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    topology.errors.InputError: expected a rate in GB/s ... got '10GBps' ('GBps' is ambiguous: GB/s or Gb/s?)
    """
    return _parse("rate", value, unit, what, where, source, positive, maximum, error)


def flag_action(parse: Any, **options: Any) -> type:
    """An ``argparse`` ``action=`` for a flag that takes a quantity: its value through ``parse`` with ``options``.

    A refusal is the :class:`~topology.errors.InputError` naming the flag (one line and exit 2 from the CLI),
    not argparse's usage text: an action's exceptions leave ``parse_args`` as they are.

    >>> import argparse
    >>> p = argparse.ArgumentParser(prog="x")
    >>> _ = p.add_argument("--nic-gbps", action=flag_action(parse_rate, unit="Gb/s"))
    >>> p.parse_args(["--nic-gbps", "50GB/s"]).nic_gbps, p.parse_args(["--nic-gbps", "200"]).nic_gbps
    (400.0, 200.0)
    >>> p.parse_args(["--nic-gbps", "0"])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    topology.errors.InputError: --nic-gbps: expected a rate in Gb/s ... got '0' (must be > 0)
    """
    import argparse

    class Quantity(argparse.Action):
        def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: str | None = None) -> None:
            setattr(namespace, self.dest, parse(values, where=option_string, **options))

    return Quantity


__all__ = ["DURATION_FORMS", "RATE_FORMS", "SIZE_FORMS", "flag_action", "parse_duration", "parse_rate", "parse_size"]
