"""A worker's registration in Redis: `keys.worker(id)` (its msgpack WorkerRegistration, with
a TTL a heartbeat thread keeps refreshing) and its id in `keys.workers`, which schedulers
discover workers by (proto/registry.py); `drain` for SIGTERM: registered as draining, the
requests running here are given time to finish before the worker deregisters."""

from __future__ import annotations

import logging
import threading
import time

import msgspec
import redis

from proto.keys import RedisKeys
from proto.messages import WorkerRegistration, stream_encoder
from worker_svc.compute_thread import ComputeThread
from worker_svc.model_runner import ModelRunner

log = logging.getLogger("pagedserve.worker")


class Registration:
    """Keeps `keys.worker(id)` alive with a TTL while the worker lives; removes it on stop."""

    def __init__(self, client: redis.Redis, keys: RedisKeys, reg: WorkerRegistration,
                 interval_s: float, ttl_s: float):
        self._client, self._keys, self._reg = client, keys, reg
        self._interval_s, self._ttl_ms = interval_s, int(ttl_s * 1000)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self._beat()
        self._thread.start()

    def drain(self) -> None:
        """From now on say `draining` (at once, and in every beat)."""
        self._reg = msgspec.structs.replace(self._reg, draining=True)
        try:
            self._beat()
        except redis.RedisError as exc:
            log.warning("could not announce the drain: %s", exc)

    def _beat(self) -> None:
        # Both, every beat: a scheduler SREMs an id whose key expired (a stalled worker),
        # so a heartbeat that resumes must put the id back as well as the key.
        pipe = self._client.pipeline(transaction=True)
        pipe.set(self._keys.worker(self._reg.worker_id), stream_encoder.encode(self._reg), px=self._ttl_ms)
        pipe.sadd(self._keys.workers, self._reg.worker_id)
        pipe.execute()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._beat()
            except redis.RedisError as exc:  # Redis may come back; the TTL covers the gap
                log.warning("heartbeat failed: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self._client.delete(self._keys.worker(self._reg.worker_id))
            self._client.srem(self._keys.workers, self._reg.worker_id)
        except redis.RedisError:
            pass


def drain(registration: Registration, compute: ComputeThread, runner: ModelRunner, timeout_s: float) -> None:
    """Registered as draining, wait (up to `timeout_s`) until no request is still generating
    here; what is left when time is up is handed over once the worker deregisters."""
    if timeout_s <= 0:
        return
    registration.drain()
    deadline = time.monotonic() + timeout_s
    while (left := compute.call(lambda: runner.num_unfinished)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left:
        log.warning("drain timeout: handing %d running request(s) over to other workers", left)
    else:
        log.info("drained: every request here finished")
