"""The flow-plan file: Python writer/reader vs the C parser in csrc/plan.c (through ctypes),
and the tuner plugin applying `tune` rules (driven through its ncclTunerPlugin_v6 table)."""

from __future__ import annotations

import ctypes
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowsched import ncclhook

LIB = ncclhook.build() / ncclhook.PLUGIN_LIB
clib = ctypes.CDLL(str(LIB))
clib.netweave_plan_resolve_text.argtypes = [ctypes.c_char_p, ctypes.c_uint64, ctypes.c_int, ctypes.c_int,
                                            ctypes.POINTER(ctypes.c_int64), ctypes.c_char_p, ctypes.c_size_t]
clib.netweave_plan_resolve_text.restype = ctypes.c_int


def c_resolve(text: str, comm_id: int, order: int, cls: int) -> dict[str, int | None] | str:
    out = (ctypes.c_int64 * 6)()
    err = ctypes.create_string_buffer(256)
    if clib.netweave_plan_resolve_text(text.encode(), comm_id, order, cls, out, err, 256) != 0:
        return err.value.decode()
    keys = ("cls", "dscp", "prio", "rate", "nsocks", "sockchunk")
    return {k: (None if v == -1 else v) for k, v in zip(keys, out, strict=True)}




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


@pytest.mark.parametrize("text,line", [
    ("", 0),
    ("netweave-plan 2\n", 1),
    ("netweave-plan 1\nclass 8 dscp=1\n", 2),
    ("netweave-plan 1\n# comment\nclass 1 dscp=64\n", 3),
    ("netweave-plan 1\ncomm 5 colour=red\n", 2),
    ("netweave-plan 1\ntune class:1 algo=ring\n", 2),
    ("netweave-plan 1\ntune * algo=warp proto=simple\n", 2),
    ("netweave-plan 1\nmark 70000 dscp=1\n", 2),
    ("netweave-plan 1\nclass 1 nsocks=0\n", 2),
    ("netweave-plan 1\nbogus 1\n", 2),
])
def test_both_parsers_reject_bad_lines_at_the_same_place(text, line):
    c_err = c_resolve(text, 0, 0, 0)
    assert isinstance(c_err, str) and c_err.startswith(f"line {line}:"), c_err
    with pytest.raises(ncclhook.NcclHookError) as e:
        ncclhook.parse_plan(text, source="x.plan")
    assert e.value.where == line and str(e.value).startswith(f"x.plan: line {line}: ")


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
