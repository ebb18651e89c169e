"""Admission before enqueueing, from the schedulers' heartbeats in a real Redis: 429 with
Retry-After while every scheduler driving workers is at its waiting bound (a standby's
empty queue does not count), 503 with the reason when no scheduler is live, and an
admitted request served (FakeWorker plays the scheduler's part)."""

from __future__ import annotations

import pytest
import redis

from tests.support.gateway_helpers import (MODEL, FakeWorker, beat_as_scheduler, gateway_client, make_config,
                                           register_worker, token_events)

pytestmark = pytest.mark.anyio


@pytest.fixture
def config(tiny_model_dir, redis_url):
    return make_config(tiny_model_dir, redis_url, request_timeout_s=10.0)  # a regression fails, not hangs


BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


async def test_a_full_queue_is_429_with_retry_after_and_a_standby_does_not_count(config):
    register_worker(config)
    beat_as_scheduler(config, ["w0"], num_waiting=5, max_waiting_requests=5)
    beat_as_scheduler(config, [], max_waiting_requests=5, scheduler_id="standby")
    async with gateway_client(config) as client:
        response = await client.post("/v1/completions", json=BODY)
        assert response.status_code == 429, response.text
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "too_many_waiting_requests"
        assert response.json()["error"]["type"] == "rate_limit_error"

        beat_as_scheduler(config, ["w0"], num_waiting=4, max_waiting_requests=5)  # room again
        async with FakeWorker(config, lambda r: token_events(r.request_id, [5, 6], "length")) as worker:
            response = await client.post("/v1/completions", json=BODY)
        assert response.status_code == 200, response.text
        assert len(worker.messages) == 1  # the refused request never reached the stream


async def test_no_live_scheduler_is_503_at_once(config):
    register_worker(config)
    keys = config.key_prefix
    redis.Redis.from_url(config.redis_url).delete(f"{keys}:scheduler:fake-scheduler")
    async with gateway_client(config) as client:
        response = await client.post("/v1/completions", json=BODY)
        ready = await client.get("/health/ready")
    assert response.status_code == 503 and response.json()["error"]["code"] == "no_live_scheduler"
    assert ready.status_code == 503 and ready.json()["error"]["code"] == "no_live_scheduler"
