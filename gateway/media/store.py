"""Checked media in Redis, each item once under its content hash, for any worker to read.

`MediaStore.put(item)` writes a `MediaItem` (msgpack) to `RedisKeys.media(content_hash)`
with a TTL and returns the hash; the request then carries only the hash. Storing what is
there already costs one round trip and no upload: `PEXPIRE ... GT` first (the item exists: its
TTL starts again, so media in use do not expire under a request), and only when that finds
nothing `SET ... NX PX` (NX: two gateways storing the same bytes at once write it once).
A TTL is only ever lengthened (GT): an image uploaded as a file (gateway/files/) is stored
for as long as the file lives, which a later request sending the same bytes with the
shorter --media-ttl-s must not cut short.

Content hash (`content_hash`): sha256 hex of an encoded image's file bytes; of
`b"rgb8:<width>x<height>:" + pixels` for a raw frame (the header keeps two frames with the
same bytes but another shape apart). Equal content, equal hash, on every gateway.

Workers read the value of `RedisKeys.media(hash)` with `proto.messages.media_item_decoder`
(vision/media_source.py, one MGET for a step's items). A new item is announced to the
encoder service (gateway/media/encode_jobs.py: when one is live), which encodes it ahead of
the question.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.errors import OpenAIError
from gateway.media.encode_jobs import EncodeJobs
from proto.keys import RedisKeys
from proto.messages import MediaItem, media_item_decoder


def store_unreachable(store: str, exc: Exception) -> OpenAIError:
    """Redis, where `store` ("media", "file") keeps its items, did not answer: a 503, as for
    the rest of a request's admission."""
    return OpenAIError(503, f"The {store} store is unreachable: {exc}", code="redis_unavailable")


def content_hash(item: MediaItem) -> str:
    """The key an item is stored under: the same for the same content, everywhere."""
    if item.kind != "rgb8":
        return encoded_hash(item.data)
    digest = hashlib.sha256(f"rgb8:{item.width}x{item.height}:".encode())
    digest.update(item.data)
    return digest.hexdigest()


def encoded_hash(data: bytes) -> str:
    """`content_hash` of an "encoded" item (a file as it came) holding `data`."""
    return hashlib.sha256(data).hexdigest()


@dataclass
class StoreStats:
    """What one gateway's store did since it started (for its metrics)."""

    items_written: int = 0  # new items
    bytes_written: int = 0  # their encoded sizes
    items_reused: int = 0  # puts of an item Redis already held (TTL refreshed, nothing sent)


class MediaStore:
    def __init__(self, client: aioredis.Redis, keys: RedisKeys, ttl_s: float):
        if ttl_s <= 0:
            raise ValueError(f"media TTL must be positive, not {ttl_s}")
        self._client = client
        self._keys = keys
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._encoder = msgspec.msgpack.Encoder()
        self.stats = StoreStats()
        self.encode_jobs = EncodeJobs(client, keys)

    @property
    def client(self) -> aioredis.Redis:
        return self._client

    @property
    def keys(self) -> RedisKeys:
        return self._keys

    async def put(self, item: MediaItem, ttl_s: float | None = None) -> str:
        """Store `item` (or refresh the TTL of its stored copy, never shortening it); its
        content hash. `ttl_s`: this store's TTL unless given. Redis unreachable: a 503, as
        for the rest of a request's admission."""
        digest = content_hash(item)
        key = self._keys.media(digest)
        ttl_ms = self._ttl_ms if ttl_s is None else max(1, int(ttl_s * 1000))
        try:
            if await self._client.pexpire(key, ttl_ms, gt=True):
                self.stats.items_reused += 1
                return digest
            value = self._encoder.encode(item)
            if await self._client.set(key, value, nx=True, px=ttl_ms):
                self.stats.items_written += 1
                self.stats.bytes_written += len(value)
                await self.encode_jobs.announce([digest])
            else:  # there with a longer TTL, or another gateway stored it between the two commands
                await self._client.pexpire(key, ttl_ms, gt=True)
                self.stats.items_reused += 1
        except (RedisError, OSError) as exc:
            raise store_unreachable("media", exc) from exc
        return digest

    async def refresh(self, digest: str, ttl_s: float | None = None) -> bool:
        """Whether an item is stored under `digest`; its TTL refreshed (never shortened) if
        so. One round trip: what an item sent again costs."""
        ttl_ms = self._ttl_ms if ttl_s is None else max(1, int(ttl_s * 1000))
        key = self._keys.media(digest)
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.pexpire(key, ttl_ms, gt=True)  # 0 also where its TTL is longer already
                pipe.exists(key)
                _, exists = await pipe.execute()
        except (RedisError, OSError) as exc:
            raise store_unreachable("media", exc) from exc
        found = bool(exists)
        if found:
            self.stats.items_reused += 1
        return found

    async def get(self, digest: str) -> MediaItem | None:
        """The item stored under `digest`, None when absent or expired."""
        value = await self._client.get(self._keys.media(digest))
        return None if value is None else media_item_decoder.decode(value)

    async def ttl_s(self, digest: str) -> float | None:
        """Seconds the item has left, None when absent (for tests and diagnostics)."""
        ms = await self._client.pttl(self._keys.media(digest))
        return None if ms < 0 else ms / 1000
