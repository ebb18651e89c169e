"""What the KV cache benchmarks (bench/kv/kv_*.py) share: a stack started for one measurement,
a sampler of its scheduler's WorkerStats, and bench/stack/serve.py's load generator.

The scheduler writes each worker's WorkerStats to Redis about once a second under load
(and whenever it goes idle); the sampler polls faster and keeps every distinct write.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import msgspec
import redis

from bench.stack import serve
from compose.launcher import Stack, StackConfig, free_port
from proto.messages import WorkerRegistration, WorkerStats, registration_decoder, stats_decoder


@contextmanager
def running_stack(model: str, run_dir: Path, *, scheduler_args: tuple[str, ...] = (),
                  worker_args: tuple[str, ...] = ()):
    """One worker, the scheduler and the gateway (plus a redis-server) for one measurement."""
    config = StackConfig(model=str(Path(model).resolve()), port=free_port(), run_dir=run_dir,
                         key_prefix=f"bench-{uuid.uuid4().hex[:8]}", scheduler_args=scheduler_args,
                         worker_args=worker_args, startup_timeout_s=600)
    with Stack(config) as stack:
        yield stack


def registration(stack: Stack, worker_id: str = "worker-0") -> WorkerRegistration:
    return registration_decoder.decode(redis.Redis.from_url(stack.redis_url).get(stack.keys.worker(worker_id)))


class StatsSampler:
    """Polls one worker's WorkerStats every `interval_s` on a thread; `samples` holds every
    distinct write (by updated_at), as plain dicts, in order."""

    def __init__(self, stack: Stack, worker_id: str = "worker-0", interval_s: float = 0.05):
        self._client = redis.Redis.from_url(stack.redis_url)
        self._key = stack.keys.worker_stats(worker_id)
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.samples: list[dict] = []

    def latest(self) -> WorkerStats | None:
        raw = self._client.get(self._key)
        return stats_decoder.decode(raw) if raw else None

    def wait_idle(self, timeout_s: float = 120.0) -> WorkerStats:
        """Stats written after now that show every block free again."""
        since, deadline = time.time(), time.monotonic() + timeout_s
        while True:
            stats = self.latest()
            if (stats is not None and stats.updated_at >= since and stats.num_free_blocks == stats.num_blocks
                    and not stats.num_running and not stats.num_waiting):
                return stats
            if time.monotonic() > deadline:
                raise TimeoutError(f"the worker did not go idle: {stats}")
            time.sleep(0.1)

    def __enter__(self) -> StatsSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        last = None
        while not self._stop.is_set():
            stats = self.latest()
            if stats is not None and stats.updated_at != last:
                last = stats.updated_at
                self.samples.append(msgspec.structs.asdict(stats))
            self._stop.wait(self._interval_s)


def run_load(argv: list[str]) -> dict:
    """bench/stack/serve.py with these flags, in this process; its result dict."""
    return serve.measure(serve.build_parser().parse_args(argv))


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def parser(doc: str) -> argparse.ArgumentParser:
    """The flags every KV benchmark takes: the checkpoint, extra flags for the stack's
    scheduler and worker, and where to write the JSON."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/small", help="checkpoint folder")
    p.add_argument("--scheduler-arg", action="append", default=[], help="extra flag for the scheduler")
    p.add_argument("--worker-arg", action="append", default=[], help="extra flag for the worker")
    p.add_argument("--out", help="write the result here (JSON: the medians and every run)")
    return p


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(this script's flags, bench/stack/serve.py's flags after `--`)."""
    return (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])


def write_json(path: str | None, result: dict) -> None:
    """The script's result (its argv, the medians, every run), when --out names a file."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"argv": sys.argv[1:], **result}, indent=1))
