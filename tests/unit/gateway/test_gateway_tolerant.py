"""vLLM's extension fields and OpenAI's prompt batches, through the gateway against a fake
worker (the real Redis stream and reply channel, scripted TokenEvents): what each field
changes in the NewRequest or the text, choices of a batch of prompts, usage in every chunk."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import openai
import pytest

from tests.support.gateway_helpers import (MODEL, FakeWorker, gateway_client, make_config, register_worker, served,
                                           sse_events, token_events)
from proto.messages import NewRequest
from proto.parallel import sequence_ids

pytestmark = pytest.mark.anyio


def echo_prompt_length(request: NewRequest) -> list:
    """Answers each sequence with as many tokens as its prompt's length mod 4, plus one."""
    count = len(request.prompt_token_ids) % 4 + 1
    return [batch for rid in sequence_ids(request.request_id, request.n)
            for batch in token_events(rid, [5] * count, "length")]


async def test_batch_of_prompts_gives_choices_prompt_major(config, tokenizer):
    prompts = ["one", [7, 8, 9], "a longer prompt here"]
    async with FakeWorker(config, echo_prompt_length) as worker:
        async with gateway_client(config) as client:
            response = await client.post("/v1/completions", json={
                "model": MODEL, "prompt": prompts, "max_tokens": 4, "n": 2, "echo": True,
                "return_token_ids": True})
            streamed = await client.post("/v1/completions", json={
                "model": MODEL, "prompt": prompts, "max_tokens": 4, "stream": True,
                "stream_options": {"include_usage": True}})
    assert response.status_code == 200, response.text
    body = response.json()
    requests = [m for m in worker.messages if isinstance(m, NewRequest)]
    ids = [tokenizer.encode_text("one"), [7, 8, 9], tokenizer.encode_text("a longer prompt here")]
    # one request per prompt, submitted side by side (in any order)
    assert sorted(r.prompt_token_ids for r in requests[:3]) == sorted(ids) and all(r.n == 2 for r in requests[:3])
    assert [c["index"] for c in body["choices"]] == list(range(6))
    for i, choice in enumerate(body["choices"]):
        prompt_ids = ids[i // 2]
        assert choice["prompt_token_ids"] == prompt_ids
        assert choice["token_ids"] == [5] * (len(prompt_ids) % 4 + 1)
        assert choice["text"].startswith(prompts[i // 2] if isinstance(prompts[i // 2], str) else "")
    assert body["usage"]["prompt_tokens"] == sum(len(p) for p in ids)
    assert body["usage"]["completion_tokens"] == sum(2 * (len(p) % 4 + 1) for p in ids)
    events = sse_events(streamed.text)
    finished = {c["index"] for e in events for c in e["choices"] if c["finish_reason"]}
    assert finished == {0, 1, 2} and events[-1]["usage"]["completion_tokens"] == sum(len(p) % 4 + 1 for p in ids)


async def test_batch_fails_as_a_whole(config):
    def script(request):
        return token_events(request.request_id, [5], "error" if request.prompt_token_ids == [9] else "length")

    async with FakeWorker(config, script):
        async with gateway_client(config) as client:
            response = await client.post("/v1/completions",
                                         json={"model": MODEL, "prompt": [[8], [9]], "max_tokens": 2})
    assert response.status_code == 500 and response.json()["error"]["code"] == "generation_error"


async def test_extensions_reach_the_request(config, tokenizer):
    async with FakeWorker(config, lambda r: token_events(r.request_id, [5], "length")) as worker:
        async with gateway_client(config) as client:
            response = await client.post("/v1/completions", json={
                "model": MODEL, "prompt": "hello there world", "max_tokens": 1, "priority": -3,
                "truncate_prompt_tokens": 2, "add_special_tokens": False})
            chat = await client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                "priority": 4, "truncate_prompt_tokens": 3})
    assert response.status_code == 200 and chat.status_code == 200, (response.text, chat.text)
    completion, chat_request = [m for m in worker.messages if isinstance(m, NewRequest)]
    assert completion.priority == -3 and chat_request.priority == 4
    assert completion.prompt_token_ids == tokenizer.encode_text("hello there world", False)[-2:]
    assert len(chat_request.prompt_token_ids) == 3


async def test_skip_special_tokens_and_include_stop_str(config, tokenizer):
    end = tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode_text(" yes", False) + [end] + tokenizer.encode_text(" STOP and more", False)
    async with FakeWorker(config, lambda r: token_events(r.request_id, ids, "length")):
        async with gateway_client(config) as client:
            async def text(**fields):
                response = await client.post("/v1/completions", json={
                    "model": MODEL, "prompt": "hi", "max_tokens": len(ids), **fields})
                assert response.status_code == 200, response.text
                return response.json()["choices"][0]["text"]

            assert await text() == " yes STOP and more"
            assert await text(skip_special_tokens=False) == " yes<|im_end|> STOP and more"
            assert await text(stop=["STOP"]) == " yes "
            assert await text(stop=["STOP"], include_stop_str_in_output=True) == " yes STOP"


async def test_kept_special_tokens_leave_out_the_one_that_stopped(config, tokenizer):
    end = tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode_text(" a", False) + [end] + tokenizer.encode_text(" b", False) + [end]
    async with FakeWorker(config, lambda r: token_events(r.request_id, ids, "stop", per_event=2)):
        async with gateway_client(config) as client:
            async def answer(**fields):
                response = await client.post("/v1/completions", json={
                    "model": MODEL, "prompt": "hi", "max_tokens": 8, "skip_special_tokens": False, **fields})
                assert response.status_code == 200, response.text
                return response.json()["choices"][0]["text"], response.json()["usage"]["completion_tokens"]

            assert await answer() == (" a<|im_end|> b", len(ids))
            assert await answer(include_stop_str_in_output=True) == (" a<|im_end|> b<|im_end|>", len(ids))


async def test_continuous_usage_stats(config, tokenizer):
    ids = tokenizer.encode_text(" a b c d", False)
    async with FakeWorker(config, lambda r: token_events(r.request_id, ids, "length")):
        async with gateway_client(config) as client:
            response = await client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": len(ids),
                "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    events = sse_events(response.text)
    counted = [e["usage"]["completion_tokens"] for e in events[1:] if e["choices"]]
    assert counted == sorted(counted) and counted[-1] == len(ids) and counted[0] >= 1
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == len(ids)


@pytest.mark.parametrize("chunked", [False, True])
async def test_oversized_body_gets_the_413_json(tiny_model_dir, redis_url, chunked):
    """A real client sending a body over the limit reads the 413 and its JSON (the gateway
    drains what it will not keep), with Content-Length or chunked."""
    config = make_config(tiny_model_dir, redis_url, max_body_bytes=64 * 1024)
    register_worker(config)
    body = json.dumps({"model": MODEL, "prompt": "x" * 12 * 2**20}).encode()
    async with served(config) as url:
        async with httpx.AsyncClient(timeout=30) as http:
            content = (piece async for piece in _pieces(body)) if chunked else body
            response = await http.post(f"{url}/v1/completions", content=content,
                                       headers={"content-type": "application/json"})
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "request_too_large"
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as err:
            await client.completions.create(model=MODEL, prompt="y" * 12 * 2**20)
        assert err.value.status_code == 413 and err.value.body["code"] == "request_too_large"
        await client.close()


async def _pieces(body: bytes):
    for start in range(0, len(body), 2**16):
        yield body[start:start + 2**16]


def _raw_post(url: str, body: bytes) -> bytes:
    """POST `body` over a plain socket, all of it, then read the answer: what a client that
    reads only once it has sent everything (curl, many HTTP libraries) sees."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


async def test_oversized_body_reaches_a_client_that_sends_everything_first(tiny_model_dir, redis_url):
    config = make_config(tiny_model_dir, redis_url, max_body_bytes=64 * 1024)
    register_worker(config)
    body = json.dumps({"model": MODEL, "prompt": "x" * 24 * 2**20}).encode()
    async with served(config) as url:
        answer = await asyncio.to_thread(_raw_post, url, body)
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and b"connection: close" in head.lower()
    assert json.loads(payload)["error"]["code"] == "request_too_large"
