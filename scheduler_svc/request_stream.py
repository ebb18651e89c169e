"""The requests stream as one scheduler's consumer sees it: reading, claiming and
acknowledging entries of the `SCHEDULER_GROUP` consumer group.

`RequestStream` owns the consumer's state -- where its read is (its own pending history
first, then new entries) and the finished entries Redis has not acknowledged yet -- and
hands each decoded message (a `NewRequest` or an `AbortRequest`) with its entry id to the
service's handler. What to do with a message is the service's (scheduler_svc/service.py);
where an entry is in the group is this class's.

Redis out of reach is never the end of the scheduler: reads are retried with a backoff (a
Redis that came back empty gets the stream and group again), and acknowledgements that
fail are kept and sent with the next ones.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from proto.keys import SCHEDULER_GROUP, STREAM_FIELD
from proto.messages import AbortRequest, NewRequest, stream_decoder
from proto.outage_log import OutageLog

log = logging.getLogger("pagedserve.scheduler")

_RETRY_S = 0.25  # first wait before reading the stream again after a Redis error
_MAX_RETRY_S = 5.0

Handler = Callable[[bytes, NewRequest | AbortRequest], Awaitable[None]]


class RequestStream:
    def __init__(self, redis: aioredis.Redis, key: str, consumer_name: str, read_batch: int,
                 handle: Handler) -> None:
        """`key`: the stream (a shard's: RedisKeys.shard_requests)."""
        self._redis = redis
        self._key = key
        self.consumer_name = consumer_name
        self._read_batch = read_batch
        self._handle = handle
        self._unacked: list[bytes] = []  # finished entries Redis has not acknowledged yet
        self._flusher: asyncio.Task | None = None  # acknowledging what ack_soon queued
        self._ack_outage = OutageLog(log, "could not acknowledge finished requests; retrying with the next",
                                     "acknowledging finished requests again")

    @property
    def key(self) -> str:
        return self._key

    async def create_group(self) -> None:
        """The stream and its group, unless they exist."""
        try:
            await self._redis.xgroup_create(self._key, SCHEDULER_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def claim_pending(self) -> int:
        """Every pending entry of the group becomes this consumer's (XAUTOCLAIM, min idle
        0: the lease, not the idle time, says the old leader is gone); they are handled by
        `read`'s history pass. How many were claimed. Raises Redis errors (NOGROUP too)."""
        start: bytes | str = "0-0"
        claimed = 0
        while True:
            next_start, entries, *_ = await self._redis.xautoclaim(
                self._key, SCHEDULER_GROUP, self.consumer_name, min_idle_time=0,
                start_id=start, count=self._read_batch)
            claimed += len(entries)
            if next_start in (b"0-0", "0-0"):
                return claimed
            start = next_start

    async def claim_orphans(self, min_idle_ms: int) -> None:
        """Entries another consumer read but never acknowledged, idle at least
        `min_idle_ms`, become this one's (XPENDING with IDLE, page by page -- this
        consumer's own long-running entries come back too -- then XCLAIM) and are handled."""
        try:
            ids, start = [], "-"
            while True:
                pending = await self._redis.xpending_range(self._key, SCHEDULER_GROUP, min=start, max="+",
                                                           count=self._read_batch, idle=min_idle_ms)
                ids += [p["message_id"] for p in pending if _text(p["consumer"]) != self.consumer_name]
                if len(pending) < self._read_batch:
                    break
                start = "(" + _text(pending[-1]["message_id"])  # exclusive: after the last one
            if not ids:
                return
            entries = await self._redis.xclaim(self._key, SCHEDULER_GROUP, self.consumer_name,
                                               min_idle_time=min_idle_ms, message_ids=ids)
        except (aioredis.RedisError, OSError) as exc:  # the stream or group gone: `read` remakes them
            log.debug("no orphaned requests claimed: %s", exc)
            return
        log.warning("claimed %d request(s) another scheduler read and left", len(entries))
        for entry_id, fields in entries:
            await self._deliver(entry_id, fields)

    async def read(self, stopping: Callable[[], bool]) -> None:
        """Handle entries until `stopping()`: first this consumer's pending ones (delivered
        before a restart, or claimed), then new ones. A history read returns the pending
        entries after `stream_id`, acknowledged or not, so it moves past each batch; an
        empty history read means the history is done."""
        stream_id: str | bytes = "0"
        history = True
        delay = _RETRY_S
        while not stopping():
            try:
                reply = await self._redis.xreadgroup(
                    SCHEDULER_GROUP, self.consumer_name, {self._key: stream_id},
                    count=self._read_batch, block=None if history else 1000)
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                log.warning("the requests stream or its group is gone (Redis restarted empty?); "
                            "creating them again")
                await self.create_group()
                continue
            except (aioredis.RedisError, OSError) as exc:
                if delay == _RETRY_S:  # once per outage
                    log.warning("reading %s failed (%s); retrying", self._key, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _MAX_RETRY_S)
                continue
            if delay != _RETRY_S:
                log.info("reading %s again", self._key)
                delay = _RETRY_S
            entries = reply[0][1] if reply else []
            if history:
                if not entries:
                    history, stream_id = False, ">"
                    continue
                stream_id = entries[-1][0]
            for entry_id, fields in entries:
                await self._deliver(entry_id, fields)

    async def ack(self, entry_ids: list[bytes]) -> None:
        """Acknowledge and delete: a finished request's entry is of no further use. With
        Redis out of reach the entries are kept and acknowledged with the next ones (a
        Redis error never stops a step loop, so it never retires a healthy worker)."""
        if not entry_ids and not self._unacked:
            return
        batch, self._unacked = [*self._unacked, *entry_ids], []
        pipe = self._redis.pipeline(transaction=False)
        pipe.xack(self._key, SCHEDULER_GROUP, *batch)
        pipe.xdel(self._key, *batch)
        try:
            await pipe.execute()
        except (aioredis.RedisError, OSError) as exc:
            self._ack_outage.failed(exc)
            self._unacked = batch + self._unacked
            return
        self._ack_outage.ok()

    def ack_soon(self, entry_ids: list[bytes]) -> None:
        """`ack` off the caller's path (a step loop's, between two steps): queued, and sent
        by one task, with whatever else is queued meanwhile (every worker's finished
        requests in one round trip)."""
        self._unacked.extend(entry_ids)
        if self._unacked and (self._flusher is None or self._flusher.done()):
            self._flusher = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        while self._unacked:
            queued = len(self._unacked)
            await self.ack([])
            if len(self._unacked) >= queued:
                return  # Redis out of reach: kept for the next acknowledgement

    async def _deliver(self, entry_id: bytes, fields: dict) -> None:
        try:
            message = stream_decoder.decode(fields[STREAM_FIELD])
        except (KeyError, TypeError, msgspec.DecodeError) as exc:  # TypeError: deleted, still pending
            log.error("dropping malformed stream entry %s: %s", entry_id, exc)
            await self.ack([entry_id])
            return
        await self._handle(entry_id, message)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
