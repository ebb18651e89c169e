"""Pydantic models of the OpenAI request schema: /v1/completions and /v1/chat/completions.
(Response shapes are in `gateway.response_models`.)

Requests are strict (a string is not a number) and forbid unknown fields, so nothing a client
sends is silently ignored. Parameters OpenAI defines that we do not implement are declared
anyway and accepted only at their neutral value (`best_of: 1`, `suffix: ""`, ...); anything
else is a 400 naming the parameter and saying it is not supported. Fields whose JSON may take
several shapes (prompt, stop, message content) are normalised by before-validators, so an
error names the field and not a pydantic union branch; their `WithJsonSchema` annotations
publish the shapes accepted on the wire in the OpenAPI schema.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, WithJsonSchema, field_validator,
                      model_validator)

INT32_MAX = 2**31 - 1
MAX_LOGPROBS = 20  # OpenAI: top_logprobs <= 20 (chat), logprobs <= 5 (completions)
MAX_N = 128  # OpenAI's limit on n
MAX_LOGIT_BIAS_ENTRIES = 1024  # each costs a little Python work per step on the worker

# Neutral values of the parameters accepted only as no-ops.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1), "suffix": (None, ""), "functions": (None, []),
    "function_call": (None, "none", "auto"),
}


def _require_neutral(name: str, value: Any) -> Any:
    if value not in _NEUTRAL[name]:
        raise ValueError(f"'{name}' is not supported (got {value!r})")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_STOP_SCHEMA = {"anyOf": [{"type": "string", "minLength": 1},
                          {"type": "array", "items": {"type": "string", "minLength": 1}}, {"type": "null"}]}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_PROMPT_SCHEMA = {"anyOf": [
    {"type": "string", "minLength": 1}, _TOKEN_IDS,
    {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
    {"type": "array", "items": _TOKEN_IDS, "minItems": 1, "maxItems": 1}]}
_LOGIT_BIAS_SCHEMA = {"anyOf": [
    {"type": "object", "propertyNames": {"pattern": "^[0-9]+$"}, "maxProperties": 1024,
     "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
    {"type": "null"}]}
_CONTENT_SCHEMA = {"anyOf": [
    {"type": "string"}, {"type": "null"},
    {"type": "array", "items": {"type": "object", "properties": {
        "type": {"const": "text"}, "text": {"type": "string"}}, "required": ["type", "text"]}}]}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool | None = False


class _SamplingRequest(BaseModel):
    """Fields both endpoints share. Extensions beyond OpenAI's schema (as vLLM has them):
    top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos, min_tokens, return_token_ids."""

    model_config = ConfigDict(strict=True, extra="forbid")

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
    def token_logit_bias(self) -> dict[int, float]:
        return {int(k): float(v) for k, v in (self.logit_bias or {}).items()}


class CompletionRequest(_SamplingRequest):
    # A string, a list of one string, a list of token ids or a list of one list of token ids;
    # normalised to str | list[int]. Batches of several prompts are not supported.
    prompt: Annotated[str | list[int], WithJsonSchema(_PROMPT_SCHEMA)]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and value and all(_is_int(t) for t in value):
            return value
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
            value = value[0]
            if isinstance(value, list) and not all(_is_int(t) for t in value):
                raise ValueError("a token-id prompt must be a list of integers")
        elif isinstance(value, list) and len(value) > 1:
            raise ValueError(f"batched prompts ({len(value)} prompts in one request) are not supported")
        if isinstance(value, (str, list)) and len(value) == 0:
            raise ValueError("prompt must not be empty")
        if not isinstance(value, (str, list)):
            raise ValueError("must be a string, a list of token ids, or a list of one string")
        return value

    @field_validator("best_of", "suffix")
    @classmethod
    def _neutral_completion(cls, value: Any, info) -> Any:
        return _require_neutral(info.field_name, value)


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    # A string or a list of text parts (joined with newlines); null only for an assistant
    # turn. Normalised to a string.
    content: Annotated[str | None, WithJsonSchema(_CONTENT_SCHEMA)] = None
    name: str | None = None
    refusal: str | None = None  # assistant turns copied back from a response carry it
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls, for the template
    tool_call_id: str | None = None  # a tool turn answers this call
    function_call: None = None  # deprecated; refused

    @field_validator("role", mode="before")
    @classmethod
    def _known_role(cls, value: Any) -> Any:
        if value == "function":
            raise ValueError("the deprecated 'function' role is not supported: use 'tool'")
        if isinstance(value, str) and value not in ("system", "developer", "user", "assistant", "tool"):
            raise ValueError(f"unknown role '{value}': expected system, developer, user, assistant or tool")
        return value

    @field_validator("content", mode="before")
    @classmethod
    def _text_content(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("must be a string or a list of content parts")
        texts = []
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"content part {i} has type {kind!r}: only 'text' parts are supported")
            if set(part) - {"type", "text"} or not isinstance(part.get("text"), str):
                raise ValueError(f"content part {i} must be {{'type': 'text', 'text': <string>}}")
            texts.append(part["text"])
        return "\n".join(texts)

    @field_validator("function_call", mode="before")
    @classmethod
    def _no_function_call(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("the deprecated 'function_call' in messages is not supported: use 'tool_calls'")
        return value

    @model_validator(mode="after")
    def _shape_per_role(self) -> ChatMessage:
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a 'tool' message needs 'tool_call_id'")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only 'assistant' messages carry 'tool_calls'")
        if self.content is None and not (self.role == "assistant"):
            raise ValueError(f"a '{self.role}' message needs 'content'")
        return self

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it; `developer` is OpenAI's newer `system`."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                   "content": self.content or ""}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class ResponseFormat(BaseModel):
    """`{"type": "text" | "json_object"}` or `{"type": "json_schema", "json_schema": {...}}`."""

    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("'json_schema' is required with type 'json_schema', and only then")
        return self


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
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
    response_format: ResponseFormat | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    # Extensions (as vLLM has them): the template's own switches and variables.
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("functions", "function_call")
    @classmethod
    def _neutral_chat(cls, value: Any, info) -> Any:
        return _require_neutral(info.field_name, value)

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:
        if value in (None, "none", "auto"):
            return value
        raise ValueError(f"tool_choice {value!r} is not supported: only 'none' and 'auto' (tool "
                         "calls are returned as text; nothing forces or parses them)")

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
