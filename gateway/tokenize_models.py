"""Request and response shapes of vLLM's `/tokenize` and `/detokenize` (not OpenAI's API).

    POST /tokenize    {"prompt": "...", "add_special_tokens": true}               text as /v1/completions sees it
                      {"messages": [...], "add_generation_prompt": true, ...}     the chat template's rendering
                      → {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize  {"tokens": [...]} → {"prompt": "..."}
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator

from gateway.chat_message import ChatMessage, ToolDefinition
from gateway.protocol import INT32_MAX, SERVED_MODEL, TEMPLATE_KWARGS, TOKEN_ID, no_reserved_kwargs
from gateway.request_part import Int, RequestPart
from gateway.schema_rules import continue_needs_no_generation_prompt


class TokenizeCompletionRequest(RequestPart):
    # A body with `messages` is read as TokenizeChatRequest, whatever else it has.
    model_config = ConfigDict(json_schema_extra={"not": {"required": ["messages"]}})

    model: Annotated[str | None, WithJsonSchema(SERVED_MODEL)] = None
    prompt: str
    add_special_tokens: bool | None = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(RequestPart):
    # `messages` take text only here (the document says so: gateway/openapi_document.py)
    model_config = ConfigDict(json_schema_extra={"allOf": [continue_needs_no_generation_prompt()]})

    model: Annotated[str | None, WithJsonSchema(SERVED_MODEL)] = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    add_special_tokens: bool | None = False
    chat_template_kwargs: Annotated[dict[str, Any] | None, WithJsonSchema(TEMPLATE_KWARGS)] = None
    tools: Annotated[list[ToolDefinition] | None, Field(json_schema_extra={"x-tools": True})] = None
    return_token_strs: bool | None = False

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return no_reserved_kwargs(value)


class DetokenizeRequest(RequestPart):
    model: Annotated[str | None, WithJsonSchema(SERVED_MODEL)] = None
    tokens: Annotated[list[Int], Field(max_length=INT32_MAX), WithJsonSchema({"type": "array", "items": TOKEN_ID})]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str
