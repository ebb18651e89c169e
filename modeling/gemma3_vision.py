"""Gemma 3's vision encoder: the SigLIP tower (modeling/siglip.py) and Gemma 3's
multi-modal projector, images in, one embedding per image soft token out -- what
transformers' `Gemma3ForConditionalGeneration.get_image_features(pixel_values)` returns.

forward(pixel_values [N, 3, S, S]) -> [N, mm_tokens_per_image, text hidden]:
    f = tower(pixel_values)                          [N, P, Dv], P = (S / patch)^2 patches
    f = f viewed as a [Dv, sqrt P, sqrt P] grid per image, average-pooled with kernel =
        stride = sqrt P / sqrt mm_tokens_per_image, flattened row-major  [N, mm, Dv]
    f = GemmaRMSNorm(f) (scale 1 + w, fp32, eps = the tower's layer_norm_eps)
    f = f @ mm_input_projection_weight               [Dv, text hidden] -> [N, mm, Dt]
The output has the encoder's dtype; it goes, as it is, over the image's soft-token rows of
the decoder's (already scaled) input embeddings: modeling/image_placement.py.

In the prompt an image is `<start_of_image>`, mm_tokens_per_image × `<image_soft_token>`,
`<end_of_image>`, with "\\n\\n" on each side as text (tools/make_vision_model.py has the
processor's exact expansion rule); `Gemma3VisionConfig` carries the three token ids.

Weights: `load_weights` takes every (name, tensor) of the checkpoint, in any of its layouts
(modeling/weight_names.py), keeps the tower's and the projector's, ignores the
language model's, and raises unless every parameter was filled and every vision tensor
placed. `load_vision_encoder(model_dir, ...)` reads only those tensors from the files.
"""

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from modeling.config import DTYPES, architecture_of
from modeling.dummy_weights import check_load_format, fill_dummy
from modeling.gemma3 import TEXT_CONFIG_DEFAULTS
from modeling.layers import GemmaRMSNorm
from modeling.loader import weight_files
from modeling.siglip import SiglipConfig, SiglipVisionTower, read_siglip_config
from modeling.weight_memory import check_fits
from modeling.weight_names import PROJECTOR, TEXT, VISION, split_name

ARCHITECTURES = ("Gemma3ForConditionalGeneration",)
# Gemma3Config's defaults in transformers (those read here)
DEFAULTS = {"mm_tokens_per_image": 256, "boi_token_index": 255_999, "eoi_token_index": 256_000,
            "image_token_index": 262_144}


@dataclass(frozen=True)
class Gemma3VisionConfig:
    tower: SiglipConfig
    mm_tokens_per_image: int  # soft tokens (embeddings) per image
    text_hidden_size: int
    boi_token_id: int  # <start_of_image>
    image_token_id: int  # <image_soft_token>, the placeholder the embeddings replace
    eoi_token_id: int  # <end_of_image>
    dtype: torch.dtype  # the checkpoint's

    def __post_init__(self) -> None:
        side = round(self.mm_tokens_per_image**0.5)
        if side * side != self.mm_tokens_per_image:
            raise ValueError(f"mm_tokens_per_image {self.mm_tokens_per_image} is not a square")
        if self.tower.patches_per_side % side:
            raise ValueError(f"{self.tower.patches_per_side}x{self.tower.patches_per_side} patches "
                             f"do not pool evenly to {side}x{side} soft tokens")

    @property
    def image_size(self) -> int:
        """The side, in pixels, of the square images the tower takes."""
        return self.tower.image_size


def read_vision_config(raw: dict) -> Gemma3VisionConfig:
    """The vision part of a Gemma3ForConditionalGeneration config.json dict."""
    if architecture_of(raw) not in ARCHITECTURES:
        raise ValueError(f"{architecture_of(raw)} has no Gemma 3 vision encoder")
    c = {**DEFAULTS, **raw}
    text = raw.get("text_config") or {}
    dtype_name = raw.get("dtype") or raw.get("torch_dtype") or text.get("dtype") or "float32"
    if dtype_name not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype_name!r}: one of {', '.join(DTYPES)}")
    return Gemma3VisionConfig(
        tower=read_siglip_config(raw.get("vision_config") or {}),
        mm_tokens_per_image=c["mm_tokens_per_image"],
        text_hidden_size=text.get("hidden_size", TEXT_CONFIG_DEFAULTS["hidden_size"]),
        boi_token_id=c["boi_token_index"], image_token_id=c["image_token_index"],
        eoi_token_id=c["eoi_token_index"], dtype=DTYPES[dtype_name])


class Gemma3Projector(nn.Module):
    """Patch features [N, P, Dv] -> soft-token embeddings [N, mm, Dt] (transformers'
    Gemma3MultiModalProjector: pool, norm, project; parameter names as theirs)."""

    def __init__(self, cfg: Gemma3VisionConfig):
        super().__init__()
        dv = cfg.tower.hidden_size
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(dv, cfg.text_hidden_size))
        self.mm_soft_emb_norm = GemmaRMSNorm(dv, cfg.tower.layer_norm_eps)
        self.patches_per_side = cfg.tower.patches_per_side
        self.kernel = self.patches_per_side // round(cfg.mm_tokens_per_image**0.5)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        n, _, dv = features.shape
        grid = features.transpose(1, 2).reshape(n, dv, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid.contiguous(), kernel_size=self.kernel, stride=self.kernel)
        normed = self.mm_soft_emb_norm(pooled.flatten(2).transpose(1, 2))
        return torch.matmul(normed, self.mm_input_projection_weight).type_as(features)


class Gemma3VisionEncoder(nn.Module):
    """Tower + projector. Submodule names are transformers' (`vision_tower`, `multi_modal_projector`)."""

    def __init__(self, cfg: Gemma3VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.vision_tower = SiglipVisionTower(cfg.tower)
        self.multi_modal_projector = Gemma3Projector(cfg)

    @property
    def dtype(self) -> torch.dtype:
        return self.multi_modal_projector.mm_input_projection_weight.dtype

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, 3, S, S] (any float dtype; cast to the encoder's) ->
        soft-token embeddings [N, mm_tokens_per_image, text hidden] in the encoder's dtype."""
        return self.multi_modal_projector(self.vision_tower(pixel_values))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill every parameter from a checkpoint's (name, tensor) pairs (any layout; the
        language model's tensors are skipped). KeyError for a vision or projector tensor
        with no place, ValueError for a wrong shape or a parameter left unfilled."""
        projector = dict(self.multi_modal_projector.named_parameters())
        unfilled = set(projector)

        def tower_weights():
            for name, tensor in weights:
                part, local = split_name(name)
                if part == VISION:
                    yield local, tensor
                elif part == PROJECTOR:
                    if local not in projector:
                        raise KeyError(f"projector tensor {name!r} matches no parameter")
                    if projector[local].shape != tensor.shape:
                        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)}, "
                                         f"model expects {tuple(projector[local].shape)}")
                    projector[local].data.copy_(tensor)
                    unfilled.discard(local)
                elif part != TEXT:
                    raise KeyError(f"checkpoint tensor {name!r}: unknown part {part}")

        unfilled.update(f"vision_tower.{key}" for key in self.vision_tower.load_weights(tower_weights()))
        if unfilled:
            raise ValueError(f"checkpoint lacks {len(unfilled)} vision tensors, e.g. {sorted(unfilled)[:4]}")


def iter_vision_tensors(model_dir: str | Path):
    """(name, tensor) of the checkpoint's vision tower and projector tensors only: the
    language model's are never read from the files."""
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if split_name(name)[0] != TEXT:
                    yield name, f.get_tensor(name)


def load_vision_encoder(model_dir: str | Path, cfg: Gemma3VisionConfig, dtype: torch.dtype,
                        device: torch.device | str, load_format: str = "auto") -> Gemma3VisionEncoder:
    """The encoder of a Gemma3ForConditionalGeneration checkpoint folder, in `dtype` on
    `device`; `load_format` "dummy": random weights, no file read (modeling/dummy_weights.py)."""
    check_load_format(load_format)
    with torch.device("meta"):
        encoder = Gemma3VisionEncoder(cfg)
    check_fits(encoder, dtype, device, "the vision encoder")
    encoder = encoder.to(dtype).to_empty(device=device)
    if load_format == "dummy":
        fill_dummy(encoder)
    else:
        encoder.load_weights(iter_vision_tensors(model_dir))
    return encoder.eval()
