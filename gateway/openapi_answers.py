"""What each route may answer, as /openapi.json publishes it: FastAPI `responses=` entries.

Every failure has OpenAI's error body (`ErrorBody`, gateway/errors.py makes it) under the
status the gateway uses for it (docs/api.md "Errors"):

    400  malformed JSON, a wrong type or value, a refused parameter; and, for a body the
         document calls valid, only the refusals its 400 lists under `x-beyond-schema`
         (BEYOND_SCHEMA: a prompt too long for the context, a grammar llguidance cannot
         enforce, media that cannot be fetched or decoded, ...)
    401  a missing or wrong API key (on /v1 routes, when the gateway has --api-key: the
         document then adds it, with the bearer scheme: gateway/openapi_document.py)
    404  a model this server does not serve
    413  a body over --max-body-bytes
    429  the waiting queue is full (with Retry-After)
    500  an unexpected error (CatchAllMiddleware)
    501  a video, on a gateway without PyAV
    503  nothing can serve the request now (no live worker or scheduler, Redis away)
    504  tokens stopped coming for --request-timeout-s

A route that streams answers 200 with its JSON body, or with `text/event-stream` when the
request asked for `stream: true` (`json_or_event_stream`).
"""

from __future__ import annotations

import copy
from types import MappingProxyType
from typing import Any

from pydantic import BaseModel, Field

JsonSchema = dict[str, Any]
_REF = "#/components/schemas/"


class ErrorDetail(BaseModel):
    message: str = Field(description="What went wrong, for a person.")
    type: str = Field(description="invalid_request_error, authentication_error, rate_limit_error, "
                                  "service_unavailable, timeout_error or server_error.")
    param: str | None = Field(description="The request field at fault, as `messages[0].content`.")
    code: str | None = Field(description="A stable name of the error: invalid_value, model_not_found, "
                                         "context_length_exceeded, ...")


class ErrorBody(BaseModel):
    """OpenAI's error shape, the body of every failure."""

    error: ErrorDetail


# The refusals of a body this document calls valid: what JSON Schema cannot state (token
# counts, comparing two fields, the last message's role, a grammar's meaning, what a URL
# holds, a chat template's own rules). Each has its own error code, listed with the 400 of
# the routes where it can happen, as "x-beyond-schema"; nothing else refuses a valid body.
BEYOND_SCHEMA: tuple[tuple[str, str], ...] = (
    ("context_length_exceeded", "the prompt's tokens plus max_tokens exceed the model's context"),
    ("min_tokens_above_max_tokens", "min_tokens exceeds max_tokens (or the default max_tokens)"),
    ("final_message_not_assistant", "continue_final_message needs an assistant message last"),
    ("chat_template_error", "the model's chat template refused the messages (e.g. roles that do not alternate)"),
    ("invalid_json_schema", "a JSON Schema that llguidance cannot enforce"),
    ("invalid_grammar", "a regular expression, choice or grammar that llguidance cannot enforce"),
    ("request_rejected", "no worker could ever hold the request (KV blocks, --max-num-seqs)"),
    # rules JSON Schema could say, left out to keep the document within a fuzzer's reach
    # (gateway/schema_rules.py)
    ("conflicting_parameters", "two structured-output fields, or one beside a forced tool call"),
    ("too_many_choices", "n times the number of prompts exceeds 128"),
    ("missing_tools", "a tool_choice other than none without tools"),
    ("tool_not_found", "tool_choice names a function that is not among the tools"),
)
# ... and what an image or video URL holds, or whether a uuid names media sent before
# (vision checkpoints only).
MEDIA_BEYOND_SCHEMA: tuple[tuple[str, str], ...] = tuple((code, "an image or video that cannot be taken") for code in (
    "invalid_media_url", "invalid_media_type", "media_fetch_failed", "media_too_large", "media_domain_not_allowed",
    "media_url_not_allowed", "local_media_not_allowed", "invalid_image", "image_too_large", "unsupported_image_format",
    "invalid_video",
    "video_too_large", "video_too_long", "too_many_media_items", "invalid_image_tokens",
    "chat_template_dropped_images", "media_not_found", "file_not_found"))
MEDIA_CODES = tuple(code for code, _ in MEDIA_BEYOND_SCHEMA)
COMPLETION_BEYOND = ("context_length_exceeded", "min_tokens_above_max_tokens", "invalid_json_schema",
                     "invalid_grammar", "request_rejected", "conflicting_parameters", "too_many_choices")
CHAT_BEYOND = tuple(code for code, _ in BEYOND_SCHEMA if code != "too_many_choices") + MEDIA_CODES
# The Responses API's tool rules are in its schema; it has no continue_final_message.
RESPONSES_BEYOND = tuple(code for code in CHAT_BEYOND if code not in (
    "final_message_not_assistant", "conflicting_parameters", "missing_tools"))
TOKENIZE_BEYOND = ("chat_template_error",)
# POST /v1/files: what the file holds (gateway/media/images.py's refusals), on any model.
FILES_PATH = "/v1/files"
FILE_UPLOAD_BEYOND = ("invalid_image", "image_too_large", "unsupported_image_format")

_DESCRIPTIONS = MappingProxyType({
    400: "The request is malformed or asks for something this server does not do (`param` names the "
         "field), or, for a body this document calls valid, one of the refusals listed in "
         "`x-beyond-schema` (error codes of rules JSON Schema cannot state, such as a prompt too long "
         "for the context: `context_length_exceeded`).",
    401: "A missing or wrong API key (`invalid_api_key`).",
    404: "The model is not served here (`model_not_found`).",
    413: "The request body is over --max-body-bytes (`request_too_large`); the connection closes.",
    429: "Every live scheduler's waiting queue is full (`too_many_waiting_requests`); retry after "
         "`Retry-After` seconds.",
    500: "An unexpected error in the gateway (`internal_error`).",
    503: "Nothing can serve the request now (`no_live_worker`, `no_live_scheduler`, "
         "`redis_unavailable`, `reply_channel_unsubscribed`); retry later.",
    501: "A video, and this server cannot decode video (PyAV is missing).",
    504: "Tokens stopped coming for --request-timeout-s.",
})
_HEADERS = MappingProxyType({
    429: {"Retry-After": {"description": "Seconds to wait before retrying.", "required": True,
                          "schema": {"type": "string", "pattern": "^[0-9]+$"}}},
})


def error_responses(*statuses: int, beyond: tuple[str, ...] = (),
                    described: dict[int, str] | None = None) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries for these error statuses, each with the OpenAI error body;
    `beyond`: the codes of the 400s a valid body may still get here; `described`: a route's
    own descriptions of some statuses (the Files API's 404 is a file's, not a model's)."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in sorted(statuses):
        out[status] = {"model": ErrorBody, "description": (described or {}).get(status, _DESCRIPTIONS[status])}
        if status in _HEADERS:
            out[status]["headers"] = copy.deepcopy(_HEADERS[status])
    if beyond and 400 in out:
        out[400]["x-beyond-schema"] = list(beyond)
    return out


# The statuses of a route that reads a body and generates, and of one that only reads a body.
GENERATE_ERRORS = (400, 404, 413, 429, 500, 503, 504)
BODY_ERRORS = (400, 404, 413, 500)


def json_or_event_stream(model: type[BaseModel], events: JsonSchema) -> dict[int | str, dict[str, Any]]:
    """A 200 that is `model` as JSON, or (with `stream: true`) server-sent events, each of
    which `events` describes (OpenAPI 3.1: the `text/event-stream` schema is one event's)."""
    return {200: {"model": model, "description": "The answer as one JSON body; with `stream: true`, "
                                                 "server-sent events instead.",
                  "content": {"text/event-stream": {"schema": events}}}}


def _event(data: JsonSchema, description: str, name: JsonSchema | None = None) -> JsonSchema:
    """One server-sent event: its `data` (and `event` name: "message" when it has none)."""
    return {"type": "object", "properties": {"data": data, "event": name or {"const": "message"}},
            "required": ["data"], "description": description}


def _json(schema: JsonSchema) -> JsonSchema:
    """A string holding JSON that `schema` describes."""
    return {"type": "string", "contentMediaType": "application/json", "contentSchema": schema}


def chunk_events(chunk: str) -> JsonSchema:
    """Completions and chat (`chunk`: the chunk's component name)."""
    return _event({"anyOf": [{"const": "[DONE]"},
                             _json({"anyOf": [{"$ref": _REF + chunk}, {"$ref": _REF + ErrorBody.__name__}]})]},
                  f"`data: <{chunk} JSON>` events, then `data: [DONE]`; an error after the stream started "
                  "is one `data: {\"error\": ...}` event before [DONE].")


def response_events(response: str) -> JsonSchema:
    """The Responses API's typed events (`response`: the response object's component name)."""
    kind = {"type": "string", "pattern": "^response\\."}
    return _event(_json({"type": "object", "properties": {
        "type": kind, "sequence_number": {"type": "integer", "minimum": 0}, "response": {"$ref": _REF + response}},
        "required": ["type", "sequence_number"]}),
        "OpenAI's typed events: `event: <type>` and `data: {\"type\", \"sequence_number\", ...}`, from "
        "response.created to response.completed (or response.failed); the first and the last carry the "
        "whole `response`.", kind)
