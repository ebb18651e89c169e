"""Pydantic models of the OpenAI schema: /v1/completions, /v1/chat/completions, /v1/models.

Requests are strict (a string is not a number) and forbid unknown fields, so nothing a client
sends is silently ignored. Parameters OpenAI defines that we do not implement yet are declared
anyway and accepted only at their neutral value (`logprobs: null`, `n: 1`, penalties 0, ...);
anything else is a 400 naming the parameter. Fields whose JSON may take several shapes
(prompt, stop, message content) are normalised by before-validators, so an error names the
field and not a pydantic union branch.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

INT32_MAX = 2**31 - 1

# Neutral values of the parameters accepted only as no-ops for now.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}), "tools": (None, []),
    "tool_choice": (None, "none", "auto"), "functions": (None, []), "function_call": (None, "none", "auto"),
    "best_of": (None, 1), "suffix": (None, ""), "echo": (None, False),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
}


def _require_neutral(name: str, value: Any) -> Any:
    if value not in _NEUTRAL[name]:
        raise ValueError(f"'{name}' is not supported yet (got {value!r})")
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool | None = False


class _SamplingRequest(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None  # optional like vLLM: absent means the served model
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)  # vLLM extension; -1/0 = off
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1)
    user: str | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    return_token_ids: bool | None = False  # vLLM extension: prompt and output token ids too

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

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, value: int | None) -> int | None:
        if value is not None and value > 1:
            raise ValueError("n > 1 is not supported yet")
        return value

    @field_validator("presence_penalty", "frequency_penalty", "logit_bias")
    @classmethod
    def _neutral(cls, value: Any, info) -> Any:
        return _require_neutral(info.field_name, value)

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None, info) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    # A string, a list of one string, a list of token ids or a list of one list of token ids;
    # normalised to str | list[int]. Batches of several prompts are not supported yet.
    prompt: str | list[int]
    logprobs: int | None = None
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
            raise ValueError(f"batched prompts ({len(value)} prompts in one request) are not supported yet")
        if isinstance(value, (str, list)) and len(value) == 0:
            raise ValueError("prompt must not be empty")
        if not isinstance(value, (str, list)):
            raise ValueError("must be a string, a list of token ids, or a list of one string")
        return value

    @field_validator("echo", "best_of", "suffix")
    @classmethod
    def _neutral_completion(cls, value: Any, info) -> Any:
        return _require_neutral(info.field_name, value)

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: int | None) -> int | None:
        # Here an integer, and 0 already asks for the sampled token's logprob.
        if value is not None:
            raise ValueError(f"'logprobs' is not supported yet (got {value!r})")
        return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    role: str
    # A string or a list of text parts (joined with newlines); null only for an assistant
    # turn. Normalised to a string.
    content: str | None = None
    name: str | None = None
    # Assistant turns copied back from a response carry these; they must be empty for now.
    refusal: str | None = None
    tool_calls: list[Any] | None = None
    function_call: Any = None
    tool_call_id: str | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, value: str) -> str:
        if value in ("tool", "function"):
            raise ValueError(f"messages with role '{value}' are not supported yet")
        if value not in ("system", "developer", "user", "assistant"):
            raise ValueError(f"unknown role '{value}': expected system, developer, user or assistant")
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
                raise ValueError(f"content part {i} has type {kind!r}: only 'text' parts are supported yet")
            if set(part) - {"type", "text"} or not isinstance(part.get("text"), str):
                raise ValueError(f"content part {i} must be {{'type': 'text', 'text': <string>}}")
            texts.append(part["text"])
        return "\n".join(texts)

    @field_validator("tool_calls", "function_call")
    @classmethod
    def _no_tools(cls, value: Any, info) -> Any:
        if value not in (None, []):
            raise ValueError(f"'{info.field_name}' in messages is not supported yet")
        return value

    def template_dict(self) -> dict[str, str]:
        """The message as chat templates expect it; `developer` is OpenAI's newer `system`."""
        message = {"role": "system" if self.role == "developer" else self.role,
                   "content": self.content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # meaningless without tools; harmless to accept
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None

    @field_validator("logprobs", "top_logprobs", "response_format", "tools", "tool_choice",
                     "functions", "function_call")
    @classmethod
    def _neutral_chat(cls, value: Any, info) -> Any:
        return _require_neutral(info.field_name, value)

    @field_validator("messages")
    @classmethod
    def _content_present(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        for i, message in enumerate(messages):
            if message.content is None and message.role != "assistant":
                raise ValueError(f"message {i} ({message.role}) has no content")
        return messages

    @property
    def requested_max_tokens(self) -> int | None:
        """`max_completion_tokens` is OpenAI's newer name; it wins when both are given."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- responses --------------------------------------------------------------------------------

FinishReason = Literal["stop", "length"]


def now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class _TokenIdsWhenAsked(BaseModel):
    """`token_ids` / `prompt_token_ids` (vLLM's `return_token_ids` extension) appear only
    when they were asked for; every other null field stays in the JSON, as OpenAI sends it."""

    @model_serializer(mode="wrap")
    def _drop_unrequested_ids(self, handler):
        data = handler(self)
        for key in ("token_ids", "prompt_token_ids"):
            if key in data and data[key] is None:
                del data[key]
        return data


class CompletionChoice(_TokenIdsWhenAsked):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None  # sent (as null until the last chunk) only with include_usage
    system_fingerprint: str | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_TokenIdsWhenAsked):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReason | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(_TokenIdsWhenAsked):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None


class Delta(BaseModel):
    """A chat stream delta: only the keys that are set (`{}` in the final chunk)."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer
    def _set_keys_only(self) -> dict[str, str]:
        return {k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None}


class ChatChunkChoice(_TokenIdsWhenAsked):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: FinishReason | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(_TokenIdsWhenAsked):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # sent (as null until the last chunk) only with include_usage
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None  # first chunk only


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "pagedserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
