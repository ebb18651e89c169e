"""The SigLIP vision transformer as Gemma 3 uses it (transformers' SiglipVisionModel, no
pooling head): an image in, one feature vector per patch out.

forward(pixel_values [N, C, S, S]) -> [N, P, D], with P = (S / patch)^2 patches:
    h = conv(pixel_values; kernel = stride = patch).flatten(2).transpose(1, 2)   [N, P, D]
    h += position_embedding[0..P-1]
    per layer:
        h += out_proj(attention(qkv_proj(layer_norm1(h))))   all patches see each other
        h += fc2(gelu_tanh(fc1(layer_norm2(h))))
    h = post_layernorm(h)

Parameter names are the checkpoint's (`embeddings.patch_embedding`, `encoder.layers.<i>.…`,
`post_layernorm`), except q/k/v, stacked into one matmul (`qkv_proj`, weight and bias);
`load_weights` fills its slices. Attention is torch's scaled_dot_product_attention (no
mask); the rest is transformers' op order, so outputs agree with theirs to float rounding.
`read_siglip_config` reads a `vision_config` dict over SiglipVisionConfig's defaults (a
saved config keeps only the keys that differ from them).
"""

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from modeling.layers import ACTIVATIONS
from modeling.stacked_weights import StackedWeights

# SiglipVisionConfig's defaults in transformers (those read here)
DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
            "num_attention_heads": 12, "num_channels": 3, "image_size": 224, "patch_size": 16,
            "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6, "vision_use_head": True}


@dataclass(frozen=True)
class SiglipConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    hidden_act: str
    layer_norm_eps: float
    use_head: bool  # the checkpoint has a pooling head (unused by Gemma 3: its tensors are skipped)

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision hidden_size {self.hidden_size} is not a multiple of "
                             f"num_attention_heads {self.num_heads}")
        if self.image_size % self.patch_size:
            raise ValueError(f"vision image_size {self.image_size} is not a multiple of "
                             f"patch_size {self.patch_size}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported vision hidden_act {self.hidden_act!r}; "
                             f"supported: {sorted(ACTIVATIONS)}")

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side**2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def read_siglip_config(raw: dict) -> SiglipConfig:
    """A `vision_config` dict (config.json), missing keys taken from SiglipVisionConfig's defaults."""
    c = {**DEFAULTS, **raw}
    for key in ("image_size", "patch_size"):
        if not isinstance(c[key], int):
            raise ValueError(f"vision {key} {c[key]!r}: only square images and patches are supported")
    return SiglipConfig(
        hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_layers=c["num_hidden_layers"], num_heads=c["num_attention_heads"],
        num_channels=c["num_channels"], image_size=c["image_size"], patch_size=c["patch_size"],
        hidden_act=c["hidden_act"], layer_norm_eps=c["layer_norm_eps"], use_head=c["vision_use_head"])


class SiglipEmbeddings(nn.Module):
    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, kernel_size=cfg.patch_size,
                                         stride=cfg.patch_size, padding="valid")
        self.position_embedding = nn.Embedding(cfg.num_patches, cfg.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        return patches.flatten(2).transpose(1, 2) + self.position_embedding.weight


class SiglipAttention(nn.Module):
    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, p, d = x.shape
        qkv = self.qkv_proj(x).view(n, p, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], scale=self.head_dim**-0.5)
        return self.out_proj(out.transpose(1, 2).reshape(n, p, d))


class SiglipMLP(nn.Module):
    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = SiglipAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = SiglipMLP(cfg)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.layer_norm1(h))
        return h + self.mlp(self.layer_norm2(h))


class SiglipEncoder(nn.Module):
    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(cfg) for _ in range(cfg.num_layers))


class SiglipVisionTower(nn.Module):
    STACKED = (("qkv_proj", "q_proj", 0), ("qkv_proj", "k_proj", 1), ("qkv_proj", "v_proj", 2))

    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.cfg = cfg
        self.embeddings = SiglipEmbeddings(cfg)
        self.encoder = SiglipEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C, S, S] (S = image_size) -> patch features [N, P, D]."""
        c, s = self.cfg.num_channels, self.cfg.image_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (c, s, s):
            raise ValueError(f"pixel_values of shape {tuple(pixel_values.shape)}; the vision tower "
                             f"takes [N, {c}, {s}, {s}]")
        h = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            h = layer(h)
        return self.post_layernorm(h)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy (name, tensor) pairs, named as in the tower (modeling/weight_names.py
        strips the checkpoint's prefix), into the parameters; q/k/v into qkv_proj's slices.
        Returns the keys still unfilled (a parameter's name, `name#i` for a slice); raises
        on a tensor with no place or of the wrong shape."""
        d = self.cfg.hidden_size
        loader = StackedWeights(dict(self.named_parameters()), self.STACKED,
                                lambda param, _, index: param[index * d:(index + 1) * d],
                                owner="the vision tower")
        for name, tensor in weights:
            if self.cfg.use_head and name.startswith("head."):
                continue  # SigLIP's pooling head: Gemma 3 reads the patch features, not it
            loader.copy(name, tensor)
        return loader.unfilled
