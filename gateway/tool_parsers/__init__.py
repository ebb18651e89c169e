"""Tool-call parsers, by vLLM's names (`--tool-call-parser`): each reads one model family's
text format for calls (`split`: content and calls so far); `stream.py` turns that into
OpenAI's `tool_calls` and stream deltas. `forced.py` reads calls a grammar forced
(`tool_choice` "required" or named). Stdlib only: the gateway's flags list the names."""

from __future__ import annotations

from gateway.tool_parsers.calls import ToolParser
from gateway.tool_parsers.hermes import HermesParser
from gateway.tool_parsers.llama3_json import Llama3JsonParser
from gateway.tool_parsers.mistral import MistralParser

TOOL_PARSERS: dict[str, type] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}


def tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()
