"""The scheduler service's worker membership, a mixin of SchedulerService
(scheduler_svc/service.py), whose state it reads and changes: discovering workers in the
registry, joining a new one (a WorkerHandle with its own BatchScheduler and step loop),
cutting its multi-step steps short, retiring a lost one and re-routing its unfinished
requests to live workers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace

import grpc
import redis.asyncio as aioredis

from proto import worker_pb2, worker_pb2_grpc
from proto.messages import TokenEvent, WorkerRegistration, registration_decoder
from scheduler_svc.batching import BatchScheduler
from scheduler_svc.metrics import WorkerRecorder

log = logging.getLogger("pagedserve.scheduler")


@dataclass
class WorkerHandle:
    registration: WorkerRegistration
    scheduler: BatchScheduler
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerStub
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    retiring: bool = False
    stats_at: float = 0.0  # time.monotonic() of the last WorkerStats written
    recorder: WorkerRecorder = field(default_factory=WorkerRecorder)  # request and step histograms
    schedules_ahead: bool = False  # async scheduling (SchedulerServiceConfig.schedules_ahead)
    cuttable: int = 0  # the multi-step step in flight, until a Cut was sent for it
    task: asyncio.Task | None = None

    @property
    def worker_id(self) -> str:
        return self.registration.worker_id


class WorkersMixin:
    """SchedulerService's worker discovery, joining, retiring and evacuation."""

    async def _live_registrations(self) -> dict[str, WorkerRegistration]:
        ids = sorted(m.decode() for m in await self.redis.smembers(self.keys.workers))
        values = await self.redis.mget([self.keys.worker(i) for i in ids]) if ids else []
        live = {}
        for worker_id, raw in zip(ids, values):
            if raw is None:  # its heartbeat expired: forget it for good
                await self.redis.srem(self.keys.workers, worker_id)
            else:
                live[worker_id] = registration_decoder.decode(raw)
        return live

    async def _discover_workers(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.config.discovery_interval_s)
            await self._refresh_workers()

    async def _refresh_workers(self) -> None:
        try:
            live = await self._live_registrations()
        except aioredis.RedisError as exc:
            log.warning("worker discovery failed: %s", exc)
            return
        for worker_id, handle in list(self.workers.items()):
            if worker_id not in live or live[worker_id].started_at != handle.registration.started_at:
                self._retire(handle, "its registration is gone")
        now = time.monotonic()
        self.retired = {k: t for k, t in self.retired.items() if t > now}
        for worker_id, reg in live.items():
            if worker_id not in self.workers and (worker_id, reg.started_at) not in self.retired:
                await self._add_worker(reg)

    async def _add_worker(self, reg: WorkerRegistration) -> None:
        channel = grpc.aio.insecure_channel(reg.address, options=[
            ("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)])
        stub = worker_pb2_grpc.WorkerStub(channel)
        try:
            info = await stub.Describe(worker_pb2.DescribeRequest(), timeout=5)
        except grpc.aio.AioRpcError as exc:
            log.warning("worker %s at %s does not answer: %s", reg.worker_id, reg.address, exc.code())
            await channel.close()
            return
        ahead = self.config.schedules_ahead(info)
        # Steps planned ahead have one pass: multi-step is for steps planned one at a time.
        batching = replace(self.config.batching, num_scheduler_steps=1) if ahead else self.config.batching
        scheduler = BatchScheduler(batching, num_blocks=info.num_blocks,
                                   block_size=info.block_size, max_model_len=info.max_model_len,
                                   num_cpu_blocks=info.num_cpu_blocks)
        handle = WorkerHandle(reg, scheduler, channel, stub, schedules_ahead=ahead)
        self.workers[reg.worker_id] = handle
        handle.task = asyncio.create_task(self._step_loop(handle), name=f"steps-{reg.worker_id}")
        log.info("worker %s joined (%s on %s, %d blocks, async scheduling %s, %d passes a step at most)",
                 reg.worker_id, reg.address, info.device or "?", info.num_blocks,
                 "on" if ahead else "off", batching.num_scheduler_steps)
        pending, self.unassigned = self.unassigned, []
        await self._route_all(pending)

    async def _cut(self, handle: WorkerHandle, step_id: int) -> None:
        """End the worker's multi-step step after its current pass (a request arrived)."""
        try:
            await handle.stub.Cut(worker_pb2.CutRequest(step_id=step_id), timeout=5)
        except grpc.aio.AioRpcError as exc:  # the step only ends later: nothing is lost
            log.warning("Cut of step %d on worker %s failed: %s", step_id, handle.worker_id, exc.code())

    def _retire(self, handle: WorkerHandle, why: str) -> None:
        if not handle.retiring:
            log.warning("retiring worker %s: %s", handle.worker_id, why)
            handle.retiring = True
            handle.wake.set()

    async def _evacuate(self, handle: WorkerHandle) -> None:
        """Move a retired worker's unfinished requests to live workers (they recompute)."""
        if self.workers.get(handle.worker_id) is handle:
            del self.workers[handle.worker_id]
            self.metrics.forget_worker(handle.worker_id)
        self.retired[(handle.worker_id, handle.registration.started_at)] = (
            time.monotonic() + self.config.retired_retry_s)
        try:
            await handle.channel.close()
        except Exception as exc:
            log.warning("closing the channel to worker %s: %s", handle.worker_id, exc)
        states = handle.scheduler.drain()
        self.in_transit.extend(states)
        try:
            for state in states:
                if not self._untransit(state):  # aborted while an earlier one was handled
                    continue
                self.owner.pop(state.request_id, None)
                count = self.reroutes.get(state.request_id, 0) + 1
                self.reroutes[state.request_id] = count
                if count > self.config.max_reroutes:
                    event = TokenEvent(state.request_id, index=len(state.token_ids) - state.num_prompt_tokens,
                                       finish_reason="error",
                                       error=f"request lost its worker {count} times; giving up")
                    try:
                        await self._publish(state.reply_channel, event)
                    except aioredis.RedisError as exc:
                        log.warning("could not tell %s it failed: %s", state.request_id, exc)
                    await self._finish(state.request_id)
                    if state.parent_id is not None:
                        await self._maybe_finish_parent(state.parent_id)
                else:
                    await self._route(state)
        finally:
            for state in states:
                self._untransit(state)
