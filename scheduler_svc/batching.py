"""The batching core for one worker: requests in, one step plan out, step results in.

One rule, as in vLLM v1 (no prefill/decode phases): every request asks for
`len(token_ids) - num_computed_tokens` tokens -- a chunk of its prompt, or 1 to decode --
and a step computes as many as the token budget and `max_num_seqs` allow:

1. Running requests first, in (priority, arrival) order. Each gets slots for its tokens;
   when blocks run out, the running request with the largest (priority, arrival) is
   preempted by recompute (blocks freed, back to WAITING with num_computed_tokens = 0,
   its id sent in finished_request_ids) and the allocation is retried. Running is kept
   sorted, so that victim is always the last one and never one already scheduled this
   step; when the victim is the request itself, nothing more fits and scheduling stops.
2. If nobody was preempted, waiting requests are admitted in (priority, arrival) order,
   their prefill chunked to the remaining budget, until one does not fit (no overtaking).

The step carries admitted requests in full (prompt + outputs so far, block table) and
running ones as diffs (the block ids allocated this step). num_computed_tokens advances
when the step is built: the worker computes exactly what was scheduled. `update` then
appends the sampled tokens and finishes requests the worker finished.

Calls alternate: schedule() -> (worker runs the step) -> update(); requests may be added
or aborted at any time, also while a step is in flight.

Invariants (checked by `check_integrity`):
- every unfinished request is in exactly one of `waiting` and `running`, each sorted by
  (priority, arrival, request id);
- a waiting request holds no blocks and has num_computed_tokens == 0;
- a running request's block table covers exactly its computed tokens
  (cdiv(num_computed_tokens, block_size) blocks), and it has tokens left to compute
  unless the step that catches it up is in flight;
- len(running) <= max_num_seqs; the KV manager's own invariants hold.
"""

import bisect

from kvstore.kv_cache_manager import KVCacheManager, cdiv
from proto import worker_pb2
from proto.messages import NewRequest, TokenEvent
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.request import RequestState, RequestStatus, to_pb_sampling


def _sort_key(req: RequestState) -> tuple[int, float, str]:
    return req.sort_key


class BatchScheduler:
    """Scheduling state for one worker with `num_blocks` KV blocks of `block_size` tokens."""

    def __init__(self, config: SchedulerConfig, num_blocks: int, block_size: int,
                 max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(num_blocks, block_size)
        self.waiting: list[RequestState] = []  # sorted by sort_key; head is admitted first
        self.running: list[RequestState] = []  # sorted by sort_key; tail is preempted first
        self._requests: dict[str, RequestState] = {}  # every unfinished request, by id
        self._finished_ids: list[str] = []  # for the worker to forget in the next step
        self._next_step_id = 1
        self._in_flight: worker_pb2.StepRequest | None = None  # scheduled, not yet updated
        self.num_preemptions = 0  # since this scheduler started, for stats

    # -- queue state -------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def load(self) -> float:
        """Tokens of every unfinished request (prompt + outputs so far) as a fraction of
        this worker's KV capacity; may exceed 1. Lowest = least loaded."""
        total = sum(req.num_tokens for req in self._requests.values())
        return total / (self.kv.num_blocks * self.kv.block_size)

    @property
    def num_steps(self) -> int:
        """Steps scheduled so far (the last step_id)."""
        return self._next_step_id - 1

    def has_work(self) -> bool:
        """True iff a request waits or runs; then schedule() returns a step (when no step
        is in flight)."""
        return bool(self._requests)

    def get_request(self, request_id: str) -> RequestState | None:
        """The unfinished request with this id, if it is here."""
        return self._requests.get(request_id)

    # -- requests in -------------------------------------------------------------------

    def add_request(self, req: NewRequest) -> TokenEvent | None:
        """Queue a new request. Returns an error event (and queues nothing) when it can
        never run here; None otherwise. A request id already here is ignored (a stream
        entry delivered twice)."""
        if req.request_id in self._requests:
            return None
        return self.add_state(RequestState.from_new_request(req))

    def add_state(self, state: RequestState) -> TokenEvent | None:
        """Queue a request taken from another scheduler's `drain()`: it is recomputed from
        its prompt + generated tokens. Returns an error event when it can never run here."""
        if state.status is RequestStatus.FINISHED:
            raise ValueError(f"request {state.request_id} is already finished")
        if state.request_id in self._requests:
            return None
        state.reset_for_recompute()
        error = self._why_impossible(state)
        if error is not None:
            state.status = RequestStatus.FINISHED
            state.finish_reason = "error"
            return TokenEvent(request_id=state.request_id, index=state.num_output_tokens,
                              finish_reason="error", error=error)
        self._requests[state.request_id] = state
        bisect.insort(self.waiting, state, key=_sort_key)
        return None

    def _why_impossible(self, req: RequestState) -> str | None:
        """Why the request could never run on this worker, or None if it can."""
        rid, num_prompt, max_tokens = req.request_id, req.num_prompt_tokens, req.sampling.max_tokens
        if num_prompt < 1:
            return f"request {rid} has an empty prompt"
        if max_tokens < 1:
            return f"request {rid} has max_tokens {max_tokens}; it must be >= 1"
        if num_prompt + max_tokens > self.max_model_len:
            return (f"request {rid} needs {num_prompt} prompt + {max_tokens} max_tokens = "
                    f"{num_prompt + max_tokens} tokens, "
                    f"more than max_model_len {self.max_model_len}")
        need = cdiv(req.max_kv_tokens, self.kv.block_size)
        if need > self.kv.num_blocks:
            return (f"request {rid} may hold {req.max_kv_tokens} tokens of K/V = {need} blocks of "
                    f"{self.kv.block_size}, more than this worker's {self.kv.num_blocks} blocks")
        return None

    def abort_request(self, request_id: str) -> bool:
        """Drop a request. False if it is not here (unknown or already finished).

        A running one's blocks are freed now and the worker forgets it in the next step;
        tokens it samples in a step already in flight are ignored by `update`.
        """
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        else:
            self.running.remove(req)
            self.kv.free(request_id)
            self._finished_ids.append(request_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason = "abort"
        return True

    # -- one step ----------------------------------------------------------------------

    def schedule(self) -> worker_pb2.StepRequest | None:
        """Plan the next step, or None when nothing can run (finished ids then wait for
        the next step). Raises RuntimeError while the previous step awaits update()."""
        if self._in_flight is not None:
            raise RuntimeError(f"step {self._in_flight.step_id} is in flight: call update() first")
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}  # request id -> tokens to compute, in step order
        new_blocks: dict[str, list[int]] = {}  # request id -> block ids allocated now
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._num_new_tokens(req, budget)
            while (ids := self.kv.allocate_slots(
                    req.request_id, req.num_computed_tokens + num_new)) is None:
                victim = self.running.pop()  # largest key; index >= i, so not scheduled yet
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if ids is None:  # preempted itself: nothing else can grow this step
                break
            scheduled[req.request_id] = num_new
            new_blocks[req.request_id] = ids
            budget -= num_new
            i += 1

        admitted: list[RequestState] = []
        # After a preemption the pool is full: admitting now would only thrash.
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            num_new = self._num_new_tokens(req, budget)
            ids = self.kv.allocate_slots(req.request_id, req.num_computed_tokens + num_new)
            if ids is None:
                break  # later arrivals do not overtake the head of the queue
            self.waiting.pop(0)
            req.status = RequestStatus.RUNNING
            bisect.insort(self.running, req, key=_sort_key)
            admitted.append(req)
            scheduled[req.request_id] = num_new
            budget -= num_new

        if not scheduled:
            return None
        return self._build_step(scheduled, new_blocks, admitted)

    def _num_new_tokens(self, req: RequestState, budget: int) -> int:
        """Tokens the request computes this step: all it lacks, capped by the per-request
        threshold and by the budget left."""
        num_new = req.num_tokens - req.num_computed_tokens
        assert num_new > 0, f"request {req.request_id} has nothing to compute"
        if self.config.long_prefill_token_threshold:
            num_new = min(num_new, self.config.long_prefill_token_threshold)
        return min(num_new, budget)

    def _preempt(self, req: RequestState) -> None:
        """Recompute preemption of a request already removed from `running`."""
        self.kv.free(req.request_id)
        req.reset_for_recompute()
        req.num_preemptions += 1
        self.num_preemptions += 1
        # Back by (priority, arrival): the front of the queue unless a request of higher
        # priority waits, so it resumes before anything that arrived after it.
        bisect.insort(self.waiting, req, key=_sort_key)
        self._finished_ids.append(req.request_id)

    def _build_step(self, scheduled: dict[str, int], new_blocks: dict[str, list[int]],
                    admitted: list[RequestState]) -> worker_pb2.StepRequest:
        step = worker_pb2.StepRequest(step_id=self._next_step_id,
                                      finished_request_ids=self._finished_ids)
        admitted_ids = {req.request_id for req in admitted}
        for request_id, num_new in scheduled.items():
            req = self._requests[request_id]
            if request_id in admitted_ids:
                step.new_requests.add(
                    request_id=request_id, token_ids=req.token_ids,
                    num_prompt_tokens=req.num_prompt_tokens,
                    block_ids=self.kv.block_ids(request_id),
                    num_computed_tokens=req.num_computed_tokens,
                    sampling=to_pb_sampling(req.sampling), reply_channel=req.reply_channel)
            else:
                # Every block allocated before this step went out in an earlier step.
                step.cached_requests.add(
                    request_id=request_id, new_block_ids=new_blocks[request_id],
                    num_computed_tokens=req.num_computed_tokens)
            step.num_scheduled_tokens[request_id] = num_new
            req.num_computed_tokens += num_new
        self._finished_ids = []
        self._next_step_id += 1
        self._in_flight = step
        return step

    def update(self, step: worker_pb2.StepRequest,
               result: worker_pb2.StepResult) -> list[RequestState]:
        """Apply the worker's result of `step` (the one schedule() returned last).

        Appends each sampled token; a non-empty finish_reason finishes the request (the
        worker applied the stop rule), freeing its blocks. Tokens of requests aborted while
        the step was in flight are ignored. Returns the requests finished here.
        Raises ValueError, changing nothing, when the result breaks the step contract.
        """
        if self._in_flight is None or step.step_id != self._in_flight.step_id:
            raise ValueError(f"step {step.step_id} is not the step in flight")
        if result.step_id != step.step_id:
            raise ValueError(f"result of step {result.step_id} given for step {step.step_id}")
        sampled = {s.request_id: s for s in result.sampled}
        if len(sampled) != len(result.sampled):
            raise ValueError(f"step {step.step_id}: a request sampled twice")
        if unscheduled := sampled.keys() - step.num_scheduled_tokens.keys():
            raise ValueError(
                f"step {step.step_id}: tokens for unscheduled requests {sorted(unscheduled)}")
        # In step order (a protobuf map has none), so finished requests come back in order.
        step_ids = ([r.request_id for r in step.cached_requests]
                    + [r.request_id for r in step.new_requests])
        live = [req for rid in step_ids
                if (req := self._requests.get(rid)) is not None
                and req.status is RequestStatus.RUNNING]
        for req in live:
            # The worker samples exactly when the step catches a request up.
            caught_up = req.num_computed_tokens == req.num_tokens
            if caught_up != (req.request_id in sampled):
                raise ValueError(
                    f"step {step.step_id}: request {req.request_id} "
                    f"{'needs' if caught_up else 'must not get'} a sampled token "
                    f"({req.num_computed_tokens} of {req.num_tokens} tokens computed)")

        self._in_flight = None
        finished = []
        for req in live:
            token = sampled.get(req.request_id)
            if token is None:
                continue
            req.token_ids.append(token.token_id)
            if token.finish_reason:
                self._finish(req, token.finish_reason)
                finished.append(req)
        return finished

    def _finish(self, req: RequestState, reason: str) -> None:
        self.running.remove(req)
        del self._requests[req.request_id]
        self.kv.free(req.request_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason  # type: ignore[assignment]  # the worker's "stop" / "length"
        self._finished_ids.append(req.request_id)

    # -- worker loss ---------------------------------------------------------------------

    def drain(self) -> list[RequestState]:
        """Remove and return every unfinished request, in (priority, arrival) order, reset
        to recompute elsewhere (`add_state` on another scheduler); frees every block and
        forgets the step in flight. Tokens that step sampled are lost and will be sampled
        again, so the gateway may see an output index twice.

        If this worker is used again, the next step tells it to forget the drained requests.
        """
        states = sorted(self.waiting + self.running, key=_sort_key)
        for req in self.running:
            self.kv.free(req.request_id)
            self._finished_ids.append(req.request_id)
        for req in states:
            req.reset_for_recompute()
        self.waiting, self.running = [], []
        self._requests.clear()
        self._in_flight = None
        return states

    # -- self-check ----------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError with a clear message unless every invariant in the module
        docstring holds."""
        self.kv.check_integrity()
        waiting_ids = [req.request_id for req in self.waiting]
        running_ids = [req.request_id for req in self.running]
        assert not set(waiting_ids) & set(running_ids), (
            f"requests both waiting and running: {set(waiting_ids) & set(running_ids)}")
        assert sorted(waiting_ids + running_ids) == sorted(self._requests), (
            "waiting + running differ from the unfinished requests")
        assert self.waiting == sorted(self.waiting, key=_sort_key), "waiting is out of order"
        assert self.running == sorted(self.running, key=_sort_key), "running is out of order"
        assert len(self.running) <= self.config.max_num_seqs, (
            f"{len(self.running)} running > max_num_seqs {self.config.max_num_seqs}")
        for req in self.waiting:
            assert req.status is RequestStatus.WAITING, f"waiting {req.request_id} is {req.status}"
            assert req.num_computed_tokens == 0, f"waiting {req.request_id} has computed tokens"
            assert not self.kv.block_ids(req.request_id), f"waiting {req.request_id} holds blocks"
        in_flight = self._in_flight.num_scheduled_tokens if self._in_flight else {}
        for req in self.running:
            rid = req.request_id
            assert req.status is RequestStatus.RUNNING, f"running {rid} is {req.status}"
            num_blocks = len(self.kv.block_ids(rid))
            assert num_blocks == cdiv(req.num_computed_tokens, self.kv.block_size), (
                f"running {rid} holds {num_blocks} blocks for {req.num_computed_tokens} "
                f"computed tokens (block size {self.kv.block_size})")
            lacking = req.num_tokens - req.num_computed_tokens
            assert lacking > 0 or (lacking == 0 and rid in in_flight), (
                f"running {rid} has {req.num_computed_tokens} of {req.num_tokens} tokens computed")
        assert set(self.kv.request_ids()) <= set(running_ids), (
            f"blocks held by requests not running: {set(self.kv.request_ids()) - set(running_ids)}")
