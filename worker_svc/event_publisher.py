"""Publishing a step's TokenEvents to Redis: one pipelined round trip per step, through
redis-py's public pipeline (no transaction: the PUBLISHes are independent).

Guarantees the worker and the gateway rely on:

* Order. Publishes take turns (a lock: the compute thread and the publishing thread both
  publish), and each one's pipeline has run before the next begins, so every channel sees
  the events in publish order; a step's events are through Redis before its result leaves
  the worker, hence before any command the scheduler sends because of that result.
* A finished request's last events are out when publish returns (the scheduler
  acknowledges its stream entry once the step's result is back): publish returns only
  after Redis answered every PUBLISH.
* Nothing is lost to a broken connection. The pipeline runs again on a new connection
  under the client's retry policy (Redis may have run some of it already: the gateway
  drops the events it has, by index). If Redis stays out of reach the publish raises and
  keeps its events; the next publish sends them first, in order, then its own.
* A PUBLISH that Redis refuses (an ACL) raises from that publish, after the rest of the
  batch went out; nothing of it is kept.

The round trip sits on the step's critical path when the compute thread publishes itself
(no step queued behind it). Writing without reading the replies would save it, but only
through redis-py's private connection internals, and served it measured no faster (0.99x in
fp32, 1.02x in bf16: docs/performance.md, "Tried and dropped"; bench/compute/event_publish.py
compares the two publishers alone).

    publisher = EventPublisher(redis.Redis.from_url(url))
    publisher.publish({channel: [TokenEvent, ...]})
"""

from __future__ import annotations

import logging
import threading

import redis

from proto.messages import TokenEvent, stream_encoder

log = logging.getLogger("pagedserve.worker")


class EventPublisher:
    """PUBLISHes each reply channel's batch of events, a step's batches in one pipeline."""

    def __init__(self, client: redis.Redis):
        self._client = client
        self._unsent: list[tuple[str, bytes]] = []  # (channel, events) Redis has not confirmed
        self._lock = threading.Lock()  # the compute and publishing threads take turns

    def publish(self, events: dict[str, list[TokenEvent]]) -> None:
        """Send the events (after any an earlier publish could not send) and wait for
        Redis's replies. ConnectionError: Redis is out of reach, the events are kept for
        the next publish; ResponseError: a PUBLISH was refused, the others went out."""
        commands = [(channel, stream_encoder.encode(batch)) for channel, batch in events.items()]
        with self._lock:
            self._unsent.extend(commands)
            if not self._unsent:
                return
            pipeline = self._client.pipeline(transaction=False)
            for channel, payload in self._unsent:
                pipeline.publish(channel, payload)
            try:
                pipeline.execute()
            except redis.ResponseError:  # every reply was read: all ran, one was refused
                self._unsent = []
                raise
            self._unsent = []

    @property
    def pending(self) -> bool:
        """Whether events an earlier publish could not send are waiting."""
        return bool(self._unsent)

    def flush(self) -> None:
        """Send what earlier publishes could not (ConnectionError if still out of reach)."""
        self.publish({})

    def close(self) -> None:
        """A last try for unsent events; what still cannot go is dropped, with a warning.
        The client (and its connections) stays its owner's to close."""
        try:
            self.flush()
        except redis.RedisError as exc:
            with self._lock:
                dropped, self._unsent = len(self._unsent), []
            log.warning("closing the event publisher: %d event batch(es) not sent: %s", dropped, exc)
