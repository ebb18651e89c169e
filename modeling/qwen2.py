"""Qwen2 and Qwen2.5: Llama with a bias on the q, k and v projections (not on o), tied
embeddings in the small sizes, and sliding windows on the layers from `max_window_layers`
on when `use_sliding_window` is set (the released checkpoints leave it off)."""

from modeling.config import FULL, SLIDING, DecoderConfig, read_common, read_layer_windows

ARCHITECTURES = ("Qwen2ForCausalLM",)


def qwen_layer_windows(raw: dict) -> tuple[int | None, ...]:
    """Qwen2/Qwen3's windows, as transformers reads them: none unless `use_sliding_window`;
    then `layer_types` when the config has them, else sliding from `max_window_layers` on."""
    if not raw.get("use_sliding_window"):
        return (None,) * raw["num_hidden_layers"]
    layer_types = raw.get("layer_types") or [
        SLIDING if i >= raw.get("max_window_layers", 28) else FULL
        for i in range(raw["num_hidden_layers"])]
    return read_layer_windows(raw, layer_types)


def read_config(raw: dict, generation: dict | None) -> DecoderConfig:
    return read_common(raw, generation, qkv_bias=True, sliding_windows=qwen_layer_windows(raw))
