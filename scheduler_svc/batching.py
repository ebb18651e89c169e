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

The step carries admitted requests in full (prompt + outputs so far, block table) and
running ones as diffs (the block ids allocated this step). num_computed_tokens advances
when the step is built: the worker computes exactly what was scheduled. `update` then
offers the blocks the step filled to the prefix cache, appends the sampled tokens and
finishes requests the worker finished.

Parallel sampling (`NewRequest.n > 1`): the parent computes its prompt but the last token,
then (in `update`, once it has) forks into n children `f"{request_id}/{i}"` that share
every block (`KVCacheManager.fork`); the parent is forgotten (finished_request_ids) and
each child goes to the worker as a new request holding the shared table, with
`child_seed(seed, i)` when the parent had a seed (ids and seeds: proto/parallel.py). A
child's first step computes the last prompt token into its last block: when that block
is partly filled and still shared, the child gets a fresh block and the step carries the
copy (`blocks_to_copy`) -- all but the last child to get there copy; the last one keeps
the original. Aborting the parent's id aborts the parent before its fork and its
unfinished children after; a child's id aborts that child alone (before the fork there is
no such child yet and the abort is ignored: the gateway stops a choice only after its
first token).

Calls alternate: schedule() -> (worker runs the step) -> update(); requests may be added
or aborted at any time, also while a step is in flight.

Invariants (checked by `check_integrity`):
- every unfinished request is in exactly one of `waiting`, `running` and `swapped`, each
  sorted by (priority, arrival, request id);
- a swapped request holds CPU blocks for exactly its computed tokens and no GPU blocks;
- a waiting request holds no blocks and has num_computed_tokens == 0;
- a running request's block table covers exactly its computed tokens
  (cdiv(num_computed_tokens, block_size) blocks), and it has tokens left to compute
  unless the step that catches it up is in flight;
- len(running) <= max_num_seqs; load_tokens is the sum of the unfinished requests'
  tokens; the KV manager's own invariants hold.
"""

import bisect
from collections.abc import Sequence

import msgspec

from kvstore.kv_cache_manager import KVCacheManager, cdiv
from proto import worker_pb2
from proto.messages import NewRequest, TokenEvent
from proto.parallel import SEPARATOR, child_request_id, child_seed, parent_request_id
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.request import RequestState, RequestStatus, to_pb_sampling
from scheduler_svc.stats import SchedulerStats

_RUNNING = RequestStatus.RUNNING


def _sort_key(req: RequestState) -> tuple[int, float, str]:
    return req.sort_key


def _target_tokens(req: RequestState) -> int:
    """Tokens the request computes before it samples: all it holds, but for a parent of
    n > 1, which stops one short of its prompt and forks (the children compute the last
    prompt token, each sampling its own first output)."""
    return req.num_prompt_tokens - 1 if req.n > 1 else len(req.token_ids)


def _may_use_prefix_cache(req: RequestState) -> bool:
    """False for a request asking for prompt logprobs: they need the logits of every
    prompt token, so it takes nothing from the prefix cache (proto/worker.proto)."""
    return getattr(req.sampling, "prompt_logprobs", None) is None


class BatchScheduler:
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
        self._in_flight: worker_pb2.StepRequest | None = None  # scheduled, not yet updated
        self._in_flight_reqs: list[tuple[RequestState, int]] = []  # its requests, tokens
        # Since this scheduler started, for stats: preemptions, and the tokens admitted
        # requests looked up in the prefix cache and found there.
        self.num_preemptions = 0
        self.num_aborted = 0  # requests aborted while waiting, running or swapped
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

    def get_request(self, request_id: str) -> RequestState | None:
        """The unfinished request with this id, if it is here."""
        return self._requests.get(request_id)

    def cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """Tokens of this sequence's prefix an admission here would find in the prefix
        cache now (full blocks, its last token excluded); 0 with caching off. Changes
        nothing; costs one hash and one lookup per block hit, plus one for the miss."""
        return len(self.kv.find_cached_prefix(token_ids, [])) * self.kv.block_size

    def stats(self) -> SchedulerStats:
        """Block pool and prefix cache accounting now (O(num_blocks); call it when idle
        or now and then, not every step)."""
        kv, pool = self.kv, self.kv.block_pool
        used = kv.num_blocks - kv.num_free_blocks
        # Shared blocks are full: subtract the tokens block tables count more than once.
        held = (sum(req.num_computed_tokens for req in self.running)
                - kv.block_size * kv.num_shared_references())
        slots = used * kv.block_size
        return SchedulerStats(
            num_blocks=kv.num_blocks, num_used_blocks=used,
            num_cached_blocks=pool.num_cached_free_blocks(), num_free_blocks=kv.num_free_blocks,
            num_running=self.num_running, num_waiting=self.num_waiting,
            num_preemptions=self.num_preemptions, num_steps=self.num_steps,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits, num_evicted_blocks=pool.num_evictions,
            kv_waste=1.0 - held / slots if slots else 0.0,
            num_swapped=len(self.swapped), num_swapped_out=self.num_swapped_out,
            num_cpu_blocks=kv.num_cpu_blocks, num_free_cpu_blocks=kv.cpu_pool.num_free_blocks,
            num_forks=self.num_forks, num_cow_copies=self.num_cow_copies,
            num_aborted=self.num_aborted)

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
        bisect.insort(self.waiting, state, key=_sort_key)
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
        the next step). Raises RuntimeError while the previous step awaits update()."""
        if self._in_flight is not None:
            raise RuntimeError(f"step {self._in_flight.step_id} is in flight: call update() first")
        budget = self.config.max_num_batched_tokens
        threshold = self.config.long_prefill_token_threshold
        scheduled: dict[str, int] = {}  # request id -> tokens to compute, in step order
        new_blocks: dict[str, list[int]] = {}  # request id -> block ids allocated now
        preempted = False

        running, allocate, unsent = self.running, self.kv.allocate_slots, self._unsent
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            num_new = _target_tokens(req) - req.num_computed_tokens
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
                victim = running.pop()  # largest key; index >= i, so not scheduled yet
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

        # After a preemption the pool is full: resuming or admitting now would only thrash.
        swapped, max_seqs = self.swapped, self.config.max_num_seqs
        num_seqs = self._num_seqs()
        while not preempted and swapped and budget > 0 and num_seqs + swapped[0].n <= max_seqs:
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
            bisect.insort(running, req, key=_sort_key)
            num_seqs += req.n
            scheduled[req.request_id] = num_new
            new_blocks[req.request_id] = ids
            budget -= num_new

        admitted: list[RequestState] = []
        while (not preempted and not swapped and self.waiting and budget > 0
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
            bisect.insort(running, req, key=_sort_key)
            num_seqs += req.n
            admitted.append(req)
            scheduled[req.request_id] = num_new
            budget -= num_new

        if not scheduled:
            return None
        return self._build_step(scheduled, new_blocks, admitted)

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

    def _preempt(self, req: RequestState) -> None:
        """Preempt a request already removed from `running`: by swap when that is the
        mode and the CPU swap space has room for its blocks, else by recompute (always for
        a forked child the worker has not seen yet)."""
        req.num_preemptions += 1
        self.num_preemptions += 1
        rid = req.request_id
        self._copies.pop(rid, None)  # its copy-on-write target goes back to the pool
        if rid in self._unsent:
            self._unsent.discard(rid)
        elif self.config.preemption_mode == "swap" and self.kv.can_swap_out(rid):
            self._swap_out[rid] = self.kv.swap_out(rid)
            self._replaced.discard(rid)
            req.status = RequestStatus.SWAPPED
            self.num_swapped_out += 1
            bisect.insort(self.swapped, req, key=_sort_key)
            return
        self.kv.free(rid)
        req.reset_for_recompute()
        # Back by (priority, arrival): the front of the queue unless a request of higher
        # priority waits, so it resumes before anything that arrived after it.
        bisect.insort(self.waiting, req, key=_sort_key)
        self._finished_ids.append(req.request_id)

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
            reqs.append((req, num_new))
            req.num_computed_tokens += num_new
        for req in admitted:
            num_new = scheduled[req.request_id]
            step.new_requests.add(
                request_id=req.request_id, token_ids=req.token_ids,
                num_prompt_tokens=req.num_prompt_tokens,
                block_ids=self.kv.block_ids(req.request_id),
                num_computed_tokens=req.num_computed_tokens,
                sampling=to_pb_sampling(req.sampling), reply_channel=req.reply_channel)
            reqs.append((req, num_new))
            req.num_computed_tokens += num_new
        step.num_scheduled_tokens.update(scheduled)
        self._finished_ids = []
        self._next_step_id += 1
        self._in_flight = step
        self._in_flight_reqs = reqs
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
        in_flight = self._in_flight_reqs
        if unscheduled := [rid for rid in sampled if rid not in step.num_scheduled_tokens]:
            raise ValueError(
                f"step {step.step_id}: tokens for unscheduled requests {sorted(unscheduled)}")
        # Requests aborted while the step was in flight are FINISHED: their tokens are dropped.
        live = [(req, n) for req, n in in_flight if req.status is _RUNNING]
        for req, _ in live:
            # The worker samples exactly when the step catches a request up.
            caught_up = req.num_computed_tokens == len(req.token_ids)
            if caught_up != (req.request_id in sampled):
                raise ValueError(
                    f"step {step.step_id}: request {req.request_id} "
                    f"{'needs' if caught_up else 'must not get'} a sampled token "
                    f"({req.num_computed_tokens} of {req.num_tokens} tokens computed)")

        self._in_flight = None
        self._in_flight_reqs = []
        caching, bs = self.kv.enable_prefix_caching, self.kv.block_size
        finished = []
        for req, n in live:  # in step order, so finished requests come back in order
            computed = req.num_computed_tokens
            if caching and computed % bs < n:  # the step filled a block
                self.kv.cache_full_blocks(req.request_id, req.token_ids, req.block_hashes, computed)
            token = sampled.get(req.request_id)
            if token is None:
                if req.n > 1 and computed == req.num_prompt_tokens - 1:
                    self._fork(req)
                continue
            req.token_ids.append(token.token_id)
            self._load_tokens += 1
            if token.finish_reason:
                self._finish(req, token.finish_reason)
                finished.append(req)
        return finished

    def _make_children(self, parent: RequestState) -> list[RequestState]:
        seed = parent.sampling.seed
        return [RequestState(
            request_id=child_request_id(parent.request_id, i), token_ids=list(parent.token_ids),
            num_prompt_tokens=parent.num_prompt_tokens,
            sampling=(parent.sampling if seed is None
                      else msgspec.structs.replace(parent.sampling, seed=child_seed(seed, i))),
            reply_channel=parent.reply_channel, arrival_time=parent.arrival_time,
            priority=parent.priority, num_computed_tokens=parent.num_computed_tokens,
            status=parent.status, block_hashes=list(parent.block_hashes),
            parent_id=parent.request_id) for i in range(parent.n)]

    def _fork(self, parent: RequestState) -> None:
        """Replace a running parent that computed all of its prompt but the last token by
        its n children, sharing its blocks; the worker forgets the parent."""
        pid = parent.request_id
        children = self._make_children(parent)
        self.running.remove(parent)
        del self._requests[pid]
        for child in children:
            self.kv.fork(pid, child.request_id)
            self._requests[child.request_id] = child
            self._unsent.add(child.request_id)
            bisect.insort(self.running, child, key=_sort_key)
        self.kv.free(pid)
        self._children[pid] = {child.request_id for child in children}
        self._load_tokens += (len(children) - 1) * parent.num_tokens
        parent.status = RequestStatus.FINISHED
        self._finished_ids.append(pid)
        self.num_forks += len(children)

    def _forget_child(self, req: RequestState) -> None:
        if req.parent_id is not None and (siblings := self._children.get(req.parent_id)):
            siblings.discard(req.request_id)
            if not siblings:
                del self._children[req.parent_id]

    def has_children(self, parent_id: str) -> bool:
        """True while some child forked from `parent_id` is unfinished here."""
        return bool(self._children.get(parent_id))

    def _finish(self, req: RequestState, reason: str) -> None:
        self._forget_child(req)
        self.running.remove(req)
        del self._requests[req.request_id]
        self._load_tokens -= req.num_tokens
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
        states = sorted(self.waiting + self.running + self.swapped, key=_sort_key)
        for req in self.running + self.swapped:
            self.kv.free(req.request_id)
            self._finished_ids.append(req.request_id)
        for req in states:
            req.reset_for_recompute()
        self.waiting, self.running, self.swapped = [], [], []
        self._swap_out, self._swap_in, self._copies, self._replaced = {}, [], {}, set()
        self._unsent, self._children = set(), {}  # children re-route as n == 1 requests
        self._requests.clear()
        self._load_tokens = 0
        self._in_flight = None
        self._in_flight_reqs = []
        return states

    # -- self-check ----------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError with a clear message unless every invariant in the module
        docstring holds."""
        self.kv.check_integrity()
        waiting_ids = [req.request_id for req in self.waiting]
        running_ids = [req.request_id for req in self.running]
        swapped_ids = [req.request_id for req in self.swapped]
        assert not set(waiting_ids) & set(running_ids), (
            f"requests both waiting and running: {set(waiting_ids) & set(running_ids)}")
        assert sorted(waiting_ids + running_ids + swapped_ids) == sorted(self._requests), (
            "waiting + running + swapped differ from the unfinished requests")
        assert self.swapped == sorted(self.swapped, key=_sort_key), "swapped is out of order"
        for req in self.swapped:
            rid = req.request_id
            assert req.status is RequestStatus.SWAPPED, f"swapped {rid} is {req.status}"
            assert not self.kv.block_ids(rid), f"swapped {rid} holds GPU blocks"
            assert self.kv.num_swapped_blocks(rid) == cdiv(req.num_computed_tokens, self.kv.block_size), (
                f"swapped {rid} holds {self.kv.num_swapped_blocks(rid)} CPU blocks for "
                f"{req.num_computed_tokens} computed tokens")
        total = sum(req.num_tokens for req in self._requests.values())
        assert self._load_tokens == total, f"load_tokens {self._load_tokens} != {total}"
        assert self.waiting == sorted(self.waiting, key=_sort_key), "waiting is out of order"
        assert self.running == sorted(self.running, key=_sort_key), "running is out of order"
        assert self._num_seqs() <= self.config.max_num_seqs, (
            f"{self._num_seqs()} sequences running > max_num_seqs {self.config.max_num_seqs}")
        assert self._unsent <= set(running_ids), f"unsent children not running: {self._unsent}"
        assert self._copies.keys() <= self._unsent, "a copy-on-write for a request already sent"
        for parent_id, children in self._children.items():
            assert children and children <= self._requests.keys(), (
                f"parent {parent_id}: children {children} not all unfinished here")
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
