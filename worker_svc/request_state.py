"""What the worker remembers about one request between steps."""

from collections.abc import Collection

from proto import worker_pb2
from proto.pan_and_scan import CropBox, ImagePiece
from modeling.image_placement import PlaceholderRange
from worker_svc.logits_processors import uses_edits
from worker_svc.stop import StopRule


def split_groups(block_ids, num_groups: int) -> list[list[int]]:
    """Block ids as the step carries them (each KV cache group's in turn, the same count
    for each: proto/worker.proto) -> one list per group."""
    ids = list(block_ids)
    if num_groups == 1:
        return [ids]
    if len(ids) % num_groups:
        raise ValueError(f"{len(ids)} block ids do not split into {num_groups} KV cache groups")
    k = len(ids) // num_groups
    return [ids[g * k:(g + 1) * k] for g in range(num_groups)]


class RequestState:
    """Invariants: token_ids[:num_computed_tokens] have K/V in the slots named by each KV
    cache group's block table, kept in the request's `row` of the persistent batch
    (worker_svc/input_batch.py; token t in table[g][t // block_size]; a sliding group's
    blocks behind its window are holes); num_computed_tokens <= len(token_ids), equal while
    a sampled token is in flight (`ahead`); num_prompt_tokens <= len(token_ids);
    once finish_reason is set the request never samples again (it waits for the scheduler
    to list it in finished_request_ids). Image i's soft tokens are
    token_ids[image_ranges[i].offset : offset + length], showing image_pieces[i] (a stored
    medium, whole or a pan-and-scan crop of it) whose embeddings are known by image_keys[i]
    (NewRequestData.mm_inputs, in prompt order; all empty for text)."""

    __slots__ = ("request_id", "token_ids", "num_prompt_tokens", "row",
                 "num_computed_tokens", "sampling", "reply_channel",
                 "finish_reason", "grammar", "image_ranges", "image_pieces", "image_keys", "images_end", "failure",
                 "num_cached_tokens", "edits", "logprobs", "prompt_logprobs", "stop", "ahead")

    def __init__(self, new: worker_pb2.NewRequestData, row: int = 0,
                 eos_token_ids: Collection[int] = ()):
        if not new.token_ids:
            raise ValueError(f"request {new.request_id!r} has no tokens")
        if not 0 <= new.num_computed_tokens < len(new.token_ids):
            raise ValueError(
                f"request {new.request_id!r}: num_computed_tokens={new.num_computed_tokens} "
                f"must be in [0, {len(new.token_ids)}) (the last token has no K/V yet)")
        self.request_id: str = new.request_id
        self.token_ids: list[int] = list(new.token_ids)
        self.num_prompt_tokens: int = new.num_prompt_tokens
        self.row: int = row  # the request's row of the persistent batch: its block tables
        self.num_computed_tokens: int = new.num_computed_tokens
        self.sampling: worker_pb2.SamplingParams = new.sampling
        # logit_bias, min_tokens or penalties: the sampler builds edits for it each step
        self.edits: bool = uses_edits(new.sampling)
        self.stop = StopRule.of(new.sampling, eos_token_ids)  # its finish rule (the model's EOS ids)
        # top-k of the prompt logprobs asked for; None: none
        self.prompt_logprobs: int | None = (new.sampling.prompt_logprobs if new.sampling.HasField("prompt_logprobs")
                                            else None)
        # top-k of each sampled token's logprobs asked for; None: none
        self.logprobs: int | None = new.sampling.logprobs if new.sampling.HasField("logprobs") else None
        self.reply_channel: str = new.reply_channel
        # Prompt tokens the scheduler took from the prefix cache when it first admitted the
        # request: published with its first output token (TokenEvent.num_cached_tokens).
        self.num_cached_tokens: int = new.num_cached_tokens
        self.finish_reason: str | None = None
        # The images of the prompt (the scheduler re-sends them with every NewRequestData).
        self.image_ranges: tuple[PlaceholderRange, ...] = tuple(
            PlaceholderRange(offset=m.offset, length=m.length) for m in new.mm_inputs)
        self.image_pieces: tuple[ImagePiece, ...] = tuple(
            ImagePiece(m.content_hash, CropBox(m.crop.top, m.crop.left, m.crop.height, m.crop.width)
                       if m.HasField("crop") else None) for m in new.mm_inputs)
        self.image_keys: tuple[str, ...] = tuple(p.key for p in self.image_pieces)
        # the position after the last image's soft tokens (0 for text): a chunk from at or
        # past it holds no image
        self.images_end: int = max((r.offset + r.length for r in self.image_ranges), default=0)
        # Why the request cannot run here (set when it is added: images this worker cannot
        # take); the runner fails it with this message the next time it is scheduled.
        self.failure: str | None = None
        # The structured-output matcher (worker_svc/grammar.py), set by the runner when
        # sampling.grammar is; None for unconstrained requests.
        self.grammar = None
        # Where the last step that sampled for it put its token in that step's sampled ids,
        # read while the token is in flight: sampled on the device, not yet appended here
        # (num_computed_tokens == len(token_ids)), when the next step computes it from there.
        self.ahead: int = -1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens
