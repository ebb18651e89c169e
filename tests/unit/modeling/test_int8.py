"""`--quantization int8`: per-output-channel symmetric int8 weights, quantized at load.

Quality, stated: on every family's `tiny` checkpoint (logits' std ~3), a 120-token prompt's
logits with int8 weights against the same model in fp32: mean |difference| at most 0.25,
max at most 2.5, and the greedy (argmax) token the same on at least 80% of the rows.
Measured on a 2-core AMD EPYC (VNNI; activations quantized to 8 bits per call): mean
0.05-0.16, max 0.5-1.3, agreement 0.87-1.0. Weight-only int8 (the dequant path, no
activation quantization; what a CPU without int8 dot products runs) is closer: mean at most
0.08 here (measured 0.02-0.06)."""

import pytest
import torch
import torch.nn.functional as F
from tests.support.runner_helpers import chunked_prefill_logits, make_runner, prompts
from torch import nn

from kernels.cpu_features import cpu_features
from modeling.int8_linear import Int8Linear, quantize_rows, quantized_engine

# the dynamic path runs only where the CPU has int8 dot products (VNNI, AMX-INT8): elsewhere
# torch's int16 sums saturate, and quantize_linears takes the dequant path
NO_INT8_DOT = None if cpu_features().int8_dot else "no int8 dot products (VNNI/AMX) on this CPU: no dynamic path"

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3")
MEAN_DIFF, MAX_DIFF, ARGMAX_AGREEMENT = 0.25, 2.5, 0.80
WEIGHT_ONLY_MEAN_DIFF = 0.08


def test_rows_are_quantized_symmetrically_per_output_channel():
    w = torch.randn(48, 32) * torch.linspace(0.01, 3.0, 48)[:, None]  # rows of very different ranges
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.shape == (48,)
    assert int(q.abs().max(dim=1).values.min()) == 127  # every row uses its whole range
    err = (q.float() * scale[:, None] - w).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-6).all())  # at most half a step, per row


def test_amx_int8_prefers_onednn_and_other_cpus_the_x86_engine():
    engines = torch.backends.quantized.supported_engines
    if "onednn" not in engines or "x86" not in engines:
        pytest.skip(f"torch's quantized engines here: {engines}")
    assert quantized_engine(amx_int8=True) == "onednn"
    assert quantized_engine(amx_int8=False) == "x86"


@pytest.mark.parametrize("engine", ["x86", "onednn"])
def test_each_quantized_engine_computes_the_same_linear(engine):
    if NO_INT8_DOT:
        pytest.skip(NO_INT8_DOT)
    if engine not in torch.backends.quantized.supported_engines:
        pytest.skip(f"torch has no {engine!r} quantized engine here")
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine
    try:
        torch.manual_seed(0)
        linear = nn.Linear(96, 40, bias=True)
        x = torch.randn(7, 96)
        got = Int8Linear(linear, dynamic=True)(x)
    finally:
        torch.backends.quantized.engine = previous
    expected = F.linear(x, linear.weight, linear.bias)
    assert ((got - expected).abs().max() / expected.abs().max()) < 0.05


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "dequant"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_int8_linear_is_close_to_the_linear_it_replaces(dynamic, dtype):
    if dynamic and quantized_engine() is None:
        pytest.skip("torch has no quantized CPU engine here")
    if dynamic and NO_INT8_DOT:
        pytest.skip(NO_INT8_DOT)
    torch.manual_seed(0)
    linear = nn.Linear(96, 40, bias=True)
    x = torch.randn(2, 5, 96)
    expected = F.linear(x, linear.weight, linear.bias)
    got = Int8Linear(linear, dynamic=dynamic)(x.to(dtype))
    assert got.dtype == dtype and got.shape == (2, 5, 40)
    rel = (got.float() - expected).abs().max() / expected.abs().max()
    assert rel < (0.05 if dtype == torch.float32 else 0.06), rel


def quality(model_dir, **config):
    prompt = prompts(9, [120])[0]
    ref = chunked_prefill_logits(make_runner(model_dir, block_size=8, num_blocks=40), prompt, [120],
                                 list(range(15)))
    runner = make_runner(model_dir, block_size=8, num_blocks=40, quantization="int8", **config)
    got = chunked_prefill_logits(runner, prompt, [120], list(range(15))).float()
    diff = (got - ref).abs()
    return runner, diff, float((got.argmax(-1) == ref.argmax(-1)).float().mean())


@pytest.mark.parametrize("arch", FAMILIES)
def test_int8_logits_and_greedy_tokens_close_to_fp32(arch, family_model_dir):
    runner, diff, agree = quality(family_model_dir(arch))
    layers = runner.model.model.layers
    assert isinstance(layers[0].mlp.gate_up_proj, Int8Linear) and isinstance(layers[0].self_attn.o_proj, Int8Linear)
    assert not isinstance(runner.model.lm_head, Int8Linear)  # the head keeps the model's dtype
    assert diff.mean() <= MEAN_DIFF and diff.max() <= MAX_DIFF, (arch, diff.mean(), diff.max())
    assert agree >= ARGMAX_AGREEMENT, (arch, agree)


def test_int8_weights_on_a_bf16_model(family_model_dir):
    runner, diff, agree = quality(family_model_dir("llama"), dtype="bfloat16")
    assert runner.kv_cache.k_caches[0].dtype == torch.bfloat16
    assert diff.mean() <= MEAN_DIFF and diff.max() <= MAX_DIFF and agree >= ARGMAX_AGREEMENT


def test_weight_only_int8_is_closer(family_model_dir, monkeypatch):
    """The dequant path (what runs where torch has no quantized engine) quantizes only the
    weights."""
    import modeling.int8_linear as int8_linear

    monkeypatch.setattr(int8_linear, "quantized_engine", lambda amx_int8=False: None)
    runner, diff, agree = quality(family_model_dir("qwen2"))
    assert not runner.model.model.layers[0].mlp.down_proj.dynamic
    assert diff.mean() <= WEIGHT_ONLY_MEAN_DIFF and agree >= 0.9, (diff.mean(), agree)


def test_an_unknown_quantization_is_refused(family_model_dir):
    with pytest.raises(ValueError, match="unknown quantization 'int4'"):
        make_runner(family_model_dir("llama"), quantization="int4")


def test_a_cpu_without_int8_dot_products_takes_the_weight_only_path(family_model_dir, monkeypatch):
    """Without VNNI/AMX-INT8 the dynamic path's int16 sums saturate (and 7-bit activations
    miss the stated quality): such a CPU quantizes the weights only."""
    import types

    import modeling.int8_linear as int8_linear

    monkeypatch.setattr(int8_linear, "cpu_features", lambda: types.SimpleNamespace(int8_dot=False, flags=frozenset()))
    runner, diff, agree = quality(family_model_dir("llama"))
    assert not runner.model.model.layers[0].mlp.down_proj.dynamic
    assert diff.mean() <= WEIGHT_ONLY_MEAN_DIFF and agree >= 0.9, (diff.mean(), agree)
