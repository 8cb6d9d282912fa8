"""File formats checked against their published JSON Schemas (draft 2020-12), with the project's one-line errors.

Each file format users write or read has one schema, a data file shipped beside the package that owns the
format (``<package>/schemas/<format>.schema.json``); ``netweave schema list`` names them all and
``docs/formats.md`` shows how to point an editor at them. The one reader of each format calls
:func:`validate` on the parsed document first, so that the structure (types, required and known fields,
enumerations, bounds, the strings :mod:`topology.units` reads) is stated once, in the schema, and what an
editor flags is what the reader refuses. Checks a schema cannot state (cross-references, names of topology
nodes, ``dp*tp*pp == gpus``) stay in the readers' code, after the schema.

A violation becomes an :class:`~topology.errors.InputError` (or the reader's subclass) on one line, naming the
file, the JSON path of the offending value and what was expected:

>>> schema = {"type": "object", "properties": {"jobs": {"type": "array", "items": {
...     "type": "object", "properties": {"gpus": {"type": "integer", "minimum": 1, "title": "a positive integer"}}}}}}
>>> validate({"jobs": [{"gpus": 8}, {"gpus": "x"}]}, schema, source="jobs.json")
Traceback (most recent call last):
...
topology.errors.InputError: jobs.json: jobs[1].gpus: expected a positive integer, got 'x'

Why ``jsonschema``: it is the reference validator of the JSON Schema specification in Python (every draft,
the official test suite), and a draft 2020-12 schema is what editors (VS Code's ``json.schemas``, the YAML
language server's ``yaml.schemas``) and other languages' validators read, so one file serves the readers and
the users' tools. Its errors carry the JSON path and the failing keyword, from which :func:`describe` writes
the project's message. The job plan's reader (:mod:`netweave.runtime.plan`) stays hand-written because the
runtime imports only the standard library and torch; its schema is published all the same and a test checks
that the two agree.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from importlib import resources
from typing import Any

from .errors import InputError

DIALECT = "https://json-schema.org/draft/2020-12/schema"

_TYPE_WORDS = {"object": "a mapping", "array": "a list", "string": "a string", "integer": "an integer", "number": "a number",
               "boolean": "true or false", "null": "null"}


@functools.cache
def load_schema(package: str, name: str) -> dict[str, Any]:
    """The schema ``<package>/schemas/<name>.schema.json`` (read once, then cached; do not modify it).

    >>> load_schema("topology", "topology")["$id"]
    'urn:netweave:schema:topology'
    """
    text = resources.files(package).joinpath("schemas", f"{name}.schema.json").read_text(encoding="utf-8")
    return json.loads(text)


def schema_file(package: str, name: str) -> str:
    """The path of the schema file inside the installed (or source) package."""
    return str(resources.files(package).joinpath("schemas", f"{name}.schema.json"))


_VALIDATORS: dict[int, tuple[dict[str, Any], Any]] = {}


@functools.cache
def _validator_class() -> Any:
    """Draft 2020-12 with one strictness of ours: an integer is an ``int`` (``8.0`` is not one), as every reader has it."""
    from jsonschema import Draft202012Validator, validators

    def is_integer(checker: Any, value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    return validators.extend(Draft202012Validator, type_checker=Draft202012Validator.TYPE_CHECKER.redefine("integer", is_integer))


def validator_for(schema: dict[str, Any]) -> Any:
    """A draft 2020-12 validator for ``schema`` (built once per schema object; integers are ``int`` only)."""
    entry = _VALIDATORS.get(id(schema))
    if entry is None or entry[0] is not schema:
        if len(_VALIDATORS) > 256:   # ad-hoc schemas (the shipped ones are few and cached for good)
            _VALIDATORS.clear()
        entry = (schema, _validator_class()(schema))
        _VALIDATORS[id(schema)] = entry
    return entry[1]


def iter_problems(data: Any, schema: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """Every violation of ``schema`` in ``data`` as ``(JSON path, message)``, in document order.

    >>> list(iter_problems({"a": -1, "b": "x"}, {"properties": {"a": {"minimum": 0}, "b": {"type": "integer"}}}))
    [('a', 'expected a number >= 0, got -1'), ('b', "expected an integer, got 'x'")]
    """
    errors = sorted(validator_for(schema).iter_errors(data), key=lambda e: _order_key(data, e))
    for error in errors:
        yield describe(error)


def validate(data: Any, schema: dict[str, Any], *, source: str | None = None, error: type[InputError] = InputError) -> None:
    """Raise ``error`` on one line (file, JSON path, what was expected) unless ``data`` follows ``schema``.

    Of several violations the one the reader would meet first is reported: the first in document order,
    and of those at one place the most specific (:func:`jsonschema.exceptions.relevance`).
    """
    from jsonschema.exceptions import relevance

    errors = list(validator_for(schema).iter_errors(data))
    if not errors:
        return
    first = min(errors, key=lambda e: (_order_key(data, e), tuple(-x for x in _rank(relevance(e)))))
    where, message = describe(first)
    raise error(message, source=source, where=where)


def _rank(key: Any) -> tuple[int, ...]:
    return tuple(int(x) if isinstance(x, bool | int) else 0 for x in key)


def _order_key(data: Any, error: Any) -> tuple[int, ...]:
    """The position of the error's value in the document: list indices and key positions, depth first.

    A missing field sits after the fields that are there, so that a reader that checks what is written
    before what is missing names the same place.
    """
    out: list[int] = []
    node = data
    parts = list(error.absolute_path)
    if error.validator == "required":
        parts.append(next((k for k in error.validator_value if isinstance(error.instance, dict) and k not in error.instance), ""))
    for part in parts:
        if isinstance(node, dict):
            keys = list(node)
            out.append(keys.index(part) if part in keys else len(keys))
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int):
            out.append(part)
            node = node[part] if part < len(node) else None
        else:
            break
    return tuple(out)


def path_text(parts: Any) -> str:
    """A JSON path as the project writes it: ``jobs[2].gpus``; the document itself is ``(top level)``.

    >>> path_text(["jobs", 2, "gpus"]), path_text([])
    ('jobs[2].gpus', '(top level)')
    """
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    text = text or "(top level)"
    return text if len(text) <= 120 else text[:117] + "..."


def describe(error: Any) -> tuple[str, str]:
    """``(JSON path, message)`` for a ``jsonschema`` error, in the project's words (``expected ..., got ...``).

    A subschema's ``title`` says what a value must be (``"a positive number of bytes or a size with a unit (2GB, ...)"``);
    a number's ``x-what`` names it for its bounds (``"a bandwidth in GB/s"``: ``expected a bandwidth in GB/s > 0``), as
    :func:`topology.inputs.check_number` words them (validators ignore such ``x-`` keywords); without either the
    message is composed from the failing keyword.
    """
    path = list(error.absolute_path)
    schema = error.schema if isinstance(error.schema, dict) else {}
    keyword, expected, instance = error.validator, error.validator_value, error.instance
    if keyword == "required":
        missing = next((k for k in expected if isinstance(instance, dict) and k not in instance), expected[0])
        return path_text([*path, missing]), "missing required field"
    if keyword == "additionalProperties" or keyword == "unevaluatedProperties":
        known = sorted(schema.get("properties", {}))
        extra = sorted(str(k) for k in instance if k not in schema.get("properties", {})) if isinstance(instance, dict) else ["?"]
        shown = f"; expected one of {', '.join(known)}" if known else ""
        return path_text([*path, extra[0] if extra else "?"]), f"unknown field {extra[0] if extra else '?'!r}{shown}"
    if keyword == "propertyNames":
        title = (schema.get("propertyNames") or {}).get("title") if isinstance(schema.get("propertyNames"), dict) else None
        bad = next((k for k in instance if not _valid(k, schema["propertyNames"])), None) if isinstance(instance, dict) else None
        return path_text(path), f"expected keys that are {title or 'names'}, got {_show(bad)}"
    if keyword == "const" and path and path[-1] == "version":
        return path_text(path), f"unsupported version {_show(instance)}, expected {_show(expected)}"
    what = schema.get("x-what")
    if what and keyword in _BOUNDS:
        return path_text(path), _bound_message(what, keyword, expected, instance)
    if what and keyword == "type":
        return path_text(path), f"expected {what}, got {_show(instance)}"
    if schema.get("title") and len(error.absolute_schema_path) > 1:  # the root's title names the format, not a value
        return path_text(path), f"expected {schema['title']}, got {_show(instance)}"
    if keyword in ("anyOf", "oneOf") and error.context:
        from jsonschema.exceptions import relevance

        # "or null" branches say nothing about a value that is not null: describe the branch that was meant
        meant = [e for e in error.context if not (e.validator == "type" and e.validator_value == "null")] or error.context
        return describe(max(meant, key=relevance))
    return path_text(path), _keyword_message(keyword, expected, instance, error.message)


_BOUNDS = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}


def _bound_message(what: str, keyword: str, bound: Any, instance: Any) -> str:
    """``expected a bandwidth in GB/s > 0, got -1``: a numeric bound as :func:`topology.inputs.check_number` words it."""
    limit = " (the limit)" if keyword == "maximum" else ""
    return f"expected {what} {_BOUNDS[keyword]} {_num(bound)}{limit}, got {_show(instance)}"


def _valid(value: Any, schema: Any) -> bool:
    return validator_for(schema if isinstance(schema, dict) else {}).is_valid(value)


def _keyword_message(keyword: str, expected: Any, instance: Any, fallback: str) -> str:
    got = f", got {_show(instance)}"
    if keyword == "type":
        types = expected if isinstance(expected, list) else [expected]
        return "expected " + " or ".join(_TYPE_WORDS.get(t, t) for t in types) + (f", got {_type_word(instance)}"
                                                                                 if isinstance(instance, dict | list) else got)
    if keyword == "enum":
        return f"expected one of {', '.join(str(x) for x in expected)}{got}"
    if keyword == "const":
        return f"expected {_show(expected)}{got}"
    if keyword in _BOUNDS:
        return _bound_message("a number", keyword, expected, instance)
    if keyword == "minItems":
        return "expected a non-empty list" if expected == 1 else f"expected at least {expected} items, got {len(instance)}"
    if keyword == "maxItems":
        return f"expected at most {expected} items (the limit), got {len(instance)}"
    if keyword == "minLength":
        return f"expected a non-empty string{got}" if expected == 1 else f"expected at least {expected} characters{got}"
    if keyword == "maxLength":
        return f"expected at most {expected} characters (the limit){got}"
    if keyword == "minProperties":
        return "expected a non-empty mapping"
    if keyword == "pattern":
        return f"expected a string matching {expected}{got}"
    if keyword == "uniqueItems":
        return "expected items that are all different"
    return fallback.replace("\n", " ")[:200]


def _type_word(value: Any) -> str:
    return "a mapping" if isinstance(value, dict) else "a list"


def _num(x: Any) -> str:
    return str(int(x)) if isinstance(x, int | float) and float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def _show(value: Any) -> str:
    if isinstance(value, dict | list):
        return _type_word(value)
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


__all__ = ["DIALECT", "describe", "iter_problems", "load_schema", "path_text", "schema_file", "validate", "validator_for"]
