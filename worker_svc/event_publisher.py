"""Publishing a step's TokenEvents to Redis without waiting for Redis's replies.

Between two steps the worker's compute thread is on the split's critical path (the result
goes back to the scheduler only after the step's events went out: a finished request is
acknowledged only after its last event). A pipelined PUBLISH that waits for its replies
holds that path for a round trip through Redis, the more so on a busy 2-core machine
(docs/performance.md, "The gap between steps": 0.47 ms median, 1.64 ms mean). The replies
carry nothing the worker needs (the number of subscribers), so each publish writes its
commands to the socket at once, and reads the replies of the publishes before it, which
have long arrived.

Nothing is lost to a broken connection: a batch counts as published once its replies were
read, and when the connection breaks every batch not confirmed yet is written again, in
order, on a new one (Redis may have run some of them already: the gateway drops the
events it has, by index). If that fails too the publish raises, and the batches are
written again by the next publish that gets through. A command Redis refused (an ACL)
raises from the publish after it, its replies read, the connection still in step.

Ordering: one connection, written by one thread at a time, so the channels see the events
in publish order; a step's events are on Redis's socket before its result leaves the
worker, hence before any command the scheduler sends because of that result.

    publisher = EventPublisher(redis.Redis.from_url(url))
    publisher.publish({channel: [TokenEvent, ...]})
"""

from __future__ import annotations

import threading

import redis

from proto.messages import TokenEvent, stream_encoder

Batch = tuple[bytes, int]  # packed PUBLISH commands, how many


class EventPublisher:
    """PUBLISHes each reply channel's batch of events on a connection of its own."""

    def __init__(self, client: redis.Redis):
        self._conn = client.connection_pool.make_connection()  # its own: nobody else reads our replies
        self._sent: list[Batch] = []  # written, replies not read yet (oldest first)
        self._broken = False  # the connection broke and the batches in _sent were not rewritten
        self._lock = threading.Lock()  # the compute and publishing threads take turns

    def publish(self, events: dict[str, list[TokenEvent]]) -> None:
        if not events:
            return
        batch = (self._conn.pack_commands(
            [("PUBLISH", channel, stream_encoder.encode(b)) for channel, b in events.items()]), len(events))
        with self._lock:
            try:
                if self._broken:
                    raise redis.ConnectionError("the connection to Redis broke")
                self._confirm()
                self._write([batch])
            except (redis.ConnectionError, redis.TimeoutError):
                unconfirmed, self._sent = [*self._sent, batch], []
                self._conn.disconnect()
                try:  # once more, on a new connection
                    self._write(unconfirmed)
                    self._broken = False
                except (redis.ConnectionError, redis.TimeoutError):
                    self._conn.disconnect()
                    self._sent, self._broken = unconfirmed, True
                    raise

    def flush(self) -> None:
        """Read the replies still owed (a refused command raises here)."""
        with self._lock:
            if not self._broken:
                self._confirm()

    def close(self) -> None:
        with self._lock:
            self._conn.disconnect()

    def _write(self, batches: list[Batch]) -> None:
        for batch in batches:
            self._conn.send_packed_command(batch[0], check_health=False)  # connects if need be
            self._sent.append(batch)

    def _confirm(self) -> None:
        """Read the replies of every batch written; the first refusal raises once all are read."""
        refused = None
        while self._sent:
            for _ in range(self._sent[0][1]):
                try:
                    self._conn.read_response()
                except redis.ResponseError as exc:
                    refused = refused or exc
            self._sent.pop(0)
        if refused is not None:
            raise refused
