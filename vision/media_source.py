"""Where the worker (and the encoder service) gets the media it must encode: the `MediaItem`s
the gateway stored under their content hashes (gateway/media/store.py), read synchronously
on the compute thread.

    MediaSource.fetch(hashes) -> {hash: MediaItem} for every hash asked, or raises
        MediaUnavailableError naming each hash it could not give and why (expired or never
        stored, not a MediaItem, the store unreachable), with the items it did get, so
        the caller fails only the requests that need the missing ones.
    RedisMediaSource   one MGET of `RedisKeys.media(hash)` for all of them, msgpack-decoded.

A worker without a media source (`ModelRunner(..., media=None)`: the in-process engine)
serves text only; a request with images there fails with an error event.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import msgspec
import redis

from proto.keys import RedisKeys
from proto.messages import MediaItem, media_item_decoder

MISSING = "not in the media store (expired, or never stored)"


class MediaUnavailableError(LookupError):
    """Some of the items asked for could not be had. `reasons`: content hash -> why;
    `found`: the items that were had, by content hash."""

    def __init__(self, reasons: Mapping[str, str], found: Mapping[str, MediaItem] | None = None):
        self.reasons = dict(reasons)
        self.found = dict(found or {})
        named = "; ".join(f"{h}: {why}" for h, why in self.reasons.items())
        super().__init__(f"{len(self.reasons)} media item(s) unavailable: {named}")


class MediaSource(Protocol):
    def fetch(self, hashes: Sequence[str]) -> dict[str, MediaItem]:
        """Every item of `hashes` (distinct content hashes) by its hash; MediaUnavailableError
        when any cannot be had."""
        ...


class RedisMediaSource:
    """The media store in Redis, read with redis-py's synchronous client (thread-safe; the
    compute thread calls it). A bounded socket timeout: a Redis that hangs fails the image
    requests of a step, not the worker."""

    def __init__(self, client: redis.Redis, keys: RedisKeys):
        self._client = client
        self._keys = keys

    @classmethod
    def from_url(cls, url: str, key_prefix: str, timeout_s: float = 5.0) -> RedisMediaSource:
        """Its own client on `url` (connect and read time out after `timeout_s`)."""
        client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        return cls(client, RedisKeys(key_prefix))

    @property
    def client(self) -> redis.Redis:
        return self._client

    @property
    def keys(self) -> RedisKeys:
        return self._keys

    def fetch(self, hashes: Sequence[str]) -> dict[str, MediaItem]:
        if not hashes:
            return {}
        try:
            values = self._client.mget([self._keys.media(h) for h in hashes])
        except (redis.RedisError, OSError) as exc:
            raise MediaUnavailableError({h: f"the media store is unreachable: {exc}" for h in hashes}) from exc
        found: dict[str, MediaItem] = {}
        reasons: dict[str, str] = {}
        for digest, value in zip(hashes, values):
            if value is None:
                reasons[digest] = MISSING
                continue
            try:
                found[digest] = media_item_decoder.decode(value)
            except msgspec.DecodeError as exc:
                reasons[digest] = f"the stored value is not a MediaItem: {exc}"
        if reasons:
            raise MediaUnavailableError(reasons, found)
        return found

    def close(self) -> None:
        self._client.close()
