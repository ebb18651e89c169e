"""Pydantic models of the bodies /v1/completions and /v1/chat/completions answer with: the
`text_completion` and `chat.completion` objects, their stream chunks, logprobs and usage
(gateway/completion_output.py fills them in). The Responses API's shapes are its own
(gateway/responses_api/output.py)."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field, model_serializer

FinishReason = Literal["stop", "length", "tool_calls"]


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose K/V came from the prefix cache (block-aligned)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails  # always sent, as OpenAI does


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


# ---- logprobs -----------------------------------------------------------------------------

class CompletionLogprobs(BaseModel):
    """The legacy shape: parallel lists, one entry per token (the first prompt token of an
    echoed prompt has null logprobs: nothing predicts it)."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None


# ---- completions ----------------------------------------------------------------------------

class CompletionChoice(_TokenIdsWhenAsked):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
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


# ---- chat -----------------------------------------------------------------------------------

class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    """`tool_calls` appears only when the answer has calls (then `content` may be null)."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _calls_when_any(self, handler):
        data = handler(self)
        if data.get("tool_calls") is None:
            data.pop("tool_calls", None)
        return data


class ChatChoice(_TokenIdsWhenAsked):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
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


class FunctionCallDelta(BaseModel):
    """Name in a call's first delta only; arguments in pieces."""

    name: str | None = None
    arguments: str = ""

    @model_serializer
    def _set_keys_only(self) -> dict[str, str]:
        return {k: v for k, v in (("name", self.name), ("arguments", self.arguments)) if v is not None}


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None  # with type and name, in the call's first delta only
    type: Literal["function"] | None = None
    function: FunctionCallDelta

    @model_serializer(mode="wrap")
    def _set_keys_only(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class Delta(BaseModel):
    """A chat stream delta: only the keys that are set (`{}` in the final chunk)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _set_keys_only(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(_TokenIdsWhenAsked):
    index: int = 0
    delta: Delta
    logprobs: ChatLogprobs | None = None
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
