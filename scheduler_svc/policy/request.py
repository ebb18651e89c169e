"""A request as the scheduler tracks it, and the conversion of its sampling parameters.

Lifecycle: WAITING --admitted--> RUNNING --finish / abort--> FINISHED
                      ^-- preempted (recompute) --'
A preempted or re-routed request keeps every token it generated; it goes back to
WAITING with num_computed_tokens = 0 and is recomputed from prompt + outputs.
With preemption_mode "swap": RUNNING --swapped out--> SWAPPED --swapped in--> RUNNING;
a swapped request keeps num_computed_tokens (its K/V sit in the worker's CPU blocks).

Which queue a request is in, and so its status, and its tokens are RequestQueues' to
change (scheduler_svc/policy/queues.py); a step advances its computed tokens (`advance`).

A request may carry images (`mm_inputs`: ranges of soft tokens in its prompt, in order,
scheduler_svc/policy/image_ranges.py): its num_computed_tokens is never strictly inside one (the
planner computes an image in one step), and they are part of its blocks' prefix-cache keys.
"""

import enum
from dataclasses import dataclass, field

import msgspec

from kvstore.block_hash import BlockExtraKeys
from proto import worker_pb2
from proto.messages import FinishReason, MultiModalInput, NewRequest, SamplingParams
from proto.parallel import request_seed
from scheduler_svc.policy.image_ranges import block_extra_keys, images_end


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued (new, preempted or re-routed); holds no blocks
    RUNNING = "running"  # admitted: holds blocks, the worker holds its state
    SWAPPED = "swapped"  # preempted by swap: holds CPU blocks, the worker keeps its state
    FINISHED = "finished"  # done; finish_reason says why


@dataclass(eq=False)
class SchedulerRequest:
    """Invariants: 0 <= num_computed_tokens <= len(token_ids) + num_pending; the last
    token (with num_pending, the last token in flight) has no K/V until a step computes
    it; num_prompt_tokens <= len(token_ids); num_computed_tokens is never strictly inside
    an image of mm_inputs."""

    request_id: str
    token_ids: list[int]  # prompt, then every output token so far
    num_prompt_tokens: int
    sampling: SamplingParams
    reply_channel: str
    arrival_time: float
    priority: int = 0  # lower runs first
    num_computed_tokens: int = 0  # tokens whose K/V are in this worker's cache
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    # Prefix-cache hashes of the first full blocks of token_ids on this worker's block
    # size, filled in by its KVCacheManager; kept across preemptions, cleared on re-routing.
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    # Parallel sampling: n > 1 on a parent that computes its prompt but its last token,
    # then forks into n children (ids f"{request_id}/{i}") sharing its blocks; a child
    # has n == 1 and names its parent here.
    n: int = 1
    parent_id: str | None = None
    # Tokens that steps in flight sample for it and update() has not appended yet: with
    # steps planned ahead, a step computes the token the step before it samples, which
    # the worker has and the scheduler does not yet.
    num_pending: int = 0
    # Prompt tokens its first admission took from the prefix cache (None until then): what
    # the client's usage reports as cached (vLLM's num_cached_tokens). Set once, by
    # RequestQueues.admit_head; kept across preemptions and re-routing; a forked child has
    # its parent's (the prompt is counted once).
    num_cached_tokens: int | None = None
    # Images of the prompt (NewRequest.mm_inputs; a child's are its parent's): well-formed
    # ranges in prompt order (image_ranges.why_invalid), never changed.
    mm_inputs: tuple[MultiModalInput, ...] = ()
    # images_end(mm_inputs): a chunk starting here or later reaches no image (0: none).
    images_end: int = field(default=0, init=False, repr=False)
    # (block size, block_extra_keys(mm_inputs, block size)), made on first use.
    _block_keys: tuple[int, BlockExtraKeys] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.images_end = images_end(self.mm_inputs)

    @classmethod
    def from_new_request(cls, req: NewRequest) -> "SchedulerRequest":
        """A sampled request without a seed gets `request_seed(request_id)`: its draws are
        then fixed wherever it runs, like a seeded one's."""
        sampling = req.sampling
        if sampling.seed is None and sampling.temperature > 0:
            sampling = msgspec.structs.replace(sampling, seed=request_seed(req.request_id))
        return cls(
            request_id=req.request_id,
            token_ids=list(req.prompt_token_ids),
            num_prompt_tokens=len(req.prompt_token_ids),
            sampling=sampling,
            reply_channel=req.reply_channel,
            arrival_time=req.arrival_time,
            priority=req.priority,
            n=req.n,
            mm_inputs=tuple(req.mm_inputs),
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def sort_key(self) -> tuple[int, float, str]:
        """Scheduling order: priority, then arrival; the id only breaks exact ties so the
        order is total and deterministic. The largest key is preempted first."""
        return (self.priority, self.arrival_time, self.request_id)

    @property
    def max_kv_tokens(self) -> int:
        """Most tokens whose K/V this request can ever hold: its last output token is
        never computed, since nothing is sampled after it."""
        return self.num_prompt_tokens + self.sampling.max_tokens - 1

    @property
    def target_tokens(self) -> int:
        """Tokens it computes before it samples: all it holds, but for a parent of n > 1,
        which stops one short of its prompt and forks (the children compute the last
        prompt token, each sampling its own first output)."""
        return self.num_prompt_tokens - 1 if self.n > 1 else len(self.token_ids)

    @property
    def uses_prefix_cache(self) -> bool:
        """False for a request asking for prompt logprobs: they need the logits of every
        prompt token, so it takes nothing from the prefix cache (proto/worker.proto)."""
        return self.sampling.prompt_logprobs is None

    def block_extra_keys(self, block_size: int) -> BlockExtraKeys | None:
        """Its blocks' prefix-cache extra keys on that block size (the images each block
        holds, scheduler_svc/policy/image_ranges.py); None for a request without images."""
        if not self.mm_inputs:
            return None
        memo = self._block_keys
        if memo is None or memo[0] != block_size:
            memo = self._block_keys = (block_size, block_extra_keys(self.mm_inputs, block_size))
        return memo[1]

    def samples_its_last_token(self) -> bool:
        """True when the tokens in flight for it reach its max_tokens: the step in flight
        finishes it."""
        return self.num_pending > 0 and self.num_output_tokens + self.num_pending >= self.sampling.max_tokens

    def advance(self, num_new_tokens: int) -> bool:
        """A step computes `num_new_tokens` more of its tokens; True when that catches it
        up with every token it has or has in flight, so the step samples one more (in
        flight until `RequestQueues.append`)."""
        self.num_computed_tokens += num_new_tokens
        if self.num_computed_tokens != len(self.token_ids) + self.num_pending:
            return False
        self.num_pending += 1
        return True

    def reset_for_recompute(self) -> None:
        """Forget all K/V (preemption or re-routing); the tokens stay."""
        self.num_computed_tokens = 0
        self.num_pending = 0


def by_sort_key(req: SchedulerRequest) -> tuple[int, float, str]:
    """`req.sort_key`: the key the scheduler's queues are sorted by (bisect, sorted)."""
    return req.sort_key


def to_pb_sampling(params: SamplingParams) -> worker_pb2.SamplingParams:
    """msgspec SamplingParams (Redis side) -> protobuf SamplingParams (gRPC side)."""
    pb = worker_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        min_tokens=params.min_tokens,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        min_p=params.min_p,
        logit_bias=params.logit_bias,
    )
    if params.seed is not None:  # proto3 optional: unset means "no per-request generator"
        pb.seed = params.seed
    if params.logprobs is not None:  # proto3 optional: unset means "no logprobs"
        pb.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        pb.prompt_logprobs = params.prompt_logprobs
    if params.grammar is not None:
        pb.grammar.kind = params.grammar.kind
        pb.grammar.spec = params.grammar.spec
    return pb
