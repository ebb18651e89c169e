"""Reading the output of a call the grammar forced (`tool_choice` "required" or a named
function, gateway/tools.py), the way vLLM shapes it:

    named      the output is the function's arguments object itself
    required   the output is a JSON array of {"name": ..., "parameters": {...}}
"""

from __future__ import annotations

from gateway.tool_parsers.calls import PartialCall, Split, call_from_object
from gateway.tool_parsers.json_scan import scan_array, value_end


class NamedCallParser:
    needs_special_tokens = False
    finish_reason = "stop"  # as OpenAI ends a named tool_choice

    def __init__(self, name: str):
        self.name = name

    def split(self, text: str, final: bool) -> Split:
        start = len(text) - len(text.lstrip())
        if start >= len(text):
            return Split("")
        end = value_end(text, start)
        return Split("", [PartialCall(self.name, text[start:end if end is not None else len(text)],
                                      end is not None)])


class RequiredCallsParser:
    needs_special_tokens = False
    finish_reason = "tool_calls"

    def split(self, text: str, final: bool) -> Split:
        start = len(text) - len(text.lstrip())
        if start >= len(text) or text[start] != "[":
            return Split("")
        starts, _ = scan_array(text, start)
        return Split("", [call_from_object(text, s, ("parameters", "arguments"))[0]
                          for s in starts if text[s] == "{"])
