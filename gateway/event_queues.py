"""Per-request event queues: how every gateway backend hands token events to requests."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

from proto.messages import TokenEvent


class EventQueues:
    """A backend's events go to the queue of their request; a request opens its queue before
    submitting (so no event is missed) and closes it when done (later events are dropped).
    One queue may take the events of several ids: a request with n > 1 gets those of its own
    id (prompt logprobs, errors before the fork) and of its sequences' ids (proto/parallel.py)
    on one queue, in the order they were published."""

    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[TokenEvent]] = {}

    def open(self, request_ids: Sequence[str]) -> asyncio.Queue[TokenEvent]:
        """The queue that will receive the events of every id in `request_ids`; open it
        before submitting."""
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        for request_id in request_ids:
            self._queues[request_id] = queue
        return queue

    def close(self, request_ids: Iterable[str]) -> bool:
        """Stop taking events for these ids; whether the backend aborted the request itself
        (here never: its owner aborts what still runs)."""
        for request_id in request_ids:
            self._queues.pop(request_id, None)
        return False

    def deliver(self, events: Iterable[TokenEvent]) -> None:
        """On the event loop's thread."""
        for event in events:
            queue = self._queues.get(event.request_id)
            if queue is not None:  # else: finished or aborted here already; late events drop
                queue.put_nowait(event)

    def fail(self, request_ids: Iterable[str], error: str) -> None:
        """End these requests (their own ids, not their sequences') with an abort event
        saying why: the client gets a 503 with `error`; a retry may succeed."""
        self.deliver([TokenEvent(rid, index=0, finish_reason="abort", error=error) for rid in request_ids])
