"""Tool-call parsers, by vLLM's names (`--tool-call-parser`): each reads one model family's
text format for calls (`split`: content and calls so far). Stdlib only: the gateway's flags
list the names.

    calls.py        ToolParser (the protocol), Split, PartialCall: what a parser reads out of
                    the text so far; a call's name and argument text out of one JSON object
    json_scan.py    where a partial JSON object's values and array's elements lie (positions,
                    not values: arguments stream as the model wrote them)
    hermes.py       `hermes`: `<tool_call>{...}</tool_call>` blocks (Hermes 2 Pro, Qwen2.5, Qwen3)
    llama3_json.py  `llama3_json`: bare JSON objects separated by `;`, after `<|python_tag|>`
                    (Llama 3.1-3.3)
    mistral.py      `mistral`: `[TOOL_CALLS]` then a JSON array of calls, or (v11 tokenizers
                    on) each call as `name[ARGS]{...}`
    stream.py       the splits as OpenAI sends them: one answer's `tool_calls`
                    (extract_tool_calls), a stream's deltas (ToolCallStream)
    forced.py       NamedCallParser, RequiredCallsParser: calls a grammar forced (`tool_choice`
                    a named function, or "required")"""

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
