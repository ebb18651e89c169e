"""The encoders of a running stack (compose/launcher.py `Stack`), for the benchmarks that
start, stop, kill and count them: bench/cameras/encoder_scaling.py and bench/stack/chaos.py's encoder
faults. `set_encoders` (start or stop encoders until N run), `encoded_counts` (each
service's `mm_items_encoded_total`), `queue_depth`, `published` (which embeddings are in
Redis), `wait_drained`, `kill_after_batch`, `who_encoded`, `tagged` (the same JPEG with a
tag in a comment segment: new bytes, the same pixels), `round_frames` (a round's tagged
frames).
"""

from __future__ import annotations

import functools
import hashlib
import signal
import time

import redis

from bench.common.workloads import camera_frame
from compose.launcher import Stack
from encoder_svc.jobs import EncodeJobStream
from proto.encoder_messages import encoder_registration_decoder
from proto.metrics_scrape import metric, scrape

ENCODED = "pagedserve:mm_items_encoded_total"


def alive(stack: Stack, name: str) -> bool:
    proc = stack.procs.get(name)
    return proc is not None and proc.poll() is None


def running_encoders(stack: Stack) -> list[str]:
    """The encoder processes alive now, oldest first."""
    names = [n for n in stack.procs if n.startswith("encoder-") and alive(stack, n)]
    return sorted(names, key=lambda n: int(n.rpartition("-")[2]))


def set_encoders(stack: Stack, n: int, timeout_s: float = 120.0) -> list[str]:
    """Exactly `n` encoders alive and registered: the newest stopped (SIGTERM: they finish
    their batch and deregister) or new ones started; their names, oldest first. Call it
    from the thread the stack lives on (a child gets SIGTERM when the thread that started
    it ends)."""
    names = running_encoders(stack)
    while len(names) > n:
        stack.stop_process(names.pop())
    while len(names) < n:  # started side by side, not one after the other
        names.append(stack.add_encoder(wait=False))
    deadline = time.monotonic() + timeout_s
    while set(stack.live_encoder_ids()) != set(names):  # a killed one's registration runs out (5 s)
        dead = [name for name in names if not alive(stack, name)]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"encoders registered: {stack.live_encoder_ids()}, expected {names}; "
                               f"exited: {dead}; logs in {stack.config.run_dir}")
        time.sleep(0.1)
    return names


def stop_encoders(stack: Stack) -> None:
    """Stop every encoder (Stack.stop does not know them)."""
    for name in reversed(running_encoders(stack)):
        stack.stop_process(name)


def encoded_counts(stack: Stack, prefixes: tuple[str, ...] = ("encoder-", "worker-"),
                   name: str = ENCODED) -> dict[str, float]:
    """`name` (media encoded, by default) from the /metrics of each live encoder and worker."""
    out = {}
    for proc, url in stack.metrics_urls.items():
        if proc.startswith(prefixes) and alive(stack, proc):
            try:
                out[proc] = metric(scrape(url, timeout_s=5), name)
            except OSError:
                pass
    return out


def queue_depth(stack: Stack) -> int:
    """Encode jobs no encoder has finished (not read yet, or read and not acknowledged)."""
    with redis.Redis.from_url(stack.redis_url, socket_timeout=5) as client:
        try:
            return EncodeJobStream(client, stack.keys, "bench").depth()
        except redis.ResponseError:  # no stream yet
            return 0


def fingerprint(stack: Stack) -> str:
    """What the live encoders' embeddings are keyed by (RedisKeys.embeddings)."""
    with redis.Redis.from_url(stack.redis_url, socket_timeout=5) as client:
        for encoder_id in stack.live_encoder_ids():
            raw = client.get(stack.keys.encoder(encoder_id))
            if raw:
                return encoder_registration_decoder.decode(raw).fingerprint
    raise RuntimeError("no live encoder")


def published(stack: Stack, fp: str, hashes: list[str]) -> set[str]:
    """Those of `hashes` whose embeddings (keyed `fp`) are in Redis now."""
    with redis.Redis.from_url(stack.redis_url, socket_timeout=5) as client:
        pipe = client.pipeline(transaction=False)
        for h in hashes:
            pipe.exists(stack.keys.embeddings(fp, h))
        return {h for h, n in zip(hashes, pipe.execute()) if n}


def wait_drained(stack: Stack, timeout_s: float = 120.0) -> None:
    """Until the live encoders have finished every encode job (a dead one's after its claim TTL)."""
    deadline = time.monotonic() + timeout_s
    while running_encoders(stack) and queue_depth(stack) and time.monotonic() < deadline:
        time.sleep(0.2)


def kill_after_batch(stack: Stack, victim: str, before: dict[str, float], seen: dict, timeout_s: float = 30.0) -> None:
    """SIGKILL encoder `victim` once it has encoded more media than `before` (encoded_counts)
    says (a batch done; `timeout_s` at most); seen["unfinished"]: the encode jobs not done
    then. Marked stopped: the launcher does not start it again."""
    deadline = time.monotonic() + timeout_s
    while encoded_counts(stack, (victim,)).get(victim, 0) <= before.get(victim, 0) and time.monotonic() < deadline:
        time.sleep(0.02)
    seen["unfinished"] = queue_depth(stack)
    stack.stop_process(victim, signal.SIGKILL)


def who_encoded(stack: Stack, fp: str | None, hashes: list[str], before: dict[str, float],
                killed: str | None = None) -> tuple[dict[str, int], int]:
    """Who encoded the media `hashes` since `before` (encoded_counts): each live encoder and
    worker by its count, `killed` (an encoder SIGKILLed meanwhile) at least by what was
    published (the embeddings of `hashes` keyed `fp` in Redis) beyond what the live encoders
    and the workers encoded (a worker publishes what it takes over from the encoders' queue);
    and how many of them were neither published nor encoded by a worker."""
    after = encoded_counts(stack)
    encoded = {n: round(after[n] - before.get(n, 0)) for n in sorted(after)}
    found = len(published(stack, fp, hashes)) if fp else 0
    by_workers = sum(v for n, v in encoded.items() if n.startswith("worker-"))
    if killed is not None:
        live = sum(v for n, v in encoded.items() if n.startswith("encoder-"))
        encoded = {f"{killed} (killed)": max(0, found - live - by_workers), **encoded}
    return encoded, max(0, len(hashes) - found - by_workers)


@functools.lru_cache(maxsize=None)
def _picture(seed: int, width: int, height: int) -> bytes:
    return camera_frame(seed, width, height)


def round_frames(requests: list[tuple[str, int]], tag: str, width: int, height: int) -> dict[str, list[bytes]]:
    """The frames of (key, how many) requests in one round: the same pictures every round
    (request i's frame k is picture i * 64 + k), tagged with the round (`tag`)."""
    return {key: [tagged(_picture(i * 64 + k, width, height), tag) for k in range(count)]
            for i, (key, count) in enumerate(requests)}


def tagged(jpeg: bytes, tag: str) -> bytes:
    """`jpeg` with a comment segment (COM) holding `tag` right after its start marker: other
    bytes (another content hash: new to the stack), the same pixels."""
    text = tag.encode()
    return jpeg[:2] + b"\xff\xfe" + (len(text) + 2).to_bytes(2, "big") + text + jpeg[2:]


def digest(data: bytes) -> str:
    """The content hash the gateway stores an image file under (gateway/media/store.py)."""
    return hashlib.sha256(data).hexdigest()


# ---- one run -------------------------------------------------------------------------------
