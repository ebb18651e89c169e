"""Usage's cached tokens through the real stack (redis-server, a gRPC worker, the scheduler,
the gateway under uvicorn) with the official `openai` client, and through the in-process
engine's backend: a prompt of several blocks, then one sharing its prefix, reports the
block-aligned prefix hit as `usage.prompt_tokens_details.cached_tokens` (completions, chat
streamed and not) and `usage.input_tokens_details.cached_tokens` (responses); a first request
reports 0. Where the count is decided and carried: test_cached_tokens.py."""

from __future__ import annotations

import asyncio
import random

import httpx
import openai
import pytest

from tests.support.stack_helpers import running_stack, wait_until_idle

BLOCK = 16  # the worker's default --block-size
SYSTEM = " ".join(f"rule {i}: answer in {w} words." for i, w in enumerate(["few", "plain", "short", "calm"] * 4))


@pytest.fixture(scope="module")
def stack(tiny_model_dir, redis_url, tmp_path_factory):
    with running_stack(tiny_model_dir, redis_url, tmp_path_factory.mktemp("cached")) as s:
        yield s


def fresh_prompt(seed: int, length: int) -> list[int]:
    """Token ids no other test of the module sends (nothing of them is cached)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 900) for _ in range(length)]


def expected_hit(first: list[int], second: list[int]) -> int:
    """The block-aligned prefix the second prompt finds cached after the first ran: full
    blocks of their common prefix, its own last token computed again."""
    common = next((i for i, (a, b) in enumerate(zip(first, second)) if a != b), min(len(first), len(second)))
    return min(common, len(second) - 1) // BLOCK * BLOCK


def chat_prompt(stack, messages: list[dict]) -> list[int]:
    body = {"model": stack.served_model_name, "messages": messages}
    response = httpx.post(f"{stack.base_url.removesuffix('/v1')}/tokenize", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def test_completions_report_the_block_aligned_prefix_hit(stack, client):
    first = fresh_prompt(1, 3 * BLOCK + 5)
    one = client.completions.create(model=stack.served_model_name, prompt=first, max_tokens=2, temperature=0)
    assert one.usage.prompt_tokens_details.cached_tokens == 0  # a first request
    wait_until_idle(stack)
    shared = first[:2 * BLOCK + 7] + fresh_prompt(2, 6)
    two = client.completions.create(model=stack.served_model_name, prompt=shared, max_tokens=2, temperature=0)
    assert two.usage.prompt_tokens_details.cached_tokens == expected_hit(first, shared) == 2 * BLOCK
    again = client.completions.create(model=stack.served_model_name, prompt=first, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 3 * BLOCK  # all but the last token's block
    # n = 2: the prompt once, so its hit once
    both = client.completions.create(model=stack.served_model_name, prompt=shared, max_tokens=2, temperature=0,
                                     n=2)
    assert (both.usage.prompt_tokens, both.usage.prompt_tokens_details.cached_tokens) == (len(shared), 2 * BLOCK)


def test_chat_reports_it_streamed_and_not(stack, client):
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a colour."}]
    second = [first[0], {"role": "user", "content": "Name a fruit, please."}]
    one = client.chat.completions.create(model=stack.served_model_name, messages=first, max_tokens=2)
    assert one.usage.prompt_tokens_details.cached_tokens == 0
    wait_until_idle(stack)
    expected = expected_hit(chat_prompt(stack, first), chat_prompt(stack, second))
    assert expected >= 2 * BLOCK  # the system message spans blocks
    chunks = list(client.chat.completions.create(model=stack.served_model_name, messages=second, max_tokens=2,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens_details.cached_tokens == expected
    whole = client.chat.completions.create(model=stack.served_model_name, messages=second, max_tokens=2)
    assert whole.usage.prompt_tokens_details.cached_tokens == expected_hit(*[chat_prompt(stack, second)] * 2)


def test_responses_report_it_as_input_tokens_details(stack, client):
    instructions = SYSTEM.replace("rule", "law")  # none of the chat test's blocks
    one = client.responses.create(model=stack.served_model_name, instructions=instructions, input="Hello.",
                                  max_output_tokens=2)
    assert one.usage.input_tokens_details.cached_tokens == 0
    wait_until_idle(stack)
    two = client.responses.create(model=stack.served_model_name, instructions=instructions,
                                  input="Good evening to you.", max_output_tokens=2)
    expected = expected_hit(chat_prompt(stack, [{"role": "system", "content": instructions},
                                                {"role": "user", "content": "Hello."}]),
                            chat_prompt(stack, [{"role": "system", "content": instructions},
                                                {"role": "user", "content": "Good evening to you."}]))
    assert expected >= 2 * BLOCK
    assert two.usage.input_tokens_details.cached_tokens == expected


def test_the_in_process_engine_reports_it_too(tiny_model_dir, redis_url):
    from compose.engine import EngineConfig
    from compose.inprocess_backend import InProcessBackend
    from gateway.app import create_app
    from gateway.config import GatewayConfig
    from worker_svc.config import RunnerConfig

    engine = EngineConfig(runner=RunnerConfig(model=str(tiny_model_dir), num_blocks=64))
    name = tiny_model_dir.name  # the runner serves the folder's name
    app = create_app(GatewayConfig(model=str(tiny_model_dir), served_model_name=name, redis_url=redis_url),
                     backend_factory=lambda: InProcessBackend(engine))
    first = fresh_prompt(3, 3 * BLOCK + 5)
    shared = first[:2 * BLOCK + 3] + fresh_prompt(4, 4)

    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://engine/v1") as http, \
                    openai.AsyncOpenAI(base_url="http://engine/v1", api_key="unused", http_client=http,
                                       max_retries=0) as client:
                one = await client.completions.create(model=name, prompt=first, max_tokens=3, temperature=0)
                two = await client.completions.create(model=name, prompt=shared, max_tokens=3, temperature=0)
                stream = await client.completions.create(model=name, prompt=shared, max_tokens=3, temperature=0,
                                                         stream=True, stream_options={"include_usage": True})
                chunks = [chunk async for chunk in stream]
        return one, two, chunks

    one, two, chunks = asyncio.run(main())
    assert one.usage.prompt_tokens_details.cached_tokens == 0
    assert two.usage.prompt_tokens_details.cached_tokens == 2 * BLOCK
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == expected_hit(shared, shared) == 2 * BLOCK
