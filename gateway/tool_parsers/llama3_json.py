"""`llama3_json` (vLLM's name): Llama 3.1-3.3 answer a call with a bare JSON object (after
`<|python_tag|>` when special tokens are kept), several separated by `;`:

    {"name": "get_weather", "parameters": {"city": "Paris"}}

An answer whose first non-blank character is not `{` (nor the tag) is plain content."""

from __future__ import annotations

from gateway.tool_parsers.calls import PartialCall, Split, call_from_object

TAG = "<|python_tag|>"


class Llama3JsonParser:
    needs_special_tokens = False
    finish_reason = "tool_calls"

    def split(self, text: str, final: bool) -> Split:
        body = text.lstrip()
        if body.startswith(TAG):
            body = body[len(TAG):].lstrip()
        elif not final and body and TAG.startswith(body):
            return Split("")  # maybe the tag: wait
        if not body:
            return Split(text if final else "")
        if body[0] != "{":
            return Split(text)
        calls: list[PartialCall] = []
        at = len(text) - len(body)
        while at < len(text) and text[at] == "{":
            call, end = call_from_object(text, at, ("parameters", "arguments"))
            calls.append(call)
            if end is None:
                break
            rest = text[end:].lstrip()
            if not rest.startswith(";"):
                break
            rest = rest[1:].lstrip()
            at = len(text) - len(rest)
        return Split("", calls)
