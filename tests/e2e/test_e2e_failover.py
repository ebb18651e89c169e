"""Scheduler failover: two schedulers on one Redis, one leading by a lease; the leader
killed (SIGKILL) mid-stream, the standby takes the lease, claims the pending requests and
serves them again -- seeded outputs at temperature 0.8 equal those of a fault-free run. A
step with a fencing token below the current one is refused by the worker."""

from __future__ import annotations

import socket

import grpc
import pytest
import redis

from proto import worker_pb2, worker_pb2_grpc
from proto.registry import WorkerRegistry
from tests.support.stack_helpers import kill, run_streams, running_stack, wait_until_idle


def _leader(stack) -> tuple[str, int]:
    """(process name, fencing token) of the scheduler holding the lease."""
    value = redis.Redis.from_url(stack.redis_url).get(stack.keys.scheduler_lease).decode()
    consumer, _, token = value.rpartition(":")
    first = f"scheduler-{socket.gethostname()}"
    return ("scheduler" if consumer == first else f"scheduler-{consumer.removeprefix(first + '-')}"), int(token)


def test_the_standby_takes_over_a_killed_leader(tiny_model_dir, redis_url, tmp_path_factory):
    with running_stack(tiny_model_dir, redis_url, tmp_path_factory.mktemp("run"), workers=2,
                       schedulers=2) as stack:
        prompts = [[12 + i, 22 + i, 32 + i, 42 + i] for i in range(6)]
        max_tokens = 100

        def run(fault):
            return run_streams(stack, prompts, fault=fault, max_tokens=max_tokens, temperature=0.8, seed=11)

        calm = run(None)
        leader, token = _leader(stack)
        faulted = run(kill(stack, leader))
        assert [len(ids) for ids in faulted] == [max_tokens] * len(prompts)
        assert faulted == calm
        new_leader, new_token = _leader(stack)
        assert new_leader != leader and new_token > token
        wait_until_idle(stack)

        # The killed leader's token is stale now: every worker refuses it.
        client = redis.Redis.from_url(stack.redis_url)
        for registration in WorkerRegistry(stack.keys).read_blocking(client).live.values():
            with grpc.insecure_channel(registration.address) as channel:
                stub = worker_pb2_grpc.WorkerStub(channel)
                with pytest.raises(grpc.RpcError) as refused:
                    stub.Step(worker_pb2.StepRequest(step_id=1, fencing_token=token), timeout=10)
                assert "lost its lease" in refused.value.details()
