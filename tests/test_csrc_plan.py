"""The flow-plan file: Python writer/reader vs the C parser in csrc/plan.c (through ctypes),
and the tuner plugin applying `tune` rules (driven through its ncclTunerPlugin_v6 table)."""

from __future__ import annotations

import ctypes
import importlib.util
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowsched import ncclhook

LIB = ncclhook.build() / ncclhook.PLUGIN_LIB
clib = ctypes.CDLL(str(LIB))
_spec = importlib.util.spec_from_file_location("plan_fuzz", ncclhook.CSRC / "tests" / "plan_fuzz.py")
plan_fuzz = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plan_fuzz)
c_resolve = plan_fuzz.c_resolver(LIB)  # the plugin's own parse + resolve, in this process


def opt(lo: int, hi: int) -> st.SearchStrategy[int | None]:
    return st.none() | st.integers(lo, hi)


marks = st.builds(ncclhook.ClassMark, dscp=opt(0, 63), prio=opt(0, 7), rate=opt(0, 10**10), nsocks=opt(1, 16), sockchunk=opt(4096, 1 << 20))
comm_rules = st.builds(ncclhook.CommRule, kind=st.sampled_from(["comm", "order"]), ident=st.integers(0, 3), cls=opt(0, 7), mark=marks)
tunes = st.builds(ncclhook.TuneRule, selector=st.sampled_from(["*", "class:2", "comm:0x10", "order:1"]),
                  coll=st.none() | st.sampled_from(["allreduce", "allgather"]), min_bytes=opt(0, 1000), max_bytes=opt(1000, 10**9),
                  channels=opt(1, 64), chunk=opt(1, 1 << 22))
mark_rules = st.builds(ncclhook.MarkRule, port=opt(1, 65535), dscp=opt(0, 63), prio=opt(0, 7))
plans = st.builds(ncclhook.FlowPlan, classes=st.dictionaries(st.integers(0, 7), marks, max_size=4),
                  comms=st.lists(comm_rules, max_size=4), tunes=st.lists(tunes, max_size=3), marks=st.lists(mark_rules, max_size=3))


@settings(max_examples=60, deadline=None)
@given(plans, st.integers(-1, 7), st.integers(0, 3), st.integers(-1, 3))
def test_c_and_python_resolve_the_same_marks(plan, traffic_class, comm_id, order):
    text = ncclhook.format_plan(plan)
    assert ncclhook.parse_plan(text) == plan  # round trip
    py = plan.resolve(None if traffic_class < 0 else traffic_class, comm_id=comm_id, order=None if order < 0 else order)
    assert c_resolve(text, comm_id, order, traffic_class) == py


HEAD = "netweave-plan 1\n"


@pytest.mark.parametrize("text,line,message", [
    ("", None, "empty plan, expected the header"),
    ("# only a comment\n\n", None, "empty plan"),
    ("netweave-plan 2\n", 1, "unsupported plan version '2'"),
    ("netweave-plan 01\n", 1, "unsupported plan version '01'"),
    ("class 1 dscp=1\n", 1, "expected the header"),
    (HEAD + "netweave-plan 1\n", 2, "a second header"),
    (HEAD + "class 8 dscp=1\n", 2, "class must be an integer 0..7, got '8'"),
    (HEAD + "# comment\nclass 1 dscp=64\n", 3, "dscp must be an integer 0..63, got '64'"),
    (HEAD + "class 1 dscp=010\n", 2, "got '010' (no leading zeros: octal is not read)"),
    (HEAD + "class 1 dscp=1k\n", 2, "dscp must be an integer 0..63"),
    (HEAD + "class 1 dscp=+5\n", 2, "got '+5'"),
    (HEAD + "class 1 dscp=-1\n", 2, "got '-1'"),
    (HEAD + "class 1 dscp=\n", 2, "got ''"),
    (HEAD + "class 1 dscp=0x\n", 2, "got '0x'"),
    (HEAD + "class 1 rate=1.5m\n", 2, "rate must be a byte count"),
    (HEAD + "class 1 rate=9223372036854775808\n", 2, "rate must be a byte count 0..9223372036854775807"),
    (HEAD + "class 1 rate=0xffffffffffffffffk\n", 2, "rate must be a byte count"),  # used to wrap to "unlimited"
    (HEAD + "tune * max=18446744073709551616\n", 2, "max must be a byte count 0..18446744073709551615"),
    (HEAD + "tune * chunk=0\n", 2, "chunk must be a byte count 1.."),
    (HEAD + "class 1 dscp=1 dscp=2\n", 2, "key 'dscp' given twice"),
    (HEAD + "comm 5 prio=1 priority=2\n", 2, "key 'priority' given twice"),
    (HEAD + "class 1 dscp=1\nclass 1 prio=2\n", 3, "class 1 already given on line 2"),
    (HEAD + "comm 5 colour=red\n", 2, "unknown key 'colour' for comm (dscp, prio, rate, nsocks, sockchunk, class)"),
    (HEAD + "class 2 class=3\n", 2, "unknown key 'class' for class"),
    (HEAD + "mark 80 rate=5\n", 2, "unknown key 'rate' for mark (dscp, prio)"),
    (HEAD + "mark 0 dscp=1\n", 2, "mark selector must be * or a port 1..65535, got '0'"),
    (HEAD + "mark 70000 dscp=1\n", 2, "mark selector must be * or a port 1..65535"),
    (HEAD + "order 2147483648\n", 2, "order must be an integer 0..2147483647"),
    (HEAD + "tune class:1 algo=ring\n", 2, "give algo and proto together"),
    (HEAD + "tune * algo=warp proto=simple\n", 2, "unknown algorithm 'warp'"),
    (HEAD + "tune * min=10 max=9\n", 2, "min > max"),
    (HEAD + "tune rack:1\n", 2, "tune selector must be *, class:K, comm:ID or order:N, got 'rack:1'"),
    (HEAD + "class 1 nsocks=0\n", 2, "nsocks must be an integer 1..16"),
    (HEAD + "bogus 1\n", 2, "unknown rule 'bogus'"),
    (HEAD + "comm\n", 2, "'comm' needs a selector"),
    (HEAD + "class 1 dscp=1\0\n", 2, "NUL byte at column 15"),
    (HEAD + "# a NUL \0 in a comment\n", 2, "NUL byte at column 9"),
    (HEAD + "class 1 dscp=\u0663\n", 2, "byte 0xd9 at column 14 is not allowed outside a comment"),  # Arabic-Indic three
    (HEAD + "class\u00a01 dscp=1\n", 2, "byte 0xc2 at column 6"),  # no-break space
    (HEAD + "class 1 dscp=1\u2028mark * dscp=9\n", 2, "byte 0xe2 at column 15"),  # line separator: not a line break here
    (HEAD + "class 1\x0bdscp=1\n", 2, "byte 0x0b at column 8"),
    (HEAD + "class 1\rdscp=1\n", 2, "byte 0x0d at column 8"),  # CR only before the LF
    (HEAD + "class 1 dscp=1 #" + "x" * 1008 + "\n", 2, "line is 1024 bytes, more than 1023"),
    (HEAD + "tune *" + " min=0" * 23 + "\n", 2, "more than 24 fields"),
    (HEAD + "".join(f"mark {p} dscp=8\n" for p in range(1, 66)), 66, "more than 64 mark rules"),
    (HEAD + "".join(f"tune order:{p}\n" for p in range(65)), 66, "more than 64 tune rules"),
    (HEAD + "".join(f"order {p}\n" for p in range(65)), 66, "more than 64 comm/order rules"),
])
def test_grammar_edge_cases_are_rejected_with_line_and_reason(text, line, message):
    """One parser: parse_plan's error and the plugin's (through its own export) are the same line and message."""
    with pytest.raises(ncclhook.NcclHookError) as e:
        ncclhook.parse_plan(text, source="x.plan")
    assert e.value.where == line and message in e.value.message, str(e.value)
    assert str(e.value) == f"x.plan: {'' if line is None else f'line {line}: '}{e.value.message}"
    if "\0" not in text:
        assert c_resolve(text, 0, 0, 0) == f"line {line or 0}: {e.value.message}"


@pytest.mark.parametrize("text,expected", [
    (HEAD.replace("\n", "\r\n") + "class 1 dscp=0x10\r\n", "class 1 dscp=16\n"),  # CRLF; hex
    (HEAD + "class 1 rate=8g sockchunk=64k\n", f"class 1 rate={8 << 30} sockchunk={64 << 10}\n"),
    (HEAD + "class 1 rate=9223372036854775807 dscp=0\n", "class 1 dscp=0 rate=9223372036854775807\n"),
    (HEAD + "class 3 priority=5\t# café: comments may hold any byte but NUL\n", "class 3 prio=5\n"),
    (HEAD + "comm 0xffffffffffffffff\ntune comm:18446744073709551615 coll=ncclFuncAllReduce\n",
     "comm 0xffffffffffffffff\ntune comm:0xffffffffffffffff coll=allreduce\n"),
    (HEAD + "tune * coll=All_Gather algo=CollNet_Direct proto=LL128\n", "tune * coll=allgather algo=collnet_direct proto=ll128\n"),
    (HEAD + "tune * algo=nvls_tree proto=simple min=0\n", "tune * min=0 algo=nvls_tree proto=simple\n"),
    (HEAD + "mark 80 dscp=1\nmark 80 dscp=2\nmark * prio=3\n", "mark 80 dscp=1\nmark 80 dscp=2\nmark * prio=3\n"),
    (HEAD + "class 1 dscp=1 #" + "x" * 1007 + "\nclass 2", "class 1 dscp=1\nclass 2\n"),  # 1023 bytes; no final LF
    (HEAD + "".join(f"mark {p} dscp=8\n" for p in range(1, 65)), "".join(f"mark {p} dscp=8\n" for p in range(1, 65))),
])
def test_grammar_accepts_and_normalises(text, expected):
    assert ncclhook.format_plan(ncclhook.parse_plan(text)) == HEAD + expected


def test_repeated_comm_rules_overlay_in_file_order():
    text = HEAD + "comm 7 dscp=10 prio=1\norder 0 class=2 rate=5\ncomm 7 dscp=12\n"
    plan = ncclhook.parse_plan(text)
    want = {"cls": 2, "dscp": 12, "prio": 1, "rate": 5, "nsocks": None, "sockchunk": None}
    assert plan.resolve(5, comm_id=7, order=0) == c_resolve(text, 7, 0, 5) == want


def test_plan_size_limit():
    big = HEAD + "#" * (1 << 20) + "\n"
    with pytest.raises(ncclhook.NcclHookError, match=r"^x.plan: the plan is 1048593 bytes, more than 1048576$"):
        ncclhook.parse_plan(big, source="x.plan")


def test_python_names_are_the_librarys():
    assert ncclhook._plan_lib().names == [list(ncclhook.FUNCS), list(ncclhook.ALGORITHMS), list(ncclhook.PROTOCOLS)]


def test_writer_refuses_what_the_plugin_would_reject():
    """The issue's case: a flow plan with 100 port rules used to pass check-plan and then be rejected by the plugin."""
    from flowsched.plan import FlowPlan, FlowRule, HostPlan, write_nccl_plan

    flow = FlowPlan({"h": HostPlan([FlowRule("job", 2, port=29500 + i) for i in range(100)])})
    with pytest.raises(ncclhook.NcclHookError, match="the plan has 100 mark rules; the NCCL plugin takes at most 64"):
        write_nccl_plan(flow, "h", "/nonexistent/never-written.plan")
    for bad, what in ((ncclhook.TuneRule(coll="allreduce\nmark * dscp=1"), "tune coll must be a name"),
                      (ncclhook.TuneRule(selector="* coll=allreduce"), "tune selector must be a name"),
                      (ncclhook.MarkRule(None, dscp="5\nmark * dscp=1"), "dscp must be an integer"),  # type: ignore[arg-type]
                      (ncclhook.MarkRule(None, dscp=True), "dscp must be an integer"),
                      (ncclhook.CommRule("comm", 1.5), "comm id must be an integer")):  # type: ignore[arg-type]
        field = "tunes" if isinstance(bad, ncclhook.TuneRule) else "marks" if isinstance(bad, ncclhook.MarkRule) else "comms"
        with pytest.raises(ncclhook.NcclHookError, match=what):
            ncclhook.format_plan(ncclhook.FlowPlan(**{field: [bad]}))
    with pytest.raises(ncclhook.NcclHookError, match=r"<format_plan>: line 2: dscp must be an integer 0..63, got '64'"):
        ncclhook.format_plan(ncclhook.FlowPlan(classes={1: ncclhook.ClassMark(dscp=64)}))


def test_read_plan_takes_bytes(tmp_path):
    bad = tmp_path / "latin1.plan"
    bad.write_bytes(b"netweave-plan 1\nclass 1 dscp=\xb3\n")
    with pytest.raises(ncclhook.NcclHookError, match=r"latin1.plan: line 2: byte 0xb3 at column 14"):
        ncclhook.read_plan(bad)
    huge = tmp_path / "huge.plan"
    huge.write_bytes(b"netweave-plan 1\n" + b"#" * (1 << 20))
    with pytest.raises(ncclhook.NcclHookError, match=r"huge.plan: the plan is larger than 1048576 bytes"):
        ncclhook.read_plan(huge)
    with pytest.raises(ncclhook.NcclHookError, match="cannot read plan"):
        ncclhook.read_plan(tmp_path)


def test_read_and_write_plan(tmp_path):
    plan = ncclhook.FlowPlan(classes={1: ncclhook.ClassMark(dscp=10)}, marks=[ncclhook.MarkRule(None, 46, 1)])
    path = ncclhook.write_plan(plan, tmp_path / "a.plan")
    assert ncclhook.read_plan(path) == plan
    with pytest.raises(ncclhook.NcclHookError, match="cannot read plan"):
        ncclhook.read_plan(tmp_path / "missing.plan")


# ------------------------------------------------------------------ tuner --
INIT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint64, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_void_p,
                        ctypes.c_void_p, ctypes.c_void_p)
COLLINFO = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                            ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int))
FINAL = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
CHUNK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                         ctypes.POINTER(ctypes.c_size_t))
NETINIT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint64, ctypes.POINTER(ctypes.c_int), ctypes.c_void_p,
                           ctypes.c_void_p)


class TunerV6(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("init", INIT), ("getCollInfo", COLLINFO), ("finalize", FINAL), ("getChunkSize", CHUNK)]


class NetHead(ctypes.Structure):  # the first two members of ncclNet_v12_t
    _fields_ = [("name", ctypes.c_char_p), ("init", NETINIT)]


ALLREDUCE, ALLGATHER = 4, 2
RING, TREE, SIMPLE, LL = 1, 0, 2, 0


def use_plan(tmp_path, monkeypatch, plan):
    path = ncclhook.write_plan(plan, tmp_path / "tune.plan")
    monkeypatch.setenv("NETWEAVE_PLAN", str(path))  # the library reads the process environment (putenv)
    time.sleep(0.15)  # the library re-reads the plan at most every 100 ms


def coll_info(tuner, ctx, coll, nbytes, unsupported=()):
    table = (ctypes.c_float * 21)(*([1.0] * 21))
    for a, p in unsupported:
        table[a * 3 + p] = -1.0
    nch = ctypes.c_int(-7)
    assert tuner.getCollInfo(ctx, coll, nbytes, 1, ctypes.cast(table, ctypes.c_void_p), 7, 3, 0, ctypes.byref(nch)) == 0
    chosen = [(i // 3, i % 3) for i in range(21) if table[i] == 0.0]
    chunk = ctypes.c_size_t(1 << 20)
    assert tuner.getChunkSize(ctx, coll, nbytes, RING, SIMPLE, 2, ctypes.byref(chunk)) == 0
    return chosen, nch.value, chunk.value


def test_tuner_applies_first_matching_rule(tmp_path, monkeypatch):
    tuner = TunerV6.in_dll(clib, "ncclTunerPlugin_v6")
    assert tuner.name == b"netweave"
    use_plan(tmp_path, monkeypatch, ncclhook.FlowPlan(tunes=[
        ncclhook.TuneRule("*", coll="allreduce", max_bytes=1 << 20, algo="ring", proto="simple", channels=3, chunk=131072),
        ncclhook.TuneRule("*", coll="allreduce", algo="tree", proto="ll"),
    ]))
    ctx = ctypes.c_void_p()
    assert tuner.init(ctypes.byref(ctx), 0xAB01, 4, 2, None, None, None) == 0
    assert coll_info(tuner, ctx, ALLREDUCE, 1 << 20) == ([(RING, SIMPLE)], 3, 131072)
    assert coll_info(tuner, ctx, ALLREDUCE, (1 << 20) + 1) == ([(TREE, LL)], -7, 1 << 20)  # second rule, no channels/chunk
    assert coll_info(tuner, ctx, ALLGATHER, 100) == ([], -7, 1 << 20)  # no rule: NCCL decides
    # an unsupported (algo, proto) pair (-1.0 in NCCL's table) is never forced
    assert coll_info(tuner, ctx, ALLREDUCE, 10, unsupported=[(RING, SIMPLE)])[0] == []
    assert tuner.finalize(ctx) == 0


def test_tuner_class_rule_uses_the_class_the_net_plugin_saw(tmp_path, monkeypatch):
    """The net plugin's per-communicator init records (commId -> class); the tuner of the same commId matches class:K."""
    use_plan(tmp_path, monkeypatch, ncclhook.FlowPlan(tunes=[ncclhook.TuneRule("class:2", channels=1)]))
    net = NetHead.in_dll(clib, "ncclNetPlugin_v12")
    tuner = TunerV6.in_dll(clib, "ncclTunerPlugin_v6")
    results = {}
    for comm_id, tc in ((0xC1A552, 2), (0xC1A556, 6)):
        nctx, tctx = ctypes.c_void_p(), ctypes.c_void_p()
        assert net.init(ctypes.byref(nctx), comm_id, ctypes.byref(ctypes.c_int(tc)), None, None) == 0
        assert tuner.init(ctypes.byref(tctx), comm_id, 2, 2, None, None, None) == 0
        results[tc] = coll_info(tuner, tctx, ALLREDUCE, 4096)[1]
        tuner.finalize(tctx)
    assert results == {2: 1, 6: -7}


def test_cli_check_plan_refuses_what_the_plugin_refuses(tmp_path, capsys):
    """`netweave flow nccl check-plan` is the plugin's verdict: the 100-rule plan that used to pass is one line, exit 2."""
    from netweave.cli import main

    many = tmp_path / "many.plan"
    many.write_text(HEAD + "".join(f"mark {29500 + i} dscp=8\n" for i in range(100)))
    binary = tmp_path / "binary.plan"
    binary.write_bytes(HEAD.encode() + b"class 1 dscp=1\xff\xfe\x00\n")
    for path, message in ((many, "many.plan: line 66: more than 64 mark rules"), (binary, "binary.plan: line 2: byte 0xff at column 15")):
        assert main(["flow", "nccl", "check-plan", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err and "Traceback" not in err, err
