"""The gateway's side of usage's cached tokens, against a fake worker whose first-token
event carries TokenEvent.num_cached_tokens: `usage.prompt_tokens_details.cached_tokens` in
completions and chat (JSON, the include_usage chunk, every continuous_usage_stats chunk),
`usage.input_tokens_details.cached_tokens` in the Responses API; the prompt counted once
with n > 1, summed over the prompts of one completion request. Where the count is decided:
test_cached_tokens.py."""

from __future__ import annotations

import json

import pytest

from tests.support.gateway_helpers import MODEL, FakeWorker, gateway_client, sse_events
from proto.messages import NewRequest, TokenEvent
from proto.parallel import sequence_ids

pytestmark = pytest.mark.anyio

OUT = [11, 12, 13, 14]


def answer(cached: int):
    """A script: every sequence of the request gets OUT, its first event with `cached`; a
    copy of that event sent again with another count (as a recomputed copy might) is ignored."""
    def script(request: NewRequest) -> list[list[TokenEvent]]:
        batches = []
        for rid in sequence_ids(request.request_id, request.n):
            batches.append([TokenEvent(rid, index=0, token_ids=OUT[:1], num_cached_tokens=cached)])
            batches.append([TokenEvent(rid, index=0, token_ids=OUT[:1], num_cached_tokens=cached + 16)])
            batches += [[TokenEvent(rid, index=i, token_ids=[t], finish_reason="length" if i == len(OUT) - 1 else None)]
                        for i, t in enumerate(OUT) if i]
        return batches
    return script


def cached_of(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


async def test_completions_and_chat_report_the_cached_tokens(config):
    chat_body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": len(OUT)}
    async with FakeWorker(config, answer(32)):
        async with gateway_client(config) as client:
            completion = (await client.post("/v1/completions", json={
                "model": MODEL, "prompt": "Hello", "max_tokens": len(OUT)})).json()
            chat = (await client.post("/v1/chat/completions", json=chat_body)).json()
            streamed = await client.post("/v1/chat/completions", json={
                **chat_body, "stream": True, "stream_options": {"include_usage": True}})
            continuous = await client.post("/v1/chat/completions", json={
                **chat_body, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert completion["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    assert cached_of(chat["usage"]) == 32
    chunks = sse_events(streamed.text)
    assert all(c["usage"] is None for c in chunks[:-1]) and cached_of(chunks[-1]["usage"]) == 32
    usages = [c["usage"] for c in sse_events(continuous.text) if c["usage"] is not None]
    assert len(usages) > len(OUT) and all(cached_of(u) == 32 for u in usages)
    assert usages[-1]["total_tokens"] == usages[-1]["prompt_tokens"] + len(OUT)


async def test_a_first_request_reports_zero(config):
    async with FakeWorker(config, answer(0)):
        async with gateway_client(config) as client:
            completion = (await client.post("/v1/completions", json={
                "model": MODEL, "prompt": "Hello", "max_tokens": len(OUT)})).json()
            response = (await client.post("/v1/responses", json={"model": MODEL, "input": "hi"})).json()
    assert completion["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert response["usage"]["input_tokens_details"] == {"cached_tokens": 0}


async def test_the_responses_api_reports_the_cached_tokens(config):
    async with FakeWorker(config, answer(48)):
        async with gateway_client(config) as client:
            whole = (await client.post("/v1/responses", json={"model": MODEL, "input": "hi"})).json()
            streamed = await client.post("/v1/responses", json={"model": MODEL, "input": "hi", "stream": True})
    assert whole["usage"]["input_tokens_details"] == {"cached_tokens": 48}
    assert whole["usage"]["output_tokens_details"] == {"reasoning_tokens": 0}
    events = [json.loads(line[len("data: "):]) for line in streamed.text.splitlines() if line.startswith("data: ")]
    [completed] = [e for e in events if e["type"] == "response.completed"]
    assert completed["response"]["usage"]["input_tokens_details"] == {"cached_tokens": 48}


async def test_n_choices_count_the_prompt_once_and_prompts_are_summed(config, tokenizer):
    def script(request: NewRequest) -> list[list[TokenEvent]]:
        # each prompt its own count: "a b" hit 16, the other 32
        return answer(16 if request.prompt_token_ids == tokenizer.encode_text("a b") else 32)(request)

    async with FakeWorker(config, script):
        async with gateway_client(config) as client:
            many = (await client.post("/v1/completions", json={
                "model": MODEL, "prompt": "Hello", "max_tokens": len(OUT), "n": 3})).json()
            batch = (await client.post("/v1/completions", json={
                "model": MODEL, "prompt": ["a b", "Hello"], "max_tokens": len(OUT), "n": 2})).json()
            streamed = await client.post("/v1/completions", json={
                "model": MODEL, "prompt": ["a b", "Hello"], "max_tokens": len(OUT), "stream": True,
                "stream_options": {"include_usage": True}})
    assert (many["usage"]["prompt_tokens"], cached_of(many["usage"])) == (len(tokenizer.encode_text("Hello")), 32)
    assert len(batch["choices"]) == 4
    assert cached_of(batch["usage"]) == 16 + 32
    assert batch["usage"]["prompt_tokens"] == len(tokenizer.encode_text("a b")) + len(tokenizer.encode_text("Hello"))
    assert cached_of(sse_events(streamed.text)[-1]["usage"]) == 16 + 32


async def test_the_documented_schema_has_the_field(config):
    async with gateway_client(config) as client:
        schemas = (await client.get("/openapi.json")).json()["components"]["schemas"]
    assert "prompt_tokens_details" in schemas["Usage"]["required"]
    assert schemas["PromptTokensDetails"]["required"] == ["cached_tokens"]
    assert "input_tokens_details" in schemas["ResponseUsage"]["required"]
    assert schemas["InputTokensDetails"]["required"] == ["cached_tokens"]
