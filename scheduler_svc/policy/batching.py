"""The batching core for one worker: requests in, one step plan out, step results in.

`BatchScheduler` is the composition its callers drive -- the scheduler service (one per
worker) and the in-process engine -- over parts that each own their state:

  queues     RequestQueues (queues.py): every unfinished request, waiting / running /
             swapped, and the load;
  kv         KVCacheManager (kvstore): blocks, block tables, the prefix cache, swap space;
  planner    StepPlanner (planner.py): the scheduling rule -- what the next step computes;
  preemptor  Preemptor (preemption.py): preemption by recompute or swap;
  forks      ForkManager (fork.py): parallel sampling, copy-on-write;
  steps      StepBuilder (step.py): the step message, the steps in flight, their results.

Calls alternate: schedule() -> (worker runs the step) -> update(); requests may be added
or aborted at any time, also while a step is in flight. With a step in flight,
`can_schedule_ahead()` says whether schedule() may plan the next (async scheduling).
"""

from collections.abc import Sequence
from dataclasses import replace

from kvstore.kv_cache_manager import KVCacheManager, cdiv
from proto import worker_pb2
from proto.messages import NO_TOKEN_ID, FinishReason, MultiModalInput, NewRequest, TokenEvent
from proto.parallel import SEPARATOR, parent_request_id
from scheduler_svc.policy.config import SchedulerConfig
from scheduler_svc.policy.encoder_budget import resolve_encoder_budget
from scheduler_svc.policy.fork import ForkManager, make_children
from scheduler_svc.policy.image_ranges import block_extra_keys, hit_blocks, image_inside, why_invalid
from scheduler_svc.policy.planner import StepPlanner
from scheduler_svc.policy.preemption import Preemptor
from scheduler_svc.policy.queues import RequestQueues
from scheduler_svc.policy.request import RequestStatus, SchedulerRequest
from scheduler_svc.policy.stats import SchedulerStats
from scheduler_svc.policy.step import StepBuilder


class BatchScheduler:
    """Scheduling state for one worker with `num_blocks` KV blocks of `block_size` tokens."""

    def __init__(self, config: SchedulerConfig, num_blocks: int, block_size: int,
                 max_model_len: int, num_cpu_blocks: int = 0,
                 group_windows: Sequence[int | None] = (None,), encoder_cache_items: int = 0,
                 embeddings_fingerprint: str = "") -> None:
        """`group_windows`: the window of each KV cache group of the worker's model (None:
        full attention; WorkerInfo.kv_cache_group_windows): a request has a block table per
        group, and a sliding group's blocks behind its window go back to the pool.
        `encoder_cache_items`: the image embeddings the worker's encoder cache holds
        (WorkerInfo.encoder_cache_items; scheduler_svc/policy/encoder_budget.py);
        `embeddings_fingerprint`: what the encoder service publishes them under for it."""
        self.config = config
        self.max_model_len = max_model_len
        self.embeddings_fingerprint = embeddings_fingerprint
        self.kv = KVCacheManager(num_blocks, block_size, config.enable_prefix_caching,
                                 num_cpu_blocks=num_cpu_blocks if config.preemption_mode == "swap" else 0,
                                 group_windows=group_windows)
        self.queues = RequestQueues()
        self.steps = StepBuilder()
        self.forks = ForkManager(self.kv)
        self.preemptor = Preemptor(config.preemption_mode, self.kv, self.queues, self.steps.forget)
        self.planner = StepPlanner(config, self.queues, self.kv, self.forks, self.preemptor, encoder_cache_items)

    @classmethod
    def for_worker(cls, config: SchedulerConfig, info: worker_pb2.WorkerInfo) -> "BatchScheduler":
        """The scheduling state for the worker that `info` describes (an auto encoder
        budget resolved for its device)."""
        config = replace(config, encoder_budget=resolve_encoder_budget(config.encoder_budget, info.device))
        return cls(config, num_blocks=info.num_blocks, block_size=info.block_size,
                   max_model_len=info.max_model_len, num_cpu_blocks=info.num_cpu_blocks,
                   group_windows=tuple(w or None for w in info.kv_cache_group_windows) or (None,),
                   encoder_cache_items=info.encoder_cache_items,
                   embeddings_fingerprint=info.embeddings_fingerprint)

    # -- reading -----------------------------------------------------------------------

    @property
    def load_tokens(self) -> int:
        """Tokens of every unfinished request here (prompt + outputs so far)."""
        return self.queues.load_tokens

    @property
    def load(self) -> float:
        """load_tokens as a fraction of this worker's KV capacity; may exceed 1.
        Lowest = least loaded."""
        return self.queues.load_tokens / (self.kv.num_blocks * self.kv.block_size)

    def has_work(self) -> bool:
        """True iff a request waits or runs; then schedule() returns a step (when no step
        is in flight)."""
        return bool(self.queues)

    def get_request(self, request_id: str) -> SchedulerRequest | None:
        """The unfinished request with this id, if it is here."""
        return self.queues.get(request_id)

    def has_children(self, parent_id: str) -> bool:
        """True while some child forked from `parent_id` is unfinished here."""
        return self.forks.has_children(parent_id)

    def can_schedule_ahead(self) -> bool:
        """True when schedule() may plan the next step before update() of the one in
        flight: exactly one is in flight, no request is swapped out (resuming one waits
        for update()), and the last step planned ahead had room for every request."""
        return self.steps.num_in_flight == 1 and not self.queues.swapped and not self.planner.ahead_blocked

    def cached_prefix_tokens(self, token_ids: Sequence[int], mm_inputs: Sequence[MultiModalInput] = (),
                             hashes: dict | None = None) -> int:
        """Tokens of this sequence's prefix (with the images `mm_inputs` in it) an admission
        here would find in the prefix cache now (full blocks, its last token excluded, not
        ending inside an image); 0 with caching off. Changes nothing; costs one hash and
        one lookup per block hit, plus one for the miss. `hashes`: the sequence's block
        hashes computed so far, shared by the caller across workers (keyed by block size
        and hash function): each block is hashed once however many workers look it up."""
        bs = self.kv.block_size
        own = [] if hashes is None else hashes.setdefault((bs, self.kv.hash_fn), [])
        if not mm_inputs:
            return len(self.kv.find_cached_prefix(token_ids, own)) * bs
        hit = self.kv.find_cached_prefix(token_ids, own, block_extra_keys(mm_inputs, bs),
                                         fit=lambda m: hit_blocks(mm_inputs, m, bs))
        return len(hit) * bs

    def held_image_tokens(self, mm_inputs: Sequence[MultiModalInput], start: int = 0) -> int:
        """Soft tokens of the images at or after `start` whose embeddings this worker holds,
        as far as its steps tell (scheduler_svc/policy/encoder_budget.py)."""
        return self.planner.encoder_cache.held_tokens(mm_inputs, start)

    def note_published(self, content_hashes: Sequence[str]) -> None:
        """The encoder service has published these media's embeddings for this worker: its
        steps read them, they cost no encoder budget."""
        self.planner.encoder_cache.note_published(content_hashes)

    def stats(self) -> SchedulerStats:
        """Block pool and prefix cache accounting now (O(num_blocks): call it when idle or
        now and then, not every step)."""
        kv, pool, queues = self.kv, self.kv.block_pool, self.queues
        used = kv.num_blocks - kv.num_free_blocks
        # Tokens in every group's table; shared blocks are full: subtract the tokens block
        # tables count more than once, and those of blocks given back behind a sliding window.
        held = (sum(req.num_computed_tokens * kv.num_groups - kv.block_size * sum(kv.num_holes(req.request_id))
                    for req in queues.running)
                - kv.block_size * kv.num_shared_references())
        slots = used * kv.block_size
        return SchedulerStats(
            num_blocks=kv.num_blocks, num_used_blocks=used,
            num_cached_blocks=pool.num_cached_free_blocks(), num_free_blocks=kv.num_free_blocks,
            num_running=len(queues.running), num_waiting=len(queues.waiting),
            num_preemptions=self.preemptor.num_preemptions, num_steps=self.steps.num_steps,
            prefix_cache_queries=self.planner.prefix_cache_queries,
            prefix_cache_hits=self.planner.prefix_cache_hits, num_evicted_blocks=pool.num_evictions,
            kv_waste=1.0 - held / slots if slots else 0.0,
            num_swapped=len(queues.swapped), num_swapped_out=self.preemptor.num_swapped_out,
            num_cpu_blocks=kv.num_cpu_blocks, num_free_cpu_blocks=kv.cpu_pool.num_free_blocks,
            num_forks=self.forks.num_forks, num_cow_copies=self.forks.num_cow_copies,
            num_aborted=queues.num_aborted, num_steps_ahead=self.steps.num_steps_ahead,
            group_windows=tuple(w or 0 for w in kv.group_windows), group_used_blocks=tuple(kv.blocks_per_group()))

    def check_integrity(self) -> None:
        """Raise AssertionError with a clear message unless every part's own invariants
        hold (`check_integrity` of each), and those between the queues and the block tables:
        a waiting request holds no blocks; a swapped one CPU blocks for exactly its
        computed tokens and no GPU blocks; a running one's table covers exactly its
        computed tokens (cdiv(num_computed_tokens, block_size) blocks); only running and
        swapped requests hold blocks; no request's num_computed_tokens is strictly inside
        one of its images."""
        kv, queues = self.kv, self.queues
        kv.check_integrity()
        queues.check_integrity(self.config.max_num_seqs)
        self.forks.check_integrity(queues)
        self.steps.check_integrity(queues)
        for req in queues.waiting:
            assert not kv.num_blocks_held(req.request_id), f"waiting {req.request_id} holds blocks"
        for req in queues.swapped:
            rid = req.request_id
            assert not kv.block_ids(rid), f"swapped {rid} holds GPU blocks"
            assert kv.table_length(rid) == cdiv(req.num_computed_tokens, kv.block_size), (
                f"swapped {rid} holds {kv.table_length(rid)} CPU table entries for "
                f"{req.num_computed_tokens} computed tokens")
        for req in (*queues.running, *queues.swapped):
            if req.num_computed_tokens < req.images_end:
                image = image_inside(req.mm_inputs, req.num_computed_tokens)
                assert image is None, (
                    f"{req.request_id} has {req.num_computed_tokens} tokens computed: inside {image}")
        for req in queues.running:
            num_blocks = kv.table_length(req.request_id)
            assert num_blocks == cdiv(req.num_computed_tokens, kv.block_size), (
                f"running {req.request_id} holds {num_blocks} blocks for {req.num_computed_tokens} "
                f"computed tokens (block size {kv.block_size})")
        running = {req.request_id for req in queues.running}
        assert set(kv.request_ids()) <= running, (
            f"blocks held by requests not running: {set(kv.request_ids()) - running}")

    # -- requests in and out -----------------------------------------------------------

    def add_request(self, req: NewRequest) -> TokenEvent | None:
        """Queue a new request. Returns an error event (and queues nothing) when it can
        never run here; None otherwise. A request id already here is ignored (a stream
        entry delivered twice)."""
        if req.request_id in self.queues:
            return None
        return self.add_state(SchedulerRequest.from_new_request(req))

    def add_state(self, state: SchedulerRequest) -> TokenEvent | None:
        """Queue a request taken from another scheduler's `drain()`: it is recomputed from
        its prompt + generated tokens. Returns an error event when it can never run here."""
        if state.status is RequestStatus.FINISHED:
            raise ValueError(f"request {state.request_id} is already finished")
        if state.request_id in self.queues:
            return None
        state.reset_for_recompute()
        state.block_hashes = []  # hashed for another worker (whose block size may differ)
        error = self._why_impossible(state)
        if error is not None:
            state.status = RequestStatus.FINISHED
            state.finish_reason = "error"
            return TokenEvent(request_id=state.request_id, index=state.num_output_tokens,
                              finish_reason="error", error=error, rejected=True)
        if state.n > 1 and (state.num_prompt_tokens == 1  # nothing to share: n requests now
                            # an image holds the fork point (the parent stops one short of its
                            # prompt): the image must be computed whole, so each child does
                            or image_inside(state.mm_inputs, state.num_prompt_tokens - 1) is not None):
            for child in make_children(state):
                self.add_state(child)
            return None
        if state.parent_id is not None:
            self.forks.adopt(state)
        self.queues.add(state)
        return None

    def _why_impossible(self, req: SchedulerRequest) -> str | None:
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
        if (invalid := why_invalid(req.mm_inputs, num_prompt)) is not None:
            return f"request {rid}: {invalid}"
        budget = self.config.max_num_batched_tokens
        for i, image in enumerate(req.mm_inputs):
            if image.length > budget:
                return (f"request {rid}: image {i} has {image.length} soft tokens, more than "
                        f"max_num_batched_tokens {budget} (--max-num-batched-tokens): an image "
                        f"is computed in one step, never split across prefill chunks")
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
        """Drop a request; a forked parent's id drops its unfinished children. False if it
        is not here (unknown or already finished).

        A running or swapped one's blocks are freed now and the worker forgets it in the
        next step; tokens it samples in a step already in flight are ignored by `update`.
        """
        if children := self.forks.children_of(request_id):
            for child_id in children:
                self.abort_request(child_id)
            return True
        req = self.queues.get(request_id)
        if req is None:
            return False
        self._finish(req, "abort")
        return True

    def _finish(self, req: SchedulerRequest, reason: FinishReason) -> None:
        self.forks.forget(req)
        if self.queues.finish(req, reason) is not RequestStatus.WAITING:
            self.kv.free(req.request_id)  # GPU blocks, or a swapped one's CPU blocks
            self.preemptor.drop(req.request_id)
            self.steps.forget(req.request_id)

    def drain(self) -> list[SchedulerRequest]:
        """Remove and return every unfinished request, in (priority, arrival) order, reset
        to recompute elsewhere (`add_state` on another scheduler); frees every block and
        forgets the steps in flight. Tokens they sampled are lost and will be sampled
        again, so the gateway may see an output index twice.

        If this worker is used again, the next step tells it to forget the drained requests.
        """
        for req in [*self.queues.running, *self.queues.swapped]:
            self.kv.free(req.request_id)
            self.steps.forget(req.request_id)
        self.preemptor.clear()
        self.forks.clear()  # children re-route as requests of n == 1
        self.steps.clear()
        self.planner.reset()
        return self.queues.drain()

    # -- one step ----------------------------------------------------------------------

    def schedule(self) -> worker_pb2.StepRequest | None:
        """Plan the next step, or None when nothing can run (finished ids then wait for
        the next step). With a step in flight, plans the step after it
        (scheduler_svc/policy/planner.py); raises RuntimeError unless can_schedule_ahead()."""
        ahead = self.steps.num_in_flight > 0
        if ahead and not self.can_schedule_ahead():
            raise RuntimeError(f"step {self.steps.num_steps} is in flight: call update() first")
        plan = self.planner.plan(ahead)
        if plan is None:
            return None
        return self.steps.build(plan, self.preemptor.take_swap_outs(), self.forks.take_copies())

    def update(self, step: worker_pb2.StepRequest, result: worker_pb2.StepResult) -> list[SchedulerRequest]:
        """Apply the worker's result of `step`, the oldest step in flight.

        Offers every block the step filled to the prefix cache, appends each sampled
        token; a non-empty finish_reason finishes the request (the worker applied the stop
        rule), freeing its blocks; a request the worker failed without computing it
        (token NO_TOKEN_ID, "error": its media could not be had) finishes with "error",
        its blocks neither filled nor cached; a parent of n > 1 that computed its prompt but the last
        token forks. Tokens of requests aborted while the step was in flight are ignored,
        as is a request a step before finished (the worker samples nothing for it).
        Returns the requests finished here, in step order. Raises ValueError, changing
        nothing, when the result breaks the step contract.
        """
        caching, bs = self.kv.enable_prefix_caching, self.kv.block_size
        finished = []
        for scheduled, token in self.steps.take_result(step, result):
            req, computed = scheduled.request, scheduled.num_computed_tokens
            if token is not None and token.token_id == NO_TOKEN_ID:  # failed, nothing computed
                self._finish(req, "error")
                finished.append(req)
                continue
            if token is not None:
                self.queues.append(req, token.token_id)
            if caching and computed % bs < scheduled.num_new_tokens:  # the step filled a block
                self.kv.cache_full_blocks(req.request_id, req.token_ids, req.block_hashes, computed,
                                          req.block_extra_keys(bs))
            if token is None:
                if req.n > 1 and computed == req.num_prompt_tokens - 1:
                    self._fork(req)
            elif token.finish_reason:
                self._finish(req, token.finish_reason)  # type: ignore[arg-type]  # "stop" / "length"
                finished.append(req)
        return finished

    def _fork(self, parent: SchedulerRequest) -> None:
        """Replace a parent that computed its prompt but the last token by its n children,
        sharing its blocks; the worker forgets the parent."""
        children = self.forks.fork(parent)
        self.queues.finish(parent, None)
        for child in children:
            self.queues.add_running(child)
        self.steps.forget(parent.request_id)
