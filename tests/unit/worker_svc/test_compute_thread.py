"""worker_svc.compute_thread: one thread runs a process's torch work, loading included; the
worker service and the in-process engine load their model and run every step on it."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import redis

from compose.engine import EngineConfig, InProcessEngine
from tests.support.engine_helpers import Collector, serve_on_thread
from proto import worker_pb2_grpc
from proto.keys import RedisKeys
from proto.messages import NewRequest, SamplingParams, registration_decoder
from scheduler_svc.policy.batching import BatchScheduler
from scheduler_svc.policy.config import SchedulerConfig
from worker_svc import server
from worker_svc.service_config import WorkerServiceConfig
from worker_svc.compute_thread import ComputeThread
from worker_svc.config import RunnerConfig
from worker_svc.model_runner import ModelRunner


def test_calls_run_in_order_on_one_thread_not_the_callers():
    compute = ComputeThread("t")
    try:
        idents = [compute.call(threading.get_ident) for _ in range(3)]
        assert len(set(idents)) == 1 and idents[0] != threading.get_ident()
        assert compute.call(lambda a, b=0: a + b, 2, b=3) == 5
        order: list[int] = []
        gate = threading.Event()
        first = compute.submit(gate.wait)
        later = [compute.submit(order.append, i) for i in range(5)]
        assert not any(f.done() for f in later)  # queued behind the first
        gate.set()
        assert first.result(timeout=5) is True
        for f in later:
            f.result(timeout=5)
        assert order == [0, 1, 2, 3, 4]
    finally:
        compute.close()


def test_exceptions_reach_the_caller_and_the_thread_survives():
    compute = ComputeThread("t")
    try:
        with pytest.raises(ZeroDivisionError):
            compute.call(lambda: 1 / 0)
        assert compute.call(lambda: "still here") == "still here"
    finally:
        compute.close()


def test_close_finishes_what_was_submitted_then_refuses_more():
    compute = ComputeThread("t")
    slow = compute.submit(time.sleep, 0.2)
    compute.close()
    assert slow.done() and slow.exception() is None
    compute.close()  # again: a no-op
    with pytest.raises(RuntimeError, match="after close"):
        compute.submit(print)


def test_close_with_a_timeout_leaves_a_stuck_daemon_behind():
    compute = ComputeThread("t")
    stuck = threading.Event()
    compute.submit(stuck.wait)
    start = time.monotonic()
    compute.close(timeout=0.2)
    assert time.monotonic() - start < 5
    assert compute._thread.daemon  # it never holds up the interpreter's exit
    stuck.set()


@pytest.fixture
def runner_threads(monkeypatch):
    """Spy on the real ModelRunner: the threads it was built on and stepped on (a step's
    launch and its finish: `step` calls both)."""
    seen: dict[str, set[int]] = {"init": set(), "step": set()}
    init = ModelRunner.__init__

    def spy_init(self, *args, **kwargs):
        seen["init"].add(threading.get_ident())
        init(self, *args, **kwargs)

    def spying(original):
        def spy(self, *args, **kwargs):
            seen["step"].add(threading.get_ident())
            return original(self, *args, **kwargs)
        return spy

    monkeypatch.setattr(ModelRunner, "__init__", spy_init)
    for name in ("launch", "finish"):
        monkeypatch.setattr(ModelRunner, name, spying(getattr(ModelRunner, name)))
    return seen


def test_engine_loads_and_steps_on_one_thread(tiny_model_dir, runner_threads):
    sink = Collector(2)
    engine = InProcessEngine(EngineConfig(runner=RunnerConfig(model=str(tiny_model_dir), num_blocks=32)), sink)
    serve_on_thread(engine, sink, [
        NewRequest(f"r{i}", [5, 6, 7, 8 + i], SamplingParams(max_tokens=3, temperature=0.0), "c", time.time())
        for i in range(2)])
    assert len(sink.finished) == 2
    assert len(runner_threads["init"]) == 1 and runner_threads["step"] == runner_threads["init"]
    assert threading.get_ident() not in runner_threads["init"]


def test_worker_loads_and_steps_on_one_thread(tiny_model_dir, redis_url, runner_threads):
    config = WorkerServiceConfig(runner=RunnerConfig(model=str(tiny_model_dir), num_blocks=32),
                                        port=0, redis_url=redis_url, key_prefix="compute-thread-test")
    ready, stop = threading.Event(), threading.Event()
    serving = threading.Thread(target=server.serve, args=(config, ready, stop), daemon=True)
    serving.start()
    try:
        assert ready.wait(timeout=60)
        # It bound port 0: its registration says which port it got.
        client = redis.Redis.from_url(redis_url)
        reg = registration_decoder.decode(client.get(RedisKeys("compute-thread-test").worker(config.worker_id)))
        scheduler = BatchScheduler(SchedulerConfig(), num_blocks=reg.num_blocks, block_size=reg.block_size,
                                   max_model_len=reg.max_model_len, num_cpu_blocks=0)
        scheduler.add_request(NewRequest("w", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0),
                                         "c", time.time()))
        with grpc.insecure_channel(reg.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            while (step := scheduler.schedule()) is not None:
                scheduler.update(step, stub.Step(step, timeout=30))
        client.close()
    finally:
        stop.set()
        serving.join(timeout=30)
    assert len(runner_threads["init"]) == 1 and runner_threads["step"] == runner_threads["init"]
    assert serving.ident not in runner_threads["init"]  # not the thread that called serve()
