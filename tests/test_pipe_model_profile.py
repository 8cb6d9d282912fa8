"""Profiles of real models split by torch's pipeline(): structure, exact bytes, split methods agree, plan + export, CLI."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import SplitPoint, pipe_split, pipeline

from netweave.cli import main
from pipesched.devices import Device, LinkModel
from pipesched.export import export_plan, read_torch_csv
from pipesched.gpt2 import gpt2
from pipesched.model_profile import (
    ModelSpecError,
    autograd_nodes,
    expand_split_names,
    load_factory,
    node_saved_tensors,
    profile_model,
    split_model,
    stage_split_points,
)
from pipesched.plan import plan
from pipesched.profile import loads_profile

L, H, A, S, V, B = 2, 32, 2, 8, 50, 2          # layers, hidden, heads, sequence, vocabulary, micro-batch
F32 = 4


def small(pipe_splits: bool = False) -> dict:
    return gpt2(layers=L, hidden=H, heads=A, seq_len=S, vocab=V, microbatch=B, pipe_splits=pipe_splits)


@pytest.fixture(scope="module")
def profile():
    spec = small()
    return profile_model(spec["model"], spec["args"], split=spec["split"], loss_fn=spec["loss_fn"], repeats=3, warmup=1, clock="cpu", threads=1)


def sizes(prof):
    return [(lay.name, lay.param_bytes, lay.output_bytes, lay.saved_bytes, lay.weight_grad_bytes) for lay in prof.layers]


def test_structure_and_exact_bytes(profile):
    act = B * S * H * F32                      # one hidden-state activation
    assert [lay.name for lay in profile.layers] == ["wte+wpe+drop", "blocks.0", "blocks.1", "ln_f+lm_head"]
    emb, *blocks, head = profile.layers
    # Parameters from the shapes; the tied embedding/head weight sits in both segments (torch's Pipe replicates it).
    assert emb.param_bytes == (V * H + S * H) * F32
    assert all(b.param_bytes == (12 * H * H + 13 * H) * F32 for b in blocks)
    assert head.param_bytes == (V * H + 2 * H) * F32
    assert profile.reference["tied"] == [{"params": ["wte.weight", "lm_head.weight"], "layers": [0, L + 1], "bytes": V * H * F32}]
    # Only the hidden state crosses a cut (mask and positions are model inputs every stage gets); the head ends in the loss.
    assert [lay.output_bytes for lay in profile.layers] == [act] * (L + 1) + [4]
    # Full recomputation keeps the segment's inputs: token ids and positions (int64); hidden state and the [s, s] mask.
    assert emb.saved_bytes["full"] == 2 * B * S * 8
    assert all(b.saved_bytes["full"] == act + S * S * F32 for b in blocks)
    assert head.saved_bytes["full"] == act
    # Selective keeps the inputs plus the linear layers' outputs: QKV (3h), projection (h), MLP (4h, h); the head's logits.
    assert all(b.saved_bytes["selective"] == b.saved_bytes["full"] + 9 * act for b in blocks)
    assert head.saved_bytes["selective"] == act + B * S * V * F32
    assert emb.saved_bytes["selective"] == emb.saved_bytes["full"]
    for lay in blocks:
        assert lay.saved_bytes["full"] < lay.saved_bytes["selective"] < lay.saved_bytes["none"]
        assert lay.weight_grad_bytes > 0


def test_times_positive_and_ordered(profile):
    for lay in profile.layers:
        assert lay.fwd_s > 0 and lay.bwd_s > 0 and lay.bwd_weight_s > 0
        assert lay.recompute_s["none"] == 0.0 <= lay.recompute_s["selective"] <= lay.recompute_s["full"] == lay.fwd_s
    emb, *blocks, _ = profile.layers
    assert emb.bwd_input_s < min(b.bwd_input_s for b in blocks)      # token ids have no gradient: I is (almost) nothing
    assert emb.fwd_s < min(b.fwd_s for b in blocks)


def test_saved_bytes_equal_the_autograd_graph():
    """Differential: what the saved-tensor hooks counted equals the storages the autograd graph's nodes hold."""
    spec = small()
    pipe, _, _ = split_model(spec["model"], spec["args"], split=["blocks.0", "blocks.1"])
    block = pipe.split_gm.submod_pp_1
    x = torch.randn(B, S, H, requires_grad=True)
    out = block(x, spec["args"][1])
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    held = {}
    for fn in autograd_nodes([out]):
        for t in node_saved_tensors(fn):
            # A Python scalar (the 1/sqrt(d) factor) is saved as a 0-dim wrapped number without the pack hook.
            if t.untyped_storage().data_ptr() not in params and t.dim() > 0:
                held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    prof = profile_model(spec["model"], spec["args"], split=["blocks.0", "blocks.1"], repeats=1, warmup=0)
    assert prof.layers[1].saved_bytes["none"] == sum(held.values())


def test_split_by_names_equals_pipe_split_and_export():
    by_names = small()
    by_calls = small(pipe_splits=True)
    kw = {"repeats": 1, "warmup": 0}
    a = profile_model(by_names["model"], by_names["args"], split=by_names["split"], loss_fn=by_names["loss_fn"], **kw)
    b = profile_model(by_calls["model"], by_calls["args"], loss_fn=by_calls["loss_fn"], **kw)
    ep = torch.export.export(small(pipe_splits=True)["model"], by_calls["args"])
    c = profile_model(ep, loss_fn=by_calls["loss_fn"], **kw)
    d = profile_model(torch.export.export(by_names["model"], by_names["args"]), split=by_names["split"], loss_fn=by_names["loss_fn"], **kw)
    assert sizes(a) == sizes(b) == sizes(c) == sizes(d)
    assert len(a.layers) == L + 2 and a.reference["tied"] == b.reference["tied"] == c.reference["tied"]


class Skip(nn.Module):
    """The first layer's output skips the middle segment: it crosses both cuts."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 10), nn.Linear(10, 3), nn.Linear(3, 10)

    def forward(self, x):
        h = self.a(x)
        pipe_split()
        g = self.b(h)
        pipe_split()
        return self.c(g) + h


def test_skip_connection_counts_at_every_cut():
    prof = profile_model(Skip(), (torch.randn(4, 6),), repeats=1, warmup=0)
    h, g = 4 * 10 * F32, 4 * 3 * F32
    assert [lay.output_bytes for lay in prof.layers] == [h, h + g, 4 * 10 * F32]
    assert [lay.param_bytes for lay in prof.layers] == [(60 + 10) * F32, (30 + 3) * F32, (30 + 10) * F32]
    assert [lay.name for lay in prof.layers] == ["a", "b", "c"]


@pytest.mark.parametrize(("split", "message"), [
    (["blocks.7"], "no submodule named 'blocks.7'"),
    (["blocks.*", "blocks.0"], "named twice"),
    (["wte"], "segment 0 (between the start and split point 1) would be empty"),
    (["blocks.0.attn", "blocks.0.attn.qkv"], "would be empty"),
    (["nothing.*"], "matches no submodule"),
])
def test_bad_splits(split, message):
    spec = small()
    with pytest.raises(ModelSpecError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*").replace(".", r"\.")):
        split_model(spec["model"], spec["args"], split=split)


def test_no_split_at_all_is_refused():
    spec = small()
    with pytest.raises(ModelSpecError, match="no pipe_split"):
        split_model(spec["model"], spec["args"])


def test_expand_patterns_keep_depth():
    names = ["", "blocks", "blocks.0", "blocks.0.mlp", "blocks.1", "ln_f"]
    assert expand_split_names(["blocks.*"], names) == ["blocks.0", "blocks.1"]
    assert expand_split_names(["blocks.*.mlp"], names) == ["blocks.0.mlp"]


def test_plan_from_the_measured_profile_exports(profile, tmp_path):
    devices = [Device(f"cpu{r}", 1.0, 2**30) for r in range(2)]
    links = LinkModel.uniform(2, 1e9, 1e-5)
    p = plan(profile, devices, links, microbatches=4, schedule="1f1b")
    assert p.sim.makespan > 0 and p.memory_ok
    info = export_plan(p.schedule, p.partition, tmp_path, layer_names=[lay.name for lay in profile.layers])
    rows = read_torch_csv(tmp_path / info["csv"])
    assert sorted(rows) == [0, 1] and all(rows.values())
    stages = json.loads((tmp_path / "stages.json").read_text())["stages"]
    assert [m for st in stages for m in st["modules"]] == [lay.name for lay in profile.layers]
    # The plan's cuts as torch split points: torch's pipeline() builds exactly these stages, with the profiled parameters.
    spans = [tuple(st["layers"]) for st in stages]
    points = stage_split_points(profile, spans)
    spec = small()
    pipe = pipeline(spec["model"], spec["args"], split_spec={name: SplitPoint.BEGINNING for name in points})
    assert pipe.num_stages == len(spans) == 2
    for (i, j), stage in zip(spans, pipe.split_gm.children(), strict=True):
        held = {n: p.numel() * p.element_size() for n, p in stage.named_parameters()}
        if i == 0:      # torch's Pipe leaves an unused copy of the tied weight in the first stage
            held.pop("lm_head.weight", None)
        assert sum(held.values()) == sum(lay.param_bytes for lay in profile.layers[i:j])


def test_load_factory_errors(tmp_path, monkeypatch):
    (tmp_path / "nw_badfactory.py").write_text("def make():\n    raise RuntimeError('weights\\nnot here')\n\ndef odd():\n    return 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModelSpecError, match="factory nw_badfactory:make failed: RuntimeError: weights not here"):
        load_factory("nw_badfactory:make")
    with pytest.raises(ModelSpecError, match="expected .model, args"):
        load_factory("nw_badfactory:odd")
    with pytest.raises(ModelSpecError, match="has no function 'absent'"):
        load_factory("nw_badfactory:absent")
    with pytest.raises(ModelSpecError, match="cannot import 'nw_no_such_module'"):
        load_factory("nw_no_such_module:make")


# -- the CLI path ---------------------------------------------------------------------------------------------

SMALL = ["--set", f"layers={L}", "--set", f"hidden={H}", "--set", f"heads={A}", "--set", f"seq_len={S}", "--set", f"vocab={V}",
         "--set", f"microbatch={B}"]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_profile_plan_export(capsys, tmp_path):
    prof_path = tmp_path / "p.json"
    code, out, _ = run(capsys, "pipe", "profile", "--model", "pipesched.gpt2:gpt2", *SMALL, "--repeats", "1", "--json", "--out", str(prof_path))
    assert code == 0
    data = json.loads(out)
    assert [lay["name"] for lay in data["layers"]] == ["wte+wpe+drop", "blocks.0", "blocks.1", "ln_f+lm_head"]
    assert loads_profile(prof_path.read_text()).to_dict() == data
    code, out, _ = run(capsys, "pipe", "profile", "--model", "pipesched.gpt2:gpt2", *SMALL, "--set", "pipe_splits=true", "--split", "pipe_split",
                       "--repeats", "1")
    assert code == 0 and "blocks.1" in out and "tied" in out
    code, out, _ = run(capsys, "pipe", "export", "--profile", str(prof_path), "--stages", "2", "--microbatches", "4", "--schedule", "1f1b",
                       "--memory", "1GiB", "--out", str(tmp_path / "exp"), "--json")
    assert code == 0 and (tmp_path / "exp" / "schedule.csv").exists()


@pytest.mark.parametrize(("argv", "message"), [
    (["--split", "blocks.9"], "--split: no submodule named 'blocks.9'"),
    (["--split", "wte,blocks.0"], "would be empty"),
    (["--set", "heads=5"], "--model: torch could not trace"),
    (["--set", "layers=-1"], "--model: factory pipesched.gpt2:gpt2 failed"),
    (["--set", "colour"], "--set: expected KEY=VALUE"),
])
def test_cli_bad_input_one_line(capsys, argv, message):
    code, out, err = run(capsys, "pipe", "profile", "--model", "pipesched.gpt2:gpt2", *SMALL, *argv, "--repeats", "1")
    assert code == 2 and out == ""
    lines = [line for line in err.strip().splitlines() if not line.startswith("splitting ")]     # the progress line
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in err


def test_cli_unknown_factory_module(capsys):
    code, _, err = run(capsys, "pipe", "profile", "--model", "nw_nowhere.models:gpt", "--repeats", "1")
    assert code == 2 and "cannot import 'nw_nowhere.models'" in err and len(err.strip().splitlines()) == 1
