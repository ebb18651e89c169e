"""The gateway's side of the OpenAI parameters, against a fake worker: what reaches the
scheduler (sampling fields, n children and their seeds, chat template inputs) and how
logprobs, echo and n come back (shapes, bytes, streamed = non-streamed)."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from gateway.token_text import _unicode_to_byte
from tests.support.gateway_helpers import MODEL, FakeWorker, gateway_client, make_config, register_worker, sse_events
from proto.messages import AbortRequest, Logprobs, NewRequest, TokenEvent
from proto.parallel import child_request_id, child_seed

pytestmark = pytest.mark.anyio


def scripted(ids: list[int], *, logprobs: bool = False, prompt_logprobs: bool = False):
    """A worker answer: one event per token, with made-up logprobs (token t gets -t/1000,
    alternatives t+1, t+2) and, when asked, prompt logprobs in two chunks."""
    def lp(t):
        return Logprobs(-t / 1000, [t, t + 1], [-t / 1000, -(t + 1) / 1000])

    def script(request: NewRequest):
        batches = []
        prompt = request.prompt_token_ids
        if prompt_logprobs:
            half = max(2, len(prompt) // 2)
            batches.append([TokenEvent(request.request_id, 0, prompt_logprobs=[lp(t) for t in prompt[1:half]],
                                       prompt_index=1)])
            batches.append([TokenEvent(request.request_id, 0, prompt_logprobs=[lp(t) for t in prompt[half:]],
                                       prompt_index=half)])
        for i, t in enumerate(ids):
            last = i == len(ids) - 1
            batches.append([TokenEvent(request.request_id, i, [t], "length" if last else None,
                                       logprobs=[lp(t)] if logprobs else None)])
        return batches
    return script


async def test_sampling_fields_reach_the_scheduler(config):
    async with FakeWorker(config, scripted([5, 6])) as worker:
        async with gateway_client(config) as client:
            response = await client.post("/v1/completions", json={
                "model": MODEL, "prompt": "hi", "max_tokens": 2, "presence_penalty": 0.5,
                "frequency_penalty": -0.25, "repetition_penalty": 1.3, "min_p": 0.1, "top_k": 7,
                "logit_bias": {"11": -100, "12": 2.5}, "logprobs": 2})
    assert response.status_code == 200, response.text
    [request] = worker.messages
    s = request.sampling
    assert ((s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_p, s.top_k)
            == (0.5, -0.25, 1.3, 0.1, 7))
    assert s.logit_bias == {11: -100.0, 12: 2.5} and s.logprobs == 2 and s.prompt_logprobs is None


@pytest.mark.parametrize("stream", [False, True])
async def test_completion_logprobs_and_echo(config, tokenizer, stream):
    ids = tokenizer.encode_text(" and 日本")
    prompt_ids = tokenizer.encode_text("Hello there")
    async with FakeWorker(config, scripted(ids, logprobs=True, prompt_logprobs=True)) as worker:
        async with gateway_client(config) as client:
            response = await client.post("/v1/completions", json={
                "model": MODEL, "prompt": "Hello there", "max_tokens": len(ids), "logprobs": 1,
                "echo": True, "stream": stream})
    assert worker.messages[0].sampling.prompt_logprobs == 1
    if stream:
        choices = [c["choices"][0] for c in sse_events(response.text)]
        text = "".join(c["text"] for c in choices)
        lps = [c["logprobs"] for c in choices if c["logprobs"]]
        merged = {k: [x for lp in lps for x in lp[k]]
                  for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    else:
        [choice] = response.json()["choices"]
        text, merged = choice["text"], choice["logprobs"]
    assert text == "Hello there and 日本"
    n = len(prompt_ids)
    assert len(merged["tokens"]) == n + len(ids)
    assert merged["token_logprobs"][0] is None and merged["top_logprobs"][0] is None
    assert merged["token_logprobs"][1:] == [-t / 1000 for t in prompt_ids[1:] + ids]
    assert merged["text_offset"][n] == len("Hello there")
    # top_logprobs hold the k alternatives and always the chosen token
    t = ids[0]
    assert set(merged["top_logprobs"][n].values()) == {-t / 1000, -(t + 1) / 1000}
    assert [x.startswith("bytes:") for x in merged["tokens"][n:]] == \
        [not _is_whole(tokenizer, i) for i in ids]


def _is_whole(tokenizer, token_id) -> bool:
    """Whether the token's bytes (GPT-2 byte-level table) are whole UTF-8 characters."""
    piece = tokenizer.hf.convert_ids_to_tokens(token_id)
    try:
        bytes(_unicode_to_byte()[c] for c in piece).decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_logprobs_bytes_rebuild_the_text(config, tokenizer, stream):
    ids = tokenizer.encode_text("日本語 ok")
    async with FakeWorker(config, scripted(ids, logprobs=True)) as worker:
        async with gateway_client(config) as client:
            response = await client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": len(ids),
                "logprobs": True, "top_logprobs": 2, "stream": stream})
    assert worker.messages[0].sampling.logprobs == 2
    if stream:
        chunks = sse_events(response.text)
        content = [e for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                   for e in c["choices"][0]["logprobs"]["content"]]
    else:
        content = response.json()["choices"][0]["logprobs"]["content"]
    assert bytes(b for e in content for b in e["bytes"]).decode() == "日本語 ok"
    assert all(len(e["top_logprobs"]) == 2 and set(e) == {"token", "logprob", "bytes", "top_logprobs"}
               for e in content)


@pytest.mark.parametrize("stream", [False, True])
async def test_n_is_one_request_whose_sequences_make_the_choices(config, tokenizer, stream):
    """n = 3 reaches the scheduler as ONE NewRequest with n; the events of its sequences
    `<id>/<i>` become choice i, and the parent's own events (prompt logprobs) are taken in."""
    answers = {0: tokenizer.encode_text(" zero"), 1: tokenizer.encode_text(" one one"),
               2: tokenizer.encode_text(" two two two")}

    def script(request):
        batches = [[TokenEvent(request.request_id, 0)]]  # the parent before its fork: nothing
        for step in range(max(len(ids) for ids in answers.values())):
            batches.append([TokenEvent(child_request_id(request.request_id, i), step, [ids[step]],
                                       "length" if step == len(ids) - 1 else None)
                            for i, ids in answers.items() if step < len(ids)])
        return batches

    async with FakeWorker(config, script) as worker:
        async with gateway_client(config) as client:
            response = await client.post("/v1/completions", json={
                "model": MODEL, "prompt": "hi", "max_tokens": 5, "n": 3, "seed": 42, "stream": stream,
                **({"stream_options": {"include_usage": True}} if stream else {})})
    [request] = worker.messages
    assert (request.n, request.sampling.seed) == (3, 42)  # the scheduler derives the others
    expected = {i: tokenizer.decode(ids) for i, ids in answers.items()}
    total = sum(len(ids) for ids in answers.values())
    if stream:
        chunks = sse_events(response.text)
        texts = {i: "".join(c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["index"] == i)
                 for i in range(3)}
        assert texts == expected
        assert chunks[-1]["usage"]["completion_tokens"] == total
    else:
        body = response.json()
        assert {c["index"]: c["text"] for c in body["choices"]} == expected
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        assert body["usage"]["completion_tokens"] == total
        assert body["usage"]["prompt_tokens"] == len(tokenizer.encode_text("hi"))


def test_child_seeds_are_int64_and_distinct():
    for seed in (0, -1, 2**63 - 1, -(2**63)):
        seeds = [child_seed(seed, i) for i in range(50)]
        assert seeds[0] == seed and len(set(seeds)) == 50
        assert all(-(2**63) <= s < 2**63 for s in seeds)
    assert child_seed(None, 3) is None


async def test_n_stop_string_aborts_only_its_choice_and_a_parent_error_fails_all(config, tokenizer):
    """A stop string in choice 1 aborts `<id>/1` alone while the others run on; an error
    event under the parent's id (before its fork) fails the whole answer."""
    stop_at = tokenizer.encode_text(" STOP here")
    plain = tokenizer.encode_text(" go on")

    def script(request):
        ids = {0: plain, 1: stop_at, 2: plain}
        return [[TokenEvent(child_request_id(request.request_id, i), step, [ids[i][step]],
                            "length" if step == len(ids[i]) - 1 else None)
                 for i in range(3) if step < len(ids[i])] for step in range(len(stop_at))]

    async with FakeWorker(config, script) as worker:
        async with gateway_client(config) as client:
            response = await client.post("/v1/completions", json={
                "model": MODEL, "prompt": "hi", "max_tokens": 5, "n": 3, "stop": ["STOP"]})
            await worker.wait_for(AbortRequest)
    body = response.json()
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "stop", "length"]
    assert body["choices"][1]["text"] == " "
    aborts = [m.request_id for m in worker.messages if isinstance(m, AbortRequest)]
    assert aborts == [child_request_id(body["id"], 1)]

    def failing(request):
        return [[TokenEvent(request.request_id, 0, finish_reason="error", error="no room")]]

    async with FakeWorker(config, failing) as worker:
        async with gateway_client(config) as client:
            response = await client.post("/v1/completions", json={
                "model": MODEL, "prompt": "hi", "max_tokens": 5, "n": 3})
        await asyncio.sleep(0.3)  # time for an abort, were one sent, to reach the stream
    assert response.status_code == 500 and "no room" in response.json()["error"]["message"]
    failed = [m for m in worker.messages if isinstance(m, NewRequest)][-1].request_id
    # (this stream also holds the first part's messages) nothing was left to abort
    assert not [m for m in worker.messages if isinstance(m, AbortRequest) and m.request_id.startswith(failed)]

    def refusing(request):  # what BatchScheduler.add_request answers for, e.g., n > max_num_seqs
        return [[TokenEvent(request.request_id, 0, finish_reason="error", rejected=True,
                            error="n 3 > max_num_seqs 2")]]

    async with FakeWorker(config, refusing) as worker:
        async with gateway_client(config) as client:
            response = await client.post("/v1/completions", json={
                "model": MODEL, "prompt": "hi", "max_tokens": 5, "n": 3})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "max_num_seqs" in error["message"]


async def test_tools_reach_a_template_that_reads_them(tiny_model_dir, redis_url, tmp_path, tokenizer):
    model = tmp_path / "tools-model"
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").write_text(
        "{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t.function.name }} {% endfor %}"
        "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{% if m.tool_calls %}{{ m.tool_calls[0].function.name }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{{ extra_note or '' }}")
    config = make_config(model, redis_url, request_timeout_s=5.0)
    register_worker(config, max_model_len=256)
    messages = [{"role": "user", "content": "add"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "adder", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c", "content": "3"}]
    async with FakeWorker(config, scripted([5])) as worker:
        async with gateway_client(config) as client:
            response = await client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": messages,
                "tools": [{"type": "function", "function": {"name": "summer", "parameters": {"type": "object"}}}],
                "chat_template_kwargs": {"extra_note": "NOTE"}})
    assert response.status_code == 200, response.text
    prompt = tokenizer.hf.decode(worker.messages[0].prompt_token_ids)
    assert "Tools: summer" in prompt and "adder" in prompt and "<|im_start|>tool\n3" in prompt
    assert prompt.endswith("<|im_start|>assistant\nNOTE")


async def test_n_128_is_one_submission(config):
    def script(request):
        return [[TokenEvent(child_request_id(request.request_id, i), step, [5 + step],
                            "length" if step == 1 else None) for i in range(request.n)]
                for step in range(2)]

    async with FakeWorker(config, script) as worker:
        async with gateway_client(config) as client:
            response = await client.post("/v1/completions", json={
                "model": MODEL, "prompt": "hi", "max_tokens": 2, "n": 128})
    assert response.status_code == 200, response.text
    assert [c["index"] for c in response.json()["choices"]] == list(range(128))
    assert [m.n for m in worker.messages] == [128]
