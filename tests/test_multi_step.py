"""Multi-step decoding (SchedulerConfig.num_scheduler_steps) against the fake worker, which
runs a step's passes as the worker does. check_integrity() runs after every schedule() and
update(); outputs must equal the reference (one pass per step, room for everything)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proto import worker_pb2
from proto.messages import NewRequest, SamplingParams
from scheduler_harness import Harness, make_request, reference_outputs, scheduled
from test_fork import parallel_request
from scheduler_svc.config import SchedulerConfig


def test_decode_steps_run_several_passes_exact_contents():
    h = Harness(block_size=4, num_scheduler_steps=4)
    h.add(make_request("a", 6, 10, arrival=0))
    h.run()
    s1, s2, s3, s4 = h.steps
    # The prefill is a step of its own (the request waited when it was planned) ...
    assert scheduled(s1) == {"a": 6} and s1.num_passes == 0
    # ... then each step decodes four tokens: blocks for all of them, one round trip.
    assert scheduled(s2) == {"a": 1} and s2.num_passes == 4
    assert s2.cached_requests[0].num_computed_tokens == 6
    assert list(s2.cached_requests[0].new_block_ids) == [2]  # positions 6..9: blocks 1, 2
    assert s3.num_passes == 4 and s3.cached_requests[0].num_computed_tokens == 10
    # 9 of 10 outputs after s3 (1 + 4 + 4): one pass left, a plain step.
    assert scheduled(s4) == {"a": 1} and s4.num_passes == 0
    assert h.outputs() == reference_outputs(make_request("a", 6, 10, arrival=0))


def test_the_last_passes_stop_at_max_tokens():
    h = Harness(block_size=4, num_scheduler_steps=4)
    h.add(make_request("a", 6, 7, arrival=0))
    h.run()
    s1, s2, s3 = h.steps
    assert s2.num_passes == 4  # outputs 2..5
    # Two outputs left: one pass after the first, and no blocks beyond the last token.
    assert s3.num_passes == 2 and h.sched.kv.num_free_blocks == h.sched.kv.num_blocks
    assert len(h.worker.steps) == 3
    assert h.outputs() == reference_outputs(make_request("a", 6, 7, arrival=0))


def test_a_step_with_one_pass_left_is_a_plain_step():
    h = Harness(block_size=4, num_scheduler_steps=3)
    h.add(make_request("a", 4, 5, arrival=0))
    h.run()
    assert [s.num_passes for s in h.steps] == [0, 3, 0]  # outputs 1; 2, 3, 4; 5
    assert h.outputs() == reference_outputs(make_request("a", 4, 5, arrival=0))


def test_a_prefill_chunk_keeps_its_step_to_one_pass():
    """A chunked prefill is running, not waiting: its next chunk must not wait behind the
    decodes' passes, so a step with a chunk in it has one pass."""
    h = Harness(block_size=4, max_num_batched_tokens=8, num_scheduler_steps=4)
    h.add(make_request("a", 3, 12, arrival=0), make_request("b", 20, 3, arrival=1))
    while "b" not in h.finished:
        step = h.step()
        chunk = scheduled(step).get("b", 0) > 1
        assert not (chunk and step.num_passes), f"step {step.step_id} holds a chunk of b's prompt"
    h.run()
    assert any(s.num_passes for s in h.steps)
    assert h.outputs() == reference_outputs(make_request("a", 3, 12, arrival=0), make_request("b", 20, 3, arrival=1))


@pytest.mark.parametrize("num_blocks", [4, 5])
def test_no_room_for_the_later_passes_means_one_pass_and_no_preemption(num_blocks):
    """Blocks for passes that may not run are taken only from free ones: with 4 blocks
    neither request has room for them; with 5 the first gets them, the second does not,
    and the first gives them back."""
    h = Harness(num_blocks=num_blocks, block_size=4, num_scheduler_steps=4)
    h.add(make_request("a", 6, 8, arrival=0), make_request("b", 7, 8, arrival=1))
    h.step()
    step = h.step()
    assert step.num_passes == 0 and h.sched.num_preemptions == 0
    assert all(not c.new_block_ids for c in step.cached_requests)
    assert h.sched.kv.num_free_blocks == num_blocks - 4
    h.run()
    assert h.outputs() == reference_outputs(make_request("a", 6, 8, arrival=0), make_request("b", 7, 8, arrival=1))


def test_an_arrival_gets_a_step_of_its_own_next():
    h = Harness(block_size=4, num_scheduler_steps=4)
    h.add(make_request("a", 5, 12, arrival=0))
    h.step()
    h.step()
    assert h.steps[-1].num_passes == 4
    h.add(make_request("b", 3, 6, arrival=1))
    step = h.step()  # b waits: one pass, b's prefill beside a's decode
    assert step.num_passes == 0 and scheduled(step) == {"a": 1, "b": 3}
    assert h.step().num_passes == 4  # both decode on
    h.run()
    assert h.outputs() == reference_outputs(make_request("a", 5, 12, arrival=0),
                                            make_request("b", 3, 6, arrival=1))


def test_a_request_finished_in_an_early_pass_frees_everything():
    h = Harness(vocab_size=1, eos_token_id=0, num_scheduler_steps=5)  # every token is the EOS
    b = NewRequest("b", [1, 2, 3], SamplingParams(max_tokens=10, min_tokens=3), "out:gw", 1.0)
    h.add(make_request("a", 4, 12, arrival=0), b)
    h.run()
    assert h.finished["a"].finish_reason == "length" and h.finished["a"].num_output_tokens == 12
    # b's 3rd token, in the second pass of step 2, finished it; a went on alone.
    assert h.finished["b"].finish_reason == "stop" and h.finished["b"].num_output_tokens == 3
    assert h.steps[1].num_passes == 5


def test_an_abort_during_a_multi_step_step():
    h = Harness(block_size=4, num_scheduler_steps=4)
    h.add(make_request("a", 6, 20, arrival=0), make_request("b", 6, 20, arrival=0))
    h.step()
    step = h.sched.schedule()
    assert step.num_passes == 4
    result = h.worker.step(step)
    assert h.sched.abort_request("a")  # its tokens of the step in flight are dropped
    h.sched.update(step, result)
    h.sched.check_integrity()
    assert h.sched.get_request("a") is None and h.sched.get_request("b").num_output_tokens == 5
    nxt = h.sched.schedule()
    assert list(nxt.finished_request_ids) == ["a"] and scheduled(nxt) == {"b": 1}
    h.in_flight.append((nxt, h.worker.step(nxt)))
    h.run()
    assert h.outputs() == {"b": reference_outputs(make_request("b", 6, 20, arrival=0))["b"]}


def test_no_step_is_planned_ahead_of_a_multi_step_one():
    h = Harness(block_size=4, num_scheduler_steps=3)
    h.add(make_request("a", 6, 12, arrival=0))
    h.step()
    assert h.sched.can_schedule_ahead() is False  # nothing in flight
    step = h.sched.schedule()
    assert step.num_passes == 3 and not h.sched.can_schedule_ahead()
    with pytest.raises(RuntimeError, match="in flight"):
        h.sched.schedule()


def test_with_steps_planned_ahead_every_step_has_one_pass():
    """Async scheduling keeps a step in flight, so no step is planned with nothing in
    flight, and multi-step never applies: the same outputs."""
    h = Harness(block_size=4, num_scheduler_steps=3, pipelined=True)
    h.add(make_request("a", 6, 12, arrival=0), make_request("b", 3, 9, arrival=1))
    h.run()
    assert h.num_ahead > 0 and all(s.num_passes == 0 for s in h.steps)
    assert h.outputs() == reference_outputs(make_request("a", 6, 12, arrival=0),
                                            make_request("b", 3, 9, arrival=1))


@pytest.mark.parametrize("mode,num_cpu_blocks", [("recompute", 0), ("swap", 64)])
def test_forked_children_decode_several_passes_under_preemption(mode, num_cpu_blocks):
    h = Harness(num_blocks=14, block_size=4, max_num_batched_tokens=16, num_cpu_blocks=num_cpu_blocks,
                preemption_mode=mode, num_scheduler_steps=3)
    h.add(parallel_request("p", 11, 12, n=3), make_request("a", 7, 14, arrival=1),
          parallel_request("q", 6, 9, n=2, arrival=2))
    h.run()
    assert h.sched.num_forks == 5 and h.sched.num_preemptions >= 1
    assert any(s.num_passes == 3 for s in h.steps)
    ref = reference_outputs(make_request("p", 11, 12, 0), make_request("a", 7, 14, 1),
                            make_request("q", 6, 9, 2))
    assert h.outputs() == {"a": ref["a"], **{f"p/{i}": ref["p"] for i in range(3)},
                           **{f"q/{i}": ref["q"] for i in range(2)}}


def test_a_cut_step_gives_back_the_blocks_of_the_passes_that_did_not_run():
    h = Harness(block_size=4, num_scheduler_steps=4)
    h.worker.cut_after = 2  # every multi-step step ends after two passes
    h.add(make_request("a", 6, 12, arrival=0), make_request("b", 3, 9, arrival=0))
    h.step()
    step = h.step()
    assert step.num_passes == 4 and h.worker.num_cuts == 1
    # Blocks for 4 passes were allocated, 2 ran: the tables cover the computed tokens only.
    a = h.sched.get_request("a")
    assert (a.num_computed_tokens, a.num_output_tokens, a.num_pending) == (8, 3, 0)
    assert h.sched.kv.block_ids("a") == h.worker.requests["a"].block_ids and len(h.sched.kv.block_ids("a")) == 2
    h.run()
    assert h.outputs() == reference_outputs(make_request("a", 6, 12, arrival=0),
                                            make_request("b", 3, 9, arrival=0))


def test_a_result_with_more_passes_than_planned_is_refused():
    h = Harness(block_size=4, num_scheduler_steps=2)
    h.add(make_request("a", 6, 20, arrival=0))
    h.step()
    step = h.sched.schedule()
    result = h.worker.step(step)
    result.passes.add()
    with pytest.raises(ValueError, match="3 passes ran, 2 planned"):
        h.sched.update(step, result)


@pytest.mark.parametrize("tokens, why", [
    (["a"] * 3, "got 3 tokens, 4 expected"),  # short, and the last does not finish it
    (["a"] * 5, "got 5 tokens, 4 expected"),
])
def test_a_result_with_the_wrong_number_of_tokens_is_refused(tokens, why):
    h = Harness(block_size=4, num_scheduler_steps=4)
    h.add(make_request("a", 6, 20, arrival=0))
    h.step()
    step = h.sched.schedule()
    result = worker_pb2.StepResult(step_id=step.step_id, sampled=[
        worker_pb2.SampledToken(request_id=rid, token_id=1) for rid in tokens])
    for _ in range(4):
        result.passes.add(num_requests=1)
    with pytest.raises(ValueError, match=why):
        h.sched.update(step, result)


def test_num_scheduler_steps_must_be_positive():
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        SchedulerConfig(num_scheduler_steps=0)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 20)), min_size=1, max_size=8),
       budget=st.integers(4, 64), eos=st.sampled_from([None, 3]), passes=st.integers(2, 5),
       num_blocks=st.sampled_from([20, 256]), mode=st.sampled_from(["recompute", "swap"]),
       arrivals=st.integers(0, 8), cut_after=st.integers(0, 3))
def test_multi_step_matches_one_pass_steps(lengths, budget, eos, passes, num_blocks, mode, arrivals,
                                           cut_after):
    """The same workload with several passes per step, under preemption or not, with some
    requests arriving while steps run, and steps cut short or not: the outputs of one pass
    per step with room for everything, and no more round trips."""
    reqs = [NewRequest(f"r{i}", [(5 * i + 3 * j) % 13 for j in range(p)],
                       SamplingParams(max_tokens=m, temperature=0.0), "out:gw", float(i))
            for i, (p, m) in enumerate(lengths)]
    runs = {}
    for num_passes in (1, passes):
        h = Harness(num_blocks=num_blocks, vocab_size=13, eos_token_id=eos, max_num_batched_tokens=budget,
                    num_scheduler_steps=num_passes, preemption_mode=mode,
                    num_cpu_blocks=64 if mode == "swap" else 0)
        h.worker.cut_after = cut_after
        h.add(*reqs[:len(reqs) - arrivals])
        late = reqs[len(reqs) - arrivals:]
        while h.sched.has_work() or h.in_flight or late:
            if late and (len(h.steps) % 3 == 1 or not h.sched.has_work()):
                h.add(late.pop(0))
            assert h.step() is not None
            assert len(h.steps) < 2000
        h.assert_done()
        runs[num_passes] = h
    assert runs[passes].outputs() == runs[1].outputs()
    if num_blocks == 256:  # no preemption: never more round trips
        assert len(runs[passes].steps) <= len(runs[1].steps)
