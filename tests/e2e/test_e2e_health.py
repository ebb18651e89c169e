"""Readiness and backpressure against real processes: the gateway's /health/live and
/health/ready, the scheduler's heartbeat, the worker's standard grpc.health.v1 service,
503 with a reason when nothing can serve, 429 with Retry-After when the waiting queue is
full (the launcher's stack: redis-server, gRPC worker, scheduler, gateway under uvicorn)."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import httpx
import openai
import pytest
import redis
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.registry import WorkerRegistry
from proto.scheduler_registry import SchedulerRegistry
from tests.support.stack_helpers import running_stack


def _health(stack, path: str) -> httpx.Response:
    return httpx.get(f"http://{stack.config.host}:{stack.config.port}{path}", timeout=10)


def _wait_ready_code(stack, code: str | None, timeout: float = 30.0) -> httpx.Response:
    """Poll /health/ready until it says ready (code None) or fails with `code`."""
    deadline = time.monotonic() + timeout
    while True:
        response = _health(stack, "/health/ready")
        got = None if response.status_code == 200 else response.json()["error"]["code"]
        if got == code:
            return response
        assert time.monotonic() < deadline, f"/health/ready still says {response.status_code} {response.text}"
        time.sleep(0.2)


def _chat(stack, **kwargs):
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=60)
    return client.chat.completions.create(model=stack.served_model_name,
                                          messages=[{"role": "user", "content": "hi"}], **kwargs)


def test_ready_means_a_scheduler_drives_a_worker(tiny_model_dir, redis_url, tmp_path_factory):
    with running_stack(tiny_model_dir, redis_url, tmp_path_factory.mktemp("run")) as stack:
        assert _health(stack, "/health/live").json() == {"status": "live"}
        ready = _wait_ready_code(stack, None).json()
        assert ready["workers"] == ["worker-0"] and len(ready["schedulers"]) == 1
        assert _chat(stack, max_tokens=3).choices[0].finish_reason in ("stop", "length")

        # The scheduler's own /health, on its metrics port: it leads, drives the worker.
        scheduler = httpx.get(f"http://127.0.0.1:{stack.metrics_ports['scheduler']}/health", timeout=10)
        assert scheduler.status_code == 200, scheduler.text
        assert scheduler.json()["role"] == "leader" and scheduler.json()["workers"] == ["worker-0"]

        # The worker answers the standard health service, for the process and its service.
        client = redis.Redis.from_url(stack.redis_url)
        (registration,) = WorkerRegistry(stack.keys).read_blocking(client).live.values()
        with grpc.insecure_channel(registration.address) as channel:
            probe = health_pb2_grpc.HealthStub(channel)
            for service in ("", "pagedserve.Worker"):
                reply = probe.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING

        # No worker: not ready, and a request is refused at once with the reason.
        stack.stop_process("worker-0")
        _wait_ready_code(stack, "no_live_worker")
        with pytest.raises(openai.APIStatusError) as refused:
            _chat(stack, max_tokens=3)
        assert refused.value.status_code == 503 and refused.value.body["code"] == "no_live_worker"

        stack.add_worker()
        _wait_ready_code(stack, None)
        assert _chat(stack, max_tokens=3).choices[0].finish_reason in ("stop", "length")

        # No scheduler (killed: no goodbye, its heartbeat expires): not ready, refused at once.
        stack.stop_process("scheduler", sig=signal.SIGKILL)
        _wait_ready_code(stack, "no_live_scheduler")
        assert asyncio.run(_schedulers(stack)) == []
        with pytest.raises(openai.APIStatusError) as refused:
            _chat(stack, max_tokens=3)
        assert refused.value.status_code == 503 and refused.value.body["code"] == "no_live_scheduler"
        assert _health(stack, "/health/live").status_code == 200  # alive all the same


def _async_redis(stack) -> aioredis.Redis:
    return aioredis.Redis.from_url(stack.redis_url)


async def _schedulers(stack):
    client = _async_redis(stack)
    try:
        return await SchedulerRegistry(stack.keys).read(client)
    finally:
        await client.aclose()


def test_a_full_waiting_queue_gets_429_and_the_admitted_complete(tiny_model_dir, redis_url, tmp_path_factory):
    """One request runs at a time and one may wait: with the queue full, the next request
    is refused with 429 and Retry-After before it is enqueued; every admitted one finishes."""
    # The gateway reuses the schedulers' heartbeats for --worker-cache-ttl-s: 0.1 s here, so
    # that the refusal is tested soon after the queue fills, while the first request (900
    # tokens, a few seconds of the tiny model) surely still runs.
    with running_stack(tiny_model_dir, redis_url, tmp_path_factory.mktemp("run"),
                       scheduler_args=("--max-num-seqs", "1", "--max-waiting-requests", "1"),
                       gateway_args=("--worker-cache-ttl-s", "0.1")) as stack:
        async def waiting(aclient) -> int:
            beats = await SchedulerRegistry(stack.keys).read(aclient)
            return max((b.num_waiting for b in beats), default=0)

        async def main():
            aclient = _async_redis(stack)
            api = openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)
            long = dict(model=stack.served_model_name, prompt="once upon a time", max_tokens=900,
                        temperature=0, extra_body={"ignore_eos": True})
            running = asyncio.create_task(api.completions.create(**long))
            queued = []
            deadline = time.monotonic() + 30
            while await waiting(aclient) < 1:  # the second one waits behind the first
                if not queued:
                    await asyncio.sleep(0.3)
                    queued.append(asyncio.create_task(api.completions.create(**long)))
                assert time.monotonic() < deadline, "no request ever waited"
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.3)  # the gateway's cached heartbeats are fresh again
            with pytest.raises(openai.RateLimitError) as refused:
                await api.completions.create(**{**long, "max_tokens": 3})
            assert int(refused.value.response.headers["retry-after"]) >= 1
            assert refused.value.body["code"] == "too_many_waiting_requests"
            done = await asyncio.gather(running, *queued)
            assert [c.choices[0].finish_reason for c in done] == ["length"] * len(done)
            assert all(len(c.choices[0].text) > 0 for c in done)
            await aclient.aclose()

        asyncio.run(main())
