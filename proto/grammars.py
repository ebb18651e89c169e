"""What each kind of `Grammar` (proto/messages.py, worker.proto) means: the llguidance
grammar the worker enforces for it. The gateway checks a request's grammar with the same
function, so a grammar the worker could not enforce is a 400 naming the request field,
never a failure inside a worker step.

    json_schema   spec: a JSON Schema (JSON text)
    regex         spec: a regular expression (Rust `regex` syntax) the whole output matches
    choice        spec: a JSON list of strings; the output is exactly one of them
    lark          spec: a grammar in llguidance's Lark dialect (`start:` is the output)

JSON is compiled without flexible whitespace (`, ` and `: ` separators): a model may not
pad the output with unbounded whitespace, which also keeps weak models from looping in it.
"""

from __future__ import annotations

import json

import llguidance

KINDS = ("json_schema", "regex", "choice", "lark")
JSON_OPTIONS = {"whitespace_flexible": False}


def grammar_text(kind: str, spec: str) -> str:
    """llguidance's grammar for a Grammar message; ValueError for an unknown kind or a spec
    of the wrong shape."""
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(spec, overrides=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        choices = json.loads(spec)
        if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
            raise ValueError("a choice needs a non-empty list of non-empty strings")
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    if kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(spec)
    raise ValueError(f"unknown grammar kind {kind!r}")


def grammar_error(kind: str, spec: str) -> str:
    """Why this grammar cannot be used ("" when it can)."""
    try:
        return llguidance.LLMatcher.validate_grammar(grammar_text(kind, spec))
    except ValueError as exc:
        return str(exc)
