"""The scheduler's side of image requests (Gemma 3 vision): an image is never split across
prefill chunks, one that can never fit is refused, nothing starves, prefix caching keys
blocks by the images they hold (and routing with them), and every NewRequestData of an
image request carries its images -- new, re-sent after a preemption, migrated, forked.

The fake worker (tests/support/fake_worker.py) fails any step whose chunk starts or ends inside an
image, and mixes each image's content hash into the K/V and the sampled token, so a hit
serving another image's K/V, or a request re-sent without its images, gives wrong outputs
(compared with reference_outputs); the harness checks integrity after every step."""

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.block_hash import span_block_keys
from proto import worker_pb2
from proto.messages import MultiModalInput, NewRequest, SamplingParams
from proto.pan_and_scan import CropBox
from tests.support.scheduler_harness import Harness, reference_outputs, scheduled
from scheduler_svc.policy.image_ranges import block_extra_keys, hit_blocks
from scheduler_svc.policy.routing import pick_worker

IMG = 99  # the placeholder token of every image's soft tokens (text tokens stay below it)
BS = 4


def image_request(rid: str, parts: list, max_tokens: int = 3, arrival: float = 0.0,
                  n: int = 1, priority: int = 0) -> NewRequest:
    """A prompt from `parts`: a list of ints is text, a (content hash, length) tuple an
    image of that many soft tokens."""
    prompt: list[int] = []
    mm: list[MultiModalInput] = []
    for part in parts:
        if isinstance(part, tuple):
            content_hash, length = part
            mm.append(MultiModalInput(content_hash, len(prompt), length))
            prompt += [IMG] * length
        else:
            prompt += part
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return NewRequest(rid, prompt, params, "out:gw", arrival, priority, n=n, mm_inputs=tuple(mm))


def pb_images(req: NewRequest) -> list[worker_pb2.MultiModalInput]:
    return [worker_pb2.MultiModalInput(content_hash=m.content_hash, offset=m.offset, length=m.length)
            for m in req.mm_inputs]


def sent_in_full(h: Harness, rid: str) -> list[worker_pb2.NewRequestData]:
    return [r for s in h.steps for r in s.new_requests if r.request_id == rid]


T = list(range(10, 20))  # text tokens


# -- chunking ------------------------------------------------------------------------------


def test_chunks_end_at_an_image_start_and_take_each_image_whole():
    req = image_request("a", [T[:6], ("A", 6), [1], ("B", 7), T[:10]])  # images [6, 12), [13, 20)
    h = Harness(block_size=BS, max_num_batched_tokens=8)
    h.add(req)
    (new,) = h.step().new_requests
    assert list(new.mm_inputs) == pb_images(req)
    chunks = [scheduled(h.steps[0])["a"]] + [scheduled(h.step())["a"] for _ in range(4)]
    # 0..8 would end inside A: ends at 6; 6..14 inside B: ends at 13; then text (30 in all)
    assert chunks == [6, 7, 8, 8, 1] and h.sched.get_request("a").num_output_tokens == 1
    h.run()
    assert h.outputs() == reference_outputs(req)


def test_the_prefill_threshold_never_splits_an_image():
    req = image_request("a", [T[:2], ("A", 6), T[:4]])  # image [2, 8)
    h = Harness(block_size=BS, max_num_batched_tokens=100, long_prefill_token_threshold=4)
    h.add(req)
    assert [scheduled(h.step())["a"] for _ in range(3)] == [2, 6, 4]
    h.run()
    assert h.outputs() == reference_outputs(req)


def test_an_image_that_does_not_fit_the_budget_left_waits_without_starving():
    # a decodes (1 token a step); b's image [3, 11) needs all 8 tokens of the budget.
    a = image_request("a", [T[:4]], max_tokens=6)
    b = image_request("b", [T[:3], ("A", 8), T[:2]], arrival=1)
    c = image_request("c", [[1, 2, 3] * 2], arrival=2)
    h = Harness(block_size=BS, max_num_batched_tokens=8)
    h.add(a)
    h.step()
    h.add(b)
    assert scheduled(h.step()) == {"a": 1, "b": 3}  # b's text up to its image
    h.add(c)
    # b (running) is passed over: its image does not fit the 7 tokens left; c runs.
    assert scheduled(h.step()) == {"a": 1, "c": 6}
    h.run()
    rest = [scheduled(s) for s in h.steps[4:]]
    first_b = next(i for i, s in enumerate(rest) if "b" in s)
    assert rest[first_b] == {"b": 8} and h.finished["a"].num_output_tokens == 6  # after a: the whole budget
    assert h.outputs() == reference_outputs(a, b, c)


def test_a_waiting_image_at_its_start_holds_the_queue_until_it_fits():
    a = image_request("a", [T[:4]], max_tokens=4)
    b = image_request("b", [("A", 8), T[:2]], arrival=1)  # its image starts the prompt
    c = image_request("c", [T[:3]], arrival=2)
    h = Harness(block_size=BS, max_num_batched_tokens=8)
    h.add(a)
    h.step()
    h.add(b, c)
    assert scheduled(h.step()) == {"a": 1}  # b does not fit; c does not overtake it
    h.run()
    first_b = next(i for i, s in enumerate(h.steps) if "b" in scheduled(s))
    assert scheduled(h.steps[first_b])["b"] == 8 and "a" not in scheduled(h.steps[first_b])
    assert h.outputs() == reference_outputs(a, b, c)


def test_an_image_longer_than_the_budget_is_refused_at_once():
    h = Harness(block_size=BS, max_num_batched_tokens=8)
    event = h.sched.add_request(image_request("x", [T[:2], ("A", 6), ("B", 9), T[:1]]))
    assert event.finish_reason == "error" and event.rejected
    assert event.error == ("request x: image 1 has 9 soft tokens, more than max_num_batched_tokens 8 "
                           "(--max-num-batched-tokens): an image is computed in one step, never "
                           "split across prefill chunks")
    bad = NewRequest("y", T[:6], SamplingParams(max_tokens=2), "out:gw", 0.0,
                     mm_inputs=(MultiModalInput("A", 2, 3), MultiModalInput("B", 4, 2)))
    assert "image 1 (offset 4, length 2)" in h.sched.add_request(bad).error  # overlapping
    past = NewRequest("z", T[:6], SamplingParams(max_tokens=2), "out:gw", 0.0,
                      mm_inputs=(MultiModalInput("A", 4, 3),))
    assert "of the 6 prompt tokens" in h.sched.add_request(past).error
    assert not h.sched.has_work()


# -- prefix caching ------------------------------------------------------------------------


def test_block_extra_keys_are_the_images_each_block_holds():
    mm = image_request("a", [T[:3], ("A", 6), ("B", 2), T[:8]]).mm_inputs  # [3, 9), [9, 11)
    assert block_extra_keys(mm, 4) == {0: (("A", 3),), 1: (("A", 3),), 2: (("A", 3), ("B", 9))}
    assert span_block_keys([(0, 4, "x"), (4, 5, "y")], 4) == {0: ("x",), 1: ("y",)}
    assert hit_blocks(mm, 3, 4) == 3  # ends at 12, after both images
    assert hit_blocks(mm, 2, 4) == 0  # 8 is inside A: back to 0 (A starts in block 0)
    adjacent = image_request("b", [T[:1], ("A", 6), ("B", 6)]).mm_inputs  # [1, 7), [7, 13)
    assert hit_blocks(adjacent, 3, 4) == 0  # 12 inside B -> 4, inside A -> 0


def _run_then(first: NewRequest, second: NewRequest) -> tuple[Harness, worker_pb2.NewRequestData]:
    h = Harness(num_blocks=32, block_size=BS)
    h.add(first)
    h.run()
    h.add(second)
    (new,) = h.step().new_requests
    h.run()
    assert h.outputs()[second.request_id] == reference_outputs(second)[second.request_id]
    return h, new


def test_a_repeated_image_hits_and_a_different_one_behind_the_same_tokens_does_not():
    parts = [T[:8], ("A", 8), T[:4]]  # image [8, 16) of a 20-token prompt
    h, same = _run_then(image_request("a", parts), image_request("b", parts, arrival=1))
    assert same.num_computed_tokens == 16  # 4 blocks, the image among them
    other = [T[:8], ("B", 8), T[:4]]  # the same tokens, another image
    h, diff = _run_then(image_request("a", parts), image_request("b", other, arrival=1))
    assert diff.num_computed_tokens == 8  # the shared text before the image hits, no more
    again = image_request("c", parts)
    assert h.sched.cached_prefix_tokens(again.prompt_token_ids, again.mm_inputs) == 16
    assert h.sched.cached_prefix_tokens(again.prompt_token_ids) == 8  # without the image: text keys


def test_another_crop_of_the_same_image_behind_the_same_tokens_does_not_hit():
    """Pan-and-scan: the crops of one image cut by other settings sit behind the same tokens
    (the same count of crops: the same text) but are other pixels; the fake worker mixes each
    piece's embedding key into its K/V, so a hit on them would give wrong outputs."""
    def pieces(rid: str, box: CropBox, arrival: float = 0.0) -> NewRequest:
        req = image_request(rid, [T[:8], ("A", 4), T[:4], ("A", 4), T[:4]], arrival=arrival)
        whole, crop = req.mm_inputs
        return msgspec.structs.replace(req, mm_inputs=(whole, msgspec.structs.replace(crop, crop=box)))

    h, same = _run_then(pieces("a", CropBox(0, 0, 20, 50)), pieces("b", CropBox(0, 0, 20, 50), arrival=1))
    assert same.num_computed_tokens == 20  # the crop hits
    h, other = _run_then(pieces("a", CropBox(0, 0, 20, 50)), pieces("b", CropBox(0, 0, 20, 34), arrival=1))
    assert other.num_computed_tokens == 16  # the text and the whole image hit, not the other crop
    assert [m.HasField("crop") for m in other.mm_inputs] == [False, True]
    assert other.mm_inputs[1].crop.width == 34


def test_a_shared_text_prefix_hits_before_different_images():
    system = T[:10] + T[:2]  # three blocks of "system prompt"
    h, new = _run_then(image_request("a", [system, ("A", 5), T[:3]]),
                       image_request("b", [system, ("B", 7), T[:1]], arrival=1))
    assert new.num_computed_tokens == 12


def test_a_hit_ending_inside_an_image_is_cut_back_to_a_block_boundary():
    # a: image [6, 14) then text; b: the same prompt up to the image's end: its hit may take
    # (14 - 1) // 4 = 3 blocks, ending at 12 inside the image: cut back to 4.
    a = image_request("a", [T[:6], ("A", 8), T[:6]])
    b = image_request("b", [T[:6], ("A", 8)], arrival=1)
    h, new = _run_then(a, b)
    assert new.num_computed_tokens == 4
    assert h.sched.cached_prefix_tokens(b.prompt_token_ids, b.mm_inputs) == 4


def test_routing_prefers_the_worker_that_holds_the_image():
    parts = [T[:8], ("A", 8), T[:4]]
    with_a, with_b = Harness(num_blocks=32, block_size=BS), Harness(num_blocks=32, block_size=BS)
    with_a.add(image_request("a", parts))
    with_a.run()
    with_b.add(image_request("b", [T[:8], ("B", 8), T[:4]]))
    with_b.run()
    req = image_request("c", parts)
    assert with_a.sched.cached_prefix_tokens(req.prompt_token_ids, req.mm_inputs) == 16
    assert with_b.sched.cached_prefix_tokens(req.prompt_token_ids, req.mm_inputs) == 8
    both = [with_b, with_a]
    assert pick_worker(both, req.prompt_token_ids, lambda h: h.sched, mm_inputs=req.mm_inputs) is with_a


# -- requests sent again: preempted, migrated, forked ---------------------------------------


def test_a_preempted_request_is_sent_again_with_its_images():
    # 6 blocks of 4: b (the later arrival) is preempted when a needs a 4th block.
    a = image_request("a", [T[:2], ("A", 4), T[:2]], max_tokens=8)
    b = image_request("b", [T[:1], ("B", 5), T[:2]], max_tokens=8, arrival=1)
    h = Harness(num_blocks=6, block_size=BS)
    h.add(a, b)
    h.run()
    assert h.finished["b"].num_preemptions == 1
    sends = sent_in_full(h, "b")
    assert len(sends) == 2 and all(list(s.mm_inputs) == pb_images(b) for s in sends)
    assert h.outputs() == reference_outputs(a, b)


def test_swap_preemption_with_images():
    a = image_request("a", [T[:2], ("A", 4), T[:2]], max_tokens=8)
    b = image_request("b", [T[:1], ("B", 5), T[:2]], max_tokens=8, arrival=1)
    h = Harness(num_blocks=6, block_size=BS, num_cpu_blocks=8, preemption_mode="swap")
    h.add(a, b)
    h.run()
    assert h.sched.preemptor.num_swapped_out == 1 and len(sent_in_full(h, "b")) == 1
    assert h.outputs() == reference_outputs(a, b)


def test_a_migrated_request_is_sent_with_its_images_on_the_new_worker():
    reqs = [image_request("a", [T[:3], ("A", 6), T[:2]], max_tokens=6),
            image_request("b", [("B", 4), T[:3]], max_tokens=6, arrival=1)]
    h1 = Harness(block_size=BS, max_num_batched_tokens=8)
    h1.add(*reqs)
    for _ in range(3):
        h1.step()
    states = h1.sched.drain()
    h1.assert_done()
    h2 = Harness(num_blocks=16, block_size=8, max_num_batched_tokens=16)  # another block size
    for state in states:
        assert h2.sched.add_state(state) is None
    h2.run()
    for req in reqs:
        assert all(list(s.mm_inputs) == pb_images(req) for s in sent_in_full(h2, req.request_id))
    assert h2.outputs() == reference_outputs(*reqs)


def test_forked_children_carry_the_parents_images():
    p = image_request("p", [T[:2], ("A", 5), T[:3]], max_tokens=4, n=3)
    h = Harness(num_blocks=32, block_size=BS)
    h.add(p)
    h.run()
    assert h.sched.forks.num_forks == 3
    for i in range(3):
        (sent,) = sent_in_full(h, f"p/{i}")
        assert list(sent.mm_inputs) == pb_images(p) and sent.num_computed_tokens == 9
    single = reference_outputs(image_request("p", [T[:2], ("A", 5), T[:3]], max_tokens=4))["p"]
    assert h.outputs() == {f"p/{i}": single for i in range(3)}


def test_an_image_holding_the_fork_point_gives_n_independent_requests():
    p = image_request("p", [T[:3], ("A", 5)], max_tokens=3, n=2)  # the last prompt token is the image's
    h = Harness(num_blocks=32, block_size=BS)
    h.add(p)
    assert sorted(r.request_id for r in h.sched.queues.waiting) == ["p/0", "p/1"]
    h.run()
    single = reference_outputs(image_request("p", [T[:3], ("A", 5)], max_tokens=3))["p"]
    assert h.outputs() == {"p/0": single, "p/1": single}


# -- random workloads ------------------------------------------------------------------------

_text = st.lists(st.integers(0, 1), min_size=1, max_size=4)
_image = st.tuples(st.sampled_from("AB"), st.integers(1, 8))  # two images: hits and misses
_parts = st.tuples(st.sampled_from([[], [T[:4]], [T[:4], ("A", 5)]]),  # a shared start, or not
                   st.lists(st.one_of(_text, _image), min_size=1, max_size=3))
_request = st.tuples(_parts, st.integers(1, 4), st.sampled_from([1, 1, 2]), st.integers(0, 3))


@settings(max_examples=100, deadline=None)
@given(requests=st.lists(_request, min_size=1, max_size=8), budget=st.integers(8, 20),
       threshold=st.sampled_from([0, 3, 5]), num_blocks=st.integers(9, 13),
       num_cpu_blocks=st.sampled_from([0, 16]), pipelined=st.booleans(),
       windows=st.sampled_from([(None,), (None,), (6,), (None, 6)]),
       encoder=st.sampled_from([(0, 0), (1, 0), (1, 1), (2, 4)]))
def test_random_image_workloads_never_split_an_image_and_match_the_reference(
        requests, budget, threshold, num_blocks, num_cpu_blocks, pipelined, windows, encoder):
    """Random prompts of text and images (at most 33 tokens + 4 outputs = 9 blocks), some
    starting alike, budgets, thresholds, pools small enough to preempt (by recompute or
    swap), n of 1 or 2, arrivals spread over steps, planned ahead or not, a sliding window,
    a global and a sliding KV cache group (Gemma 3's kinds; the pool scaled by the groups),
    or neither, an encoder budget (with a mirrored encoder cache) or none: every step keeps
    images whole (the fake checks), integrity holds after each, everything finishes (no
    starvation: Harness.run fails without progress) with the outputs of a run that never chunks
    or caches."""
    reqs = [(image_request(f"r{i}", start + parts, max_tokens, float(i), n=n), delay)
            for i, ((start, parts), max_tokens, n, delay) in enumerate(requests)]
    h = Harness(num_blocks=num_blocks * len(windows), block_size=BS, max_num_batched_tokens=budget,
                long_prefill_token_threshold=threshold, num_cpu_blocks=num_cpu_blocks,
                preemption_mode="swap" if num_cpu_blocks else "recompute", pipelined=pipelined,
                group_windows=windows, encoder_budget=encoder[0], encoder_cache_items=encoder[1])
    for req, delay in reqs:
        h.add(req)
        for _ in range(delay):
            if h.sched.has_work():
                h.step()
    h.run()
    single = reference_outputs(*(NewRequest(r.request_id, r.prompt_token_ids, r.sampling, r.reply_channel,
                                            r.arrival_time, mm_inputs=r.mm_inputs) for r, _ in reqs),
                                group_windows=windows)
    expected = {rid if r.n == 1 else f"{rid}/{i}": out
                for (r, _), (rid, out) in zip(reqs, sorted(single.items(), key=lambda kv: int(kv[0][1:])))
                for i in range(r.n)}
    assert h.outputs() == expected


# -- a request the worker fails (its media could not be had) ---------------------------------


def test_a_request_failed_by_the_worker_finishes_with_error_in_any_step():
    """The worker answers NO_TOKEN_ID / "error" for a request whose image it could not fetch,
    even in a step that samples nothing for it (a first prefill chunk): the request finishes
    with "error", nothing is appended, its blocks are freed and none is offered to the prefix
    cache; the request beside it runs on."""
    from proto.messages import NO_TOKEN_ID

    h = Harness(block_size=BS, max_num_batched_tokens=8)
    bad = image_request("bad", [T[:2], ("GONE", 4), T[:9]])  # 15 tokens: chunks of 8 and 7
    h.add(bad, image_request("ok", [T[:3]], max_tokens=2, arrival=1.0))
    step = h.sched.schedule()
    assert step.num_scheduled_tokens["bad"] == 8  # a first chunk, image included: samples nothing
    result = h.worker.step(step)
    kept = [s for s in result.sampled if s.request_id != "bad"]
    del result.sampled[:]
    result.sampled.extend(kept)
    result.sampled.add(request_id="bad", token_id=NO_TOKEN_ID, finish_reason="error")
    finished = h.sched.update(step, result)
    assert [r.request_id for r in finished] == ["bad"] and finished[0].finish_reason == "error"
    assert finished[0].num_tokens == 15  # nothing appended
    h.sched.check_integrity()
    assert h.sched.kv.find_cached_prefix(bad.prompt_token_ids, [],
                                         block_extra_keys(bad.mm_inputs, BS)) == []
    while h.sched.has_work():
        step = h.sched.schedule()
        for req in h.sched.update(step, h.worker.step(step)):
            h.finished[req.request_id] = req
        h.sched.check_integrity()
    assert h.finished["ok"].finish_reason == "length"
