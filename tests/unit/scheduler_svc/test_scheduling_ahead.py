"""Steps planned ahead (BatchScheduler.can_schedule_ahead, the scheduler service's async
scheduling) against the fake worker, which runs each step as soon as it is planned, before
the scheduler has the result of the one before. check_integrity() runs after every
schedule() and update(); outputs must equal the reference (nothing planned ahead)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proto.messages import NewRequest, SamplingParams
from tests.unit.scheduler_svc.test_fork import parallel_request
from tests.support.scheduler_harness import Harness, make_request, reference_outputs, scheduled


def test_decode_steps_are_planned_ahead_exact_contents():
    h = Harness(block_size=4, pipelined=True)
    h.add(make_request("a", 6, 4, arrival=0))
    h.run()
    s1, s2, s3, s4 = h.steps
    assert s1.after_step_id == 0 and scheduled(s1) == {"a": 6}
    # Each decode computes the token the step before samples, which only the worker has.
    for step, computed in ((s2, 6), (s3, 7), (s4, 8)):
        assert step.after_step_id == step.step_id - 1 and scheduled(step) == {"a": 1}
        assert step.cached_requests[0].num_computed_tokens == computed
    assert list(s4.cached_requests[0].new_block_ids) == [2]  # position 8 opens block 2
    # The step after s4 would compute a token past max_tokens: none is planned.
    assert h.num_ahead == h.sched.steps.num_steps_ahead == 3 and len(h.steps) == 4
    assert h.outputs() == reference_outputs(make_request("a", 6, 4, arrival=0))


def test_a_request_finished_by_the_step_in_flight_is_skipped_then_forgotten():
    h = Harness(vocab_size=1, eos_token_id=0, pipelined=True)  # every token is the EOS
    b = NewRequest("b", [1, 2, 3], SamplingParams(max_tokens=10, min_tokens=3), "out:gw", 1.0)
    h.add(make_request("a", 4, 8, arrival=0), b)
    h.run()
    assert h.finished["a"].finish_reason == "length" and h.finished["a"].num_output_tokens == 8
    assert h.finished["b"].finish_reason == "stop" and h.finished["b"].num_output_tokens == 3
    # b's 3rd token (step 3) finished it; step 4, planned while step 3 ran, still listed b
    # (the fake checked that it follows step 3, and skipped b) ...
    assert [s.step_id for s in h.steps if "b" in scheduled(s)] == [1, 2, 3, 4]
    assert h.steps[3].after_step_id == 3
    # ... and step 5, planned after step 3's result, told the worker to forget it, once.
    assert [s.step_id for s in h.steps if "b" in s.finished_request_ids] == [5]


def test_an_abort_with_two_steps_in_flight():
    h = Harness(pipelined=True)
    h.add(make_request("a", 6, 50, arrival=0), make_request("b", 6, 5, arrival=1))
    h.step()  # step 1 updated, step 2 (planned ahead) in flight
    assert h.sched.can_schedule_ahead()
    step3 = h._send()  # two in flight: 2 and 3
    assert step3.after_step_id == 2 and h.sched.steps.num_in_flight == 2
    assert h.sched.abort_request("a")  # blocks freed now; steps 2 and 3 still compute it
    h.sched.check_integrity()
    for _ in range(2):
        h.step()  # a's tokens are dropped
    assert "a" not in h.finished and h.sched.get_request("a") is None
    h.run()
    assert "a" in {rid for s in h.steps for rid in s.finished_request_ids}
    assert h.outputs() == reference_outputs(make_request("b", 6, 5, arrival=1))


def test_a_step_ahead_never_preempts_and_the_step_after_it_does():
    reqs = [make_request("a", 8, 12, arrival=0), make_request("b", 8, 12, arrival=1)]
    h = Harness(num_blocks=8, block_size=4, pipelined=True)  # 2 × 19 tokens of K/V > 8 blocks
    h.add(*reqs)
    blocked = 0
    while h.sched.has_work() or h.in_flight:
        in_flight_before = h.sched.steps.num_in_flight
        preemptions_before = h.sched.preemptor.num_preemptions
        h.step()
        if in_flight_before and h.sched.preemptor.num_preemptions > preemptions_before:
            raise AssertionError("a step planned ahead preempted")
        blocked += h.sched.planner.ahead_blocked
    h.assert_done()
    assert h.sched.preemptor.num_preemptions >= 1 and blocked >= 1 and h.num_ahead > 0
    assert h.outputs() == reference_outputs(*reqs)


def test_a_parent_forks_after_the_step_in_flight_and_its_children_run_ahead():
    h = Harness(num_blocks=32, block_size=4, pipelined=True)
    h.add(parallel_request("p", 6, 5, n=3))
    h.run()
    assert h.sched.forks.num_forks == 3 and h.worker.num_copies >= 1 and h.num_ahead > 0
    ref = reference_outputs(make_request("p", 6, 5, arrival=0))["p"]
    assert h.outputs() == {f"p/{i}": ref for i in range(3)}


@pytest.mark.parametrize("mode,num_cpu_blocks", [("recompute", 0), ("swap", 4), ("swap", 64)])
def test_children_under_preemption_with_steps_ahead(mode, num_cpu_blocks):
    h = Harness(num_blocks=14, block_size=4, max_num_batched_tokens=16, num_cpu_blocks=num_cpu_blocks,
                preemption_mode=mode, pipelined=True)
    reqs = [parallel_request("p", 11, 12, n=3), make_request("a", 7, 14, arrival=1),
            parallel_request("q", 6, 9, n=2, arrival=2)]
    h.add(*reqs)
    h.run()
    assert h.sched.preemptor.num_preemptions >= 1 and h.num_ahead > 0
    ref = reference_outputs(make_request("p", 11, 12, 0), make_request("a", 7, 14, 1),
                            make_request("q", 6, 9, 2))
    assert h.outputs() == {"a": ref["a"], **{f"p/{i}": ref["p"] for i in range(3)},
                           **{f"q/{i}": ref["q"] for i in range(2)}}


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 20)), min_size=1, max_size=8),
       budget=st.integers(4, 64), eos=st.sampled_from([None, 3]))
def test_steps_ahead_match_steps_in_lockstep(lengths, budget, eos):
    """The same workload, room for everything, planned ahead or not: the same outputs,
    and planning ahead never takes more steps."""
    reqs = [NewRequest(f"r{i}", [(5 * i + 3 * j) % 13 for j in range(p)],
                       SamplingParams(max_tokens=m, temperature=0.0), "out:gw", float(i))
            for i, (p, m) in enumerate(lengths)]
    runs = {}
    for pipelined in (False, True):
        h = Harness(num_blocks=256, vocab_size=13, eos_token_id=eos, max_num_batched_tokens=budget,
                    pipelined=pipelined)
        h.add(*reqs)
        h.run()
        runs[pipelined] = h
    assert runs[True].outputs() == runs[False].outputs()
    # Planned ahead, a step may list requests the step before finished: at most one more
    # step per finished request, and never fewer tokens computed per useful step.
    assert len(runs[True].steps) <= len(runs[False].steps) + len(reqs)
