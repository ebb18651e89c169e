"""Checking an image with PIL before it is stored: a format we accept, a size within the
pixel cap, and a full decode, so a truncated or corrupt file is refused here (a 400) rather
than failing in a worker.

Accepted: PNG, JPEG (and MPO, the JPEG variant many cameras write), WEBP, GIF and BMP; of an
animated file the first frame is what a model sees. The pixel cap is checked from the header,
before anything is decoded, so a decompression bomb (a small file declaring a huge image)
costs nothing. What is stored is the file as it came (`MediaItem` kind "encoded"): smaller
than its pixels, and the worker decodes the same bytes the same way.

`check_image` is synchronous and CPU-bound: call it in a thread (loader.py does). Bytes
already stored (a camera's frame sent again) need only `checked_before`: the header.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from gateway.errors import OpenAIError, invalid
from proto.messages import MediaItem

ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # PIL's JPEG plugin also opens MPO
# First bytes of our formats (WEBP: RIFF....WEBP, below; BMP's "BM" is too short to tell).
_SIGNATURES = {b"\x89PNG\r\n\x1a\n": "PNG", b"\xff\xd8\xff": "JPEG", b"GIF87a": "GIF", b"GIF89a": "GIF"}
_MIME = {"PNG": "image/png", "JPEG": "image/jpeg", "MPO": "image/jpeg", "WEBP": "image/webp",
         "GIF": "image/gif", "BMP": "image/bmp"}
MIME_TYPES = tuple(dict.fromkeys(_MIME.values()))  # what a stored image's bytes are, as HTTP types them


@dataclass(frozen=True)
class CheckedImage:
    """An image that decoded in full, as stored: its file's bytes and what they hold."""

    data: bytes
    format: str  # PIL's name: PNG, JPEG, ...
    width: int
    height: int
    mode: str  # PIL's mode of the decoded pixels: RGB, RGBA, L, P, ...

    @property
    def mime(self) -> str:
        return _MIME[self.format]

    def item(self) -> MediaItem:
        return MediaItem(kind="encoded", width=self.width, height=self.height, data=self.data,
                         mime=self.mime)


def check_image(data: bytes, *, max_pixels: int, param: str) -> CheckedImage:
    """The image in `data`, decoded once in full; a 400 naming `param` for anything wrong."""
    with _open(data, max_pixels, param) as image:
        try:
            image.load()  # the first frame of an animation
        except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as exc:
            raise invalid(f"The {image.format} image is truncated or corrupt: {exc}.", param=param,
                          code="invalid_image") from None
        return _checked(data, image)


def checked_before(data: bytes, *, max_pixels: int, param: str) -> CheckedImage:
    """What `check_image` says of bytes that passed it before (the store holds them under
    their content hash), from the header alone: nothing is decoded (tens of microseconds where
    a full decode of a camera frame takes milliseconds). The pixel cap is checked again."""
    with _open(data, max_pixels, param) as image:
        return _checked(data, image)


def _open(data: bytes, max_pixels: int, param: str) -> Image.Image:
    """The image opened (its header read, nothing decoded), its format and size checked."""
    try:
        image = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
    except Image.DecompressionBombError:  # PIL's own cap (far above ours) hit while reading the header
        raise invalid(f"The image is too large: more than {max_pixels} pixels.", param=param,
                      code="image_too_large") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise _unidentified(data, param) from None
    width, height = image.size
    refusal = None
    if width <= 0 or height <= 0:
        refusal = invalid(f"The image has no pixels ({width}x{height}).", param=param, code="invalid_image")
    elif width * height > max_pixels:
        refusal = invalid(f"The image is {width}x{height} = {width * height} pixels; the limit is "
                          f"{max_pixels} pixels.", param=param, code="image_too_large")
    if refusal is not None:
        image.close()
        raise refusal
    return image


def _checked(data: bytes, image: Image.Image) -> CheckedImage:
    width, height = image.size
    return CheckedImage(data=data, format=str(image.format), width=width, height=height, mode=image.mode)


def _unidentified(data: bytes, param: str) -> OpenAIError:
    """Why none of our formats opened it: a format PIL knows but we do not take, one of ours
    whose header is cut or broken, or not an image at all."""
    try:
        with Image.open(io.BytesIO(data)) as other:  # the header only: nothing is decoded
            found = other.format
    except Exception:  # any plugin's complaint means the same here: no image it knows
        found = None
    if found:
        return invalid(f"The image format {found} is not supported; send {', '.join(ALLOWED_FORMATS)}.",
                       param=param, code="unsupported_image_format")
    ours = _signature(data)
    if ours:
        return invalid(f"The {ours} image is truncated or corrupt.", param=param, code="invalid_image")
    return invalid("The data is not a valid image (PNG, JPEG, WEBP, GIF or BMP).", param=param,
                   code="invalid_image")


def _signature(data: bytes) -> str | None:
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return next((fmt for magic, fmt in _SIGNATURES.items() if data.startswith(magic)), None)
