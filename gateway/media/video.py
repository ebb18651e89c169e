"""A video file → its sampled frames as RGB pixels with their timestamps, decoded with PyAV.

Two passes over the file, both from memory:
1. demux only (no decoding, cheap): count the video stream's packets, one per frame, and
   refuse more than `max_frames` before anything is decoded (20 MiB of a still scene can
   hold hours of frames); the frame rate and duration come from the container.
2. decode up to the last frame to keep; keep the frames `VideoSampling.indices` names
   (vLLM's rule: min(num_frames, floor(duration * fps), total) frames, evenly spaced from
   the first frame to the last), each converted to RGB8.

A frame's timestamp is its presentation time in seconds from the first frame (so it is
right for a variable-frame-rate camera stream too); index / fps where the file has none.
Only common video containers are opened (`CONTAINERS`, FFmpeg's `format_whitelist`): a
playlist format (HLS, concat) could otherwise make FFmpeg open other files or URLs.

`decode_video` is synchronous and CPU-bound: call it in a thread (loader.py does), so a
long video does not stall the event loop.
"""

from __future__ import annotations

import importlib
import io
from dataclasses import dataclass
from types import ModuleType

from gateway.errors import OpenAIError, invalid
from gateway.media.options import VideoSampling
from proto.messages import MediaItem

# FFmpeg demuxer names (a demuxer named "mov,mp4,m4a,3gp,3g2,mj2" matches any of its names).
CONTAINERS = "mov,mp4,matroska,webm,avi,mpegts,mpeg,flv,ogg,gif"
ACCEPTED = "MP4/MOV, WebM/MKV, AVI, MPEG-PS/TS, FLV, OGG, GIF"


@dataclass(frozen=True)
class VideoFrame:
    """One kept frame: `height` rows of `width` RGB pixels, 3 bytes each, no padding."""

    index: int  # its position among the video's frames, from 0
    timestamp_s: float  # seconds from the first frame
    width: int
    height: int
    rgb: bytes

    def item(self) -> MediaItem:
        return MediaItem(kind="rgb8", width=self.width, height=self.height, data=self.rgb)


@dataclass(frozen=True)
class DecodedVideo:
    frames: tuple[VideoFrame, ...]  # ascending in time
    total_frames: int  # in the video, before sampling
    fps: float  # the video's own frame rate (0: unknown)
    duration_s: float


def decode_video(data: bytes, *, sampling: VideoSampling, max_pixels: int, max_frames: int,
                 param: str) -> DecodedVideo:
    """The frames of the video in `data` that `sampling` keeps; a 400 naming `param` for a
    file that is not a video we can decode, has no frames, or is over a cap."""
    av = _pyav(param)
    try:
        total, fps, duration = _survey(data, max_pixels, max_frames, param)
        wanted = sampling.indices(total, duration)
        frames = _decode(data, wanted, fps, max_pixels, param)
    except (av.FFmpegError, ValueError) as exc:  # PyAV's errors; ValueError: a frame it cannot convert
        reason = getattr(exc, "strerror", None) or str(exc)
        raise invalid(f"The video could not be decoded ({reason}); accepted containers: {ACCEPTED}.",
                      param=param, code="invalid_video") from None
    if not frames:
        raise invalid("The video has no frame that decodes.", param=param, code="invalid_video")
    return DecodedVideo(frames=tuple(frames), total_frames=total, fps=fps, duration_s=duration)


def _pyav(param: str) -> ModuleType:
    """PyAV, imported on the first video: a gateway that is never sent one (the GPU check's,
    whose bundle leaves the 36 MB wheel out) runs without it."""
    try:
        return importlib.import_module("av")
    except ImportError:
        raise OpenAIError(501, "This server cannot decode video: PyAV (`pip install av`) is not "
                               "installed.", param=param, code="video_not_supported") from None


def _open(data: bytes):
    return _pyav("").open(io.BytesIO(data), mode="r", options={"format_whitelist": CONTAINERS})


def _survey(data: bytes, max_pixels: int, max_frames: int, param: str) -> tuple[int, float, float]:
    """(frames, frame rate, duration in seconds), from the container without decoding."""
    with _open(data) as container:
        if not container.streams.video:
            raise invalid("The file has no video stream.", param=param, code="invalid_video")
        stream = container.streams.video[0]
        _check_size(stream.width, stream.height, max_pixels, param)
        total = 0
        for packet in container.demux(stream):
            if packet.size:  # the last, empty packet only flushes the decoder
                total += 1
                if total > max_frames:
                    raise invalid(f"The video has more than {max_frames} frames; the limit is "
                                  f"{max_frames}.", param=param, code="video_too_long")
        if total == 0:
            raise invalid("The video has no frames.", param=param, code="invalid_video")
        rate = stream.average_rate or stream.guessed_rate
        seconds = container.duration / _pyav("").time_base if container.duration else 0.0
        fps = float(rate) if rate else (total / seconds if seconds else 0.0)
        duration = total / fps if fps else seconds  # vLLM's: frames / frame rate
        return total, fps, duration


def _decode(data: bytes, wanted: list[int], fps: float, max_pixels: int, param: str) -> list[VideoFrame]:
    keep = set(wanted)
    last = wanted[-1]
    frames: list[VideoFrame] = []
    first_time: float | None = None
    with _open(data) as container:
        stream = container.streams.video[0]
        for index, frame in enumerate(container.decode(stream)):
            if index == 0:
                first_time = frame.time
            _check_size(frame.width, frame.height, max_pixels, param)
            if index in keep:
                if frame.time is not None and first_time is not None:
                    timestamp = max(0.0, frame.time - first_time)
                else:
                    timestamp = index / fps if fps else 0.0
                image = frame.to_image()  # RGB, rows without padding
                frames.append(VideoFrame(index=index, timestamp_s=round(timestamp, 6), width=image.width,
                                         height=image.height, rgb=image.tobytes()))
            if index >= last:
                break
    return frames


def _check_size(width: int, height: int, max_pixels: int, param: str) -> None:
    if width * height > max_pixels:
        raise invalid(f"The video's frames are {width}x{height} = {width * height} pixels; the limit "
                      f"is {max_pixels} pixels.", param=param, code="video_too_large")
