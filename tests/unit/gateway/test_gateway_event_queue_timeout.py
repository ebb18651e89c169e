"""gateway/event_queues.py RequestQueue.take: the wait for a request's next event, bounded
by its timeout, watched by one timer per queue that re-arms itself instead of one per wait."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from gateway.event_queues import EventQueues, RequestQueue
from proto.messages import TokenEvent


def _event(i: int) -> TokenEvent:
    return TokenEvent("r", index=i, token_ids=[i])


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request):
    """Run a coroutine on asyncio's loop, or on uvloop's (the gateway's: its timers are
    rounded to milliseconds, and one due now is a plain Handle)."""
    factory = uvloop.new_event_loop if request.param == "uvloop" else None

    def runner(coro):
        with asyncio.Runner(loop_factory=factory) as r:
            return r.run(coro)
    return runner


def test_events_queued_are_taken_at_once_without_a_timer(run):
    async def scenario():
        queue = RequestQueue(["r"])
        for i in range(3):
            queue.put_nowait(_event(i))
        assert [e.index for e in await queue.take(0.05)] == [0, 1, 2]
        assert queue._watchdog is None  # nothing waited: no timer
    run(scenario())


def test_a_wait_with_nothing_coming_times_out_after_its_timeout(run):
    async def scenario():
        loop = asyncio.get_running_loop()
        queue = RequestQueue(["r"])
        start = loop.time()
        with pytest.raises(TimeoutError):
            await queue.take(0.2)
        assert 0.198 <= loop.time() - start < 1.0  # (uvloop: whole milliseconds)
        queue.put_nowait(_event(0))  # the queue works on after a timeout, no mark left
        assert [e.index for e in await queue.take(0.2)] == [0]
    run(scenario())


def test_each_wait_gets_its_whole_timeout_from_one_timer(run):
    """Waits that begin after the timer was set are timed from their own start: the timer
    fires early for them and re-arms; a wait that gets its event in time never times out."""
    async def scenario():
        loop = asyncio.get_running_loop()
        queue = RequestQueue(["r"])
        for i in range(4):  # events every 0.15 s, timeout 0.25 s: 0.6 s in all, no timeout
            loop.call_later(0.15, queue.put_nowait, _event(i))
            assert [e.index for e in await queue.take(0.25)] == [i]
        timer = queue._watchdog
        assert timer is not None  # the same one, re-armed when it fired early
        start = loop.time()
        with pytest.raises(TimeoutError):
            await queue.take(0.25)
        assert 0.248 <= loop.time() - start < 1.0
    run(scenario())


def test_a_shorter_timeout_rearms_the_timer_sooner(run):
    async def scenario():
        loop = asyncio.get_running_loop()
        queue = RequestQueue(["r"])
        loop.call_later(0.05, queue.put_nowait, _event(0))
        await queue.take(30.0)  # leaves a timer due in ~30 s
        start = loop.time()
        with pytest.raises(TimeoutError):
            await queue.take(0.1)  # a gap's grace: shorter than the request timeout
        assert loop.time() - start < 1.0
    run(scenario())


def test_an_event_that_comes_with_the_timeout_mark_is_taken(run):
    async def scenario():
        queue = RequestQueue(["r"])
        with pytest.raises(TimeoutError):
            await queue.take(0.05)
        queue._waiting = (asyncio.get_running_loop().time() - 1.0, 0.5)
        queue._watch()  # the mark, queued as a wait times out ...
        queue.put_nowait(_event(7))  # ... with an event right behind it
        assert [e.index for e in await queue.take(0.05)] == [7]
    run(scenario())


def test_closing_a_queue_stops_its_timer(run):
    async def scenario():
        queues = EventQueues()
        queue = queues.open(["r", "r/0"])
        asyncio.get_running_loop().call_later(0.02, queue.put_nowait, _event(0))
        await queue.take(30.0)
        timer = queue._watchdog
        assert timer is not None and not timer.cancelled()
        queues.close(["r", "r/0"])
        assert timer.cancelled() and queue._watchdog is None
    run(scenario())


def test_waits_of_under_a_millisecond_after_an_event(run):
    """A timer due within a millisecond (uvloop: a plain Handle, no when())."""
    async def scenario():
        loop = asyncio.get_running_loop()
        queue = RequestQueue(["r"])
        loop.call_soon(queue.put_nowait, _event(0))
        assert [e.index for e in await queue.take(0.0003)] == [0]
        with pytest.raises(TimeoutError):
            await queue.take(0.0003)
        loop.call_soon(queue.put_nowait, _event(1))
        assert [e.index for e in await queue.take(0.0003)] == [1]
    run(scenario())


def test_a_cancelled_wait_leaves_no_timeout_for_the_next(run):
    async def scenario():
        loop = asyncio.get_running_loop()
        queue = RequestQueue(["r"])
        waiting = asyncio.ensure_future(queue.take(0.05))
        await asyncio.sleep(0)
        queue._waiting = (loop.time() - 1.0, 0.05)
        queue._watch()  # it timed out ...
        waiting.cancel()  # ... and was cancelled before it took the mark
        with pytest.raises(asyncio.CancelledError):
            await waiting
        loop.call_later(0.02, queue.put_nowait, _event(3))
        assert [e.index for e in await queue.take(1.0)] == [3]  # a wait of its own, not a timeout
    run(scenario())
