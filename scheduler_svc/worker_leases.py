"""The leases of the workers one scheduler shard drives, and how many it should drive.

A shard (scheduler_svc/shard.py) steps a worker only while it holds the worker's lease:
`<prefix>:worker-lease:<worker id>` = `"<shard>:<fencing token>"`, with a TTL the shard
renews every `ttl_s / 3` (scheduler_svc/leader.py's Lease; its tokens come from the
stack's one counter, so a worker's new owner always stamps a higher token than its old
one, and the worker refuses the old one's steps). The value names the shard, not the
scheduler: the scheduler that takes a shard over takes its workers at once, under new
tokens.

Sharing: with W live workers and L led shards, each shard drives about `ceil(W / L)`
(`fair_share`). A shard below its share leases free workers, in the order of a
rendezvous hash of (shard, worker id) -- shards prefer different workers, so they rarely
race for one; above it, it hands its least loaded worker over once that worker has
finished its requests (WorkerPool, scheduler_svc/worker_pool.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import redis.asyncio as aioredis

from proto.keys import RedisKeys
from proto.rendezvous import rendezvous_order
from scheduler_svc.leader import Lease, LeaseLost


def fair_share(num_workers: int, num_shards: int) -> int:
    """Workers one of `num_shards` led shards should drive out of `num_workers`."""
    return math.ceil(num_workers / max(1, num_shards))


def preference(shard: int, worker_ids: Iterable[str]) -> list[str]:
    """The workers in the order shard `shard` tries to lease them (rendezvous hashing)."""
    return rendezvous_order(f"{shard}:".encode(), worker_ids)


class WorkerLeases:
    def __init__(self, redis: aioredis.Redis, keys: RedisKeys, shard: int, ttl_s: float) -> None:
        self._redis, self._keys, self._shard, self._ttl_s = redis, keys, shard, ttl_s
        self._leases: dict[str, Lease] = {}  # worker id -> its lease, held

    def token(self, worker_id: str) -> int:
        """The fencing token of a held lease (0: not held)."""
        lease = self._leases.get(worker_id)
        return lease.token if lease else 0

    @property
    def held(self) -> frozenset[str]:
        return frozenset(self._leases)

    async def acquire(self, worker_id: str) -> int:
        """Lease the worker if no other shard holds it; its token, or 0."""
        lease = Lease(self._redis, self._keys.worker_lease(worker_id), self._keys.scheduler_epoch,
                      str(self._shard), self._ttl_s)
        if not await lease.acquire():
            return 0
        self._leases[worker_id] = lease
        return lease.token

    async def renew(self) -> list[str]:
        """Renew every held lease; the workers whose lease another shard holds now
        (forgotten here). Raises Redis errors (the caller retries at its next renewal)."""
        lost = []
        for worker_id, lease in list(self._leases.items()):
            try:
                await lease.renew()
            except LeaseLost:
                if self._leases.get(worker_id) is lease:  # not released meanwhile
                    del self._leases[worker_id]
                    lost.append(worker_id)
        return lost

    async def release(self, worker_id: str) -> None:
        """Give the worker's lease up (its handle left the pool): another shard may take it."""
        lease = self._leases.pop(worker_id, None)
        if lease is not None:
            try:
                await lease.release()
            except (aioredis.RedisError, OSError):
                pass  # its TTL frees it

    async def release_all(self) -> None:
        for worker_id in list(self._leases):
            await self.release(worker_id)
