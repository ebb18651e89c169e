"""proto.registry.WorkerRegistry against a real Redis: the one reader of the worker
registry, through the asyncio client (scheduler, gateway) and the blocking one (launcher)."""

import asyncio
import time
import uuid

import redis
import redis.asyncio as aioredis

from proto.keys import RedisKeys
from proto.messages import WorkerRegistration, stream_encoder
from proto.registry import WorkerRegistry


def registration(worker_id: str) -> WorkerRegistration:
    return WorkerRegistration(worker_id=worker_id, address=f"{worker_id}:1", model="m", block_size=16,
                              num_blocks=64, max_model_len=256, started_at=time.time())


def test_live_expired_and_undecodable_registrations(redis_url):
    keys = RedisKeys(f"test-registry-{uuid.uuid4().hex[:8]}")
    registry = WorkerRegistry(keys)
    client = redis.Redis.from_url(redis_url)
    try:
        for worker_id in ("w-b", "w-a"):
            client.set(keys.worker(worker_id), stream_encoder.encode(registration(worker_id)), ex=60)
        client.set(keys.worker("w-garbage"), b"not msgpack of a registration", ex=60)
        client.sadd(keys.workers, "w-b", "w-a", "w-garbage", "w-expired")  # w-expired: no key

        snapshot = registry.read_blocking(client)
        assert list(snapshot.live) == ["w-a", "w-b"]  # in id order; the garbage one ignored
        assert [r.address for r in snapshot.live.values()] == ["w-a:1", "w-b:1"]
        assert snapshot.expired == ["w-expired"]

        async def read_and_forget():
            aclient = aioredis.Redis.from_url(redis_url)
            try:
                seen = await registry.read(aclient)
                await registry.forget(aclient, seen.expired)
                return seen
            finally:
                await aclient.aclose()

        assert asyncio.run(read_and_forget()) == snapshot
        assert {m.decode() for m in client.smembers(keys.workers)} == {"w-a", "w-b", "w-garbage"}
        assert registry.read_blocking(client).expired == []
    finally:
        client.delete(keys.workers, *(keys.worker(w) for w in ("w-a", "w-b", "w-garbage")))
        client.close()
