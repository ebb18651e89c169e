"""The gateway's backend interface served by the in-process engine instead of Redis.

`pagedserve engine` runs the gateway with this backend: the same HTTP, validation,
detokenizing and SSE code, the same scheduler and model cores — only Redis and gRPC are
gone. Benchmarks compare it with the full stack to price the service split.
"""

from __future__ import annotations

import asyncio
import time

from compose.engine import EngineConfig, InProcessEngine
from gateway.event_queues import DEFAULT_MAX_UNREAD, EventQueues
from proto.messages import NewRequest, SchedulerHeartbeat, TokenEvent, WorkerRegistration, WorkerStats

REPLY_CHANNEL = "in-process"


class InProcessBackend(EventQueues):
    """Implements what gateway.generation / preflight / app use of gateway.backend.RedisBackend."""

    def __init__(self, config: EngineConfig, max_unread_events: int = DEFAULT_MAX_UNREAD):
        super().__init__(max_unread_events)
        self._config = config
        self.reply_channel = REPLY_CHANNEL
        self._loop: asyncio.AbstractEventLoop | None = None
        self._engine: InProcessEngine | None = None
        self._registration: WorkerRegistration | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        # Loading the model takes seconds: off the event loop.
        self._engine = await asyncio.to_thread(InProcessEngine, self._config, self._on_events)
        self._engine.start()
        info = self._engine.info
        self._registration = WorkerRegistration(
            worker_id=info.worker_id, address="in-process", model=info.model, block_size=info.block_size,
            num_blocks=info.num_blocks, max_model_len=info.max_model_len, started_at=time.time())

    async def stop(self) -> None:
        if self._engine is not None:
            await asyncio.to_thread(self._engine.stop)

    def _on_events(self, events: dict[str, list[TokenEvent]]) -> None:
        """Engine thread → event loop."""
        batch = [e for group in events.values() for e in group]
        self._loop.call_soon_threadsafe(self.deliver, batch)

    async def shard_for(self, request: NewRequest) -> int:
        return 0  # one engine: no shards

    async def submit(self, request: NewRequest, shard: int = 0) -> None:
        self._engine.submit(request)

    async def abort(self, request_id: str, shard: int = 0) -> None:
        self._engine.abort(request_id)

    def abort_soon(self, request_id: str, shard: int = 0) -> None:
        self._engine.abort(request_id)

    async def live_workers(self) -> list[WorkerRegistration]:
        return [self._registration] if self._registration else []

    async def schedulers(self) -> list[SchedulerHeartbeat]:
        """The engine is its own scheduler: live while its thread runs, no waiting bound."""
        if self._engine is None or not self._engine.is_alive() or self._registration is None:
            return []
        return [SchedulerHeartbeat(scheduler_id="in-process", worker_ids=[self._registration.worker_id],
                                   num_waiting=0, max_waiting_requests=0, interval_s=0.0,
                                   updated_at=time.time())]

    @property
    def subscribed(self) -> bool:
        return True  # events come straight from the engine's thread

    async def worker_stats(self) -> list[WorkerStats]:
        stats = self._engine.stats if self._engine is not None else None
        return [stats] if stats is not None else []

    async def ping(self) -> bool:
        return self._engine is not None and self._engine.is_alive()
