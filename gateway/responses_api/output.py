"""The Responses API's answer (`POST /v1/responses`): one `response` object, or its stream
of typed events, made from the same Generation a chat completion has.

Output items: a `message` with one `output_text` part for the text, then one
`function_call` item per tool call (read with the chat request's tool parser). Streamed:

    response.created, response.in_progress
    text:  response.output_item.added (message), response.content_part.added,
           response.output_text.delta ..., response.output_text.done,
           response.content_part.done, response.output_item.done
    call:  response.output_item.added (function_call), response.function_call_arguments.delta ...,
           response.function_call_arguments.done, response.output_item.done
    response.completed (status "incomplete" when max_output_tokens cut it), or
    response.failed with the error, when the generation fails after the stream started

Each SSE event is `event: <type>` and `data: <json>` with a growing `sequence_number`;
no `[DONE]` (OpenAI sends none on this endpoint).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, Field

from gateway.completion_models import Usage, now
from gateway.completion_output import ChoiceResult, usage
from gateway.errors import OpenAIError
from gateway.generation_group import Generating
from gateway.tool_parsers.calls import ToolParser
from gateway.tool_parsers.stream import ToolCallStream, extract_tool_calls

logger = logging.getLogger(__name__)


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []


class MessageItem(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = []


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class InputTokensDetails(BaseModel):
    cached_tokens: int  # input tokens whose K/V came from the prefix cache (block-aligned)


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=now)
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[MessageItem | FunctionCallItem] = []
    usage: ResponseUsage | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, str] | None = None
    instructions: str | None = None
    metadata: dict[str, str] = {}
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = []
    text: dict[str, Any] = {"format": {"type": "text"}}
    truncation: str = "disabled"
    store: bool = False


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(counts: Usage) -> ResponseUsage:
    """Chat's usage in the Responses API's names."""
    return ResponseUsage(input_tokens=counts.prompt_tokens, output_tokens=counts.completion_tokens,
                         total_tokens=counts.total_tokens,
                         input_tokens_details=InputTokensDetails(
                             cached_tokens=counts.prompt_tokens_details.cached_tokens))


class ResponsesFormat:
    """Also a `BodyFormat` of serving.collect (its `response`), and the event stream of a
    streamed request (`stream`)."""

    return_token_ids = False

    def __init__(self, response_id: str, model: str, echo: dict[str, Any], tool_parser: ToolParser | None):
        self.response_id = response_id
        self.model = model
        self.echo = echo  # request fields the response repeats (instructions, tools, ...)
        self.tool_parser = tool_parser

    def _response(self, status: str, output: list, usage: ResponseUsage | None = None, **extra) -> ResponseObject:
        return ResponseObject(id=self.response_id, status=status, model=self.model, output=output, usage=usage,
                              **self.echo, **extra)

    def _finish(self, finish_reason: str | None) -> dict[str, Any]:
        if finish_reason == "length":
            return {"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}}
        return {"status": "completed"}

    def response(self, choices: list[ChoiceResult], usage: Usage) -> ResponseObject:
        [choice] = choices
        content, calls = (choice.text, []) if self.tool_parser is None else \
            extract_tool_calls(self.tool_parser, choice.text)
        output: list[MessageItem | FunctionCallItem] = []
        if content or not calls:
            output.append(MessageItem(id=_item_id("msg"), content=[OutputText(text=content or "")]))
        output += [FunctionCallItem(id=_item_id("fc"), call_id=c.id, name=c.name, arguments=c.arguments)
                   for c in calls]
        finish = self._finish(choice.finish_reason)
        return self._response(finish.pop("status"), output, _usage(usage), **finish)

    async def stream(self, generation: Generating, num_prompt_tokens: int) -> AsyncIterator[str]:
        events = _EventWriter()
        yield events("response.created", response=self._response("in_progress", []))
        yield events("response.in_progress", response=self._response("in_progress", []))
        output: list[MessageItem | FunctionCallItem] = []
        message: MessageItem | None = None
        calls: dict[int, FunctionCallItem] = {}
        tools = ToolCallStream(self.tool_parser) if self.tool_parser is not None else None
        num_tokens, finish_reason = 0, None

        def text_events(text: str) -> list[str]:
            nonlocal message
            if not text:
                return []
            out = []
            if message is None:
                message = MessageItem(id=_item_id("msg"), status="in_progress", content=[])
                output.append(message)
                out.append(events("response.output_item.added", output_index=len(output) - 1, item=message))
                out.append(events("response.content_part.added", item_id=message.id, output_index=len(output) - 1,
                                  content_index=0, part=OutputText(text="")))
                message.content.append(OutputText(text=""))
            message.content[0].text += text
            out.append(events("response.output_text.delta", item_id=message.id, output_index=output.index(message),
                              content_index=0, delta=text, logprobs=[]))
            return out

        def call_events(deltas) -> list[str]:
            out = []
            for delta in deltas:
                if delta.index not in calls:
                    out += close_message()
                    item = FunctionCallItem(id=_item_id("fc"), call_id=delta.id, name=delta.name, arguments="",
                                            status="in_progress")
                    calls[delta.index] = item
                    output.append(item)
                    out.append(events("response.output_item.added", output_index=len(output) - 1, item=item))
                item = calls[delta.index]
                if delta.arguments:
                    item.arguments += delta.arguments
                    out.append(events("response.function_call_arguments.delta", item_id=item.id,
                                      output_index=output.index(item), delta=delta.arguments))
            return out

        def close_message() -> list[str]:
            nonlocal message
            if message is None or message.status != "in_progress":
                return []
            message.status = "completed"
            index = output.index(message)
            part = message.content[0]
            return [events("response.output_text.done", item_id=message.id, output_index=index, content_index=0,
                           text=part.text, logprobs=[]),
                    events("response.content_part.done", item_id=message.id, output_index=index, content_index=0,
                           part=part),
                    events("response.output_item.done", output_index=index, item=message)]

        try:
            async for _, out in generation.outputs():
                num_tokens, finish_reason = out.num_tokens, out.finish_reason or finish_reason
                if tools is None:
                    for event in text_events(out.text):
                        yield event
                    continue
                content, deltas = tools.feed(out.text)
                for event in text_events(content) + call_events(deltas):
                    yield event
            if tools is not None:
                content, deltas = tools.finish()
                for event in text_events(content) + call_events(deltas):
                    yield event
            for event in close_message():
                yield event
            for item in calls.values():
                item.status = "completed"
                index = output.index(item)
                yield events("response.function_call_arguments.done", item_id=item.id, output_index=index,
                             name=item.name, arguments=item.arguments)
                yield events("response.output_item.done", output_index=index, item=item)
            used = _usage(usage(num_prompt_tokens, num_tokens, generation.num_cached_tokens))
            finish = self._finish(finish_reason)
            yield events("response.completed", response=self._response(finish.pop("status"), output, used, **finish))
        except Exception as exc:  # the stream has started: report it inside, in the API's shape
            if not isinstance(exc, OpenAIError):
                logger.exception("response stream %s failed", self.response_id)
                exc = OpenAIError(500, "The server had an error while processing your request.",
                                  type="server_error", code="internal_error")
            error = {"code": exc.code or exc.type, "message": exc.message}
            yield events("response.failed", response=self._response("failed", output, error=error))
        finally:
            generation.close()


class _EventWriter:
    """One SSE event per call, numbered."""

    def __init__(self) -> None:
        self._sequence = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self._sequence,
                **{k: v.model_dump(mode="json") if isinstance(v, BaseModel) else v for k, v in fields.items()}}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"
