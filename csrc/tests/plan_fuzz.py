"""Plan-file fuzzer for the flow-plan grammar (``csrc/plan.c``, docs/ncclhook.md): grammar-aware
mutations of random valid plans, aimed at the places where two parsers of one grammar drift apart
(octal and overflowing numbers, repeated keys and classes, NUL bytes, Unicode digits and separators,
the line, field, rule and size limits), plus blind byte edits.

``fuzz_plan(rnd)`` returns the bytes of one plan; ``rnd`` is a ``random.Random`` (``hypothesis``'
``st.randoms()`` in the CI test, a seeded one in ``bench/bench_nccl_plan_fuzz.py``), so one function
feeds both. ``MUTATIONS`` names what it does; ``fuzz_plan(rnd, mutations=[...])`` picks from a subset.
"""

from __future__ import annotations

import random

FUNCS = ("allreduce", "AllReduce", "ncclFuncAllGather", "all_gather", "reducescatter", "broadcast", "sendrecv")
ALGOS = ("ring", "tree", "RING", "collnet_direct", "CollNet_Chain", "nvls_tree", "pat")
PROTOS = ("simple", "ll", "LL128", "Simple")


def _num(rnd: random.Random, lo: int, hi: int, size: bool = False) -> str:
    """A valid spelling of an integer in [lo, hi]: decimal, hex, or (byte counts) a k/m/g suffix."""
    v = rnd.randint(lo, hi)
    if size and rnd.random() < 0.3:
        shift, sfx = rnd.choice([(10, "k"), (20, "m"), (30, "g"), (10, "K"), (20, "M")])
        base = max(lo >> shift, 1 if lo else 0)
        if (base << shift) >= lo and (base << shift) <= hi:
            return f"{rnd.randint(base, max(base, min(hi >> shift, base + 1000)))}{sfx}"
    return f"{v:#x}" if rnd.random() < 0.2 else str(v)


def _mark_keys(rnd: random.Random, with_class: bool) -> list[str]:
    keys = [("dscp", lambda: _num(rnd, 0, 63)), ("prio", lambda: _num(rnd, 0, 7)), ("rate", lambda: _num(rnd, 0, 10**10, True)),
            ("nsocks", lambda: _num(rnd, 1, 16)), ("sockchunk", lambda: _num(rnd, 4096, 1 << 30, True))]
    if with_class:
        keys.append(("class", lambda: _num(rnd, 0, 7)))
    return [f"{k}={v()}" for k, v in rnd.sample(keys, rnd.randint(0, len(keys)))]


def valid_plan(rnd: random.Random) -> list[str]:
    """The lines of a random plan in the grammar (comments, blank lines and spellings vary)."""
    lines = ["# a netweave plan"] * rnd.randint(0, 1) + ["netweave-plan 1"]
    for k in rnd.sample(range(8), rnd.randint(0, 4)):
        lines.append(" ".join([f"class {k}", *_mark_keys(rnd, False)]))
    for _ in range(rnd.randint(0, 4)):
        kind = rnd.choice(["comm", "order"])
        ident = _num(rnd, 0, 3) if rnd.random() < 0.7 else _num(rnd, 0, 2**64 - 1 if kind == "comm" else 2**31 - 1)
        lines.append(" ".join([f"{kind} {ident}", *_mark_keys(rnd, True)]))
    for _ in range(rnd.randint(0, 3)):
        sel = rnd.choice(["*", f"class:{rnd.randint(0, 7)}", f"comm:{_num(rnd, 0, 99)}", f"order:{_num(rnd, 0, 9)}"])
        keys = []
        if rnd.random() < 0.5:
            keys.append(f"coll={rnd.choice(FUNCS)}")
        lo = rnd.randint(0, 4096)
        if rnd.random() < 0.4:
            keys.append(f"min={lo}")
        if rnd.random() < 0.4:
            keys.append(f"max={_num(rnd, lo, 2**40, True)}")
        if rnd.random() < 0.5:
            keys += [f"algo={rnd.choice(ALGOS)}", f"proto={rnd.choice(PROTOS)}"]
        if rnd.random() < 0.3:
            keys.append(f"channels={_num(rnd, 1, 64)}")
        if rnd.random() < 0.3:
            keys.append(f"chunk={_num(rnd, 1, 1 << 24, True)}")
        rnd.shuffle(keys)
        lines.append(" ".join([f"tune {sel}", *keys]))
    for _ in range(rnd.randint(0, 3)):
        keys = [f"dscp={_num(rnd, 0, 63)}"] * (rnd.random() < 0.8) + [f"prio={_num(rnd, 0, 7)}"] * (rnd.random() < 0.5)
        lines.append(" ".join([f"mark {rnd.choice(['*', _num(rnd, 1, 65535)])}", *keys]))
    if rnd.random() < 0.3:  # comments, blank lines and tabs between and after
        i = rnd.randint(1, len(lines))
        lines.insert(i, rnd.choice(["", "   ", "# note", "\t# tab"]))
        j = rnd.randrange(len(lines))
        lines[j] = lines[j] + rnd.choice(["  # trailing", "\t", " #x=1 dscp=99"])
    return lines


def _pick_line(rnd: random.Random, lines: list[str], prefix: tuple[str, ...] = ("class", "comm", "order", "tune", "mark")) -> int | None:
    idx = [i for i, line in enumerate(lines) if line.startswith(prefix)]
    return rnd.choice(idx) if idx else None


def _replace_value(rnd: random.Random, lines: list[str], key: str, new: str) -> list[str]:
    idx = [i for i, line in enumerate(lines) if f" {key}=" in line]
    if not idx:
        i = _pick_line(rnd, lines, ("class", "comm", "order") if key in ("dscp", "prio", "rate", "nsocks", "sockchunk") else ("tune",))
        if i is not None:
            lines[i] += f" {key}={new}"
        return lines
    i = rnd.choice(idx)
    head, _, tail = lines[i].partition(f" {key}=")
    rest = tail.split(" ", 1)
    lines[i] = f"{head} {key}={new}" + (" " + rest[1] if len(rest) > 1 else "")
    return lines


def _octal(rnd, lines):
    return _replace_value(rnd, lines, rnd.choice(["dscp", "prio", "nsocks", "rate"]), "0" + str(rnd.randint(1, 77)))


def _overflow(rnd, lines):
    big = rnd.choice(["18446744073709551616", "18446744073709551615", "9223372036854775808", "0xffffffffffffffffk", "99999999999999999999g",
                      "17179869184g", "0x10000000000000000", "9223372036854775807"])
    return _replace_value(rnd, lines, rnd.choice(["rate", "chunk", "max", "min", "sockchunk"]), big)


def _repeat_key(rnd, lines):
    i = _pick_line(rnd, lines, ("class", "comm", "order", "mark"))
    if i is not None:
        lines[i] += rnd.choice([" dscp=5", " prio=2", " priority=3", " dscp=63 dscp=1"])
    return lines


def _repeat_class(rnd, lines):
    k = rnd.randint(0, 7)
    lines += [f"class {k} dscp={rnd.randint(0, 63)}", f"class {k} prio={rnd.randint(0, 7)}"]
    return lines


def _nul(rnd, lines):
    i = rnd.randrange(len(lines))
    j = rnd.randint(0, len(lines[i]))
    lines[i] = lines[i][:j] + "\0" + lines[i][j:]
    return lines


def _unicode_digit(rnd, lines):
    i = _pick_line(rnd, lines)
    if i is not None:
        pos = [j for j, c in enumerate(lines[i]) if c.isdigit()]
        if pos:
            j = rnd.choice(pos)
            lines[i] = lines[i][:j] + rnd.choice(["\u0663", "\uff13", "\u0967", "\u00b2"]) + lines[i][j + 1:]
    return lines


def _unicode_separator(rnd, lines):
    i = rnd.randrange(len(lines))
    sep = rnd.choice(["\u00a0", "\u2028", "\u2029", "\x0b", "\x0c", "\x1c", "\x85", "\u3000", "\ufeff", "\r"])
    if " " in lines[i] and rnd.random() < 0.7:
        lines[i] = lines[i].replace(" ", sep, 1)
    else:
        lines[i] += sep + rnd.choice(["mark * dscp=1", "class 1 dscp=9", ""])
    return lines


def _long_line(rnd, lines):
    i = rnd.randrange(len(lines))
    lines[i] += rnd.choice([" #", " dscp=1 #", ""]) + "x" * rnd.choice([1000, 1010, 1023, 1024, 1100])
    return lines


def _many_fields(rnd, lines):
    n = rnd.choice([20, 22, 23, 24, 25, 30])
    lines.append("tune *" + " " * rnd.randint(1, 2) + " ".join(["min=0"] * (n - 2)))
    return lines


def _many_rules(rnd, lines):
    kind = rnd.choice(["mark", "comm", "order", "tune"])
    n = rnd.choice([63, 64, 65, 100])
    for p in range(1, n + 1):
        lines.append({"mark": f"mark {p} dscp=8", "comm": f"comm {p} dscp=8", "order": f"order {p}", "tune": f"tune order:{p} channels=2"}[kind])
    return lines


def _sign_or_empty(rnd, lines):
    bad = rnd.choice(["+5", "-1", "", " ", "5 ", "0x", "1kk", "1.5", "1e3"])
    return _replace_value(rnd, lines, rnd.choice(["dscp", "prio", "rate", "chunk"]), bad)


def _suffix_where_not_allowed(rnd, lines):
    return _replace_value(rnd, lines, rnd.choice(["dscp", "prio", "nsocks", "channels"]), rnd.choice(["1k", "0k", "0x1k"]))


def _bad_names(rnd, lines):
    i = _pick_line(rnd, lines)
    if i is not None:
        lines[i] += rnd.choice([" coll=all-reduce", " algo=collnetdirect proto=ll", " algo=ring", " colour=red", " =5", " class=8",
                                " coll=" + "a" * 40, " algo=RING proto=LL_128"])
    return lines


def _header(rnd, lines):
    choice = rnd.randrange(4)
    if choice == 0:
        lines.insert(0, "class 1 dscp=9")
    elif choice == 1:
        lines.append("netweave-plan 1")
    elif choice == 2 and "netweave-plan 1" in lines:
        lines[lines.index("netweave-plan 1")] = rnd.choice(["netweave-plan 01", "netweave-plan 2", "netweave-plan 1 x", "netweave-plan"])
    else:
        lines[:] = [line for line in lines if line != "netweave-plan 1"]
    return lines


def _bytes_edit(rnd, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rnd.randint(1, 4)):
        op = rnd.randrange(3)
        pos = rnd.randint(0, len(b))
        if op == 0 and pos < len(b):
            b[pos] = rnd.randrange(256)
        elif op == 1:
            b[pos:pos] = bytes([rnd.choice([0, 9, 10, 13, 32, 35, 61, 0x80, 0xC3, 0xFF, rnd.randrange(256)])])
        elif pos < len(b):
            del b[pos]
    return bytes(b)


MUTATIONS = {
    "octal": _octal, "overflow": _overflow, "repeat_key": _repeat_key, "repeat_class": _repeat_class, "nul": _nul,
    "unicode_digit": _unicode_digit, "unicode_separator": _unicode_separator, "long_line": _long_line, "many_fields": _many_fields,
    "many_rules": _many_rules, "sign_or_empty": _sign_or_empty, "suffix": _suffix_where_not_allowed, "names": _bad_names, "header": _header,
}


def fuzz_plan(rnd: random.Random, mutations: list[str] | None = None) -> bytes:
    """One plan: a valid plan, then 0-3 grammar mutations (1-2 of ``mutations`` when given), sometimes blind byte edits;
    CRLF now and then."""
    lines = valid_plan(rnd)
    names = list(mutations if mutations is not None else MUTATIONS)
    for _ in range(rnd.choice([0, 1, 1, 1, 2, 3] if mutations is None else [1, 1, 2])):
        lines = MUTATIONS[rnd.choice(names)](rnd, lines)
    eol = "\r\n" if rnd.random() < 0.1 else "\n"
    data = (eol.join(lines) + (eol if rnd.random() < 0.9 else "")).encode("utf-8")
    if mutations is None and rnd.random() < 0.15:
        data = _bytes_edit(rnd, data)
    return data


# ------------------------------------------------------------------ the differential check --
PROBE_CLASSES = (-1, 0, 3, 7)


def check_batch(harness: str, lib: str, plans: list[bytes], timeout: float = 300, env: dict[str, str] | None = None) -> list[str]:
    """Each plan through ``plan_check LIB -`` (the plugin library dlopened as NCCL does): its result text."""
    import struct
    import subprocess

    stdin = b"".join(struct.pack("<I", len(p)) + p for p in plans)
    res = subprocess.run([harness, lib, "-"], input=stdin, capture_output=True, timeout=timeout, env=env)
    if res.returncode != 0 or b"Sanitizer" in res.stderr or b"runtime error" in res.stderr:
        raise RuntimeError(f"plan_check exited {res.returncode}: {res.stderr.decode(errors='replace')[-2000:]}")
    out, pos = [], 0
    while pos < len(res.stdout):
        (n,) = struct.unpack_from("<I", res.stdout, pos)
        out.append(res.stdout[pos + 4:pos + 4 + n].decode("ascii", "replace"))
        pos += 4 + n
    if len(out) != len(plans):
        raise RuntimeError(f"plan_check answered {len(out)} of {len(plans)} plans: {res.stderr.decode(errors='replace')[-2000:]}")
    return out


def probes(plan) -> list[tuple[int, int, int]]:
    """(comm id, order, NCCL class) triples that exercise a plan's comm/order/class rules."""
    comm_ids = sorted({r.ident for r in plan.comms if r.kind == "comm"} | {0})[:4]
    orders = sorted({r.ident for r in plan.comms if r.kind == "order"} | {-1})[:4]
    return [(c, o, k) for c in comm_ids for o in orders for k in PROBE_CLASSES]


def disagreement(data: bytes, c_result: str, c_resolve) -> str | None:
    """Where the Python path (``parse_plan`` -> ``FlowPlan`` -> ``format_plan``, ``FlowPlan.resolve``) and the C
    parser's result for the same bytes differ; None when they agree. ``c_resolve(text, comm, order, cls)`` is the
    plugin's ``netweave_plan_resolve_text`` (a dict of marks, or the error string)."""
    from flowsched import ncclhook

    try:
        plan = ncclhook.parse_plan(data, source="fuzz")
    except ncclhook.NcclHookError as e:
        line = e.where if e.where is not None else 0
        mine = f"line {line}: {e.message}"
        theirs = c_result.split(" ", 2)[2].rstrip("\n") if c_result.startswith("ERROR ") else c_result
        return None if mine == theirs else f"verdict: python {mine!r}, C {c_result!r}"
    if not c_result.startswith("OK\n"):
        return f"verdict: python accepted, C {c_result!r}"
    try:
        text = ncclhook.format_plan(plan)
    except ncclhook.NcclHookError as e:
        return f"format_plan refused a plan the C parser accepted: {e}"
    if text != c_result[3:]:
        return f"canonical text: python {text!r}, C {c_result[3:]!r}"
    if b"\0" in data:
        return "a plan with a NUL byte was accepted"
    for comm, order, cls in probes(plan):
        mine = plan.resolve(None if cls < 0 else cls, comm_id=comm, order=None if order < 0 else order)
        theirs = c_resolve(text, comm, order, cls)
        if mine != theirs:
            return f"resolve({comm}, {order}, {cls}): python {mine}, C {theirs}"
    return None


def c_resolver(lib_path):
    """``netweave_plan_resolve_text`` of a plugin library: ``resolve(text, comm, order, cls)`` -> marks dict or "line N: ..." string."""
    import ctypes

    fn = ctypes.CDLL(str(lib_path)).netweave_plan_resolve_text
    fn.argtypes = [ctypes.c_char_p, ctypes.c_uint64, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int64), ctypes.c_char_p, ctypes.c_size_t]
    fn.restype = ctypes.c_int

    def resolve(text: str | bytes, comm: int, order: int, cls: int) -> dict[str, int | None] | str:
        out = (ctypes.c_int64 * 6)()
        err = ctypes.create_string_buffer(256)
        data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
        if fn(data, comm, order, cls, out, err, 256) != 0:
            return err.value.decode("ascii", "replace")
        keys = ("cls", "dscp", "prio", "rate", "nsocks", "sockchunk")
        return {k: (None if v == -1 else v) for k, v in zip(keys, out, strict=True)}

    return resolve
