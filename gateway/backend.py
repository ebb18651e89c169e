"""The gateway's Redis side: submit and abort requests, route token events, see workers.

One `RedisBackend` per gateway process. It owns:
- a gateway id (uuid) and its reply channel `keys.reply_channel(gateway_id)`;
- ONE subscription task that decodes every message on that channel (a msgpack
  `list[TokenEvent]`) and puts each event on the asyncio queue of its request;
- the NewRequests it submitted whose events are still awaited (until their queues close):
  after its subscription was lost it sends each of them again (`_resubmit_open`);
- the choice of a scheduler shard for each request (`shard_for`, gateway/shard_choice.py),
  which the caller passes to the request's submit and aborts;
- a short-lived cache of the live workers' `WorkerRegistration`s and of the live
  schedulers' `SchedulerHeartbeat`s.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Iterable

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from gateway.event_queues import DEFAULT_MAX_UNREAD, EventQueues
from gateway.shard_choice import ShardChoice
from proto.keys import STREAM_FIELD, RedisKeys
from proto.messages import (AbortRequest, NewRequest, SchedulerHeartbeat, WorkerRegistration,
                            WorkerStats, events_decoder, stats_decoder, stream_encoder)
from proto.registry import WorkerRegistry
from proto.scheduler_registry import SchedulerRegistry

logger = logging.getLogger(__name__)

_MAX_CONNECTIONS = 64  # commands to Redis in flight at once; more wait for a connection
_POOL_WAIT_S = 10.0
_RESUBSCRIBE_DELAY_S = 0.25
_RESUBSCRIBE_MAX_DELAY_S = 5.0
_RESUBMIT_FOR_S = 10.0  # how long open requests are tried to be sent again, all together


class RedisBackend(EventQueues):
    def __init__(self, redis_url: str, keys: RedisKeys, worker_cache_ttl_s: float = 1.0,
                 max_unread_events: int = DEFAULT_MAX_UNREAD):
        super().__init__(max_unread_events)
        self.keys = keys
        self._registry = WorkerRegistry(keys)
        self.gateway_id = uuid.uuid4().hex
        self.reply_channel = keys.reply_channel(self.gateway_id)
        self._worker_cache_ttl_s = worker_cache_ttl_s
        # Commands time out so a dead Redis yields a 503, not a hung request. The pool waits
        # for a free connection when all are busy (redis-py's default pool fails at once with
        # "Too many connections" past 100 concurrent commands: a burst of requests, or n=128).
        # The subscriber has its own client without a read timeout: it legitimately waits.
        # A pooled connection to a Redis that restarted fails on its next use: a connection
        # error is retried on a fresh one (an XADD that did reach Redis may then be queued
        # twice; the scheduler drops the copy of a request it holds).
        pool = aioredis.BlockingConnectionPool.from_url(
            redis_url, max_connections=_MAX_CONNECTIONS, timeout=_POOL_WAIT_S,
            socket_timeout=5, socket_connect_timeout=5,
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 3, supported_errors=(RedisConnectionError,)))
        self._client = aioredis.Redis.from_pool(pool)
        self._sub_client = aioredis.Redis.from_url(redis_url, socket_connect_timeout=5)
        self._subscribed = asyncio.Event()
        self._listener: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self._open: dict[str, NewRequest] = {}  # submitted, events still awaited
        self._shard_choice = ShardChoice()
        self._resubmitted: set[str] = set()  # of those, sent again after a lost subscription
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
        if self._listener is not None:  # a read the cancel missed ends with the connection
            await asyncio.wait({self._listener}, timeout=2)

    async def _listen(self) -> None:
        """Subscribe and route forever; on a lost connection, resubscribe with a backoff.
        Events published while unsubscribed are lost (pub/sub keeps nothing), so once
        subscribed again every request that was open across the gap is sent again
        (`_resubmit_open`); admission refuses new requests while unsubscribed
        (gateway/readiness.py)."""
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
                            self._in_background(self._resubmit_open())
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

    async def _resubmit_open(self) -> None:
        """Send every open request again, marked `resubmitted`: the scheduler starts it over
        from its prompt (replacing the copy it may still run, or anew when a Redis restart
        took the stream). Its sampling depends on (seed, position) only, so the new copy
        yields the tokens the client already has -- which the request drops by index -- and
        then those lost in the gap; events of the old copy past a gap are dropped too
        (gateway/generation.py). A request that cannot be sent ends with a clear 503."""
        requests = list(self._open.values())
        failed = []
        deadline = time.monotonic() + _RESUBMIT_FOR_S
        for request in requests:
            if request.request_id not in self._open:
                continue  # it ended meanwhile
            try:
                await self._xadd_retrying(msgspec.structs.replace(request, resubmitted=True), deadline)
            except (RedisError, OSError) as exc:
                logger.warning("could not send %s again: %s", request.request_id, exc)
                failed.append(request)
                continue
            if request.request_id in self._open:
                self._resubmitted.add(request.request_id)
            else:  # it ended while being sent: stop the new copy
                self.abort_soon(request.request_id, request.shard)
        if requests:
            logger.warning("reply channel %s is back; sent %d request(s) open across the gap again "
                           "(%d could not be sent)", self.reply_channel, len(requests), len(failed))
        self.fail([r.request_id for r in failed], "token events were lost while the gateway's connection to "
                  "Redis was down and the request could not be sent again; retry it")
        for request in failed:
            self.abort_soon(request.request_id, request.shard)

    def _route(self, data: bytes) -> None:
        try:
            events = events_decoder.decode(data)
        except msgspec.DecodeError:
            logger.error("undecodable message on %s (%d bytes) dropped", self.reply_channel, len(data))
            return
        self.deliver(events)

    # ---- requests -------------------------------------------------------------------------

    async def shard_for(self, request: NewRequest) -> int:
        """The scheduler shard to send it to (gateway/shard_choice.py): its `submit` and
        its aborts go there."""
        return self._shard_choice.pick(request, await self.schedulers())

    async def submit(self, request: NewRequest, shard: int = 0) -> None:
        """Queue it on shard `shard`'s stream (`shard_for`); its events are awaited (and it
        is sent again, to the same shard, after a lost subscription) until its queue closes."""
        request = msgspec.structs.replace(request, shard=shard)
        self._open[request.request_id] = request
        await self._xadd(request)

    def shard_of(self, request_id: str) -> int:
        request = self._open.get(request_id)
        return request.shard if request is not None else 0

    def close(self, request_ids: Iterable[str]) -> bool:
        """Close the queues; a request sent again may have a copy still running that its
        finished (or abandoned) first copy did not stop: it is aborted (True)."""
        request_ids = list(request_ids)
        super().close(request_ids)
        aborted = False
        for request_id in request_ids:
            request = self._open.pop(request_id, None)
            if request is not None and request_id in self._resubmitted:
                self._resubmitted.discard(request_id)
                self.abort_soon(request_id, request.shard)
                aborted = True
        return aborted

    async def _xadd(self, request: NewRequest) -> None:
        await self._client.xadd(self.keys.shard_requests(request.shard), {STREAM_FIELD: stream_encoder.encode(request)})

    async def _xadd_retrying(self, request: NewRequest, deadline: float) -> None:
        """XADD, tried again until `deadline` (monotonic): right after Redis came back, the
        pool's connections to the old server fail once each."""
        delay = _RESUBSCRIBE_DELAY_S
        while True:
            try:
                return await self._xadd(request)
            except (RedisError, OSError):
                if time.monotonic() + delay > deadline:
                    raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, _RESUBSCRIBE_MAX_DELAY_S)

    async def abort(self, request_id: str, shard: int = 0) -> None:
        """To `shard`, the one its request (a child's: its parent) went to (`submit`)."""
        await self._client.xadd(self.keys.shard_requests(shard),
                                {STREAM_FIELD: stream_encoder.encode(AbortRequest(request_id))})

    def abort_soon(self, request_id: str, shard: int = 0) -> None:
        """Abort from code that cannot await (a cancelled stream's cleanup): the XADD runs as
        its own task, outside the cancelled scope."""
        self._in_background(self._abort_logged(request_id, shard))

    def _in_background(self, coroutine) -> None:
        """Run a coroutine as its own task, kept until done (`stop` waits for them)."""
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort_logged(self, request_id: str, shard: int) -> None:
        try:
            await self.abort(request_id, shard)
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
    def redis(self) -> aioredis.Redis:
        """The pooled client (commands time out; a connection error is retried), for other
        parts of the gateway that keep data in Redis: the media store. Closed by `stop`."""
        return self._client

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

