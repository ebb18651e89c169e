"""OpenAI's Responses API request (`POST /v1/responses`), and how it becomes a chat
completion request: the gateway serves it with the same template, tools, grammar and
scheduler path as /v1/chat/completions (gateway/responses_api/output.py shapes the answer).

    instructions                        a system message first
    input: "text"                       one user message
    input: [items]                      messages ({"role", "content": text or input_text /
                                        output_text / input_image parts}; an input_image's
                                        image_url becomes chat's image_url part, its file_id
                                        chat's file part (an image uploaded to /v1/files)),
                                        "function_call" items (an
                                        assistant turn's tool_calls), "function_call_output"
                                        items (tool messages)
    tools: [{"type": "function", "name", "parameters", ...}]   chat's tools
    tool_choice, parallel_tool_calls    as in chat ({"type": "function", "name"} for one)
    text.format                         chat's response_format (json_schema flattened)
    max_output_tokens                   max_tokens

Errors of the chat request name the Responses fields they came from (`as_responses_error`).
Stateless: nothing is stored, so `previous_response_id`, `conversation` and `background`
are refused; `store` is accepted and the response says `"store": false`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import ConfigDict, Field, ValidationError, WithJsonSchema, field_validator

from gateway.errors import OpenAIError, from_validation_errors, invalid
from gateway.protocol import INT32_MAX, SERVED_MODEL, ChatCompletionRequest
from gateway.request_part import RequestPart, int_in
from gateway.responses_api import schema as wire
from gateway.schema_rules import tool_choice_needs_tools, when


class ResponsesRequest(RequestPart):
    # The dict-typed fields publish what the translation below accepts (gateway/responses_api/schema.py).
    model_config = ConfigDict(json_schema_extra={"allOf": [
        wire.INPUT_NOT_EMPTY,
        tool_choice_needs_tools(),
        when({"properties": {"tool_choice": {"anyOf": [{"const": "required"}, {"type": "object"}]}},
              "required": ["tool_choice"]},
             {"properties": {"text": {"anyOf": [{"type": "null"}, {"properties": {"format": {"anyOf": [
                 {"type": "null"}, {"properties": {"type": {"const": "text"}}}]}}}]}}}),
    ]})

    model: Annotated[str | None, WithJsonSchema(SERVED_MODEL)] = None
    input: Annotated[str | list[dict[str, Any]], WithJsonSchema(wire.INPUT)]
    instructions: str | None = None
    max_output_tokens: int_in(1, INT32_MAX) | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool | None = False
    tools: Annotated[list[dict[str, Any]] | None, WithJsonSchema(wire.TOOLS)] = None
    tool_choice: Annotated[str | dict[str, Any] | None, WithJsonSchema(wire.TOOL_CHOICE)] = None
    parallel_tool_calls: bool | None = None
    text: Annotated[dict[str, Any] | None, WithJsonSchema(wire.TEXT)] = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    previous_response_id: Annotated[str | None, WithJsonSchema(wire.STATELESS)] = None
    conversation: Annotated[Any, WithJsonSchema(wire.STATELESS_OR_FALSE)] = None
    background: Annotated[bool | None, WithJsonSchema(wire.STATELESS_OR_FALSE)] = None

    @field_validator("previous_response_id", "conversation", "background")
    @classmethod
    def _stateless(cls, value: Any, info) -> Any:
        if value is not None and value is not False:
            raise ValueError(f"'{info.field_name}' is not supported (got {value!r}): this server keeps no "
                             "state between responses; send the whole conversation in 'input'")
        return value


def _content_of(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content as chat content: text parts joined into a string, or, with an
    `input_image`, chat's list of parts (text and image_url)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of content parts.", param=f"{where}.content")
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image":
            parts.append(_image_part(part, f"{where}.content[{i}]"))
        else:
            raise invalid(f"{where}.content[{i}] has type {kind!r}: only input_text and input_image parts "
                          "are supported.", param=f"{where}.content")
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _image_part(part: dict[str, Any], where: str) -> dict[str, Any]:
    """`{"type": "input_image", "image_url": URL, "detail": ...}` → chat's image_url part
    (`detail` is ignored there anyway); `{"type": "input_image", "file_id": "file-..."}` (an
    image uploaded to /v1/files) → chat's file part. One of the two, not both."""
    url, file_id = part.get("image_url"), part.get("file_id")
    if url is not None and file_id is not None:
        raise invalid(f"{where}: an input_image takes 'image_url' or 'file_id', not both.",
                      param=f"{where}.file_id", code="invalid_value")
    if file_id is not None:
        if not isinstance(file_id, str) or not file_id:
            raise invalid(f"{where}: 'file_id' must be the id of an uploaded file.", param=f"{where}.file_id",
                          code="invalid_value")
        return {"type": "file", "file": {"file_id": file_id}}
    if not isinstance(url, str) or not url:
        raise invalid(f"{where}: an input_image needs 'image_url' (an http(s) URL or a data: URL) or "
                      "'file_id' (an image uploaded to /v1/files).",
                      param=f"{where}.image_url", code="missing_required_parameter")
    return {"type": "image_url", "image_url": {"url": url}}


def _messages(body: ResponsesRequest) -> tuple[list[dict[str, Any]], list[str]]:
    """The chat messages of `body`, and the Responses field each came from ("instructions",
    "input", "input[3]"), for error parameters."""
    messages: list[dict[str, Any]] = []
    sources: list[str] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
        sources.append("instructions")
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}], [*sources, "input"]
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            if item.get("role") not in ("user", "system", "developer", "assistant"):
                raise invalid(f"{where}.role must be user, system, developer or assistant.", param=f"{where}.role")
            messages.append({"role": item["role"], "content": _content_of(item.get("content"), where)})
            sources.append(where)
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            last = messages[-1] if messages else None
            if last and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # several calls of one turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                sources.append(where)
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else _content_of(output, where)})
            sources.append(where)
        else:
            raise invalid(f"{where} has type {kind!r}: only message, function_call and "
                          "function_call_output items are supported.", param=f"{where}.type")
    if not messages:
        raise invalid("'input' is empty.", param="input")
    return messages, sources


def _tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise invalid(f"tools[{i}] has type {tool.get('type')!r}: only function tools are supported "
                          "(no built-in tools run on this server).", param=f"tools[{i}].type")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters", "strict")
                                                     if tool.get(k) is not None}})
    return out


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return fmt
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "description", "schema", "strict")
                                                   if k in fmt}}


# Chat fields → the Responses fields they came from, for error messages.
_FIELD_OF = (("max_tokens", "max_output_tokens"), ("messages", "input"), ("response_format", "text.format"))


def as_responses_error(error: OpenAIError, body: ResponsesRequest | None = None) -> OpenAIError:
    """A chat-request error renamed into the Responses API's fields (`max_tokens` →
    `max_output_tokens`, ...). A message's field is named at the input item it came from when
    `body` is given (`messages[1].content[0].image_url.url` → `input[0].content[0].image_url`,
    the item's own field), else, like errors about the whole conversation, as `input`."""
    param = error.param
    for chat, ours in _FIELD_OF:
        if param is not None and (param == chat or param.startswith((chat + ".", chat + "["))):
            if chat == "messages" and body is not None:
                ours = _item_param(param, _messages(body)[1])
            message = error.message.replace(f"'{param}'", f"'{ours}'").replace(param, ours)
            if chat == "messages":
                message = message.replace("messages", "input")
            return OpenAIError(error.status, message, type=error.type, param=ours, code=error.code)
    return error


def _item_param(param: str, sources: list[str]) -> str:
    """`messages[k]<field>` → the source of message k with that field (`sources` from
    `_messages`); `input` when there is no item to name."""
    found = re.fullmatch(r"messages\[(\d+)\](.*)", param)
    if found is None or int(found[1]) >= len(sources):
        return "input"
    source = sources[int(found[1])]
    if not source.startswith("input["):  # the whole input string, or the instructions
        return source
    # an input_image's image_url is the URL itself, where chat's is {"url": ...}; its file_id
    # is chat's file.file_id
    return source + found[2].replace(".image_url.url", ".image_url").replace(".file.file_id", ".file_id")


def chat_body(body: ResponsesRequest) -> dict[str, Any]:
    """The /v1/chat/completions body this request amounts to (validated by the caller)."""
    chat: dict[str, Any] = {"messages": _messages(body)[0]}
    if body.model is not None:
        chat["model"] = body.model
    for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p"), ("parallel_tool_calls", "parallel_tool_calls")):
        if getattr(body, ours) is not None:
            chat[theirs] = getattr(body, ours)
    if body.tools:
        chat["tools"] = _tools(body.tools)
    choice = body.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        chat["tool_choice"] = choice
    response_format = _response_format(body.text)
    if response_format is not None:
        chat["response_format"] = response_format
    return chat


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request this request amounts to, validated as /v1/chat/completions
    validates its body (errors in chat's names: `as_responses_error` renames them)."""
    try:
        return ChatCompletionRequest.model_validate(chat_body(body))
    except ValidationError as exc:
        raise from_validation_errors(list(exc.errors(include_url=False))) from None


def echoed_fields(body: ResponsesRequest) -> dict[str, Any]:
    """The request's fields that its `response` object repeats, those that were sent."""
    return {key: value for key, value in (
        ("instructions", body.instructions), ("metadata", body.metadata), ("temperature", body.temperature),
        ("top_p", body.top_p), ("max_output_tokens", body.max_output_tokens), ("tools", body.tools),
        ("tool_choice", body.tool_choice), ("parallel_tool_calls", body.parallel_tool_calls),
        ("text", body.text)) if value is not None}
