"""Sharded schedulers (scheduler_svc/service.py, scheduler_svc/shard.py): two schedulers
share two shards and three workers, each worker leased by one shard; requests through the
gateway reach both shards. One scheduler killed (SIGKILL) mid-stream: the other takes its
shard over -- its stream's pending requests and its workers, under new fencing tokens --
and the seeded outputs at temperature 0.8 equal those of a fault-free run."""

from __future__ import annotations

import socket
import time

import redis

from proto.messages import heartbeat_decoder
from tests.support.stack_helpers import kill, run_streams, running_stack, wait_until_idle, worker_stats


def _leases(stack) -> dict[str, tuple[int, int]]:
    """worker id -> (shard, fencing token) of its lease."""
    client = redis.Redis.from_url(stack.redis_url)
    out = {}
    for key in client.scan_iter(match=stack.keys.worker_lease("*")):
        shard, _, token = client.get(key).decode().partition(":")
        out[key.decode().rpartition(":")[2]] = (int(shard), int(token))
    return out


def _shards_led(stack) -> dict[str, list[int]]:
    """scheduler id -> the shards its heartbeat says it leads, each with workers."""
    client = redis.Redis.from_url(stack.redis_url)
    out = {}
    for key in client.scan_iter(match=stack.keys.scheduler("*")):
        beat = heartbeat_decoder.decode(client.get(key))
        out[beat.scheduler_id] = sorted(s.shard for s in beat.shards if s.worker_ids)
    return out


def _wait(predicate, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)
    return value


def test_two_schedulers_share_shards_and_one_takes_over_a_killed_one(tiny_model_dir, redis_url, tmp_path_factory):
    with running_stack(tiny_model_dir, redis_url, tmp_path_factory.mktemp("run"), workers=3, schedulers=2,
                       scheduler_args=("--shards", "2")) as stack:
        _wait(lambda: sorted(map(tuple, _shards_led(stack).values())) == [(0,), (1,)],
              "each scheduler to lead one shard with workers")
        leases = _wait(lambda: (lambda ls: ls if len(ls) == 3 else None)(_leases(stack)), "every worker leased")
        assert sorted(shard for shard, _ in leases.values()) in ([0, 0, 1], [0, 1, 1])  # the fair share: 2 and 1

        prompts = [[12 + 7 * i, 22 + i, 32 + i, 42 + i] for i in range(8)]
        max_tokens = 100

        def run(fault):
            return run_streams(stack, prompts, fault=fault, max_tokens=max_tokens, temperature=0.8, seed=11)

        calm = run(None)
        # each worker's stats are written by its scheduler once a second: read until they show the steps
        _wait(lambda: {leases[w][0] for w, s in worker_stats(stack).items() if s.num_steps > 0} == {0, 1},
              "requests to reach both shards (their workers' stats showing steps)", timeout=30)

        led = _shards_led(stack)
        victim_id = next(s for s, shards in led.items() if shards == [1])
        victim = next(name for name in ("scheduler", "scheduler-1") if _consumer(name) == victim_id)
        faulted = run(kill(stack, victim))
        assert [len(ids) for ids in faulted] == [max_tokens] * len(prompts)
        assert faulted == calm

        survivor = _wait(lambda: next((s for s, shards in _shards_led(stack).items() if shards == [0, 1]), None),
                         "the survivor to lead both shards")
        assert survivor != victim_id
        after = _leases(stack)
        for worker_id, (shard, token) in leases.items():
            if shard == 1:  # the killed scheduler's workers: leased again, newer tokens
                assert after[worker_id][1] > token
        wait_until_idle(stack)


def _consumer(name: str) -> str:
    """The consumer name of the launcher's scheduler process `name` (compose/launcher.py)."""
    first = f"scheduler-{socket.gethostname()}"
    return first if name == "scheduler" else f"{first}-{name.removeprefix('scheduler-')}"
