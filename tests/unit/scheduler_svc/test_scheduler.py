"""BatchScheduler policy against the fake worker: every step is checked by the fake,
check_integrity() runs after every schedule() and update(), and every scenario ends with
all blocks free."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proto import worker_pb2
from proto.messages import NewRequest, SamplingParams
from tests.support.scheduler_harness import Harness, make_request, reference_outputs, scheduled
from scheduler_svc.policy.request import RequestStatus, to_pb_sampling


def test_prefill_then_decode_exact_step_contents():
    h = Harness(block_size=4)
    h.add(make_request("a", 10, 3, arrival=0))
    s1 = h.step()
    assert s1.step_id == 1 and scheduled(s1) == {"a": 10}
    (new,) = s1.new_requests
    assert list(new.block_ids) == [0, 1, 2] and new.num_computed_tokens == 0
    assert new.num_prompt_tokens == 10 and len(new.token_ids) == 10
    assert new.sampling == to_pb_sampling(
        SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    s2 = h.step()  # position 10 still fits in 3 blocks
    assert s2.step_id == 2 and not s2.new_requests and scheduled(s2) == {"a": 1}
    (diff,) = s2.cached_requests
    assert list(diff.new_block_ids) == [] and diff.num_computed_tokens == 10
    s3 = h.step()
    assert h.finished["a"].finish_reason == "length" and len(h.finished["a"].output_token_ids) == 3
    assert list(s3.cached_requests[0].new_block_ids) == []
    h.assert_done()
    free_queue = [block.block_id for block in h.sched.kv.block_pool.free_queue]
    assert free_queue[-3:] == [2, 1, 0]  # a's blocks, its tail block to be evicted first
    h.add(make_request("b", 4, 1, arrival=1))
    s4 = h.step()
    assert list(s4.finished_request_ids) == ["a"]  # the worker forgets it now
    assert list(s4.new_requests[0].block_ids) == [3]  # never-used blocks go first
    h.assert_done()


def test_continuous_batching_new_request_joins_running_one():
    a, b = make_request("a", 8, 6, arrival=0), make_request("b", 5, 4, arrival=1)
    h = Harness()
    h.add(a)
    h.step()
    h.step()
    h.add(b)
    s3 = h.step()
    assert scheduled(s3) == {"a": 1, "b": 5}
    assert [r.request_id for r in s3.cached_requests] == ["a"]
    assert [r.request_id for r in s3.new_requests] == ["b"]
    h.run()
    assert h.outputs() == reference_outputs(a, b)


def test_chunked_prefill_under_small_budget():
    h = Harness(max_num_batched_tokens=8)
    a = make_request("a", 20, 3, arrival=0)
    h.add(a)
    chunks = [scheduled(h.step())["a"] for _ in range(3)]
    assert chunks == [8, 8, 4]
    assert h.sched.get_request("a").num_output_tokens == 1  # sampled only after the last chunk
    h.add(make_request("b", 20, 2, arrival=1))
    s4 = h.step()
    assert scheduled(s4) == {"a": 1, "b": 7}  # decode first, the prefill takes the rest
    h.run()
    assert h.outputs()["a"] == reference_outputs(a)["a"]


def test_long_prefill_token_threshold_caps_one_request():
    h = Harness(max_num_batched_tokens=100, long_prefill_token_threshold=5)
    h.add(make_request("a", 12, 2, arrival=0), make_request("b", 3, 2, arrival=1))
    assert scheduled(h.step()) == {"a": 5, "b": 3}
    assert scheduled(h.step()) == {"a": 5, "b": 1}
    assert scheduled(h.step()) == {"a": 2}
    h.run()


def test_max_num_seqs_limits_running_requests():
    h = Harness(max_num_seqs=2)
    h.add(make_request("a", 4, 2, arrival=0), make_request("b", 4, 4, arrival=1),
          make_request("c", 4, 2, arrival=2))
    assert sorted(scheduled(h.step())) == ["a", "b"]
    assert len(h.sched.queues.running) == 2 and len(h.sched.queues.waiting) == 1
    assert sorted(scheduled(h.step())) == ["a", "b"]  # a finishes here
    assert sorted(scheduled(h.step())) == ["b", "c"]
    h.run()


def test_preempts_latest_arrival_by_recompute_and_it_resumes_identically():
    # 6 blocks of 4: a and b (8-token prompts) fill the pool at their 9th token; at the
    # 13th a needs a 4th block and b, the later arrival, is preempted.
    a, b = make_request("a", 8, 8, arrival=0), make_request("b", 8, 8, arrival=1)
    h = Harness(num_blocks=6, block_size=4)
    c = make_request("c", 4, 2, arrival=2)  # would fit after the preemption, must not enter
    h.add(a, b)
    for _ in range(5):
        h.step()
    h.add(c)
    s6 = h.step()
    assert list(s6.finished_request_ids) == ["b"] and scheduled(s6) == {"a": 1}
    assert scheduled(h.step()) == {"a": 1}  # c does not overtake b at the head of the queue
    assert list(s6.cached_requests[0].new_block_ids) == [5]  # b's tail block, freed first
    b_state = h.sched.get_request("b")
    assert b_state.status is RequestStatus.WAITING and b_state.num_preemptions == 1
    assert b_state.num_computed_tokens == 0 and b_state.num_output_tokens == 5
    assert h.sched.queues.waiting == [b_state, h.sched.get_request("c")]
    h.run()
    sent_b = [(i, r) for i, s in enumerate(h.steps) for r in s.new_requests if r.request_id == "b"]
    step_index, new_b = sent_b[1]  # sent in full again when it resumes
    assert step_index == 8 and list(h.steps[8].finished_request_ids) == ["a"]
    assert list(new_b.token_ids) == list(b.prompt_token_ids) + b_state.output_token_ids[:5]
    # Its first two blocks were still cached (its third went to a): it resumes from them.
    assert new_b.num_prompt_tokens == 8 and list(new_b.block_ids) == [2, 3, 5, 4]
    assert new_b.num_computed_tokens == 8
    assert h.finished["a"].num_preemptions == 0 and h.sched.preemptor.num_preemptions == 1
    assert h.sched.steps.num_steps == len(h.steps)
    assert h.outputs() == reference_outputs(a, b, c)


def test_no_admission_in_a_step_that_preempted():
    a, b = make_request("a", 8, 8, arrival=0), make_request("b", 8, 8, arrival=1)
    c = make_request("c", 4, 2, arrival=2, priority=-1)  # heads the queue; fits once b leaves
    h = Harness(num_blocks=6, block_size=4)
    h.add(a, b)
    for _ in range(5):
        h.step()
    h.add(c)
    s6 = h.step()
    assert list(s6.finished_request_ids) == ["b"] and scheduled(s6) == {"a": 1}
    assert scheduled(h.step()) == {"a": 1, "c": 4}
    h.run()
    assert h.outputs() == reference_outputs(a, b, c)


def test_request_that_cannot_grow_preempts_itself_when_it_is_the_latest():
    # b (9-token prompt) crosses into a 4th block while a still fits: b is the victim.
    a, b = make_request("a", 8, 6, arrival=0), make_request("b", 9, 6, arrival=1)
    h = Harness(num_blocks=6, block_size=4)
    h.add(a, b)
    for _ in range(4):
        h.step()
    s5 = h.step()
    assert scheduled(s5) == {"a": 1} and list(s5.finished_request_ids) == ["b"]
    h.run()
    assert h.finished["b"].num_preemptions == 1
    assert h.outputs() == reference_outputs(a, b)


def test_priority_beats_arrival_when_choosing_the_victim():
    a = make_request("a", 8, 8, arrival=0, priority=1)
    b = make_request("b", 8, 8, arrival=1, priority=0)  # later, but more important
    h = Harness(num_blocks=6, block_size=4)
    h.add(a, b)
    s1 = h.step()
    assert [r.request_id for r in s1.new_requests] == ["b", "a"]
    for _ in range(4):
        h.step()
    assert list(h.step().finished_request_ids) == ["a"]
    h.run()
    assert h.finished["a"].num_preemptions == 1 and h.finished["b"].num_preemptions == 0
    assert h.outputs() == reference_outputs(a, b)


def test_abort_waiting_and_running_requests():
    h = Harness(max_num_seqs=1)
    h.add(make_request("a", 6, 50, arrival=0), make_request("b", 6, 5, arrival=1))
    h.step()
    assert h.sched.abort_request("b") is True  # waiting: just dropped
    assert h.sched.abort_request("b") is False
    assert len(h.sched.queues.waiting) == 0
    assert h.sched.abort_request("a") is True  # running: blocks freed at once
    assert h.sched.kv.num_free_blocks == h.sched.kv.num_blocks
    h.add(make_request("c", 3, 1, arrival=2))
    assert list(h.step().finished_request_ids) == ["a"]
    assert "b" not in {rid for s in h.steps for rid in scheduled(s)}
    h.run()


def test_abort_while_step_in_flight_ignores_its_token():
    h = Harness()
    h.add(make_request("a", 6, 50, arrival=0), make_request("b", 6, 3, arrival=1))
    h.step()
    step = h.sched.schedule()
    assert h.sched.abort_request("a")  # the worker is computing a's token right now
    result = h.worker.step(step)
    assert {s.request_id for s in result.sampled} == {"a", "b"}
    assert h.sched.update(step, result) == []
    h.sched.check_integrity()
    assert list(h.sched.schedule().finished_request_ids) == ["a"]


def test_impossible_requests_get_an_error_event_and_are_not_queued():
    h = Harness(num_blocks=4, block_size=4, max_model_len=64)
    too_long = h.sched.add_request(make_request("x", 60, 10, arrival=0))
    assert too_long.finish_reason == "error" and too_long.index == 0 and too_long.rejected
    assert "60 prompt + 10 max_tokens = 70 tokens" in too_long.error
    assert "max_model_len 64" in too_long.error
    too_big = h.sched.add_request(make_request("y", 10, 8, arrival=1))  # 17 tokens of K/V
    assert too_big.finish_reason == "error"
    assert "17 tokens of K/V = 5 blocks of 4" in too_big.error and "4 blocks" in too_big.error
    assert not h.sched.has_work()
    h.add(make_request("z", 10, 7, arrival=2))  # 16 tokens of K/V: exactly the whole pool
    h.run()
    assert h.finished["z"].num_output_tokens == 7


def test_duplicate_request_id_is_ignored():
    h = Harness()
    h.add(make_request("a", 4, 2, arrival=0))
    assert h.sched.add_request(make_request("a", 4, 2, arrival=0)) is None
    assert len(h.sched.queues.waiting) == 1
    h.run()


def test_worker_finish_reason_stop_is_trusted():
    h = Harness(vocab_size=1, eos_token_id=0)  # every token is the EOS
    a = make_request("a", 4, 10, arrival=0)
    b = NewRequest("b", [1, 2, 3], SamplingParams(max_tokens=10, min_tokens=3), "out:gw", 1.0)
    h.add(a, b)
    h.run()
    assert h.finished["a"].finish_reason == "length" and h.finished["a"].num_output_tokens == 10
    assert h.finished["b"].finish_reason == "stop" and h.finished["b"].num_output_tokens == 3


def test_drain_and_add_state_reroutes_to_another_worker():
    reqs = [make_request("a", 9, 6, arrival=0), make_request("b", 7, 6, arrival=1),
            make_request("c", 5, 6, arrival=2)]
    h1 = Harness(max_num_seqs=2)
    h1.add(*reqs)
    for _ in range(3):
        h1.step()
    in_flight = h1.sched.schedule()  # the worker dies with this step in flight
    states = h1.sched.drain()
    assert [s.request_id for s in states] == ["a", "b", "c"]
    assert all(s.status is RequestStatus.WAITING and s.num_computed_tokens == 0 for s in states)
    assert [s.num_output_tokens for s in states] == [3, 3, 0]
    assert in_flight is not None
    h1.assert_done()

    h2 = Harness(num_blocks=16)
    for state in states:
        assert h2.sched.add_state(state) is None
    first = h2.step()
    assert list(first.new_requests[0].token_ids) == states[0].token_ids[:12]
    h2.run()
    assert h2.outputs() == reference_outputs(*reqs)


def test_add_state_rejects_what_the_new_worker_cannot_hold():
    h1 = Harness(max_model_len=256)
    h1.add(make_request("a", 40, 30, arrival=0))
    h1.step()
    h1.step()
    (state,) = h1.sched.drain()
    h2 = Harness(max_model_len=64)
    event = h2.sched.add_state(state)
    assert event.finish_reason == "error" and event.index == 2 and "max_model_len 64" in event.error
    assert not h2.sched.has_work()


def test_drained_scheduler_tells_its_worker_to_forget_everything():
    h = Harness()
    h.add(make_request("a", 4, 5, arrival=0))
    h.step()
    h.sched.drain()
    h.add(make_request("b", 4, 1, arrival=1))
    assert list(h.step().finished_request_ids) == ["a"]
    h.assert_done()


def test_a_third_step_in_flight_is_refused_and_updates_go_oldest_first():
    h = Harness()
    h.add(make_request("a", 4, 5, arrival=0))
    step = h.sched.schedule()
    assert step.after_step_id == 0 and h.sched.can_schedule_ahead()
    ahead = h.sched.schedule()
    assert ahead.after_step_id == step.step_id and not h.sched.can_schedule_ahead()
    with pytest.raises(RuntimeError, match="in flight"):
        h.sched.schedule()
    first, second = h.worker.step(step), h.worker.step(ahead)  # the worker runs them in order
    with pytest.raises(ValueError, match="not the oldest step in flight"):
        h.sched.update(ahead, second)
    bad = worker_pb2.StepResult(step_id=step.step_id)  # a caught-up request without a token
    with pytest.raises(ValueError, match="needs a sampled token"):
        h.sched.update(step, bad)
    h.sched.update(step, first)
    h.sched.check_integrity()
    h.sched.update(ahead, second)
    h.sched.check_integrity()
    assert h.sched.get_request("a").output_token_ids == h.worker.requests["a"].token_ids[4:]


def test_load_counts_tokens_against_capacity():
    h = Harness(num_blocks=10, block_size=4)
    assert h.sched.load == 0
    h.add(make_request("a", 8, 4, arrival=0), make_request("b", 12, 4, arrival=1))
    assert h.sched.load == pytest.approx(20 / 40)
    h.run()
    assert h.sched.load == 0


@settings(max_examples=60, deadline=None)
@given(
    # (prompt length, max_tokens, priority, arrival step, abort 3 steps later?)
    workload=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 16), st.integers(0, 2),
                                st.integers(0, 6), st.booleans()), min_size=2, max_size=10),
    num_blocks=st.integers(9, 14),  # a request holds up to 35 tokens = 9 blocks
    budget=st.integers(1, 32),
    max_num_seqs=st.integers(1, 6),
    num_cpu_blocks=st.sampled_from([0, 3, 40]),  # > 0: swap preemption (3: often full)
    ns=st.lists(st.sampled_from([1, 1, 2, 3]), min_size=10, max_size=10),  # parallel sampling
    pipelined=st.booleans(),
)
def test_random_workloads_finish_with_reference_outputs(workload, num_blocks, budget, max_num_seqs,
                                                        num_cpu_blocks, ns, pipelined):
    """Arrivals spread over time, random priorities, some aborts; small pools force
    preemptions (by recompute, or by swap with a recompute fallback); steps planned ahead
    or not. Unaborted requests must produce the reference outputs."""
    h = Harness(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget,
                max_num_seqs=max_num_seqs, num_cpu_blocks=num_cpu_blocks, pipelined=pipelined,
                preemption_mode="swap" if num_cpu_blocks else "recompute")
    reqs = {f"r{i}": (make_request(f"r{i}", p, m, arrival=float(i), priority=prio), at, abort)
            for i, (p, m, prio, at, abort) in enumerate(workload)}
    n_of = {rid: min(ns[i], max_num_seqs) for i, rid in enumerate(reqs)}
    reqs = {rid: (NewRequest(r.request_id, r.prompt_token_ids, r.sampling, r.reply_channel,
                             r.arrival_time, r.priority, n=n_of[rid]), at, abort)
            for rid, (r, at, abort) in reqs.items()}
    aborted = set()
    for t in range(2000):
        for rid, (req, at, abort) in reqs.items():
            if at == t:
                h.add(req)
            if abort and at + 3 == t and h.sched.abort_request(rid):
                aborted.add(rid)
        if t > 15 and not h.sched.has_work():
            break
        h.step()
    h.assert_done()
    names = {rid: [rid] if n_of[rid] == 1 else [f"{rid}/{i}" for i in range(n_of[rid])] for rid in reqs}
    assert set(h.finished) | {c for rid in aborted for c in names[rid]} >= {c for v in names.values() for c in v}
    expected = reference_outputs(*(NewRequest(r.request_id, r.prompt_token_ids, r.sampling, r.reply_channel,
                                              r.arrival_time, r.priority)
                                   for rid, (r, _, _) in reqs.items() if rid not in aborted))
    # n > 1: every child produces what the request alone would (the fake ignores seeds).
    got = {c: out for c, out in h.outputs().items() if c.split("/")[0] not in aborted}
    assert got == {c: out for rid, out in expected.items() for c in names[rid]}
