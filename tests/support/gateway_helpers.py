"""Shared pieces of the gateway tests: the app under httpx, a registered (fake) worker, and a
fake worker loop that answers NewRequests with scripted TokenEvents."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
import uvicorn
import msgspec
import redis
import redis.asyncio as aioredis

from compose.launcher import free_port
from gateway.app import create_app
from gateway.config import GatewayConfig
from proto.keys import STREAM_FIELD, RedisKeys
from proto.messages import (NewRequest, SchedulerHeartbeat, StreamMessage, TokenEvent,
                            WorkerRegistration, stream_decoder)

MODEL = "tiny"


def sse_events(text: str) -> list:
    """The JSON events of an SSE body, which must end in `data: [DONE]`."""
    lines = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def make_config(model_dir, redis_url: str, **overrides) -> GatewayConfig:
    """A config with its own key prefix, so tests never see each other's workers or streams."""
    values = dict(model=str(model_dir), served_model_name=MODEL, redis_url=redis_url,
                  key_prefix=f"test-{uuid.uuid4().hex[:8]}", worker_cache_ttl_s=0.0)
    values.update(overrides)
    return GatewayConfig(**values)


def register_worker(config: GatewayConfig, *, model: str = MODEL, max_model_len: int = 128,
                    worker_id: str = "w0", ttl_s: int = 30) -> None:
    keys = RedisKeys(config.key_prefix)
    registration = WorkerRegistration(worker_id=worker_id, address="127.0.0.1:1", model=model,
                                      block_size=16, num_blocks=64, max_model_len=max_model_len,
                                      started_at=time.time())
    client = redis.Redis.from_url(config.redis_url)
    client.set(keys.worker(worker_id), msgspec.msgpack.encode(registration), ex=ttl_s)
    client.sadd(keys.workers, worker_id)
    beat_as_scheduler(config, [worker_id], ttl_s=ttl_s)


def beat_as_scheduler(config: GatewayConfig, worker_ids: list[str], *, num_waiting: int = 0,
                      max_waiting_requests: int = 0, ttl_s: int = 30,
                      scheduler_id: str = "fake-scheduler") -> None:
    """The heartbeat a scheduler driving `worker_ids` writes (scheduler_svc/heartbeat.py),
    for the tests where FakeWorker plays the scheduler: the gateway admits requests only
    while one is live."""
    keys = RedisKeys(config.key_prefix)
    heartbeat = SchedulerHeartbeat(scheduler_id=scheduler_id, worker_ids=worker_ids,
                                   num_waiting=num_waiting, max_waiting_requests=max_waiting_requests,
                                   interval_s=1.0, updated_at=time.time())
    client = redis.Redis.from_url(config.redis_url)
    client.set(keys.scheduler(heartbeat.scheduler_id), msgspec.msgpack.encode(heartbeat), ex=ttl_s)
    client.sadd(keys.schedulers, heartbeat.scheduler_id)


@asynccontextmanager
async def served(config):
    """The app under a real uvicorn on a free port (ASGITransport cannot disconnect mid-stream)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(config), host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "uvicorn exited"
        await asyncio.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


@asynccontextmanager
async def gateway_client(config: GatewayConfig) -> AsyncIterator[httpx.AsyncClient]:
    """The app with its lifespan running, called in-process (responses are buffered)."""
    app = create_app(config)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            client.app = app  # tests reach app.state through it
            yield client
    # The app's background tasks end with its lifespan: one left running would hang the
    # test runner's closing (it cancels and awaits every task, and redis-py can swallow that).
    left = [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("gateway-") and not t.done()]
    assert not left, f"the gateway left tasks running after its lifespan: {left}"


Script = Callable[[NewRequest], list[list[TokenEvent]]]


class FakeWorker:
    """Reads the requests stream like the scheduler would; answers each NewRequest by
    publishing the batches `script(request)` returns, and records every message."""

    def __init__(self, config: GatewayConfig, script: Script):
        self.keys = RedisKeys(config.key_prefix)
        self.client = aioredis.Redis.from_url(config.redis_url)
        self.script = script
        self.messages: list[StreamMessage] = []
        self._task: asyncio.Task | None = None
        self._stopping = False

    async def __aenter__(self) -> FakeWorker:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc) -> None:
        # Stopped by a flag, not cancel(): a redis-py read cancelled mid-XREAD can hang.
        self._stopping = True
        await self._task
        await self.client.aclose()

    async def _run(self) -> None:
        last_id = "0"
        while not self._stopping:
            for _, entries in await self.client.xread({self.keys.requests: last_id}, block=100) or []:
                for entry_id, fields in entries:
                    last_id = entry_id
                    message = stream_decoder.decode(fields[STREAM_FIELD])
                    self.messages.append(message)
                    if isinstance(message, NewRequest):
                        for batch in self.script(message):
                            await self.client.publish(message.reply_channel, msgspec.msgpack.encode(batch))

    async def wait_for(self, kind: type, timeout_s: float = 5.0) -> list:
        deadline = time.monotonic() + timeout_s
        while not (found := [m for m in self.messages if isinstance(m, kind)]):
            assert time.monotonic() < deadline, f"no {kind.__name__} arrived"
            await asyncio.sleep(0.02)
        return found


def token_events(request_id: str, token_ids: list[int], finish_reason: str | None = "length",
                 per_event: int = 1) -> list[list[TokenEvent]]:
    """One batch per `per_event` tokens; the last event carries the finish reason."""
    batches = []
    for start in range(0, len(token_ids), per_event):
        chunk = token_ids[start:start + per_event]
        last = start + per_event >= len(token_ids)
        batches.append([TokenEvent(request_id=request_id, index=start, token_ids=chunk,
                                   finish_reason=finish_reason if last else None)])
    return batches
