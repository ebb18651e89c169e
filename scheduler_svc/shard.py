"""One scheduler shard: its requests stream, its workers and every request it holds.

A shard is what one scheduler leads (scheduler_svc/service.py runs the shards it holds
the lease of). It wires four parts, each owning its state:
  * `WorkerPool` (scheduler_svc/worker_pool.py) -- its workers: discovery, leasing its
    fair share (scheduler_svc/worker_leases.py), joining (a WorkerHandle with its own
    BatchScheduler), handing over, retiring, evacuation;
  * `RequestLedger` (scheduler_svc/ledger.py) -- where every request is: on a worker,
    parked until one joins, or in transit; its stream entry; its children (n > 1);
  * `StepLoop` (scheduler_svc/step_loop.py), one per worker -- schedule() -> Steps
    (gRPC, stamped with the worker lease's fencing token) -> update(), stats; its worker
    evacuated and its requests re-routed when it ends;
  * `RequestStream` (scheduler_svc/request_stream.py) -- the shard's requests stream
    (`keys.shard_requests(shard)`) as this consumer sees it: reading, claiming, acknowledging.
While it leads, two tasks run on the scheduler's asyncio loop: the stream's read, whose
messages `_handle_entry` routes (a NewRequest to one of the shard's workers, prefix-aware:
`scheduler_svc.policy.routing`; an AbortRequest to wherever the request is), and
`_discover_workers`, which refreshes the pool (a worker that joins gets its step loop and
the parked requests).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from proto.keys import RedisKeys
from proto.messages import AbortRequest, NewRequest, ShardLoad, TokenEvent, stream_encoder
from proto.parallel import parent_request_id
from proto.registry import WorkerRegistry
from scheduler_svc.encoding_wait import EncodingWait
from scheduler_svc.leader import Lease
from scheduler_svc.ledger import RequestLedger, Unrouted
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.policy.request import SchedulerRequest
from scheduler_svc.policy.routing import pick_worker
from scheduler_svc.request_stream import RequestStream
from scheduler_svc.service_config import SchedulerServiceConfig
from scheduler_svc.step_loop import StepLoop
from scheduler_svc.worker_leases import WorkerLeases
from scheduler_svc.worker_pool import WorkerHandle, WorkerPool

log = logging.getLogger("pagedserve.scheduler")

_RETRY_S = 0.25  # first wait before taking over again after a Redis error
_MAX_RETRY_S = 5.0


class Shard:
    def __init__(self, config: SchedulerServiceConfig, shard: int, redis: aioredis.Redis,
                 metrics: SchedulerMetrics, lease: Lease, led_shards: Callable[[], int] = lambda: 1):
        """`lease`: shard `shard`'s, held; `led_shards()`: how many shards have a leader."""
        self.config = config
        self.shard = shard
        self.keys = RedisKeys(config.key_prefix)
        self.redis = redis
        self.metrics = metrics
        self.lease = lease
        leases = WorkerLeases(redis, self.keys, shard, config.lease_ttl_s)
        self.pool = WorkerPool(WorkerRegistry(self.keys), redis, config.batching, config.retired_retry_s,
                               config.schedules_ahead, leases, shard, led_shards)
        self.ledger = RequestLedger(config.max_early_aborts)
        self.stream = RequestStream(redis, self.keys.shard_requests(shard), config.consumer_name,
                                    config.read_batch, self._handle_entry)
        self.encoding = EncodingWait(redis, self.keys)
        self._loops: list[asyncio.Task] = []  # the stream's read and the workers' discovery
        self._stopping = False

    # ---- leading ---------------------------------------------------------------------

    async def lead(self) -> None:
        """With the lease held: claim every pending request of the stream (a dead
        leader's too), start reading and discovering, then renew the leases (the shard's
        and its workers') until a loop crashes (raised) or the lease is lost (LeaseLost)."""
        log.info("scheduler %s leads shard %d (fencing token %d), reading %s", self.config.consumer_name,
                 self.shard, self.lease.token, self.stream.key)
        await self._take_over()
        self._loops = [asyncio.create_task(self.stream.read(lambda: self._stopping), name=f"read-{self.shard}"),
                       asyncio.create_task(self._discover_workers(), name=f"discover-{self.shard}")]
        failing = False
        while True:
            await asyncio.wait(self._loops, timeout=self.lease.ttl_s / 3)
            for task in self._loops:
                if task.done():
                    task.result()  # raises what crashed it
                    raise RuntimeError(f"{task.get_name()} ended")
            try:
                await self.lease.renew()
                await self.pool.renew_leases()
            except (aioredis.RedisError, OSError) as exc:
                if not failing:
                    log.warning("could not renew the leases of shard %d: %s", self.shard, exc)
                failing = True
                continue
            failing = False
            # Entries another scheduler read and left, idle for two lease periods: a leader
            # that lost its lease may read some before it notices (e.g. requests a gateway
            # sent again right after a Redis restart that also moved the lead).
            await self.stream.claim_orphans(int(2 * self.lease.ttl_s * 1000))

    async def _take_over(self) -> None:
        """Claim the pending requests, then learn the shard's workers before routing
        anything; a Redis error here is retried with a backoff (a group gone with an empty
        Redis is made again), never the end of the scheduler."""
        delay = _RETRY_S
        while True:
            try:
                # Every pending request becomes ours (a dead leader's too), served again from
                # its prompt; with (seed, position) sampling and `request_seed` it comes out
                # as the client already has it, and its gateway drops the indices it has.
                claimed = await self.stream.claim_pending()
                if claimed:
                    log.info("shard %d: claimed %d pending request(s)", self.shard, claimed)
                await self._refresh_workers()
                return
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                await self.stream.create_group()
            except (aioredis.RedisError, OSError) as exc:
                log.warning("taking over shard %d failed (%s); retrying", self.shard, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _MAX_RETRY_S)

    async def stop(self) -> None:
        """Stop every task of the shard, close its workers' channels and give its leases
        up (the workers' first: whoever takes the shard takes them at once)."""
        if self._stopping:
            return
        self._stopping = True
        tasks = [*self._loops, *self.encoding.waiting, *(h.task for h in self.pool.handles() if h.task)]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=3)
        await self.pool.close()
        try:
            await asyncio.wait_for(self.stream.ack([]), 2)  # what ack_soon still holds
        except (aioredis.RedisError, OSError, TimeoutError):
            pass  # read again (and finished again) by the next leader
        try:
            await self.lease.release()
        except (aioredis.RedisError, OSError):
            pass  # its TTL frees it

    def load(self) -> tuple[ShardLoad, int]:
        """What the heartbeat says of this shard, and its requests waiting for a step (on
        a worker's waiting queue, parked until a worker joins, or in transit)."""
        live = self.pool.live()
        unrouted = len(self.ledger.unassigned) + len(self.ledger.in_transit)
        waiting = sum(len(h.scheduler.queues.waiting) for h in live) + unrouted
        held = sum(len(h.scheduler.queues.waiting) + len(h.scheduler.queues.running)
                   + len(h.scheduler.queues.swapped) for h in self.pool.handles())
        return ShardLoad(self.shard, [h.worker_id for h in live], held + unrouted), waiting

    # ---- workers ---------------------------------------------------------------------

    async def _discover_workers(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.config.discovery_interval_s)
            await self._refresh_workers()

    async def _refresh_workers(self) -> None:
        for handle in await self.pool.refresh():
            self.start_worker(handle)
            await self._route_all(self.ledger.take_parked())

    def start_worker(self, handle: WorkerHandle) -> None:
        """Put the worker in the pool and start its step loop."""
        self.pool.add(handle)
        handle.task = asyncio.create_task(self._drive(handle), name=f"steps-{handle.worker_id}")

    async def _drive(self, handle: WorkerHandle) -> None:
        """The worker's step loop, then (once it is retired) its evacuation."""
        loop = StepLoop(handle, self.redis, self.keys, self.metrics, self.config.step_timeout_s,
                        self.config.stats_interval_s, self._finished, handle.fencing_token)
        try:
            await loop.run()
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug or a Redis error: never leave a dead loop holding requests
            log.exception("step loop of worker %s crashed", handle.worker_id)
            handle.retire("its step loop crashed")
        finally:
            if not self._stopping:
                try:
                    states = await self.pool.evacuate(handle)
                    self.metrics.forget_worker(handle.worker_id)
                    await self._route_all(states, lost_worker=True)
                except Exception:
                    log.exception("re-routing the requests of worker %s failed", handle.worker_id)

    # ---- requests in -----------------------------------------------------------------

    async def _handle_entry(self, entry_id: bytes, message: NewRequest | AbortRequest) -> None:
        """A message read from the stream (or claimed)."""
        if self._stopping:  # a read that outlived the shard: left pending for its next leader
            return
        if isinstance(message, AbortRequest):
            await self.stream.ack([entry_id])
            await self._abort(message.request_id)
        elif message.request_id in self.ledger.entries:
            if message.resubmitted:  # its gateway lost events: start it over, here or anywhere
                await self._abort(message.request_id)  # acknowledges the old entry
                self.ledger.open(message.request_id, entry_id)
                await self._route(message)
            elif entry_id != self.ledger.entries[message.request_id]:
                await self.stream.ack([entry_id])  # its resubmitted copy came first: this one is done
            # else the same entry, delivered again while in flight
        elif self.ledger.take_early_abort(message.request_id):
            await self.stream.ack([entry_id])
        else:
            self.ledger.open(message.request_id, entry_id)
            if message.mm_inputs and await self.encoding.pending([m.embedding_key for m in message.mm_inputs]):
                self.encoding.route_when_encoded(message, self.ledger, self._route, self._budget_fingerprint)
            else:
                hashes = [m.embedding_key for m in message.mm_inputs]  # published: no encoder budget
                await self._route(message, await self.encoding.published(hashes, self._budget_fingerprint()))

    async def _abort(self, request_id: str) -> None:
        """Abort a request wherever it is (the ledger says where) and, n > 1, its children
        wherever each is. A child's id (`p/1`, proto/parallel.py) aborts that child alone;
        the parent's entry is done with its last child. A request id not seen yet is
        remembered (boundedly) as an early abort: its NewRequest is dropped when it comes."""
        parent_id = parent_request_id(request_id)
        # Parked or in transit: taken out first, so nothing routes them afterwards.
        gone = self.ledger.take_unrouted(request_id)
        children = self.ledger.assigned_children(request_id)
        # abort_request(parent) on a worker aborts the children forked there too.
        for handle in self.ledger.holders(request_id):
            if handle.scheduler.abort_request(request_id):
                handle.wake.set()  # the worker learns to forget it in the next step
                gone.append(request_id)
        for child_id in {*children, *(rid for rid in gone if parent_request_id(rid) == request_id)}:
            self.ledger.close(child_id)  # children have no stream entry of their own
        if parent_id is not None:
            self.ledger.close(request_id)
            if gone:  # else already finished (the finish did this) or not forked yet
                await self.stream.ack(self._close_parent_if_done(parent_id))
        elif request_id in self.ledger.entries:
            await self.stream.ack(self._close(request_id))
        else:
            self.ledger.remember_early_abort(request_id)

    async def _route(self, item: Unrouted, published: Sequence[str] = ()) -> None:
        """The live worker holding the longest cached prefix of the request's tokens,
        unless it is much more loaded than another (the score: scheduler_svc.policy.routing).
        `published`: its media the encoder service has published (EncodingWait.published)."""
        live = self.pool.live()
        if not live:
            self.ledger.park(item)
            return
        tokens = item.prompt_token_ids if isinstance(item, NewRequest) else item.token_ids
        handle = pick_worker(live, tokens, lambda h: h.scheduler, mm_inputs=item.mm_inputs)
        handle.scheduler.note_published(published)
        add = handle.scheduler.add_request if isinstance(item, NewRequest) else handle.scheduler.add_state
        error = add(item)
        if error is not None:  # it can never fit on that worker: tell the client, drop it
            done = self._close(item.request_id, item.parent_id if isinstance(item, SchedulerRequest) else None)
            await self._publish(item.reply_channel, error)
            await self.stream.ack(done)
            return
        self.ledger.assign(item.request_id, handle)
        handle.wake.set()

    def _budget_fingerprint(self) -> str | None:
        """The workers' embeddings fingerprint when steps budget encoder work, else None."""
        live = self.pool.live()
        return live[0].scheduler.embeddings_fingerprint if live and live[0].scheduler.config.encoder_budget else None

    async def _route_all(self, items: list[Unrouted], lost_worker: bool = False) -> None:
        """Route each in turn (`lost_worker`: drained from a lost worker -- a request that
        lost too many gets an error instead). Those not routed yet are in transit
        meanwhile: an abort takes them out, and a sibling that fails to route does not
        finish its parent's entry early."""
        self.ledger.start_transit(items)
        try:
            for item in items:
                if not self.ledger.end_transit(item):  # aborted meanwhile
                    continue
                losses = self.ledger.lost_worker(item.request_id) if lost_worker else 0
                if losses > self.config.max_reroutes:
                    await self._give_up(item, losses)
                else:
                    await self._route(item)
        finally:
            for item in items:
                self.ledger.end_transit(item)

    async def _give_up(self, state: SchedulerRequest, losses: int) -> None:
        event = TokenEvent(state.request_id, index=state.num_output_tokens, finish_reason="error",
                           error=f"request lost its worker {losses} times; giving up")
        done = self._close(state.request_id, state.parent_id)
        await self._publish(state.reply_channel, event)
        await self.stream.ack(done)

    # ---- requests out ----------------------------------------------------------------

    async def _finished(self, states: list[SchedulerRequest]) -> None:
        """A worker finished these requests (its step loop's update, in step order)."""
        done = [entry_id for state in states for entry_id in self._close(state.request_id, state.parent_id)]
        self.stream.ack_soon(done)  # not on the step's path: the ledger is closed already

    async def _publish(self, channel: str, event: TokenEvent) -> None:
        """An error event for a client; with Redis out of reach it is lost (logged), and the
        client's request ends by its timeout."""
        try:
            await self.redis.publish(channel, stream_encoder.encode([event]))
        except (aioredis.RedisError, OSError) as exc:
            log.warning("could not tell %s: %s", event.request_id, exc)

    def _close(self, request_id: str, parent_id: str | None = None) -> list[bytes]:
        """Take a done request out of the ledger, and its parent (n > 1) when that was its
        last child; the stream entries to acknowledge. Synchronous, and done before any
        await: a resubmitted copy of the request routed meanwhile (`_handle_entry`) must
        never be closed for it."""
        entry_id = self.ledger.close(request_id)
        done = [] if entry_id is None else [entry_id]
        if parent_id is not None:
            done += self._close_parent_if_done(parent_id)
        return done

    def _close_parent_if_done(self, parent_id: str) -> list[bytes]:
        """n > 1: the stream entry is the parent's, done with its last child (on a worker,
        parked or in transit)."""
        if (parent_id in self.ledger.entries and not self.pool.has_children(parent_id)
                and not self.ledger.has_unrouted_children(parent_id)):
            return self._close(parent_id)
        return []
