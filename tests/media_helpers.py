"""Media the tests make: video files encoded with PyAV, one solid colour a frame (far enough
from its neighbours' to survive lossy codecs), for the gateway's and the stack's tests."""

import io

import av
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
