from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias", "logprobs", "prompt_logprobs", "grammar")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    min_tokens: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    logit_bias: _containers.ScalarMap[int, float]
    logprobs: int
    prompt_logprobs: int
    grammar: Grammar
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("kind", "spec")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    kind: str
    spec: str
    def __init__(self, kind: _Optional[str] = ..., spec: _Optional[str] = ...) -> None: ...

class NewRequestData(_message.Message):
    __slots__ = ("request_id", "token_ids", "num_prompt_tokens", "block_ids", "num_computed_tokens", "sampling", "reply_channel", "mm_inputs", "num_cached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REPLY_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    MM_INPUTS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    sampling: SamplingParams
    reply_channel: str
    mm_inputs: _containers.RepeatedCompositeFieldContainer[MultiModalInput]
    num_cached_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., reply_channel: _Optional[str] = ..., mm_inputs: _Optional[_Iterable[_Union[MultiModalInput, _Mapping]]] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class MultiModalInput(_message.Message):
    __slots__ = ("content_hash", "offset", "length", "crop")
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CROP_FIELD_NUMBER: _ClassVar[int]
    content_hash: str
    offset: int
    length: int
    crop: CropBox
    def __init__(self, content_hash: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., crop: _Optional[_Union[CropBox, _Mapping]] = ...) -> None: ...

class CropBox(_message.Message):
    __slots__ = ("top", "left", "height", "width")
    TOP_FIELD_NUMBER: _ClassVar[int]
    LEFT_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    top: int
    left: int
    height: int
    width: int
    def __init__(self, top: _Optional[int] = ..., left: _Optional[int] = ..., height: _Optional[int] = ..., width: _Optional[int] = ...) -> None: ...

class CachedRequestData(_message.Message):
    __slots__ = ("request_id", "new_block_ids", "num_computed_tokens", "replace_block_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPLACE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    replace_block_ids: bool
    def __init__(self, request_id: _Optional[str] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., replace_block_ids: _Optional[bool] = ...) -> None: ...

class BlockPair(_message.Message):
    __slots__ = ("src", "dst")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src: int
    dst: int
    def __init__(self, src: _Optional[int] = ..., dst: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step_id", "finished_request_ids", "new_requests", "cached_requests", "num_scheduled_tokens", "blocks_to_swap_out", "blocks_to_swap_in", "blocks_to_copy", "swapped_out_request_ids", "after_step_id", "fencing_token")
    class NumScheduledTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_COPY_FIELD_NUMBER: _ClassVar[int]
    SWAPPED_OUT_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    AFTER_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    finished_request_ids: _containers.RepeatedScalarFieldContainer[str]
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequestData]
    cached_requests: _containers.RepeatedCompositeFieldContainer[CachedRequestData]
    num_scheduled_tokens: _containers.ScalarMap[str, int]
    blocks_to_swap_out: _containers.RepeatedCompositeFieldContainer[BlockPair]
    blocks_to_swap_in: _containers.RepeatedCompositeFieldContainer[BlockPair]
    blocks_to_copy: _containers.RepeatedCompositeFieldContainer[BlockPair]
    swapped_out_request_ids: _containers.RepeatedScalarFieldContainer[str]
    after_step_id: int
    fencing_token: int
    def __init__(self, step_id: _Optional[int] = ..., finished_request_ids: _Optional[_Iterable[str]] = ..., new_requests: _Optional[_Iterable[_Union[NewRequestData, _Mapping]]] = ..., cached_requests: _Optional[_Iterable[_Union[CachedRequestData, _Mapping]]] = ..., num_scheduled_tokens: _Optional[_Mapping[str, int]] = ..., blocks_to_swap_out: _Optional[_Iterable[_Union[BlockPair, _Mapping]]] = ..., blocks_to_swap_in: _Optional[_Iterable[_Union[BlockPair, _Mapping]]] = ..., blocks_to_copy: _Optional[_Iterable[_Union[BlockPair, _Mapping]]] = ..., swapped_out_request_ids: _Optional[_Iterable[str]] = ..., after_step_id: _Optional[int] = ..., fencing_token: _Optional[int] = ...) -> None: ...

class SampledToken(_message.Message):
    __slots__ = ("request_id", "token_id", "finish_reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_id: int
    finish_reason: str
    def __init__(self, request_id: _Optional[str] = ..., token_id: _Optional[int] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "sampled", "execute_seconds", "gap_seconds", "images", "forward_seconds", "sample_seconds")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GAP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sampled: _containers.RepeatedCompositeFieldContainer[SampledToken]
    execute_seconds: float
    gap_seconds: float
    images: ImageStepStats
    forward_seconds: float
    sample_seconds: float
    def __init__(self, step_id: _Optional[int] = ..., sampled: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., execute_seconds: _Optional[float] = ..., gap_seconds: _Optional[float] = ..., images: _Optional[_Union[ImageStepStats, _Mapping]] = ..., forward_seconds: _Optional[float] = ..., sample_seconds: _Optional[float] = ...) -> None: ...

class ImageStepStats(_message.Message):
    __slots__ = ("queries", "cache_hits", "published_hits", "items_encoded", "seconds")
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_HITS_FIELD_NUMBER: _ClassVar[int]
    ITEMS_ENCODED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    queries: int
    cache_hits: int
    published_hits: int
    items_encoded: int
    seconds: float
    def __init__(self, queries: _Optional[int] = ..., cache_hits: _Optional[int] = ..., published_hits: _Optional[int] = ..., items_encoded: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "model", "block_size", "num_blocks", "max_model_len", "vocab_size", "eos_token_ids", "num_cpu_blocks", "device", "kv_cache_group_windows", "kv_cache_group_size", "encoder_cache_items", "embeddings_fingerprint")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_GROUP_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENCODER_CACHE_ITEMS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model: str
    block_size: int
    num_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_cpu_blocks: int
    device: str
    kv_cache_group_windows: _containers.RepeatedScalarFieldContainer[int]
    kv_cache_group_size: int
    encoder_cache_items: int
    embeddings_fingerprint: str
    def __init__(self, worker_id: _Optional[str] = ..., model: _Optional[str] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., num_cpu_blocks: _Optional[int] = ..., device: _Optional[str] = ..., kv_cache_group_windows: _Optional[_Iterable[int]] = ..., kv_cache_group_size: _Optional[int] = ..., encoder_cache_items: _Optional[int] = ..., embeddings_fingerprint: _Optional[str] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("ok", "num_requests")
    OK_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    num_requests: int
    def __init__(self, ok: _Optional[bool] = ..., num_requests: _Optional[int] = ...) -> None: ...
