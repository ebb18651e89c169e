"""Qwen3 (dense): Qwen2's layout with an RMSNorm over each q and k head before RoPE, no
q/k/v bias unless `attention_bias`, and a `head_dim` of its own (not hidden / heads)."""

from modeling.config import DecoderConfig, read_common
from modeling.qwen2 import qwen_layer_windows

ARCHITECTURES = ("Qwen3ForCausalLM",)


def read_config(raw: dict, generation: dict | None) -> DecoderConfig:
    bias = raw.get("attention_bias", False)
    return read_common(raw, generation, qkv_bias=bias, o_bias=bias, qk_norm=True,
                       sliding_windows=qwen_layer_windows(raw))
