"""SchedulerService against a real Redis, no worker: what it does with the requests stream
on its own (restart recovery, aborts of requests waiting for a worker)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import pytest
import redis.asyncio as aioredis

from proto.keys import STREAM_FIELD, RedisKeys
from proto.messages import AbortRequest, NewRequest, SamplingParams, stream_encoder
from scheduler_svc.service import SchedulerService
from scheduler_svc.service_config import SchedulerServiceConfig
from scheduler_svc.shard import Shard

TIMEOUT_S = 20.0


def new_request(request_id: str, n: int = 1) -> NewRequest:
    return NewRequest(request_id=request_id, prompt_token_ids=[1, 2, 3, 4],
                      sampling=SamplingParams(max_tokens=4), reply_channel="test:out:nobody",
                      arrival_time=time.time(), n=n)


async def xadd(client: aioredis.Redis, keys: RedisKeys, message) -> None:
    await client.xadd(keys.requests, {STREAM_FIELD: stream_encoder.encode(message)})


def unassigned_ids(service: Shard) -> set[str]:
    return {item.request_id for item in service.ledger.unassigned}


async def wait_for(predicate, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def running(config: SchedulerServiceConfig):
    """The service's shard 0, once it leads it."""
    service = SchedulerService(config)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    try:
        await wait_for(lambda: service.shard is not None or task.done(), "the lead")
        yield service.shard
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=10)


@contextlib.asynccontextmanager
async def fresh_prefix(redis_url: str):
    keys = RedisKeys(f"test-svc-{uuid.uuid4().hex[:8]}")
    client = aioredis.Redis.from_url(redis_url)
    try:
        yield keys, client
    finally:
        names = [k async for k in client.scan_iter(match=f"{keys.prefix}:*")]
        if names:
            await client.delete(*names)
        await client.aclose()


def test_restart_reads_its_history_then_new_requests(redis_url):
    async def main():
        async with fresh_prefix(redis_url) as (keys, client):
            config = SchedulerServiceConfig(redis_url=redis_url, key_prefix=keys.prefix,
                                            consumer_name="scheduler-restart-test")
            await xadd(client, keys, new_request("a"))
            await xadd(client, keys, new_request("b"))
            async with running(config) as first:  # no workers: both wait in unassigned
                await wait_for(lambda: unassigned_ids(first) == {"a", "b"}, "the first instance")
            # Restarted under the same consumer name: a and b are pending (never acked).
            async with running(config) as second:
                await xadd(client, keys, new_request("c"))
                await wait_for(lambda: unassigned_ids(second) == {"a", "b", "c"},
                               "the second instance to get past its history")
                assert len(second.ledger.unassigned) == 3
            pending = await client.xpending(keys.requests, "schedulers")
            assert pending["pending"] == 3  # none of them finished

    asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))


def test_a_resubmitted_request_replaces_its_copy_and_a_new_one_is_served(redis_url):
    """A gateway that lost events sends its open requests again (`resubmitted`): one still
    held is started over (its old entry acknowledged, one copy left); one this scheduler
    does not have (a Redis restart took the stream) is taken as new; an original that comes
    after its resubmitted copy is acknowledged and dropped."""
    import msgspec

    async def main():
        async with fresh_prefix(redis_url) as (keys, client):
            config = SchedulerServiceConfig(redis_url=redis_url, key_prefix=keys.prefix,
                                            consumer_name="scheduler-resubmit-test")
            async with running(config) as service:  # no workers: requests wait in unassigned
                first = new_request("a")
                await xadd(client, keys, first)
                await wait_for(lambda: unassigned_ids(service) == {"a"}, "the request")
                old_entry = service.ledger.entries["a"]
                await xadd(client, keys, msgspec.structs.replace(first, resubmitted=True))
                await xadd(client, keys, msgspec.structs.replace(new_request("b"), resubmitted=True))
                await wait_for(lambda: unassigned_ids(service) == {"a", "b"}, "the resubmitted requests")
                await wait_for(lambda: service.ledger.entries["a"] != old_entry, "the replacement")
                copies = [item for item in service.ledger.unassigned if item.request_id == "a"]
                assert len(copies) == 1 and copies[0].resubmitted
                # The resubmitted copy may overtake its original (sent while the first XADD
                # was in flight): the original is then acknowledged, not left pending.
                late = new_request("c")
                await xadd(client, keys, msgspec.structs.replace(late, resubmitted=True))
                await xadd(client, keys, late)
                await wait_for(lambda: unassigned_ids(service) == {"a", "b", "c"}, "c")
                await asyncio.sleep(0.3)  # the original of c is read and acknowledged
                assert len(service.ledger.unassigned) == 3
            pending = await client.xpending(keys.requests, "schedulers")
            assert pending["pending"] == 3  # the new "a", "b" and the first "c"; the others are acknowledged

    asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))


def test_the_leader_claims_requests_another_scheduler_read_and_left(redis_url):
    """A scheduler that lost its lease may have read entries before it noticed (or died
    after the new leader took over): the leader claims them once idle for two lease periods."""
    async def main():
        async with fresh_prefix(redis_url) as (keys, client):
            config = SchedulerServiceConfig(redis_url=redis_url, key_prefix=keys.prefix,
                                            consumer_name="scheduler-leader", lease_ttl_s=0.5, read_batch=2)
            async with running(config) as service:
                await wait_for(lambda: service.lease.token > 0, "the lease")
                # Its own requests, waiting (no workers) and so pending and idle, more than one
                # XPENDING page of them: they must not hide the orphan behind them.
                for i in range(3):
                    await xadd(client, keys, new_request(f"mine-{i}"))
                await wait_for(lambda: unassigned_ids(service) == {"mine-0", "mine-1", "mine-2"}, "its own")
                # Read by a scheduler that then went away, never acknowledged: added and read
                # in one transaction, so the leader cannot read it first.
                pipe = client.pipeline(transaction=True)
                pipe.xadd(keys.requests, {STREAM_FIELD: stream_encoder.encode(new_request("orphan"))})
                pipe.xreadgroup("schedulers", "scheduler-gone", {keys.requests: ">"}, count=10)
                _, read = await pipe.execute()
                assert len(read[0][1]) == 1
                await wait_for(lambda: "orphan" in unassigned_ids(service), "the claim", timeout=10)
            pending = await client.xpending_range(keys.requests, "schedulers", "-", "+", 10)
            assert [p["consumer"] for p in pending] == [b"scheduler-leader"] * 4

    asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))


def _park_children(service: Shard, parent_id: str, n: int) -> list:
    """As after a worker loss with no live worker left: the forked parent is gone, its
    children wait one by one (returned, for the caller to park or put in transit)."""
    from proto.parallel import child_request_id
    from scheduler_svc.policy.request import SchedulerRequest

    parked = service.ledger.take_parked()
    parent = next(r for r in parked if r.request_id == parent_id)
    for item in parked:
        if item is not parent:
            service.ledger.park(item)
    children = []
    for i in range(n):
        child = SchedulerRequest.from_new_request(
            NewRequest(request_id=child_request_id(parent_id, i), prompt_token_ids=[1, 2, 3, 4],
                       sampling=parent.sampling, reply_channel=parent.reply_channel,
                       arrival_time=parent.arrival_time))
        child.parent_id = parent_id
        children.append(child)
    return children


def test_abort_of_a_parent_removes_its_unassigned_children(redis_url):
    async def main():
        async with fresh_prefix(redis_url) as (keys, client):
            config = SchedulerServiceConfig(redis_url=redis_url, key_prefix=keys.prefix,
                                            consumer_name="scheduler-abort-test")
            async with running(config) as service:
                await xadd(client, keys, new_request("p", n=3))
                await xadd(client, keys, new_request("other"))
                await wait_for(lambda: unassigned_ids(service) == {"p", "other"}, "both requests")
                for child in _park_children(service, "p", 3):
                    service.ledger.park(child)
                await xadd(client, keys, AbortRequest("p"))
                await wait_for(lambda: unassigned_ids(service) == {"other"},
                               "the abort to remove the children")
                await wait_for(lambda: "p" not in service.ledger.entries, "the parent's entry to be done")
            pending = await client.xpending(keys.requests, "schedulers")
            assert pending["pending"] == 1  # only "other"'s entry is left unacknowledged

    asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))


def test_abort_of_a_child_id_takes_that_child_alone_and_the_last_one_ends_the_entry(redis_url):
    async def main():
        async with fresh_prefix(redis_url) as (keys, client):
            config = SchedulerServiceConfig(redis_url=redis_url, key_prefix=keys.prefix,
                                            consumer_name="scheduler-child-abort-test")
            async with running(config) as service:
                await xadd(client, keys, new_request("p", n=3))
                await wait_for(lambda: unassigned_ids(service) == {"p"}, "the request")
                for child in _park_children(service, "p", 3):
                    service.ledger.park(child)
                await xadd(client, keys, AbortRequest("p/1"))
                await wait_for(lambda: unassigned_ids(service) == {"p/0", "p/2"}, "p/1 to go")
                assert "p" in service.ledger.entries and not service.ledger.is_early_abort("p/1")
                await xadd(client, keys, AbortRequest("p/0"))
                await xadd(client, keys, AbortRequest("p/2"))
                await wait_for(lambda: "p" not in service.ledger.entries, "the entry to end with the last child")
                assert not service.ledger.unassigned
            assert (await client.xpending(keys.requests, "schedulers"))["pending"] == 0

    asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))


def test_abort_of_a_parent_reaches_children_in_transit(redis_url):
    """Children being moved after a worker loss (in transit between workers) are taken
    out by the abort; routing them afterwards skips them."""
    async def main():
        async with fresh_prefix(redis_url) as (keys, client):
            config = SchedulerServiceConfig(redis_url=redis_url, key_prefix=keys.prefix,
                                            consumer_name="scheduler-transit-abort-test")
            async with running(config) as service:
                await xadd(client, keys, new_request("p", n=2))
                await wait_for(lambda: unassigned_ids(service) == {"p"}, "the request")
                children = _park_children(service, "p", 2)
                service.ledger.start_transit(children)  # as _route_all holds them across an await
                await xadd(client, keys, AbortRequest("p"))
                await wait_for(lambda: not service.ledger.in_transit and "p" not in service.ledger.entries,
                               "the abort to take the children in transit")
                for child in children:  # what _route_all checks next for each: skipped
                    assert not service.ledger.end_transit(child)
                assert not service.ledger.unassigned and not service.ledger.owners
            assert (await client.xpending(keys.requests, "schedulers"))["pending"] == 0

    asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))


class _CrashingSteps:
    async def write(self, step):
        raise RuntimeError("not an RPC error: a bug")

    def cancel(self):
        return True


class _CrashingStub:
    def Steps(self):  # noqa: N802 (gRPC's name)
        return _CrashingSteps()


class _Channel:
    async def close(self):
        pass


def test_a_crashed_step_loop_retires_its_worker_and_keeps_its_requests(redis_url):
    from proto.messages import WorkerRegistration
    from scheduler_svc.policy.batching import BatchScheduler
    from scheduler_svc.policy.config import SchedulerConfig
    from scheduler_svc.worker_pool import WorkerHandle

    async def main():
        async with fresh_prefix(redis_url) as (keys, client):
            config = SchedulerServiceConfig(redis_url=redis_url, key_prefix=keys.prefix,
                                            consumer_name="scheduler-crash-test")
            async with running(config) as service:
                reg = WorkerRegistration(worker_id="w-crash", address="nowhere:1", model="m",
                                         block_size=16, num_blocks=64, max_model_len=256,
                                         started_at=time.time())
                handle = WorkerHandle(reg, BatchScheduler(SchedulerConfig(), num_blocks=64, block_size=16,
                                                          max_model_len=256),
                                      _Channel(), _CrashingStub())
                # Registered, so discovery leaves it alone (it has no gRPC server to dial).
                await client.set(keys.worker(reg.worker_id), stream_encoder.encode(reg))
                await client.sadd(keys.workers, reg.worker_id)
                service.start_worker(handle)
                await xadd(client, keys, new_request("r"))
                await handle.task  # crashes on its first Step, quietly no more
                assert handle.retiring
                assert handle not in service.pool.handles()
                assert unassigned_ids(service) == {"r"}  # back waiting for a live worker
                assert "r" in service.ledger.entries and "r" not in service.ledger.owners

    asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))


def test_a_resumed_heartbeat_registers_the_worker_id_again(redis_url):
    import redis

    from proto.messages import WorkerRegistration
    from worker_svc.server import Registration

    keys = RedisKeys(f"test-svc-{uuid.uuid4().hex[:8]}")
    client = redis.Redis.from_url(redis_url)
    reg = WorkerRegistration(worker_id="w-beat", address="nowhere:1", model="m", block_size=16,
                             num_blocks=64, max_model_len=256, started_at=time.time())
    registration = Registration(client, keys, reg, interval_s=0.05, ttl_s=5.0)
    registration.start()
    try:
        assert client.sismember(keys.workers, "w-beat")
        client.srem(keys.workers, "w-beat")  # what a scheduler does when the key had expired
        deadline = time.monotonic() + 5
        while not client.sismember(keys.workers, "w-beat"):
            assert time.monotonic() < deadline, "the heartbeat did not re-add the worker id"
            time.sleep(0.02)
        assert client.get(keys.worker("w-beat")) is not None
    finally:
        registration.stop()
        assert not client.sismember(keys.workers, "w-beat")
        client.close()


def test_async_scheduling_auto_is_on_for_accelerators_only():
    from proto import worker_pb2

    def ahead(setting: str, device: str) -> bool:
        return SchedulerServiceConfig(async_scheduling=setting).schedules_ahead(worker_pb2.WorkerInfo(device=device))

    assert not ahead("auto", "cpu") and not ahead("auto", "")  # "": a worker that does not say
    assert ahead("auto", "cuda:0") and ahead("auto", "cuda")
    assert ahead("on", "cpu") and not ahead("off", "cuda:0")
    with pytest.raises(ValueError, match="async_scheduling must be"):
        SchedulerServiceConfig(async_scheduling="yes")
