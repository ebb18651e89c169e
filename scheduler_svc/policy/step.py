"""The step message out of a scheduler, and the worker's result back in.

The step carries admitted requests in full (prompt + outputs so far, block table, and the
prompt's images every time one is sent in full: new, a forked child, re-sent after a
preemption by recompute or on another worker) and running ones as diffs (the block ids
allocated this step). num_computed_tokens advances when the step is built: the worker
computes exactly what was planned, and a request the step catches up counts one token in
flight (num_pending) until its result comes back.

Steps planned ahead (async scheduling): the step after the one in flight carries
`after_step_id`, and computes the token the step before samples, which only the worker
has yet. Results come back oldest first; a request the step in flight finished (EOS, a
stop token) was planned once more for nothing -- the worker skips it.

Invariants (`check_integrity`): at most two steps are in flight; a running request's
tokens in flight are the steps in flight that sample for it, and it has tokens left to
compute (counting those in flight) unless the step that catches it up is in flight.
"""

from dataclasses import dataclass
from typing import NamedTuple

from proto import worker_pb2
from proto.messages import NO_TOKEN_ID
from scheduler_svc.policy.image_ranges import to_pb_mm_inputs
from scheduler_svc.policy.planner import StepPlan
from scheduler_svc.policy.queues import RequestQueues
from scheduler_svc.policy.request import RequestStatus, SchedulerRequest, to_pb_sampling

_RUNNING = RequestStatus.RUNNING
_BlockPair = worker_pb2.BlockPair
# Makes a ScheduledRequest from a tuple of its fields in one C call: its NamedTuple
# constructor is a Python call, and build() makes one per request per step.
_new_record = tuple.__new__


class ScheduledRequest(NamedTuple):
    """One request of a step in flight (a tuple: one is made per request per step)."""

    request: SchedulerRequest
    num_new_tokens: int  # tokens the step computes for it
    num_computed_tokens: int  # its computed tokens once the step ran
    samples: bool  # the step catches it up: the worker samples a token for it


@dataclass(frozen=True, slots=True)
class InFlightStep:
    """A step sent and not updated yet, with its requests in step order."""

    step: worker_pb2.StepRequest
    requests: tuple[ScheduledRequest, ...]


class StepBuilder:
    """Builds each step message and holds the steps in flight until their results."""

    def __init__(self) -> None:
        self._next_step_id = 1
        self._in_flight: list[InFlightStep] = []  # oldest first
        self._to_forget: list[str] = []  # request ids the worker forgets in the next step
        self.num_steps_ahead = 0  # steps planned while one was in flight, since start

    @property
    def num_steps(self) -> int:
        """Steps built so far (the last step_id)."""
        return self._next_step_id - 1

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def forget(self, request_id: str) -> None:
        """The worker drops the request in the next step (finished, aborted, preempted by
        recompute, a forked parent)."""
        self._to_forget.append(request_id)

    def build(self, plan: StepPlan, swap_outs: dict[str, list[tuple[int, int]]],
              copies: list[tuple[int, int]]) -> worker_pb2.StepRequest:
        """The step message for `plan`, with the block copies it carries; advances each
        request's num_computed_tokens by what the step computes for it."""
        step = worker_pb2.StepRequest(step_id=self._next_step_id, finished_request_ids=self._to_forget)
        if swap_outs:
            step.swapped_out_request_ids.extend(swap_outs)
            for pairs in swap_outs.values():
                step.blocks_to_swap_out.extend(_BlockPair(src=s, dst=d) for s, d in pairs)
        if plan.swap_in:
            step.blocks_to_swap_in.extend(_BlockPair(src=s, dst=d) for s, d in plan.swap_in)
        if copies:
            step.blocks_to_copy.extend(_BlockPair(src=s, dst=d) for s, d in copies)
        if self._in_flight:  # planned ahead: the worker runs it after the step in flight
            step.after_step_id = self._in_flight[-1].step.step_id
            self.num_steps_ahead += 1
        add_cached, requests, scheduled = step.cached_requests.add, [], {}
        for req, num_new, block_ids in plan.running:
            if block_ids:  # every block allocated before went out in an earlier step
                add_cached(request_id=req.request_id, new_block_ids=block_ids,
                           num_computed_tokens=req.num_computed_tokens)
            else:  # (an empty repeated field costs as much as a full one to pass)
                add_cached(request_id=req.request_id, num_computed_tokens=req.num_computed_tokens)
            scheduled[req.request_id] = num_new
            samples = req.advance(num_new)
            requests.append(_new_record(ScheduledRequest, (req, num_new, req.num_computed_tokens, samples)))
        for req, num_new, block_ids in plan.resumed:
            add_cached(request_id=req.request_id, new_block_ids=block_ids,
                       num_computed_tokens=req.num_computed_tokens, replace_block_ids=True)
            scheduled[req.request_id] = num_new
            samples = req.advance(num_new)
            requests.append(_new_record(ScheduledRequest, (req, num_new, req.num_computed_tokens, samples)))
        for req, num_new, block_ids in plan.new:
            new = step.new_requests.add(
                request_id=req.request_id, token_ids=req.token_ids, num_prompt_tokens=req.num_prompt_tokens,
                block_ids=block_ids, num_computed_tokens=req.num_computed_tokens,
                sampling=to_pb_sampling(req.sampling), reply_channel=req.reply_channel,
                num_cached_tokens=req.num_cached_tokens or 0)
            if req.mm_inputs:
                new.mm_inputs.extend(to_pb_mm_inputs(req.mm_inputs))
            scheduled[req.request_id] = num_new
            samples = req.advance(num_new)
            requests.append(_new_record(ScheduledRequest, (req, num_new, req.num_computed_tokens, samples)))
        step.num_scheduled_tokens.update(scheduled)
        self._to_forget = []
        self._next_step_id += 1
        self._in_flight.append(InFlightStep(step, tuple(requests)))
        return step

    def take_result(self, step: worker_pb2.StepRequest, result: worker_pb2.StepResult
                    ) -> list[tuple[ScheduledRequest, worker_pb2.SampledToken | None]]:
        """Take `step`, the oldest in flight, off with its result: each request still
        running, in step order, with the token sampled for it. Requests aborted, or
        finished by an earlier step, while it was in flight are left out (their tokens
        dropped). Raises ValueError, changing nothing, when the result breaks the step
        contract."""
        if not self._in_flight or step.step_id != self._in_flight[0].step.step_id:
            raise ValueError(f"step {step.step_id} is not the oldest step in flight")
        if result.step_id != step.step_id:
            raise ValueError(f"result of step {result.step_id} given for step {step.step_id}")
        sampled: dict[str, list[worker_pb2.SampledToken]] = {}
        for token in result.sampled:
            sampled.setdefault(token.request_id, []).append(token)
        if unscheduled := [rid for rid in sampled if rid not in step.num_scheduled_tokens]:
            raise ValueError(f"step {step.step_id}: tokens for unscheduled requests {sorted(unscheduled)}")
        live = []
        for scheduled in self._in_flight[0].requests:
            req = scheduled.request
            if req.status is not _RUNNING:
                continue
            tokens = sampled.get(req.request_id, ())
            # The worker samples exactly when the step catches a request up -- or fails the
            # request in any step it is scheduled in (NO_TOKEN_ID, "error": its media could
            # not be had), computing nothing for it.
            failed = len(tokens) == 1 and tokens[0].token_id == NO_TOKEN_ID and tokens[0].finish_reason == "error"
            if scheduled.samples != bool(tokens) and not failed:
                raise ValueError(
                    f"step {step.step_id}: request {req.request_id} "
                    f"{'needs' if scheduled.samples else 'must not get'} a sampled token "
                    f"({scheduled.num_computed_tokens} of {req.num_tokens} tokens computed)")
            if len(tokens) > 1:
                raise ValueError(
                    f"step {step.step_id}: request {req.request_id} got {len(tokens)} tokens, one expected")
            live.append((scheduled, tokens[0] if tokens else None))
        self._in_flight.pop(0)
        return live

    def clear(self) -> None:
        """The worker was lost: no result of a step in flight will come."""
        self._in_flight = []

    def check_integrity(self, queues: RequestQueues) -> None:
        assert len(self._in_flight) <= 2, f"{len(self._in_flight)} steps in flight"
        in_flight = {rid for f in self._in_flight for rid in f.step.num_scheduled_tokens}
        sampling: dict[int, int] = {}  # id(request) -> steps in flight that sample for it
        for f in self._in_flight:
            for scheduled in f.requests:
                sampling[id(scheduled.request)] = sampling.get(id(scheduled.request), 0) + scheduled.samples
        for req in queues.running:
            rid, samples = req.request_id, sampling.get(id(req), 0)
            assert req.num_pending == samples, (
                f"running {rid} has {req.num_pending} tokens pending, steps in flight sample {samples}")
            lacking = req.num_tokens + req.num_pending - req.num_computed_tokens
            assert lacking > 0 or (lacking == 0 and rid in in_flight), (
                f"running {rid} has {req.num_computed_tokens} of {req.num_tokens} "
                f"(+{req.num_pending} in flight) tokens computed")

