"""A parser's splits turned into what OpenAI sends: one answer's `tool_calls`, or the
deltas of a stream (content pieces; per call its index, then id and name once, then its
arguments in pieces).

    stream = ToolCallStream(parser)
    for text in pieces:                        # the choice's new text
        content, deltas = stream.feed(text)    # what the next chunk carries
    content, deltas = stream.finish()          # held-back content, the rest of the calls
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from gateway.tool_parsers.calls import ToolParser


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ParsedToolCallDelta:
    index: int
    id: str | None = None  # with the name, in the call's first delta
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class ParsedToolCall:
    id: str
    name: str
    arguments: str  # JSON text


def extract_tool_calls(parser: ToolParser, text: str) -> tuple[str | None, list[ParsedToolCall]]:
    """(content, calls) of a whole answer. Text whose calls are not all well formed stays
    content, with no calls (as vLLM does)."""
    split = parser.split(text, final=True)
    calls = split.valid_calls()
    if calls is None:
        return text, []
    return split.content or None, [ParsedToolCall(call_id(), c.name or "", c.arguments) for c in calls]


class ToolCallStream:
    def __init__(self, parser: ToolParser):
        self._parser = parser
        self._text = ""
        self._content_sent = 0
        self._ids: list[str] = []  # one per call whose name went out
        self._args_sent: list[int] = []

    @property
    def called(self) -> bool:
        return bool(self._ids)

    def feed(self, text: str) -> tuple[str, list[ParsedToolCallDelta]]:
        self._text += text
        return self._diff(final=False)

    def finish(self) -> tuple[str, list[ParsedToolCallDelta]]:
        return self._diff(final=True)

    def _diff(self, final: bool) -> tuple[str, list[ParsedToolCallDelta]]:
        split = self._parser.split(self._text, final)
        content = split.content[self._content_sent:] if len(split.content) > self._content_sent else ""
        self._content_sent += len(content)
        deltas = []
        for index, call in enumerate(split.calls):
            if index == len(self._ids):
                if call.name is None:
                    break  # calls go out in order: wait for this one's name
                self._ids.append(call_id())
                self._args_sent.append(0)
                deltas.append(ParsedToolCallDelta(index, self._ids[index], call.name, call.arguments))
                self._args_sent[index] = len(call.arguments)
            elif len(call.arguments) > self._args_sent[index]:
                deltas.append(ParsedToolCallDelta(index, arguments=call.arguments[self._args_sent[index]:]))
                self._args_sent[index] = len(call.arguments)
        return content, deltas
