"""A request's life through the gateway against a fake worker: the real Redis stream and
reply channel, scripted TokenEvents instead of a model. Checks the NewRequest the scheduler
would see, response and chunk shapes, stop strings and their abort, dedupe by index, errors,
timeouts and client disconnects."""

from __future__ import annotations


import httpx
import pytest
from openai import AsyncOpenAI

from gateway.tokenizer import PromptTokenizer
from tests.support.gateway_helpers import (MODEL, FakeWorker, gateway_client, make_config, register_worker, served,
                                           sse_events, token_events)
from proto.messages import AbortRequest, NewRequest, TokenEvent

pytestmark = pytest.mark.anyio


def im_end(tokenizer: PromptTokenizer) -> int:
    return tokenizer.hf.convert_tokens_to_ids("<|im_end|>")


async def test_completion(config, tokenizer):
    ids = tokenizer.encode_text(" and 日本語 too")
    async with FakeWorker(config, lambda r: token_events(r.request_id, ids, "length", per_event=2)) as worker:
        async with gateway_client(config) as client:
            response = await client.post("/v1/completions", json={
                "model": MODEL, "prompt": "Hello", "max_tokens": len(ids), "temperature": 0, "seed": 3,
                "stop_token_ids": [7]})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    # Exactly OpenAI's keys: no token_ids unless asked for.
    assert body["choices"] == [{"index": 0, "text": " and 日本語 too", "logprobs": None, "finish_reason": "length"}]
    prompt_ids = tokenizer.encode_text("Hello")
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                             "total_tokens": len(prompt_ids) + len(ids),
                             "prompt_tokens_details": {"cached_tokens": 0}}
    [request] = worker.messages
    assert isinstance(request, NewRequest) and request.request_id == body["id"]
    assert request.prompt_token_ids == prompt_ids and request.priority == 0
    assert request.reply_channel.startswith(f"{config.key_prefix}:out:")
    sampling = request.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.seed) == (len(ids), 0.0, 3)
    assert sampling.stop_token_ids == [7] and not sampling.ignore_eos


@pytest.mark.parametrize("stream", [False, True])
async def test_return_token_ids(config, tokenizer, stream):
    """vLLM's extension: output ids (in a stream, per chunk, ids mid-character included) and
    the prompt's ids once."""
    ids = tokenizer.encode_text("ids of 🙂 and é")
    async with FakeWorker(config, lambda r: token_events(r.request_id, ids, "length")):
        async with gateway_client(config) as client:
            response = await client.post("/v1/completions", json={
                "model": MODEL, "prompt": [5, 6, 7], "max_tokens": len(ids), "stream": stream,
                "return_token_ids": True})
            chat = (await client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "x"}], "return_token_ids": True})).json()
    if stream:
        choices = [c["choices"][0] for c in sse_events(response.text)]
        assert choices[0]["prompt_token_ids"] == [5, 6, 7]
        assert all("prompt_token_ids" not in c for c in choices[1:])
        assert [t for c in choices for t in c["token_ids"]] == ids
        assert "".join(c["text"] for c in choices) == "ids of 🙂 and é"
    else:
        [choice] = response.json()["choices"]
        assert (choice["prompt_token_ids"], choice["token_ids"]) == ([5, 6, 7], ids)
    assert chat["choices"][0]["token_ids"] == ids
    assert chat["prompt_token_ids"] == tokenizer.encode_chat([{"role": "user", "content": "x"}])


async def test_chat_stream_with_usage(config, tokenizer):
    ids = tokenizer.encode_text("Hi there 🙂") + [im_end(tokenizer)]
    async with FakeWorker(config, lambda r: token_events(r.request_id, ids, "stop")) as worker:
        async with gateway_client(config) as client:
            response = await client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True})
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = sse_events(response.text)
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-2])
    assert content == "Hi there 🙂"
    assert chunks[-2]["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(ids)
    [request] = worker.messages
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert request.prompt_token_ids == tokenizer.encode_chat(messages)
    assert request.sampling.ignore_eos
    assert request.sampling.max_tokens == 256 - len(request.prompt_token_ids)  # the context left


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_string_cuts_and_aborts(config, tokenizer, stream):
    ids = tokenizer.encode_text("one two END three four")
    async with FakeWorker(config, lambda r: token_events(r.request_id, ids, None)) as worker:
        async with gateway_client(config) as client:
            response = await client.post("/v1/completions", json={
                "model": MODEL, "prompt": "Count:", "stop": ["END", "zzz"], "max_tokens": 50, "stream": stream})
        [abort] = await worker.wait_for(AbortRequest)
    if stream:
        chunks = sse_events(response.text)
        text = "".join(c["choices"][0]["text"] for c in chunks)
        finish = chunks[-1]["choices"][0]["finish_reason"]
        request_id = chunks[0]["id"]
        assert "usage" not in chunks[0]
    else:
        body = response.json()
        text, finish, request_id = body["choices"][0]["text"], body["choices"][0]["finish_reason"], body["id"]
    assert (text, finish) == ("one two ", "stop")
    assert abort.request_id == request_id


async def test_resent_tokens_are_deduplicated(config, tokenizer):
    ids = tokenizer.encode_text("a re-routed request resumes")

    def script(request: NewRequest) -> list[list[TokenEvent]]:
        rid = request.request_id
        return [[TokenEvent(rid, 0, ids[:4])], [TokenEvent(rid, 2, ids[2:6])],  # overlaps
                [TokenEvent(rid, 6, ids[6:])], [TokenEvent(rid, 3, ids[3:], finish_reason="length")]]

    async with FakeWorker(config, script):
        async with gateway_client(config) as client:
            body = (await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})).json()
    assert body["choices"][0]["text"] == "a re-routed request resumes"
    assert body["usage"]["completion_tokens"] == len(ids)


async def test_events_queued_together_go_out_as_one_chunk(config, tokenizer):
    """Events that wait in a request's queue when it reads (here: one message of three) are
    merged into one output: one chunk with all their text, then the finish chunk."""
    ids = tokenizer.encode_text("several steps arrive at once")

    def script(request: NewRequest) -> list[list[TokenEvent]]:
        rid = request.request_id
        return [[TokenEvent(rid, 0, ids[:2]), TokenEvent(rid, 2, ids[2:4]),
                 TokenEvent(rid, 4, ids[4:], finish_reason="length")]]

    async with FakeWorker(config, script):
        async with gateway_client(config) as client:
            response = await client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True,
                "return_token_ids": True})
    chunks = sse_events(response.text)
    [merged] = [c["choices"][0] for c in chunks[1:] if c["choices"][0]["delta"].get("content")]
    assert merged["delta"]["content"] == "several steps arrive at once"
    assert merged["token_ids"] == ids
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True])
async def test_scheduler_error(config, tokenizer, stream):
    def script(request: NewRequest) -> list[list[TokenEvent]]:
        return [[TokenEvent(request.request_id, 0, tokenizer.encode_text("partial"))],
                [TokenEvent(request.request_id, 1, finish_reason="error", error="worker exploded")]]

    async with FakeWorker(config, script) as worker:
        async with gateway_client(config) as client:
            response = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": stream})
    if stream:
        assert response.status_code == 200
        *_, last = sse_events(response.text)
        error = last["error"]
    else:
        assert response.status_code == 500
        error = response.json()["error"]
    assert "worker exploded" in error["message"] and error["type"] == "server_error"
    assert not [m for m in worker.messages if isinstance(m, AbortRequest)]  # it is already gone there


async def test_timeout_aborts(tiny_model_dir, redis_url):
    config = make_config(tiny_model_dir, redis_url, request_timeout_s=0.3)
    register_worker(config)
    async with FakeWorker(config, lambda r: []) as worker:
        async with gateway_client(config) as client:
            response = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        await worker.wait_for(AbortRequest)
    assert response.status_code == 504 and response.json()["error"]["code"] == "timeout"


@pytest.mark.parametrize("stream", [False, True])
async def test_client_disconnect_aborts(config, tokenizer, stream):
    ids = tokenizer.encode_text("never ending")
    async with FakeWorker(config, lambda r: token_events(r.request_id, ids, None)) as worker:
        async with served(config) as url, httpx.AsyncClient(base_url=url) as client:
            body = {"model": MODEL, "prompt": "x", "stream": stream}
            if stream:
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            break  # hang up after the first chunk
            else:
                with pytest.raises(httpx.ReadTimeout):
                    await client.post("/v1/completions", json=body, timeout=0.5)
            [request] = await worker.wait_for(NewRequest)
            [abort] = await worker.wait_for(AbortRequest)
    assert abort.request_id == request.request_id


async def test_official_openai_client(config, tokenizer):
    ids = tokenizer.encode_text("Bonjour à tous") + [im_end(tokenizer)]
    async with FakeWorker(config, lambda r: token_events(r.request_id, ids, "stop", per_event=3)):
        async with served(config) as url:
            client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            [model] = (await client.models.list()).data
            assert model.id == MODEL
            chat = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Salut"}], max_tokens=20)
            assert chat.choices[0].message.content == "Bonjour à tous"
            assert chat.choices[0].finish_reason == "stop" and chat.usage.completion_tokens == len(ids)
            stream = await client.completions.create(model=MODEL, prompt="Salut", max_tokens=20, stream=True)
            pieces = [chunk.choices[0].text async for chunk in stream if chunk.choices]
            assert "".join(pieces) == "Bonjour à tous"
            await client.close()
