"""The whole pipeline, started for real: official `openai` client → gateway (uvicorn) →
Redis stream → scheduler → gRPC → worker → Redis pub/sub → gateway."""

from __future__ import annotations

import asyncio
import random

import openai
import pytest
import torch
from transformers import AutoTokenizer

from tests.support.runner_helpers import hf_greedy
from tests.support.stack_helpers import greedy_completions, kill, run_streams, running_stack, wait_until_idle

NUM_BLOCKS = 48  # 768 token slots for 24 requests needing ~2,400: forces preemption
TOKEN_BUDGET = 48  # prompts up to 120 tokens are prefilled in chunks
# Nearly all the pool holds for one short prompt (max_model_len is 1024, the pool 768 slots):
# hundreds of decode steps, so such a request only ends early when it is aborted.
LONG_MAX_TOKENS = NUM_BLOCKS * 16 - 32


@pytest.fixture(scope="module", params=["off", "on"], ids=["lockstep", "async-scheduling"])
def stack(request, tiny_model_dir, redis_url, tmp_path_factory):
    """Every test on this stack runs twice: steps planned one at a time (the default on a
    CPU worker), and each planned while the one before runs (--async-scheduling on)."""
    with running_stack(tiny_model_dir, redis_url, tmp_path_factory.mktemp("run"),
                       worker_args=("--num-blocks", str(NUM_BLOCKS)),
                       scheduler_args=("--max-num-batched-tokens", str(TOKEN_BUDGET),
                                       "--async-scheduling", request.param)) as s:
        yield s


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)



def test_greedy_equals_transformers_with_chunking_and_preemption(stack, hf_model, tokenizer):
    rng = random.Random(0)
    vocab = tokenizer.vocab_size
    special = set(tokenizer.all_special_ids)
    cases = []
    for i in range(24):
        prompt = [t for t in (rng.randrange(vocab) for _ in range(rng.randint(3, 120))) if t not in special]
        cases.append((prompt, rng.randint(1, 40)))

    choices = greedy_completions(stack, cases)
    for (prompt, max_tokens), choice in zip(cases, choices):
        expected = hf_greedy(hf_model, prompt, max_tokens)
        assert choice.token_ids == expected, f"prompt of {len(prompt)} tokens"
        assert choice.text == tokenizer.decode(expected, skip_special_tokens=True)
        assert choice.finish_reason == ("length" if len(expected) == max_tokens else "stop")

    stats = wait_until_idle(stack)
    (only,) = stats.values()
    assert only.integrity_error is None
    assert only.num_free_blocks == only.num_blocks == NUM_BLOCKS
    assert only.num_preemptions >= 1, "the pool was meant to be small enough to preempt"

    # The same accounting, as Prometheus metrics at the gateway.
    import urllib.request

    text = urllib.request.urlopen(stack.base_url.removesuffix("/v1") + "/metrics").read().decode()
    samples = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
               if line.startswith("pagedserve:")}
    assert samples['pagedserve:num_preemptions_total{worker="worker-0"}'] >= 1
    assert samples['pagedserve:kv_blocks_total{worker="worker-0"}'] == NUM_BLOCKS
    assert samples['pagedserve:kv_cache_usage_perc{worker="worker-0"}'] == 0.0
    assert samples['pagedserve:kv_integrity_ok{worker="worker-0"}'] == 1.0
    # Steps planned while the one before ran: only with async scheduling on.
    ahead = samples['pagedserve:scheduler_steps_ahead_total{worker="worker-0"}']
    assert ahead == only.num_steps_ahead
    flags = dict(zip(stack.config.scheduler_args[::2], stack.config.scheduler_args[1::2]))
    assert (ahead > 0) == (flags["--async-scheduling"] == "on")
    # Idle, every step planned came back and was timed once.
    assert samples['pagedserve:step_duration_seconds_count{worker="worker-0"}'] == only.num_steps
    assert samples['pagedserve:prefix_cache_queries_total{worker="worker-0"}'] > 0


def test_streaming_equals_non_streaming_completions(stack):
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    kwargs = dict(model=stack.served_model_name, prompt="The quick brown fox", max_tokens=24, temperature=0)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert full.usage.completion_tokens > 0 and full.usage.prompt_tokens > 0


def test_streaming_equals_non_streaming_chat(stack):
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    kwargs = dict(model=stack.served_model_name, temperature=0, max_tokens=20,
                  messages=[{"role": "system", "content": "You are terse."},
                            {"role": "user", "content": "Name three colours."}])
    full = client.chat.completions.create(**kwargs)
    assert full.choices[0].message.role == "assistant"
    stream = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == full.choices[0].message.content
    assert stream[-1].usage.completion_tokens == full.usage.completion_tokens


def test_stop_string_cuts_and_frees_blocks(stack, tokenizer):
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    base = client.completions.create(model=stack.served_model_name, prompt="Once upon a time",
                                     max_tokens=30, temperature=0)
    text = base.choices[0].text
    if len(text) < 6:
        pytest.fail(f"the tiny model produced too little text to pick a stop string: {text!r}")
    stop = text[3:6]
    aborted = sum(s.num_aborted for s in wait_until_idle(stack).values())
    # Far more tokens than the stop string needs (and no EOS ending it early): only the
    # gateway's abort at the stop string can end it before the assertions below.
    cut = client.completions.create(model=stack.served_model_name, prompt="Once upon a time",
                                    max_tokens=LONG_MAX_TOKENS, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    stats = wait_until_idle(stack)
    assert sum(s.num_aborted for s in stats.values()) >= aborted + 1, stats  # the hit aborted it


def test_client_disconnect_aborts(stack):
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    aborted = sum(s.num_aborted for s in wait_until_idle(stack).values())
    stream = client.completions.create(model=stack.served_model_name, prompt="Hello",
                                       max_tokens=LONG_MAX_TOKENS, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    stats = wait_until_idle(stack)  # the abort freed the request's blocks long before it could finish
    assert all(s.integrity_error is None for s in stats.values())
    assert sum(s.num_aborted for s in stats.values()) >= aborted + 1, stats  # aborted, not finished


def test_errors_through_the_stack(stack):
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=4)
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=stack.served_model_name, prompt="hi", max_tokens=10**6)
    assert err.value.body["code"] == "context_length_exceeded"
    assert "1000000" in err.value.body["message"]


def test_two_workers_share_load_and_survive_sigterm(tiny_model_dir, redis_url, tmp_path_factory):
    with running_stack(tiny_model_dir, redis_url, tmp_path_factory.mktemp("run2"), workers=2) as stack:
        async def burst(n):
            async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0,
                                          timeout=120) as client:
                return await asyncio.gather(*(client.completions.create(
                    model=stack.served_model_name, prompt=f"Request number {i}", max_tokens=16, temperature=0)
                    for i in range(n)))

        first = asyncio.run(burst(8))
        assert all(r.choices[0].finish_reason in ("stop", "length") for r in first)
        # Tokens reach the client before the scheduler has the step's result: wait for it.
        stats = wait_until_idle(stack, ["worker-0", "worker-1"])
        assert all(stats[w].num_steps > 0 for w in ("worker-0", "worker-1")), stats

        assert stack.stop_process("worker-0") == 0  # SIGTERM: a clean exit
        second = asyncio.run(burst(6))
        assert len(second) == 6 and all(r.choices[0].finish_reason in ("stop", "length") for r in second)
        wait_until_idle(stack, ["worker-1"])


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_requests_survive_a_worker_killed_mid_generation(tiny_model_dir, redis_url, tmp_path_factory, hf_model,
                                                         async_scheduling):
    """SIGKILL (no deregistration): the scheduler sees the Step fail (with async scheduling,
    two steps in flight), moves the requests to the other worker, which recomputes them;
    clients get complete, correct outputs."""
    with running_stack(tiny_model_dir, redis_url, tmp_path_factory.mktemp("run3"), workers=2,
                       scheduler_args=("--async-scheduling", async_scheduling)) as stack:
        prompts = [[10 + i, 20 + i, 30 + i, 40 + i] for i in range(6)]
        max_tokens = 120
        outputs = run_streams(stack, prompts, fault=kill(stack, "worker-0"), max_tokens=max_tokens, temperature=0)
        for prompt, ids in zip(prompts, outputs):
            assert len(ids) == max_tokens
            with torch.no_grad():
                expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                             min_new_tokens=max_tokens,
                                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
            expected = expected[0, len(prompt):].tolist()
            # min_new_tokens masks EOS where we ignore it: compare up to the first EOS only.
            eos = set(hf_model.generation_config.eos_token_id or [])
            cut = next((i for i, t in enumerate(ids) if t in eos), len(ids))
            assert ids[:cut] == expected[:cut]
        wait_until_idle(stack, ["worker-1"])


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_seeded_sampled_requests_killed_mid_generation_match_the_fault_free_run(
        tiny_model_dir, redis_url, tmp_path_factory, async_scheduling):
    """Temperature 0.8 with seeds: the requests moved off a worker killed mid-stream (tokens
    it published in steps whose results never came back included) give exactly the texts
    of the same requests without the fault, with no token repeated or skipped."""
    with running_stack(tiny_model_dir, redis_url, tmp_path_factory.mktemp("run4"), workers=2,
                       scheduler_args=("--async-scheduling", async_scheduling)) as stack:
        prompts = [[11 + i, 21 + i, 31 + i, 41 + i] for i in range(8)]
        max_tokens = 120

        def run(fault) -> list[list[int]]:
            return run_streams(stack, prompts, fault=fault, max_tokens=max_tokens, temperature=0.8, seed=7)

        calm = run(None)
        assert len({tuple(ids) for ids in calm}) == len(prompts)  # sampled: they differ
        faulted = run(kill(stack, "worker-0"))
        assert [len(ids) for ids in faulted] == [max_tokens] * len(prompts)
        assert faulted == calm
        wait_until_idle(stack, ["worker-1"])


def test_swap_preemption_through_the_stack(tiny_model_dir, redis_url, tmp_path_factory, hf_model, tokenizer):
    """--preemption-mode swap on the scheduler, --swap-space on the worker: greedy outputs
    still equal transformers, requests were swapped out and back, every block comes back."""
    rng = random.Random(5)
    special = set(tokenizer.all_special_ids)
    cases = []
    for _ in range(16):
        prompt = [t for t in (rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(3, 80)))
                  if t not in special]
        cases.append((prompt, rng.randint(10, 40)))
    with running_stack(tiny_model_dir, redis_url, tmp_path_factory.mktemp("swap"),
                       worker_args=("--num-blocks", "24", "--swap-space", "8MiB"),
                       scheduler_args=("--max-num-batched-tokens", "48", "--preemption-mode", "swap")) as stack:
        choices = greedy_completions(stack, cases)
        stats = wait_until_idle(stack)
    for (prompt, max_tokens), choice in zip(cases, choices):
        assert choice.token_ids == hf_greedy(hf_model, prompt, max_tokens), f"prompt of {len(prompt)} tokens"
    (only,) = stats.values()
    assert only.integrity_error is None
    assert only.num_swapped_out >= 1, "the pool was meant to be small enough to swap"
    assert only.num_cpu_blocks > 0 and only.num_free_cpu_blocks == only.num_cpu_blocks
    assert only.num_free_blocks == only.num_blocks == 24 and only.num_swapped == 0


def test_parallel_sampling_through_the_scheduler_and_worker(tiny_model_dir, redis_url, tmp_path_factory, hf_model):
    """NewRequest.n = 3 put on the stream as a gateway would: the prompt is computed once,
    the three children's events arrive under f"{id}/{i}", greedy children equal transformers;
    aborting the parent's id aborts the children; the stream entry is acknowledged."""
    import time

    import redis as sync_redis

    from proto.keys import STREAM_FIELD, RedisKeys
    from proto.messages import AbortRequest, NewRequest, SamplingParams, events_decoder, stream_encoder

    prompt = [(11 * i + 7) % 900 + 3 for i in range(37)]
    with running_stack(tiny_model_dir, redis_url, tmp_path_factory.mktemp("n")) as stack:
        client = sync_redis.Redis.from_url(stack.redis_url)
        keys = RedisKeys(stack.config.key_prefix)
        channel = keys.reply_channel("test-gw")
        sub = client.pubsub()
        sub.subscribe(channel)
        sub.get_message(timeout=5)  # the subscribe confirmation

        def events_until(done, timeout=60.0):
            tokens, reasons = {}, {}
            deadline = time.monotonic() + timeout
            while not done(tokens, reasons):
                assert time.monotonic() < deadline, (tokens, reasons)
                message = sub.get_message(timeout=1.0)
                if message is None or message["type"] != "message":
                    continue
                for event in events_decoder.decode(message["data"]):
                    for k, t in enumerate(event.token_ids):
                        tokens.setdefault(event.request_id, {})[event.index + k] = t
                    if event.finish_reason:
                        reasons[event.request_id] = event.finish_reason
            return tokens, reasons

        greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        client.xadd(keys.requests, {STREAM_FIELD: stream_encoder.encode(
            NewRequest("par", prompt, greedy, channel, time.time(), n=3))})
        tokens, reasons = events_until(lambda t, r: len(r) == 3)
        assert sorted(reasons) == ["par/0", "par/1", "par/2"]
        expected = hf_greedy(hf_model, prompt, 10)
        for rid in reasons:
            assert [tokens[rid][k] for k in sorted(tokens[rid])] == expected, rid

        long = SamplingParams(max_tokens=400, temperature=1.0, seed=5, ignore_eos=True)
        client.xadd(keys.requests, {STREAM_FIELD: stream_encoder.encode(
            NewRequest("big", prompt, long, channel, time.time(), n=3))})
        events_until(lambda t, r: len(t) == 3 and all(len(v) >= 2 for v in t.values()))
        client.xadd(keys.requests, {STREAM_FIELD: stream_encoder.encode(AbortRequest("big"))})
        stats = wait_until_idle(stack)
        (only,) = stats.values()
        assert only.integrity_error is None and only.num_forks == 6 and only.num_cow_copies == 4
        deadline = time.monotonic() + 10
        while client.xlen(keys.requests) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.xlen(keys.requests) == 0, "stream entries left unacknowledged"
        sub.close()
