"""The fields of a Hugging Face `config.json` a decoder needs, read once into a frozen
dataclass (both the transformers v5 spelling and the older one)."""

import json
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class DecoderConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # {"rope_type": "llama3", factor, ...}; None for plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    hidden_act: str
    dtype: torch.dtype  # the checkpoint's own dtype (float32 when it names none)
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        """Shapes the model cannot run refused at load, not met as a wrong answer later."""
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) is not a multiple of "
                             f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} is odd: rotary embeddings rotate pairs of dims")

    @classmethod
    def from_dict(cls, raw: dict, generation: dict | None = None) -> "DecoderConfig":
        num_heads = raw["num_attention_heads"]
        # transformers v5 keeps RoPE settings in `rope_parameters`; v4 in rope_theta/rope_scaling
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", raw.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"unsupported rope_type {rope_type!r}")
        partial = rope.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
        if partial != 1.0:  # rotary on part of each head only (Phi, GPT-NeoX style)
            raise ValueError(f"unsupported partial_rotary_factor {partial}: rotary covers whole heads here")
        eos = (generation or {}).get("eos_token_id", raw.get("eos_token_id"))
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        if dtype_name not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype_name!r}: one of {', '.join(DTYPES)}")
        return cls(
            architecture=(raw.get("architectures") or ["LlamaForCausalLM"])[0],
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling={**rope, "rope_type": rope_type} if rope_type != "default" else None,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", False),
            mlp_bias=raw.get("mlp_bias", False),
            hidden_act=raw.get("hidden_act", "silu"),
            dtype=DTYPES[dtype_name],
            eos_token_ids=tuple(eos),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "DecoderConfig":
        """config.json, with eos ids from generation_config.json when it has them."""
        model_dir = Path(model_dir)
        raw = json.loads((model_dir / "config.json").read_text())
        gen_path = model_dir / "generation_config.json"
        generation = json.loads(gen_path.read_text()) if gen_path.exists() else None
        return cls.from_dict(raw, generation)
