"""A request's structured-output fields → the Grammar the worker enforces (worker_svc/grammar.py
does the masking; proto/grammars.py says what each kind means).

    response_format {"type": "text"}                      no grammar
    response_format {"type": "json_object"}               JSON Schema {"type": "object"}
    response_format {"type": "json_schema", ...}          its `schema` ({} -- any JSON -- if absent)
    structured_outputs {"json": schema}  / guided_json    that JSON Schema (an object or its JSON text)
    structured_outputs {"json_object": true}              JSON Schema {"type": "object"}
    structured_outputs {"regex": ...}    / guided_regex   the output matches the regex
    structured_outputs {"choice": [...]} / guided_choice  the output is one of the strings
    structured_outputs {"grammar": ...}  / guided_grammar llguidance's Lark grammar

At most one of them per request. The grammar is checked here with the same function the
worker uses (llguidance), so one it cannot enforce is a 400 naming the field, never a
failure inside a worker step. `strict` is accepted either way: the schema is always enforced.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.errors import invalid
from gateway.structured_output_request import ResponseFormat, StructuredOutputs
from proto.grammars import grammar_error
from proto.messages import Grammar


def _response_format(response_format: ResponseFormat) -> tuple[str, Any] | None:
    if response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return "json_schema", {"type": "object"}
    assert response_format.json_schema is not None  # the model validator ensures it
    schema = response_format.json_schema.schema_
    return "json_schema", {} if schema is None else schema


def _structured_outputs(so: StructuredOutputs) -> list[tuple[str, str, Any]]:
    found = [(f"structured_outputs.{name}", kind, value) for name, kind, value in (
        ("json", "json_schema", so.json_), ("regex", "regex", so.regex), ("choice", "choice", so.choice),
        ("grammar", "lark", so.grammar)) if value is not None]
    if so.json_object:
        found.append(("structured_outputs.json_object", "json_schema", {"type": "object"}))
    return found


def constraints(body: Any) -> list[tuple[str, str, Any]]:
    """(request field, grammar kind, spec) for every structured-output field the body sets."""
    found: list[tuple[str, str, Any]] = []
    if body.response_format is not None and (rf := _response_format(body.response_format)):
        found.append(("response_format", *rf))
    if body.structured_outputs is not None:
        found += _structured_outputs(body.structured_outputs)
    for name, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"),
                       ("guided_choice", "choice"), ("guided_grammar", "lark")):
        if getattr(body, name) is not None:
            found.append((name, kind, getattr(body, name)))
    return found


def checked_grammar(field: str, kind: str, spec: Any) -> Grammar:
    """The Grammar for one field, or a 400 naming it. CPU-bound for large grammars: call it
    in a worker thread."""
    text = spec if isinstance(spec, str) and kind != "choice" else json.dumps(spec)
    if kind == "json_schema" and isinstance(spec, str):
        try:
            json.loads(spec)
        except ValueError as exc:
            raise invalid(f"{field}: the JSON Schema is not valid JSON: {exc}", param=field,
                          code="invalid_json_schema") from None
    problem = grammar_error(kind, text)
    if problem:
        what = {"json_schema": "this JSON Schema", "regex": "this regular expression",
                "choice": "this choice", "lark": "this grammar"}[kind]
        raise invalid(f"{field}: {what} cannot be enforced: {problem}", param=field,
                      code="invalid_json_schema" if kind == "json_schema" else "invalid_grammar")
    return Grammar(kind=kind, spec=text)


def grammar_for(body: Any) -> Grammar | None:
    """The one grammar the body asks for (None: unconstrained); 400 when it sets several."""
    found = constraints(body)
    if len(found) > 1:
        names = ", ".join(field for field, _, _ in found)
        raise invalid(f"Only one structured-output field may be set per request (got {names}).",
                      param=found[1][0], code="conflicting_parameters")
    return checked_grammar(*found[0]) if found else None
