"""Mistral: Llama's layout with GQA and, when `sliding_window` is set (Mistral 7B v0.1),
the same window on every layer -- so KV blocks wholly behind it go back to the pool as a
request advances (one KV cache group with that window: kvstore/kv_cache_groups.py). Like transformers, any `layer_types`
in the config is ignored (alternating windows are Ministral's, a different architecture)."""

from modeling.config import DecoderConfig, read_common

ARCHITECTURES = ("MistralForCausalLM",)


def read_config(raw: dict, generation: dict | None) -> DecoderConfig:
    window = raw.get("sliding_window")
    return read_common(raw, generation, sliding_windows=(window,) * raw["num_hidden_layers"])
