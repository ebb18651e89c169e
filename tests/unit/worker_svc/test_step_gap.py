"""StepGap: the idle time between two steps is measured only while requests go on."""

import time

from proto import worker_pb2
from worker_svc.step_gap import StepGap


def _step(*request_ids: str) -> worker_pb2.StepRequest:
    return worker_pb2.StepRequest(num_scheduled_tokens={rid: 1 for rid in request_ids})


def _result(**finish_reasons: str) -> worker_pb2.StepResult:
    return worker_pb2.StepResult(sampled=[worker_pb2.SampledToken(request_id=rid, token_id=1, finish_reason=reason)
                                          for rid, reason in finish_reasons.items()])


def test_gap_after_a_step_that_left_work_going_on():
    gap = StepGap()
    assert gap.start() is None  # the first step: nothing before it
    first = _result(a="", b="stop")
    gap.end(_step("a", "b"), first, None)  # a goes on
    assert not first.HasField("gap_seconds")
    time.sleep(0.02)
    waited = gap.start()
    assert waited is not None and 0.02 <= waited < 1.0
    assert gap.start() is None  # measured once
    second = _result(a="stop")
    gap.end(_step("a"), second, waited)
    assert second.gap_seconds == waited


def test_no_gap_after_a_step_that_finished_everything():
    gap = StepGap()
    gap.end(_step("a", "b"), _result(a="length", b="stop"), None)
    assert gap.start() is None


def test_a_prefill_chunk_without_a_token_goes_on():
    gap = StepGap()
    gap.end(_step("a"), _result(), None)  # a chunk of a's prompt: nothing sampled yet
    assert gap.start() is not None
