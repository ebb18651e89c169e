"""The scheduler on a worker whose model slides a window over every layer: blocks behind
each request's window go back to the pool as it advances, so long generations that would
not fit in the pool together run without preemption; with preemption (recompute or swap),
parallel sampling, prefix caching and steps planned ahead, outputs are those of a run with
room for everything, and the fake worker checks every step reads intact K/V for its
window (tests/support/fake_worker.py)."""

import pytest
from tests.support.scheduler_harness import Harness, make_request, reference_outputs

W, BS = 8, 4


def long_requests(n: int = 6, max_tokens: int = 60):
    return [make_request(f"r{i}", 5 + 3 * i, max_tokens, arrival=float(i)) for i in range(n)]


def test_long_generations_fit_together_once_blocks_behind_the_window_go_back():
    """Six requests of up to 80 tokens need 6 x 20 = 120 blocks without a window; the pool
    has 40. With the window each decoding request holds at most W / BS + 2 blocks, so none
    is preempted."""
    reqs = long_requests()
    h = Harness(num_blocks=40, block_size=BS, group_windows=(W,), max_num_batched_tokens=64)
    h.add(*reqs)
    peak = 0
    while h.sched.has_work() or h.in_flight:
        h.step()
        peak = max(peak, h.sched.kv.num_blocks - h.sched.kv.num_free_blocks)
        for req in h.sched.queues.running:  # decoding (a prefill holds its chunk until the next step)
            if req.num_computed_tokens > req.num_prompt_tokens:
                assert h.sched.kv.num_blocks_held(req.request_id) <= W // BS + 2
    h.assert_done()
    assert h.sched.preemptor.num_preemptions == 0
    assert peak <= 6 * (W // BS + 2)
    assert h.outputs() == reference_outputs(*reqs, group_windows=(W,))

    without = Harness(num_blocks=40, block_size=BS, max_num_batched_tokens=64)
    without.add(*reqs)
    without.run()
    assert without.sched.preemptor.num_preemptions > 0
    assert without.outputs() == h.outputs()


@pytest.mark.parametrize("pipelined", [False, True], ids=["lockstep", "ahead"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("caching", [True, False], ids=["prefix-cache", "no-cache"])
@pytest.mark.parametrize("windows", [(W,), (None, W, W)], ids=["window", "hybrid"])
def test_preemption_forks_and_prefix_hits_under_a_window(pipelined, mode, caching, windows):
    """Every layer sliding (one group, Mistral), or a global and two sliding KV cache
    groups (Gemma 3's kinds): the pool is small enough to preempt either way."""
    reqs = [*long_requests(5, 40),
            make_request("shared-a", 30, 20, arrival=5.0),
            make_request("shared-b", 30, 20, arrival=6.0),  # the same prompt
            make_request("fork", 14, 16, arrival=7.0, seed=3)]
    reqs[-1] = type(reqs[-1])(**{**{f: getattr(reqs[-1], f) for f in reqs[-1].__struct_fields__}, "n": 3})
    scale = 1 if len(windows) == 1 else 2  # the hybrid's global group holds every block
    h = Harness(num_blocks=20 * scale, block_size=BS, group_windows=windows, max_num_batched_tokens=24,
                pipelined=pipelined, preemption_mode=mode,
                num_cpu_blocks=12 * scale if mode == "swap" else 0, enable_prefix_caching=caching)
    h.add(*reqs)
    h.run()
    assert h.sched.preemptor.num_preemptions > 0
    if mode == "swap":
        assert h.sched.preemptor.num_swapped_out > 0
    assert h.outputs() == reference_outputs(*reqs, group_windows=windows)


def test_a_prompt_whose_blocks_went_behind_the_window_is_still_found_cached():
    """The blocks a request gave back were offered to the prefix cache first, so a later
    request with the same prompt hits all of it (up to its last token)."""
    a = make_request("a-first", 30, 24, arrival=0.0)
    h = Harness(num_blocks=64, block_size=BS, group_windows=(W,), max_num_batched_tokens=64)
    h.add(a)
    h.run()
    assert h.sched.kv.num_blocks_held("a-first") == 0
    b = make_request("a-again", 30, 8, arrival=1.0)
    assert b.prompt_token_ids == a.prompt_token_ids
    h.add(b)
    h.run()
    assert h.sched.planner.prefix_cache_hits == (30 - 1) // BS * BS
    assert h.outputs()["a-again"] == reference_outputs(b, group_windows=(W,))["a-again"]
