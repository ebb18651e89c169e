"""Reading the schedulers' heartbeats: which schedulers are alive, and what they report.

A scheduler (scheduler_svc/heartbeat.py) keeps its msgpack `SchedulerHeartbeat` under
`keys.scheduler(id)` with a TTL it refreshes, and its id in the set `keys.schedulers`. An
id whose key is gone has expired (the scheduler died or stalled); reading drops it from
the set, and a heartbeat that resumes adds it back. The gateway's readiness and admission
(gateway/readiness.py) read it here.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from proto.keys import RedisKeys
from proto.live_set import LiveSet
from proto.messages import SchedulerHeartbeat, heartbeat_decoder


@dataclass(frozen=True)
class SchedulerRegistry:
    keys: RedisKeys

    async def read(self, client: aioredis.Redis) -> list[SchedulerHeartbeat]:
        """The heartbeats of live schedulers, in id order."""
        return await LiveSet(self.keys.schedulers, self.keys.scheduler, heartbeat_decoder, "scheduler").read(client)
