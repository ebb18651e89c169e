"""Tool calls through the gateway against a fake worker (the real Redis stream and reply
channel, scripted text as token events), on the tiny Qwen2 checkpoint whose template lists
tools and writes calls the Hermes way: what each tool_choice sends to the worker (grammar),
how calls come back (message.tool_calls, stream deltas, finish_reason), the 400s, and tool
turns reaching the template."""

from __future__ import annotations

import json

import pytest

from gateway.tokenizer import PromptTokenizer
from tests.support.gateway_helpers import (MODEL, FakeWorker, gateway_client, make_config, register_worker, sse_events,
                                           token_events)
from proto.messages import NewRequest

pytestmark = pytest.mark.anyio

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]
HERMES_ANSWER = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                 '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')


@pytest.fixture(scope="module")
def tokenizer(qwen_dir) -> PromptTokenizer:
    return PromptTokenizer(qwen_dir)


def config_for(qwen_dir, redis_url, **overrides):
    config = make_config(qwen_dir, redis_url, request_timeout_s=5.0, **overrides)
    register_worker(config, max_model_len=1024)
    return config


def answering(tokenizer: PromptTokenizer, text: str):
    ids = tokenizer.encode_text(text, False)
    return lambda request: token_events(request.request_id, ids, "stop", per_event=3)


async def test_auto_calls_parsed_whole_and_streamed(qwen_dir, redis_url, tokenizer):
    config = config_for(qwen_dir, redis_url, tool_call_parser="hermes", enable_auto_tool_choice=True)
    async with FakeWorker(config, answering(tokenizer, HERMES_ANSWER)) as worker:
        async with gateway_client(config) as client:
            body = {"model": MODEL, "messages": USER, "tools": [WEATHER, TIME]}
            whole = await client.post("/v1/chat/completions", json=body)
            streamed = await client.post("/v1/chat/completions", json={**body, "stream": True})
    assert whole.status_code == 200, whole.text
    [choice] = whole.json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Checking.\n"
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] \
        == [("function", "get_weather", {"city": "Paris"}), ("function", "get_time", {"tz": "CET"})]
    assert all(c["id"].startswith("call_") for c in message["tool_calls"])
    assert all(m.sampling.grammar is None for m in worker.messages if isinstance(m, NewRequest))
    events = sse_events(streamed.text)
    content, calls = "", {}
    for event in events:
        delta = event["choices"][0]["delta"]
        content += delta.get("content") or ""
        for call in delta.get("tool_calls", []):
            if "id" in call:
                calls[call["index"]] = [call["function"]["name"], ""]
            calls[call["index"]][1] += call["function"]["arguments"]
    assert content == "Checking.\n" and events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert [(n, json.loads(a)) for n, a in calls.values()] == [("get_weather", {"city": "Paris"}),
                                                               ("get_time", {"tz": "CET"})]


async def test_auto_without_a_call_is_content(qwen_dir, redis_url, tokenizer):
    config = config_for(qwen_dir, redis_url, tool_call_parser="hermes", enable_auto_tool_choice=True)
    async with FakeWorker(config, answering(tokenizer, "It is sunny.")):
        async with gateway_client(config) as client:
            response = await client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": USER, "tools": [WEATHER], "tool_choice": "auto"})
    [choice] = response.json()["choices"]
    assert choice["message"] == {"role": "assistant", "content": "It is sunny.", "refusal": None}
    assert choice["finish_reason"] == "stop"


async def test_forced_calls_send_their_grammar(qwen_dir, redis_url, tokenizer):
    config = config_for(qwen_dir, redis_url)  # no parser, no auto: forced calls need neither
    required = json.dumps([{"name": "get_time", "parameters": {"tz": "UTC"}}])
    async with FakeWorker(config, answering(tokenizer, required)) as worker:
        async with gateway_client(config) as client:
            response = await client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": USER, "tools": [WEATHER, TIME], "tool_choice": "required",
                "parallel_tool_calls": False})
    [choice] = response.json()["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == ("get_time", {"tz": "UTC"})
    [request] = [m for m in worker.messages if isinstance(m, NewRequest)]
    schema = json.loads(request.sampling.grammar.spec)
    assert schema["type"] == "array" and schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2

    async with FakeWorker(config, answering(tokenizer, '{"city": "Oslo"}')) as worker:
        async with gateway_client(config) as client:
            response = await client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": USER, "tools": [WEATHER, TIME], "stream": True,
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    events = sse_events(response.text)
    first = next(c for e in events for c in e["choices"][0]["delta"].get("tool_calls", []))
    assert first["function"]["name"] == "get_weather" and first["type"] == "function"
    arguments = "".join(c["function"]["arguments"]
                        for e in events for c in e["choices"][0]["delta"].get("tool_calls", []))
    assert json.loads(arguments) == {"city": "Oslo"}
    assert events[-1]["choices"][0]["finish_reason"] == "stop"  # named: as OpenAI
    request = [m for m in worker.messages if isinstance(m, NewRequest)][-1]  # the stream holds both
    assert json.loads(request.sampling.grammar.spec) == WEATHER["function"]["parameters"]


@pytest.mark.parametrize("fields,words", [
    ({"tools": [WEATHER], "tool_choice": "auto"}, "--enable-auto-tool-choice"),
    ({"tool_choice": "required"}, "needs 'tools'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "required"),
])
async def test_tool_choice_errors_name_tool_choice(qwen_dir, redis_url, fields, words):
    config = config_for(qwen_dir, redis_url)
    async with gateway_client(config) as client:
        response = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tool_choice" and words in error["message"], error


async def test_bad_tool_schema_names_tools(qwen_dir, redis_url):
    config = config_for(qwen_dir, redis_url)
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}
    async with gateway_client(config) as client:
        response = await client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": USER, "tools": [bad], "tool_choice": "required"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools", response.text


async def test_tool_turns_reach_the_template(qwen_dir, redis_url, tokenizer):
    config = config_for(qwen_dir, redis_url)
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    async with FakeWorker(config, answering(tokenizer, "Nice.")) as worker:
        async with gateway_client(config) as client:
            response = await client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": messages, "tools": [WEATHER], "max_tokens": 4})
    assert response.status_code == 200, response.text
    [request] = [m for m in worker.messages if isinstance(m, NewRequest)]
    prompt = tokenizer.hf.decode(request.prompt_token_ids)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n18 C and sunny\n</tool_response>" in prompt
