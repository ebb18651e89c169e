"""Gemma 3 (text): sliding and global layers interleaved by `layer_types` (or every
`sliding_window_pattern`-th layer global), each layer type with its own RoPE base
(`rope_parameters` per type; older configs: `rope_theta` for global layers with
`rope_scaling`, `rope_local_base_freq` for sliding ones), RMSNorm over q and k heads,
Gemma's RMSNorm (scale 1 + w) before and after attention and the MLP, tanh-GELU,
embeddings times sqrt(hidden), attention scaled by `query_pre_attn_scalar ** -0.5`, tied
embeddings, and the final logits soft-capped when `final_logit_softcapping` is set.

`attn_logit_softcapping` is not applied: Gemma 3 replaced it by the q/k norms, and
transformers' and vLLM's Gemma 3 both ignore the field; a config that sets it is served
as they serve it, with a warning.

Gemma3ForConditionalGeneration (every Gemma 3 above 1B: this decoder + a SigLIP tower +
a projector, modeling/gemma3_vision.py) is read from its `text_config`, laid over
Gemma3TextConfig's defaults, as transformers does: a saved config keeps only the keys that
differ from them (Google's gemma-3-4b-it's text_config has six). The outer config says what
holds for the whole model: dtype, tied embeddings, EOS ids. Its logits are not soft-capped:
transformers 5's Gemma3ForConditionalGeneration applies no final soft-cap (Gemma3ForCausalLM
does), and the released checkpoints set none."""

import logging
from types import MappingProxyType

from modeling.config import (
    FULL,
    SLIDING,
    DecoderConfig,
    architecture_of,
    read_common,
    read_layer_windows,
    read_rope,
)

ARCHITECTURES = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
# Gemma3TextConfig's defaults in transformers (those this module reads).
TEXT_CONFIG_DEFAULTS = MappingProxyType({
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6, "eos_token_id": 1, "tie_word_embeddings": True, "attention_bias": False,
    "query_pre_attn_scalar": 256, "sliding_window": 4096,
})
log = logging.getLogger(__name__)


def text_config(raw: dict) -> dict:
    """The decoder's config.json dict of a Gemma3ForConditionalGeneration config.json."""
    text = {**TEXT_CONFIG_DEFAULTS, **(raw.get("text_config") or {}),
            "architectures": raw["architectures"]}
    dtype = raw.get("dtype") or raw.get("torch_dtype")
    if dtype is not None:
        text["dtype"] = dtype
    for key in ("tie_word_embeddings", "eos_token_id"):
        if raw.get(key) is not None:
            text[key] = raw[key]
    if text.get("final_logit_softcapping") is not None:
        log.warning("Gemma3ForConditionalGeneration: final_logit_softcapping=%s is not applied, "
                    "as transformers 5 does not apply it for this architecture",
                    text["final_logit_softcapping"])
        text["final_logit_softcapping"] = None
    return text


def _rope_by_layer_type(raw: dict) -> dict:
    params = raw.get("rope_parameters") or {}
    if SLIDING in params or FULL in params:
        return {SLIDING: read_rope(params.get(SLIDING) or {}, 10_000.0),
                FULL: read_rope(params.get(FULL) or {}, 1_000_000.0)}
    glob = {**(raw.get("rope_scaling") or {}), "rope_theta": raw.get("rope_theta", 1_000_000.0)}
    return {SLIDING: read_rope({"rope_theta": raw.get("rope_local_base_freq", 10_000.0)}),
            FULL: read_rope(glob)}


def read_config(raw: dict, generation: dict | None) -> DecoderConfig:
    if architecture_of(raw) == "Gemma3ForConditionalGeneration":  # its language model
        raw = text_config(raw)
    if raw.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 with use_bidirectional_attention (an embedding model) is not "
                         "a causal decoder; it is not served")
    if raw.get("attn_logit_softcapping") is not None:
        log.warning("Gemma 3: attn_logit_softcapping=%s is ignored, as transformers and vLLM "
                    "ignore it for this architecture", raw["attn_logit_softcapping"])
    n = raw["num_hidden_layers"]
    pattern = raw.get("sliding_window_pattern", 6)
    layer_types = raw.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    windows = read_layer_windows(raw, layer_types)  # validates the layer types too
    rope = _rope_by_layer_type(raw)
    bias = raw.get("attention_bias", False)
    return read_common(
        raw, generation, hidden_act=raw.get("hidden_activation", "gelu_pytorch_tanh"),
        tie_word_embeddings=raw.get("tie_word_embeddings", True), qkv_bias=bias, o_bias=bias,
        qk_norm=True, gemma_norms=True, embedding_scale=raw["hidden_size"] ** 0.5,
        attn_scale=raw.get("query_pre_attn_scalar", 256) ** -0.5,
        final_logit_softcap=raw.get("final_logit_softcapping"),
        rope=tuple(rope[t] for t in layer_types), sliding_windows=windows)
