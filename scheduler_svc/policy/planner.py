"""What the next step computes for one worker: the scheduling rule.

One rule, as in vLLM v1 (no prefill/decode phases): every request asks for
`len(token_ids) - num_computed_tokens` tokens -- a chunk of its prompt, or 1 to decode --
and a step computes as many as the token budget and `max_num_seqs` allow:

1. Running requests first, in (priority, arrival) order. Each gets slots for its tokens;
   when blocks run out, the running request with the largest (priority, arrival) is
   preempted (scheduler_svc/policy/preemption.py says how) and the allocation is retried.
   Running is kept sorted, so the victim is always the last one and never one already
   planned this step; when the victim is the request itself, nothing more fits and
   planning stops.
2. If nobody was preempted, swapped requests resume first, in (priority, arrival) order
   (fresh GPU blocks, blocks_to_swap_in, the full new block table sent with
   replace_block_ids), until one does not fit.
3. If nobody was preempted and nothing is swapped out, waiting requests are admitted in
   (priority, arrival) order (a parent of n > 1 counts as n sequences), their prefill
   chunked to the remaining budget, until one does not fit (no overtaking). With prefix
   caching, an admitted request starts from the longest cached prefix of its tokens
   (prompt + outputs, so a preempted request finds its own blocks again if they were not
   evicted): those blocks are shared, and only the rest is computed.

Images (Gemma 3: the soft tokens of one image attend to each other both ways) are never
split across prefill chunks, as vLLM does for Gemma 3. The rule, applied to every chunk
above after the threshold and budget caps (`fit_images`): a chunk that would end strictly
inside an image's range ends at that image's start instead; when that leaves nothing (the
image starts at num_computed_tokens), the chunk is the whole image if the budget left holds
it (long_prefill_token_threshold never splits an image), and otherwise the request computes
nothing this step: a running one is passed over (the requests after it still run), a
swapped or waiting head stops resuming / admitting as a head that does not fit does. So
num_computed_tokens is never strictly inside an image (BatchScheduler.check_integrity), and
a prefix-cache hit that would end inside one is cut back to the last block boundary at or
before its start (image_ranges.hit_blocks).
Why never split rather than an exact split: the first chunk's image tokens attend to the
later chunks' ones, so an exact split would need the later half's K/V before the first
half's attention -- computing the image twice, or holding its queries across steps. One
step per image (at most max_num_batched_tokens tokens) needs neither.
No starvation: an image longer than max_num_batched_tokens is refused on arrival
(BatchScheduler.add_request), so every image fits a step's whole budget. Only requests
ahead of a waiting image in (priority, arrival) order are planned before it, and nothing
behind a swapped or waiting head is resumed or admitted meanwhile; those ahead finish their
prefills, then take one token a step until they finish, so the budget left to the image
grows until it fits -- at the latest when it is the first request with work in a step (as
for any request, a stream of higher-priority arrivals can delay it).

Encoder work (scheduler_svc/policy/encoder_budget.py): with `encoder_budget` N > 0 (auto: 2 on a
CPU worker, resolved by BatchScheduler.for_worker), a step makes
its worker encode at most N images the worker does not hold (by the planner's mirror of its
encoder cache); a chunk that cannot afford its next image ends at that image's start, and
when that leaves nothing the request waits for a later step, as for the token budget. Every
step's images then go into the mirror.

Planned ahead (a step in flight: async scheduling), the step assumes every request the
step in flight samples for gets its token (`num_pending`), and never preempts, swaps or
forks: a running request that cannot grow without a preemption ends the step there
(`ahead_blocked`: the next one is planned after the result, with nothing in flight), and
a request about to sample its last token (max_tokens) or to fork (n > 1) waits for it.
"""

from dataclasses import dataclass, field

from kvstore.kv_cache_manager import KVCacheManager
from scheduler_svc.policy.config import SchedulerConfig
from scheduler_svc.policy.encoder_budget import EncoderCacheMirror, StepEncoderBudget
from scheduler_svc.policy.fork import ForkManager
from scheduler_svc.policy.image_ranges import hit_blocks, image_inside
from scheduler_svc.policy.preemption import Preemptor
from scheduler_svc.policy.queues import RequestQueues
from scheduler_svc.policy.request import SchedulerRequest


# (request, tokens the step computes for it from its num_computed_tokens, block ids): for a
# running request the worker holds, the blocks allocated for this step (appended to its
# table); otherwise its whole block table. Read once, by StepBuilder.build.
PlannedRequest = tuple[SchedulerRequest, int, list[int]]


@dataclass(slots=True)
class StepPlan:
    """One step, in step order."""

    running: list[PlannedRequest] = field(default_factory=list)  # the worker holds them: diffs
    resumed: list[PlannedRequest] = field(default_factory=list)  # swapped in: a new table each
    new: list[PlannedRequest] = field(default_factory=list)  # admitted, then forked children: in full
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, gpu block)

    def __bool__(self) -> bool:
        return bool(self.running or self.resumed or self.new)


class StepPlanner:
    def __init__(self, config: SchedulerConfig, queues: RequestQueues, kv: KVCacheManager,
                 forks: ForkManager, preemptor: Preemptor, encoder_cache_items: int = 0) -> None:
        self._config = config
        self._queues = queues
        self._kv = kv
        self._forks = forks
        self._preemptor = preemptor
        # The last step planned ahead stopped short of a running request (it needed a
        # preemption): the next one waits for the result, so it may preempt.
        self._ahead_blocked = False
        # Since start: tokens of admitted requests looked up in the prefix cache, and found.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Which image embeddings the worker holds, as its steps tell (routing reads it too).
        self.encoder_cache = EncoderCacheMirror(encoder_cache_items)
        self._encoding: StepEncoderBudget | None = None  # the step being planned's

    @property
    def ahead_blocked(self) -> bool:
        return self._ahead_blocked

    def reset(self) -> None:
        """Nothing in flight any more (drained)."""
        self._ahead_blocked = False

    def plan(self, ahead: bool) -> StepPlan | None:
        """The next step (after the one in flight, with `ahead`), or None when nothing can
        run. Allocates its blocks and moves requests between queues as it goes."""
        self._ahead_blocked = False
        if self._config.encoder_budget:
            self._encoding = StepEncoderBudget(self._config.encoder_budget, self.encoder_cache)
        plan, children = StepPlan(), []
        budget, full = self._plan_running(plan, children, ahead)
        # After a preemption the pool is full: resuming or admitting now would only thrash.
        if not full:
            num_seqs = self._queues.num_running_seqs()
            budget, num_seqs = self._resume_swapped(plan, budget, num_seqs)
            if not self._queues.swapped:
                self._admit_waiting(plan, budget, num_seqs)
        plan.new.extend(children)
        if not plan:
            return None
        self.encoder_cache.touch_step((r, n) for r, n, _ in (*plan.running, *plan.resumed, *plan.new))
        return plan

    def _plan_running(self, plan: StepPlan, children: list[PlannedRequest], ahead: bool) -> tuple[int, bool]:
        """Step 1 of the rule; returns (the budget left, whether the pool ran out)."""
        budget = self._config.max_num_batched_tokens
        threshold = self._config.long_prefill_token_threshold
        running, allocate, forks = self._queues.running, self._kv.allocate_slots, self._forks
        forked = forks.has_unsent()  # else (the common case) no fork call per request
        full = False
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            num_new = req.target_tokens + req.num_pending - req.num_computed_tokens
            if ahead and (num_new <= 0 or req.samples_its_last_token()):
                i += 1  # it forks, or finishes, when the step in flight comes back
                continue
            assert num_new > 0, f"request {req.request_id} has nothing to compute"
            if threshold and num_new > threshold:
                num_new = threshold
            if num_new > budget:
                num_new = budget
            if req.num_computed_tokens < req.images_end:  # a prefill chunk that may reach an image
                num_new = fit_images(req, req.num_computed_tokens, num_new, budget)
                if num_new and self._encoding is not None:
                    num_new = self._encoding.fit(req, req.num_computed_tokens, num_new)
                if num_new == 0:
                    i += 1  # its next image does not fit the budget left: a later step
                    continue
            while True:
                # A forked child about to write into its shared, partly filled last block
                # gets its own copy first.
                cow = not forked or forks.copy_on_write(req)
                ids = allocate(req.request_id, req.num_computed_tokens + num_new,
                               num_computed_tokens=req.num_computed_tokens) if cow else None
                if ids is not None:
                    break
                full = True
                if ahead:  # no preemption before the result: the step ends here
                    self._ahead_blocked = True
                    break
                victim = self._queues.pop_victim()  # largest key; index >= i, so not planned yet
                self._preemptor.preempt(victim, may_swap=not forks.preempted(victim.request_id))
                if victim is req:
                    break
            if ids is None:  # preempted itself, or ahead: nothing else can grow this step
                break
            if forked and forks.is_unsent(req.request_id):  # a forked child: in full, with its (shared) table
                forks.mark_sent(req.request_id)
                children.append((req, num_new, self._kv.block_ids(req.request_id)))
            else:
                plan.running.append((req, num_new, ids))
            budget -= num_new
            i += 1
        return budget, full

    def _resume_swapped(self, plan: StepPlan, budget: int, num_seqs: int) -> tuple[int, int]:
        """Step 2 of the rule; returns the budget and sequences running after it."""
        swapped, max_seqs = self._queues.swapped, self._config.max_num_seqs
        while swapped and budget > 0 and num_seqs + swapped[0].n <= max_seqs:
            req = swapped[0]
            num_new = self._num_new_tokens(req, req.num_computed_tokens, budget)
            if num_new == 0:
                break  # its next image does not fit the budget left; later ones wait too
            pairs = self._kv.swap_in(req.request_id, req.num_computed_tokens + num_new, req.num_computed_tokens)
            if pairs is None:
                break  # resumes in order: later ones wait too
            ids = self._kv.allocate_slots(req.request_id, req.num_computed_tokens + num_new,
                                          num_computed_tokens=req.num_computed_tokens)
            assert ids is not None, "swap_in checked the room for the step's tokens"
            self._queues.resume_head_swapped()
            plan.swap_in.extend(pairs)
            plan.resumed.append((req, num_new, self._kv.block_ids(req.request_id)))
            num_seqs += req.n
            budget -= num_new
        return budget, num_seqs

    def _admit_waiting(self, plan: StepPlan, budget: int, num_seqs: int) -> None:
        """Step 3 of the rule."""
        waiting, kv, max_seqs = self._queues.waiting, self._kv, self._config.max_num_seqs
        while waiting and budget > 0 and num_seqs + waiting[0].n <= max_seqs:
            req = waiting[0]
            lookup = kv.enable_prefix_caching and req.uses_prefix_cache
            cached = kv.find_cached_prefix(req.token_ids, req.block_hashes, req.block_extra_keys(kv.block_size),
                                           fit=_hit_fit(req, kv.block_size)) if lookup else []
            num_cached = len(cached) * kv.block_size
            num_new = self._num_new_tokens(req, num_cached, budget)
            if num_new == 0:
                break  # its next image does not fit the budget left (no overtaking)
            if kv.allocate_slots(req.request_id, num_cached + num_new, cached) is None:
                break  # later arrivals do not overtake the head of the queue
            self._queues.admit_head(num_cached)
            if lookup:
                self.prefix_cache_queries += req.num_tokens
                self.prefix_cache_hits += num_cached
            plan.new.append((req, num_new, kv.block_ids(req.request_id)))
            num_seqs += req.n
            budget -= num_new

    def _num_new_tokens(self, req: SchedulerRequest, num_computed: int, budget: int) -> int:
        """Tokens a request with `num_computed` tokens computed computes this step: all it
        lacks, capped by the per-request threshold and by the budget left, then fitted to
        its images (`fit_images`) and to the encoder budget (0: its next image does not fit)."""
        num_new = req.target_tokens - num_computed
        assert num_new > 0, f"request {req.request_id} has nothing to compute"
        if self._config.long_prefill_token_threshold:
            num_new = min(num_new, self._config.long_prefill_token_threshold)
        num_new = min(num_new, budget)
        if num_computed < req.images_end:
            num_new = fit_images(req, num_computed, num_new, budget)
            if num_new and self._encoding is not None:
                num_new = self._encoding.fit(req, num_computed, num_new)
        return num_new


def _hit_fit(req: SchedulerRequest, block_size: int):
    """The largest prefix hit <= m blocks the request can take (None: any): a parent
    (n > 1) computes at least one token before it forks, and a hit never ends inside an image."""
    if req.n == 1 and not req.mm_inputs:
        return None
    limit = (req.num_prompt_tokens - 2) // block_size if req.n > 1 else None

    def fit(m: int) -> int:
        if limit is not None:
            m = min(m, limit)
        return hit_blocks(req.mm_inputs, m, block_size) if req.mm_inputs and m else m
    return fit


def fit_images(req: SchedulerRequest, start: int, num_new: int, budget: int) -> int:
    """The chunk `start .. start + num_new` (capped already; `start` not inside an image)
    fitted to the request's images: ended at the start of the image it would end inside,
    or when that image starts the chunk, the whole image if `budget` holds it, else 0."""
    image = image_inside(req.mm_inputs, start + num_new)
    if image is None:
        return num_new
    if image.offset > start:
        return image.offset - start
    assert image.offset == start, f"request {req.request_id}: chunk starts inside an image at {start}"
    assert start + image.length <= req.target_tokens, (
        f"request {req.request_id}: image at {start} reaches past its {req.target_tokens} tokens to compute")
    return image.length if image.length <= budget else 0
