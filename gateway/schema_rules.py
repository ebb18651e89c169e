"""The rules of a request body that span several fields, written as JSON Schema for
/openapi.json (each model's `json_schema_extra` adds them under `allOf`), so that a body
the document calls valid is one the gateway takes. The validators in gateway/protocol.py,
gateway/chat_message.py and the preflight enforce the same rules; these only publish them.

Budget: a fuzzer generates bodies from the document by rewriting it into a union of plain
object schemas (schemathesis canonicalizes it with jsonschema_rs), and every rule here
doubles that union at least. With the fifty-odd fields of a chat request it gives up past
three such rules (the operation is then not tested at all), so each request model carries
at most three top-level rules. The other rules that span fields are left out of the schema
and their refusals carry their own error codes, listed with the 400 of each route as
`x-beyond-schema` (gateway/openapi_answers.py), beside what no JSON Schema can say:
a prompt too long for the context, a grammar llguidance cannot compile, ...
"""

from __future__ import annotations

from typing import Any

JsonSchema = dict[str, Any]
NOT_NULL: JsonSchema = {"not": {"type": "null"}}
_NO_CALL: JsonSchema = {"enum": ["none", None]}


def present(field: str, schema: JsonSchema | None = None) -> JsonSchema:
    """The body has `field`, not null (and matching `schema`)."""
    return {"properties": {field: {**NOT_NULL, **(schema or {})}}, "required": [field]}


def when(condition: JsonSchema, then: JsonSchema) -> JsonSchema:
    return {"if": condition, "then": then}


def stream_options_need_stream() -> JsonSchema:
    return when(present("stream_options"), {"properties": {"stream": {"const": True}}, "required": ["stream"]})


def continue_needs_no_generation_prompt() -> JsonSchema:
    """continue_final_message: true needs add_generation_prompt false or null (it defaults to true)."""
    return when({"properties": {"continue_final_message": {"const": True}}, "required": ["continue_final_message"]},
                {"properties": {"add_generation_prompt": {"enum": [False, None]}},
                 "required": ["add_generation_prompt"]})


def top_logprobs_need_logprobs() -> JsonSchema:
    return when(present("top_logprobs"), {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]})


def tool_choice_needs_tools() -> JsonSchema:
    """A tool_choice other than "none" needs at least one tool."""
    return when({"properties": {"tool_choice": {"not": _NO_CALL}}, "required": ["tool_choice"]},
                {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]})


def min_tokens_within_default(default_max_tokens: int) -> JsonSchema:
    """Without max_tokens, min_tokens may not exceed the default max_tokens."""
    return when({"properties": {"max_tokens": {"type": "null"}}},
                {"properties": {"min_tokens": {"anyOf": [{"type": "null"},
                                                         {"type": "integer", "maximum": default_max_tokens}]}}})


def one_of_keys(keys: dict[str, tuple[JsonSchema, JsonSchema]]) -> JsonSchema:
    """At most one key of an object is set: each key is (set, unset), as schemas of the
    object. One anyOf (none set, or exactly one), for a small object such as
    structured_outputs."""
    unset = [off for _, off in keys.values()]
    return {"anyOf": [{"allOf": unset}] + [{"allOf": [on] + [off for other, (_, off) in keys.items() if other != name]}
                                           for name, (on, _) in keys.items()]}
