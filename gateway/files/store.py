"""The Files API's storage: an upload checked and stored, and the routes' reads and deletes,
all per scope (the API key's, as media uuids: gateway/media/uuids.py `media_scope`).

    store = FileStore(redis_client, RedisKeys(prefix), FileSettings.from_config(config))
    record = await store.create(scope, upload)     # FileRecord; 400 / 413 / 429
    await store.get(scope, file_id)                # FileRecord | None
    await store.list_files(scope, purpose=..., limit=..., order=..., after=...)  # FileList
    await store.content(scope, file_id)            # (bytes, mime) | None
    await store.delete(scope, file_id)             # bool

An upload is an image, checked as an inline image is (gateway/media/images.py: a format we
take, the pixel cap, a full decode; each failure a 400 naming `file`), then admitted into
the ledger (gateway/files/ledger.py: the record, its scope's index, the bytes of all files
under --max-file-storage-bytes; over it a 429 `file_storage_full` with Retry-After: when
enough stored files will have expired), then stored as the `MediaItem` the same bytes sent
inline make (gateway/media/store.py), for at least as long as the file lives: the record
points at its content hash. Deleting a file deletes its record; the media item, shared by
content hash with any request that sent the same bytes, expires on its own TTL.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from dataclasses import dataclass
from typing import Literal

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.config import GatewayConfig
from gateway.errors import OpenAIError
from gateway.files.ledger import FileLedger
from gateway.files.models import FileList, FileRecord, is_file_id, new_file_id, record_decoder
from gateway.files.upload import FileUpload
from gateway.media.images import check_image
from gateway.media.store import MediaStore, content_hash, store_unreachable
from proto.keys import RedisKeys


@dataclass(frozen=True)
class FileSettings:
    """GatewayConfig's fields the Files API reads."""

    ttl_s: float = 3600.0  # --file-ttl-s: how long a file lives (at most)
    max_file_bytes: int = 20 * 2**20  # --max-media-bytes: one file
    max_storage_bytes: int = 2**30  # --max-file-storage-bytes: all files together
    max_image_pixels: int = 2**25  # --max-image-pixels
    media_ttl_s: float = 3600.0  # --media-ttl-s: the media store's own TTL

    @classmethod
    def from_config(cls, config: GatewayConfig) -> FileSettings:
        settings = cls(ttl_s=config.file_ttl_s, max_file_bytes=config.max_media_bytes,
                       max_storage_bytes=config.max_file_storage_bytes, max_image_pixels=config.max_image_pixels,
                       media_ttl_s=config.media_ttl_s)
        if settings.ttl_s <= 0 or settings.max_storage_bytes <= 0:
            raise ValueError(f"gateway file settings: --file-ttl-s ({settings.ttl_s}) and "
                             f"--max-file-storage-bytes ({settings.max_storage_bytes}) must be positive")
        return settings


class FileStore:
    def __init__(self, client: aioredis.Redis, keys: RedisKeys, settings: FileSettings,
                 media: MediaStore | None = None, decode_threads: int | None = None):
        """`media`: where images go (by default a store of the media TTL over `client`)."""
        self.settings = settings
        self._client = client
        self._keys = keys
        self.media = media or MediaStore(client, keys, settings.media_ttl_s)
        self.ledger = FileLedger(client, keys, settings.max_storage_bytes)
        self._decoding = asyncio.Semaphore(decode_threads or min(4, os.cpu_count() or 1))

    async def create(self, scope: str, upload: FileUpload) -> FileRecord:
        """Check, admit and store an upload; its record."""
        size = len(upload.data)
        if size > self.settings.max_storage_bytes:
            raise OpenAIError(413, f"The file is {size} bytes, more than all files may take together "
                                   f"({self.settings.max_storage_bytes} bytes, --max-file-storage-bytes).",
                              param="file", code="file_too_large")
        async with self._decoding:
            image = await asyncio.to_thread(check_image, upload.data, max_pixels=self.settings.max_image_pixels,
                                            param="file")
        item = image.item()
        now = time.time()
        now_ms = int(now * 1000)
        expires_ms = now_ms + max(1, int(upload.ttl_s * 1000))
        record = FileRecord(id=new_file_id(now), bytes=size, created_at=int(now), expires_at=expires_ms // 1000,
                            filename=upload.filename, purpose=upload.purpose, content_hash=content_hash(item),
                            width=image.width, height=image.height, mime=image.mime)
        try:
            admission = await self.ledger.admit(scope, record, now_ms, expires_ms)
        except (RedisError, OSError) as exc:
            raise store_unreachable("file", exc) from exc
        if not admission.admitted:
            retry = admission.retry_after_s or math.ceil(self.settings.ttl_s)
            raise OpenAIError(429, f"The file storage is full: stored files take {admission.stored_bytes} of "
                                   f"{self.settings.max_storage_bytes} bytes (--max-file-storage-bytes), and this "
                                   f"file is {size}. Delete files you no longer need, or retry after {retry} s, "
                                   "when enough will have expired.", type="insufficient_quota",
                              code="file_storage_full", headers={"Retry-After": str(retry)})
        try:  # for as long as the file lives, at least (a TTL the media store never shortens)
            await self.media.put(item, ttl_s=max(self.settings.media_ttl_s, upload.ttl_s))
        except OpenAIError:
            await self._forget(scope, record)
            raise
        return record

    async def _forget(self, scope: str, record: FileRecord) -> None:
        try:
            await self.ledger.drop(scope, record)
        except (RedisError, OSError):
            pass  # Redis is away: the record expires with its TTL

    async def get(self, scope: str, file_id: str) -> FileRecord | None:
        """The file's record; None when no such file is here (never uploaded in this scope,
        deleted, expired, or not an id of ours)."""
        if not is_file_id(file_id):
            return None
        try:
            value = await self._client.get(self._keys.file(scope, file_id))
        except (RedisError, OSError) as exc:
            raise store_unreachable("file", exc) from exc
        return None if value is None else record_decoder.decode(value)

    async def list_files(self, scope: str, *, purpose: str | None = None, limit: int = 10000,
                   order: Literal["asc", "desc"] = "desc", after: str | None = None) -> FileList:
        """The scope's files in upload order (`desc`: newest first), after the file `after`
        names (its place in that order, even if it is gone), at most `limit`."""
        try:
            ids = sorted(await self.ledger.file_ids(scope), reverse=order == "desc")
            if after is not None:
                ids = [i for i in ids if (i > after if order == "asc" else i < after)]
            values = await self._client.mget([self._keys.file(scope, i) for i in ids]) if ids else []
        except (RedisError, OSError) as exc:
            raise store_unreachable("file", exc) from exc
        records = [record_decoder.decode(v) for v in values if v is not None]
        if purpose is not None:
            records = [r for r in records if r.purpose == purpose]
        page = [r.file_object() for r in records[:limit]]
        return FileList(data=page, first_id=page[0].id if page else None, last_id=page[-1].id if page else None,
                        has_more=len(records) > limit)

    async def content(self, scope: str, file_id: str) -> tuple[bytes, str] | None:
        """The file's bytes, as uploaded, and their MIME type; None when there is no such file."""
        record = await self.get(scope, file_id)
        if record is None:
            return None
        try:
            item = await self.media.get(record.content_hash)
        except (RedisError, OSError) as exc:
            raise store_unreachable("file", exc) from exc
        return None if item is None else (item.data, record.mime)

    async def delete(self, scope: str, file_id: str) -> bool:
        """Delete the file; False when there is no such file."""
        record = await self.get(scope, file_id)
        if record is None:
            return False
        try:
            return await self.ledger.drop(scope, record)
        except (RedisError, OSError) as exc:
            raise store_unreachable("file", exc) from exc
