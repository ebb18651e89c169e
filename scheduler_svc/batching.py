"""The batching core for one worker: requests in, one step plan out, step results in.

One rule, as in vLLM v1 (no prefill/decode phases): every request asks for
`len(token_ids) - num_computed_tokens` tokens -- a chunk of its prompt, or 1 to decode --
and a step computes as many as the token budget and `max_num_seqs` allow:

1. Running requests first, in (priority, arrival) order. Each gets slots for its tokens;
   when blocks run out, the running request with the largest (priority, arrival) is
   preempted and the allocation is retried. By recompute (the default): blocks freed,
   back to WAITING with num_computed_tokens = 0, its id sent in finished_request_ids.
   By swap (preemption_mode "swap", when the worker's CPU swap space has room): its
   blocks move to CPU blocks (the step's blocks_to_swap_out), it goes to SWAPPED keeping
   num_computed_tokens, and the worker keeps its state (swapped_out_request_ids).
   Running is kept sorted, so the victim is always the last one and never one already
   scheduled this step; when the victim is the request itself, nothing more fits and
   scheduling stops.
2. If nobody was preempted, swapped requests resume first, in (priority, arrival) order
   (fresh GPU blocks, blocks_to_swap_in, the full new block table sent with
   replace_block_ids), until one does not fit.
3. If nobody was preempted and nothing is swapped out, waiting requests are admitted in
   (priority, arrival) order (a parent of n > 1 counts as n sequences),
   their prefill chunked to the remaining budget, until one does not fit (no overtaking).
   With prefix caching, an admitted request starts from the longest cached prefix of its
   tokens (prompt + outputs, so a preempted request finds its own blocks again if they
   were not evicted): those blocks are shared, and only the rest is computed.

The step message and `update`: scheduler_svc/step.py. Preemption and `drain`:
scheduler_svc/preemption.py. Parallel sampling (n > 1): scheduler_svc/fork.py. The
invariants, checked by `check_integrity`: scheduler_svc/integrity.py.

Calls alternate: schedule() -> (worker runs the step) -> update(); requests may be added
or aborted at any time, also while a step is in flight.

Scheduling ahead (vLLM's async scheduling, on for accelerator workers): with a step in
flight, `can_schedule_ahead()` says whether schedule() may plan the next; see step.py.
Multi-step (num_scheduler_steps > 1): a step planned with nothing in flight, nothing
waiting or swapped and no preemption lets its decodes run several passes on the worker;
see step.py too.
"""

import bisect
from collections.abc import Sequence

from kvstore.kv_cache_manager import KVCacheManager, cdiv
from proto import worker_pb2
from proto.messages import NewRequest, TokenEvent
from proto.parallel import SEPARATOR, parent_request_id
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.fork import ForkMixin
from scheduler_svc.integrity import IntegrityMixin
from scheduler_svc.preemption import PreemptionMixin
from scheduler_svc.request import RequestState, RequestStatus, by_sort_key
from scheduler_svc.stats import SchedulerStats, scheduler_stats
from scheduler_svc.step import InFlightStep, StepMixin

_RUNNING = RequestStatus.RUNNING


def _target_tokens(req: RequestState) -> int:
    """Tokens the request computes before it samples: all it holds, but for a parent of
    n > 1, which stops one short of its prompt and forks (the children compute the last
    prompt token, each sampling its own first output)."""
    return req.num_prompt_tokens - 1 if req.n > 1 else len(req.token_ids)


def _samples_its_last_token(req: RequestState) -> bool:
    """True when the tokens in flight for the request reach its max_tokens: the step in
    flight finishes it."""
    return req.num_pending > 0 and req.num_output_tokens + req.num_pending >= req.sampling.max_tokens


def _may_use_prefix_cache(req: RequestState) -> bool:
    """False for a request asking for prompt logprobs: they need the logits of every
    prompt token, so it takes nothing from the prefix cache (proto/worker.proto)."""
    return getattr(req.sampling, "prompt_logprobs", None) is None


class BatchScheduler(StepMixin, PreemptionMixin, ForkMixin, IntegrityMixin):
    """Scheduling state for one worker with `num_blocks` KV blocks of `block_size` tokens."""

    def __init__(self, config: SchedulerConfig, num_blocks: int, block_size: int,
                 max_model_len: int, num_cpu_blocks: int = 0) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(num_blocks, block_size, config.enable_prefix_caching,
                                 num_cpu_blocks=num_cpu_blocks if config.preemption_mode == "swap" else 0)
        self.waiting: list[RequestState] = []  # sorted by sort_key; head is admitted first
        self.running: list[RequestState] = []  # sorted by sort_key; tail is preempted first
        self.swapped: list[RequestState] = []  # sorted by sort_key; head resumes first
        # Block copies for the next step: swap-outs by request (an abort before the step
        # goes out drops its own), swap-ins, copy-on-write copies; swapped-out request ids.
        self._swap_out: dict[str, list[tuple[int, int]]] = {}
        self._swap_in: list[tuple[int, int]] = []
        self._replaced: set[str] = set()  # requests whose whole block table goes out again
        self._copies: dict[str, tuple[int, int]] = {}  # by request (a preemption drops its own)
        self._unsent: set[str] = set()  # forked children the worker has not seen yet
        self._children: dict[str, set[str]] = {}  # parent id -> its unfinished children
        self.num_swapped_out = 0
        self.num_forks = 0
        self.num_cow_copies = 0
        self._requests: dict[str, RequestState] = {}  # every unfinished request, by id
        self._load_tokens = 0  # sum of their num_tokens
        self._finished_ids: list[str] = []  # for the worker to forget in the next step
        self._next_step_id = 1
        self._in_flight: list[InFlightStep] = []  # scheduled, not yet updated; oldest first
        # A step planned ahead stopped short of a running request (it needed a preemption):
        # the next step waits for update(), so it may preempt.
        self._ahead_blocked = False
        # Since this scheduler started, for stats: preemptions, and the tokens admitted
        # requests looked up in the prefix cache and found there.
        self.num_preemptions = 0
        self.num_aborted = 0  # requests aborted while waiting, running or swapped
        self.num_steps_ahead = 0  # steps planned while one was in flight
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # -- queue state -------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def load_tokens(self) -> int:
        """Tokens of every unfinished request here (prompt + outputs so far)."""
        return self._load_tokens

    @property
    def load(self) -> float:
        """load_tokens as a fraction of this worker's KV capacity; may exceed 1.
        Lowest = least loaded."""
        return self._load_tokens / (self.kv.num_blocks * self.kv.block_size)

    @property
    def num_steps(self) -> int:
        """Steps scheduled so far (the last step_id)."""
        return self._next_step_id - 1

    def has_work(self) -> bool:
        """True iff a request waits or runs; then schedule() returns a step (when no step
        is in flight)."""
        return bool(self._requests)

    @property
    def num_in_flight(self) -> int:
        """Steps scheduled and not updated yet (0, 1, or 2 with a step planned ahead)."""
        return len(self._in_flight)

    def can_schedule_ahead(self) -> bool:
        """True when schedule() may plan the next step before update() of the one in
        flight: exactly one is in flight and it is not a multi-step one, no request is
        swapped out (resuming one waits for update()), and the last step planned ahead had
        room for every request."""
        return (len(self._in_flight) == 1 and not self.swapped and not self._ahead_blocked
                and self._in_flight[0].step.num_passes <= 1)

    def get_request(self, request_id: str) -> RequestState | None:
        """The unfinished request with this id, if it is here."""
        return self._requests.get(request_id)

    def cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """Tokens of this sequence's prefix an admission here would find in the prefix
        cache now (full blocks, its last token excluded); 0 with caching off. Changes
        nothing; costs one hash and one lookup per block hit, plus one for the miss."""
        return len(self.kv.find_cached_prefix(token_ids, [])) * self.kv.block_size

    def stats(self) -> SchedulerStats:
        """Block pool and prefix cache accounting now (scheduler_stats: O(num_blocks); call
        it when idle or now and then, not every step)."""
        return scheduler_stats(self)

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
        state.block_hashes = []  # hashed for another worker (whose block size may differ)
        error = self._why_impossible(state)
        if error is not None:
            state.status = RequestStatus.FINISHED
            state.finish_reason = "error"
            return TokenEvent(request_id=state.request_id, index=state.num_output_tokens,
                              finish_reason="error", error=error, rejected=True)
        self._requests[state.request_id] = state
        self._load_tokens += state.num_tokens
        if state.parent_id is not None:
            self._children.setdefault(state.parent_id, set()).add(state.request_id)
        if state.n > 1 and state.num_prompt_tokens == 1:  # nothing to share: n requests now
            self._requests.pop(state.request_id)
            self._load_tokens -= state.num_tokens
            for child in self._make_children(state):
                self.add_state(child)
            return None
        bisect.insort(self.waiting, state, key=by_sort_key)
        return None

    def _why_impossible(self, req: RequestState) -> str | None:
        """Why the request could never run on this worker, or None if it can."""
        rid, num_prompt, max_tokens = req.request_id, req.num_prompt_tokens, req.sampling.max_tokens
        if req.parent_id is None and parent_request_id(rid) is not None:
            return f"request {rid}: a request id must not contain {SEPARATOR!r} (proto/parallel.py)"
        if num_prompt < 1:
            return f"request {rid} has an empty prompt"
        if max_tokens < 1:
            return f"request {rid} has max_tokens {max_tokens}; it must be >= 1"
        if not 1 <= req.n <= self.config.max_num_seqs:
            return f"request {rid} has n {req.n}; it must be in [1, max_num_seqs {self.config.max_num_seqs}]"
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
        children = self._children.get(request_id)
        if children:  # a forked parent: abort its children
            for child_id in sorted(children):
                self.abort_request(child_id)
            return True
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        self.num_aborted += 1
        self._forget_child(req)
        self._copies.pop(request_id, None)
        self._unsent.discard(request_id)
        self._load_tokens -= req.num_tokens
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status is RequestStatus.SWAPPED:
            self.swapped.remove(req)
            self.kv.free(request_id)  # its CPU blocks, free for another swap-out now,
            self._swap_out.pop(request_id, None)  # so its copy must not go out too
            self._finished_ids.append(request_id)
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
        the next step). With a step in flight, plans the step after it (the module
        docstring); raises RuntimeError unless can_schedule_ahead()."""
        ahead = bool(self._in_flight)
        if ahead and not self.can_schedule_ahead():
            raise RuntimeError(f"step {self._in_flight[-1].step.step_id} is in flight: "
                               f"call update() first")
        self._ahead_blocked = False
        budget = self.config.max_num_batched_tokens
        threshold = self.config.long_prefill_token_threshold
        scheduled: dict[str, int] = {}  # request id -> tokens to compute, in step order
        new_blocks: dict[str, list[int]] = {}  # request id -> block ids allocated now
        full = False  # the pool ran out: a request was preempted, or could not grow ahead

        running, allocate, unsent = self.running, self.kv.allocate_slots, self._unsent
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            num_new = _target_tokens(req) + req.num_pending - req.num_computed_tokens
            if ahead and (num_new <= 0 or _samples_its_last_token(req)):
                i += 1  # it forks, or finishes, when the step in flight comes back
                continue
            assert num_new > 0, f"request {req.request_id} has nothing to compute"
            if threshold and num_new > threshold:
                num_new = threshold
            if num_new > budget:
                num_new = budget
            while True:
                # A forked child about to write into its shared, partly filled last block
                # gets its own copy first.
                cow = (self.kv.copy_on_write(req.request_id, req.num_computed_tokens)
                       if req.request_id in unsent else None)
                if cow:
                    self._copies[req.request_id] = cow
                    self.num_cow_copies += 1
                if cow is not False:
                    ids = allocate(req.request_id, req.num_computed_tokens + num_new)
                    if ids is not None:
                        break
                ids = None
                full = True
                if ahead:  # no preemption before update(): the step ends here
                    self._ahead_blocked = True
                    break
                victim = running.pop()  # largest key; index >= i, so not scheduled yet
                self._preempt(victim)
                if victim is req:
                    break
            if ids is None:  # preempted itself, or ahead: nothing else can grow this step
                break
            scheduled[req.request_id] = num_new
            new_blocks[req.request_id] = ids
            budget -= num_new
            i += 1

        # After a preemption the pool is full: resuming or admitting now would only thrash.
        swapped, max_seqs = self.swapped, self.config.max_num_seqs
        num_seqs = self._num_seqs()
        while not full and swapped and budget > 0 and num_seqs + swapped[0].n <= max_seqs:
            req = swapped[0]
            num_new = self._num_new_tokens(req, req.num_computed_tokens, budget)
            pairs = self.kv.swap_in(req.request_id, req.num_computed_tokens + num_new)
            if pairs is None:
                break  # resumes in order: later ones wait too
            ids = allocate(req.request_id, req.num_computed_tokens + num_new)
            assert ids is not None, "swap_in checked the room for the step's tokens"
            swapped.pop(0)
            self._swap_in.extend(pairs)
            self._replaced.add(req.request_id)
            req.status = _RUNNING
            bisect.insort(running, req, key=by_sort_key)
            num_seqs += req.n
            scheduled[req.request_id] = num_new
            new_blocks[req.request_id] = ids
            budget -= num_new

        admitted: list[RequestState] = []
        while (not full and not swapped and self.waiting and budget > 0
               and num_seqs + self.waiting[0].n <= max_seqs):
            req = self.waiting[0]
            lookup = self.kv.enable_prefix_caching and _may_use_prefix_cache(req)
            cached = self.kv.find_cached_prefix(req.token_ids, req.block_hashes) if lookup else []
            if req.n > 1:  # a parent computes at least one token before it forks
                cached = cached[:(req.num_prompt_tokens - 2) // self.kv.block_size]
            num_cached = len(cached) * self.kv.block_size
            num_new = self._num_new_tokens(req, num_cached, budget)
            ids = allocate(req.request_id, num_cached + num_new, cached)
            if ids is None:
                break  # later arrivals do not overtake the head of the queue
            self.waiting.pop(0)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_cached
            if lookup:
                self.prefix_cache_queries += req.num_tokens
                self.prefix_cache_hits += num_cached
            bisect.insort(running, req, key=by_sort_key)
            num_seqs += req.n
            admitted.append(req)
            scheduled[req.request_id] = num_new
            budget -= num_new

        if not scheduled:
            return None
        # Multi-step (step.py) when nothing waits for a step of its own.
        multi_step = not (ahead or full or admitted or self.waiting or self.swapped)
        extra = self._extra_passes(scheduled, new_blocks) if multi_step else {}
        return self._build_step(scheduled, new_blocks, admitted, extra)

    def _num_new_tokens(self, req: RequestState, num_computed: int, budget: int) -> int:
        """Tokens a request with `num_computed` tokens computed computes this step: all it
        lacks, capped by the per-request threshold and by the budget left."""
        num_new = _target_tokens(req) - num_computed
        assert num_new > 0, f"request {req.request_id} has nothing to compute"
        if self.config.long_prefill_token_threshold:
            num_new = min(num_new, self.config.long_prefill_token_threshold)
        return min(num_new, budget)

    def _num_seqs(self) -> int:
        """Sequences running: a parent not forked yet counts as its n children."""
        return sum(req.n for req in self.running)
