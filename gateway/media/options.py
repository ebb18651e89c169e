"""The media flags that take JSON, with vLLM's syntax, parsed and checked.

`--limit-mm-per-prompt '{"image": 8, "video": 1}'`: the most items of each kind one prompt
may carry. A kind may also be given as `{"count": N, ...}` (vLLM's newer form; the other
keys size vLLM's profiling and are ignored here). 0 turns a kind off; a kind the JSON
leaves out keeps its default (DEFAULT_LIMITS).

`--media-io-kwargs '{"video": {"num_frames": 32, "fps": 2}}'`: how a video is sampled
(gateway/media/video.py): `num_frames` (-1: no limit) and `fps` (<= 0: off); when both
are set the smaller number of frames wins, as in vLLM's video loader. Other kinds and keys
are refused, so a misspelt flag fails at startup rather than being ignored.

Stdlib only: gateway/config.py uses these as argparse types (a bad value is a bad flag).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MEDIA_KINDS = ("image", "video")
DEFAULT_LIMITS: Mapping[str, int] = {"image": 8, "video": 1}
DEFAULT_NUM_FRAMES = 32  # vLLM's VideoMediaIO default


@dataclass(frozen=True)
class VideoSampling:
    """Which frames of a video are kept: evenly spaced over the whole video, as many as
    min(num_frames, floor(duration * fps), total frames), at least one."""

    num_frames: int = DEFAULT_NUM_FRAMES  # -1: no limit of its own
    fps: float = -1.0  # frames per second of video kept; <= 0: off

    def __post_init__(self) -> None:
        if self.num_frames == 0 or self.num_frames < -1:
            raise ValueError(f"num_frames must be a positive number of frames or -1, not {self.num_frames}")

    def count(self, total_frames: int, duration_s: float) -> int:
        """How many of `total_frames` frames (lasting `duration_s`) to keep."""
        keep = total_frames
        if self.num_frames > 0:
            keep = min(keep, self.num_frames)
        if self.fps > 0:
            keep = min(keep, int(duration_s * self.fps))
        return max(1, keep)

    def indices(self, total_frames: int, duration_s: float) -> list[int]:
        """The kept frames' indices, ascending: numpy's `linspace(0, total - 1, n, dtype=int)`
        (what vLLM's loader takes), without numpy."""
        keep = self.count(total_frames, duration_s)
        if keep >= total_frames:
            return list(range(total_frames))
        if keep == 1:
            return [0]
        step = (total_frames - 1) / (keep - 1)
        return [int(i * step) for i in range(keep - 1)] + [total_frames - 1]  # the end exactly


def parse_limits(text: str) -> dict[str, int]:
    """`--limit-mm-per-prompt`'s JSON → {kind: most items per prompt}, defaults filled in."""
    spec = _json_object(text, "--limit-mm-per-prompt")
    limits = dict(DEFAULT_LIMITS)
    for kind, value in spec.items():
        if isinstance(value, Mapping):
            value = value.get("count")
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"--limit-mm-per-prompt: {kind!r} must be a count >= 0 "
                             f"(or {{\"count\": N}}), not {value!r}")
        limits[kind] = value
    return limits


def parse_video_sampling(text: str) -> VideoSampling:
    """`--media-io-kwargs`'s JSON → the VideoSampling it sets (vLLM's defaults otherwise)."""
    spec = _json_object(text, "--media-io-kwargs")
    unknown = set(spec) - set(MEDIA_KINDS)
    if unknown:
        raise ValueError(f"--media-io-kwargs: unknown media kind(s) {sorted(unknown)}; "
                         f"expected {list(MEDIA_KINDS)}")
    image = spec.get("image", {})
    if not isinstance(image, Mapping) or image:
        raise ValueError("--media-io-kwargs: images take no options here")
    video = spec.get("video", {})
    if not isinstance(video, Mapping):
        raise ValueError("--media-io-kwargs: 'video' must be an object like {\"num_frames\": 32, \"fps\": 2}")
    unknown = set(video) - {"num_frames", "fps"}
    if unknown:
        raise ValueError(f"--media-io-kwargs: unknown video option(s) {sorted(unknown)}; "
                         "expected num_frames, fps")
    num_frames = video.get("num_frames", DEFAULT_NUM_FRAMES)
    fps = video.get("fps", -1.0)
    if not isinstance(num_frames, int) or isinstance(num_frames, bool):
        raise ValueError(f"--media-io-kwargs: video num_frames must be an integer, not {num_frames!r}")
    if not isinstance(fps, (int, float)) or isinstance(fps, bool):
        raise ValueError(f"--media-io-kwargs: video fps must be a number, not {fps!r}")
    try:
        return VideoSampling(num_frames=num_frames, fps=float(fps))
    except ValueError as exc:
        raise ValueError(f"--media-io-kwargs: video {exc}") from None


def limits_arg(text: str) -> str:
    """argparse type of --limit-mm-per-prompt: the text, once it parses."""
    return _checked(parse_limits, text)


def media_io_kwargs_arg(text: str) -> str:
    """argparse type of --media-io-kwargs: the text, once it parses."""
    return _checked(parse_video_sampling, text)


def _checked(parse: Any, text: str) -> str:
    try:
        parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _json_object(text: str, flag: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag}: expected a JSON object, not {text!r}")
    return value
