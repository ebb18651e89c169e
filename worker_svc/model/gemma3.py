"""Gemma 3 (text): sliding and global layers interleaved by `layer_types` (or every
`sliding_window_pattern`-th layer global), each layer type with its own RoPE base
(`rope_parameters` per type; older configs: `rope_theta` for global layers with
`rope_scaling`, `rope_local_base_freq` for sliding ones), RMSNorm over q and k heads,
Gemma's RMSNorm (scale 1 + w) before and after attention and the MLP, tanh-GELU,
embeddings times sqrt(hidden), attention scaled by `query_pre_attn_scalar ** -0.5`, tied
embeddings, and the final logits soft-capped when `final_logit_softcapping` is set.

`attn_logit_softcapping` is not applied: Gemma 3 replaced it by the q/k norms, and
transformers' and vLLM's Gemma 3 both ignore the field; a config that sets it is served
as they serve it, with a warning. The vision-language checkpoints
(Gemma3ForConditionalGeneration) are not served."""

import logging

from worker_svc.model.config import FULL, SLIDING, DecoderConfig, read_common, read_layer_windows, read_rope

ARCHITECTURES = ("Gemma3ForCausalLM",)
log = logging.getLogger(__name__)


def _rope_by_layer_type(raw: dict) -> dict:
    params = raw.get("rope_parameters") or {}
    if SLIDING in params or FULL in params:
        return {SLIDING: read_rope(params.get(SLIDING) or {}, 10_000.0),
                FULL: read_rope(params.get(FULL) or {}, 1_000_000.0)}
    glob = {**(raw.get("rope_scaling") or {}), "rope_theta": raw.get("rope_theta", 1_000_000.0)}
    return {SLIDING: read_rope({"rope_theta": raw.get("rope_local_base_freq", 10_000.0)}),
            FULL: read_rope(glob)}


def read_config(raw: dict, generation: dict | None) -> DecoderConfig:
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
