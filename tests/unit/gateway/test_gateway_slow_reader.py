"""A client that stops reading its stream: its request is aborted once `--max-unread-events`
token events wait unread (its blocks freed, the gateway's memory per stream bounded), and
other streams go on meanwhile. Here the gateway's backend with a full queue; with a real stack
(tiny model) and a raw socket that never reads: tests/e2e/test_e2e_slow_reader.py."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from gateway.backend import RedisBackend
from proto.keys import STREAM_FIELD, RedisKeys
from proto.messages import AbortRequest, TokenEvent, stream_decoder


def test_a_full_queue_aborts_its_request_and_keeps_only_the_reason(redis_url):
    keys = RedisKeys("slow-reader-unit")

    async def scenario():
        backend = RedisBackend(redis_url, keys, max_unread_events=4)
        try:
            queue = backend.open(["r1"])
            other = backend.open(["r2"])
            backend._open["r1"] = type("Sent", (), {"shard": 3})()  # what submit() records
            backend.deliver([TokenEvent("r1", index=i, token_ids=[i]) for i in range(4)])
            assert queue.qsize() == 4
            backend.deliver([TokenEvent("r2", index=0, token_ids=[5]), TokenEvent("r1", index=4, token_ids=[4])])
            backend.deliver([TokenEvent("r1", index=5, token_ids=[5])])  # closed: dropped
            assert queue.qsize() == 1 and other.qsize() == 1
            reason = queue.get_nowait()
            assert reason.finish_reason == "abort" and "did not read its stream" in reason.error
            await asyncio.wait(backend._background, timeout=5)
            client = aioredis.Redis.from_url(redis_url)
            entries = await client.xrange(keys.shard_requests(3))
            await client.aclose()
            assert [stream_decoder.decode(e[STREAM_FIELD]) for _, e in entries] == [AbortRequest("r1")]
        finally:
            await backend.stop()

    asyncio.run(scenario())
