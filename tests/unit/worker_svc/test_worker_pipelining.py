"""The worker service with steps planned ahead (StepRequest.after_step_id), one call a
step (Step) or on one stream (Steps, the scheduler's way): a real worker (tiny model, real
Redis, gRPC) driven by a BatchScheduler that keeps two steps in flight."""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import msgspec
import pytest
import redis

from proto import worker_pb2, worker_pb2_grpc
from proto.keys import RedisKeys
from proto.messages import NewRequest, SamplingParams, events_decoder, registration_decoder
from scheduler_svc.policy.batching import BatchScheduler
from scheduler_svc.policy.config import SchedulerConfig
from worker_svc import server
from worker_svc.service_config import WorkerServiceConfig
from worker_svc.config import RunnerConfig
from worker_svc.model_runner import ModelRunner


@contextlib.contextmanager
def worker(model_dir, redis_url, batching: SchedulerConfig = SchedulerConfig(max_num_batched_tokens=16),
           launch_ahead: bool | None = None):
    """A worker service on a thread; yields (stub, a scheduler for it, the redis client)."""
    prefix = f"pipelining-{uuid.uuid4().hex[:8]}"
    config = WorkerServiceConfig(runner=RunnerConfig(model=str(model_dir), num_blocks=64),
                                        port=0, redis_url=redis_url, key_prefix=prefix,
                                        launch_ahead=launch_ahead, drain_timeout_s=0)
    ready, stop = threading.Event(), threading.Event()
    serving = threading.Thread(target=server.serve, args=(config, ready, stop), daemon=True)
    serving.start()
    client = redis.Redis.from_url(redis_url)
    try:
        assert ready.wait(timeout=60)
        reg = registration_decoder.decode(client.get(RedisKeys(prefix).worker(config.worker_id)))
        scheduler = BatchScheduler(batching, num_blocks=reg.num_blocks,
                                   block_size=reg.block_size, max_model_len=reg.max_model_len)
        with grpc.insecure_channel(reg.address) as channel:
            yield worker_pb2_grpc.WorkerStub(channel), scheduler, client
    finally:
        client.close()
        stop.set()
        serving.join(timeout=30)


def subscribed(client, scheduler: BatchScheduler):
    """A fresh reply channel, subscribed to, and `requests(channel)` added to `scheduler`;
    returns (channel, the subscription)."""
    channel = f"out:{uuid.uuid4().hex[:8]}"
    events = client.pubsub()
    events.subscribe(channel)
    for req in requests(channel):
        scheduler.add_request(req)
    return channel, events


def requests(channel: str) -> list[NewRequest]:
    return [NewRequest(f"r{i}", [5 + i, 6, 7, 8, 9, 10, 11][: 3 + 2 * i],
                       SamplingParams(max_tokens=4 + 3 * i, temperature=0.0), channel, time.time())
            for i in range(3)]


def outputs_of(scheduler: BatchScheduler, stub, pipelined: bool, pool: ThreadPoolExecutor):
    """Run every request to the end; with `pipelined`, a step planned ahead is sent before
    the one it follows (its RPC overtakes: the worker must still run them in order)."""
    finished = {}
    in_flight = []  # (step, future of its result)
    while scheduler.has_work() or in_flight:
        if not in_flight:
            step = scheduler.schedule()
            ahead = scheduler.schedule() if pipelined and scheduler.can_schedule_ahead() else None
            if ahead is not None:
                assert ahead.after_step_id == step.step_id
                in_flight.append((ahead, pool.submit(stub.Step, ahead, timeout=30)))
                time.sleep(0.05)  # it reaches the worker first, and waits there
            in_flight.insert(0, (step, pool.submit(stub.Step, step, timeout=30)))
        step, call = in_flight.pop(0)
        for req in scheduler.update(step, call.result()):
            finished[req.request_id] = req.output_token_ids
    return finished


@pytest.mark.parametrize("launch_ahead", [False, True], ids=["finish-first", "launch-ahead"])
def test_steps_planned_ahead_give_the_outputs_of_steps_in_lockstep(tiny_model_dir, redis_url, launch_ahead):
    with worker(tiny_model_dir, redis_url, launch_ahead=launch_ahead) as (stub, scheduler, client), \
            ThreadPoolExecutor(4) as pool:
        channel, events = subscribed(client, scheduler)
        lockstep = outputs_of(scheduler, stub, False, pool)
        for req in requests(channel):
            scheduler.add_request(msgspec.structs.replace(req, request_id=req.request_id + "-ahead"))
        ahead = outputs_of(scheduler, stub, True, pool)
        assert scheduler.steps.num_steps > 0 and len(lockstep) == 3
        assert {rid.removesuffix("-ahead"): out for rid, out in ahead.items()} == lockstep
        # Every token went out on pub/sub once, in order, each step's events before the next's.
        published = read_published(events, 2 * sum(map(len, lockstep.values())))
        assert {rid: out for rid, out in published.items() if not rid.endswith("-ahead")} == lockstep
        events.close()


def streamed_outputs(scheduler: BatchScheduler, stub):
    """Every request to the end over one Steps stream, a step planned ahead whenever the
    scheduler can (sent before the result of the one it follows is read)."""
    sent: queue.SimpleQueue = queue.SimpleQueue()
    results = stub.Steps(iter(sent.get, None), timeout=60)
    finished, in_flight, ahead_steps = {}, collections.deque(), 0
    while scheduler.has_work() or in_flight:
        if not in_flight:
            in_flight.append(scheduler.schedule())
            sent.put(in_flight[-1])
        if scheduler.can_schedule_ahead() and (ahead := scheduler.schedule()) is not None:
            in_flight.append(ahead)
            sent.put(ahead)
            ahead_steps += 1
        step = in_flight.popleft()
        result = next(results)
        assert result.step_id == step.step_id
        for req in scheduler.update(step, result):
            finished[req.request_id] = req.output_token_ids
    sent.put(None)  # the stream ends cleanly once the last result is in
    assert next(results, None) is None and ahead_steps > 0
    return finished


def traced(monkeypatch) -> list[tuple[str, int]]:
    """ModelRunner's launch and finish calls from now on, as (name, step id)."""
    calls = []
    for name in ("launch", "finish"):
        def tracing(self, step, _name=name, _original=getattr(ModelRunner, name)):
            calls.append((_name, (step if _name == "launch" else step.request).step_id))
            return _original(self, step)
        monkeypatch.setattr(ModelRunner, name, tracing)
    return calls


def launched_ahead(calls: list[tuple[str, int]]) -> list[int]:
    """The steps launched before the step before them finished."""
    return [step for i, (call, step) in enumerate(calls) if call == "launch" and ("finish", step - 1) in calls[i:]]


@pytest.mark.parametrize("launch_ahead", [False, True], ids=["finish-first", "launch-ahead"])
def test_the_steps_stream_gives_the_outputs_of_one_call_a_step(tiny_model_dir, redis_url, launch_ahead, monkeypatch):
    calls = traced(monkeypatch)
    with worker(tiny_model_dir, redis_url, launch_ahead=launch_ahead) as (stub, scheduler, client), \
            ThreadPoolExecutor(4) as pool:
        channel, events = subscribed(client, scheduler)
        streamed = streamed_outputs(scheduler, stub)
        assert bool(launched_ahead(calls)) == launch_ahead
        assert len(streamed) == 3
        assert lockstep_outputs(scheduler, stub, channel, pool) == streamed
        published = read_published(events, 2 * sum(map(len, streamed.values())))
        assert {rid: out for rid, out in published.items() if not rid.endswith("-1")} == streamed
        events.close()


def mixed_requests(channel: str, stop_token: int | None = None) -> list[NewRequest]:
    """Greedy and seeded requests a step may launch ahead for, one with a stop token (it
    finishes while the step after is in flight, where `stop_token` is one it samples),
    and one with a penalty (its steps finish the step before first)."""
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14], [15, 16, 17, 18], [19, 20, 21]]
    params = [SamplingParams(max_tokens=9, temperature=0.0),
              SamplingParams(max_tokens=7, temperature=1.0, seed=11),
              SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=3),
              SamplingParams(max_tokens=9, temperature=0.0,
                             stop_token_ids=[stop_token] if stop_token is not None else []),
              SamplingParams(max_tokens=2, temperature=0.0, repetition_penalty=1.3)]
    return [NewRequest(f"m{i}", prompt, sampling, channel, time.time())
            for i, (prompt, sampling) in enumerate(zip(prompts, params))]


def test_steps_launched_ahead_sample_what_steps_finished_first_sample(tiny_model_dir, redis_url, monkeypatch):
    """Launched ahead, a step reads the tokens of the step in flight on the device: the
    outputs (seeded draws, a stop token, a penalty's request) are those of a worker
    that finishes each step first, and steps did launch ahead."""
    calls = traced(monkeypatch)
    outputs = {}
    stop_token = None
    for launch_ahead in (False, True):
        with worker(tiny_model_dir, redis_url, launch_ahead=launch_ahead) as (stub, scheduler, client):
            channel, events = f"out:{uuid.uuid4().hex[:8]}", None
            if launch_ahead:
                events = client.pubsub()
                events.subscribe(channel)
            for req in mixed_requests(channel, stop_token):
                scheduler.add_request(req)
            calls.clear()
            outputs[launch_ahead] = streamed_outputs(scheduler, stub)
            if not launch_ahead:  # the third token m3 samples stops it, with a step ahead in flight
                stop_token = outputs[False]["m3"][2]
                assert stop_token not in outputs[False]["m3"][:2]
                for req in mixed_requests(channel, stop_token):
                    scheduler.add_request(msgspec.structs.replace(req, request_id=req.request_id + "-stop"))
                outputs[False] = {rid.removesuffix("-stop"): out
                                  for rid, out in streamed_outputs(scheduler, stub).items() if rid.endswith("-stop")}
                assert len(outputs[False]["m3"]) == 3
                assert [c for c, _ in calls if c == "launch"]  # traced
            else:
                assert len(launched_ahead(calls)) >= 3, str(calls)
                published = read_published(events, sum(map(len, outputs[True].values())))
                assert published == outputs[True]
                events.close()
    assert outputs[True] == outputs[False]


def read_published(events, num_tokens: int) -> dict[str, list[int]]:
    """Token ids by request from the subscription until `num_tokens` came, each event
    checked to come in order."""
    published: dict[str, list[int]] = {}
    deadline = time.monotonic() + 10
    while sum(map(len, published.values())) < num_tokens:
        assert time.monotonic() < deadline, f"published so far: {published}"
        message = events.get_message(timeout=1)
        if message and message["type"] == "message":
            for event in events_decoder.decode(message["data"]):
                seen = published.setdefault(event.request_id, [])
                assert event.index == len(seen)
                seen.extend(event.token_ids)
    return published


def lockstep_outputs(like: BatchScheduler, stub, channel: str, pool: ThreadPoolExecutor):
    """The outputs of `requests(channel)` (ids suffixed, so the worker holds both) in
    unary steps planned one at a time by a scheduler for the same worker as `like`."""
    lockstep = BatchScheduler(SchedulerConfig(max_num_batched_tokens=16), num_blocks=like.kv.num_blocks,
                              block_size=like.kv.block_size, max_model_len=like.max_model_len)
    for req in requests(channel):
        lockstep.add_request(msgspec.structs.replace(req, request_id=req.request_id + "-1"))
    outputs = outputs_of(lockstep, stub, False, pool)
    return {rid.removesuffix("-1"): out for rid, out in outputs.items()}


def test_a_step_planned_after_one_never_received_is_refused(tiny_model_dir, redis_url, monkeypatch):
    monkeypatch.setattr(server, "ORDER_TIMEOUT_S", 0.5)
    orphan = worker_pb2.StepRequest(step_id=8, after_step_id=7)
    with worker(tiny_model_dir, redis_url) as (stub, _, _):
        for call in (lambda: stub.Step(orphan, timeout=30), lambda: next(stub.Steps(iter([orphan]), timeout=30))):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "planned after step 7, which this worker did not receive" in err.value.details()


def bad_step_and_one_after() -> tuple[worker_pb2.StepRequest, worker_pb2.StepRequest]:
    """Step 1 names a request the worker does not hold; step 2, planned after it, is fine."""
    bad = worker_pb2.StepRequest(step_id=1)
    bad.cached_requests.add(request_id="nobody", num_computed_tokens=0)
    bad.num_scheduled_tokens["nobody"] = 1
    after = worker_pb2.StepRequest(step_id=2, after_step_id=1)
    after.new_requests.add(request_id="x", token_ids=[5, 6], num_prompt_tokens=2, block_ids=[0],
                           sampling=worker_pb2.SamplingParams(max_tokens=2))
    after.num_scheduled_tokens["x"] = 2
    return bad, after


@pytest.mark.parametrize("launch_ahead", [False, True], ids=["finish-first", "launch-ahead"])
def test_a_failed_step_ends_the_steps_stream_with_its_status(tiny_model_dir, redis_url, launch_ahead):
    with worker(tiny_model_dir, redis_url, launch_ahead=launch_ahead) as (stub, _, _):
        results = stub.Steps(iter(bad_step_and_one_after()), timeout=30)
        with pytest.raises(grpc.RpcError) as err:
            next(results)
        assert err.value.code() == grpc.StatusCode.INTERNAL and "unknown to this worker" in err.value.details()
        fine = worker_pb2.StepRequest(step_id=3)  # queued behind step 2, if that was queued
        fine.new_requests.add(request_id="y", token_ids=[5, 6], num_prompt_tokens=2, block_ids=[1],
                              sampling=worker_pb2.SamplingParams(max_tokens=2))
        fine.num_scheduled_tokens["y"] = 2
        assert [r.step_id for r in stub.Steps(iter([fine]), timeout=30)] == [3]  # a new stream works
        assert stub.Health(worker_pb2.HealthRequest(), timeout=5).num_requests == 1  # y; x never ran


@pytest.mark.parametrize("launch_ahead", [False, True], ids=["finish-first", "launch-ahead"])
def test_a_step_planned_after_a_failed_one_fails_without_running(tiny_model_dir, redis_url, launch_ahead):
    with worker(tiny_model_dir, redis_url, launch_ahead=launch_ahead) as (stub, scheduler, _), \
            ThreadPoolExecutor(2) as pool:
        bad, after = bad_step_and_one_after()
        bad.step_id, after.step_id, after.after_step_id = 2, 3, 2
        first = pool.submit(stub.Step, bad, timeout=30)
        time.sleep(0.05)
        second = pool.submit(stub.Step, after, timeout=30)
        for call, message in ((first, "unknown to this worker"),
                              (second, "planned after step 2, which failed")):
            with pytest.raises(grpc.RpcError) as err:
                call.result()
            assert err.value.code() == grpc.StatusCode.INTERNAL and message in err.value.details()
        assert stub.Health(worker_pb2.HealthRequest(), timeout=5).num_requests == 0  # x never ran
        # A scheduler starting over (step ids from 1 again; step 4 is planned after step 3)
        # is not refused for the failure of the steps 2 and 3 of the one before.
        for req in requests(f"out:{uuid.uuid4().hex[:8]}"):
            scheduler.add_request(req)
        assert len(outputs_of(scheduler, stub, True, pool)) == 3 and scheduler.steps.num_steps >= 4
