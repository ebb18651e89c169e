"""The step message out of a BatchScheduler and the worker's result back in: a mixin of
BatchScheduler (scheduler_svc/batching.py), whose state it reads and changes.

The step carries admitted requests in full (prompt + outputs so far, block table) and
running ones as diffs (the block ids allocated this step). num_computed_tokens advances
when the step is built: the worker computes exactly what was scheduled, and a request the
step catches up counts one token in flight (num_pending) until its result. `update` then
offers the blocks the step filled to the prefix cache, appends the sampled tokens and
finishes requests the worker finished.

Steps planned ahead (BatchScheduler.can_schedule_ahead): the worker finds the next step
queued when it finishes the first. The step ahead assumes every request the step in flight
samples for gets its token (`num_pending`): a decode computes that token, which only the
worker knows yet (the step carries `after_step_id`). `update()` takes results oldest first
and reconciles: a request the step in flight finished (EOS, a stop token) was scheduled once
more for nothing -- the worker skips it, and its blocks were freed at the first update. A
step ahead never preempts, swaps or forks: a request that cannot grow without a preemption
ends the step there (the one after it is planned after update(), with nothing in flight), a
request about to sample its last token (max_tokens) or to fork (n > 1) waits for update().
"""

from dataclasses import dataclass

from proto import worker_pb2
from scheduler_svc.request import RequestState, RequestStatus, to_pb_sampling

_RUNNING = RequestStatus.RUNNING


@dataclass(frozen=True, slots=True)
class InFlightStep:
    """A step sent and not updated yet, and for each of its requests in step order:
    (request, tokens it computes, its num_computed_tokens after the step, whether the
    worker samples a token for it)."""

    step: worker_pb2.StepRequest
    reqs: list[tuple[RequestState, int, int, bool]]


class StepMixin:
    """BatchScheduler's `_build_step`, `update` and `_finish`."""

    def _build_step(self, scheduled: dict[str, int], new_blocks: dict[str, list[int]],
                    admitted: list[RequestState]) -> worker_pb2.StepRequest:
        """The step message; advances num_computed_tokens by what it schedules. Running
        requests come first in `scheduled`, then the admitted ones."""
        step = worker_pb2.StepRequest(step_id=self._next_step_id,
                                      finished_request_ids=self._finished_ids)
        if self._swap_out:
            step.swapped_out_request_ids.extend(self._swap_out)
            for pairs in self._swap_out.values():
                step.blocks_to_swap_out.extend(worker_pb2.BlockPair(src=s, dst=d) for s, d in pairs)
            self._swap_out = {}
        if self._swap_in:
            step.blocks_to_swap_in.extend(worker_pb2.BlockPair(src=s, dst=d) for s, d in self._swap_in)
            self._swap_in = []
        if self._copies:
            step.blocks_to_copy.extend(worker_pb2.BlockPair(src=s, dst=d)
                                       for s, d in self._copies.values())
            self._copies = {}
        if self._in_flight:  # planned ahead: the worker runs it after the step in flight
            step.after_step_id = self._in_flight[-1].step.step_id
            self.num_steps_ahead += 1
        replaced, self._replaced = self._replaced, set()
        requests, reqs = self._requests, []
        add_cached = step.cached_requests.add
        unsent = self._unsent
        for request_id, num_new in scheduled.items():
            req = requests[request_id]
            if request_id not in new_blocks:
                break  # the admitted ones: below
            if request_id in unsent:  # a forked child: in full, with its (shared) table
                unsent.discard(request_id)
                admitted.append(req)
                continue
            if request_id in replaced:  # swapped in (or copied on write): the whole table
                add_cached(request_id=request_id, new_block_ids=self.kv.block_ids(request_id),
                           num_computed_tokens=req.num_computed_tokens, replace_block_ids=True)
            # Every block allocated before this step went out in an earlier step.
            elif ids := new_blocks[request_id]:
                add_cached(request_id=request_id, new_block_ids=ids,
                           num_computed_tokens=req.num_computed_tokens)
            else:  # (an empty repeated field costs as much as a full one to pass)
                add_cached(request_id=request_id, num_computed_tokens=req.num_computed_tokens)
            reqs.append(_advance(req, num_new))
        for req in admitted:
            num_new = scheduled[req.request_id]
            step.new_requests.add(
                request_id=req.request_id, token_ids=req.token_ids,
                num_prompt_tokens=req.num_prompt_tokens,
                block_ids=self.kv.block_ids(req.request_id),
                num_computed_tokens=req.num_computed_tokens,
                sampling=to_pb_sampling(req.sampling), reply_channel=req.reply_channel)
            reqs.append(_advance(req, num_new))
        step.num_scheduled_tokens.update(scheduled)
        self._finished_ids = []
        self._next_step_id += 1
        self._in_flight.append(InFlightStep(step, reqs))
        return step

    def update(self, step: worker_pb2.StepRequest,
               result: worker_pb2.StepResult) -> list[RequestState]:
        """Apply the worker's result of `step`, the oldest step in flight.

        Appends each sampled token; a non-empty finish_reason finishes the request (the
        worker applied the stop rule), freeing its blocks. Tokens of requests aborted while
        the step was in flight are ignored, as is a request a step before finished (the
        worker samples nothing for it). Returns the requests finished here.
        Raises ValueError, changing nothing, when the result breaks the step contract.
        """
        if not self._in_flight or step.step_id != self._in_flight[0].step.step_id:
            raise ValueError(f"step {step.step_id} is not the oldest step in flight")
        if result.step_id != step.step_id:
            raise ValueError(f"result of step {result.step_id} given for step {step.step_id}")
        sampled = {s.request_id: s for s in result.sampled}
        if len(sampled) != len(result.sampled):
            raise ValueError(f"step {step.step_id}: a request sampled twice")
        if unscheduled := [rid for rid in sampled if rid not in step.num_scheduled_tokens]:
            raise ValueError(
                f"step {step.step_id}: tokens for unscheduled requests {sorted(unscheduled)}")
        # Requests aborted, or finished by an earlier step, while this one was in flight
        # are FINISHED: their tokens are dropped.
        live = [entry for entry in self._in_flight[0].reqs if entry[0].status is _RUNNING]
        for req, _, computed, samples in live:
            # The worker samples exactly when the step catches a request up.
            if samples != (req.request_id in sampled):
                raise ValueError(
                    f"step {step.step_id}: request {req.request_id} "
                    f"{'needs' if samples else 'must not get'} a sampled token "
                    f"({computed} of {req.num_tokens} tokens computed)")

        self._in_flight.pop(0)
        caching, bs = self.kv.enable_prefix_caching, self.kv.block_size
        finished = []
        for req, n, computed, _ in live:  # in step order, so finished requests come back in order
            if caching and computed % bs < n:  # the step filled a block
                self.kv.cache_full_blocks(req.request_id, req.token_ids, req.block_hashes, computed)
            token = sampled.get(req.request_id)
            if token is None:
                if req.n > 1 and computed == req.num_prompt_tokens - 1:
                    self._fork(req)
                continue
            req.token_ids.append(token.token_id)
            req.num_pending -= 1
            self._load_tokens += 1
            if token.finish_reason:
                self._finish(req, token.finish_reason)
                finished.append(req)
        return finished


    def _finish(self, req: RequestState, reason: str) -> None:
        self._forget_child(req)
        self.running.remove(req)
        del self._requests[req.request_id]
        self._load_tokens -= req.num_tokens
        self.kv.free(req.request_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason  # type: ignore[assignment]  # the worker's "stop" / "length"
        self._finished_ids.append(req.request_id)


def _advance(req: RequestState, num_new: int) -> tuple[RequestState, int, int, bool]:
    """Advance the request past a step that computes `num_new` of its tokens; its entry
    in that InFlightStep. The step samples when it catches the request up with every
    token it has or has in flight."""
    computed = req.num_computed_tokens = req.num_computed_tokens + num_new
    samples = computed == req.num_tokens + req.num_pending
    if samples:
        req.num_pending += 1
    return req, num_new, computed, samples
