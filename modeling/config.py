"""What a decoder family needs from a Hugging Face `config.json`, read once into a frozen
dataclass (both the transformers v5 spelling and the older one).

`DecoderConfig` holds the shapes every family shares and one switch per way a family
differs from Llama (biases, q/k norms, Gemma's norms, windows and RoPE per layer, scales,
soft-caps). A family module (modeling/<family>.py) reads its own keys into those
switches; `read_common` reads the rest; modeling/registry.py picks the family.
Whatever a switch cannot express is refused at load, with a message naming what is supported.
"""

from dataclasses import dataclass

import torch

from modeling.layers import ACTIVATIONS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ROPE_TYPES = ("default", "linear", "llama3")
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of one layer: base `theta` and, for rope_type "linear" or
    "llama3", the scaling dict as the config gives it ({"rope_type", "factor", ...})."""

    theta: float
    scaling: dict | None = None

    def __hash__(self) -> int:  # scaling is a dict: hash what identifies it
        return hash((self.theta, tuple(sorted((self.scaling or {}).items()))))


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
    max_position_embeddings: int
    tie_word_embeddings: bool
    hidden_act: str
    dtype: torch.dtype  # the checkpoint's own dtype (float32 when it names none)
    eos_token_ids: tuple[int, ...]
    rope: tuple[RopeSpec, ...]  # per layer
    sliding_windows: tuple[int | None, ...]  # per layer: a key window W (itself + W-1 before), or None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # an RMSNorm over head_dim on every q and k head, before RoPE (Qwen3, Gemma 3)
    gemma_norms: bool = False  # RMSNorm scaled by 1 + w; norms after attention and around the MLP
    embedding_scale: float | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden))
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None

    def __post_init__(self) -> None:
        """Shapes the model cannot run refused at load, not met as a wrong answer later."""
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) is not a multiple of "
                             f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} is odd: rotary embeddings rotate pairs of dims")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden activation {self.hidden_act!r}; "
                             f"supported: {sorted(ACTIVATIONS)}")
        if not len(self.rope) == len(self.sliding_windows) == self.num_layers:
            raise ValueError(f"{self.num_layers} layers but {len(self.rope)} RoPE specs and "
                             f"{len(self.sliding_windows)} windows")
        for window in self.sliding_windows:
            if window is not None and window < 1:
                raise ValueError(f"sliding_window must be >= 1, got {window}")

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5


def architecture_of(raw: dict) -> str:
    return (raw.get("architectures") or ["LlamaForCausalLM"])[0]


def read_rope(params: dict, default_theta: float = 10000.0) -> RopeSpec:
    """One RoPE spec from a flat `rope_parameters` / v4 `rope_scaling` dict."""
    rope = dict(params)
    theta = float(rope.pop("rope_theta", default_theta))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {ROPE_TYPES}")
    partial = rope.pop("partial_rotary_factor", 1.0)
    if partial != 1.0:  # rotary on part of each head only (Phi, GPT-NeoX style)
        raise ValueError(f"unsupported partial_rotary_factor {partial}: rotary covers whole heads here")
    rope.pop("type", None)
    return RopeSpec(theta, {**rope, "rope_type": rope_type} if rope_type != "default" else None)


def read_flat_rope(raw: dict) -> RopeSpec:
    """The one RoPE every layer shares: transformers v5 keeps it in `rope_parameters`, v4 in
    `rope_theta` + `rope_scaling`."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    if "partial_rotary_factor" in raw:
        params.setdefault("partial_rotary_factor", raw["partial_rotary_factor"])
    return read_rope(params)


def read_layer_windows(raw: dict, layer_types: list[str] | None) -> tuple[int | None, ...]:
    """Per layer: `sliding_window` on "sliding_attention" layers, None on "full_attention"."""
    n = raw["num_hidden_layers"]
    if layer_types is None:
        return (None,) * n
    if len(layer_types) != n:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {n} layers")
    unknown = set(layer_types) - {SLIDING, FULL}
    if unknown:
        raise ValueError(f"unsupported layer_types {sorted(unknown)}; supported: {SLIDING!r}, {FULL!r}")
    window = raw.get("sliding_window")
    if SLIDING in layer_types and not window:
        raise ValueError("layer_types has sliding layers but sliding_window is not set")
    return tuple(window if t == SLIDING else None for t in layer_types)


def read_common(raw: dict, generation: dict | None, **switches) -> DecoderConfig:
    """The fields every family reads the same way; `switches` (DecoderConfig fields) say how
    the family differs. `rope` and `sliding_windows` default to one flat RoPE and no window."""
    num_heads = raw["num_attention_heads"]
    num_layers = raw["num_hidden_layers"]
    eos = (generation or {}).get("eos_token_id", raw.get("eos_token_id"))
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if dtype_name not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype_name!r}: one of {', '.join(DTYPES)}")
    fields = dict(
        architecture=architecture_of(raw),
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        hidden_act=raw.get("hidden_act", "silu"),
        dtype=DTYPES[dtype_name],
        eos_token_ids=tuple(eos),
    )
    fields.update(switches)
    fields.setdefault("rope", (read_flat_rope(raw),) * num_layers)
    fields.setdefault("sliding_windows", (None,) * num_layers)
    return DecoderConfig(**fields)
