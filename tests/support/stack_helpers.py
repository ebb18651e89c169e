"""Helpers for tests that start the real stack (redis-server, gRPC workers, scheduler,
the gateway under uvicorn) through the same launcher `pagedserve up` uses."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path

import openai
import redis

from compose.launcher import Stack, StackConfig, free_port
from proto.keys import RedisKeys
from proto.messages import WorkerStats, stats_decoder


@contextmanager
def running_stack(model: Path, redis_url: str | None, run_dir: Path, workers: int = 1,
                  worker_args: tuple[str, ...] = (), scheduler_args: tuple[str, ...] = (),
                  gateway_args: tuple[str, ...] = (), schedulers: int = 1, encoders: int = 0,
                  encoder_args: tuple[str, ...] = (), gateways: int = 1):
    """`redis_url` None: the launcher starts a redis-server of the stack's own."""
    config = StackConfig(model=str(model), port=free_port(), workers=workers, gateways=gateways, redis_url=redis_url,
                         schedulers=schedulers, encoders=encoders,
                         encoder_args=("--threads", "1", *encoder_args) if encoders else (),
                         key_prefix=f"test-{uuid.uuid4().hex[:8]}", run_dir=run_dir,
                         worker_args=("--threads", "1", *worker_args), scheduler_args=scheduler_args,
                         gateway_args=gateway_args,
                         startup_timeout_s=120)
    with Stack(config) as stack:
        yield stack


def ids_of(choice) -> list[int]:
    """The token ids of a choice (the `return_token_ids` extension)."""
    return choice.model_extra["token_ids"]


def worker_stats(stack: Stack) -> dict[str, WorkerStats]:
    client = redis.Redis.from_url(stack.redis_url)
    keys = RedisKeys(stack.config.key_prefix)
    out = {}
    for key in client.scan_iter(match=keys.worker_stats("*")):
        stats = stats_decoder.decode(client.get(key))
        out[stats.worker_id] = stats
    return out


def wait_until_idle(stack: Stack, worker_ids: list[str] | None = None, timeout: float = 30.0) -> dict[str, WorkerStats]:
    """Wait until every worker's pool is entirely free again, as stats written from now on
    say (a client has its tokens before the scheduler has the step's result); return them."""
    since = time.time()
    deadline = time.monotonic() + timeout
    while True:
        stats = worker_stats(stack)
        chosen = [stats.get(w) for w in worker_ids] if worker_ids else list(stats.values())
        if chosen and all(s is not None and s.updated_at >= since and s.num_free_blocks == s.num_blocks
                          and s.num_running == 0 and s.num_waiting == 0 for s in chosen):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks still held after {timeout}s: {stats}")
        time.sleep(0.1)


def wait_until_answers(url: str, proc: subprocess.Popen, timeout: float, what: str) -> None:
    """Poll `url` until it answers; fail with `what` if `proc` exits or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, what
            time.sleep(0.1)


def greedy_completions(stack: Stack, cases: list[tuple[list[int], int]]) -> list:
    """Every (prompt ids, max_tokens) case sent at once through the official client, greedy,
    with the generated token ids returned; the choices in the order of `cases`."""
    async def one(client, prompt, max_tokens):
        resp = await client.completions.create(model=stack.served_model_name, prompt=prompt,
                                               max_tokens=max_tokens, temperature=0,
                                               extra_body={"return_token_ids": True})
        return resp.choices[0]

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0,
                                      timeout=300) as client:
            return await asyncio.gather(*(one(client, p, m) for p, m in cases))

    return asyncio.run(all_of_them())


async def stream_ids(client, stack: Stack, prompt, started: asyncio.Event, **kwargs) -> list[int]:
    """A streamed completion's token ids (ignoring EOS); `started` is set once 5 arrived."""
    ids = []
    stream = await client.completions.create(
        model=stack.served_model_name, prompt=prompt, stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True}, **kwargs)
    async for chunk in stream:
        if chunk.choices:
            ids.extend(chunk.choices[0].token_ids or [])
            if len(ids) >= 5:
                started.set()
    return ids


async def all_flowing(tasks: Sequence[asyncio.Task], started: Sequence[asyncio.Event], timeout_s: float = 120) -> None:
    """Until each stream's `started` is set or its task has ended (a stream that failed
    early then shows its own error, not a timeout here)."""
    async def one(task: asyncio.Task, event: asyncio.Event) -> None:
        waiter = asyncio.create_task(event.wait())
        try:
            await asyncio.wait([waiter, task], return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()

    await asyncio.wait_for(asyncio.gather(*(one(t, e) for t, e in zip(tasks, started))), timeout_s)


def run_streams(stack: Stack, prompts, fault: Callable[[], None] | None = None, **kwargs) -> list[list[int]]:
    """Stream every prompt at once (the official openai client); once tokens flow in every
    stream (a request still on its way when the fault strikes tests something else), call
    `fault`. The token ids of each."""
    async def run_all():
        client = openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)
        started = [asyncio.Event() for _ in prompts]
        async with client:
            tasks = [asyncio.create_task(stream_ids(client, stack, p, s, **kwargs)) for p, s in zip(prompts, started)]
            await all_flowing(tasks, started)
            if fault is not None:
                assert not all(t.done() for t in tasks), "the streams ended before the fault"
                await asyncio.to_thread(fault)
            return await asyncio.gather(*tasks)

    return asyncio.run(run_all())


def kill(stack: Stack, name: str | Callable[[], str]) -> Callable[[], None]:
    """A fault: SIGKILL the stack's process `name` (or the one `name()` names then)."""
    def fault() -> None:
        stack.stop_process(name if isinstance(name, str) else name(), sig=signal.SIGKILL)
    return fault
