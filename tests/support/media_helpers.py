"""Media the tests make: images of random pixels in any mode, saved as files; video files
encoded with PyAV, one solid colour a frame (far enough from its neighbours' to survive lossy
codecs); data: URLs of them; and `refused`, the check of the gateway's 400 for bad media.
For the gateway's, the worker's and the stack's tests."""

import base64
import io

import numpy as np
from PIL import Image

from gateway.errors import OpenAIError

PARAM = "messages[0].content[1].image_url.url"  # where refused() expects the error by default


def color(i: int) -> tuple[int, int, int]:
    """Frame i's colour."""
    return (i * 12) % 256, 128, 255 - (i * 12) % 256


def make_video(container: str = "mp4", codec: str = "mpeg4", frames: int = 20, rate: int = 10,
               size: tuple[int, int] = (64, 48)) -> bytes:
    import av  # only here: the GPU image's tests use the images alone and it has no PyAV

    out = io.BytesIO()
    with av.open(out, "w", format=container) as video:
        stream = video.add_stream(codec, rate=rate)
        stream.width, stream.height = size
        stream.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_image(Image.new("RGB", size, color(i)))
            for packet in stream.encode(frame):
                video.mux(packet)
        for packet in stream.encode():
            video.mux(packet)
    return out.getvalue()


def picture(seed: int, width: int, height: int, mode: str = "RGB") -> Image.Image:
    """Random pixels in `mode` (RGB, RGBA with random alpha, L, P with 16 colours ...)."""
    rs = np.random.RandomState(seed)
    rgb = Image.fromarray(rs.randint(0, 256, (height, width, 3), dtype=np.uint8))
    if mode == "RGBA":
        rgba = rgb.convert("RGBA")
        rgba.putalpha(Image.fromarray(rs.randint(0, 256, (height, width), dtype=np.uint8)))
        return rgba
    if mode == "P":
        return rgb.quantize(colors=16)
    return rgb.convert(mode)


def file_bytes(image: Image.Image, fmt: str) -> bytes:
    """The image saved as a `fmt` file (JPEG at quality 80)."""
    out = io.BytesIO()
    image.save(out, format=fmt, **({"quality": 80} if fmt == "JPEG" else {}))
    return out.getvalue()


def png(size=(32, 24), color=(200, 30, 40)) -> bytes:
    """A small one-colour PNG file."""
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, "PNG")
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def refused(exc_info, code: str, *words: str, param: str = PARAM) -> None:
    """The raised error is the gateway's 400 with this code, param and words in its message."""
    error = exc_info.value
    assert isinstance(error, OpenAIError)
    assert error.status == 400 and error.type == "invalid_request_error"
    assert error.code == code, error.message
    assert error.param == param
    for word in words:
        assert word in error.message, error.message
