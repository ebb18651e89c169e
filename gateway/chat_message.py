"""One turn of a chat conversation and the tools offered to the model, as OpenAI's chat API
defines them: a message's role and content (a string, or content parts: text, images and
video, gateway/content_parts.py), an assistant turn's tool calls, a tool turn's answer; and
`template_dict`, the message as chat templates take it."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from gateway.content_parts import ContentPart, MediaContentPart, normalize_content
from gateway.request_part import RequestPart
from gateway.schema_rules import NOT_NULL, JsonSchema, present, when


def _role_is(*roles: str) -> JsonSchema:
    return {"properties": {"role": {"enum": list(roles)}}, "required": ["role"]}


def _role_is_not(role: str) -> JsonSchema:
    return {"properties": {"role": {"not": {"const": role}}}, "required": ["role"]}


# `_shape_per_role` as JSON Schema: a tool turn names its call; only an assistant turn may
# leave content null or carry tool_calls; only a user turn carries images or video.
_PER_ROLE = [
    when(_role_is("tool"), present("tool_call_id", {"type": "string"})),
    when(_role_is_not("assistant"), {"properties": {"content": NOT_NULL,
                                                    "tool_calls": {"anyOf": [{"type": "null"},
                                                                             {"type": "array", "maxItems": 0}]}},
                                     "required": ["content"]}),
    when(_role_is_not("user"), {"properties": {"content": {"anyOf": [
        {"type": "string"}, {"type": "null"},
        {"type": "array", "items": {"properties": {"type": {"const": "text"}}}}]}}}),
]


class ChatMessage(RequestPart):
    model_config = ConfigDict(json_schema_extra={"allOf": _PER_ROLE})

    role: Literal["system", "developer", "user", "assistant", "tool"]
    # A string, or a list of content parts (gateway/content_parts.py): text parts only are
    # joined with newlines into a string; with an image or a video the list stays, typed.
    # null only for an assistant turn.
    content: str | list[ContentPart] | None = None
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
    def _content(cls, value: Any) -> Any:
        return normalize_content(value)

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
        if self.has_media and self.role != "user":
            raise ValueError(f"only 'user' turns may carry image_url or video_url parts; this one "
                             f"is '{self.role}'")
        return self

    @property
    def has_media(self) -> bool:
        """Whether the content holds an image or a video (it is then a list of parts)."""
        return isinstance(self.content, list)

    @property
    def media_parts(self) -> list[tuple[int, MediaContentPart]]:
        """(index in content, part) of each image and video part, in order."""
        if not isinstance(self.content, list):
            return []
        return [(j, part) for j, part in enumerate(self.content) if part.type != "text"]

    def template_dict(self, content: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The message as chat templates expect it; `developer` is OpenAI's newer `system`.
        A call's `arguments` (JSON text on the wire) become an object, as templates (Qwen's,
        Llama's, Mistral's) write them with `tojson`. `content`: the template's parts for a
        message with media (gateway/mm_prompt.py makes them), which its own content is not."""
        if content is None and self.has_media:
            raise ValueError("a message with images or video needs its template parts")
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                   "content": content if content is not None else self.content or ""}
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        if self.tool_calls is not None:
            message["tool_calls"] = [_template_call(call) for call in self.tool_calls]
        return message


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


class FunctionDefinition(RequestPart):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(RequestPart):
    type: Literal["function"]
    function: FunctionDefinition
