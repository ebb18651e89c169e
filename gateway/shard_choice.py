"""Which scheduler shard a request goes to: prefix affinity with a bound on load.

A stack's requests are split over scheduler shards (scheduler_svc/service.py), each
driving its own share of the workers and routing prefix-aware among them
(scheduler_svc/policy/routing.py). Across shards the gateway keeps requests that share a prefix
together, so a shard's prefix cache serves them:

  * the request's affinity key is its first `affinity_tokens` prompt tokens (and the
    content hashes of the images among them); requests sharing that much of a prefix --
    a system prompt, the earlier turns of a conversation -- have the same key;
  * the shards that lead workers (the schedulers' heartbeats say which, with their
    workers and requests) are ranked by a rendezvous hash of (key, shard): every gateway
    ranks them the same way, and a shard that comes or goes moves only its own keys;
  * the first shard in that order whose requests per worker are within `slack` of the
    mean (plus one) takes the request -- consistent hashing with bounded loads, so a hot
    prefix spills over to its second shard instead of swamping the first.

The loads come from the heartbeats (refreshed every second); the requests this gateway
sent since the heartbeats were read are added, so a burst does not all go to one shard.
With no heartbeat naming a shard (one shard, or schedulers of before), shard 0.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from proto.messages import NewRequest, SchedulerHeartbeat, ShardLoad
from proto.rendezvous import rendezvous_order

AFFINITY_TOKENS = 64  # a system prompt's start, and a conversation's first turn
SLACK = 0.25  # a shard takes up to 25% more requests per worker than the mean (plus one)


def affinity_key(request: NewRequest, affinity_tokens: int = AFFINITY_TOKENS) -> bytes:
    """What requests that should share a shard have in common."""
    head = request.prompt_token_ids[:affinity_tokens]
    key = hashlib.blake2b(struct.pack(f"<{len(head)}q", *head), digest_size=16)
    for item in request.mm_inputs:
        if item.offset < affinity_tokens:
            key.update(item.content_hash.encode())
    return key.digest()


class ShardChoice:
    def __init__(self, affinity_tokens: int = AFFINITY_TOKENS, slack: float = SLACK) -> None:
        self._affinity_tokens = affinity_tokens
        self._slack = slack
        self._beats: Sequence[SchedulerHeartbeat] | None = None  # the heartbeats last seen
        self._sent: dict[int, int] = {}  # shard -> requests sent since they were read

    def pick(self, request: NewRequest, beats: Sequence[SchedulerHeartbeat]) -> int:
        """The shard for `request`, given the live schedulers' heartbeats."""
        if beats is not self._beats:  # read again: their counts include what was sent
            self._beats, self._sent = beats, {}
        shards = {s.shard: s for b in beats for s in b.shards if s.worker_ids}
        if len(shards) <= 1:
            return next(iter(shards), 0)
        key = affinity_key(request, self._affinity_tokens)
        ranked = rendezvous_order(key, shards)
        chosen = self._within_bound(ranked, shards)
        self._sent[chosen] = self._sent.get(chosen, 0) + 1
        return chosen

    def _within_bound(self, ranked: list[int], shards: dict[int, ShardLoad]) -> int:
        """The first ranked shard whose requests per worker are within the bound."""
        def requests(k: int) -> int:
            return shards[k].num_requests + self._sent.get(k, 0)
        workers = sum(len(s.worker_ids) for s in shards.values())
        bound = (1 + self._slack) * sum(requests(k) for k in shards) / workers + 1
        for k in ranked:
            if requests(k) / len(shards[k].worker_ids) <= bound:
                return k
        return ranked[0]  # not reached: some shard is at or below the mean
