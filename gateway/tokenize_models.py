"""Request and response shapes of vLLM's `/tokenize` and `/detokenize` (not OpenAI's API).

    POST /tokenize    {"prompt": "...", "add_special_tokens": true}               text as /v1/completions sees it
                      {"messages": [...], "add_generation_prompt": true, ...}     the chat template's rendering
                      → {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize  {"tokens": [...]} → {"prompt": "..."}
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from gateway.chat_message import ChatMessage, ToolDefinition
from gateway.protocol import INT32_MAX
from gateway.request_part import RequestPart


class TokenizeCompletionRequest(RequestPart):
    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(RequestPart):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    add_special_tokens: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(RequestPart):
    model: str | None = None
    tokens: list[int] = Field(max_length=INT32_MAX)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str
