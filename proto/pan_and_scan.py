"""Pan-and-scan (Gemma 3): the one definition the gateway and the worker share. The gateway
needs each image's crops to expand the prompt (one run of soft tokens per piece), the worker
to encode them; the gateway runs without torch or worker code (the `light` image), so the
pure arithmetic lives here, beside the messages that carry its result.

    settings = PanAndScan.from_image_processor(checkpoint_image_processor_dict)
    settings = settings.overridden(request.mm_processor_kwargs)     # ValueError naming the bad one
    settings.boxes(height, width)  -> [CropBox(top, left, height, width), ...]   ([] when off)
    embedding_key(content_hash, crop)                                # what its embeddings are known by

The arithmetic is transformers' (`Gemma3ImageProcessorPil.pan_and_scan`): an image whose
long side / short side is at least `min_ratio_to_activate` is cut along its long side into

    n = clamp(min(floor(ratio + 0.5), floor(long side / min_crop_size)), 2, max_num_crops)

crops of ceil(side / n) pixels, row-major (the last one shorter when n does not divide the
side: a slice past the edge), unless a crop would be shorter than `min_crop_size` -- then
none. The image is encoded whole first, then each crop as an image of its own.

Where the settings come from (vLLM's rule, not AutoProcessor's): the checkpoint's image
processor config where it sets a value (non-null), else Gemma3Processor's defaults (off,
256, 4, 1.2); a request's `mm_processor_kwargs` (vLLM's field, transformers' names) over
both -- `do_pan_and_scan: false` turns a checkpoint's pan-and-scan off. transformers 5's
Gemma3Processor passes its own defaults over the image processor's config, so
`AutoProcessor` ignores a checkpoint's pan-and-scan settings; called with the same values
explicitly it makes exactly our prompt and pixels.

A crop's embeddings are its own, never the image's: `embedding_key` names the whole image by
its content hash (so an image's first piece shares its embeddings with the same image sent
without pan-and-scan -- they are the same pixels) and a crop by the hash and its box (the box
fixes the crop's pixels, whatever settings cut it). Encoder caches, published embeddings,
encoding claims and prefix-cache keys all use it, so no piece is ever taken for another.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

# Gemma3Processor's images_kwargs: what a checkpoint's null (or absent) values mean
DEFAULTS = {"do_pan_and_scan": False, "pan_and_scan_min_crop_size": 256, "pan_and_scan_max_num_crops": 4,
            "pan_and_scan_min_ratio_to_activate": 1.2}
# transformers' name -> PanAndScan's field
_FIELDS = {"do_pan_and_scan": "enabled", "pan_and_scan_min_crop_size": "min_crop_size",
           "pan_and_scan_max_num_crops": "max_num_crops",
           "pan_and_scan_min_ratio_to_activate": "min_ratio_to_activate"}
NAMES = tuple(_FIELDS)


class CropBox(NamedTuple):
    """Where a crop is in its image, in pixels (it may reach past the right or bottom edge,
    where it is cut short)."""

    top: int
    left: int
    height: int
    width: int


@dataclass(frozen=True)
class ImagePiece:
    """What one run of soft tokens shows: a stored image (by content hash), whole or one crop."""

    content_hash: str
    crop: CropBox | None = None

    @property
    def key(self) -> str:
        return embedding_key(self.content_hash, self.crop)


def embedding_key(content_hash: str, crop: CropBox | tuple[int, int, int, int] | None) -> str:
    """What a piece's embeddings are known by: the content hash for the whole image, the hash
    and the box for a crop."""
    if crop is None:
        return content_hash
    top, left, height, width = crop
    return f"{content_hash}:crop:{top},{left},{height},{width}"


def crop_grid(height: int, width: int, min_crop_size: int, max_num_crops: int,
              min_ratio_to_activate: float) -> tuple[int, int]:
    """(rows, columns) of the crops pan-and-scan cuts from an image of that size; (0, 0) when
    it leaves the image whole (transformers' arithmetic, step by step). Counting them costs
    nothing, whatever the settings: a request's sizes are checked against the context with
    it before any box is made."""
    if width >= height:
        if width / height < min_ratio_to_activate:
            return 0, 0
        n = min(int(math.floor(width / min_crop_size)), int(math.floor(width / height + 0.5)))
        crops_w, crops_h = min(max_num_crops, max(2, n)), 1
    else:
        if height / width < min_ratio_to_activate:
            return 0, 0
        n = min(int(math.floor(height / min_crop_size)), int(math.floor(height / width + 0.5)))
        crops_w, crops_h = 1, min(max_num_crops, max(2, n))
    if min(math.ceil(width / crops_w), math.ceil(height / crops_h)) < min_crop_size:
        return 0, 0
    return crops_h, crops_w


def crop_boxes(height: int, width: int, min_crop_size: int, max_num_crops: int,
               min_ratio_to_activate: float) -> list[CropBox]:
    """The crops of `crop_grid`, row-major; [] when it leaves the image whole."""
    crops_h, crops_w = crop_grid(height, width, min_crop_size, max_num_crops, min_ratio_to_activate)
    if not crops_h:
        return []
    crop_w, crop_h = int(math.ceil(width / crops_w)), int(math.ceil(height / crops_h))
    return [CropBox(crop_h * i, crop_w * j, crop_h, crop_w) for i in range(crops_h) for j in range(crops_w)]


@dataclass(frozen=True)
class PanAndScan:
    enabled: bool = DEFAULTS["do_pan_and_scan"]
    min_crop_size: int = DEFAULTS["pan_and_scan_min_crop_size"]
    max_num_crops: int = DEFAULTS["pan_and_scan_max_num_crops"]
    min_ratio_to_activate: float = DEFAULTS["pan_and_scan_min_ratio_to_activate"]

    @classmethod
    def from_image_processor(cls, raw: Mapping[str, Any] | None) -> PanAndScan:
        """The settings of a checkpoint's image processor config (None: it has none): its
        non-null values over Gemma3Processor's defaults. ValueError naming a bad value."""
        try:
            return cls().overridden({k: v for k, v in (raw or {}).items() if k in _FIELDS})
        except ValueError as exc:
            raise ValueError(f"the image processor config: {exc}") from None

    def overridden(self, kwargs: Mapping[str, Any] | None) -> PanAndScan:
        """These settings with a request's `mm_processor_kwargs` over them (None values leave
        a setting as it is). ValueError naming the first unknown name or bad value."""
        changes = {}
        for name, value in (kwargs or {}).items():
            if name not in _FIELDS:
                raise ValueError(f"'{name}' is not a processor setting of this model; the settings "
                                 f"are {', '.join(repr(n) for n in NAMES)}")
            if value is not None:
                changes[_FIELDS[name]] = _checked(name, value)
        return replace(self, **changes) if changes else self

    def count(self, height: int, width: int) -> int:
        """How many crops `boxes` would make, without making them."""
        if not self.enabled:
            return 0
        rows, columns = crop_grid(height, width, self.min_crop_size, self.max_num_crops, self.min_ratio_to_activate)
        return rows * columns

    def boxes(self, height: int, width: int) -> list[CropBox]:
        """The crops of an image of that size ([] when pan-and-scan is off or leaves it whole)."""
        if not self.enabled:
            return []
        return crop_boxes(height, width, self.min_crop_size, self.max_num_crops, self.min_ratio_to_activate)


def _checked(name: str, value: Any) -> bool | int | float:
    """`value` for setting `name`, or ValueError saying what it must be."""
    if name == "do_pan_and_scan":
        if not isinstance(value, bool):
            raise ValueError(f"'{name}' must be true or false, not {value!r}")
        return value
    if name == "pan_and_scan_min_ratio_to_activate":
        try:  # an integer too large for a float overflows: as bad as infinity
            number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        except OverflowError:
            number = None
        if number is None or not math.isfinite(number) or number <= 0:
            raise ValueError(f"'{name}' must be a finite number above 0, not {_shown(value)}")
        return number
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"'{name}' must be an integer of at least 1, not {_shown(value)}")
    return value


def _shown(value: Any) -> str:
    """`value` for an error message, a huge one cut short."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
