"""The worker service's order of launching and finishing steps (ModelWorkerServicer._run)
with launching ahead on, on a runner that records its calls and whose sampled ids take a
while to reach the host, as on a GPU; events published to a real Redis through the real
EventPublisher. A step planned after one in flight launches before that one finishes;
every queued step's outcome is set, whatever fails; nothing planned after a failed step
runs or is heard of; a refused publish fails its step instead of hanging it."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import TimeoutError as FutureTimeout

import pytest
import redis

from proto import worker_pb2
from proto.messages import TokenEvent, events_decoder
from worker_svc import server
from worker_svc.compute_thread import ComputeThread
from worker_svc.event_publisher import EventPublisher
from worker_svc.step_output import StepOutput

DEVICE_S = 0.2  # how long a launched step's ids take to reach the host


class Launched:
    def __init__(self, request: worker_pb2.StepRequest):
        self.request, self.at = request, time.monotonic()

    def ready(self) -> bool:
        return time.monotonic() - self.at > DEVICE_S


class RecordingRunner:
    """ModelRunner's launch / finish / can_launch_ahead, recorded; a step in `fail_launch`
    or `fail_finish` raises there. Each finished step sends one event on `channel`."""

    vision = None

    def __init__(self, channel: str, fail_launch=(), fail_finish=(), not_ahead=(), broken=()):
        self.channel, self.fail_launch, self.fail_finish = channel, set(fail_launch), set(fail_finish)
        self.not_ahead = set(not_ahead)  # steps that may not launch before the one in flight finishes
        self.broken = set(broken)  # steps whose can_launch_ahead raises (a bug outside any step's own handling)
        self.calls: list[tuple[str, int]] = []

    def can_launch_ahead(self, request) -> bool:
        if request.step_id in self.broken:
            raise RuntimeError(f"can_launch_ahead broke on step {request.step_id}")
        return request.step_id not in self.not_ahead

    def launch(self, request):
        self.calls.append(("launch", request.step_id))
        if request.step_id in self.fail_launch:
            raise ValueError(f"launch {request.step_id} failed")
        return Launched(request)

    def finish(self, launched: Launched) -> StepOutput:
        step_id = launched.request.step_id
        self.calls.append(("finish", step_id))
        if step_id in self.fail_finish:
            raise ValueError(f"finish {step_id} failed")
        event = TokenEvent(request_id=f"step{step_id}", index=0, token_ids=[step_id])
        return StepOutput(result=worker_pb2.StepResult(step_id=step_id), events={self.channel: [event]})


def steps(*ids: int) -> list[worker_pb2.StepRequest]:
    """Steps with these ids, each planned after the one before."""
    return [worker_pb2.StepRequest(step_id=i, after_step_id=ids[k - 1] if k else 0) for k, i in enumerate(ids)]


def outcome_of(done) -> str:
    """"ok <step id>" or "failed: <why>"; an outcome never set fails the test (a hang)."""
    try:
        output, published = done.result(timeout=10)
        if published is not None:
            published.result(timeout=10)
        return f"ok {output.result.step_id}"
    except FutureTimeout:
        raise
    except Exception as exc:  # the step's own failure
        return f"failed: {exc}"


@pytest.fixture
def service(redis_url):
    """`service(runner, client=None)`: a servicer with launching ahead on, publishing with
    `client` (default: the test Redis); closed at the end."""
    made = []

    def make(runner, client=None):
        servicer = server.ModelWorkerServicer(runner, ComputeThread("step"),
                                              EventPublisher(client or redis.Redis.from_url(redis_url)),
                                              launch_ahead=True)
        made.append(servicer)
        return servicer
    yield make
    for servicer in made:
        servicer.close()


@pytest.fixture
def listener(redis_url):
    client = redis.Redis.from_url(redis_url)
    channel = f"out:{uuid.uuid4().hex[:8]}"
    sub = client.pubsub()
    sub.subscribe(channel)
    assert sub.get_message(timeout=5)["type"] == "subscribe"
    yield channel, sub
    sub.close()
    client.close()


def heard(sub, wait_s: float = 1.0) -> list[str]:
    """The request ids of the events published so far."""
    ids, deadline = [], time.monotonic() + wait_s
    while time.monotonic() < deadline:
        message = sub.get_message(timeout=0.1)
        if message and message["type"] == "message":
            ids.extend(event.request_id for event in events_decoder.decode(message["data"]))
    return ids


def test_a_step_queued_behind_one_in_flight_launches_before_it_finishes(service, listener):
    channel, sub = listener
    runner = RecordingRunner(channel)
    servicer = service(runner)
    first, second, third = steps(1, 2, 3)
    done = [servicer._queue(first), servicer._queue(second)]
    assert [outcome_of(d) for d in done] == ["ok 1", "ok 2"]
    done.append(servicer._queue(third))  # 2 was finished (no step behind it), so 3 launches alone
    assert outcome_of(done[2]) == "ok 3"
    assert runner.calls == [("launch", 1), ("launch", 2), ("finish", 1), ("finish", 2),
                            ("launch", 3), ("finish", 3)]
    assert heard(sub) == ["step1", "step2", "step3"]


def test_a_step_that_may_not_launch_ahead_waits_for_the_one_in_flight(service, listener):
    channel, sub = listener
    runner = RecordingRunner(channel, not_ahead={2})
    servicer = service(runner)
    done = [servicer._queue(step) for step in steps(1, 2, 3)]
    assert [outcome_of(d) for d in done] == ["ok 1", "ok 2", "ok 3"]
    assert runner.calls == [("launch", 1), ("finish", 1), ("launch", 2), ("launch", 3), ("finish", 2),
                            ("finish", 3)]
    assert heard(sub) == ["step1", "step2", "step3"]


def test_a_step_that_fails_to_launch_ahead_lets_the_one_in_flight_finish_and_stops_the_rest(service, listener):
    channel, sub = listener
    runner = RecordingRunner(channel, fail_launch={2})
    servicer = service(runner)
    done = [servicer._queue(step) for step in steps(1, 2, 3)]
    assert outcome_of(done[0]) == "ok 1"
    assert outcome_of(done[1]) == "failed: launch 2 failed"
    assert outcome_of(done[2]) == "failed: step 3 is planned after step 2, which failed"
    assert ("launch", 3) not in runner.calls
    assert heard(sub) == ["step1"]


def test_a_step_launched_ahead_of_one_that_fails_to_finish_fails_too_unheard(service, listener):
    channel, sub = listener
    runner = RecordingRunner(channel, fail_finish={1})
    servicer = service(runner)
    done = [servicer._queue(step) for step in steps(1, 2, 3)]
    assert outcome_of(done[0]) == "failed: finish 1 failed"
    assert outcome_of(done[1]) == "failed: step 2 is planned after step 1, which failed"
    assert outcome_of(done[2]) == "failed: step 3 is planned after step 2, which failed"
    assert runner.calls[:4] == [("launch", 1), ("launch", 2), ("finish", 1), ("finish", 2)]  # 2 finished, unheard
    assert heard(sub) == []
    runner.fail_finish.clear()
    restart = worker_pb2.StepRequest(step_id=1)  # a scheduler starting over is not refused
    assert outcome_of(servicer._queue(restart)) == "ok 1"


def test_a_bug_outside_a_steps_own_handling_finishes_the_one_in_flight_and_fails_the_rest(service, listener):
    channel, sub = listener
    runner = RecordingRunner(channel, broken={2})
    servicer = service(runner)
    done = [servicer._queue(step) for step in steps(1, 2, 3)]
    assert outcome_of(done[0]) == "ok 1"
    assert outcome_of(done[1]) == "failed: can_launch_ahead broke on step 2"
    assert outcome_of(done[2]) == "failed: step 3 is planned after step 2, which failed"
    assert runner.calls == [("launch", 1), ("finish", 1)]
    assert heard(sub) == ["step1"]


def test_a_refused_publish_fails_its_step_instead_of_hanging_it(service, listener, redis_url):
    channel, _ = listener
    admin = redis.Redis.from_url(redis_url)
    user = f"mute-{uuid.uuid4().hex[:6]}"
    admin.acl_setuser(user, enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all"],
                      reset_channels=True)  # may publish to no channel
    mute = redis.Redis.from_url(redis_url, username=user, password="pw")
    try:
        servicer = service(RecordingRunner(channel), mute)
        done = [servicer._queue(step) for step in steps(1, 2)]
        for outcome in map(outcome_of, done):  # each set (a hang fails outcome_of), with Redis's refusal
            assert outcome.startswith("failed: ") and "no permissions" in outcome, outcome
    finally:
        mute.close()
        admin.acl_deluser(user)
        admin.close()
