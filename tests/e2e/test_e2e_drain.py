"""SIGTERM drains: a worker stops taking requests and finishes those it runs (a lone
worker too: nothing is parked); a gateway finishes its open streams before it exits, for
at most its --drain-timeout."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import openai

from tests.support.stack_helpers import all_flowing, running_stack

MAX_TOKENS = 300


async def _stream(client, model: str, started: asyncio.Event, max_tokens: int) -> tuple[int, str | None]:
    """(tokens, finish reason) of one streamed completion."""
    chunks = await client.completions.create(model=model, prompt="once upon", max_tokens=max_tokens,
                                             temperature=0.8, seed=1, stream=True,
                                             extra_body={"ignore_eos": True, "return_token_ids": True})
    count, reason = 0, None
    async for chunk in chunks:
        if chunk.choices:
            count += len(chunk.choices[0].token_ids or [])
            reason = chunk.choices[0].finish_reason or reason
            if count >= 3:
                started.set()
    return count, reason


def _under_sigterm(stack, name: str, during, max_tokens: int = MAX_TOKENS) -> tuple[list, int | None]:
    """Start 3 streams, SIGTERM `name` once tokens flow in each, run `during(client)` while it
    drains; the streams' results (an exception for a stream that broke) and what `during`
    returned."""

    async def main():
        async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0,
                                      timeout=120) as client:
            started = [asyncio.Event() for _ in range(3)]  # SIGTERM once all three have tokens
            tasks = [asyncio.create_task(_stream(client, stack.served_model_name, s, max_tokens))
                     for s in started]
            await all_flowing(tasks, started)
            assert not all(t.done() for t in tasks), "the streams ended before the signal"
            stack.procs[name].send_signal(signal.SIGTERM)
            extra = await during(client)
            return await asyncio.gather(*tasks, return_exceptions=True), extra

    return asyncio.run(main())


def _no_live_worker(response: httpx.Response) -> bool:
    return response.status_code == 503 and response.json()["error"]["code"] == "no_live_worker"


def test_a_lone_worker_finishes_its_requests_on_sigterm(tiny_model_dir, redis_url, tmp_path_factory):
    with running_stack(tiny_model_dir, redis_url, tmp_path_factory.mktemp("run"),
                       worker_args=("--drain-timeout", "60")) as stack:
        async def refused_meanwhile(client):
            # Once the scheduler has seen the drain and the gateway its heartbeat (readiness
            # and admission read the same): polled, however long a loaded machine takes.
            url = f"http://{stack.config.host}:{stack.config.port}/health/ready"
            deadline = time.monotonic() + 30
            async with httpx.AsyncClient(timeout=5) as http:
                while not _no_live_worker(await http.get(url)):  # not any 503: the drain's
                    assert time.monotonic() < deadline, "the drain never reached the gateway"
                    await asyncio.sleep(0.1)
            try:
                await client.completions.create(model=stack.served_model_name, prompt="hi", max_tokens=2)
            except openai.APIStatusError as exc:
                return exc.status_code
            return 200

        results, status = _under_sigterm(stack, "worker-0", refused_meanwhile)
        assert results == [(MAX_TOKENS, "length")] * 3
        assert status == 503  # draining: no new requests
        assert stack.procs["worker-0"].wait(timeout=30) == 0


def test_a_gateway_finishes_its_open_streams_on_sigterm(tiny_model_dir, redis_url, tmp_path_factory):
    with running_stack(tiny_model_dir, redis_url, tmp_path_factory.mktemp("run")) as stack:
        async def nothing(client):
            return None

        results, _ = _under_sigterm(stack, "gateway", nothing)
        assert results == [(MAX_TOKENS, "length")] * 3
        deadline = time.monotonic() + 30
        while stack.procs["gateway"].poll() is None:
            assert time.monotonic() < deadline, "the gateway did not exit after its streams"
            time.sleep(0.1)


def test_a_gateway_cuts_what_is_open_at_its_drain_timeout(tiny_model_dir, redis_url, tmp_path_factory):
    """--drain-timeout bounds the wait: streams still open when it is up are cut (no finish
    reason) and the gateway exits. The worker is stopped meanwhile (SIGSTOP, well within its
    registration TTL) so the streams cannot finish first."""
    with running_stack(tiny_model_dir, redis_url, tmp_path_factory.mktemp("run"),
                       gateway_args=("--drain-timeout", "0.5")) as stack:
        async def exit_time(client):
            worker = stack.procs["worker-0"]
            worker.send_signal(signal.SIGSTOP)
            start = time.monotonic()
            try:
                while stack.procs["gateway"].poll() is None:
                    assert time.monotonic() - start < 40, "the gateway did not exit"
                    await asyncio.sleep(0.05)
                return time.monotonic() - start
            finally:
                worker.send_signal(signal.SIGCONT)

        results, took = _under_sigterm(stack, "gateway", exit_time)
        assert not any(r == (MAX_TOKENS, "length") for r in results), (results, took)
        assert took < 25, took  # bounded by the 0.5 s drain timeout and the exit, not the 30 s default
