"""Routing a request after the encoder service has finished its media, not during.

A gateway marks a medium it announces to the encoder service QUEUED (`RedisKeys.encoding
(hash)`, 60 s at most: gateway/media/encode_jobs.py); the encoder (encoder_svc/) that takes
it claims it for --claim-ttl-s and gives the claim up once its embeddings are published. A
request whose media are marked, routed now, would reach its worker before the embeddings
and be encoded there a second time, on the question's path; waiting for the marks to go
costs the question at most the rest of that encoding, and the worker then finds the
embeddings published. A medium still only QUEUED after `queued_wait_s` (1 s: the encoders
are behind, or none is left) is not waited for: the worker takes it over from the queue,
encodes and publishes it, and the encoder skips it when it gets there.

    wait = EncodingWait(client, keys)
    await wait.pending(hashes)   -> whether any of them is being encoded now (one EXISTS)
    wait.route_when_encoded(request, ledger, route)   a task (kept in `wait.waiting`) that
                                  waits, then routes the request; in transit meanwhile in
                                  the ledger, so an abort takes it out and it is not routed
    await wait.until_done(hashes) returns once none is claimed, or after `max_wait_s`
    await wait.published(hashes, fingerprint) -> those the encoder service has published for
                                  workers of that fingerprint (WorkerInfo.embeddings_fingerprint):
                                  they cost the worker's step no encoding (the encoder budget)

The hashes are the request's images' embedding keys (MultiModalInput.embedding_key): a
whole image's is its content hash, what the encoders claim and publish; a pan-and-scan
crop's names its box too, and no encoder ever marks it (the worker encodes crops itself).

A claim whose encoder died runs out with its TTL, so nothing waits for a dead encoder
longer than that (--claim-ttl-s on the encoder, 10 s); `max_wait_s` bounds it here too.
A Redis error counts as "nothing claimed": the worker encodes what it lacks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from proto.encoder_messages import QUEUED
from proto.keys import RedisKeys
from proto.messages import NewRequest
from scheduler_svc.ledger import RequestLedger

QUEUED_BYTES = QUEUED.encode()
Route = Callable[[NewRequest, Sequence[str]], Awaitable[None]]  # (request, its published media)


class EncodingWait:
    def __init__(self, client: aioredis.Redis, keys: RedisKeys, poll_s: float = 0.005, max_wait_s: float = 10.0,
                 queued_wait_s: float = 1.0):
        self._client = client
        self._keys = keys
        self._poll_s = poll_s
        self._max_wait_s = max_wait_s
        self._queued_wait_s = queued_wait_s
        self.waiting: set[asyncio.Task] = set()  # requests waiting now (cancelled at a stop)

    def route_when_encoded(self, request: NewRequest, ledger: RequestLedger, route: Route,
                           published_fingerprint: Callable[[], str | None]) -> None:
        """Route `request` (`route`) once the media it is waiting for are published.
        `published_fingerprint`: the workers' embeddings fingerprint when the scheduler
        budgets encoder work (then route gets the published media), else None."""
        ledger.start_transit([request])
        hashes = [m.embedding_key for m in request.mm_inputs]

        async def wait_then_route() -> None:
            await self.until_done(hashes)
            fingerprint = published_fingerprint()
            published = await self.published(hashes, fingerprint) if fingerprint else []
            if ledger.end_transit(request):
                await route(request, published)

        task = asyncio.create_task(wait_then_route(), name=f"encoding-{request.request_id}")
        self.waiting.add(task)
        task.add_done_callback(self.waiting.discard)

    async def pending(self, hashes: Sequence[str]) -> bool:
        """Whether any of `hashes` is queued for an encoder or being encoded."""
        return bool(await self._marks(hashes))

    async def _marks(self, hashes: Sequence[str]) -> list[bytes]:
        """The encoding marks of `hashes` that exist (QUEUED, or an encoder's id)."""
        if not hashes:
            return []
        try:
            values = await self._client.mget([self._keys.encoding(h) for h in dict.fromkeys(hashes)])
        except (RedisError, OSError):
            return []
        return [v for v in values if v is not None]

    async def published(self, hashes: Sequence[str], fingerprint: str | None) -> list[str]:
        if not hashes or not fingerprint:
            return []
        distinct = list(dict.fromkeys(hashes))
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                for h in distinct:
                    pipe.exists(self._keys.embeddings(fingerprint, h))
                found = await pipe.execute()
        except (RedisError, OSError):
            return []
        return [h for h, n in zip(distinct, found) if n]

    async def until_done(self, hashes: Sequence[str]) -> None:
        """Until none of `hashes` is marked: at most `max_wait_s` while an encoder is
        encoding one, at most `queued_wait_s` while they only wait in the encoders' queue
        (they are behind: the worker takes those over, worker_svc/vision_step.py)."""
        start = time.monotonic()
        while marks := await self._marks(hashes):
            waited = time.monotonic() - start
            encoding = any(m != QUEUED_BYTES for m in marks)
            if waited >= (self._max_wait_s if encoding else self._queued_wait_s):
                break
            await asyncio.sleep(self._poll_s)
