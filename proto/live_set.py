"""Who is alive, as Redis keeps it: an id in a set, and per id one msgpack record under a key
with a TTL its owner refreshes. An id whose key is gone belongs to an owner that stopped or
died. Schedulers' heartbeats (proto/scheduler_registry.py), encoders' stats
(proto/encoder_registry.py) and gateways' own metrics (gateway/gateway_metrics_peers.py) are
read this way.

    live = await LiveSet(keys.schedulers, keys.scheduler, heartbeat_decoder, "scheduler").read(client)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import msgspec
import redis.asyncio as aioredis

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LiveSet:
    members: str  # the set of ids
    key_of: Callable[[str], str]  # an id's record key
    decoder: msgspec.msgpack.Decoder
    what: str  # the owners, for the log: "scheduler", "encoder", ...

    async def read(self, client: aioredis.Redis, *, prune: bool = True,
                   exclude: Collection[str] = ()) -> list[Any]:
        """The records of the live ids (not those in `exclude`), in id order: one SMEMBERS, one
        MGET. `prune`: ids whose record expired leave the set (an owner that resumes adds
        itself back); off where the set is another record's too. A record that does not
        decode (another version's) is left out, with a warning."""
        ids = sorted(m.decode() if isinstance(m, bytes) else m for m in await client.smembers(self.members))
        ids = [i for i in ids if i not in exclude]
        if not ids:
            return []
        live, expired = [], []
        for owner, value in zip(ids, await client.mget([self.key_of(i) for i in ids])):
            if value is None:
                expired.append(owner)
                continue
            try:
                live.append(self.decoder.decode(value))
            except msgspec.DecodeError:
                log.warning("%s %s has an undecodable record; left out", self.what, owner)
        if prune and expired:
            await client.srem(self.members, *expired)
        return live
