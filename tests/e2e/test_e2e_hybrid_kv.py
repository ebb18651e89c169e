"""Gemma 3's KV cache groups through the whole stack (official openai client -> gateway ->
Redis -> scheduler -> gRPC -> worker): the tiny Gemma 3 has two sliding layers (window 48)
and a global one, so the worker keeps a block table per group and the sliding groups give
back their blocks behind the window. Long greedy generations (prompt + output up to ~7
windows), prefix hits on a shared prefix longer than the window, n = 2, chunked prefill
and preemption -- by recompute and by swap -- in a pool far too small to hold the requests
with every layer's blocks: every output equals transformers' generate() token for token."""

from __future__ import annotations

import asyncio
import random

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.stack_helpers import running_stack, wait_until_idle

NUM_BLOCKS = 60  # blocks of 16 tokens, one layer each: 960 token slots across three groups
TOKEN_BUDGET = 64


@pytest.fixture(scope="module", params=["recompute", "swap"])
def gemma3(request, family_model_dir, redis_url, tmp_path_factory):
    model_dir = family_model_dir("gemma3")
    mode = request.param
    with running_stack(model_dir, redis_url, tmp_path_factory.mktemp(f"hybrid-{mode}"),
                       worker_args=("--num-blocks", str(NUM_BLOCKS), "--swap-space", "4MiB"),
                       scheduler_args=("--max-num-batched-tokens", str(TOKEN_BUDGET),
                                       "--preemption-mode", mode)) as stack:
        yield mode, stack, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _expected(hf, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy tokens, EOS banned throughout (as min_tokens = max_tokens)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                          do_sample=False, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def test_long_greedy_generations_equal_transformers(gemma3):
    mode, stack, hf = gemma3
    rng = random.Random(7)
    vocab = hf.config.vocab_size
    shared = [rng.randrange(10, vocab) for _ in range(100)]  # two windows and more
    cases = []  # (prompt, max_tokens, n)
    for i in range(10):
        prompt = (shared + [rng.randrange(10, vocab) for _ in range(rng.randint(3, 30))] if i % 2
                  else [rng.randrange(10, vocab) for _ in range(rng.randint(20, 120))])
        cases.append((prompt, rng.randint(120, 220), 2 if i % 4 == 1 else 1))

    async def one(client, prompt, max_tokens, n):
        resp = await client.completions.create(
            model=stack.served_model_name, prompt=prompt, max_tokens=max_tokens, temperature=0, n=n,
            extra_body={"return_token_ids": True, "min_tokens": max_tokens})
        return [choice.token_ids for choice in sorted(resp.choices, key=lambda c: c.index)]

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0,
                                      timeout=600) as client:
            return await asyncio.gather(*(one(client, *case) for case in cases))

    outputs = asyncio.run(all_of_them())
    for i, ((prompt, max_tokens, n), choices) in enumerate(zip(cases, outputs)):
        expected = _expected(hf, prompt, max_tokens)
        assert choices == [expected] * n, (mode, i, len(prompt), max_tokens)

    (stats,) = wait_until_idle(stack, timeout=60).values()
    assert stats.integrity_error is None
    assert stats.num_free_blocks == stats.num_blocks == NUM_BLOCKS
    assert stats.num_preemptions >= 1, "the pool was meant to be small enough to preempt"
    if mode == "swap":
        assert stats.num_swapped_out >= 1 and stats.num_swapped == 0
    assert stats.prefix_cache_hits >= 96, "the shared prefix was meant to be found cached"
    assert stats.num_forks >= 2
