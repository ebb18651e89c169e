"""A PIL image -> the vision tower's `pixel_values`, exactly as the image processor
`AutoProcessor` loads for a Gemma 3 checkpoint in this environment (transformers 5's
`Gemma3ImageProcessorPil`, under Gemma3Processor's defaults), with its parameters read
from the checkpoint (`ImagePreprocessConfig.from_checkpoint`).

preprocess_image(image, cfg) -> float32 [1 + k, 3, H, W] (k pan-and-scan crops, 0 unless asked):
    rgb = image as RGB, uint8 [h, w, 3]: an image with an alpha band ("RGBA", "LA", ...) or
          a transparency key ("P" or "L" with one) composited over opaque white, any other
          mode (grayscale "L", palette "P", "CMYK", ...) through PIL's convert("RGB")
    pieces = [rgb] + (pan-and-scan crops of rgb, when on)
    per piece: PIL resize to (H, W) with the config's filter (Gemma 3: bilinear), then
          x = float32(float64(x) * rescale_factor)        (1/255)
          x = (x - mean) / std                             per channel, in float32
          channels first
Each step is the one transformers takes, in its dtype, so the result is bit-identical.
preprocess_piece(rgb_array(image, cfg), cfg, crop) -> float32 [3, H, W]: one of those pieces
(crop None: the image), what a worker encodes for one run of soft tokens; the image is
converted once however many pieces are cut from it.
A PIL image built from raw RGB bytes (`Image.frombytes("RGB", (w, h), data)`, how video
frames arrive) is just an RGB image here.

Pan-and-scan (`do_pan_and_scan`, off by default in Gemma 3's configs; a request may ask
for it) is implemented as transformers does it, by the arithmetic the gateway expands the
prompt with (proto/pan_and_scan.py: which images it cuts, into which boxes, and where its
settings come from); the crops follow the image as extra images, each with its own soft
tokens. A worker encodes each piece on its own (`preprocess_piece`: the whole image, or one
crop box the gateway named); `preprocess_image` makes all of an image's pieces at once.
"""

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from proto.image_processor_config import image_processor_config
from proto.pan_and_scan import CropBox, PanAndScan

# Gemma3Processor's default for a value Google's preprocessor_config.json leaves null (its
# pan-and-scan defaults: proto/pan_and_scan.py)
PROCESSOR_DEFAULTS = {"do_convert_rgb": True}
# Gemma3ImageProcessorPil's class defaults
IMAGE_PROCESSOR_DEFAULTS = {"size": {"height": 224, "width": 224}, "resample": Image.Resampling.BILINEAR,
                            "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
                            "do_normalize": True, "image_mean": (0.5, 0.5, 0.5), "image_std": (0.5, 0.5, 0.5)}
IMAGE_PROCESSOR_TYPES = ("Gemma3ImageProcessor", "Gemma3ImageProcessorPil", "Gemma3ImageProcessorFast")


@dataclass(frozen=True)
class ImagePreprocessConfig:
    height: int
    width: int
    resample: int  # a PIL.Image.Resampling value
    do_resize: bool
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    do_convert_rgb: bool
    pan_and_scan: PanAndScan  # the checkpoint's; a request's mm_processor_kwargs may change it

    @classmethod
    def from_dict(cls, raw: dict) -> "ImagePreprocessConfig":
        """An image processor's config dict (null values: Gemma3Processor's defaults)."""
        kind = raw.get("image_processor_type")
        if kind is not None and kind not in IMAGE_PROCESSOR_TYPES:
            raise ValueError(f"image processor {kind!r}: only Gemma 3's ({', '.join(IMAGE_PROCESSOR_TYPES)}) "
                             "is implemented")
        c = {**IMAGE_PROCESSOR_DEFAULTS, **PROCESSOR_DEFAULTS,
             **{k: v for k, v in raw.items() if v is not None}}
        size = c["size"]
        if isinstance(size, int):
            size = {"height": size, "width": size}
        if set(size) != {"height", "width"}:
            raise ValueError(f"image size {size}: only a fixed {{height, width}} is supported (Gemma 3's)")
        return cls(height=size["height"], width=size["width"], resample=int(c["resample"]),
                   do_resize=c["do_resize"], do_rescale=c["do_rescale"],
                   rescale_factor=c["rescale_factor"], do_normalize=c["do_normalize"],
                   image_mean=_per_channel(c["image_mean"]), image_std=_per_channel(c["image_std"]),
                   do_convert_rgb=c["do_convert_rgb"], pan_and_scan=PanAndScan.from_image_processor(raw))

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path) -> "ImagePreprocessConfig":
        """The image processor's config of a checkpoint folder, found where transformers 5
        looks first (proto/image_processor_config.py)."""
        raw = image_processor_config(model_dir)
        if raw is None:
            raise FileNotFoundError(f"{model_dir} has no image processor config (processor_config.json "
                                    "with an image_processor, or preprocessor_config.json)")
        return cls.from_dict(raw)


def _per_channel(value) -> tuple[float, float, float]:
    values = tuple(float(v) for v in value) if isinstance(value, (list, tuple)) else (float(value),) * 3
    if len(values) != 3:
        raise ValueError(f"{len(values)} values for 3 channels: {value}")
    return values


def to_rgb(image: Image.Image) -> Image.Image:
    """transformers' convert_to_rgb: transparency composited over white, else convert("RGB")."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _to_pixels(rgb: np.ndarray, cfg: ImagePreprocessConfig) -> np.ndarray:
    """uint8 [h, w, 3] -> float32 [3, H, W]: resize, rescale, normalize."""
    if cfg.do_resize:
        resized = Image.fromarray(np.ascontiguousarray(rgb)).resize((cfg.width, cfg.height),
                                                                    resample=cfg.resample)
        rgb = np.asarray(resized)
    x = rgb.transpose(2, 0, 1)
    if cfg.do_rescale:  # in float64, then float32, as transformers' rescale
        x = (x.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    if cfg.do_normalize:
        if not np.issubdtype(x.dtype, np.floating):
            x = x.astype(np.float32)
        mean = np.array(cfg.image_mean, dtype=x.dtype)[:, None, None]
        std = np.array(cfg.image_std, dtype=x.dtype)[:, None, None]
        x = (x - mean) / std
    return x.astype(np.float32)


def rgb_array(image: Image.Image, cfg: ImagePreprocessConfig) -> np.ndarray:
    """uint8 [h, w, 3] of `image`, converted as the config says: once per image, however many
    pieces are cut from it. ValueError for a mode the config cannot use."""
    if cfg.do_convert_rgb:
        image = to_rgb(image)
    elif image.mode != "RGB":
        raise ValueError(f"a {image.mode} image with do_convert_rgb off: only RGB images can be used")
    return np.asarray(image)


def preprocess_image(image: Image.Image, cfg: ImagePreprocessConfig,
                     do_pan_and_scan: bool | None = None) -> torch.Tensor:
    """pixel_values float32 [1 + k, 3, H, W]: the image, then its k pan-and-scan crops
    (`do_pan_and_scan`: the request's choice, None for the config's)."""
    rgb = rgb_array(image, cfg)
    settings = cfg.pan_and_scan if do_pan_and_scan is None else replace(cfg.pan_and_scan, enabled=do_pan_and_scan)
    height, width = rgb.shape[:2]
    return torch.stack([preprocess_piece(rgb, cfg, crop) for crop in (None, *settings.boxes(height, width))])


def preprocess_piece(rgb: np.ndarray, cfg: ImagePreprocessConfig, crop: CropBox | None = None) -> torch.Tensor:
    """pixel_values float32 [3, H, W] of one piece of an image (`rgb`: its `rgb_array`): the
    whole image (`crop` None) or the crop at that box (cut short at the image's edge, as
    transformers' slice). ValueError for a box that starts outside the image or is empty."""
    if crop is not None:
        top, left, h, w = crop
        height, width = rgb.shape[:2]
        if h < 1 or w < 1 or not (0 <= top < height and 0 <= left < width):
            raise ValueError(f"crop box {tuple(crop)} (top, left, height, width) is not inside the "
                             f"{width}x{height} image")
        rgb = rgb[top:top + h, left:left + w]
    return torch.from_numpy(_to_pixels(rgb, cfg))
