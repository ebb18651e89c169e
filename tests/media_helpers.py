"""Media the tests make: images of random pixels in any mode, saved as files; video files
encoded with PyAV, one solid colour a frame (far enough from its neighbours' to survive lossy
codecs); for the gateway's, the worker's and the stack's tests."""

import io

import av
import numpy as np
from PIL import Image


def color(i: int) -> tuple[int, int, int]:
    """Frame i's colour."""
    return (i * 12) % 256, 128, 255 - (i * 12) % 256


def make_video(container: str = "mp4", codec: str = "mpeg4", frames: int = 20, rate: int = 10,
               size: tuple[int, int] = (64, 48)) -> bytes:
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
