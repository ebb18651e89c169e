"""What a tool parser reads out of the model's text so far (`ToolParser.split`), and how a
call's name and argument text come out of one JSON object.

A parser sees the whole text each time (streaming: all of it so far, `final` False) and
returns the plain content and the calls found, the last one possibly still open. Content it
cannot yet tell from the start of a call (a partial `<tool_call>` marker) is held back
until `final`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Protocol

from gateway.tool_parsers.json_scan import scan_object


@dataclass
class PartialCall:
    name: str | None  # None until the name's string is complete
    arguments: str  # the arguments' JSON text so far, as the model wrote it
    complete: bool  # the call's text has ended


@dataclass
class Split:
    content: str
    calls: list[PartialCall] = field(default_factory=list)

    def valid_calls(self) -> list[PartialCall] | None:
        """The calls, when every one is complete with a name and JSON object arguments
        (else None: the text is not a well-formed answer with calls)."""
        if not self.calls:
            return None
        for call in self.calls:
            if not call.complete or not call.name:
                return None
            try:
                if not isinstance(json.loads(call.arguments), dict):
                    return None
            except ValueError:
                return None
        return self.calls


class ToolParser(Protocol):
    # vLLM sets skip_special_tokens false for parsers whose markers are special tokens.
    needs_special_tokens: bool
    # What a choice that made calls ends with: "tool_calls", but "stop" when the request
    # named the function (OpenAI's answer to a named tool_choice).
    finish_reason: str

    def split(self, text: str, final: bool) -> Split: ...


def held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def call_from_object(text: str, start: int, args_keys: tuple[str, ...],
                     name: str | None = None) -> tuple[PartialCall, int | None]:
    """The call in the JSON object at text[start] ("{"): its "name" (or `name`), its
    arguments under the first of `args_keys` present; and the index past the object."""
    scanned = scan_object(text, start)
    if name is None and "name" in scanned.values:
        begin, end = scanned.values["name"]
        if end is not None:
            try:
                name = json.loads(text[begin:end])
            except ValueError:
                name = None
            name = name if isinstance(name, str) else None
    arguments = ""
    for key in args_keys:
        if key in scanned.values:
            begin, end = scanned.values[key]
            arguments = text[begin:end if end is not None else len(text)]
            break
    complete = scanned.end is not None
    if complete and not arguments:
        arguments = "{}"
    return PartialCall(name, arguments, complete), scanned.end
