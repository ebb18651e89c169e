"""Multi-step decoding: one StepRequest, up to `num_passes` forward passes on the worker.

Between two steps the compute thread waits for a round trip: the result back to the
scheduler, its update and its next plan, the next step over gRPC (3-5 ms on the 2-core
machines, docs/performance.md). With num_passes > 1 (the scheduler's
--num-scheduler-steps, as vLLM's multi-step scheduling) one step runs several passes back
to back: the first computes what the scheduler scheduled; each later one decodes one more
token for every request the pass before sampled for and did not finish. That pass's
StepRequest is made here, and holds nothing but num_scheduled_tokens (1 for each). Each
pass's events are streamed as it ends (`on_pass`; the last pass's come back with the
result, to go out as a single step's do). The scheduler gets one StepResult with every
pass's tokens, and per-pass timings in `passes`.

    output = run_passes(runner, step, gap, on_pass, cut)  # on_pass(a pass's StepOutput)

A request arriving while such a step runs would wait for all of its passes: the scheduler
then sends Cut (proto/worker.proto), and `cut()` ends the step after the pass that runs, so
it waits no longer than in a step of one pass. Every request of the step then keeps the
blocks its computed tokens fill; the scheduler drops the rest of its table as well.

The scheduler allocated blocks for every pass (proto/worker.proto says how many a request
gets); a request that would need more fails the step (worker_svc/batch.py checks the block
table), as any step the two sides disagree about.
"""

from __future__ import annotations

from collections.abc import Callable

from proto import worker_pb2
from worker_svc.model_runner import ModelRunner, StepOutput
from worker_svc.step_gap import StepGap

PassSink = Callable[[StepOutput], None]


def run_passes(runner: ModelRunner, step: worker_pb2.StepRequest, gap: StepGap,
               on_pass: PassSink, cut: Callable[[], bool]) -> StepOutput:
    """Run the step's passes on the calling (compute) thread, each timed by `gap`; every
    pass but the last goes to `on_pass` with its events as it ends. `cut()`, asked after
    each pass, ends the step there (a request arrived and waits). Returns the step's
    output: the result of every pass merged (one pass's as it was), and the last pass's
    events."""
    request = step
    done: list[tuple[worker_pb2.StepRequest, StepOutput]] = []
    while True:
        gap.start()
        output = runner.step(request)
        gap.end(request, output.result)
        done.append((request, output))
        go_on = {token.request_id: 1 for token in output.result.sampled if not token.finish_reason}
        if len(done) >= step.num_passes or not go_on:
            break
        if cut():  # blocks were allocated for passes that will not run: drop them
            runner.trim_block_tables(go_on)
            break
        on_pass(output)
        request = worker_pb2.StepRequest(step_id=step.step_id, num_scheduled_tokens=go_on)
    if step.num_passes <= 1:
        return output
    result = worker_pb2.StepResult(step_id=step.step_id)
    for request, one in ((r, o.result) for r, o in done):
        result.sampled.extend(one.sampled)
        result.execute_seconds += one.execute_seconds
        stats = result.passes.add(execute_seconds=one.execute_seconds,
                                  num_requests=len(request.num_scheduled_tokens),
                                  num_tokens=sum(request.num_scheduled_tokens.values()))
        if one.HasField("gap_seconds"):
            stats.gap_seconds = one.gap_seconds
    first = done[0][1].result
    if first.HasField("gap_seconds"):
        result.gap_seconds = first.gap_seconds
    return StepOutput(result=result, events=output.events)
