"""Failures after an answer has started keep each API's stream shape, through the gateway
against a fake worker whose request fails midway: a batch of prompts (one prompt fails: the
others are aborted), chat with tool calls (an error event, then [DONE]), the Responses API
(`response.failed`, or a JSON error when not streamed); and the Responses API's 400s."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest
import redis

from gateway.tokenizer import PromptTokenizer
from tests.support.gateway_helpers import MODEL, FakeWorker, gateway_client, make_config, register_worker, token_events
from proto.messages import AbortRequest, NewRequest, TokenEvent

pytestmark = pytest.mark.anyio
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer(qwen_dir) -> PromptTokenizer:
    return PromptTokenizer(qwen_dir)


@pytest.fixture
def config(qwen_dir, redis_url):
    config = make_config(qwen_dir, redis_url, request_timeout_s=5.0, tool_call_parser="hermes",
                         enable_auto_tool_choice=True)
    register_worker(config, max_model_len=1024)
    return config


def failing_after(tokenizer: PromptTokenizer, text: str, fail=lambda request: True):
    def script(request: NewRequest) -> list[list[TokenEvent]]:
        ids = tokenizer.encode_text(text, False)
        if not fail(request):
            return [[TokenEvent(request.request_id, 0, ids)]]  # runs on until aborted
        return [[TokenEvent(request.request_id, 0, ids)],
                [TokenEvent(request.request_id, len(ids), finish_reason="error", error="worker exploded")]]
    return script


def sse_data(text: str) -> list:
    return [json.loads(line.removeprefix("data: ")) for block in text.split("\n\n") if block
            for line in block.split("\n") if line.startswith("data: ") and line != "data: [DONE]"]


async def test_batch_stream_fails_with_an_error_event_and_aborts_the_rest(config, tokenizer):
    script = failing_after(tokenizer, " some text", fail=lambda r: r.prompt_token_ids == [9])
    async with FakeWorker(config, script) as worker:
        async with gateway_client(config) as client:
            response = await client.post("/v1/completions", json={
                "model": MODEL, "prompt": [[8], [9]], "max_tokens": 10, "stream": True})
        aborts = await worker.wait_for(AbortRequest)
    assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")
    *_, last = sse_data(response.text)
    assert "worker exploded" in last["error"]["message"]
    running = [m.request_id for m in worker.messages if isinstance(m, NewRequest) and m.prompt_token_ids == [8]]
    assert [a.request_id for a in aborts] == running  # the prompt still running is aborted


async def test_tool_call_stream_fails_in_shape(config, tokenizer):
    script = failing_after(tokenizer, '<tool_call>\n{"name": "f", "arguments": {"a": ')
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    async with FakeWorker(config, script):
        async with gateway_client(config) as client:
            response = await client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": USER, "tools": tools, "stream": True})
    assert response.text.endswith("data: [DONE]\n\n")
    events = sse_data(response.text)
    assert events[-1]["error"]["type"] == "server_error"
    calls = [c for e in events[:-1] for c in e["choices"][0]["delta"].get("tool_calls", [])]
    assert calls and calls[0]["function"]["name"] == "f"  # what was streamed before the failure


async def test_responses_failures(config, tokenizer):
    async with FakeWorker(config, failing_after(tokenizer, "partial answer")):
        async with gateway_client(config) as client:
            streamed = await client.post("/v1/responses", json={"model": MODEL, "input": "hi", "stream": True})
            whole = await client.post("/v1/responses", json={"model": MODEL, "input": "hi"})
    events = sse_data(streamed.text)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.failed"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and "worker exploded" in failed["error"]["message"]
    assert failed["output"][0]["content"][0]["text"] == "partial answer"
    assert "data: [DONE]" not in streamed.text
    assert whole.status_code == 500 and "worker exploded" in whole.json()["error"]["message"]


@pytest.mark.parametrize("body,param", [
    ({"input": [{"type": "image", "url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content"),
    ({"input": []}, "input"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 5000}, "input"),  # context_length_exceeded, named as ours
    ({"input": [{"role": "user", "content": None}]}, "input[0].content"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "wat"}}}},
     "text.format"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice"),
])
async def test_responses_bad_requests(config, body, param):
    async with gateway_client(config) as client:
        response = await client.post("/v1/responses", json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def kill_subscriptions(redis_url: str) -> None:
    """Drop every pub/sub connection (the gateway's reply channel): it resubscribes."""
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.client_kill_filter(_type="pubsub") >= 1
    finally:
        client.close()


async def test_a_request_open_across_a_lost_subscription_is_sent_again_and_completes(config, tokenizer):
    """Events published while the gateway's subscription was down are lost: it sends the
    request again (`resubmitted`); the new copy starts over, the tokens the client has are
    dropped by index, an old copy's event past the gap is dropped, and the text comes out
    whole, once. The finished request's new copy is aborted."""
    ids = tokenizer.encode_text(" one two three four five six", False)

    def script(request: NewRequest) -> list[list[TokenEvent]]:
        rid = request.request_id
        if not request.resubmitted:
            return [[TokenEvent(rid, 0, ids[:2])]]  # then silence: the rest is "lost"
        return [[TokenEvent(rid, 4, ids[4:5])],  # the old copy's, past the gap
                *[[TokenEvent(rid, i, ids[i:i + 1], finish_reason="length" if i == len(ids) - 1 else None)]
                  for i in range(len(ids))]]

    async with FakeWorker(config, script) as worker:
        async with gateway_client(config) as client:
            answer = asyncio.create_task(client.post("/v1/completions", json={
                "model": MODEL, "prompt": "Hello", "max_tokens": len(ids), "stream": True}))
            while not any(isinstance(m, NewRequest) for m in worker.messages):
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # the first two tokens are in
            kill_subscriptions(config.redis_url)
            response = await asyncio.wait_for(answer, 10)
            aborts = await worker.wait_for(AbortRequest)
    assert response.status_code == 200, response.text
    chunks = sse_data(response.text)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == tokenizer.decode(ids)
    first, again = [m for m in worker.messages if isinstance(m, NewRequest)]
    assert (first.resubmitted, again.resubmitted) == (False, True)
    assert again == msgspec.structs.replace(first, resubmitted=True)
    assert [a.request_id for a in aborts] == [first.request_id]


async def test_a_request_that_cannot_be_sent_again_ends_with_503_and_the_reason(qwen_dir, redis_url, tokenizer):
    """Redis takes no writes when the gateway resubscribes (CLIENT PAUSE, longer than the
    gateway tries to send it again): the request ends with a 503 that says why."""
    config = make_config(qwen_dir, redis_url, request_timeout_s=60.0)
    register_worker(config, max_model_len=1024)
    script = failing_after(tokenizer, " some text", fail=lambda request: False)  # runs on
    async with FakeWorker(config, script) as worker:
        async with gateway_client(config) as client:
            answer = asyncio.create_task(client.post("/v1/completions", json={
                "model": MODEL, "prompt": "Hello", "max_tokens": 50}))
            while not any(isinstance(m, NewRequest) for m in worker.messages):
                await asyncio.sleep(0.01)
            pauser = redis.Redis.from_url(config.redis_url)
            # Writes only, well past the gateway's 10 s of retries however late it resubscribes
            # (unpaused as soon as the answer is in).
            pauser.client_pause(30_000, all=False)
            try:
                kill_subscriptions(config.redis_url)
                response = await asyncio.wait_for(answer, 45)
            finally:
                pauser.client_unpause()
                pauser.close()
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == "aborted"
    assert "could not be sent again" in error["message"], error


async def test_a_gap_nothing_fills_ends_with_503_after_its_grace(config, tokenizer, monkeypatch):
    """Events past a gap are dropped while the tokens before it may still come (a request
    sent again starts over); when only such events come for the grace period, the request
    fails with a 503 that says so -- never a text with tokens skipped."""
    import gateway.generation

    monkeypatch.setattr(gateway.generation, "GAP_GRACE_S", 1.0)
    ids = tokenizer.encode_text(" one two three four five six", False)

    def script(request: NewRequest) -> list[list[TokenEvent]]:
        rid = request.request_id
        return [[TokenEvent(rid, 0, ids[:2])], [TokenEvent(rid, 4, ids[4:5])]]  # 2..3 never come

    async with FakeWorker(config, script) as worker:
        async with gateway_client(config) as client:
            response = await client.post("/v1/completions", json={
                "model": MODEL, "prompt": "Hello", "max_tokens": len(ids)})
        aborts = await worker.wait_for(AbortRequest)
    assert response.status_code == 503, response.text
    assert "did not come again" in response.json()["error"]["message"]
    assert [a.request_id for a in aborts] == [m.request_id for m in worker.messages if isinstance(m, NewRequest)]


async def test_pooled_connections_broken_by_a_redis_restart_are_replaced(config, tokenizer):
    """Every connection the gateway holds is cut (as a Redis restart does): the next request
    is queued on a fresh connection, not refused with 'The request queue is unreachable'."""
    ids = tokenizer.encode_text(" fine", False)
    script = lambda request: token_events(request.request_id, ids)  # noqa: E731
    async with gateway_client(config) as client:
        async with FakeWorker(config, script):
            first = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
        assert first.status_code == 200, first.text
        killer = redis.Redis.from_url(config.redis_url)
        try:
            assert killer.client_kill_filter(_type="normal", skipme=True) >= 1
        finally:
            killer.close()
        async with FakeWorker(config, script):
            again = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert again.status_code == 200, again.text
