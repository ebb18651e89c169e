"""What a chat request's `tools` and `tool_choice` make of its answer: the parser that reads
calls out of the text, and, when the choice forces a call, the grammar that makes the model
write one (so only a valid call can come out, whatever the weights).

    tool_choice        grammar (JSON Schema)                        parser
    none               -                                            - (text only)
    absent             - ; as "auto" when the gateway has            -
                       --enable-auto-tool-choice, else as "none"
    auto               - (needs --enable-auto-tool-choice and        --tool-call-parser's
                       --tool-call-parser, else 400)
    required           an array of >= 1 {"name", "parameters"}       forced.RequiredCallsParser
                       objects, one schema per tool (at most one
                       with parallel_tool_calls false)
    {"function": f}    f's parameters                               forced.NamedCallParser(f)

The tools always reach the chat template (how the model learns of them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.errors import invalid
from gateway.protocol import ChatCompletionRequest
from gateway.structured_output import checked_grammar, constraints
from gateway.tool_parsers import tool_parser
from gateway.tool_parsers.calls import ToolParser
from gateway.tool_parsers.forced import NamedCallParser, RequiredCallsParser
from proto.messages import Grammar


@dataclass(frozen=True)
class ToolPlan:
    parser: ToolParser | None = None  # None: the answer is text only
    grammar: Grammar | None = None  # set when the call is forced


def _parameters(function: Any) -> dict[str, Any]:
    return function.parameters if function.parameters is not None else {"type": "object", "properties": {}}


def plan_tools(body: ChatCompletionRequest, parser_name: str | None, auto_enabled: bool) -> ToolPlan:
    """CPU-bound for large schemas: call it in a worker thread."""
    tools = body.tools or []
    choice = body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise invalid(f"tool_choice {choice!r} needs 'tools'.", param="tool_choice", code="missing_tools")
        return ToolPlan()
    if choice == "none" or (choice is None and not (auto_enabled and parser_name)):
        return ToolPlan()
    if choice in (None, "auto"):
        if not (auto_enabled and parser_name):
            raise invalid("tool_choice 'auto' needs the gateway started with --enable-auto-tool-choice "
                          "and --tool-call-parser.", param="tool_choice", code="unsupported_parameter")
        return ToolPlan(parser=tool_parser(parser_name))
    if constraints(body):
        names = ", ".join(field for field, _, _ in constraints(body))
        raise invalid(f"tool_choice {choice!r} forces a call with a grammar; it cannot be combined with {names}.",
                      param="tool_choice", code="conflicting_parameters")
    if choice == "required":
        calls = {"anyOf": [{"type": "object", "properties": {
            "name": {"const": t.function.name}, "parameters": _parameters(t.function)},
            "required": ["name", "parameters"], "additionalProperties": False} for t in tools]}
        schema: dict[str, Any] = {"type": "array", "items": calls, "minItems": 1}
        if body.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan(RequiredCallsParser(), checked_grammar("tools", "json_schema", schema))
    name = body.named_tool
    function = next((t.function for t in tools if t.function.name == name), None)
    if function is None:
        raise invalid(f"tool_choice names the function {name!r}, which is not among the tools.",
                      param="tool_choice", code="tool_not_found")
    return ToolPlan(NamedCallParser(name), checked_grammar("tools", "json_schema", _parameters(function)))
