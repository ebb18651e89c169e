"""Automatic prefix caching in the scheduler: with the fake worker, what a hit leaves to
compute, shared blocks, resuming from cached blocks after preemption, the accounting in
WorkerStats, re-routing, random workloads against outputs without caching; then a real
model's greedy outputs with hits mid-run. The kvstore underneath: test_prefix_cache.py."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.prefix_cache_helpers import BS, P, request
from tests.support.scheduler_harness import Harness, make_request, reference_outputs, scheduled


# -- the scheduler with the fake worker -------------------------------------------------


def test_second_identical_request_computes_only_the_uncached_tail():
    h = Harness(num_blocks=8, block_size=BS)
    h.add(request("a", P[:10], 3, arrival=0))
    h.run()  # a computed 12 tokens: blocks 0, 1, 2 cached
    assert h.sched.cached_prefix_tokens(P[:10]) == 8  # its last token is computed again
    h.add(request("b", P[:10], 3, arrival=1))
    step = h.step()
    (new,) = step.new_requests
    assert new.num_computed_tokens == 8 and list(new.block_ids) == [0, 1, 3]
    assert scheduled(step) == {"b": 2}
    h.run()
    assert h.outputs()["b"] == h.outputs()["a"]
    stats = h.sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20, 8)


def test_live_requests_share_a_prefix_and_outputs_do_not_change():
    a, b = request("a", P[:10], 6, arrival=0), request("b", P[:9] + [5, 6, 7], 6, arrival=1)
    h = Harness(num_blocks=8, block_size=BS)
    h.add(a)
    h.step()  # a's prompt: blocks 0, 1 full and cached
    h.add(b)
    step = h.step()
    assert scheduled(step) == {"a": 1, "b": 4}
    assert list(step.new_requests[0].block_ids) == [0, 1, 3]
    pool = h.sched.kv.block_pool
    assert [pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    stats = h.sched.stats()  # 11 + 12 tokens in 4 blocks of 4, 2 of them counted twice
    assert (stats.num_used_blocks, stats.num_free_blocks) == (4, 4)
    assert stats.kv_waste == pytest.approx(1 - (11 + 12 - 8) / 16)
    h.run()
    assert h.outputs() == reference_outputs(a, b)
    stats = h.sched.stats()
    assert (stats.num_used_blocks, stats.num_free_blocks, stats.kv_waste) == (0, 8, 0.0)
    assert stats.num_cached_blocks == len(pool.cached) == 5  # a: 0, 1, 2; b: 3, 4


def test_a_preempted_request_resumes_from_its_cached_blocks():
    # 6 blocks of 4: b (the later arrival) is preempted when a needs a 4th block.
    a, b = make_request("a", 8, 8, arrival=0), make_request("b", 8, 8, arrival=1)
    h = Harness(num_blocks=6, block_size=BS)
    h.add(a, b)
    while h.sched.preemptor.num_preemptions == 0:
        h.step()
    state = h.sched.get_request("b")
    assert h.sched.cached_prefix_tokens(state.token_ids) == 8
    hashes = list(state.block_hashes)
    h.run()
    assert state.block_hashes[:len(hashes)] == hashes  # kept across the preemption
    resumed = [r for s in h.steps for r in s.new_requests if r.request_id == "b"][1]
    assert resumed.num_computed_tokens == 8
    assert h.outputs() == reference_outputs(a, b)
    stats = h.sched.stats()
    assert stats.num_preemptions == 1 and stats.prefix_cache_hits == 8
    assert stats.prefix_cache_queries == 8 + 8 + len(resumed.token_ids)


def test_stats_travel_as_worker_stats():
    from dataclasses import asdict

    from proto.messages import WorkerStats, stats_decoder, stream_encoder

    h = Harness(num_blocks=8, block_size=BS)
    h.add(request("a", P[:10], 3, arrival=0), request("b", P[:10], 3, arrival=1))
    h.step()  # both prefill from scratch: b was admitted before a's blocks were cached
    h.run()
    h.add(request("c", P[:10], 3, arrival=2))
    h.run()
    stats = h.sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (30, 8)
    assert stats.prefix_cache_hit_rate == pytest.approx(8 / 30)
    wire = WorkerStats(worker_id="w", **asdict(stats))
    assert stats_decoder.decode(stream_encoder.encode(wire)) == wire
    assert (wire.num_cached_blocks, wire.num_free_blocks, wire.num_used_blocks) == (3, 8, 0)


def test_prefix_caching_off_computes_everything():
    h = Harness(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    h.add(request("a", P[:10], 3, arrival=0))
    h.run()
    assert h.sched.cached_prefix_tokens(P[:10]) == 0
    h.add(request("b", P[:10], 3, arrival=1))
    assert h.step().new_requests[0].num_computed_tokens == 0
    h.run()
    assert h.sched.stats().prefix_cache_queries == 0


def test_re_routed_request_forgets_hashes_of_its_old_worker():
    h1 = Harness(block_size=BS)
    h1.add(request("a", P, 4, arrival=0))
    h1.step()
    (state,) = h1.sched.drain()
    assert state.block_hashes
    h2 = Harness(block_size=8)
    h2.sched.add_state(state)
    assert state.block_hashes == []
    h2.run()
    assert h2.outputs() == reference_outputs(request("a", P, 4, arrival=0))


@settings(max_examples=30, deadline=None)
@given(
    # (shared prefix, suffix length, max_tokens, arrival step)
    workload=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 6), st.integers(1, 12),
                                st.integers(0, 8)), min_size=2, max_size=8),
    num_blocks=st.integers(8, 14),
    budget=st.integers(2, 24),
)
def test_outputs_with_prefix_caching_equal_outputs_without(workload, num_blocks, budget):
    """Shared prefixes arriving over time, small pools (preemption, eviction), chunked
    prefill: every request's greedy output equals the reference without caching."""
    prefixes = [P[:3], P[:9], [9] * 8]
    reqs = {f"r{i}": (request(f"r{i}", prefixes[p] + [i] * n, m, arrival=float(i)), at)
            for i, (p, n, m, at) in enumerate(workload)}
    h = Harness(num_blocks=num_blocks, block_size=BS, max_num_batched_tokens=budget)
    for t in range(1000):
        for req, at in reqs.values():
            if at == t:
                h.add(req)
        if t > 8 and not h.sched.has_work():
            break
        h.step()
    h.assert_done()
    assert h.outputs() == reference_outputs(*(req for req, _ in reqs.values()))


# -- a real model ------------------------------------------------------------------------


def run_engine(model_dir, arrivals: dict, caching: bool):
    """BatchScheduler + ModelRunner in one process (the in-process engine)."""
    from scheduler_svc.policy.batching import BatchScheduler
    from scheduler_svc.policy.config import SchedulerConfig
    from worker_svc.config import RunnerConfig
    from worker_svc.model_runner import ModelRunner

    runner = ModelRunner(RunnerConfig(model=str(model_dir), block_size=BS, num_blocks=24))
    sched = BatchScheduler(SchedulerConfig(max_num_batched_tokens=16, enable_prefix_caching=caching),
                           24, BS, runner.max_model_len)
    outputs = {}
    for t in range(400):
        for req in arrivals.get(t, []):
            assert sched.add_request(req) is None
        if t > max(arrivals) and not sched.has_work():
            break
        step = sched.schedule()
        if step is not None:
            for req in sched.update(step, runner.step(step).result):
                outputs[req.request_id] = req.output_token_ids
        sched.check_integrity()
    return outputs, sched.stats()


def test_greedy_outputs_identical_with_prefix_hits_mid_run(tiny_model_dir):
    system = [(37 * i) % 1500 + 3 for i in range(13)]
    arrivals = {0: [request("a", system + [11, 12], 10, 0)],
                3: [request("b", system + [21], 8, 1), request("c", system + [11, 12], 6, 2)],
                9: [request("d", system + [31, 32, 33, 34, 35], 9, 3)],
                14: [request("e", [5, 6, 7, 8, 9], 12, 4), request("f", system[:8], 7, 5)]}
    on, stats = run_engine(tiny_model_dir, arrivals, caching=True)
    off, _ = run_engine(tiny_model_dir, arrivals, caching=False)
    assert on == off and len(on) == 6
    # b, c and d find a's first three blocks; f (8 tokens) its first one only.
    assert stats.prefix_cache_hits == 12 + 12 + 12 + 4
