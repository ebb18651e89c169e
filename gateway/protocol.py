"""Pydantic models of the OpenAI request schema: /v1/completions and /v1/chat/completions.
(A chat message and a tool: `gateway.chat_message`; its content parts:
`gateway.content_parts`; response shapes: `gateway.response_models`.)

Requests are strict (a string is not a number). Unknown fields are accepted and ignored, as
vLLM does (frameworks add their own extras): `gateway.request_part.ignored_fields` names
them and the gateway logs one warning per request. Parameters OpenAI or vLLM define that
change the output and that we do not implement are declared anyway and accepted only at
their neutral value (`best_of: 1`, `suffix: ""`, `use_beam_search: false`, ...); anything
else is a 400 naming the parameter and saying it is not supported. Fields whose JSON may
take several shapes (prompt, stop, message content) are normalised by before-validators, so
an error names the field and not a pydantic union branch; the `WithJsonSchema` annotations
of prompt and stop publish the shapes accepted on the wire in the OpenAPI schema, and
message content's parts (text, image_url, video_url: gateway/content_parts.py) appear there
as the models they are.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, WithJsonSchema, field_validator,
                      model_validator)

from gateway.chat_message import ChatMessage, ToolDefinition
from gateway.media.options import parse_video_sampling
from gateway.request_part import RequestPart

INT32_MAX = 2**31 - 1
MAX_LOGPROBS = 20  # OpenAI: top_logprobs <= 20 (chat), logprobs <= 5 (completions)
MAX_N = 128  # OpenAI's limit on n
MAX_LOGIT_BIAS_ENTRIES = 1024  # each costs a little Python work per step on the worker

# Neutral values of the parameters accepted only as no-ops, and why anything else is refused.
_NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "best_of": ((None, 1), "only one sequence is generated per choice"),
    "suffix": ((None, ""), "insertion (text after the completion) needs a fill-in-the-middle model"),
    "functions": ((None, []), "use 'tools'"),
    "function_call": ((None, "none", "auto"), "use 'tool_choice'"),
    # vLLM's extensions we do not implement
    "use_beam_search": ((None, False), "beam search is not implemented"),
    "length_penalty": ((None, 1, 1.0), "it only applies to beam search, which is not implemented"),
    "early_stopping": ((None, False), "it only applies to beam search, which is not implemented"),
    "prompt_logprobs": ((None,), "on /v1/completions use echo with logprobs"),
    "spaces_between_special_tokens": ((None, True), "special tokens are decoded as they are"),
    "bad_words": ((None, []), "use logit_bias"),
    "allowed_token_ids": ((None,), "use logit_bias or structured output"),
    "logits_processors": ((None, []), "custom logits processors are not loaded"),
    "detokenize": ((None, True), "use return_token_ids"),
    "return_tokens_as_token_ids": ((None, False), "use return_token_ids"),
    "cache_salt": ((None,), "the prefix cache is shared by every request"),
    "kv_transfer_params": ((None,), "disaggregated prefill is not implemented"),
    "vllm_xargs": ((None,), "there are no custom sampling extensions"),
    "echo": ((None, False), "chat answers never repeat the prompt"),
    "documents": ((None,), "documents are not passed to chat templates"),
    "chat_template": ((None,), "the model's own chat template is always used"),
    "guided_whitespace_pattern": ((None,), "JSON is generated with compact separators"),
    "whitespace_pattern": ((None,), "JSON is generated with compact separators"),
    "structural_tag": ((None,), "use tools with tool_choice, or a grammar"),
}


def _require_neutral(name: str, value: Any) -> Any:
    allowed, why = _NEUTRAL[name]
    if value not in allowed:
        raise ValueError(f"'{name}' is not supported (got {value!r}): {why}")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_STOP_SCHEMA = {"anyOf": [{"type": "string", "minLength": 1},
                          {"type": "array", "items": {"type": "string", "minLength": 1}}, {"type": "null"}]}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_PROMPT_SCHEMA = {"anyOf": [
    {"type": "string", "minLength": 1}, _TOKEN_IDS,
    {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 16},
    {"type": "array", "items": _TOKEN_IDS, "minItems": 1, "maxItems": 16}]}
MAX_PROMPTS = 16  # prompts in one /v1/completions request
_LOGIT_BIAS_SCHEMA = {"anyOf": [
    {"type": "object", "propertyNames": {"pattern": "^[0-9]+$"}, "maxProperties": 1024,
     "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
    {"type": "null"}]}


class StreamOptions(RequestPart):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: usage in every chunk too


class _SamplingRequest(RequestPart):
    """Fields both endpoints share. Extensions beyond OpenAI's schema (as vLLM has them):
    top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos, min_tokens, return_token_ids,
    skip_special_tokens, include_stop_str_in_output, priority, truncate_prompt_tokens,
    add_special_tokens; and the ones accepted only at their neutral value (`_NEUTRAL`)."""

    model: str | None = None  # optional like vLLM: absent means the served model
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)  # -1/0 = off
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: Annotated[list[str] | None, WithJsonSchema(_STOP_SCHEMA)] = None
    stop_token_ids: list[int] | None = None  # checked against the vocabulary in preflight
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    user: str | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0, le=2)
    # token id (a string) -> bias in [-100, 100]
    logit_bias: Annotated[dict[str, float] | None, WithJsonSchema(_LOGIT_BIAS_SCHEMA)] = None
    return_token_ids: bool | None = False  # prompt and output token ids too
    skip_special_tokens: bool | None = True  # leave special tokens (EOS, <|im_end|>) out of text
    include_stop_str_in_output: bool | None = False  # keep the stop string that ended the text
    priority: int | None = Field(default=0, ge=-INT32_MAX, le=INT32_MAX)  # lower runs first
    truncate_prompt_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)  # keep the last k
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    early_stopping: bool | None = None
    prompt_logprobs: int | None = None
    spaces_between_special_tokens: bool | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    logits_processors: list[Any] | None = None
    detokenize: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    # Structured output (gateway/structured_output.py): OpenAI's response_format, vLLM's
    # structured_outputs, or one of vLLM's older guided_* fields; at most one of them.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted, unused: the backend is llguidance
    guided_whitespace_pattern: str | None = None

    @field_validator("use_beam_search", "length_penalty", "early_stopping", "prompt_logprobs",
                     "spaces_between_special_tokens", "bad_words", "allowed_token_ids",
                     "logits_processors", "detokenize", "return_tokens_as_token_ids", "cache_salt",
                     "kv_transfer_params", "vllm_xargs", "guided_whitespace_pattern")
    @classmethod
    def _neutral_extension(cls, value: Any, info) -> Any:
        return _require_neutral(info.field_name, value)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError("must be a string or a list of strings")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is None:
            return None
        if len(value) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_ENTRIES} entries are allowed (got {len(value)})")
        for key in value:
            if not (key.isascii() and key.isdigit() and int(key) <= INT32_MAX):
                raise ValueError(f"keys must be token ids written as strings, like \"50256\" (got {key!r})")
        bad = next((v for v in value.values() if not -100 <= v <= 100), None)
        if bad is not None:
            raise ValueError(f"biases must lie in [-100, 100] (got {bad})")
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None, info) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's `continuous_usage_stats`: every chunk carries the usage so far."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    @property
    def token_logit_bias(self) -> dict[int, float]:
        return {int(k): float(v) for k, v in (self.logit_bias or {}).items()}


class CompletionRequest(_SamplingRequest):
    # A string, a list of token ids, or a list of several of either (a batch: its choices
    # come prompt-major, choice i*n + j is prompt i's j-th); normalised to a list of prompts.
    prompt: Annotated[list[str | list[int]], WithJsonSchema(_PROMPT_SCHEMA)]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool | None = True  # BOS the way the model expects

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_list(cls, value: Any) -> Any:
        if isinstance(value, str) or (isinstance(value, list) and value and all(_is_int(t) for t in value)):
            value = [value]
        if not isinstance(value, list) or not value:
            raise ValueError("must be a string, a list of token ids, or a list of several of either")
        if len(value) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts are allowed in one request (got {len(value)})")
        for i, prompt in enumerate(value):
            if isinstance(prompt, list) and not all(_is_int(t) for t in prompt):
                raise ValueError(f"prompt {i}: a token-id prompt must be a list of integers")
            if not isinstance(prompt, (str, list)):
                raise ValueError(f"prompt {i}: must be a string or a list of token ids")
            if len(prompt) == 0:
                raise ValueError("prompt must not be empty" if len(value) == 1 else f"prompt {i} is empty")
        return value

    @field_validator("n")
    @classmethod
    def _choices_in_all(cls, value: int | None, info) -> int | None:
        prompts = info.data.get("prompt") or []
        if value is not None and value * len(prompts) > MAX_N:
            raise ValueError(f"n ({value}) times the number of prompts ({len(prompts)}) must not exceed {MAX_N}")
        return value

    @field_validator("best_of", "suffix")
    @classmethod
    def _neutral_completion(cls, value: Any, info) -> Any:
        return _require_neutral(info.field_name, value)


class ResponseFormat(RequestPart):
    """`{"type": "text" | "json_object"}` or `{"type": "json_schema", "json_schema": {...}}`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("'json_schema' is required with type 'json_schema', and only then")
        return self


class StructuredOutputs(RequestPart):
    """vLLM's `structured_outputs`: exactly one of json (a schema), json_object, regex,
    choice, grammar (llguidance's Lark)."""

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")  # BaseModel has .json
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: Any = None
    whitespace_pattern: str | None = None

    @field_validator("structural_tag", "whitespace_pattern")
    @classmethod
    def _neutral_structured(cls, value: Any, info) -> Any:
        return _require_neutral(info.field_name, value)


class JsonSchemaFormat(RequestPart):
    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    # "schema" shadows a BaseModel attribute, hence the alias
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDefinition] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    # Extensions (as vLLM has them): the template's own switches and variables.
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = False  # the template already writes BOS
    echo: bool | None = None
    documents: list[Any] | None = None
    chat_template: str | None = None
    # Images and video (vLLM's names): this request's video sampling, over the server's
    # --media-io-kwargs ({"video": {"num_frames": N, "fps": F}}); and the processor's
    # switches, of which only pan-and-scan exists for Gemma 3, and is not supported.
    media_io_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    @field_validator("functions", "function_call", "echo", "documents", "chat_template")
    @classmethod
    def _neutral_chat(cls, value: Any, info) -> Any:
        return _require_neutral(info.field_name, value)

    @field_validator("media_io_kwargs")
    @classmethod
    def _media_io_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value:
            try:
                parse_video_sampling(json.dumps(value))
            except (ValueError, TypeError) as exc:
                raise ValueError(str(exc).removeprefix("--media-io-kwargs: ")) from None
        return value

    @field_validator("mm_processor_kwargs")
    @classmethod
    def _mm_processor_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        for key, setting in (value or {}).items():
            if key == "do_pan_and_scan":
                if setting not in (None, False):
                    raise ValueError("pan-and-scan ('do_pan_and_scan') is not supported: each image is "
                                     "resized whole to the vision tower's size (vLLM's default); leave "
                                     "it out or set it to false")
            elif not key.startswith("pan_and_scan_"):  # pan-and-scan's own sizes: moot while it is off
                raise ValueError(f"'{key}' is not supported: the only processor switch is "
                                 "'do_pan_and_scan', and it must be false")
        return value

    @property
    def has_media(self) -> bool:
        """Whether any message carries an image or a video."""
        return any(m.has_media for m in self.messages)

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:
        if value in (None, "none", "auto", "required"):
            return value
        function = value.get("function") if isinstance(value, dict) else None
        if (isinstance(value, dict) and value.get("type") == "function" and isinstance(function, dict)
                and isinstance(function.get("name"), str) and function["name"]):
            return value
        raise ValueError(f"must be 'none', 'auto', 'required' or "
                         f"{{'type': 'function', 'function': {{'name': ...}}}} (got {value!r})")

    @property
    def named_tool(self) -> str | None:
        """The function a named tool_choice forces, else None."""
        return self.tool_choice["function"]["name"] if isinstance(self.tool_choice, dict) else None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        reserved = sorted(set(value or {}) & _RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(f"{reserved} cannot be set through chat_template_kwargs")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return value

    @field_validator("continue_final_message")
    @classmethod
    def _continue_assistant(cls, value: bool | None, info) -> bool | None:
        if value and info.data.get("add_generation_prompt"):
            raise ValueError("continue_final_message needs add_generation_prompt set to false")
        messages = info.data.get("messages")
        if value and messages and messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs an assistant message last")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        """`max_completion_tokens` is OpenAI's newer name; it wins when both are given."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


ResponseFormat.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()
