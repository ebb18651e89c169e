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
A PIL image built from raw RGB bytes (`Image.frombytes("RGB", (w, h), data)`, how video
frames arrive) is just an RGB image here.

Pan-and-scan (`do_pan_and_scan`, off by default in Gemma 3's configs; a request may ask
for it) is implemented as transformers does it: an image whose aspect ratio is at least
`pan_and_scan_min_ratio_to_activate` is also cut along its long side into
n = clamp(min(floor(ratio + 0.5), floor(long side / min_crop_size)), 2, max_num_crops)
crops of ceil(side / n) pixels (the last one shorter when it does not divide), unless a
crop would be shorter than `pan_and_scan_min_crop_size`; the crops follow the image as
extra images, each with its own soft tokens, and the prompt expands differently
(worker_svc/make_vision_model.py gives the text).
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

# Gemma3Processor's defaults for the values Google's preprocessor_config.json leaves null
PROCESSOR_DEFAULTS = {"do_convert_rgb": True, "do_pan_and_scan": False, "pan_and_scan_min_crop_size": 256,
                      "pan_and_scan_max_num_crops": 4, "pan_and_scan_min_ratio_to_activate": 1.2}
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
    do_pan_and_scan: bool
    pan_and_scan_min_crop_size: int
    pan_and_scan_max_num_crops: int
    pan_and_scan_min_ratio_to_activate: float

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
                   do_convert_rgb=c["do_convert_rgb"], do_pan_and_scan=c["do_pan_and_scan"],
                   pan_and_scan_min_crop_size=c["pan_and_scan_min_crop_size"],
                   pan_and_scan_max_num_crops=c["pan_and_scan_max_num_crops"],
                   pan_and_scan_min_ratio_to_activate=c["pan_and_scan_min_ratio_to_activate"])

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path) -> "ImagePreprocessConfig":
        """The image processor's config of a checkpoint folder, found where transformers 5
        looks first: processor_config.json's "image_processor" (what it saves), else
        preprocessor_config.json (Google's releases, transformers 4)."""
        model_dir = Path(model_dir)
        processor = model_dir / "processor_config.json"
        if processor.exists():
            nested = json.loads(processor.read_text()).get("image_processor")
            if nested is not None:
                return cls.from_dict(nested)
        legacy = model_dir / "preprocessor_config.json"
        if not legacy.exists():
            raise FileNotFoundError(f"{model_dir} has no image processor config (processor_config.json "
                                    "with an image_processor, or preprocessor_config.json)")
        return cls.from_dict(json.loads(legacy.read_text()))


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


def pan_and_scan_boxes(height: int, width: int,
                       cfg: ImagePreprocessConfig) -> list[tuple[int, int, int, int]]:
    """(top, left, crop height, crop width) of each crop pan-and-scan cuts from an image of
    that size, row-major; [] when it leaves the image whole. Crops may reach past the
    image's edge, where they are cut short (the slice of an array)."""
    long, short = max(width, height), min(width, height)
    if long / short < cfg.pan_and_scan_min_ratio_to_activate:
        return []
    n = min(int(math.floor(long / short + 0.5)), int(math.floor(long / cfg.pan_and_scan_min_crop_size)))
    n = min(cfg.pan_and_scan_max_num_crops, max(2, n))
    crops_w, crops_h = (n, 1) if width >= height else (1, n)
    crop_w, crop_h = int(math.ceil(width / crops_w)), int(math.ceil(height / crops_h))
    if min(crop_w, crop_h) < cfg.pan_and_scan_min_crop_size:
        return []
    return [(crop_h * i, crop_w * j, crop_h, crop_w) for i in range(crops_h) for j in range(crops_w)]


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


def preprocess_image(image: Image.Image, cfg: ImagePreprocessConfig,
                     do_pan_and_scan: bool | None = None) -> torch.Tensor:
    """pixel_values float32 [1 + k, 3, H, W]: the image, then its k pan-and-scan crops
    (`do_pan_and_scan`: the request's choice, None for the config's)."""
    if cfg.do_convert_rgb:
        image = to_rgb(image)
    elif image.mode != "RGB":
        raise ValueError(f"a {image.mode} image with do_convert_rgb off: only RGB images can be used")
    rgb = np.asarray(image)
    pieces = [rgb]
    if cfg.do_pan_and_scan if do_pan_and_scan is None else do_pan_and_scan:
        height, width = rgb.shape[:2]
        pieces += [rgb[t:t + h, l:l + w] for t, l, h, w in pan_and_scan_boxes(height, width, cfg)]
    return torch.from_numpy(np.stack([_to_pixels(p, cfg) for p in pieces]))
