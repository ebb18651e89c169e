"""Per-request event queues: how every gateway backend hands token events to requests."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from proto.messages import TokenEvent


class EventQueues:
    """A backend's events go to the queue of their request; a request opens its queue before
    submitting (so no event is missed) and closes it when done (later events are dropped)."""

    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[TokenEvent]] = {}

    def open(self, request_id: str) -> asyncio.Queue[TokenEvent]:
        """The queue that will receive `request_id`'s events; open it before submitting."""
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def deliver(self, events: Iterable[TokenEvent]) -> None:
        """On the event loop's thread."""
        for event in events:
            queue = self._queues.get(event.request_id)
            if queue is not None:  # else: finished or aborted here already; late events drop
                queue.put_nowait(event)
