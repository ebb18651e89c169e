"""Reading the worker registry: which workers are alive, and their registrations.

A worker registers (worker_svc/registration.py, `Registration`) by keeping its msgpack
`WorkerRegistration` under `keys.worker(id)` with a TTL its heartbeat refreshes, and its id
in the set `keys.workers`. An id whose key is gone has expired: the worker died or stalled
(a heartbeat that resumes adds both back). The scheduler, the gateway and the local
launcher all read it here, through an asyncio or a blocking redis-py client alike.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec
import redis
import redis.asyncio as aioredis

from proto.keys import RedisKeys
from proto.messages import WorkerRegistration, registration_decoder

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RegistrySnapshot:
    live: dict[str, WorkerRegistration]  # by worker id, in id order
    expired: list[str]  # ids in the set whose registration key is gone


@dataclass(frozen=True)
class WorkerRegistry:
    keys: RedisKeys

    async def read(self, client: aioredis.Redis) -> RegistrySnapshot:
        ids = _sorted_ids(await client.smembers(self.keys.workers))
        return self._decode(ids, await client.mget([self.keys.worker(i) for i in ids]) if ids else [])

    def read_blocking(self, client: redis.Redis) -> RegistrySnapshot:
        ids = _sorted_ids(client.smembers(self.keys.workers))
        return self._decode(ids, client.mget([self.keys.worker(i) for i in ids]) if ids else [])

    async def forget(self, client: aioredis.Redis, worker_ids: list[str]) -> None:
        """Drop expired ids from the set (a stalled worker's heartbeat adds its id back)."""
        if worker_ids:
            await client.srem(self.keys.workers, *worker_ids)

    @staticmethod
    def _decode(ids: list[str], values: Iterable[bytes | None]) -> RegistrySnapshot:
        live, expired = {}, []
        for worker_id, value in zip(ids, values):
            if value is None:
                expired.append(worker_id)
                continue
            try:
                live[worker_id] = registration_decoder.decode(value)
            except msgspec.DecodeError:  # another version's message: not a worker we can use
                log.warning("worker %s has an undecodable registration; ignored", worker_id)
        return RegistrySnapshot(live, expired)


def _sorted_ids(members: Iterable[bytes | str]) -> list[str]:
    return sorted(m.decode() if isinstance(m, bytes) else m for m in members)
