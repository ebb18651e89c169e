"""`hermes` (vLLM's name): Hermes 2 Pro, Qwen2.5, Qwen3 and others write each call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

after any plain content; several calls are several blocks."""

from __future__ import annotations

from gateway.tool_parsers.calls import PartialCall, Split, call_from_object, held_back

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser:
    needs_special_tokens = False
    finish_reason = "tool_calls"

    def split(self, text: str, final: bool) -> Split:
        first = text.find(OPEN)
        if first < 0:
            keep = 0 if final else held_back(text, OPEN)
            return Split(text[:len(text) - keep])
        calls: list[PartialCall] = []
        at = first
        while at >= 0:
            body = at + len(OPEN)
            brace = text.find("{", body)
            if brace < 0 or text[body:brace].strip():
                break
            call, end = call_from_object(text, brace, ("arguments", "parameters"))
            close = text.find(CLOSE, end) if end is not None else -1
            call.complete = call.complete and (close >= 0 or final)
            calls.append(call)
            if close < 0:
                break
            at = text.find(OPEN, close + len(CLOSE))
        return Split(text[:first], calls)
