"""What the loader takes and gives: a request's media parts, and each one loaded (its content
hashes and what the prompt needs of it), in the parts' order.

    MediaPart("image", "data:image/png;base64,...", "messages[0].content[1].image_url.url")
    MediaPart("image", None, "messages[2].content[0].uuid", uuid="cam0-frame-17")  # by uuid
    MediaPart("image", None, "messages[3].content[0].file.file_id", file_id="file-...")  # an uploaded file
    → LoadedImage(content_hash, width, height, mime, param, uuid)
    → LoadedVideo(frames=(LoadedFrame(content_hash, width, height, timestamp_s, index), ...), ...)

A part without data (`url` None) names media sent before under its `uuid`
(gateway/media/uuids.py); it loads to exactly what the part that sent them loaded to. One
with a `file_id` names an image uploaded through the Files API (gateway/files/): it loads
to what the upload stored, as the same image sent inline would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gateway.media.fetch import MediaKind


@dataclass(frozen=True)
class MediaPart:
    """One media content part of a request, as the preflight finds it."""

    kind: MediaKind
    url: str | None  # None: no data, the media sent before under `uuid`
    param: str  # where it is in the body, for errors: "messages[0].content[1].image_url.url"
    uuid: str | None = None
    file_id: str | None = None  # an uploaded file's id (no url, no uuid)

    @property
    def by_uuid(self) -> bool:
        """Whether the part names media sent before instead of carrying them."""
        return self.url is None and self.uuid is not None and self.file_id is None

    @property
    def by_file(self) -> bool:
        """Whether the part names an uploaded file (gateway/files/)."""
        return self.file_id is not None


@dataclass(frozen=True)
class LoadedImage:
    content_hash: str
    width: int
    height: int
    mime: str
    param: str
    uuid: str | None = None
    kind: Literal["image"] = "image"


@dataclass(frozen=True)
class LoadedFrame:
    """One kept frame of a video: an image of its own in the prompt, with its time."""

    content_hash: str
    width: int
    height: int
    timestamp_s: float  # from the video's first frame
    index: int  # among the video's frames


@dataclass(frozen=True)
class LoadedVideo:
    frames: tuple[LoadedFrame, ...]
    total_frames: int
    fps: float
    duration_s: float
    param: str
    uuid: str | None = None
    kind: Literal["video"] = "video"


LoadedMedia = LoadedImage | LoadedVideo


def content_hashes(loaded: LoadedMedia) -> tuple[str, ...]:
    """The items in Redis that `loaded` stands for: an image's one, a video's frames'."""
    return (loaded.content_hash,) if isinstance(loaded, LoadedImage) else tuple(f.content_hash for f in loaded.frames)
