"""Swap preemption: the CPU block pool and KVCacheManager.swap_out/swap_in (exact ids),
the scheduler against the fake worker (which checks every swapped block's contents come
back intact), and the real model through the in-process engine against transformers."""

from __future__ import annotations

import random
import time

import pytest
import torch

from kvstore.cache_tensors import KVCacheTensors, swap_blocks
from kvstore.kv_cache_manager import KVCacheManager
from kvstore.swap_pool import CpuBlockPool
from scheduler_svc.policy.config import SchedulerConfig
from scheduler_svc.policy.request import RequestStatus
from tests.support.scheduler_harness import Harness, make_request, reference_outputs, scheduled


# -- kvstore -----------------------------------------------------------------------------

def test_cpu_pool_lowest_ids_first_and_integrity():
    pool = CpuBlockPool(4)
    assert pool.allocate(2) == [0, 1] and pool.num_free_blocks == 2
    assert pool.allocate(1) == [2]
    pool.free([1, 0])
    assert pool.allocate(3) == [0, 1, 3]
    pool.check_integrity()
    with pytest.raises(IndexError):
        pool.allocate(1)
    with pytest.raises(ValueError):
        pool.free([7])
    pool.free([0, 1, 2, 3])
    assert pool.num_free_blocks == 4
    pool.check_integrity()


def test_swap_out_and_in_exact_ids():
    kv = KVCacheManager(8, 4, enable_prefix_caching=False, num_cpu_blocks=4)
    assert kv.allocate_slots("a", 10) == [0, 1, 2]
    assert kv.allocate_slots("b", 4) == [3]
    assert kv.can_swap_out("a") and not kv.can_swap_out("nobody")
    assert kv.swap_out("a") == [(0, 0), (1, 1), (2, 2)]
    kv.check_integrity()
    assert kv.block_ids("a") == [] and kv.num_swapped_blocks("a") == 3
    assert kv.num_free_blocks == 7 and kv.cpu_pool.num_free_blocks == 1
    assert not kv.can_swap_out("b") or kv.cpu_pool.num_free_blocks >= 1  # b has 1 block: fits
    assert kv.allocate_slots("c", 8) == [0, 1]  # a's freed blocks, head of the queue
    assert kv.swap_in("a", 12) == [(0, 2), (1, 4), (2, 5)]
    kv.check_integrity()
    assert kv.block_ids("a") == [2, 4, 5] and kv.num_swapped_blocks("a") == 0
    assert kv.cpu_pool.num_free_blocks == 4
    for rid in ("a", "b", "c"):
        kv.free(rid)
    kv.check_integrity()
    assert kv.num_free_blocks == 8


def test_swap_in_refused_without_room_changes_nothing():
    kv = KVCacheManager(4, 4, enable_prefix_caching=False, num_cpu_blocks=4)
    kv.allocate_slots("a", 8)
    kv.swap_out("a")
    kv.allocate_slots("b", 12)  # 3 of 4 GPU blocks
    assert kv.swap_in("a") is None
    assert kv.swap_in("a", 4) is None  # needs 2 for its swapped blocks anyway
    kv.check_integrity()
    assert kv.num_swapped_blocks("a") == 2 and kv.num_free_blocks == 1
    kv.free("b")
    assert kv.swap_in("a", 9) == [(0, 0), (1, 1)]  # room for 3 checked, 2 taken
    kv.free("a")
    kv.check_integrity()


def test_freeing_a_swapped_request_releases_its_cpu_blocks():
    kv = KVCacheManager(4, 4, num_cpu_blocks=2)
    kv.allocate_slots("a", 8)
    kv.swap_out("a")
    assert not kv.can_swap_out("a")  # holds no GPU blocks now
    kv.free("a")
    kv.check_integrity()
    assert kv.cpu_pool.num_free_blocks == 2 and kv.num_free_blocks == 4


def test_swap_with_prefix_caching_keeps_cached_blocks_and_reoffers_the_new_table():
    kv = KVCacheManager(8, 4, num_cpu_blocks=8)
    tokens, hashes = list(range(10)), []
    kv.allocate_slots("a", 10)
    kv.cache_full_blocks("a", tokens, hashes, 10)
    assert len(kv.block_pool.cached) == 2
    pairs = kv.swap_out("a")
    assert [src for src, _ in pairs] == [0, 1, 2]
    assert kv.find_cached_prefix(tokens, hashes) == [kv.block_pool.blocks[0], kv.block_pool.blocks[1]]
    back = kv.swap_in("a")
    kv.check_integrity()
    # The swapped-in copies hold the same content as the still-cached blocks: the chain
    # goes on through those, and nothing is cached twice.
    kv.cache_full_blocks("a", tokens + [10, 11], hashes, 12)
    kv.check_integrity()
    assert len(kv.block_pool.cached) == 3
    assert kv.block_pool.cached[hashes[2]].block_id == back[2][1]
    kv.free("a")
    kv.check_integrity()


def test_swap_blocks_copies_across_tensor_sets():
    gpu = KVCacheTensors(2, 4, 2, 1, 3, torch.float32)
    cpu = KVCacheTensors(2, 3, 2, 1, 3, torch.float32)
    gpu.kv.copy_(torch.randn_like(gpu.kv))
    swap_blocks(gpu, cpu, [(3, 0), (1, 2)])
    assert torch.equal(cpu.kv[:, :, 0], gpu.kv[:, :, 3]) and torch.equal(cpu.kv[:, :, 2], gpu.kv[:, :, 1])
    assert not cpu.kv[:, :, 1].any()
    swap_blocks(cpu, gpu, [(2, 0)])
    assert torch.equal(gpu.kv[:, :, 0], gpu.kv[:, :, 1])


# -- the scheduler, against the fake worker -------------------------------------------------

def test_swap_preemption_step_contents_and_identical_outputs():
    # As test_preempts_latest_arrival_by_recompute...: 6 blocks of 4, a and b fill the pool;
    # at the 13th token a needs a 4th block and b is swapped out instead of recomputed.
    a, b = make_request("a", 8, 8, arrival=0), make_request("b", 8, 8, arrival=1)
    h = Harness(num_blocks=6, block_size=4, num_cpu_blocks=8, preemption_mode="swap")
    h.add(a, b)
    for _ in range(5):
        h.step()
    s6 = h.step()
    assert scheduled(s6) == {"a": 1}
    assert list(s6.finished_request_ids) == [] and list(s6.swapped_out_request_ids) == ["b"]
    assert [(p.src, p.dst) for p in s6.blocks_to_swap_out] == [(2, 0), (3, 1), (5, 2)]
    assert list(s6.cached_requests[0].new_block_ids) == [5]  # b's tail block, freed first
    b_state = h.sched.get_request("b")
    assert b_state.status is RequestStatus.SWAPPED and b_state.num_computed_tokens == 12
    assert h.sched.queues.swapped == [b_state] and h.sched.preemptor.num_swapped_out == 1
    assert h.sched.stats().num_swapped == 1 and h.sched.stats().num_free_cpu_blocks == 5
    h.run()
    resumed = [s for s in h.steps if s.blocks_to_swap_in]
    assert len(resumed) == 1
    back = [c for c in resumed[0].cached_requests if c.request_id == "b"][0]
    assert back.replace_block_ids and back.num_computed_tokens == 12
    assert [p.dst for p in resumed[0].blocks_to_swap_in] == list(back.new_block_ids)[:3]
    assert [p.src for p in resumed[0].blocks_to_swap_in] == [0, 1, 2]
    # Never recomputed: b went out in full once, and its 12 tokens were computed once.
    assert sum(r.request_id == "b" for s in h.steps for r in s.new_requests) == 1
    assert h.worker.num_swapped_out == 3 and h.worker.num_swapped_in == 3
    assert h.finished["b"].num_preemptions == 1
    assert h.outputs() == reference_outputs(a, b)


def test_swapped_requests_resume_before_new_ones_in_arrival_order():
    reqs = [make_request(f"r{i}", 6, 10, arrival=i) for i in range(3)]
    h = Harness(num_blocks=8, block_size=4, num_cpu_blocks=32, preemption_mode="swap")
    h.add(*reqs)
    while not h.sched.queues.swapped:
        h.step()
    late = make_request("late", 3, 2, arrival=10)
    h.add(late)
    resumed_order = []
    while h.sched.has_work():
        step = h.step()
        resumed_order += [c.request_id for c in step.cached_requests if c.replace_block_ids]
        if any(r.request_id == "late" for r in step.new_requests):
            assert not h.sched.queues.swapped, "a new request admitted while requests were swapped out"
    assert resumed_order and h.sched.preemptor.num_swapped_out == len(resumed_order)
    assert h.outputs() == reference_outputs(*reqs, late)


def test_full_swap_space_falls_back_to_recompute():
    a, b = make_request("a", 8, 8, arrival=0), make_request("b", 8, 8, arrival=1)
    h = Harness(num_blocks=6, block_size=4, num_cpu_blocks=2, preemption_mode="swap")  # b needs 3
    h.add(a, b)
    for _ in range(6):
        h.step()
    assert list(h.steps[-1].finished_request_ids) == ["b"] and not h.steps[-1].blocks_to_swap_out
    assert h.sched.get_request("b").status is RequestStatus.WAITING
    assert h.sched.preemptor.num_swapped_out == 0 and h.sched.preemptor.num_preemptions == 1
    h.run()
    assert h.outputs() == reference_outputs(a, b)


def test_recompute_mode_ignores_the_swap_space():
    a, b = make_request("a", 8, 8, arrival=0), make_request("b", 8, 8, arrival=1)
    h = Harness(num_blocks=6, block_size=4, num_cpu_blocks=8)
    assert h.sched.kv.num_cpu_blocks == 0
    h.add(a, b)
    h.run()
    assert h.sched.preemptor.num_preemptions == 1 and h.sched.preemptor.num_swapped_out == 0


def test_abort_of_a_swapped_request_frees_its_cpu_blocks():
    a, b = make_request("a", 8, 8, arrival=0), make_request("b", 8, 8, arrival=1)
    h = Harness(num_blocks=6, block_size=4, num_cpu_blocks=8, preemption_mode="swap")
    h.add(a, b)
    for _ in range(6):
        h.step()
    assert h.sched.get_request("b").status is RequestStatus.SWAPPED
    assert h.sched.abort_request("b")
    h.sched.check_integrity()
    assert h.sched.kv.cpu_pool.num_free_blocks == 8
    step = h.step()
    assert list(step.finished_request_ids) == ["b"]
    h.run()
    assert "b" not in h.finished


def test_drain_returns_swapped_requests_for_recompute():
    a, b = make_request("a", 8, 8, arrival=0), make_request("b", 8, 8, arrival=1)
    h = Harness(num_blocks=6, block_size=4, num_cpu_blocks=8, preemption_mode="swap")
    h.add(a, b)
    for _ in range(6):
        h.step()
    states = h.sched.drain()
    assert [s.request_id for s in states] == ["a", "b"]
    assert all(s.status is RequestStatus.WAITING and s.num_computed_tokens == 0 for s in states)
    h.sched.check_integrity()
    assert h.sched.kv.cpu_pool.num_free_blocks == 8 and h.sched.kv.num_free_blocks == 6


# -- the real model ---------------------------------------------------------------------

def test_engine_greedy_equals_transformers_with_swaps(tiny_model_dir):

    from compose.engine import EngineConfig, InProcessEngine
    from proto.messages import NewRequest, SamplingParams
    from tests.support.engine_helpers import Collector, assert_greedy_matches_transformers, serve_on_thread
    from worker_svc.config import RunnerConfig

    rng = random.Random(2)
    cases = [([rng.randrange(3, 900) for _ in range(rng.randint(2, 60))], rng.randint(5, 30))
             for _ in range(12)]
    sink = Collector(len(cases))
    engine = InProcessEngine(EngineConfig(
        runner=RunnerConfig(model=str(tiny_model_dir), num_blocks=16, num_cpu_blocks=64),
        batching=SchedulerConfig(max_num_batched_tokens=48, preemption_mode="swap")), sink)
    assert engine.info.num_cpu_blocks == 64
    serve_on_thread(engine, sink, [
        NewRequest(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                   reply_channel="c", arrival_time=time.time())
        for i, (prompt, max_tokens) in enumerate(cases)])
    sched = engine.scheduler
    assert sched.preemptor.num_swapped_out >= 1, "no swap happened"
    sched.check_integrity()
    assert sched.kv.num_free_blocks == 16 and sched.kv.cpu_pool.num_free_blocks == 64

    assert_greedy_matches_transformers(tiny_model_dir, cases, sink)


def test_engine_seeded_sampling_unchanged_by_swaps(tiny_model_dir):
    """Seeded draws depend on (seed, position) alone, so swapped requests give the same
    tokens as a run with room for everything."""
    from compose.engine import EngineConfig, InProcessEngine
    from proto.messages import NewRequest, SamplingParams
    from tests.support.engine_helpers import Collector, run_engine
    from worker_svc.config import RunnerConfig

    rng = random.Random(3)
    cases = [([rng.randrange(3, 900) for _ in range(rng.randint(2, 40))], rng.randint(10, 30))
             for _ in range(8)]

    def outputs(num_blocks, mode):
        sink = Collector(len(cases))
        engine = InProcessEngine(EngineConfig(
            runner=RunnerConfig(model=str(tiny_model_dir), num_blocks=num_blocks, num_cpu_blocks=64),
            batching=SchedulerConfig(max_num_batched_tokens=48, preemption_mode=mode)), sink)
        run_engine(engine, sink, [
            NewRequest(f"r{i}", prompt, SamplingParams(max_tokens=m, temperature=1.0, seed=i, ignore_eos=True),
                       "c", time.time() + i) for i, (prompt, m) in enumerate(cases)])
        return {rid: [t[k] for k in sorted(t)] for rid, t in sink.tokens.items()}, engine.scheduler

    roomy, sched = outputs(256, "swap")
    assert sched.preemptor.num_preemptions == 0
    swapped, sched = outputs(12, "swap")
    assert sched.preemptor.num_swapped_out >= 1
    assert swapped == roomy
