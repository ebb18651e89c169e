"""A Redis restart under a running stack (its own redis-server, no persistence, killed
and restarted by the launcher on the same port): no service exits, no worker is retired,
the streams in flight complete with the text they have without the fault (the gateway
sends them again, gateway/backend.py), and a request after it succeeds."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import openai

from tests.support.stack_helpers import all_flowing, running_stack


def _ready(stack) -> dict | None:
    try:
        response = httpx.get(f"http://{stack.config.host}:{stack.config.port}/health/ready", timeout=5)
    except httpx.HTTPError:
        return None
    return response.json() if response.status_code == 200 else None


def test_a_redis_restart_under_load(tiny_model_dir, tmp_path_factory):
    with running_stack(tiny_model_dir, None, tmp_path_factory.mktemp("run")) as stack:
        model = stack.served_model_name

        params = dict(model=model, prompt="once upon", max_tokens=400, temperature=0,
                      extra_body={"ignore_eos": True})
        sync_client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)
        fault_free = sync_client.completions.create(**params).choices[0].text

        async def stream(client, started: asyncio.Event) -> str:
            """The text, or the error it ended with."""
            try:
                chunks = await client.completions.create(**params, stream=True)
                pieces = []
                async for chunk in chunks:
                    pieces.append(chunk.choices[0].text)
                    if len(pieces) >= 3:
                        started.set()
                return "".join(pieces)
            except openai.APIError as exc:
                return f"error: {exc}"

        async def main() -> list[str]:
            async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0,
                                          timeout=60) as client:
                # Redis goes down once every stream is in flight (a request submitted during
                # the outage gets a 503, by design: that is not what this test is about).
                started = [asyncio.Event() for _ in range(4)]
                tasks = [asyncio.create_task(stream(client, s)) for s in started]
                await all_flowing(tasks, started)
                assert not all(t.done() for t in tasks), "the streams ended before the fault"
                redis_proc = stack.procs["redis"]
                redis_proc.send_signal(signal.SIGKILL)
                await asyncio.to_thread(redis_proc.wait, 10)
                await asyncio.sleep(1.0)  # an outage of a second
                assert stack.supervise() == ["redis"]
                # In flight: each ends, well within the client's timeout (nothing hangs).
                return await asyncio.wait_for(asyncio.gather(*tasks), 90)

        outcomes = asyncio.run(main())
        assert outcomes == [fault_free] * 4

        deadline = time.monotonic() + 30
        while (ready := _ready(stack)) is None:
            assert time.monotonic() < deadline, "not ready again after the Redis restart"
            time.sleep(0.2)
        assert ready["workers"] == ["worker-0"]
        reply = sync_client.completions.create(model=model, prompt="hello", max_tokens=5)
        assert reply.choices[0].finish_reason in ("stop", "length")
        # No service exited but the killed Redis, and the worker was never retired.
        assert [n for n, p in stack.procs.items() if p.poll() is not None] == []
        scheduler_log = (stack.config.run_dir / "scheduler.log").read_text()
        assert "retiring worker" not in scheduler_log
