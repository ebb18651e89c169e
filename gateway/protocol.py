"""Pydantic models of the OpenAI request schema: /v1/completions and /v1/chat/completions.
(A chat message and a tool: `gateway.chat_message`; its content parts:
`gateway.content_parts`; response shapes: `gateway.completion_models`.)

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

The schemas are the contract (gateway/openapi_document.py): what a validator here refuses,
the schema refuses too — a neutral-only parameter is published with its neutral values as
the only ones (and why), rules between fields as `json_schema_extra` (gateway/schema_rules.py),
and "x-" markers stand for what the document fills in per server (served names, the
vocabulary, tools).
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import ConfigDict, Field, WithJsonSchema, field_validator

from gateway.chat_message import ChatMessage, ToolDefinition
from gateway.errors import coded
from gateway.media.options import parse_video_sampling
from gateway.neutral_params import neutral_schema, require_neutral
from gateway.request_part import Int, RequestPart, int_in, whole, whole_numbers
from gateway.schema_rules import (continue_needs_no_generation_prompt, stream_options_need_stream,
                                  top_logprobs_need_logprobs)
from gateway.structured_output_request import CHOICES, ResponseFormat, StructuredOutputs
from proto.pan_and_scan import PanAndScan

INT32_MAX = 2**31 - 1
MAX_LOGPROBS = 20  # OpenAI: top_logprobs <= 20 (chat), logprobs <= 5 (completions)
MAX_N = 128  # OpenAI's limit on n
MAX_LOGIT_BIAS_ENTRIES = 1024  # each costs a little Python work per step on the worker

def _is_int(value: Any) -> bool:
    value = whole(value)
    return isinstance(value, int) and not isinstance(value, bool)


_STOP_SCHEMA = {"anyOf": [{"type": "string", "minLength": 1},
                          {"type": "array", "items": {"type": "string", "minLength": 1}}, {"type": "null"}]}
# "x-token-id": the document of a running server bounds these by its vocabulary
# (gateway/openapi_document.py fills in every x- marker of this package).
TOKEN_ID = {"type": "integer", "minimum": 0, "x-token-id": True}
_TOKEN_IDS = {"type": "array", "items": TOKEN_ID, "minItems": 1}
_PROMPT_SCHEMA = {"anyOf": [
    {"type": "string", "minLength": 1}, _TOKEN_IDS,
    {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 16},
    {"type": "array", "items": _TOKEN_IDS, "minItems": 1, "maxItems": 16}]}
MAX_PROMPTS = 16  # prompts in one /v1/completions request
# One of the served names (the document lists them), or null for the served model.
SERVED_MODEL = {"anyOf": [{"type": "string"}, {"type": "null"}], "x-served-model": True}
_LOGIT_BIAS_SCHEMA = {"anyOf": [
    {"type": "object", "propertyNames": {"pattern": "^[0-9]+$", "x-token-id-key": True}, "maxProperties": 1024,
     "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
    {"type": "null"}]}


class StreamOptions(RequestPart):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: usage in every chunk too


class _SamplingRequest(RequestPart):
    """Fields both endpoints share. Extensions beyond OpenAI's schema (as vLLM has them):
    top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos, min_tokens, return_token_ids,
    skip_special_tokens, include_stop_str_in_output, priority, truncate_prompt_tokens,
    add_special_tokens; and the ones accepted only at their neutral value (gateway/neutral_params.py)."""

    # optional like vLLM: absent means the served model
    model: Annotated[str | None, WithJsonSchema(SERVED_MODEL)] = None
    max_tokens: int_in(1, INT32_MAX) | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int_in(-1, INT32_MAX) | None = None  # -1/0 = off
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int_in(-(2**63), 2**63 - 1) | None = None
    stop: Annotated[list[str] | None, WithJsonSchema(_STOP_SCHEMA)] = None
    # checked against the vocabulary in preflight
    stop_token_ids: Annotated[list[Int] | None, WithJsonSchema(
        {"anyOf": [{"type": "array", "items": TOKEN_ID}, {"type": "null"}]})] = None
    ignore_eos: bool | None = False
    min_tokens: int_in(0, INT32_MAX) | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int_in(1, MAX_N) | None = None
    user: str | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0, le=2)
    # token id (a string) -> bias in [-100, 100]
    logit_bias: Annotated[dict[str, float] | None, WithJsonSchema(_LOGIT_BIAS_SCHEMA)] = None
    return_token_ids: bool | None = False  # prompt and output token ids too
    skip_special_tokens: bool | None = True  # leave special tokens (EOS, <|im_end|>) out of text
    include_stop_str_in_output: bool | None = False  # keep the stop string that ended the text
    priority: int_in(-INT32_MAX, INT32_MAX) | None = 0  # lower runs first
    truncate_prompt_tokens: int_in(1, INT32_MAX) | None = None  # keep the last k
    use_beam_search: Annotated[bool | None, neutral_schema("use_beam_search")] = None
    length_penalty: Annotated[float | None, neutral_schema("length_penalty")] = None
    early_stopping: Annotated[bool | None, neutral_schema("early_stopping")] = None
    prompt_logprobs: Annotated[int | None, neutral_schema("prompt_logprobs")] = None
    spaces_between_special_tokens: Annotated[bool | None, neutral_schema("spaces_between_special_tokens")] = None
    bad_words: Annotated[list[str] | None, neutral_schema("bad_words")] = None
    allowed_token_ids: Annotated[list[int] | None, neutral_schema("allowed_token_ids")] = None
    logits_processors: Annotated[list[Any] | None, neutral_schema("logits_processors")] = None
    detokenize: Annotated[bool | None, neutral_schema("detokenize")] = None
    return_tokens_as_token_ids: Annotated[bool | None, neutral_schema("return_tokens_as_token_ids")] = None
    cache_salt: Annotated[str | None, neutral_schema("cache_salt")] = None
    kv_transfer_params: Annotated[dict[str, Any] | None, neutral_schema("kv_transfer_params")] = None
    vllm_xargs: Annotated[dict[str, Any] | None, neutral_schema("vllm_xargs")] = None
    # Structured output (gateway/structured_output.py): OpenAI's response_format, vLLM's
    # structured_outputs, or one of vLLM's older guided_* fields; at most one of them.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str] | None, WithJsonSchema(CHOICES)] = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted, unused: the backend is llguidance
    guided_whitespace_pattern: Annotated[str | None, neutral_schema("guided_whitespace_pattern")] = None

    @field_validator("use_beam_search", "length_penalty", "early_stopping", "prompt_logprobs",
                     "spaces_between_special_tokens", "bad_words", "allowed_token_ids",
                     "logits_processors", "detokenize", "return_tokens_as_token_ids", "cache_salt",
                     "kv_transfer_params", "vllm_xargs", "guided_whitespace_pattern")
    @classmethod
    def _neutral_extension(cls, value: Any, info) -> Any:
        return require_neutral(info.field_name, value)

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
    # (and min_tokens within the default max_tokens: gateway/openapi_document.py)
    model_config = ConfigDict(json_schema_extra={"allOf": [stream_options_need_stream()]})

    # A string, a list of token ids, or a list of several of either (a batch: its choices
    # come prompt-major, choice i*n + j is prompt i's j-th); normalised to a list of prompts.
    prompt: Annotated[list[str | list[Int]], WithJsonSchema(_PROMPT_SCHEMA)]
    logprobs: int_in(0, MAX_LOGPROBS) | None = None
    echo: bool | None = False
    best_of: Annotated[Int | None, neutral_schema("best_of")] = None
    suffix: Annotated[str | None, neutral_schema("suffix")] = None
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
            raise coded("too_many_choices",
                        f"n ({value}) times the number of prompts ({len(prompts)}) must not exceed {MAX_N}")
        return value

    @field_validator("best_of", "suffix")
    @classmethod
    def _neutral_completion(cls, value: Any, info) -> Any:
        return require_neutral(info.field_name, value)


_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def no_reserved_kwargs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """chat_template_kwargs' validator: the template call's own arguments cannot be set there."""
    reserved = sorted(set(value or {}) & _RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise ValueError(f"{reserved} cannot be set through chat_template_kwargs")
    return value


TEMPLATE_KWARGS = {"anyOf": [{"type": "object", "propertyNames": {"not": {"enum": sorted(_RESERVED_TEMPLATE_KWARGS)}}},
                             {"type": "null"}],
                   "description": "Extra variables for the chat template; its own switches cannot be set here."}


# tool_choice as the validator takes it; "x-tool-choice": the document of a server without
# --enable-auto-tool-choice leaves "auto" out.
TOOL_CHOICE = {"anyOf": [{"enum": ["none", "auto", "required"]},
                         {"type": "object", "properties": {
                             "type": {"const": "function"},
                             "function": {"type": "object", "properties": {"name": {"type": "string", "minLength": 1}},
                                          "required": ["name"]}},
                          "required": ["type", "function"]},
                         {"type": "null"}], "x-tool-choice": True}
_MEDIA_IO_KWARGS = {"anyOf": [{"type": "object", "additionalProperties": False, "properties": {
    "image": {"type": "object", "maxProperties": 0},
    "video": {"type": "object", "additionalProperties": False, "properties": {
        "num_frames": {"anyOf": [{"type": "integer", "minimum": 1}, {"const": -1}]},
        "fps": {"type": "number"}}}}}, {"type": "null"}],
    "description": "This request's video sampling: {\"video\": {\"num_frames\": N (-1: no limit), \"fps\": F}}."}
_AT_LEAST_1 = {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}]}
_MM_PROCESSOR_KWARGS = {"anyOf": [{"type": "object", "additionalProperties": False, "properties": {
    "do_pan_and_scan": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
    "pan_and_scan_min_crop_size": _AT_LEAST_1, "pan_and_scan_max_num_crops": _AT_LEAST_1,
    "pan_and_scan_min_ratio_to_activate": {"anyOf": [{"type": "number", "exclusiveMinimum": 0}, {"type": "null"}]}}},
    {"type": "null"}],
    "description": "Gemma 3's pan-and-scan, as transformers names its settings: do_pan_and_scan (over the "
                   "checkpoint's; false turns it off), pan_and_scan_min_crop_size, pan_and_scan_max_num_crops, "
                   "pan_and_scan_min_ratio_to_activate; null leaves a setting as the checkpoint has it."}


class ChatCompletionRequest(_SamplingRequest):
    # At most three such rules (gateway/schema_rules.py): those of tools are left to x-beyond-schema.
    model_config = ConfigDict(json_schema_extra={"allOf": [
        stream_options_need_stream(), continue_needs_no_generation_prompt(), top_logprobs_need_logprobs()]})

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int_in(1, INT32_MAX) | None = None
    logprobs: bool | None = False
    top_logprobs: int_in(0, MAX_LOGPROBS) | None = None
    # "x-tools": the document of a server whose chat template reads no tools refuses them
    tools: Annotated[list[ToolDefinition] | None, Field(json_schema_extra={"x-tools": True})] = None
    tool_choice: Annotated[str | dict[str, Any] | None, WithJsonSchema(TOOL_CHOICE)] = None
    parallel_tool_calls: bool | None = None
    functions: Annotated[list[Any] | None, neutral_schema("functions")] = None
    function_call: Annotated[str | dict[str, Any] | None, neutral_schema("function_call")] = None
    # Extensions (as vLLM has them): the template's own switches and variables.
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: Annotated[dict[str, Any] | None, WithJsonSchema(TEMPLATE_KWARGS)] = None
    add_special_tokens: bool | None = False  # the template already writes BOS
    echo: Annotated[bool | None, neutral_schema("echo")] = None
    documents: Annotated[list[Any] | None, neutral_schema("documents")] = None
    chat_template: Annotated[str | None, neutral_schema("chat_template")] = None
    # Images and video (vLLM's names): this request's video sampling, over the server's
    # --media-io-kwargs ({"video": {"num_frames": N, "fps": F}}); and the processor's
    # switches, of which only pan-and-scan's exist for Gemma 3 (proto/pan_and_scan.py).
    media_io_kwargs: Annotated[dict[str, Any] | None, WithJsonSchema(_MEDIA_IO_KWARGS)] = None
    mm_processor_kwargs: Annotated[dict[str, Any] | None, WithJsonSchema(_MM_PROCESSOR_KWARGS)] = None

    @field_validator("functions", "function_call", "echo", "documents", "chat_template")
    @classmethod
    def _neutral_chat(cls, value: Any, info) -> Any:
        return require_neutral(info.field_name, value)

    @field_validator("media_io_kwargs")
    @classmethod
    def _media_io_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        value = whole_numbers(value)  # num_frames 8.0 is 8
        if value:
            try:
                parse_video_sampling(json.dumps(value))
            except (ValueError, TypeError) as exc:
                raise ValueError(str(exc).removeprefix("--media-io-kwargs: ")) from None
        return value

    @field_validator("mm_processor_kwargs")
    @classmethod
    def _mm_processor_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        """Pan-and-scan's settings, each checked (its type and range) before anything is
        fetched; the checkpoint's settings under them are applied when the prompt is built."""
        value = whole_numbers(value)  # pan_and_scan_min_crop_size 8.0 is 8
        PanAndScan().overridden(value)
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
        return no_reserved_kwargs(value)

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
            raise coded("final_message_not_assistant", "continue_final_message needs an assistant message last")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        """`max_completion_tokens` is OpenAI's newer name; it wins when both are given."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()
