"""Profiles: analytic formulas, measured profiler, JSON round trip and error messages."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesched.profile import (
    RECOMPUTE_OPTIONS,
    GPTConfig,
    LayerProfile,
    ModelProfile,
    ProfileError,
    analytic_profile,
    config_from_dict,
    dumps_profile,
    load_model_config,
    load_profile,
    loads_profile,
    measure_profile,
    save_profile,
)


def test_korthikanti_activation_memory():
    s, b, h, a = 2048, 1, 4096, 32
    prof = analytic_profile(GPTConfig(layers=2, hidden=h, heads=a, seq_len=s, vocab=50000, microbatch_size=b))
    block = prof.layers[1]
    assert block.saved_bytes["none"] == s * b * h * (34 + 5 * a * s / h)
    assert block.saved_bytes["selective"] == 34 * s * b * h
    assert block.saved_bytes["full"] == 2 * s * b * h
    assert block.output_bytes == 2 * s * b * h
    assert block.param_bytes == 2 * (12 * h * h + 13 * h)    # GPT block: 12h^2 weights + 13h biases/norms, bf16


def test_flops_split_and_head_cost():
    cfg = GPTConfig(layers=4, hidden=1024, heads=16, seq_len=1024, vocab=50257, flops_efficiency=1.0, memory_efficiency=1.0,
                    tflops=1e6, hbm_gbs=1e9)   # compute-bound everywhere
    prof = analytic_profile(cfg)
    t = cfg.seq_len
    lin, core = 24 * t * 1024**2, 4 * t * t * 1024
    block = prof.layers[1]
    assert block.fwd_s == pytest.approx((lin + core) / 1e18)
    assert block.bwd_input_s == pytest.approx((lin + 2 * core) / 1e18)
    assert block.bwd_weight_s == pytest.approx(lin / 1e18)
    head = prof.layers[-1]
    assert head.name == "lm_head" and head.fwd_s == pytest.approx(2 * t * 1024 * 50257 / 1e18)
    assert head.fwd_s / block.fwd_s > 0.3      # the head is as costly as a third of a block: it must be planned for
    assert prof.layers[0].name == "embedding" and prof.layers[0].param_bytes == (50257 * 1024 + 1024 * 1024) * 2


def test_llama_config():
    prof = analytic_profile(GPTConfig(kind="llama", layers=2, hidden=4096, heads=32, kv_heads=8, seq_len=4096, vocab=32000))
    block = prof.layers[1]
    f = 11008
    assert block.param_bytes == 2 * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * f + 2 * 4096)
    assert block.saved_bytes["full"] < block.saved_bytes["selective"] < block.saved_bytes["none"]


@settings(max_examples=30, deadline=None)
@given(layers=st.integers(1, 6), hidden=st.sampled_from([64, 128, 256]), heads=st.sampled_from([1, 2, 4]), seq=st.integers(1, 512),
       vocab=st.integers(2, 5000), kind=st.sampled_from(["gpt", "llama"]), dtype=st.sampled_from(["bf16", "fp32"]))
def test_json_round_trip(layers, hidden, heads, seq, vocab, kind, dtype):
    prof = analytic_profile(GPTConfig(layers=layers, hidden=hidden, heads=heads, seq_len=seq, vocab=vocab, kind=kind, dtype=dtype))
    back = loads_profile(dumps_profile(prof))
    assert back == prof
    for lay in back.layers:
        assert lay.saved_bytes["full"] <= lay.saved_bytes["selective"] <= lay.saved_bytes["none"]
        assert lay.recompute_s["none"] == 0.0 <= lay.recompute_s["selective"] <= lay.recompute_s["full"]


def test_save_load_file(tmp_path):
    prof = analytic_profile(GPTConfig(layers=1, hidden=64, heads=2, seq_len=8, vocab=10))
    save_profile(prof, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == prof


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda d: d.update(format="x"), "format"),
    (lambda d: d.update(version=9), "version"),
    (lambda d: d.update(layers=[]), "layers"),
    (lambda d: d["layers"][1].update(fwd_s=-1), r"layers\[1\].fwd_s"),
    (lambda d: d["layers"][0]["saved_bytes"].pop("full"), r"layers\[0\].saved_bytes"),
    (lambda d: d.update(microbatch_size=0), "microbatch_size"),
])
def test_bad_profiles_name_the_field(mutate, message):
    d = analytic_profile(GPTConfig(layers=1, hidden=64, heads=2, seq_len=8, vocab=10)).to_dict()
    mutate(d)
    with pytest.raises(ProfileError, match=message):
        loads_profile(json.dumps(d), source="p.json")
    with pytest.raises(ProfileError, match="p.json: line 1"):
        loads_profile("{bad", source="p.json")


def test_model_config_errors(tmp_path):
    (tmp_path / "m.yaml").write_text("model:\n  layers: 4\n  hidden: 100\n  heads: 3\n  seq_len: 8\n  vocab: 10\n")
    with pytest.raises(ProfileError, match="m.yaml: heads: hidden .100. must be a multiple of heads"):
        load_model_config(tmp_path / "m.yaml")
    with pytest.raises(ProfileError, match="layrs: unknown field"):
        config_from_dict({"layrs": 2})
    with pytest.raises(ProfileError, match="vocab: missing"):
        config_from_dict({"layers": 2, "hidden": 8, "heads": 2, "seq_len": 8})
    (tmp_path / "bad.yaml").write_text("model: [1, 2\n")
    with pytest.raises(ProfileError, match="bad.yaml: line"):
        load_model_config(tmp_path / "bad.yaml")
    cfg = config_from_dict({"layers": 2, "hidden": 8, "heads": 2, "seq_len": 8, "vocab": 10, "kind": "llama"})
    assert cfg.kind == "llama"


def test_measured_profile_of_a_real_module():
    torch = pytest.importorskip("torch")
    dim, width, rows = 32, 256, 16
    layers = [torch.nn.Sequential(torch.nn.Linear(dim, width), torch.nn.GELU(), torch.nn.Linear(width, dim)), torch.nn.Linear(dim, dim)]
    prof = measure_profile(layers, torch.randn(rows, dim), repeats=2)
    first, second = prof.layers
    assert prof.source == "measured" and prof.microbatch_size == rows
    assert first.param_bytes == 4 * (dim * width + width + width * dim + dim)
    assert first.output_bytes == rows * dim * 4
    # autograd saves: the block input (rows x dim), the GELU input and the second Linear's input (rows x width each)
    assert first.saved_bytes["none"] == 4 * (rows * dim + 2 * rows * width)
    assert first.saved_bytes["full"] == 4 * rows * dim                     # only the input is kept
    assert first.saved_bytes["selective"] < first.saved_bytes["none"]      # what the GELU saved is recomputed
    assert first.recompute_s["full"] == first.fwd_s and first.recompute_s["selective"] > 0
    assert second.saved_bytes["none"] == 4 * rows * dim
    for lay in prof.layers:
        assert lay.fwd_s > 0 and lay.bwd_input_s > 0 and lay.bwd_weight_s > 0 and lay.bwd_full_s > 0
    assert loads_profile(dumps_profile(prof)) == prof


def test_scaled_profile():
    lay = LayerProfile("x", 1.0, 2.0, 3.0, 1, 1, {o: 1 for o in RECOMPUTE_OPTIONS}, {o: 0.5 for o in RECOMPUTE_OPTIONS}, bwd_full_s=4.0)
    prof = ModelProfile("m", (lay,)).scaled(2.0)
    assert prof.layers[0].fwd_s == 2.0 and prof.layers[0].bwd_s == 8.0 and prof.layers[0].recompute_s["full"] == 1.0


def test_selective_recompute_time_is_one_forward_of_the_parameter_free_children():
    """A block whose forward is almost all one parameter-free child (20 ms of sleep): selective recomputation costs
    that child's forward once, about the whole forward, not twice (the profiler runs two forwards per repetition
    and times the children in one of them)."""
    import time as _time

    torch = pytest.importorskip("torch")

    class Pause(torch.nn.Module):
        def forward(self, x):
            _time.sleep(0.02)
            return torch.nn.functional.gelu(x)      # saves its input: recomputed under "selective"

    block = torch.nn.Sequential(torch.nn.Linear(4, 4), Pause())
    lay = measure_profile([block], torch.randn(2, 4), repeats=3, warmup=1).layers[0]
    assert lay.fwd_s >= 0.02
    assert 0.02 <= lay.recompute_s["selective"] <= lay.fwd_s * 1.25     # was ~2x fwd_s when both forwards were counted


def test_every_timed_fused_backward_adds_into_existing_gradients_and_the_layers_grads_come_back():
    """As in a pipelined step (all micro-batches but the first add into ``.grad``), even with ``warmup=0``: a
    backward into ``None`` gradients only keeps autograd's result and skips the add, which on the validation
    model made a single-repetition profile's backward ~40 % cheaper than the steps' (fails on the old profiler)."""
    torch = pytest.importorskip("torch")
    layer = torch.nn.Linear(4, 4)
    seen: list[bool] = []
    layer.weight.register_hook(lambda g: seen.append(layer.weight.grad is not None))
    before = torch.full_like(layer.weight, 7.0)
    layer.weight.grad = before
    measure_profile([layer], torch.randn(2, 4), repeats=1, warmup=0)
    # W (autograd.grad: no accumulation, but the hook fires) and the fused backward, once each
    assert seen == [True, True]
    assert layer.weight.grad is before and bool((before == 7.0).all())
    layer.weight.grad = None
    measure_profile([layer], torch.randn(2, 4), repeats=1, warmup=0)
    assert layer.weight.grad is None


def test_embedding_weight_gradient_is_dense():
    """The embedding's W passes over the whole table four times (zero-fill, scatter target, .grad read and write)."""
    cfg = GPTConfig(layers=1, hidden=768, heads=12, seq_len=1024, vocab=50257, dtype="fp32", tflops=1e6, hbm_gbs=10.0,
                    memory_efficiency=1.0)
    emb = analytic_profile(cfg).layers[0]
    table = (50257 + 1024) * 768 * 4
    assert emb.param_bytes == table
    assert emb.bwd_weight_s == pytest.approx((3 * 1024 * 768 * 4 + 4 * table) / 10e9)
