"""Reading the encoder services' counters: what the gateway's /metrics shows of each live
encoder beside the workers' WorkerStats.

An encoder (encoder_svc/service.py) keeps its id in the set `keys.encoders` and, with every
heartbeat, its msgpack `EncoderRegistration` under `keys.encoder(id)` and its `EncoderStats`
under `keys.encoder_stats(id)`, both with the registration's TTL: an id whose stats key is
gone is an encoder that stopped or died, and is left out.

    stats = await EncoderRegistry(keys).stats(client)   -> [EncoderStats], in id order
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from proto.encoder_messages import EncoderStats, encoder_stats_decoder
from proto.keys import RedisKeys
from proto.live_set import LiveSet


@dataclass(frozen=True)
class EncoderRegistry:
    keys: RedisKeys

    async def stats(self, client: aioredis.Redis) -> list[EncoderStats]:
        """The latest EncoderStats of every live encoder (one SMEMBERS, one MGET); the set is
        the registrations' too, so nothing is pruned here."""
        return await LiveSet(self.keys.encoders, self.keys.encoder_stats, encoder_stats_decoder,
                             "encoder").read(client, prune=False)
