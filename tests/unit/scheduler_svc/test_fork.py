"""Copy-on-write fork for parallel sampling (n > 1): KVCacheManager.fork/copy_on_write
(exact ids and reference counts), the scheduler against the fake worker (copies executed,
contents verified), and the real model through the in-process engine against transformers."""

from __future__ import annotations

import time

import pytest
import torch

from kvstore.kv_cache_manager import KVCacheManager
from proto.messages import NewRequest, SamplingParams
from tests.support.scheduler_harness import Harness, make_request, reference_outputs, scheduled


def refs(kv: KVCacheManager) -> dict[int, int]:
    return {b.block_id: b.ref_cnt for b in kv.block_pool.blocks if b.ref_cnt}


# -- kvstore -----------------------------------------------------------------------------

def test_fork_shares_every_block_and_copy_on_write_takes_the_partial_one():
    kv = KVCacheManager(8, 4, enable_prefix_caching=False)
    assert kv.allocate_slots("p", 9) == [0, 1, 2]  # 9 tokens: the last block holds 1
    for child in ("p/0", "p/1", "p/2"):
        kv.fork("p", child)
    kv.free("p")
    kv.check_integrity()
    assert refs(kv) == {0: 3, 1: 3, 2: 3}
    assert kv.block_ids("p/1") == [0, 1, 2]
    # Each child writes token 9 into block 2: all but the last holder copy it.
    assert kv.copy_on_write("p/0", 9) == [(2, 3)]
    assert kv.copy_on_write("p/0", 9) == []  # its own now
    assert kv.copy_on_write("p/1", 9) == [(2, 4)]
    assert kv.copy_on_write("p/2", 9) == []  # the last holder keeps the original
    kv.check_integrity()
    assert kv.block_ids("p/0") == [0, 1, 3] and kv.block_ids("p/1") == [0, 1, 4]
    assert kv.block_ids("p/2") == [0, 1, 2]
    assert refs(kv) == {0: 3, 1: 3, 2: 1, 3: 1, 4: 1}
    for child in ("p/0", "p/1", "p/2"):
        kv.free(child)
    kv.check_integrity()
    assert kv.num_free_blocks == 8


def test_copy_on_write_not_needed_at_a_block_boundary_and_refused_without_room():
    kv = KVCacheManager(3, 4, enable_prefix_caching=False)
    kv.allocate_slots("p", 8)
    kv.fork("p", "c")
    assert kv.copy_on_write("c", 8) == []  # token 8 starts a new block: nothing shared to write
    kv.free("c")
    kv.allocate_slots("p", 7)  # covers 7 of its 8 slots: still 2 blocks
    kv.fork("p", "c")
    kv.allocate_slots("x", 4)  # takes the last free block
    assert kv.copy_on_write("c", 7) is None
    kv.check_integrity()
    assert refs(kv) == {0: 2, 1: 2, 2: 1}
    for rid in ("p", "c", "x"):
        kv.free(rid)
    kv.check_integrity()


def test_fork_copies_the_prefix_cache_chain():
    kv = KVCacheManager(8, 4)
    tokens, hashes = list(range(9)), []
    kv.allocate_slots("p", 8)
    kv.cache_full_blocks("p", tokens, hashes, 8)
    kv.fork("p", "c")
    kv.free("p")
    kv.allocate_slots("c", 10)
    kv.cache_full_blocks("c", tokens + [9, 10, 11], hashes, 12)
    kv.check_integrity()
    assert len(kv.block_pool.cached) == 3  # the child's third block joined the chain
    kv.free("c")
    kv.check_integrity()


# -- the scheduler, against the fake worker -------------------------------------------------

def parallel_request(request_id: str, prompt_len: int, max_tokens: int, n: int, arrival: float = 0,
                     **sampling) -> NewRequest:
    req = make_request(request_id, prompt_len, max_tokens, arrival, **sampling)
    return NewRequest(req.request_id, req.prompt_token_ids, req.sampling, req.reply_channel,
                      req.arrival_time, req.priority, n=n)


def test_parent_prefills_once_then_children_share_and_copy_on_write():
    h = Harness(num_blocks=32, block_size=4, max_num_batched_tokens=64)
    h.add(parallel_request("p", 10, 5, n=4, seed=7))
    s1 = h.step()
    assert scheduled(s1) == {"p": 9}  # all of the prompt but its last token
    parent_blocks = list(s1.new_requests[0].block_ids)
    assert parent_blocks == [0, 1, 2]
    assert h.sched.forks.num_forks == 4 and h.sched.get_request("p") is None
    s2 = h.step()
    assert list(s2.finished_request_ids) == ["p"]
    assert scheduled(s2) == {f"p/{i}": 1 for i in range(4)}
    news = {r.request_id: r for r in s2.new_requests}
    assert sorted(news) == [f"p/{i}" for i in range(4)]
    assert [news[f"p/{i}"].sampling.seed for i in range(4)] == [7, 8, 9, 10]
    assert all(r.num_computed_tokens == 9 and list(r.token_ids)[:10] == list(r.token_ids) for r in news.values())
    # Block 2 holds token 8 (1 of 4 slots): 3 children copy it, the last keeps it.
    copies = [(c.src, c.dst) for c in s2.blocks_to_copy]
    assert copies == [(2, 3), (2, 4), (2, 5)]
    assert [list(news[f"p/{i}"].block_ids) for i in range(4)] == [[0, 1, 3], [0, 1, 4], [0, 1, 5], [0, 1, 2]]
    assert h.worker.num_copies == 3 and h.sched.forks.num_cow_copies == 3
    h.run()
    outs = h.outputs()
    single = reference_outputs(make_request("p", 10, 5, 0, seed=7))["p"]
    assert outs == {f"p/{i}": single for i in range(4)}  # the fake "model" ignores seeds


def test_parallel_requests_use_fewer_blocks_than_separate_ones():
    def peak(*reqs):
        h = Harness(num_blocks=64, block_size=4, max_num_batched_tokens=256, enable_prefix_caching=False)
        h.add(*reqs)
        most = 0
        while h.sched.has_work():
            h.step()
            most = max(most, h.sched.kv.num_blocks - h.sched.kv.num_free_blocks)
        return most, h.outputs()

    shared, outs = peak(parallel_request("p", 30, 6, n=4))
    separate, _ = peak(*(make_request(f"p{i}", 30, 6, float(i)) for i in range(4)))
    assert separate == 4 * 9 and shared == 7 + 4 * 2  # 7 shared prompt blocks, 2 per child
    assert len(outs) == 4


def test_prompt_of_one_token_gives_n_independent_requests():
    h = Harness(num_blocks=16, block_size=4)
    h.add(parallel_request("p", 1, 3, n=3))
    assert sorted(r.request_id for r in h.sched.queues.waiting) == ["p/0", "p/1", "p/2"]
    h.run()
    assert sorted(h.finished) == ["p/0", "p/1", "p/2"]


def test_abort_parent_id_aborts_children_before_and_after_the_fork():
    h = Harness(num_blocks=32, block_size=4)
    h.add(parallel_request("p", 10, 20, n=3))
    assert h.sched.abort_request("p")  # before: the parent itself
    h.sched.check_integrity()
    h.add(parallel_request("q", 10, 20, n=3))
    h.step()
    h.step()
    assert h.sched.has_children("q")
    assert h.sched.abort_request("q")
    h.sched.check_integrity()
    assert not h.sched.has_work() and not h.sched.has_children("q")
    step = h.step()
    assert step is None or not scheduled(step)
    assert h.sched.kv.num_free_blocks == 32


def test_abort_of_a_child_id_aborts_that_child_alone():
    h = Harness(num_blocks=32, block_size=4)
    h.add(parallel_request("p", 10, 20, n=3))
    assert not h.sched.abort_request("p/1")  # not forked yet: no such child, nothing happens
    h.step()
    h.step()
    assert h.sched.abort_request("p/1")
    h.sched.check_integrity()
    assert h.sched.has_children("p") and h.sched.get_request("p/1") is None
    h.run()
    assert sorted(h.finished) == ["p/0", "p/2"]
    assert h.sched.kv.num_free_blocks == 32 and h.sched.queues.num_aborted == 1


def test_children_seeds_wrap_into_int64_and_ids_follow_proto_parallel():
    from proto.parallel import child_request_id, child_seed

    h = Harness(num_blocks=32, block_size=4)
    h.add(parallel_request("p", 10, 3, n=3, seed=2**63 - 2))
    h.step()
    news = {r.request_id: r.sampling.seed for r in h.step().new_requests}
    assert news == {child_request_id("p", i): child_seed(2**63 - 2, i) for i in range(3)}
    assert news["p/2"] == -(2**63)  # int64's next value after 2**63 - 1


def test_a_request_id_naming_a_sequence_is_refused():
    h = Harness(num_blocks=32, block_size=4)
    error = h.sched.add_request(make_request("a/1", 5, 3, 0.0))
    assert error.finish_reason == "error" and "must not contain" in error.error


def test_n_counts_against_max_num_seqs():
    h = Harness(num_blocks=64, block_size=4, max_num_seqs=4)
    h.add(parallel_request("p", 6, 3, n=3), make_request("a", 5, 3, arrival=1),
          make_request("b", 5, 3, arrival=2))
    s1 = h.step()
    assert set(scheduled(s1)) == {"p", "a"}  # 3 + 1 sequences: b waits
    h.run()
    assert len(h.finished) == 5
    bad = parallel_request("x", 6, 3, n=5)
    assert h.sched.add_request(bad).finish_reason == "error"


@pytest.mark.parametrize("mode,num_cpu_blocks", [("recompute", 0), ("swap", 4), ("swap", 64)])
def test_children_under_preemption_finish_with_reference_outputs(mode, num_cpu_blocks):
    h = Harness(num_blocks=14, block_size=4, max_num_batched_tokens=16, num_cpu_blocks=num_cpu_blocks,
                preemption_mode=mode)
    reqs = [parallel_request("p", 11, 12, n=3), make_request("a", 7, 14, arrival=1),
            parallel_request("q", 6, 9, n=2, arrival=2)]
    h.add(*reqs)
    h.run()
    assert h.sched.preemptor.num_preemptions >= 1 and h.worker.num_copies >= 1
    ref = reference_outputs(make_request("p", 11, 12, 0), make_request("a", 7, 14, 1),
                            make_request("q", 6, 9, 2))
    expected = {"a": ref["a"], **{f"p/{i}": ref["p"] for i in range(3)},
                **{f"q/{i}": ref["q"] for i in range(2)}}
    assert h.outputs() == expected


# -- the real model ---------------------------------------------------------------------

def test_engine_n4_greedy_equals_transformers_and_shares_blocks(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from compose.engine import EngineConfig, InProcessEngine
    from scheduler_svc.policy.config import SchedulerConfig
    from tests.support.engine_helpers import Collector, run_engine
    from worker_svc.config import RunnerConfig

    prompt, max_tokens = [(13 * i + 5) % 800 + 3 for i in range(45)], 12
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def engine():
        return InProcessEngine(EngineConfig(
            runner=RunnerConfig(model=str(tiny_model_dir), num_blocks=64, block_size=16),
            batching=SchedulerConfig(enable_prefix_caching=False)), sink)

    sink = Collector(4)
    e = engine()
    shared = run_engine(e, sink, [NewRequest("p", prompt, params, "c", time.time(), n=4)])
    outputs = {rid: [t[k] for k in sorted(t)] for rid, t in sink.tokens.items()}
    assert sorted(outputs) == [f"p/{i}" for i in range(4)]
    assert e.scheduler.forks.num_cow_copies == 3 and e.scheduler.kv.num_free_blocks == 64

    sink = Collector(4)
    separate = run_engine(engine(), sink, [NewRequest(f"s{i}", prompt, params, "c", time.time() + i)
                                           for i in range(4)])
    # 45 prompt + 12 outputs - 1 = 56 tokens of K/V = 4 blocks of 16 per sequence:
    # apart 16 blocks; shared: the 2 full prompt blocks once + 2 own per child = 10.
    assert separate == 16 and shared == 10, (shared, separate)

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    expected = out[0, len(prompt):].tolist()
    assert all(got == expected for got in outputs.values()), outputs


def test_engine_n_seeded_children_get_their_own_streams(tiny_model_dir):
    from compose.engine import EngineConfig, InProcessEngine
    from tests.support.engine_helpers import Collector, run_engine
    from worker_svc.config import RunnerConfig

    prompt = [(7 * i + 2) % 800 + 3 for i in range(20)]
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=123, ignore_eos=True)

    def outputs(reqs):
        sink = Collector(len(reqs))
        e = InProcessEngine(EngineConfig(runner=RunnerConfig(model=str(tiny_model_dir), num_blocks=64)), sink)
        run_engine(e, sink, reqs)
        return {rid: [t[k] for k in sorted(t)] for rid, t in sink.tokens.items()}

    forked = outputs([NewRequest("p", prompt, params, "c", time.time(), n=3)])
    # Child i samples as a lone request with seed 123 + i would.
    for i in range(3):
        alone = outputs([NewRequest("x", prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=123 + i,
                                                                 ignore_eos=True), "c", time.time())])
        assert forked[f"p/{i}"] == alone["x"], i
    assert len({tuple(v) for v in forked.values()}) > 1
