"""The gateway's choice of a scheduler shard (gateway/shard_choice.py): prefix affinity,
the same on every gateway, with a bound on each shard's requests per worker."""

from __future__ import annotations

import collections
import random

from gateway.shard_choice import ShardChoice, affinity_key
from proto.messages import MultiModalInput, NewRequest, SamplingParams, SchedulerHeartbeat, ShardLoad


def request(tokens: list[int], mm_inputs: tuple[MultiModalInput, ...] = ()) -> NewRequest:
    return NewRequest(request_id="r", prompt_token_ids=tokens, sampling=SamplingParams(max_tokens=4),
                      reply_channel="c", arrival_time=0.0, mm_inputs=mm_inputs)


def beats(loads: dict[int, tuple[int, int]]) -> list[SchedulerHeartbeat]:
    """One scheduler per shard: shard -> (workers, requests held)."""
    return [SchedulerHeartbeat(scheduler_id=f"s{k}", worker_ids=[f"w{k}-{i}" for i in range(w)],
                               num_waiting=0, max_waiting_requests=0, interval_s=1.0, updated_at=0.0,
                               shards=[ShardLoad(k, [f"w{k}-{i}" for i in range(w)], n)])
            for k, (w, n) in loads.items()]


def test_no_shards_named_means_shard_zero():
    standby = SchedulerHeartbeat(scheduler_id="s", worker_ids=[], num_waiting=0, max_waiting_requests=0,
                                 interval_s=1.0, updated_at=0.0)
    assert ShardChoice().pick(request([1, 2, 3]), []) == 0
    assert ShardChoice().pick(request([1, 2, 3]), [standby]) == 0
    assert ShardChoice().pick(request([1, 2, 3]), beats({3: (2, 0)})) == 3
    # a shard without workers takes nothing
    assert ShardChoice().pick(request([1, 2, 3]), beats({0: (0, 0), 1: (1, 50)})) == 1


def test_a_shared_prefix_goes_to_one_shard_on_every_gateway():
    loads = beats({k: (4, 0) for k in range(4)})
    system = list(range(100, 164))  # 64 tokens: the affinity key
    gateways = [ShardChoice(), ShardChoice()]
    chosen = {g.pick(request(system + [random.randrange(1000) for _ in range(20)]), loads)
              for g in gateways for _ in range(5)}
    assert len(chosen) == 1
    # The key is the first 64 tokens: a conversation's later turns follow its first.
    assert affinity_key(request(system + [1, 2])) == affinity_key(request(system + [7, 8, 9]))
    assert affinity_key(request(system[:10])) != affinity_key(request(system[:11]))


def test_many_prefixes_spread_over_the_shards():
    loads = beats({k: (4, 0) for k in range(4)})
    choice = ShardChoice(slack=100.0)  # no bound: the hash alone
    counts = collections.Counter(choice.pick(request([p, p + 1, p + 2]), loads) for p in range(0, 4000, 10))
    assert set(counts) == {0, 1, 2, 3}
    assert min(counts.values()) > 400 / 4 * 0.6


def test_a_hot_prefix_spills_over_once_its_shard_is_beyond_the_bound():
    choice = ShardChoice(slack=0.25)
    hot = request(list(range(64)))
    first = choice.pick(hot, beats({k: (2, 0) for k in range(3)}))
    # its shard holds 10 per worker against 1 elsewhere: beyond (1.25 * mean + 1)
    loaded = beats({k: (2, 20 if k == first else 2) for k in range(3)})
    assert choice.pick(hot, loaded) != first
    # within the bound it stays
    assert choice.pick(hot, beats({k: (2, 4 if k == first else 3) for k in range(3)})) == first


def test_the_requests_a_gateway_sent_count_until_the_heartbeats_are_read_again():
    choice = ShardChoice(slack=0.25)
    loads = beats({k: (1, 0) for k in range(2)})
    hot = request(list(range(64)))
    picks = [choice.pick(hot, loads) for _ in range(20)]  # one burst, one read of the heartbeats
    counts = collections.Counter(picks)
    assert len(counts) == 2 and max(counts.values()) <= 1.25 * 20 / 2 + 1
    assert choice.pick(hot, beats({k: (1, 0) for k in range(2)})) == picks[0]  # a fresh read


def test_images_at_the_start_are_part_of_the_key():
    tokens = [5] * 300
    a = request(tokens, (MultiModalInput(content_hash="a" * 64, offset=2, length=256),))
    b = request(tokens, (MultiModalInput(content_hash="b" * 64, offset=2, length=256),))
    late_a = request(tokens, (MultiModalInput(content_hash="a" * 64, offset=100, length=100),))
    late_b = request(tokens, (MultiModalInput(content_hash="b" * 64, offset=100, length=100),))
    assert affinity_key(a) != affinity_key(b)
    assert affinity_key(late_a) == affinity_key(late_b)
