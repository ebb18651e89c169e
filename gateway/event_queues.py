"""Per-request event queues: how every gateway backend hands token events to requests."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

from proto.messages import TokenEvent

# Events a request's queue holds before its reader is deemed gone (GatewayConfig.max_unread_events).
DEFAULT_MAX_UNREAD = 4096
# What a RequestQueue's watchdog queues to wake a wait that timed out (never handed out).
_EXPIRED = TokenEvent("", index=-1)
# How early a wait counts as run out: event loops may fire a timer up to a millisecond early
# (uvloop rounds to milliseconds).
_TIMER_SLACK_S = 1e-3


class RequestQueue(asyncio.Queue[TokenEvent]):
    """The events of one request (all of `request_ids`: its own id first), taken in batches
    by `take`, whose wait for the next event is bounded by a timeout.

    The timeout is watched by one timer per queue that re-arms itself when it fires early
    (a wait began after it was set), not by a timer made and cancelled per wait: a stream
    waits once per token, and the timer then costs once per timeout period."""

    def __init__(self, request_ids: Sequence[str]):
        super().__init__()
        self.request_ids = tuple(request_ids)
        self._watchdog: asyncio.Handle | None = None
        self._due = 0.0  # when the watchdog fires (loop time)
        self._waiting: tuple[float, float] | None = None  # the wait in progress: (since, timeout)
        self._expired = False  # the watchdog queued _EXPIRED

    async def take(self, timeout_s: float) -> list[TokenEvent]:
        """The next event and every one queued behind it; TimeoutError when none came within
        `timeout_s` of waiting."""
        if self._expired:  # the mark of a wait that was cancelled: not this one's
            self._drop_marks()
        if self.empty():
            loop = asyncio.get_running_loop()
            now = loop.time()
            if self._watchdog is None or self._due > now + timeout_s:  # none, or due too late
                self._arm(loop, now + timeout_s)
            self._waiting = (now, timeout_s)
            try:
                events = [await self.get()]
            finally:
                self._waiting = None
        else:
            events = [self.get_nowait()]
        while not self.empty():
            events.append(self.get_nowait())
        if self._expired:  # the watchdog's mark: a timeout, unless events came with it
            self._expired = False
            events = [e for e in events if e is not _EXPIRED]
            if not events:
                raise TimeoutError
        return events

    def stop_watching(self) -> None:
        """The request is done with its queue: its timer goes."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def _arm(self, loop: asyncio.AbstractEventLoop, due: float) -> None:
        self.stop_watching()
        self._due = due
        self._watchdog = loop.call_at(due, self._watch)

    def _watch(self) -> None:
        """The timer: wake a wait that has run its timeout (within a millisecond: timers
        may fire that early) with _EXPIRED; for a wait that began later, fire again at its
        end; none waiting: stop until the next wait."""
        self._watchdog = None
        if self._waiting is None:
            return
        since, timeout_s = self._waiting
        loop = asyncio.get_running_loop()
        if loop.time() >= since + timeout_s - _TIMER_SLACK_S:
            self._expired = True
            self.put_nowait(_EXPIRED)
        else:
            self._arm(loop, since + timeout_s)

    def _drop_marks(self) -> None:
        """Take _EXPIRED out of the queue, keeping the events in their order."""
        events = [e for e in (self.get_nowait() for _ in range(self.qsize())) if e is not _EXPIRED]
        for event in events:
            self.put_nowait(event)
        self._expired = False


class EventQueues:
    """A backend's events go to the queue of their request; a request opens its queue before
    submitting (so no event is missed) and closes it when done (later events are dropped).
    One queue may take the events of several ids: a request with n > 1 gets those of its own
    id (prompt logprobs, errors before the fork) and of its sequences' ids (proto/parallel.py)
    on one queue, in the order they were published.

    A queue holds at most `max_unread` events per id it takes (a request with n > 1 gets n
    sequences' events each step). A request takes every queued event at each
    read (gateway/generation.py), so a queue fills only while its reader is stuck: a
    streaming client that stopped reading leaves the response's write waiting on a full
    socket. Then the request is aborted (`abort_soon`: the scheduler frees its blocks), its
    events dropped, and the queue left with one abort event saying why: the gateway's memory
    per stream stays bounded and no other stream waits."""

    def __init__(self, max_unread: int = DEFAULT_MAX_UNREAD) -> None:
        self._queues: dict[str, RequestQueue] = {}
        self._max_unread = max_unread

    def open(self, request_ids: Sequence[str]) -> RequestQueue:
        """The queue that will receive the events of every id in `request_ids` (the request's
        own id first); open it before submitting."""
        queue = RequestQueue(request_ids)
        for request_id in request_ids:
            self._queues[request_id] = queue
        return queue

    def close(self, request_ids: Iterable[str]) -> bool:
        """Stop taking events for these ids; whether the backend aborted the request itself
        (here never: its owner aborts what still runs)."""
        for request_id in request_ids:
            queue = self._queues.pop(request_id, None)
            if queue is not None:
                queue.stop_watching()
        return False

    def deliver(self, events: Iterable[TokenEvent]) -> None:
        """On the event loop's thread."""
        for event in events:
            queue = self._queues.get(event.request_id)
            if queue is None:  # finished or aborted here already; late events drop
                continue
            if queue.qsize() >= self._max_unread * len(queue.request_ids):  # per sequence
                self._give_up(queue)
            else:
                queue.put_nowait(event)

    def fail(self, request_ids: Iterable[str], error: str) -> None:
        """End these requests (their own ids, not their sequences') with an abort event
        saying why: the client gets a 503 with `error`; a retry may succeed."""
        self.deliver([TokenEvent(rid, index=0, finish_reason="abort", error=error) for rid in request_ids])

    def abort_soon(self, request_id: str, shard: int = 0) -> None:
        raise NotImplementedError

    def shard_of(self, request_id: str) -> int:
        """The scheduler shard an open request went to (for its abort)."""
        return 0

    def _give_up(self, queue: RequestQueue) -> None:
        """The reader of `queue` stopped reading: abort its request, keep only the reason."""
        request_id = queue.request_ids[0]
        queue_limit = self._max_unread * len(queue.request_ids)
        shard = self.shard_of(request_id)
        self.close(queue.request_ids)
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(TokenEvent(request_id, index=0, finish_reason="abort", error=(
            f"The client did not read its stream: {queue_limit} token events waited unread, "
            "so the request was aborted.")))
        self.abort_soon(request_id, shard)
