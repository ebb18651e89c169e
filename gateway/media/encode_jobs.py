"""Telling the encoder service (encoder_svc/) about media just stored, so their embeddings
are ready before a question needs them.

    jobs = EncodeJobs(client, keys)
    await jobs.announce(hashes)   when a live encoder is registered: each medium marked
                                  QUEUED (`RedisKeys.encoding(hash)`, SET NX, `queued_ttl_s`)
                                  and one XADD of an EncodeJob to RedisKeys.encode_jobs;
                                  nothing otherwise

The QUEUED mark makes the scheduler route a question needing the medium once an encoder
has published it (scheduler_svc/encoding_wait.py), rather than send it to a worker that
would encode it a second time. The scheduler waits for a medium only QUEUED for 1 s at
most (the encoders are behind, or died); its worker then takes it over from the queue,
encodes and publishes it, and the encoder skips it (worker_svc/vision_step.py). The mark
lasts `queued_ttl_s` (60 s) at most -- longer than the encoders' queue should ever be, so
a worker that takes a medium over still finds it queued. The encoder that takes the job
turns the mark into its own claim.

Whether an encoder is live is read from its registration (`RedisKeys.encoders` and each
`RedisKeys.encoder(id)` with its TTL) at most once per `recheck_s`: a stack without
encoders writes no jobs (its workers encode what they need, as always), and one whose
encoders all died stops writing within a few seconds (what was written stays for the next
encoder to take; the stream is capped at `max_len` entries, oldest out). A Redis error
here is not the request's: the announcement is skipped and logged -- the worker encodes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from proto.encoder_messages import QUEUED, EncodeJob, job_encoder
from proto.keys import STREAM_FIELD, RedisKeys

log = logging.getLogger(__name__)


class EncodeJobs:
    def __init__(self, client: aioredis.Redis, keys: RedisKeys, recheck_s: float = 1.0, max_len: int = 100_000,
                 queued_ttl_s: float = 60.0):
        self._client = client
        self._queued_ms = max(1, int(queued_ttl_s * 1000))
        self._keys = keys
        self._recheck_s = recheck_s
        self._max_len = max_len
        self._live = False
        self._checked_at = -float("inf")
        self._checking = asyncio.Lock()

    async def announce(self, hashes: Sequence[str]) -> bool:
        """Queue `hashes` for the encoders, if any is live; whether they were queued."""
        if not hashes:
            return False
        try:
            if not await self._encoders_live():
                return False
            pipe = self._client.pipeline(transaction=False)
            for digest in hashes:
                pipe.set(self._keys.encoding(digest), QUEUED, nx=True, px=self._queued_ms)
            pipe.xadd(self._keys.encode_jobs, {STREAM_FIELD: job_encoder.encode(EncodeJob(tuple(hashes)))},
                      maxlen=self._max_len, approximate=True)
            await pipe.execute()
        except (RedisError, OSError) as exc:
            log.warning("encode job not queued (%s): the workers will encode %d item(s)", exc, len(hashes))
            return False
        return True

    async def _encoders_live(self) -> bool:
        """Read the registry at most once per `recheck_s`; announcements meanwhile (also
        those that come while a read is under way) share its answer."""
        async with self._checking:
            if time.monotonic() - self._checked_at >= self._recheck_s:
                ids = await self._client.smembers(self._keys.encoders)
                values = await self._client.mget([self._keys.encoder(i.decode() if isinstance(i, bytes) else i)
                                                  for i in ids]) if ids else []
                self._live = any(v is not None for v in values)
                self._checked_at = time.monotonic()
        return self._live
