"""Prefix-aware routing (scheduler_svc.policy.routing) over schedulers driven by the fake worker."""

import pytest

from scheduler_svc.policy.routing import pick_worker, route_cost
from tests.support.prefix_cache_helpers import BS, P, request
from tests.support.scheduler_harness import Harness


def test_routing_prefers_the_cached_prefix_unless_much_more_loaded():
    warm, cold = Harness(num_blocks=16, block_size=BS), Harness(num_blocks=16, block_size=BS)
    warm.add(request("a", P + [1], 2, arrival=0))
    warm.run()  # P cached on warm
    prompt = P + [2, 3]
    assert warm.sched.cached_prefix_tokens(prompt) == 12
    assert route_cost(warm.sched, prompt) == pytest.approx((0 + 14 - 12) / 64)
    assert route_cost(cold.sched, prompt) == pytest.approx((0 + 14) / 64)
    both = [warm, cold]
    assert pick_worker(both, prompt, lambda h: h.sched) is warm
    assert pick_worker(both, prompt, lambda h: h.sched, prefix_weight=0) is warm  # tie: first
    warm.add(request("x", [5] * 11, 1, arrival=1))  # 11 tokens of load, less than the 12 hit
    assert pick_worker(both, prompt, lambda h: h.sched) is warm
    warm.add(request("y", [6], 1, arrival=2))  # 12: equal cost, lower load wins
    assert pick_worker(both, prompt, lambda h: h.sched) is cold
    assert pick_worker([warm], prompt, lambda h: h.sched) is warm
