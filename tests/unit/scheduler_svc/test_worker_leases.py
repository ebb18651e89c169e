"""Worker leases (scheduler_svc/worker_leases.py) in a real Redis: one shard at a time
drives a worker, tokens grow with every lease, a lost lease is noticed at renewal, and
the shards' shares and preferences."""

from __future__ import annotations

import asyncio
import uuid

import redis.asyncio as aioredis

from proto.keys import RedisKeys
from scheduler_svc.leader import shard_lease
from scheduler_svc.worker_leases import WorkerLeases, fair_share, preference


def test_shares_and_preferences():
    assert [fair_share(w, 2) for w in (0, 1, 2, 3, 4, 5)] == [0, 1, 1, 2, 2, 3]
    assert fair_share(256, 8) == 32 and fair_share(3, 0) == 3
    workers = [f"w{i}" for i in range(64)]
    firsts = {preference(shard, workers)[0] for shard in range(8)}
    assert len(firsts) >= 6  # shards start from different workers
    assert preference(3, workers) == preference(3, list(reversed(workers)))


def test_one_shard_holds_a_worker_and_the_next_owner_gets_a_higher_token(redis_url):
    async def main():
        keys = RedisKeys(f"test-leases-{uuid.uuid4().hex[:8]}")
        client = aioredis.Redis.from_url(redis_url)
        try:
            a, b = WorkerLeases(client, keys, 0, ttl_s=0.5), WorkerLeases(client, keys, 1, ttl_s=0.5)
            token = await a.acquire("w")
            assert token > 0 and a.token("w") == token and a.held == {"w"}
            assert await b.acquire("w") == 0  # shard 0 holds it
            # The scheduler that takes shard 0 over takes its workers at once, newer tokens.
            again = WorkerLeases(client, keys, 0, ttl_s=0.5)
            newer = await again.acquire("w")
            assert newer > token
            assert await a.renew() == ["w"] and a.held == frozenset()  # the old owner notices
            await again.release("w")
            taken = await b.acquire("w")
            assert taken > newer and await again.renew() == []
            # A stalled owner: its lease runs out, another takes it, renewal says it is lost.
            await asyncio.sleep(0.7)
            assert await a.acquire("w") > taken
            assert await b.renew() == ["w"]
            # Shard leases draw from the same counter.
            lease = shard_lease(client, keys, "s", 0.5, shard=3)
            assert await lease.acquire() and lease.token > a.token("w")
            assert (await client.get(keys.shard_lease(3))).decode() == f"s:{lease.token}"
            # A lease that ran out with no other owner since is taken back at renewal, though
            # other leases drew newer tokens meanwhile (Redis stalled past the TTL).
            shard0 = shard_lease(client, keys, "s0", 0.3, shard=0)
            assert await shard0.acquire()
            assert await WorkerLeases(client, keys, 0, ttl_s=5).acquire("w2") > shard0.token
            await asyncio.sleep(0.5)
            assert await client.get(keys.shard_lease(0)) is None
            await shard0.renew()  # no LeaseLost
            assert (await client.get(keys.shard_lease(0))).decode() == f"s0:{shard0.token}"
        finally:
            names = [k async for k in client.scan_iter(match=f"{keys.prefix}:*")]
            if names:
                await client.delete(*names)
            await client.aclose()

    asyncio.run(asyncio.wait_for(main(), 20))
