"""The scheduler service: the Redis and gRPC shell around one BatchScheduler per worker.

Three kinds of task share one asyncio loop:
  * `_read_requests` — XREADGROUP on the requests stream; routes NewRequest to a worker
    (prefix-aware: `scheduler_svc.routing`) and AbortRequest to whichever worker holds
    the request;
  * `_discover_workers` — polls the registry; a new registration gets a WorkerHandle and
    its own step loop, a vanished one is retired and its requests re-routed;
  * `_step_loop` (one per worker) — schedule() → the worker's Steps stream (gRPC) →
    update(), XACKing finished requests. With async scheduling (by default for
    accelerator workers), while a step runs on the worker the loop plans and sends the
    next one (BatchScheduler.can_schedule_ahead), so the worker goes from one step
    straight into the next instead of waiting a round trip for it. While a multi-step step runs
    (--num-scheduler-steps), a request routed to its worker sends Cut, so the step ends
    after its current pass and the newcomer's prefill comes next.
    Only this loop drains its worker, so a step in flight is never torn apart.

Worker discovery, joining, retiring and re-routing a lost worker's requests:
scheduler_svc/workers.py (WorkerHandle, WorkersMixin).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import grpc
import msgspec
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from proto import worker_pb2
from proto.keys import SCHEDULER_GROUP, STREAM_FIELD, RedisKeys
from proto.messages import AbortRequest, NewRequest, TokenEvent, stream_decoder, stream_encoder
from proto.parallel import parent_request_id
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.request import RequestState
from scheduler_svc.stats import worker_stats
from scheduler_svc.routing import pick_worker
from scheduler_svc.workers import WorkerHandle, WorkersMixin

log = logging.getLogger("pagedserve.scheduler")


@dataclass(frozen=True)
class SchedulerServiceConfig:
    batching: SchedulerConfig = field(default_factory=SchedulerConfig)
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "pagedserve"
    # Fixed per instance so a restarted scheduler re-reads what it had not acknowledged.
    consumer_name: str = field(default_factory=lambda: f"scheduler-{socket.gethostname()}")
    discovery_interval_s: float = 0.5
    step_timeout_s: float = 120.0
    max_reroutes: int = 2  # a request whose worker died this often gets an error instead
    read_batch: int = 256
    max_early_aborts: int = 10_000
    idle_stats_interval_s: float = 1.0
    retired_retry_s: float = 30.0  # a retired worker that still looks registered is redialled after this
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0  # /metrics (scheduler_svc/metrics.py) on this port; 0 = none
    # Plan step k+1 while step k runs (scheduler_svc/batching.py): "on", "off", or "auto":
    # on for a worker that computes on an accelerator, off for one on the CPU, where the
    # host work it overlaps with a step competes with that step for the same cores
    # (docs/performance.md has the numbers).
    async_scheduling: str = "auto"

    def __post_init__(self) -> None:
        if self.async_scheduling not in ("auto", "on", "off"):
            raise ValueError(f"async_scheduling must be 'auto', 'on' or 'off', got {self.async_scheduling!r}")

    def schedules_ahead(self, info: worker_pb2.WorkerInfo) -> bool:
        """Whether steps for this worker are planned while the one before runs."""
        if self.async_scheduling == "auto":
            return info.device not in ("", "cpu")
        return self.async_scheduling == "on"


class SchedulerService(WorkersMixin):
    def __init__(self, config: SchedulerServiceConfig):
        self.config = config
        self.keys = RedisKeys(config.key_prefix)
        self.redis = aioredis.Redis.from_url(config.redis_url)
        self.workers: dict[str, WorkerHandle] = {}
        self.owner: dict[str, WorkerHandle] = {}  # request id → the worker holding it
        self.entry_ids: dict[str, bytes] = {}  # request id → its stream entry, acked when done
        self.unassigned: list[NewRequest | RequestState] = []  # waiting for a live worker
        self.reroutes: dict[str, int] = {}
        # Retired registrations (worker id, started_at) → when to try them again: a killed
        # worker's registration lingers until its TTL runs out; don't redial it meanwhile.
        self.retired: dict[tuple[str, float], float] = {}
        # Aborts that overtook their NewRequest (the gateway's XADD was cancelled midway):
        # remembered, boundedly, so the request is dropped when it does arrive.
        self.early_aborts: OrderedDict[str, None] = OrderedDict()
        self.in_transit: list[NewRequest | RequestState] = []  # being routed by _route_all
        self.metrics = SchedulerMetrics()
        self._cuts: set[asyncio.Task] = set()  # Cut RPCs under way
        self._stopping = False

    # ---- lifecycle -------------------------------------------------------------------

    async def run(self, stop: asyncio.Event | None = None) -> None:
        stop = stop or asyncio.Event()
        try:
            await self.redis.xgroup_create(self.keys.requests, SCHEDULER_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        await self._refresh_workers()  # know every live worker before routing anything
        metrics_server = self.metrics.serve(self.config.metrics_host, self.config.metrics_port)
        tasks = [asyncio.create_task(self._read_requests(), name="read-requests"),
                 asyncio.create_task(self._discover_workers(), name="discover-workers")]
        log.info("scheduler %s reading %s", self.config.consumer_name, self.keys.requests)
        waiter = asyncio.create_task(stop.wait())
        done: set[asyncio.Task] = set()
        try:
            done, _ = await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
        finally:
            # The loops also check _stopping: a blocking redis-py read may swallow a cancellation.
            self._stopping = True
            everything = [waiter, *tasks, *(h.task for h in self.workers.values() if h.task)]
            try:
                for task in everything:
                    task.cancel()
                await asyncio.wait(everything, timeout=3)
            finally:
                for handle in list(self.workers.values()):
                    try:
                        await handle.channel.close()
                    except Exception as exc:
                        log.warning("closing the channel to worker %s: %s", handle.worker_id, exc)
                if metrics_server is not None:
                    metrics_server.close()
                await self.redis.aclose()
        for task in done:  # surface a crashed reader/discovery task instead of hiding it
            if task is not waiter and not task.cancelled() and task.exception():
                raise task.exception()

    # ---- requests in -----------------------------------------------------------------

    async def _read_requests(self) -> None:
        # First our own pending entries (delivered before a restart), then new ones. A
        # history read returns the pending entries after `stream_id`, acked or not, so it
        # moves past each batch; an empty history read means the history is done.
        stream_id: str | bytes = "0"
        history = True
        while not self._stopping:
            reply = await self.redis.xreadgroup(
                SCHEDULER_GROUP, self.config.consumer_name, {self.keys.requests: stream_id},
                count=self.config.read_batch, block=None if history else 1000)
            entries = reply[0][1] if reply else []
            if history:
                if not entries:
                    history, stream_id = False, ">"
                    continue
                stream_id = entries[-1][0]
            for entry_id, fields in entries:
                await self._handle_entry(entry_id, fields)

    async def _handle_entry(self, entry_id: bytes, fields: dict) -> None:
        try:
            message = stream_decoder.decode(fields[STREAM_FIELD])
        except (KeyError, TypeError, msgspec.DecodeError) as exc:  # TypeError: deleted, still pending
            log.error("dropping malformed stream entry %s: %s", entry_id, exc)
            await self._ack(entry_id)
            return
        if isinstance(message, AbortRequest):
            await self._ack(entry_id)
            await self._abort(message.request_id)
            return
        if message.request_id in self.entry_ids:  # re-delivered while still in flight
            return
        if message.request_id in self.early_aborts:
            del self.early_aborts[message.request_id]
            await self._ack(entry_id)
            return
        self.entry_ids[message.request_id] = entry_id
        await self._route(message)

    async def _abort(self, request_id: str) -> None:
        """Abort a request wherever it is -- on a worker, parked in `unassigned`, or in
        transit between workers -- and (n > 1) its children wherever each is: forked on
        the parent's worker or re-routed one by one after a worker loss. A child's id
        (`p/1`, proto/parallel.py) aborts that child alone; the parent's entry is done with
        its last child. A request id not seen yet is remembered (boundedly) as an early
        abort: its NewRequest is dropped when it arrives."""
        parent_id = parent_request_id(request_id)

        def is_child(rid: str) -> bool:
            return parent_request_id(rid) == request_id

        # Waiting for a live worker or between workers: removed first, so nothing routes
        # them afterwards (_route_all and _evacuate skip what is no longer in transit).
        gone = [r.request_id for r in (*self.unassigned, *self.in_transit)
                if r.request_id == request_id or is_child(r.request_id)]
        if gone:
            self.unassigned = [r for r in self.unassigned if r.request_id not in gone]
            self.in_transit = [r for r in self.in_transit if r.request_id not in gone]
        # On workers: its own (a forked child lives on its parent's worker) and those of
        # children re-routed one by one. abort_request(parent) aborts a parent's children.
        children = [rid for rid in self.owner if is_child(rid)]
        holders = (self.owner.get(request_id), self.owner.get(parent_id) if parent_id else None,
                   *(self.owner[rid] for rid in children))
        for handle in {id(h): h for h in holders if h is not None}.values():
            if handle.scheduler.abort_request(request_id):
                handle.wake.set()  # the worker learns to forget it in the next step
                gone.append(request_id)
        for child_id in {*children, *(rid for rid in gone if is_child(rid))}:
            self._forget(child_id)  # children have no stream entry of their own
        if parent_id is not None:
            self._forget(request_id)
            if gone:  # else already finished (the finish did this) or not forked yet
                await self._maybe_finish_parent(parent_id)
        elif request_id in self.entry_ids:
            await self._finish(request_id)
        else:
            self.early_aborts[request_id] = None
            while len(self.early_aborts) > self.config.max_early_aborts:
                self.early_aborts.popitem(last=False)

    async def _route(self, item: NewRequest | RequestState) -> None:
        """The live worker holding the longest cached prefix of the request's tokens,
        unless it is much more loaded than another (the score: scheduler_svc.routing)."""
        live = [h for h in self.workers.values() if not h.retiring]
        if not live:
            self.unassigned.append(item)
            return
        tokens = item.prompt_token_ids if isinstance(item, NewRequest) else item.token_ids
        handle = pick_worker(live, tokens, lambda h: h.scheduler)
        add = handle.scheduler.add_request if isinstance(item, NewRequest) else handle.scheduler.add_state
        error = add(item)
        if error is not None:  # it can never fit on that worker: tell the client, drop it
            await self._publish(item.reply_channel, error)
            await self._finish(item.request_id)
            if isinstance(item, RequestState) and item.parent_id is not None:
                await self._maybe_finish_parent(item.parent_id)
            return
        self.owner[item.request_id] = handle
        handle.wake.set()
        if handle.cuttable:  # a multi-step step runs: end it after its current pass
            step_id, handle.cuttable = handle.cuttable, 0
            task = asyncio.create_task(self._cut(handle, step_id))  # routing goes on meanwhile
            self._cuts.add(task)  # held until done: the loop keeps only weak references
            task.add_done_callback(self._cuts.discard)

    # ---- workers ---------------------------------------------------------------------

    async def _route_all(self, items: list[NewRequest | RequestState]) -> None:
        """Route each in turn; those not routed yet count as unfinished children meanwhile
        (so a sibling that fails to route does not finish its parent's entry early)."""
        self.in_transit.extend(items)
        try:
            for item in items:
                if self._untransit(item):  # else aborted meanwhile
                    await self._route(item)
        finally:
            for item in items:
                self._untransit(item)

    async def _step_loop(self, handle: WorkerHandle) -> None:
        try:
            await self._steps(handle)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug or a Redis error: never leave a dead loop holding requests
            log.exception("step loop of worker %s crashed", handle.worker_id)
            self._retire(handle, "its step loop crashed")
        finally:
            if not self._stopping:
                try:
                    await self._evacuate(handle)
                except Exception:
                    log.exception("re-routing the requests of worker %s failed", handle.worker_id)

    async def _send(self, handle: WorkerHandle, steps: grpc.aio.StreamStreamCall,
                    step: worker_pb2.StepRequest) -> worker_pb2.StepRequest:
        """Send the step on the worker's stream (on its way once this returns)."""
        handle.recorder.scheduled(handle.scheduler, step)
        await steps.write(step)
        return step

    async def _steps(self, handle: WorkerHandle) -> None:
        scheduler = handle.scheduler
        steps = handle.stub.Steps()  # results come back in the order the steps went
        in_flight: deque[worker_pb2.StepRequest] = deque()  # oldest first
        try:
            while not handle.retiring:
                if not in_flight:
                    step = scheduler.schedule()
                    if step is None:
                        # Idle: a consistent moment to self-check; repeated while idle so
                        # readers of the stats can tell fresh from stale by updated_at.
                        await self._write_stats(handle)
                        try:
                            await asyncio.wait_for(handle.wake.wait(), self.config.idle_stats_interval_s)
                        except TimeoutError:
                            continue
                        handle.wake.clear()
                        continue
                    in_flight.append(await self._send(handle, steps, step))
                if handle.schedules_ahead and scheduler.can_schedule_ahead():
                    ahead = scheduler.schedule()
                    if ahead is not None:
                        in_flight.append(await self._send(handle, steps, ahead))
                step = in_flight.popleft()
                handle.cuttable = step.step_id if step.num_passes > 1 else 0
                updated = await self._update(handle, step, steps)
                handle.cuttable = 0
                if not updated:
                    break
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:  # a write to a broken stream
            self._retire(handle, f"Steps stream failed: {exc}")
        finally:
            steps.cancel()  # retired with steps in flight: the worker is gone

    async def _update(self, handle: WorkerHandle, step: worker_pb2.StepRequest,
                      steps: grpc.aio.StreamStreamCall) -> bool:
        """Await the step's result and apply it; False (and the worker retired) if it failed."""
        scheduler = handle.scheduler
        try:
            async with asyncio.timeout(self.config.step_timeout_s):
                result = await steps.read()
            if result is grpc.aio.EOF:
                raise EOFError("the worker ended the Steps stream")
        except (grpc.aio.AioRpcError, TimeoutError, EOFError) as exc:
            why = (f"{exc.code().name} {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError)
                   else str(exc) or f"no result in {self.config.step_timeout_s} s")
            self._retire(handle, f"step {step.step_id} failed: {why}")
            return False
        try:
            finished = scheduler.update(step, result)
        except ValueError as exc:  # the worker broke the Step contract: stop trusting it
            self._retire(handle, f"bad StepResult: {exc}")
            return False
        handle.recorder.stepped(scheduler, step, result, finished)
        for state in finished:
            await self._finish(state.request_id)
            if state.parent_id is not None:
                await self._maybe_finish_parent(state.parent_id)
        if time.monotonic() - handle.stats_at >= self.config.idle_stats_interval_s:
            await self._write_stats(handle, check=False)  # under load too, about once a second
        return True

    def _untransit(self, item: NewRequest | RequestState) -> bool:
        """Take `item` out of `in_transit`; False if it was not there (an abort took it)."""
        before = len(self.in_transit)
        self.in_transit = [r for r in self.in_transit if r is not item]
        return len(self.in_transit) < before

    async def _write_stats(self, handle: WorkerHandle, check: bool = True) -> None:
        """WorkerStats to Redis; with `check`, after check_integrity() (O(blocks): when idle)."""
        handle.stats_at = time.monotonic()
        stats = worker_stats(handle.scheduler, handle.worker_id, check, handle.recorder)
        self.metrics.publish(stats)
        if stats.integrity_error:
            log.error("worker %s: block pool integrity: %s", handle.worker_id, stats.integrity_error)
        try:
            await self.redis.set(self.keys.worker_stats(handle.worker_id), stream_encoder.encode(stats),
                                 ex=3600)
        except aioredis.RedisError as exc:
            log.warning("could not write stats: %s", exc)

    # ---- requests out ----------------------------------------------------------------

    async def _publish(self, channel: str, event: TokenEvent) -> None:
        await self.redis.publish(channel, stream_encoder.encode([event]))

    async def _finish(self, request_id: str) -> None:
        entry_id = self.entry_ids.get(request_id)
        self._forget(request_id)
        if entry_id is not None:
            await self._ack(entry_id)

    def _has_children(self, parent_id: str) -> bool:
        """True while a child of `parent_id` is unfinished on a worker or waits for one."""
        return (any(h.scheduler.has_children(parent_id) for h in self.workers.values())
                or any(parent_request_id(item.request_id) == parent_id
                       for item in (*self.unassigned, *self.in_transit)))

    async def _maybe_finish_parent(self, parent_id: str) -> None:
        """n > 1: the stream entry is the parent's, done with its last child."""
        if parent_id in self.entry_ids and not self._has_children(parent_id):
            await self._finish(parent_id)

    def _forget(self, request_id: str) -> None:
        self.owner.pop(request_id, None)
        self.entry_ids.pop(request_id, None)
        self.reroutes.pop(request_id, None)

    async def _ack(self, entry_id: bytes) -> None:
        """Acknowledge and delete: a finished request's entry is of no further use."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.xack(self.keys.requests, SCHEDULER_GROUP, entry_id)
        pipe.xdel(self.keys.requests, entry_id)
        await pipe.execute()
