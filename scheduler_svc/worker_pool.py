"""The workers one scheduler shard drives: discovery, leasing, joining, retiring, evacuation.

Workers register themselves in Redis (proto/registry.py). The pool reads the registry
now and then and keeps its shard's fair share of the live workers
(scheduler_svc/worker_leases.py): below it, it leases free workers; a leased worker is
dialled (gRPC `Describe`) and joins with a WorkerHandle -- its own BatchScheduler sized
from the worker's blocks, its channel, its metrics recorder, its lease's fencing token;
above it, its least loaded worker gets nothing new and is handed over (retired, its lease
released) once its requests are done. A registration that vanished (or was replaced by a
restarted worker), or a lease another shard holds now, retires its handle. A retired
handle is evacuated by its own step loop once that has stopped (so a step in flight is
never torn apart): it leaves the pool, its channel closes, its lease is released, and its
requests come back drained, to be re-routed. A retired worker that still
looks registered (a killed worker's key lingers until its TTL runs out) is not dialled
again for `retired_retry_s`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import redis.asyncio as aioredis

from proto import worker_pb2, worker_pb2_grpc
from proto.grpc_options import GRPC_OPTIONS
from proto.messages import WorkerRegistration
from proto.registry import WorkerRegistry
from scheduler_svc.metrics import WorkerRecorder
from scheduler_svc.policy.batching import BatchScheduler
from scheduler_svc.policy.config import SchedulerConfig
from scheduler_svc.policy.request import SchedulerRequest
from scheduler_svc.worker_leases import WorkerLeases, fair_share, preference

log = logging.getLogger("pagedserve.scheduler")


@dataclass
class WorkerHandle:
    registration: WorkerRegistration
    scheduler: BatchScheduler
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerStub
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # set: work for the step loop
    retiring: bool = False
    draining: bool = False  # its worker got SIGTERM: it finishes what it has, gets nothing new
    recorder: WorkerRecorder = field(default_factory=WorkerRecorder)  # request and step histograms
    schedules_ahead: bool = False  # async scheduling (SchedulerServiceConfig.schedules_ahead)
    task: asyncio.Task | None = None  # its step loop
    fencing_token: int = 0  # the token it joined under, stamped on every step (kept here: a lease
    # lost meanwhile must not leave its steps unfenced)
    handing_over: bool = False  # beyond the shard's share: retired once its requests are done

    @property
    def worker_id(self) -> str:
        return self.registration.worker_id

    def retire(self, why: str, level: int = logging.WARNING) -> None:
        """Route nothing more here; the step loop stops and evacuates the worker. `level`:
        INFO for a routine retirement (a hand-over), WARNING for a fault."""
        if not self.retiring:
            log.log(level, "retiring worker %s: %s", self.worker_id, why)
            self.retiring = True
            self.wake.set()


# After Redis restarts without its data, every worker's registration is gone until its next
# heartbeat (every second); a missing registration retires nobody for this long (the
# registration TTL: a worker that died meanwhile is retired right after, or by its Steps).
REDIS_RESTART_GRACE_S = 5.0


class WorkerPool:
    def __init__(self, registry: WorkerRegistry, redis: aioredis.Redis, batching: SchedulerConfig,
                 retired_retry_s: float, schedules_ahead: Callable[[worker_pb2.WorkerInfo], bool],
                 leases: WorkerLeases, shard: int = 0, led_shards: Callable[[], int] = lambda: 1) -> None:
        """`led_shards()`: how many shards have a leader now (the share is taken of those)."""
        self._registry = registry
        self.leases = leases
        self._shard = shard
        self._led_shards = led_shards
        self._redis = redis
        self._batching = batching
        self._retired_retry_s = retired_retry_s
        self._schedules_ahead = schedules_ahead
        self._workers: dict[str, WorkerHandle] = {}
        # Retired registrations (worker id, started_at) -> when to try them again.
        self._retired: dict[tuple[str, float], float] = {}
        self._redis_run_id: str | None = None  # the Redis server's run_id, new at each start
        self._grace_until = float("-inf")  # no retirement for a missing registration before this

    async def _redis_restarted(self) -> bool:
        """Whether Redis restarted since the last call (its run_id changed)."""
        run_id = (await self._redis.info("server"))["run_id"]
        restarted = self._redis_run_id is not None and run_id != self._redis_run_id
        self._redis_run_id = run_id
        return restarted

    def handles(self) -> list[WorkerHandle]:
        """Every worker in the pool, retiring ones included."""
        return list(self._workers.values())

    def live(self) -> list[WorkerHandle]:
        """The workers new requests may go to (not retiring, draining or being handed over)."""
        return [h for h in self._workers.values() if not (h.retiring or h.draining or h.handing_over)]

    def has_children(self, parent_id: str) -> bool:
        """True while a child of `parent_id` is unfinished on some worker."""
        return any(h.scheduler.has_children(parent_id) for h in self._workers.values())

    async def refresh(self) -> list[WorkerHandle]:
        """Read the registry: retire the workers whose registration is gone, hand over
        what is beyond the shard's share, lease and dial free workers up to it. Returns a
        handle for each that joined, to `add` (with its step loop)."""
        now = time.monotonic()
        try:
            snapshot = await self._registry.read(self._redis)
            await self._registry.forget(self._redis, snapshot.expired)
            live = snapshot.live
            if (self._redis_run_id is None or any(w not in live for w in self._workers)) \
                    and await self._redis_restarted():
                log.warning("Redis restarted empty: its workers have %.0f s to register again",
                            REDIS_RESTART_GRACE_S)
                self._grace_until = now + REDIS_RESTART_GRACE_S
        except (aioredis.RedisError, OSError) as exc:
            log.warning("worker discovery failed: %s", exc)
            return []
        for worker_id, handle in list(self._workers.items()):
            if worker_id not in live and now < self._grace_until:
                continue  # its registration went with Redis's data; its heartbeat writes it again
            if worker_id not in live or live[worker_id].started_at != handle.registration.started_at:
                handle.retire("its registration is gone")
            elif live[worker_id].draining and not handle.draining:
                log.info("worker %s is draining: no new requests go there", worker_id)
                handle.draining = True
        self._retired = {k: t for k, t in self._retired.items() if t > now}
        # In the grace after a Redis restart, the workers still registering count as live.
        counted = set(live) | (set(self._workers) if now < self._grace_until else set())
        share = fair_share(len(counted), self._led_shards())
        self._hand_over(share)
        driving = sum(1 for h in self._workers.values() if not h.retiring and not h.handing_over)
        joined: list[WorkerHandle] = []
        free = [w for w in live if w not in self._workers and (w, live[w].started_at) not in self._retired]
        for worker_id in preference(self._shard, free):
            if driving + len(joined) >= share:
                break
            if (handle := await self._join(live[worker_id])) is not None:
                joined.append(handle)
        return joined

    def _hand_over(self, share: int) -> None:
        """Beyond `share`: the least loaded worker gets nothing new; a worker being handed
        over whose requests are done is retired (its step loop ends, `evacuate` releases
        its lease for a shard below its share)."""
        keeping = [h for h in self._workers.values() if not h.retiring and not h.handing_over]
        if len(keeping) > share:
            handle = min(keeping, key=lambda h: h.scheduler.load)
            log.info("worker %s goes to another shard (this one drives %d, its share is %d)",
                     handle.worker_id, len(keeping), share)
            handle.handing_over = True
        for handle in self._workers.values():
            if handle.handing_over and not handle.retiring and not handle.scheduler.queues:
                handle.retire("handed over to another shard", logging.INFO)

    async def _join(self, reg: WorkerRegistration) -> WorkerHandle | None:
        """Lease the worker and dial it; None if another shard holds it or it does not answer."""
        try:
            token = await self.leases.acquire(reg.worker_id)
        except (aioredis.RedisError, OSError) as exc:
            log.warning("could not lease worker %s: %s", reg.worker_id, exc)
            return None
        if not token:
            return None
        handle = await self._dial(reg)
        if handle is None:
            await self.leases.release(reg.worker_id)
            return None
        handle.fencing_token = token
        return handle

    async def renew_leases(self) -> None:
        """Renew the workers' leases; a worker whose lease another shard took is retired
        (its steps would be refused). Redis errors are the caller's."""
        for worker_id in await self.leases.renew():
            if (handle := self._workers.get(worker_id)) is not None:
                handle.retire("another shard holds its lease")

    async def _dial(self, reg: WorkerRegistration) -> WorkerHandle | None:
        channel = grpc.aio.insecure_channel(reg.address, options=GRPC_OPTIONS)
        stub = worker_pb2_grpc.WorkerStub(channel)
        try:
            info = await stub.Describe(worker_pb2.DescribeRequest(), timeout=5)
        except grpc.aio.AioRpcError as exc:
            log.warning("worker %s at %s does not answer: %s", reg.worker_id, reg.address, exc.code())
            await channel.close()
            return None
        ahead = self._schedules_ahead(info)
        scheduler = BatchScheduler.for_worker(self._batching, info)
        log.info("worker %s joined (%s on %s, %d blocks, async scheduling %s)",
                 reg.worker_id, reg.address, info.device or "?", info.num_blocks, "on" if ahead else "off")
        return WorkerHandle(reg, scheduler, channel, stub, schedules_ahead=ahead)

    def add(self, handle: WorkerHandle) -> None:
        self._workers[handle.worker_id] = handle

    async def evacuate(self, handle: WorkerHandle) -> list[SchedulerRequest]:
        """Take a retired worker, whose step loop has stopped, out of the pool; its
        unfinished requests, reset to be recomputed elsewhere."""
        if self._workers.get(handle.worker_id) is handle:
            del self._workers[handle.worker_id]
        if not handle.handing_over:
            self._retired[(handle.worker_id, handle.registration.started_at)] = (
                time.monotonic() + self._retired_retry_s)
        await _close(handle)
        await self.leases.release(handle.worker_id)
        return handle.scheduler.drain()

    async def close(self) -> None:
        """Close every channel and release every lease (the shard is stopping)."""
        for handle in list(self._workers.values()):
            await _close(handle)
        await self.leases.release_all()


async def _close(handle: WorkerHandle) -> None:
    try:
        await handle.channel.close()
    except Exception as exc:
        log.warning("closing the channel to worker %s: %s", handle.worker_id, exc)
