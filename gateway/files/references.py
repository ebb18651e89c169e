"""A request's parts that name uploaded files (`file_id`: the Responses API's input_image,
chat's file part) → the images the uploads stored, as the media loader takes them
(gateway/media/loader.py `FileImages`).

    images = await FileReferences(client, keys, media_ttl_s).recall(scope, parts)
    # → [LoadedImage(content_hash, width, height, mime, param), ...], in the parts' order

One round trip reads every part's record (`RedisKeys.file(scope, id)`); a second refreshes
each image's media item for --media-ttl-s (never shortening it: `PEXPIRE GT`, the file's
own upload set it to the file's lifetime) and checks it is there. The first part whose id
names no file here -- never uploaded with this API key, deleted, expired, or not an id of
ours -- is a 400 `file_not_found` naming it, before anything is fetched or queued. A part by
file is then exactly the image sent inline: the same content hash, the same prompt, so the
worker's encoder cache and the prefix cache hit.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.errors import OpenAIError, invalid
from gateway.files.models import FileRecord, is_file_id, record_decoder
from gateway.media.loaded import LoadedImage, MediaPart
from gateway.media.store import store_unreachable
from proto.keys import RedisKeys


def not_found(part: MediaPart, why: str) -> OpenAIError:
    return invalid(f"No file {part.file_id!r} is here: {why}. Upload the image again (POST /v1/files) or "
                   "send it in the request itself.", param=part.param, code="file_not_found")


class FileReferences:
    def __init__(self, client: aioredis.Redis, keys: RedisKeys, media_ttl_s: float):
        self._client = client
        self._keys = keys
        self._media_ttl_ms = max(1, int(media_ttl_s * 1000))

    async def recall(self, scope: str, parts: Sequence[MediaPart]) -> list[LoadedImage]:
        """The image each part's file_id names in `scope`; a 400 `file_not_found` for the
        first that names none."""
        if not parts:
            return []
        for part in parts:
            if part.file_id is None or not is_file_id(part.file_id):
                raise not_found(part, "it is not the id of a file this server made")
        try:
            values = await self._client.mget([self._keys.file(scope, p.file_id) for p in parts])
            records = [self._record(part, value) for part, value in zip(parts, values)]
            async with self._client.pipeline(transaction=False) as pipe:
                for record in records:
                    pipe.pexpire(self._keys.media(record.content_hash), self._media_ttl_ms, gt=True)
                    pipe.exists(self._keys.media(record.content_hash))
                alive = (await pipe.execute())[1::2]
        except (RedisError, OSError) as exc:
            raise store_unreachable("file", exc) from exc
        for part, there in zip(parts, alive):
            if not there:
                raise not_found(part, "its image is no longer stored")
        return [LoadedImage(r.content_hash, r.width, r.height, r.mime, part.param) for r, part in zip(records, parts)]

    @staticmethod
    def _record(part: MediaPart, value: bytes | None) -> FileRecord:
        if value is None:
            raise not_found(part, "it was never uploaded (with this API key), or it was deleted, or it expired")
        try:
            return record_decoder.decode(value)
        except (msgspec.DecodeError, msgspec.ValidationError):
            raise not_found(part, "its record is unreadable") from None
