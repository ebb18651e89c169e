"""Helpers for tests that start the real stack (redis-server, gRPC workers, scheduler,
the gateway under uvicorn) through the same launcher `pagedserve up` uses."""

from __future__ import annotations

import subprocess
import time
import urllib.request
import uuid
from contextlib import contextmanager
from pathlib import Path

import redis

from compose.launcher import Stack, StackConfig, free_port
from proto.keys import RedisKeys
from proto.messages import WorkerStats, stats_decoder


@contextmanager
def running_stack(model: Path, redis_url: str, run_dir: Path, workers: int = 1,
                  worker_args: tuple[str, ...] = (), scheduler_args: tuple[str, ...] = ()):
    config = StackConfig(model=str(model), port=free_port(), workers=workers, redis_url=redis_url,
                         key_prefix=f"test-{uuid.uuid4().hex[:8]}", run_dir=run_dir,
                         worker_args=("--threads", "1", *worker_args), scheduler_args=scheduler_args,
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
