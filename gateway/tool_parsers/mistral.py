"""`mistral` (vLLM's name): Mistral models write `[TOOL_CALLS]` (a special token, so the
request keeps special tokens in the text) and then either a JSON array of calls (v3 tokenizers)

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

or, from the v11 tokenizers on, each call as a name and its arguments

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}"""

from __future__ import annotations

import re

from gateway.tool_parsers.calls import PartialCall, Split, call_from_object, held_back
from gateway.tool_parsers.json_scan import scan_array, value_end

MARK, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"\s*([A-Za-z0-9_.\-]+)\[ARGS\]")


class MistralParser:
    needs_special_tokens = True
    finish_reason = "tool_calls"

    def split(self, text: str, final: bool) -> Split:
        first = text.find(MARK)
        if first < 0:
            keep = 0 if final else held_back(text, MARK)
            return Split(text[:len(text) - keep])
        content, rest = text[:first], first + len(MARK)
        body = text[rest:].lstrip()
        at = len(text) - len(body)
        if body.startswith("["):
            return Split(content, self._array(text, at))
        return Split(content, self._named(text, rest))

    def _array(self, text: str, at: int) -> list[PartialCall]:
        starts, _ = scan_array(text, at)
        calls = []
        for start in starts:
            if text[start] != "{":
                break
            calls.append(call_from_object(text, start, ("arguments", "parameters"))[0])
        return calls

    def _named(self, text: str, at: int) -> list[PartialCall]:
        calls = []
        while at < len(text):
            match = _NAME.match(text, at)
            if match is None:
                break
            start = match.end()
            end = value_end(text, start) if start < len(text) else None
            calls.append(PartialCall(match.group(1), text[start:end if end is not None else len(text)],
                                     end is not None))
            if end is None:
                break
            at = end + len(MARK) if text.startswith(MARK, end) else end
        return calls
