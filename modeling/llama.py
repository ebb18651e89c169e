"""Llama (1, 2, 3.x) and checkpoints in its layout: the shared decoder as it stands, with
bias on all four attention projections and on the MLP when `attention_bias` / `mlp_bias`
say so, and Llama 3's RoPE scaling (`rope_type: llama3`)."""

from modeling.config import DecoderConfig, read_common

ARCHITECTURES = ("LlamaForCausalLM",)


def read_config(raw: dict, generation: dict | None) -> DecoderConfig:
    bias = raw.get("attention_bias", False)
    return read_common(raw, generation, qkv_bias=bias, o_bias=bias, mlp_bias=raw.get("mlp_bias", False))
