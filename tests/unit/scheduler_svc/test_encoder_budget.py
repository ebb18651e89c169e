"""Encoder work in the scheduler (scheduler_svc/policy/encoder_budget.py): the mirror of a worker's
encoder cache replays its LRU; with --encoder-budget N a step makes its worker encode at
most N images it does not hold -- a chunk ends before the image it cannot afford, an image
the worker holds costs nothing, nothing starves, outputs are unchanged -- and routing sends
a request to the worker holding its frames when no prefix hit tells them apart."""

from tests.support.scheduler_harness import Harness, reference_outputs, scheduled
from tests.unit.scheduler_svc.test_scheduler_images import BS, T, image_request

from scheduler_svc.policy.encoder_budget import EncoderCacheMirror
from scheduler_svc.policy.routing import pick_worker




def test_the_mirror_replays_a_least_recently_used_cache():
    mirror = EncoderCacheMirror(2)
    mirror.touch(["a", "b"])
    mirror.touch(["a"])  # b is now the oldest
    mirror.touch(["c"])
    assert [mirror.holds(h) for h in "abc"] == [True, False, True]
    off = EncoderCacheMirror(0)
    off.touch(["a"])
    assert not off.holds("a") and len(off) == 0


def test_a_step_encodes_at_most_the_budget_and_chunks_end_before_the_next_image():
    req = image_request("a", [T[:2], ("A", 4), ("B", 4), ("C", 4), T[:2]])  # A [2,6) B [6,10) C [10,14)
    h = Harness(block_size=BS, max_num_batched_tokens=100, encoder_budget=1, encoder_cache_items=8)
    h.add(req)
    chunks = [scheduled(h.step())["a"] for _ in range(3)]
    assert chunks == [6, 4, 6]  # text + A; B; C + text: one new image a step
    h.run()
    assert h.outputs() == reference_outputs(req)


def test_an_image_the_worker_holds_costs_nothing():
    h = Harness(num_blocks=64, block_size=BS, max_num_batched_tokens=100, encoder_budget=1,
                encoder_cache_items=8, enable_prefix_caching=False)
    h.add(image_request("a", [T[:2], ("A", 4), T[:2]]))
    h.run()
    assert h.sched.planner.encoder_cache.holds("A")
    second = image_request("b", [T[:3], ("A", 4), ("B", 4), T[:2]])
    h.add(second)
    assert scheduled(h.step())["b"] == 13  # A is held: only B counts, the whole prompt fits
    h.run()
    assert h.outputs()["b"] == reference_outputs(second)["b"]


def test_requests_share_the_budget_and_none_starves():
    reqs = [image_request(r, [T[:2], (r.upper(), 4), T[:2]], arrival=float(i)) for i, r in enumerate("abc")]
    h = Harness(block_size=BS, max_num_batched_tokens=100, encoder_budget=1, encoder_cache_items=8)
    h.add(*reqs)
    assert scheduled(h.step()) == {"a": 8, "b": 2, "c": 2}  # a's image; b's and c's text before theirs
    second = scheduled(h.step())
    assert second["b"] == 6 and "c" not in second  # b's image takes the budget: c's waits a step
    assert scheduled(h.step())["c"] == 6
    h.run()
    assert h.outputs() == reference_outputs(*reqs)


def test_without_a_budget_every_image_fits_the_token_budget():
    req = image_request("a", [T[:2], ("A", 4), ("B", 4), ("C", 4), T[:2]])
    h = Harness(block_size=BS, max_num_batched_tokens=100, encoder_cache_items=8)
    h.add(req)
    assert scheduled(h.step())["a"] == 16


def test_routing_prefers_the_worker_holding_the_frames_when_no_prefix_hit_differs():
    # a camera's window moved on by one frame: the prompt starts with a frame nobody cached
    # as a prefix, and one worker has the other frames' embeddings
    holder, other = (Harness(num_blocks=64, block_size=BS, encoder_cache_items=8) for _ in range(2))
    holder.add(image_request("q1", [T[:1], ("F1", 4), ("F2", 4), ("F3", 4), T[:2]]))
    holder.run()
    other.add(image_request("x", [T[:1], ("G1", 4), T[:2]]))
    other.run()
    nxt = image_request("q2", [T[:1], ("F2", 4), ("F3", 4), ("F4", 4), T[:2]])
    assert holder.sched.cached_prefix_tokens(nxt.prompt_token_ids, nxt.mm_inputs) == 0
    assert holder.sched.held_image_tokens(nxt.mm_inputs) == 8 and other.sched.held_image_tokens(nxt.mm_inputs) == 0
    assert pick_worker([other, holder], nxt.prompt_token_ids, lambda h: h.sched, mm_inputs=nxt.mm_inputs) is holder


def test_media_the_encoder_service_published_cost_no_budget():
    req = image_request("a", [T[:2], ("A", 4), ("B", 4), ("C", 4), T[:2]])
    h = Harness(block_size=BS, max_num_batched_tokens=100, encoder_budget=1, encoder_cache_items=8)
    h.sched.note_published(["B", "C"])  # the worker reads them: only A is encoded
    h.add(req)
    assert scheduled(h.step())["a"] == 16


def test_auto_is_two_images_a_step_on_a_cpu_worker_and_no_bound_on_a_gpu():
    from proto import worker_pb2
    from scheduler_svc.policy.batching import BatchScheduler
    from scheduler_svc.policy.config import SchedulerConfig
    from scheduler_svc.policy.encoder_budget import resolve_encoder_budget

    assert [resolve_encoder_budget(None, d) for d in ("cpu", "", "cuda:0")] == [2, 2, 0]
    assert resolve_encoder_budget(5, "cuda:0") == 5 and resolve_encoder_budget(0, "cpu") == 0
    info = worker_pb2.WorkerInfo(num_blocks=8, block_size=4, max_model_len=64, device="cpu", encoder_cache_items=3)
    cpu = BatchScheduler.for_worker(SchedulerConfig(), info)
    info.device = "cuda:0"
    gpu = BatchScheduler.for_worker(SchedulerConfig(), info)
    assert (cpu.config.encoder_budget, gpu.config.encoder_budget) == (2, 0)
    assert cpu.planner.encoder_cache.capacity_items == 3


def test_the_flag_takes_auto_or_a_count():
    import argparse

    import pytest

    from compose.flags import _budget

    assert (_budget("auto"), _budget("0"), _budget("3")) == (None, 0, 3)
    with pytest.raises(argparse.ArgumentTypeError):
        _budget("-1")
