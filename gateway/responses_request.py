"""OpenAI's Responses API request (`POST /v1/responses`), and how it becomes a chat
completion request: the gateway serves it with the same template, tools, grammar and
scheduler path as /v1/chat/completions (gateway/responses_output.py shapes the answer).

    instructions                        a system message first
    input: "text"                       one user message
    input: [items]                      messages ({"role", "content": text or input_text /
                                        output_text parts}), "function_call" items (an
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

from typing import Any

from pydantic import Field, field_validator

from gateway.errors import OpenAIError, invalid
from gateway.protocol import INT32_MAX, RequestPart


class ResponsesRequest(RequestPart):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool | None = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None

    @field_validator("previous_response_id", "conversation", "background")
    @classmethod
    def _stateless(cls, value: Any, info) -> Any:
        if value not in (None, False):
            raise ValueError(f"'{info.field_name}' is not supported (got {value!r}): this server keeps no "
                             "state between responses; send the whole conversation in 'input'")
        return value


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text")
                    and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise invalid(f"{where}.content[{i}] has type {kind!r}: only text parts are supported.",
                              param=f"{where}.content")
            texts.append(part["text"])
        return "\n".join(texts)
    raise invalid(f"{where}.content must be a string or a list of text parts.", param=f"{where}.content")


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            if item.get("role") not in ("user", "system", "developer", "assistant"):
                raise invalid(f"{where}.role must be user, system, developer or assistant.", param=f"{where}.role")
            messages.append({"role": item["role"], "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            last = messages[-1] if messages else None
            if last and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # several calls of one turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else _text_of(output, where)})
        else:
            raise invalid(f"{where} has type {kind!r}: only message, function_call and "
                          "function_call_output items are supported.", param=f"{where}.type")
    if not messages:
        raise invalid("'input' is empty.", param="input")
    return messages


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


def as_responses_error(error: OpenAIError) -> OpenAIError:
    """A chat-request error renamed into the Responses API's fields (`messages[2].content`
    → `input`, `max_tokens` → `max_output_tokens`, ...)."""
    param = error.param
    for chat, ours in _FIELD_OF:
        if param is not None and (param == chat or param.startswith((chat + ".", chat + "["))):
            message = error.message.replace(f"'{param}'", f"'{ours}'").replace(param, ours)
            if chat == "messages":
                message = message.replace("messages", "input")
            return OpenAIError(error.status, message, type=error.type, param=ours, code=error.code)
    return error


def chat_body(body: ResponsesRequest) -> dict[str, Any]:
    """The /v1/chat/completions body this request amounts to (validated by the caller)."""
    chat: dict[str, Any] = {"messages": _messages(body)}
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
