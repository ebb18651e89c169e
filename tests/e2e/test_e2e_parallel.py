"""`n > 1` through the real stack: the official `openai` client → gateway → ONE NewRequest
with n → the scheduler computes the prompt once and forks n sequences sharing its KV blocks
(copy-on-write) → the worker → the gateway maps sequence `<id>/<i>` to choice i.

Every test reads the scheduler's WorkerStats (forks, copy-on-write copies, aborts, free
blocks, integrity) to show the shared-block path was taken and everything was freed."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
import torch

from tests.support.stack_helpers import ids_of, running_stack, wait_until_idle, worker_stats

MAX_NUM_SEQS = 8  # an n=8 request fills a step: another n > 1 request must wait (before its fork)
PROMPT = [(11 * i + 7) % 900 + 3 for i in range(45)]  # 2 full blocks + 13 tokens: copy-on-write
MAX_MODEL_LEN = 8192  # past the tiny model's 1024 positions: room for LONG
LONG = MAX_MODEL_LEN - len(PROMPT)  # decode steps only an abort ends early (seconds of them)


@pytest.fixture(scope="module")
def stack(tiny_model_dir, redis_url, tmp_path_factory):
    with running_stack(tiny_model_dir, redis_url, tmp_path_factory.mktemp("parallel"),
                       worker_args=("--max-model-len", str(MAX_MODEL_LEN)),
                       scheduler_args=("--max-num-batched-tokens", "32",
                                       "--max-num-seqs", str(MAX_NUM_SEQS))) as s:
        yield s


def counters(stack) -> dict[str, int]:
    """forks, copies, aborts so far, once every block is free again (integrity checked)."""
    (stats,) = wait_until_idle(stack).values()
    assert stats.integrity_error is None, stats.integrity_error
    return {"forks": stats.num_forks, "copies": stats.num_cow_copies, "aborted": stats.num_aborted}


def grew(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in before}


def test_n4_greedy_choices_equal_transformers_through_shared_blocks(stack, client, hf_model):
    before = counters(stack)
    kwargs = dict(model=stack.served_model_name, prompt=PROMPT, max_tokens=12, temperature=0, n=4,
                  extra_body={"return_token_ids": True, "ignore_eos": True})
    full = client.completions.create(**kwargs)
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False,
                                     min_new_tokens=12, attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long))
    expected = expected[0, len(PROMPT):].tolist()
    assert [c.index for c in full.choices] == [0, 1, 2, 3]
    assert all(ids_of(c) == expected for c in full.choices), [ids_of(c) for c in full.choices]
    # OpenAI's usage: the prompt once, the completions of every choice.
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (len(PROMPT), 4 * 12)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    for i in range(4):
        assert [t for c in chunks if c.choices and c.choices[0].index == i
                for t in c.choices[0].model_extra["token_ids"]] == expected
    # The same counts; the prompt's 2 full blocks now come from the prefix cache (counted once)
    streamed = chunks[-1].usage
    assert (streamed.prompt_tokens, streamed.completion_tokens) == (full.usage.prompt_tokens, 4 * 12)
    assert streamed.prompt_tokens_details.cached_tokens == 32
    # One prompt computed, forked into 4 sequences; 3 copied the partly filled last block.
    assert grew(before, counters(stack)) == {"forks": 8, "copies": 6, "aborted": 0}


def test_n_chat_streamed_equals_collected_with_logprobs_per_choice(stack, client):
    before = counters(stack)
    kwargs = dict(model=stack.served_model_name, messages=[{"role": "user", "content": "Tell me a story"}],
                  max_tokens=10, temperature=1.0, seed=5, n=3, logprobs=True, top_logprobs=2,
                  extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    assert [c.index for c in full.choices] == [0, 1, 2]
    assert len({c.message.content for c in full.choices}) > 1  # each sequence its own seed
    assert all(len(c.logprobs.content) == 10 for c in full.choices)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    for choice in full.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        streamed = [e for c in mine if c.logprobs for e in c.logprobs.content]
        assert [e.token for e in streamed] == [e.token for e in choice.logprobs.content]
        assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in choice.logprobs.content],
                                                              abs=1e-4)
    assert grew(before, counters(stack))["forks"] == 6


def test_n4_seeded_sampling_is_reproducible(stack, client):
    kwargs = dict(model=stack.served_model_name, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=1234,
                  n=4, extra_body={"return_token_ids": True, "ignore_eos": True})
    first = [ids_of(c) for c in client.completions.create(**kwargs).choices]
    second = [ids_of(c) for c in client.completions.create(**kwargs).choices]
    assert first == second
    assert len({tuple(ids) for ids in first}) == 4  # seed + i: four different streams
    alone = client.completions.create(**{**kwargs, "n": 1})
    assert ids_of(alone.choices[0]) == first[0]  # choice 0 samples as the request with n = 1


def _unique_piece(texts: list[str]) -> tuple[int, str]:
    """(choice, a 3-character piece early in its text that no other choice's text holds):
    a stop string that ends that choice while it still has tokens to go."""
    for index, text in enumerate(texts):
        others = [t for i, t in enumerate(texts) if i != index]
        for start in range(2, len(text) // 3):
            piece = text[start:start + 3]
            if piece.strip() and not any(piece in other for other in others):
                return index, piece
    pytest.fail(f"no choice has a piece of text of its own: {texts!r}")


def test_a_stop_string_ends_only_its_choice(stack, client):
    kwargs = dict(model=stack.served_model_name, prompt=PROMPT, max_tokens=40, temperature=1.0, seed=77,
                  n=4, extra_body={"return_token_ids": True, "ignore_eos": True})
    base = client.completions.create(**kwargs)
    texts = [c.text for c in base.choices]
    stopped, piece = _unique_piece(texts)
    before = counters(stack)
    cut = client.completions.create(stop=[piece], **kwargs)
    for choice, text in zip(cut.choices, texts):
        if choice.index == stopped:
            assert (choice.text, choice.finish_reason) == (text[:text.index(piece)], "stop")
            assert len(ids_of(choice)) < 40
        else:  # the others ran on to their length
            assert (choice.text, choice.finish_reason, len(ids_of(choice))) == (text, "length", 40)
    assert cut.usage.completion_tokens == sum(len(ids_of(c)) for c in cut.choices)
    assert grew(before, counters(stack)) == {"forks": 4, "copies": 3, "aborted": 1}  # that sequence alone


def test_disconnects_abort_every_sequence_before_and_after_the_fork(stack):
    """A streamed n=8 request (all of max_num_seqs) runs forked; a collected n=4 request
    waits behind it, before its fork. Both clients go away: every block comes back."""
    before = counters(stack)

    async def main():
        async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0,
                                      timeout=120) as client:
            stream = await client.completions.create(
                model=stack.served_model_name, prompt=PROMPT, max_tokens=LONG, temperature=1.0, n=MAX_NUM_SEQS,
                stream=True, extra_body={"ignore_eos": True})
            seen = set()
            async for chunk in stream:  # tokens of every sequence: forked
                seen.update(c.index for c in chunk.choices)
                if len(seen) == MAX_NUM_SEQS:
                    break
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as http:
                waiting = asyncio.create_task(http.post("/completions", json={
                    "model": stack.served_model_name, "prompt": PROMPT, "max_tokens": 8, "n": 4}))
                deadline = asyncio.get_running_loop().time() + 30
                while not any(s.num_waiting for s in worker_stats(stack).values()):
                    assert asyncio.get_running_loop().time() < deadline, "the n=4 request never queued"
                    await asyncio.sleep(0.05)
                waiting.cancel()  # the client goes away while its request waits, unforked
                await asyncio.gather(waiting, return_exceptions=True)
                while any(s.num_waiting for s in worker_stats(stack).values()):  # its abort landed
                    assert asyncio.get_running_loop().time() < deadline, "the n=4 request was not aborted"
                    await asyncio.sleep(0.05)
            await stream.close()  # and the forked one's client too

    asyncio.run(main())
    # The waiting parent (1) and the 8 sequences were aborted; only those 8 were ever forked.
    assert grew(before, counters(stack)) == {"forks": MAX_NUM_SEQS, "copies": MAX_NUM_SEQS - 1,
                                             "aborted": 1 + MAX_NUM_SEQS}


def test_the_in_process_engine_serves_n_with_the_same_gateway(tiny_model_dir, redis_url):
    """`pagedserve engine`'s backend (no Redis, no gRPC) routes the sequences' events to
    choices and aborts one sequence at its stop string, like the Redis one."""
    from compose.engine import EngineConfig
    from compose.inprocess_backend import InProcessBackend
    from gateway.app import create_app
    from gateway.config import GatewayConfig
    from worker_svc.config import RunnerConfig

    engine = EngineConfig(runner=RunnerConfig(model=str(tiny_model_dir), num_blocks=64))
    name = tiny_model_dir.name  # the runner serves the folder's name
    app = create_app(GatewayConfig(model=str(tiny_model_dir), served_model_name=name, redis_url=redis_url),
                     backend_factory=lambda: InProcessBackend(engine))

    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://engine/v1") as http, \
                    openai.AsyncOpenAI(base_url="http://engine/v1", api_key="unused", http_client=http,
                                       max_retries=0) as client:
                kwargs = dict(model=name, prompt=PROMPT, max_tokens=40, temperature=1.0, seed=3,
                              extra_body={"return_token_ids": True, "ignore_eos": True})
                many = await client.completions.create(n=3, **kwargs)
                one = await client.completions.create(n=1, **kwargs)
                texts = [c.text for c in many.choices]
                stopped, piece = _unique_piece(texts)
                cut = await client.completions.create(n=3, stop=[piece], **kwargs)
                since = time.time()  # (the stats of the idle engine before `cut` are stale)
                deadline = asyncio.get_running_loop().time() + 30
                while True:  # the engine writes its stats when it goes idle
                    (stats,) = await app.state.backend.worker_stats()
                    if (stats.updated_at >= since and stats.num_free_blocks == stats.num_blocks
                            and not stats.num_running):
                        break
                    assert asyncio.get_running_loop().time() < deadline, stats
                    await asyncio.sleep(0.05)
        return many, one, texts, stopped, piece, cut, stats

    many, one, texts, stopped, piece, cut, stats = asyncio.run(main())
    assert ids_of(many.choices[0]) == ids_of(one.choices[0])
    assert len({tuple(ids_of(c)) for c in many.choices}) == 3
    assert [c.text for c in cut.choices] == [t[:t.index(piece)] if i == stopped else t for i, t in enumerate(texts)]
    assert (stats.num_forks, stats.num_aborted, stats.integrity_error) == (6, 1, None)
