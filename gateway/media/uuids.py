"""Media by uuid (vLLM's per-part `uuid`): a client sends an image or a video once with its
uuid, and later parts name it by the uuid alone, without data -- a camera client asks
several questions about a frame it uploaded once.

    {"type": "image_url", "image_url": {"url": "data:..."}, "uuid": "cam0-frame-17"}  # sends it
    {"type": "image_url", "image_url": null, "uuid": "cam0-frame-17"}                # names it

A part with data is loaded as any (its content hash computed from its bytes), and the
gateway then records uuid → what it loaded to (`MediaRecord`: an image's content hash and
size; a video's sampled frames, their hashes and times) under
`RedisKeys.media_uuid(scope, kind, uuid)`, with the media items' TTL (`--media-ttl-s`). A part
without data is that record, read back: no fetch, no decode, the same hashes, hence the same
prompt, the same encoder-cache entries and the same prefix-cache keys downstream. Reading
it refreshes the TTL of the record and of every item it names (`GETEX`, then `PEXPIRE GT`s),
as storing media again does; a record whose uuid was never sent, or whose record or items
expired, is a 400 `media_not_found` at once.

Semantics, as a cache's: the newest data sent under a uuid wins (a part with data always
rewrites the record); within one request, a part without data takes what a part with data
under the same uuid in that request loaded to (the last such part). A video named by uuid
is the frames sampled when it was sent: that request's `media_io_kwargs`, not this one's.

Trust: vLLM's uuids are the client's word, global to a server. Here they are scoped
(`media_scope`): when the gateway has API keys, by the key of the request (a SHA-256 of it
in the Redis key), so a client can neither name nor overwrite media another key sent;
without keys, every client shares one scope, as on vLLM, and any client that can reach the
gateway can read (ask about) or replace what another sent under a uuid it knows. The uuid
never stands for content the gateway did not see: a part with data is hashed from its bytes.
Image and video uuids are apart (an image part never names a video).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.errors import OpenAIError, invalid
from gateway.media.loaded import LoadedFrame, LoadedImage, LoadedMedia, LoadedVideo, MediaPart, content_hashes
from gateway.media.store import store_unreachable
from proto.keys import RedisKeys

SHARED_SCOPE = "shared"  # a gateway without API keys: every client's uuids together


def media_scope(authorization: str | None, keyed: bool) -> str:
    """The uuid scope of a request: its API key's (hashed) when the gateway has keys (the
    key is checked before a route runs), else the one shared scope."""
    if not keyed:
        return SHARED_SCOPE
    _, _, token = (authorization or "").partition(" ")
    return "key-" + hashlib.sha256(token.strip().encode()).hexdigest()[:32]


class FrameRecord(msgspec.Struct, frozen=True, array_like=True):
    content_hash: str
    width: int
    height: int
    timestamp_s: float
    index: int


class ImageRecord(msgspec.Struct, frozen=True, tag="image"):
    content_hash: str
    width: int
    height: int
    mime: str


class VideoRecord(msgspec.Struct, frozen=True, tag="video"):
    frames: tuple[FrameRecord, ...]
    total_frames: int
    fps: float
    duration_s: float


MediaRecord = ImageRecord | VideoRecord
_decoder = msgspec.msgpack.Decoder(MediaRecord)
_encoder = msgspec.msgpack.Encoder()


def record_of(loaded: LoadedMedia) -> MediaRecord:
    """What a later part by uuid needs of `loaded` (not where it was in its request)."""
    if isinstance(loaded, LoadedImage):
        return ImageRecord(loaded.content_hash, loaded.width, loaded.height, loaded.mime)
    return VideoRecord(tuple(FrameRecord(f.content_hash, f.width, f.height, f.timestamp_s, f.index)
                             for f in loaded.frames), loaded.total_frames, loaded.fps, loaded.duration_s)


def loaded_from(record: MediaRecord, part: MediaPart) -> LoadedMedia:
    """`record` as the part `part` loads to."""
    if isinstance(record, ImageRecord):
        return LoadedImage(record.content_hash, record.width, record.height, record.mime, part.param, part.uuid)
    return LoadedVideo(tuple(LoadedFrame(f.content_hash, f.width, f.height, f.timestamp_s, f.index)
                             for f in record.frames), record.total_frames, record.fps, record.duration_s,
                       part.param, part.uuid)


def not_found(part: MediaPart, why: str) -> OpenAIError:
    return invalid(f"No {part.kind} is known by uuid {part.uuid!r}: {why}. Send it again with its data "
                   f"(and the uuid); media sent with a uuid are kept for --media-ttl-s after their last use.",
                   param=part.param, code="media_not_found")


class MediaUUIDs:
    """The uuid records of one gateway's media, in Redis with the media's TTL."""

    def __init__(self, client: aioredis.Redis, keys: RedisKeys, ttl_s: float):
        if ttl_s <= 0:
            raise ValueError(f"media TTL must be positive, not {ttl_s}")
        self._client = client
        self._keys = keys
        self._ttl_ms = max(1, int(ttl_s * 1000))

    def _key(self, scope: str, part: MediaPart) -> str:
        assert part.uuid is not None
        return self._keys.media_uuid(scope, part.kind, part.uuid)

    async def remember(self, scope: str, sent: Sequence[tuple[MediaPart, LoadedMedia]]) -> None:
        """Record each part's uuid → what it loaded to (its items were just stored, so their
        TTL starts with the record's); a uuid sent before now names this."""
        if not sent:
            return
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                for part, loaded in sent:
                    pipe.set(self._key(scope, part), _encoder.encode(record_of(loaded)), px=self._ttl_ms)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            raise store_unreachable("media", exc) from exc

    async def recall(self, scope: str, parts: Sequence[MediaPart]) -> list[LoadedMedia]:
        """What each part (by uuid) names, its TTLs refreshed; the first unknown or expired
        one is a 400 `media_not_found`."""
        if not parts:
            return []
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                for part in parts:
                    pipe.getex(self._key(scope, part), px=self._ttl_ms)
                values = await pipe.execute()
            records = [self._decode(part, value) for part, value in zip(parts, values)]
            hashes = [content_hashes(loaded_from(r, p)) for r, p in zip(records, parts)]
            async with self._client.pipeline(transaction=False) as pipe:
                for h in (h for item in hashes for h in item):  # never shortened (an uploaded file's)
                    pipe.pexpire(self._keys.media(h), self._ttl_ms, gt=True)
                    pipe.exists(self._keys.media(h))
                alive = iter((await pipe.execute())[1::2])
        except (RedisError, OSError) as exc:
            raise store_unreachable("media", exc) from exc
        for part, item in zip(parts, hashes):
            if not all([next(alive) for _ in item]):  # every frame's answer taken, in order
                raise not_found(part, "its media expired")
        return [loaded_from(record, part) for record, part in zip(records, parts)]

    @staticmethod
    def _decode(part: MediaPart, value: bytes | None) -> MediaRecord:
        if value is None:
            raise not_found(part, "none was sent with it, or it expired")
        try:
            return _decoder.decode(value)
        except (msgspec.DecodeError, msgspec.ValidationError):
            raise not_found(part, "its record is unreadable") from None
