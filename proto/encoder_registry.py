"""Reading the encoder services' counters: what the gateway's /metrics shows of each live
encoder beside the workers' WorkerStats.

An encoder (encoder_svc/service.py) keeps its id in the set `keys.encoders` and, with every
heartbeat, its msgpack `EncoderRegistration` under `keys.encoder(id)` and its `EncoderStats`
under `keys.encoder_stats(id)`, both with the registration's TTL: an id whose stats key is
gone is an encoder that stopped or died, and is left out.

    stats = await EncoderRegistry(keys).stats(client)   -> [EncoderStats], in id order
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import msgspec
import redis.asyncio as aioredis

from proto.encoder_messages import EncoderStats, encoder_stats_decoder
from proto.keys import RedisKeys

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EncoderRegistry:
    keys: RedisKeys

    async def stats(self, client: aioredis.Redis) -> list[EncoderStats]:
        """The latest EncoderStats of every live encoder (one SMEMBERS, one MGET)."""
        ids = sorted(m.decode() if isinstance(m, bytes) else m for m in await client.smembers(self.keys.encoders))
        if not ids:
            return []
        out = []
        for encoder_id, value in zip(ids, await client.mget([self.keys.encoder_stats(i) for i in ids])):
            if value is None:
                continue
            try:
                out.append(encoder_stats_decoder.decode(value))
            except msgspec.DecodeError:  # another version's message
                log.warning("encoder %s has undecodable stats; left out", encoder_id)
        return out
