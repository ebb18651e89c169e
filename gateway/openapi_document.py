"""/openapi.json: the contract of this gateway, built once per app.

FastAPI writes the routes and their `responses=` (gateway/openapi_answers.py); this adds
what it cannot infer and what depends on the server:

* the request bodies: the routes read and validate the raw body themselves (size limit
  first, OpenAI-shaped errors), so FastAPI does not see them; `/tokenize` takes either of
  two shapes (with `messages`: the chat one);
* the request models' "x-" markers, filled in for this server (`ServedFacts`): the served
  model names (`x-served-model`), the vocabulary bound of token ids (`x-token-id`, and
  `x-token-id-key` for logit_bias keys), image and video parts only where the model takes
  them (`x-media`), tools only where the chat template reads them (`x-tools`), "auto"
  tool choice only with --enable-auto-tool-choice and a parser (`x-tool-choice`), and
  min_tokens within the default max_tokens of /v1/completions;
* no 422 (validation errors are OpenAI 400s here), and the bearer scheme on the routes that
  want an API key when the gateway has keys.

So that a body this document calls valid is one the gateway takes, up to the refusals no
JSON Schema can state (gateway/openapi_answers.py, BEYOND_SCHEMA). A third-party fuzzer
holds the gateway to it (tests/e2e/test_e2e_openapi_contract.py; docs/api.md, "The OpenAPI document
is the contract").
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from gateway.openapi_answers import FILES_PATH, MEDIA_CODES, ErrorBody, error_responses
from gateway.schema_rules import min_tokens_within_default

JsonSchema = dict[str, Any]
_REF = "#/components/schemas/"


@dataclass(frozen=True)
class ServedFacts:
    """What the document says of this server in particular."""

    model_names: tuple[str, ...]
    vocab_size: int
    takes_media: bool  # a vision checkpoint, served by the stack (not the in-process engine)
    tools: bool  # the chat template reads `tools`
    auto_tool_choice: bool  # --enable-auto-tool-choice with a --tool-call-parser
    completion_max_tokens: int  # /v1/completions' max_tokens when a request has none
    api_keys: bool  # every /v1 route wants a key
    protect_metrics: bool  # so do /health*


def install_openapi(app: FastAPI, bodies: dict[str, type[BaseModel] | tuple[type[BaseModel], ...]],
                    events: tuple[type[BaseModel], ...], facts: ServedFacts) -> None:
    """Serve the document described above at /openapi.json; `bodies`: each POST route's
    request model (a tuple: any one of them); `events`: the models streamed events carry."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            _add_bodies(schema, bodies)
            _add_components(schema, events)
            schema = copy.deepcopy(schema)  # the models' schemas share constants: patch a copy
            _fill_markers(schema, facts)
            _drop_validation_errors(schema)
            if facts.api_keys:
                _add_security(schema, facts.protect_metrics)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _add_bodies(schema: JsonSchema, bodies: dict[str, type[BaseModel] | tuple[type[BaseModel], ...]]) -> None:
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, models in bodies.items():
        models = models if isinstance(models, tuple) else (models,)
        for model in models:
            body = model.model_json_schema(ref_template=_REF + "{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
        refs = [{"$ref": _REF + model.__name__} for model in models]
        schema["paths"][path]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": refs[0] if len(refs) == 1 else {"anyOf": refs}}}}


def _add_components(schema: JsonSchema, models: tuple[type[BaseModel], ...]) -> None:
    components = schema["components"]["schemas"]
    for model in models:
        body = model.model_json_schema(ref_template=_REF + "{model}", mode="serialization")
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body


def _nodes(node: Any) -> Iterator[JsonSchema]:
    """Every dict in the document, parents before children."""
    if isinstance(node, dict):
        yield node
        for value in list(node.values()):
            yield from _nodes(value)
    elif isinstance(node, list):
        for value in node:
            yield from _nodes(value)


def _fill_markers(schema: JsonSchema, facts: ServedFacts) -> None:
    components = schema["components"]["schemas"]
    if not facts.takes_media:
        _drop_alternatives(schema, lambda s: s.get("x-media") is True
                           or components.get(s.get("$ref", "").removeprefix(_REF), {}).get("x-media") is True)
        for name in [n for n, s in components.items() if s.get("x-media") is True]:
            del components[name]
        for path, operations in schema["paths"].items():
            if path.startswith(FILES_PATH):  # the Files API checks its images on any model
                continue
            for node in _nodes(operations):
                if isinstance(node.get("x-beyond-schema"), list):
                    node["x-beyond-schema"] = [c for c in node["x-beyond-schema"] if c not in MEDIA_CODES]
    _text_only_tokenize(components)
    for node in list(_nodes(schema)):
        node.pop("x-media", None)
        if node.pop("x-token-id", False):
            node["maximum"] = facts.vocab_size - 1
            node["description"] = f"A token id of this model's vocabulary: 0 to {facts.vocab_size - 1}."
        if node.pop("x-token-id-key", False):
            node["pattern"] = token_id_pattern(facts.vocab_size)
        if node.pop("x-served-model", False):
            node.clear()
            node.update({"anyOf": [{"enum": list(facts.model_names)}, {"type": "null"}],
                         "description": "One of the served names; absent or null: the served model."})
        if node.pop("x-tools", False) and not facts.tools:
            node.clear()
            node.update({"anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}],
                         "description": "Refused (400) unless empty: this model's chat template has no tool support."})
        if node.pop("x-tool-choice", False):
            choices = node["anyOf"]
            if not facts.tools:
                choices[:] = [{"enum": ["none"]}, {"type": "null"}]
            elif not facts.auto_tool_choice:
                choices[0] = {"enum": ["none", "required"]}
                node["description"] = ("'auto' is refused (400): the gateway runs without "
                                       "--enable-auto-tool-choice and --tool-call-parser.")
    completion = components["CompletionRequest"]
    completion["allOf"].append(min_tokens_within_default(facts.completion_max_tokens))
    _drop_unreferenced(schema)


def _drop_alternatives(schema: JsonSchema, drop: Callable[[JsonSchema], bool]) -> None:
    """Remove the anyOf / oneOf alternatives `drop` picks (and their discriminator mappings)."""
    for node in list(_nodes(schema)):
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list) and any(drop(s) for s in node[key] if isinstance(s, dict)):
                node[key] = [s for s in node[key] if not drop(s)]
                mapping = node.get("discriminator", {}).get("mapping", {})
                kept = {s.get("$ref") for s in node[key]}
                for value, ref in list(mapping.items()):
                    if ref not in kept:
                        del mapping[value]


def _drop_unreferenced(schema: JsonSchema) -> None:
    """Remove the components nothing refers to any more (ImageURL, once its part is gone)."""
    components = schema["components"]["schemas"]
    seen: set[str] = set()
    todo = [schema["paths"]]
    while todo:
        for node in _nodes(todo.pop()):
            name = node.get("$ref", "").removeprefix(_REF) if isinstance(node.get("$ref"), str) else ""
            if name and name not in seen and name in components:
                seen.add(name)
                todo.append(components[name])
    for name in set(components) - seen:
        del components[name]


def _text_only_tokenize(components: dict[str, JsonSchema]) -> None:
    """/tokenize takes text parts only: its messages get a ChatMessage without media."""
    message = copy.deepcopy(components["ChatMessage"])
    content = message["properties"]["content"]
    for alternative in content["anyOf"]:
        if alternative.get("type") == "array":
            alternative["items"] = {"$ref": _REF + "TextPart"}
    message["title"] = "TextChatMessage"
    message["description"] = "A chat message whose content is text (a string, or text parts)."
    components["TextChatMessage"] = message
    components["TokenizeChatRequest"]["properties"]["messages"]["items"] = {"$ref": _REF + "TextChatMessage"}


def _drop_validation_errors(schema: JsonSchema) -> None:
    """FastAPI documents a 422 for routes with parameters; this gateway answers 400 instead."""
    for methods in schema["paths"].values():
        for operation in methods.values():
            operation.get("responses", {}).pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        schema["components"]["schemas"].pop(name, None)


def _add_security(schema: JsonSchema, protect_metrics: bool) -> None:
    """The routes gateway/auth.py guards want a bearer key, and may answer 401."""
    schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer",
                                                          "description": "An API key of --api-key."}}
    error_body = ErrorBody.model_json_schema(ref_template=_REF + "{model}")
    schema["components"]["schemas"].update({**error_body.pop("$defs", {}), ErrorBody.__name__: error_body})
    unauthorized = error_responses(401)[401]
    for path, methods in schema["paths"].items():
        if path == "/v1" or path.startswith("/v1/") or (protect_metrics and path.startswith("/health")):
            for operation in methods.values():
                operation["security"] = [{"bearer": []}]
                operation["responses"]["401"] = {
                    "description": unauthorized["description"],
                    "content": {"application/json": {"schema": {"$ref": _REF + ErrorBody.__name__}}}}


def token_id_pattern(vocab_size: int) -> str:
    """A regular expression for the decimal token ids 0 .. vocab_size - 1, leading zeros
    allowed (the gateway reads logit_bias keys with int())."""
    top = str(vocab_size - 1)
    alternatives = [f"[0-9]{{1,{len(top) - 1}}}"] if len(top) > 1 else []
    for i, digit in enumerate(top):
        if digit != "0":
            low = "0" if i or len(top) == 1 else "1"
            if int(digit) - 1 >= int(low):
                rest = f"[0-9]{{{len(top) - i - 1}}}" if i < len(top) - 1 else ""
                alternatives.append(f"{top[:i]}[{low}-{int(digit) - 1}]{rest}")
    alternatives.append(top)
    return f"^0*(?:{'|'.join(alternatives)})$"
