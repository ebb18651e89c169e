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

Multi-step (SchedulerConfig.num_scheduler_steps > 1): a step planned with nothing in
flight, nothing waiting or swapped and no preemption, in which every request samples,
runs up to that many passes on the worker (worker_svc/multi_step.py): after the first,
each request decodes on, one token a pass, until it finishes or the passes run out. The
step allocates blocks for all of its passes when the pool has room for them (else it has
one), and counts their tokens in flight; `update()` takes every pass's tokens.
No step is planned ahead of a multi-step one. A request arriving meanwhile makes the
scheduler service send Cut: the worker ends the step after the pass that runs, and
`update()` gives back what the passes that did not run were allocated.
"""

from dataclasses import dataclass

from proto import worker_pb2
from scheduler_svc.request import RequestState, RequestStatus, to_pb_sampling

_RUNNING = RequestStatus.RUNNING


@dataclass(frozen=True, slots=True)
class InFlightStep:
    """A step sent and not updated yet, and for each of its requests in step order:
    (request, tokens its first pass computes, its num_computed_tokens after the step, the
    tokens the worker samples for it: 0, 1, or with multi-step up to num_passes)."""

    step: worker_pb2.StepRequest
    reqs: list[tuple[RequestState, int, int, int]]


class StepMixin:
    """BatchScheduler's `_extra_passes`, `_build_step`, `update` and `_finish`."""

    def _extra_passes(self, scheduled: dict[str, int], new_blocks: dict[str, list[int]]) -> dict[str, int]:
        """Multi-step: request id -> the passes after the first it decodes in (up to
        num_scheduler_steps - 1, within its max_tokens), its blocks for them allocated and
        appended to new_blocks. Empty, with nothing allocated, unless every request of the
        step samples in the first pass (no prefill chunk waits behind the passes) and the
        pool has room for all of them (no preemption for passes that may not run)."""
        limit = self.config.num_scheduler_steps - 1
        extra: dict[str, int] = {}
        for request_id, num_new in scheduled.items() if limit else ():
            req = self._requests[request_id]
            computed = req.num_computed_tokens + num_new
            more = min(limit, req.sampling.max_tokens - req.num_output_tokens - req.num_pending - 1)
            samples = computed == req.num_tokens + req.num_pending
            ids = self.kv.allocate_slots(request_id, computed + more) if samples and more > 0 else []
            if not samples or ids is None:  # one pass after all: give back what was taken
                for rid in extra:
                    taken = self.kv.trim(rid, self._requests[rid].num_computed_tokens + scheduled[rid])
                    del new_blocks[rid][len(new_blocks[rid]) - taken:]
                return {}
            if more > 0:
                new_blocks[request_id] = [*new_blocks[request_id], *ids]
                extra[request_id] = more
        return extra

    def _build_step(self, scheduled: dict[str, int], new_blocks: dict[str, list[int]],
                    admitted: list[RequestState], extra: dict[str, int]) -> worker_pb2.StepRequest:
        """The step message; advances num_computed_tokens by what it schedules. Running
        requests come first in `scheduled`, then the admitted ones. Multi-step: `extra`
        (from _extra_passes) holds the passes after the first each request decodes in."""
        step = worker_pb2.StepRequest(step_id=self._next_step_id,
                                      finished_request_ids=self._finished_ids)
        if extra:
            step.num_passes = 1 + max(extra.values())
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
            reqs.append(_advance(req, num_new, extra.get(request_id, 0)))
        for req in admitted:
            num_new = scheduled[req.request_id]
            step.new_requests.add(
                request_id=req.request_id, token_ids=req.token_ids,
                num_prompt_tokens=req.num_prompt_tokens,
                block_ids=self.kv.block_ids(req.request_id),
                num_computed_tokens=req.num_computed_tokens,
                sampling=to_pb_sampling(req.sampling), reply_channel=req.reply_channel)
            reqs.append(_advance(req, num_new, extra.get(req.request_id, 0)))
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
        worker samples nothing for it). A multi-step step samples a request's tokens in
        every pass it ran in: all it was scheduled for, or fewer when the last finished
        it or a Cut ended the step early (`result.passes` says how many ran; its blocks
        past its computed tokens are then freed). Returns the requests finished here.
        Raises ValueError, changing nothing, when the result breaks the step contract.
        """
        if not self._in_flight or step.step_id != self._in_flight[0].step.step_id:
            raise ValueError(f"step {step.step_id} is not the oldest step in flight")
        if result.step_id != step.step_id:
            raise ValueError(f"result of step {result.step_id} given for step {step.step_id}")
        # Multi-step: the passes that ran (fewer than planned when a Cut ended it early).
        passes = len(result.passes) if step.num_passes > 1 else 1
        if not 1 <= passes <= max(step.num_passes, 1):
            raise ValueError(f"step {step.step_id}: {passes} passes ran, {step.num_passes} planned")
        sampled: dict[str, list[worker_pb2.SampledToken]] = {}
        for token in result.sampled:
            sampled.setdefault(token.request_id, []).append(token)
        if unscheduled := [rid for rid in sampled if rid not in step.num_scheduled_tokens]:
            raise ValueError(
                f"step {step.step_id}: tokens for unscheduled requests {sorted(unscheduled)}")
        # Requests aborted, or finished by an earlier step, while this one was in flight
        # are FINISHED: their tokens are dropped.
        live = [entry for entry in self._in_flight[0].reqs if entry[0].status is _RUNNING]
        for req, _, computed, num_samples in live:
            tokens = sampled.get(req.request_id, ())
            # The worker samples exactly when the step catches a request up.
            if bool(num_samples) != bool(tokens):
                raise ValueError(
                    f"step {step.step_id}: request {req.request_id} "
                    f"{'needs' if num_samples else 'must not get'} a sampled token "
                    f"({computed} of {req.num_tokens} tokens computed)")
            expected = min(num_samples, passes)  # one a pass it ran in
            if len(tokens) > expected or any(t.finish_reason for t in tokens[:-1]) or (
                    len(tokens) < expected and not tokens[-1].finish_reason):
                raise ValueError(
                    f"step {step.step_id}: request {req.request_id} got {len(tokens)} tokens, "
                    f"{expected} expected (fewer only when the last one finishes it)")

        self._in_flight.pop(0)
        caching, bs = self.kv.enable_prefix_caching, self.kv.block_size
        finished = []
        for req, n, computed, num_samples in live:  # in step order, so finished requests come back in order
            tokens = sampled.get(req.request_id)
            if tokens is not None:
                req.token_ids.extend(token.token_id for token in tokens)
                req.num_pending -= num_samples
                self._load_tokens += len(tokens)
                computed -= num_samples - len(tokens)  # passes it finished before, or cut
                n += len(tokens) - 1  # the passes after the first computed one token each
                if len(tokens) < num_samples and not tokens[-1].finish_reason:  # cut short
                    req.num_computed_tokens = computed
                    self.kv.trim(req.request_id, computed)  # as the worker did
            if caching and computed % bs < n:  # the step filled a block
                self.kv.cache_full_blocks(req.request_id, req.token_ids, req.block_hashes, computed)
            if tokens is None:
                if req.n > 1 and computed == req.num_prompt_tokens - 1:
                    self._fork(req)
            elif tokens[-1].finish_reason:
                self._finish(req, tokens[-1].finish_reason)
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


def _advance(req: RequestState, num_new: int, extra: int = 0) -> tuple[RequestState, int, int, int]:
    """Advance the request past a step whose first pass computes `num_new` of its tokens;
    its entry in that InFlightStep. The step samples when its first pass catches the
    request up with every token it has or has in flight; a multi-step step then decodes
    it in `extra` passes more (each computes the token the one before sampled)."""
    computed = req.num_computed_tokens = req.num_computed_tokens + num_new
    if computed != req.num_tokens + req.num_pending:
        return req, num_new, computed, 0
    computed = req.num_computed_tokens = computed + extra
    req.num_pending += 1 + extra
    return req, num_new, computed, 1 + extra
