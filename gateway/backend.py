"""The gateway's Redis side: submit and abort requests, route token events, see workers.

One `RedisBackend` per gateway process. It owns:
- a gateway id (uuid) and its reply channel `keys.reply_channel(gateway_id)`;
- ONE subscription task that decodes every message on that channel (a msgpack
  `list[TokenEvent]`) and puts each event on the asyncio queue of its request;
- a short-lived cache of the live workers' `WorkerRegistration`s and of the live
  schedulers' `SchedulerHeartbeat`s.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.event_queues import EventQueues
from proto.keys import STREAM_FIELD, RedisKeys
from proto.messages import (AbortRequest, NewRequest, SchedulerHeartbeat, TokenEvent, WorkerRegistration,
                            WorkerStats, events_decoder, stats_decoder, stream_encoder)
from proto.registry import WorkerRegistry
from proto.scheduler_registry import SchedulerRegistry

logger = logging.getLogger(__name__)

_MAX_CONNECTIONS = 64  # commands to Redis in flight at once; more wait for a connection
_POOL_WAIT_S = 10.0
_RESUBSCRIBE_DELAY_S = 0.25
_RESUBSCRIBE_MAX_DELAY_S = 5.0


class RedisBackend(EventQueues):
    def __init__(self, redis_url: str, keys: RedisKeys, worker_cache_ttl_s: float = 1.0):
        super().__init__()
        self.keys = keys
        self._registry = WorkerRegistry(keys)
        self.gateway_id = uuid.uuid4().hex
        self.reply_channel = keys.reply_channel(self.gateway_id)
        self._worker_cache_ttl_s = worker_cache_ttl_s
        # Commands time out so a dead Redis yields a 503, not a hung request. The pool waits
        # for a free connection when all are busy (redis-py's default pool fails at once with
        # "Too many connections" past 100 concurrent commands: a burst of requests, or n=128).
        # The subscriber has its own client without a read timeout: it legitimately waits.
        pool = aioredis.BlockingConnectionPool.from_url(
            redis_url, max_connections=_MAX_CONNECTIONS, timeout=_POOL_WAIT_S,
            socket_timeout=5, socket_connect_timeout=5)
        self._client = aioredis.Redis.from_pool(pool)
        self._sub_client = aioredis.Redis.from_url(redis_url, socket_connect_timeout=5)
        self._subscribed = asyncio.Event()
        self._listener: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self._workers: list[WorkerRegistration] = []
        self._workers_at = float("-inf")
        self._schedulers_reader = SchedulerRegistry(keys)
        self._schedulers: list[SchedulerHeartbeat] = []
        self._schedulers_at = float("-inf")
        self._closing = False

    # ---- lifecycle ------------------------------------------------------------------------

    async def start(self, timeout_s: float = 10.0) -> None:
        """Subscribe before the first request can be submitted, so no event is missed."""
        self._listener = asyncio.create_task(self._listen(), name=f"gateway-{self.gateway_id}-events")
        if not await self.ping():
            logger.warning("Redis does not answer; subscribing in the background")
            return
        try:
            await asyncio.wait_for(self._subscribed.wait(), timeout_s)
        except TimeoutError:
            # Redis is not up yet: keep retrying in the background; /health says 503 meanwhile.
            logger.warning("could not subscribe to %s within %.0fs; retrying", self.reply_channel, timeout_s)

    async def stop(self) -> None:
        self._closing = True
        if self._background:  # pending aborts
            await asyncio.wait(self._background, timeout=2)
        if self._listener is not None:
            # redis-py (8.1) sometimes swallows a cancellation that lands mid-read, so the
            # wait is bounded; closing the client below then ends the read, and the loop
            # sees _closing.
            self._listener.cancel()
            await asyncio.wait({self._listener}, timeout=2)
        await self._client.aclose()
        await self._sub_client.aclose()

    async def _listen(self) -> None:
        """Subscribe and route forever; on a lost connection, resubscribe with a backoff.
        Events published while unsubscribed are lost (pub/sub keeps nothing), so once
        subscribed again every request that was open across the gap ends at once with a
        clear error (and is aborted) instead of waiting for its timeout; admission refuses
        new requests while unsubscribed (gateway/readiness.py)."""
        delay = _RESUBSCRIBE_DELAY_S
        lost = False  # a subscription was lost: requests open meanwhile may miss events
        while not self._closing:
            pubsub = self._sub_client.pubsub()
            try:
                await pubsub.subscribe(self.reply_channel)
                async for message in pubsub.listen():
                    if self._closing:
                        break
                    if message["type"] == "subscribe":
                        self._subscribed.set()
                        delay = _RESUBSCRIBE_DELAY_S
                        if lost:
                            lost = False
                            self._fail_open_requests()
                    elif message["type"] == "message":
                        self._route(message["data"])
            except (RedisError, OSError) as exc:
                if self._closing:
                    break
                if self._subscribed.is_set() or delay == _RESUBSCRIBE_DELAY_S:  # once per outage
                    logger.warning("reply channel %s lost (%s); resubscribing", self.reply_channel, exc)
            except Exception:  # a bug, not an outage: keep serving, but say so loudly
                logger.exception("reply channel %s failed; resubscribing", self.reply_channel)
            finally:
                if self._subscribed.is_set():  # however the subscription ended
                    lost = True
                    self._subscribed.clear()
                await asyncio.shield(pubsub.aclose())
            await asyncio.sleep(delay)
            delay = min(delay * 2, _RESUBSCRIBE_MAX_DELAY_S)

    def _fail_open_requests(self) -> None:
        ids = self.fail_open("token events were lost while the gateway's connection to Redis was "
                             "down; the request was aborted, retry it")
        if ids:
            logger.warning("reply channel %s is back; failed %d request(s) open across the gap",
                           self.reply_channel, len(ids))
        for request_id in ids:
            self.abort_soon(request_id)

    def _route(self, data: bytes) -> None:
        try:
            events = events_decoder.decode(data)
        except msgspec.DecodeError:
            logger.error("undecodable message on %s (%d bytes) dropped", self.reply_channel, len(data))
            return
        self.deliver(events)

    # ---- requests -------------------------------------------------------------------------

    async def submit(self, request: NewRequest) -> None:
        await self._client.xadd(self.keys.requests, {STREAM_FIELD: stream_encoder.encode(request)})

    async def abort(self, request_id: str) -> None:
        await self._client.xadd(self.keys.requests,
                                {STREAM_FIELD: stream_encoder.encode(AbortRequest(request_id))})

    def abort_soon(self, request_id: str) -> None:
        """Abort from code that cannot await (a cancelled stream's cleanup): the XADD runs as
        its own task, outside the cancelled scope."""
        task = asyncio.get_running_loop().create_task(self._abort_logged(request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort_logged(self, request_id: str) -> None:
        try:
            await self.abort(request_id)
        except (RedisError, OSError):
            logger.warning("could not send the abort of %s", request_id, exc_info=True)

    # ---- workers and health ---------------------------------------------------------------

    async def live_workers(self) -> list[WorkerRegistration]:
        """Registrations of workers whose key has not expired, reused for worker_cache_ttl_s."""
        if time.monotonic() - self._workers_at < self._worker_cache_ttl_s:
            return self._workers
        self._workers = list((await self._registry.read(self._client)).live.values())
        self._workers_at = time.monotonic()
        return self._workers

    async def schedulers(self) -> list[SchedulerHeartbeat]:
        """Heartbeats of live schedulers, reused for worker_cache_ttl_s."""
        if time.monotonic() - self._schedulers_at < self._worker_cache_ttl_s:
            return self._schedulers
        self._schedulers = await self._schedulers_reader.read(self._client)
        self._schedulers_at = time.monotonic()
        return self._schedulers

    @property
    def subscribed(self) -> bool:
        """Whether the reply channel is subscribed now (token events can reach us)."""
        return self._subscribed.is_set()

    async def worker_stats(self) -> list[WorkerStats]:
        """The scheduler's latest WorkerStats of every live worker."""
        workers = await self.live_workers()
        if not workers:
            return []
        values = await self._client.mget([self.keys.worker_stats(w.worker_id) for w in workers])
        return [stats_decoder.decode(v) for v in values if v is not None]

    async def ping(self) -> bool:
        try:
            return bool(await self._client.ping())
        except (RedisError, OSError):
            return False

