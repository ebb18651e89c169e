"""Reading the schedulers' heartbeats: which schedulers are alive, and what they report.

A scheduler (scheduler_svc/heartbeat.py) keeps its msgpack `SchedulerHeartbeat` under
`keys.scheduler(id)` with a TTL it refreshes, and its id in the set `keys.schedulers`. An
id whose key is gone has expired (the scheduler died or stalled); reading drops it from
the set, and a heartbeat that resumes adds it back. The gateway's readiness and admission
(gateway/readiness.py) read it here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import msgspec
import redis.asyncio as aioredis

from proto.keys import RedisKeys
from proto.messages import SchedulerHeartbeat, heartbeat_decoder

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerRegistry:
    keys: RedisKeys

    async def read(self, client: aioredis.Redis) -> list[SchedulerHeartbeat]:
        """The heartbeats of live schedulers, in id order."""
        ids = sorted(m.decode() if isinstance(m, bytes) else m
                     for m in await client.smembers(self.keys.schedulers))
        if not ids:
            return []
        values = await client.mget([self.keys.scheduler(i) for i in ids])
        live, expired = [], []
        for scheduler_id, value in zip(ids, values):
            if value is None:
                expired.append(scheduler_id)
                continue
            try:
                live.append(heartbeat_decoder.decode(value))
            except msgspec.DecodeError:  # another version's message
                log.warning("scheduler %s has an undecodable heartbeat; ignored", scheduler_id)
        if expired:
            await client.srem(self.keys.schedulers, *expired)
        return live
