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
written again by the next publish that gets through. A write into a connection Redis has
closed succeeds, so a break shows only when the replies are read: a batch that finishes a
request (whose stream entry the scheduler acknowledges once the step's result is back)
waits for its replies, as every publish used to; the others do not. A command Redis
refused (an ACL) raises from the publish after it, once that one's events are written,
the connection still in step.

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
        self._refused: redis.ResponseError | None = None  # the first refusal read, not raised yet
        self._lock = threading.Lock()  # the compute and publishing threads take turns

    def publish(self, events: dict[str, list[TokenEvent]]) -> None:
        """Write the events; when one finishes its request (the scheduler acknowledges it once
        the step's result is back), wait for the replies, so that it is surely out."""
        if not events:
            return
        batch = (self._conn.pack_commands(
            [("PUBLISH", channel, stream_encoder.encode(b)) for channel, b in events.items()]), len(events))
        finishes = any(e.finish_reason is not None for b in events.values() for e in b)
        with self._lock:
            written = False
            try:
                if self._broken:
                    raise redis.ConnectionError("the connection to Redis broke")
                self._confirm()
                self._write(batch)
                written = True
                if finishes:
                    self._confirm()
            except Exception:  # broken (redis-py may fail in other ways than ConnectionError then)
                self._rewrite([*self._sent, *([] if written else [batch])])
            self._raise_refusal()

    def flush(self) -> None:
        """Read the replies still owed (a refused command raises here)."""
        with self._lock:
            if self._broken:
                return
            try:
                self._confirm()
            except Exception:  # the next publish writes what is unconfirmed again
                self._conn.disconnect()
                self._broken = True
                raise
            self._raise_refusal()

    def close(self) -> None:
        """Read what is owed, then disconnect (what is still unread could be lost with it)."""
        with self._lock:
            try:
                if not self._broken:
                    self._confirm()
            except Exception:  # closing anyway
                pass
            self._conn.disconnect()

    def _rewrite(self, unconfirmed: list[Batch]) -> None:
        """Every batch not confirmed, again, in order, on a new connection, and confirmed
        (one may finish a request); if that fails too, they stay for the next publish and
        this one raises."""
        self._sent = []
        self._conn.disconnect()
        try:
            for batch in unconfirmed:
                self._write(batch)
            self._confirm()
        except Exception:
            self._conn.disconnect()
            self._sent, self._broken = unconfirmed, True
            raise
        self._broken = False

    def _raise_refusal(self) -> None:
        refused, self._refused = self._refused, None
        if refused is not None:
            raise refused

    def _write(self, batch: Batch) -> None:
        self._conn.send_packed_command(batch[0], check_health=False)  # connects if need be
        self._sent.append(batch)

    def _confirm(self) -> None:
        """Read the replies of every batch written; the first refusal is kept to be raised."""
        while self._sent:
            for _ in range(self._sent[0][1]):
                try:
                    self._conn.read_response()
                except redis.ResponseError as exc:
                    self._refused = self._refused or exc
            self._sent.pop(0)
