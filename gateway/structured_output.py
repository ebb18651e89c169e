"""response_format → the Grammar the worker enforces (worker_svc/grammar.py does the masking).

    {"type": "text"}                                  no grammar
    {"type": "json_object"}                           JSON Schema {"type": "object"}
    {"type": "json_schema", "json_schema": {...}}     its `schema` ({} — any JSON — if absent)

The schema is checked here with the same library the worker uses (llguidance), so a schema
it cannot enforce is a 400 naming `response_format`, never a failure inside a worker step.
`strict` is accepted either way: the schema is always enforced.
"""

from __future__ import annotations

import json

import llguidance

from gateway.errors import invalid
from gateway.protocol import ResponseFormat
from proto.messages import Grammar


def schema_problem(spec: str) -> str:
    """Why llguidance cannot enforce this JSON Schema ("" when it can)."""
    try:
        return llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(spec))
    except ValueError as exc:
        return str(exc)


def grammar_for(response_format: ResponseFormat | None) -> Grammar | None:
    """CPU-bound for large schemas: call it in a worker thread."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        schema = {"type": "object"}
    else:
        assert response_format.json_schema is not None  # the model validator ensures it
        schema = response_format.json_schema.schema_
        schema = {} if schema is None else schema
    spec = json.dumps(schema)
    problem = schema_problem(spec)
    if problem:
        raise invalid(f"response_format: this JSON Schema cannot be enforced: {problem}",
                      param="response_format", code="invalid_json_schema")
    return Grammar(kind="json_schema", spec=spec)
