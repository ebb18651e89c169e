"""msgspec messages carried through Redis.

Stream `RedisKeys.requests` (gateway → scheduler): StreamMessage = NewRequest | AbortRequest,
msgpack-encoded under the field STREAM_FIELD.
Channel `RedisKeys.reply_channel(gateway_id)` (worker or scheduler → gateway): a msgpack
list[TokenEvent] per publish, every event of one step for that gateway in one message.
Key `RedisKeys.worker(worker_id)` (worker → scheduler, gateway): WorkerRegistration.
Key `RedisKeys.worker_stats(worker_id)` (scheduler → anyone): WorkerStats, the scheduler's
view of that worker's block pool, its requests' phase times, its steps (histograms) and
the images its steps needed (VisionStats), rewritten every `--stats-interval` (1 s) and
whenever its step loop goes idle.
proto/metrics.py renders it as Prometheus metrics.
"""

from typing import Literal

import msgspec

from proto.pan_and_scan import CropBox, ImagePiece, embedding_key

FinishReason = Literal["stop", "length", "abort", "error"]
# SampledToken.token_id (proto/worker.proto) of a request the worker failed without computing
# it (finish_reason "error": its media could not be had); it may come in any step.
NO_TOKEN_ID = -1


class Grammar(msgspec.Struct, frozen=True):
    """A constraint on the output (worker.proto `Grammar`)."""

    kind: Literal["json_schema", "regex", "choice", "lark"]  # proto/grammars.py says what each means
    spec: str  # json_schema: the schema as JSON text; regex; choice: a JSON list; lark


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """What worker.proto's SamplingParams says, field by field (see the comments there)."""

    max_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    min_p: float = 0.0
    logit_bias: dict[int, float] = {}
    logprobs: int | None = None  # None: none; k: the sampled token's logprob and the top k
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's (after the first)
    grammar: Grammar | None = None


class MultiModalInput(msgspec.Struct, frozen=True, array_like=True):
    """One image (or video frame) of a prompt, or one of its pan-and-scan crops: its soft
    tokens are prompt_token_ids[offset : offset + length]; the worker encodes the MediaItem
    stored under RedisKeys.media(content_hash) -- whole, or the `crop` box of it -- and
    writes its embeddings over them. Those tokens see each other both ways (Gemma 3), so the
    scheduler never splits them across steps, and `embedding_key` is part of the
    prefix-cache key of every block they touch. An image with k crops is 1 + k of these, in
    prompt order: the image whole, then its crops (proto/pan_and_scan.py)."""

    content_hash: str  # sha256 hex of the stored media
    offset: int
    length: int
    crop: CropBox | None = None  # a pan-and-scan crop of the image; None: the whole image

    @property
    def piece(self) -> ImagePiece:
        return ImagePiece(self.content_hash, self.crop)

    @property
    def embedding_key(self) -> str:
        """What its embeddings are known by (encoder caches, published embeddings, encoding
        claims, prefix-cache keys): the content hash, and a crop's box."""
        return embedding_key(self.content_hash, self.crop)


class NewRequest(msgspec.Struct, frozen=True, tag="new"):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    reply_channel: str
    arrival_time: float  # time.time() at the gateway
    priority: int = 0  # lower runs first; ties go to the earlier arrival
    # Parallel sampling: n > 1 computes the prompt once, then n sequences sharing its
    # blocks (copy-on-write). Their TokenEvents carry the ids f"{request_id}/{i}",
    # i = 0..n-1 (never request_id itself); sequence i samples with seed + i when a seed
    # is set. Aborting request_id aborts them all.
    n: int = 1
    # Sent again by its gateway after token events may have been lost (its subscription
    # dropped, e.g. a Redis restart): the scheduler starts the request over from its prompt,
    # replacing a copy it still runs. (seed, position) sampling and `request_seed` make the
    # new copy produce the tokens the client already has; the gateway drops those by index.
    resubmitted: bool = False
    # Images and video frames in the prompt, in prompt order (empty for text).
    mm_inputs: tuple[MultiModalInput, ...] = ()
    # The scheduler shard whose stream it went to (gateway/shard_choice.py); its aborts
    # and resubmissions go there too.
    shard: int = 0


class AbortRequest(msgspec.Struct, frozen=True, tag="abort"):
    request_id: str


StreamMessage = NewRequest | AbortRequest


class Logprobs(msgspec.Struct, frozen=True, array_like=True):
    """One position's logprobs: the token's own, then the top alternatives (most likely
    first; they may include the token itself)."""

    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class TokenEvent(msgspec.Struct, frozen=True, omit_defaults=True):
    """Output tokens of one request. `index` is the output position of token_ids[0];
    a finished request's last event carries finish_reason (and `error` for "error"; for
    "abort", the reason when the gateway itself ended the request).

    With `sampling.logprobs` set, `logprobs[i]` belongs to token_ids[i]. With
    `sampling.prompt_logprobs` set, events also carry `prompt_logprobs` for the prompt
    positions `prompt_index, prompt_index + 1, ...` (position 0 has none; a chunked prefill
    sends them in pieces, and a recomputed request may send some again)."""

    request_id: str
    index: int
    token_ids: list[int] = []
    finish_reason: FinishReason | None = None
    error: str | None = None
    # with finish_reason "error": the scheduler refused the request before running it
    # (it can never run on this worker: too long, n too large, ...) -- the client's request
    # is at fault (HTTP 400), not the server (500)
    rejected: bool = False
    logprobs: list[Logprobs] | None = None
    prompt_logprobs: list[Logprobs] | None = None
    prompt_index: int = 0
    # On the event of the first output token (index 0, token_ids not empty) only: the prompt
    # tokens whose K/V came from the prefix cache when the scheduler first admitted the
    # request (worker.proto NewRequestData.num_cached_tokens; a forked child's is its
    # parent's). The gateway reports it as usage's cached tokens.
    num_cached_tokens: int = 0


class WorkerRegistration(msgspec.Struct, frozen=True):
    worker_id: str
    address: str  # host:port of its gRPC server
    model: str  # served model name
    block_size: int
    num_blocks: int
    max_model_len: int
    started_at: float
    num_cpu_blocks: int = 0  # CPU swap space in blocks (WorkerInfo.num_cpu_blocks)
    draining: bool = False  # SIGTERM: finishing what runs; route nothing new here


class ShardLoad(msgspec.Struct, frozen=True):
    """One scheduler shard as its leader reports it: the gateways pick a shard for each
    request from these (gateway/shard_choice.py)."""

    shard: int
    worker_ids: list[str]  # the workers the shard drives (their leases are its)
    num_requests: int  # requests the shard holds: on its workers, parked or in transit


class SchedulerHeartbeat(msgspec.Struct, frozen=True):
    """What a live scheduler says about itself (scheduler_svc/heartbeat.py), refreshed
    every `interval_s` under a TTL: the gateway's readiness and admission read it."""

    scheduler_id: str  # its stream consumer name
    worker_ids: list[str]  # the workers it drives now (joined, not retired)
    num_waiting: int  # requests waiting for a step: in workers' waiting queues, or parked
    max_waiting_requests: int  # the bound on num_waiting the gateway enforces; 0 = none
    interval_s: float  # how often it is refreshed
    updated_at: float  # time.time() when written
    shards: list[ShardLoad] = []  # the shards it leads (none: a standby)


class Histogram(msgspec.Struct, frozen=True, array_like=True):
    """A Prometheus histogram's state (proto/metrics.py HistogramRecorder.snapshot):
    counts[i] values fell in (bounds[i-1], bounds[i]]; counts[-1] (one more than bounds)
    above the last bound. Not cumulative; the renderer makes Prometheus' `le` buckets."""

    bounds: list[float]
    counts: list[int]
    sum: float = 0.0


class RequestHistograms(msgspec.Struct, frozen=True):
    """Seconds in each phase of the requests a worker ran, as the scheduler saw them
    (vLLM's phases; scheduler_svc/metrics.py): arrival (NewRequest.arrival_time) → first
    scheduled → first token → finished by the worker ("stop" / "length")."""

    queue_time: Histogram  # arrival → first scheduled
    prefill_time: Histogram  # first scheduled → first token
    decode_time: Histogram  # first token → finished
    inference_time: Histogram  # first scheduled → finished


class StepHistograms(msgspec.Struct, frozen=True):
    """The steps run on one worker (proto/metrics.py StepRecorder): the worker keeps its
    own for its /metrics, the scheduler one from each StepResult for WorkerStats."""

    duration: Histogram  # seconds: StepResult.execute_seconds (the step on the compute thread)
    batch_size: Histogram  # requests in the step
    tokens: Histogram  # tokens computed in the step
    gap: Histogram | None = None  # seconds: StepResult.gap_seconds (idle before the step, work going on)
    forward: Histogram | None = None  # seconds: StepResult.forward_seconds (the model's forward)
    sample: Histogram | None = None  # seconds: StepResult.sample_seconds (the sampler's pass)


class VisionStats(msgspec.Struct, frozen=True):
    """A process's images so far (proto/metrics.py EncoderRecorder.snapshot): a worker's, as
    its scheduler sums them from each StepResult.images (in WorkerStats), or an encoder
    service's own (proto/encoder_messages.py EncoderStats: what it encoded, no queries)."""

    items_encoded: int = 0  # distinct images (video frames included) run through the vision encoder
    cache_hits: int = 0  # needed by a step, found in the worker's encoder cache
    published_hits: int = 0  # needed by a step, found published by the encoder service
    queries: int = 0  # needed by a step (each once a step)
    seconds: Histogram | None = None  # of each step (or encoder batch) that had to encode: getting them


class WorkerStats(msgspec.Struct, frozen=True):
    """Counters run since the scheduler took this worker on (scheduler_svc/policy/stats.py)."""

    worker_id: str
    num_blocks: int
    num_free_blocks: int  # held by no request, cached ones included
    num_running: int
    num_waiting: int
    num_preemptions: int
    num_steps: int
    integrity_error: str | None = None  # check_integrity()'s complaint, None when it holds
    updated_at: float = 0.0
    num_used_blocks: int = 0  # held by running requests
    num_cached_blocks: int = 0  # held by none, still reusable by a prefix hit
    prefix_cache_queries: int = 0  # tokens of admitted requests looked up
    prefix_cache_hits: int = 0  # tokens found cached (not computed again)
    num_evicted_blocks: int = 0  # cached blocks taken for other contents
    kv_waste: float = 0.0  # 1 - tokens held / slots of used blocks
    num_swapped: int = 0  # requests swapped out to CPU blocks now
    num_swapped_out: int = 0  # swap-outs (preemptions by swap)
    num_cpu_blocks: int = 0  # the worker's swap space, in blocks
    num_free_cpu_blocks: int = 0
    num_forks: int = 0  # sequences forked for parallel sampling (n > 1)
    num_cow_copies: int = 0  # shared, partly filled blocks copied on write
    num_aborted: int = 0  # requests aborted while waiting, running or swapped
    num_steps_ahead: int = 0  # steps planned while the step before ran (async scheduling)
    group_windows: tuple[int, ...] = ()  # each KV cache group's window (0: full attention)
    group_used_blocks: tuple[int, ...] = ()  # blocks held in each KV cache group
    requests: RequestHistograms | None = None
    steps: StepHistograms | None = None
    vision: VisionStats | None = None  # the images of its steps; None until a step had one (text models: always)


stream_encoder = msgspec.msgpack.Encoder()
stream_decoder = msgspec.msgpack.Decoder(StreamMessage)
events_decoder = msgspec.msgpack.Decoder(list[TokenEvent])
registration_decoder = msgspec.msgpack.Decoder(WorkerRegistration)
stats_decoder = msgspec.msgpack.Decoder(WorkerStats)
heartbeat_decoder = msgspec.msgpack.Decoder(SchedulerHeartbeat)


class MediaItem(msgspec.Struct, frozen=True):
    """One image as stored under `RedisKeys.media(content_hash)` (gateway → worker): written
    once by the gateway that validated it, read by any worker that must encode it.

    kind "encoded": `data` is the image file exactly as the client sent it (PNG, JPEG, WEBP,
    GIF -- its first frame --, BMP; `mime` says which), already fully decoded once by the
    gateway; content hash = sha256(data).
    kind "rgb8": `data` is `height` rows of `width` RGB pixels, 3 bytes each, row-major, no
    padding (len = width * height * 3): a sampled video frame; `mime` is ""; content hash =
    sha256(f"rgb8:{width}x{height}:".encode() + data). A frame's timestamp is not part of it:
    the same pixels are one item, however many requests or instants carry them."""

    kind: Literal["encoded", "rgb8"]
    width: int
    height: int
    data: bytes
    mime: str = ""


media_item_decoder = msgspec.msgpack.Decoder(MediaItem)
