"""The compute thread's idle time between two steps while requests go on: what the round
trip between steps costs (publishing the events, the result back to the scheduler, its
update and next schedule, the next step over to the worker), as the worker sees it.

    gaps = StepGap()
    gap = gaps.start()                           # right before the step computes: the idle
    output = runner.step(request)                #   time since the last step, or None
    gaps.end(request, output.result, gap)        # right after it: sets result.gap_seconds

The time is measured only when the step before left a request to go on (one it did not
finish: a decode, or a prefill chunk): after a step that finished everything the worker
waits for new requests, which is not a cost of the round trip. The in-process engine keeps
one too, so `pagedserve:step_gap_seconds` compares the stack with it directly.
"""

from __future__ import annotations

import time

from proto import worker_pb2


class StepGap:
    def __init__(self) -> None:
        self._ended_at: float | None = None  # end of the last step, when it left work to go on

    def start(self) -> float | None:
        """Seconds since the step before ended, if it left requests to go on; else None."""
        ended_at, self._ended_at = self._ended_at, None
        return None if ended_at is None else time.perf_counter() - ended_at

    def end(self, step: worker_pb2.StepRequest, result: worker_pb2.StepResult, gap: float | None) -> None:
        """The step done: its `gap` (what start() gave before it) into `result.gap_seconds`
        when there was one, and the clock started for the next if the step left requests
        to go on."""
        if gap is not None:
            result.gap_seconds = gap
        finished = sum(1 for token in result.sampled if token.finish_reason)
        if len(step.num_scheduled_tokens) > finished:
            self._ended_at = time.perf_counter()
