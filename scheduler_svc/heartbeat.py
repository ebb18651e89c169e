"""The scheduler's heartbeat: a `SchedulerHeartbeat` under `keys.scheduler(id)` with a TTL,
refreshed every `interval_s`, its id in `keys.schedulers` (re-added by every beat).

It is the scheduler's health as the rest of the stack sees it: the gateway's readiness
(`/health/ready`) wants a live heartbeat naming at least one worker, and its admission
reads the waiting count and the bound (`--max-waiting-requests`) from it to answer 429
before enqueueing. From outside, `redis-cli EXISTS <prefix>:scheduler:<consumer name>` is
the scheduler's own liveness check (1 = alive), as is its `GET /health` on the metrics port.
A Redis error skips a beat, with a warning; the TTL covers the gap, and the next beat writes
it again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from proto.keys import RedisKeys
from proto.messages import SchedulerHeartbeat, ShardLoad, stream_encoder
from proto.outage_log import OutageLog

log = logging.getLogger("pagedserve.scheduler")


@dataclass(frozen=True)
class Load:
    """What the scheduler reports each beat."""

    worker_ids: list[str]
    num_waiting: int
    shards: list[ShardLoad] = field(default_factory=list)  # the shards it leads


class Heartbeat:
    def __init__(self, redis: aioredis.Redis, keys: RedisKeys, scheduler_id: str, *,
                 interval_s: float, ttl_s: float, max_waiting_requests: int,
                 load: Callable[[], Load]):
        self._redis, self._keys, self._id = redis, keys, scheduler_id
        self._interval_s, self._ttl_ms = interval_s, int(ttl_s * 1000)
        self._max_waiting = max_waiting_requests
        self._load = load
        self._outage = OutageLog(log, "heartbeat not written", "heartbeat written again")
        self.written_at: float | None = None  # time.monotonic() of the last beat Redis took
        self.written: Load | None = None  # what it said

    async def run(self) -> None:
        """Beat until cancelled."""
        while True:
            await self.beat()
            await asyncio.sleep(self._interval_s)

    async def beat(self) -> None:
        load = self._load()
        message = SchedulerHeartbeat(
            scheduler_id=self._id, worker_ids=load.worker_ids, num_waiting=load.num_waiting,
            max_waiting_requests=self._max_waiting, interval_s=self._interval_s, updated_at=time.time(),
            shards=load.shards)
        pipe = self._redis.pipeline(transaction=True)
        pipe.set(self._keys.scheduler(self._id), stream_encoder.encode(message), px=self._ttl_ms)
        pipe.sadd(self._keys.schedulers, self._id)
        try:
            await pipe.execute()
        except (aioredis.RedisError, OSError) as exc:
            self._outage.failed(exc)
            return
        self._outage.ok()
        self.written_at, self.written = time.monotonic(), load

    async def clear(self) -> None:
        """On a clean stop: say at once that this scheduler is gone."""
        try:
            pipe = self._redis.pipeline(transaction=True)
            pipe.delete(self._keys.scheduler(self._id))
            pipe.srem(self._keys.schedulers, self._id)
            await pipe.execute()
        except (aioredis.RedisError, OSError):
            pass  # the TTL removes it
