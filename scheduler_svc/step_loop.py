"""One worker's step loop: schedule() -> the worker's Steps stream (gRPC) -> update().

With async scheduling (by default for accelerator workers), while a step runs on the
worker the loop plans and sends the next one (BatchScheduler.can_schedule_ahead), so the
worker goes from one step straight into the next instead of waiting a round trip for it.
Finished requests go to `on_finished` (the service acknowledges them). Every stats
interval (`--stats-interval`, 1 s), and whenever the loop goes idle, it writes the worker's
WorkerStats to Redis (and to the scheduler's /metrics); when idle it runs check_integrity()
first.

The loop ends when its worker is retired: a step failed (the stream broke, no result
within `step_timeout_s`, or a result broke the step contract) or the pool retired it.
Only the loop drains its worker afterwards (WorkerPool.evacuate), so a step in flight is
never torn apart.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable

import grpc
import redis.asyncio as aioredis

from proto import worker_pb2
from proto.keys import RedisKeys
from proto.messages import stream_encoder
from scheduler_svc.metrics import SchedulerMetrics, worker_stats
from scheduler_svc.policy.request import SchedulerRequest
from scheduler_svc.worker_pool import WorkerHandle

log = logging.getLogger("pagedserve.scheduler")


class StepLoop:
    def __init__(self, handle: WorkerHandle, redis: aioredis.Redis, keys: RedisKeys,
                 metrics: SchedulerMetrics, step_timeout_s: float, stats_interval_s: float,
                 on_finished: Callable[[list[SchedulerRequest]], Awaitable[None]], fencing_token: int = 0) -> None:
        """`fencing_token`: the worker lease's token (scheduler_svc/worker_leases.py), stamped on
        every step (0: not fenced)."""
        self._handle = handle
        self._redis = redis
        self._keys = keys
        self._metrics = metrics
        self._step_timeout_s = step_timeout_s
        self._stats_interval_s = stats_interval_s
        self._on_finished = on_finished
        self._fencing_token = fencing_token
        self._stats_at = 0.0  # time.monotonic() of the last WorkerStats written

    async def run(self) -> None:
        """Drive the worker until it is retired."""
        handle, scheduler = self._handle, self._handle.scheduler
        steps = handle.stub.Steps()  # results come back in the order the steps went
        in_flight: deque[worker_pb2.StepRequest] = deque()  # oldest first
        try:
            while not handle.retiring:
                if not in_flight:
                    step = scheduler.schedule()
                    if step is None:
                        # Idle: a consistent moment to self-check; repeated while idle so
                        # readers of the stats can tell fresh from stale by updated_at.
                        await self._write_stats(check=True)
                        try:
                            await asyncio.wait_for(handle.wake.wait(), self._stats_interval_s)
                        except TimeoutError:
                            continue
                        handle.wake.clear()
                        continue
                    in_flight.append(await self._send(steps, step))
                if handle.schedules_ahead and scheduler.can_schedule_ahead():
                    ahead = scheduler.schedule()
                    if ahead is not None:
                        in_flight.append(await self._send(steps, ahead))
                if not await self._update(steps, in_flight.popleft()):
                    break
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:  # a write to a broken stream
            handle.retire(f"Steps stream failed: {exc}")
        finally:
            steps.cancel()  # retired with steps in flight: the worker is gone

    async def _send(self, steps: grpc.aio.StreamStreamCall, step: worker_pb2.StepRequest) -> worker_pb2.StepRequest:
        """Send the step on the worker's stream (on its way once this returns)."""
        self._handle.recorder.scheduled(self._handle.scheduler, step)
        step.fencing_token = self._fencing_token
        await steps.write(step)
        return step

    async def _update(self, steps: grpc.aio.StreamStreamCall, step: worker_pb2.StepRequest) -> bool:
        """Await the step's result and apply it; False (and the worker retired) if it failed."""
        handle, scheduler = self._handle, self._handle.scheduler
        try:
            async with asyncio.timeout(self._step_timeout_s):
                result = await steps.read()
            if result is grpc.aio.EOF:
                raise EOFError("the worker ended the Steps stream")
        except (grpc.aio.AioRpcError, TimeoutError, EOFError) as exc:
            why = (f"{exc.code().name} {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError)
                   else str(exc) or f"no result in {self._step_timeout_s} s")
            handle.retire(f"step {step.step_id} failed: {why}")
            return False
        try:
            finished = scheduler.update(step, result)
        except ValueError as exc:  # the worker broke the Step contract: stop trusting it
            handle.retire(f"bad StepResult: {exc}")
            return False
        handle.recorder.stepped(scheduler, step, result, finished)
        if finished:
            await self._on_finished(finished)  # all at once: their ledger entries close before any await
        if time.monotonic() - self._stats_at >= self._stats_interval_s:
            await self._write_stats(check=False)  # under load too, every stats interval
        return True

    async def _write_stats(self, check: bool) -> None:
        """WorkerStats to Redis; with `check`, after check_integrity() (O(blocks): when idle)."""
        handle = self._handle
        self._stats_at = time.monotonic()
        stats = worker_stats(handle.scheduler, handle.worker_id, check, handle.recorder)
        self._metrics.publish(stats)
        if stats.integrity_error:
            log.error("worker %s: block pool integrity: %s", handle.worker_id, stats.integrity_error)
        try:
            await self._redis.set(self._keys.worker_stats(handle.worker_id), stream_encoder.encode(stats), ex=3600)
        except (aioredis.RedisError, OSError) as exc:
            log.warning("could not write stats: %s", exc)
