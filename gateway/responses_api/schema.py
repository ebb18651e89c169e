"""The JSON Schema /openapi.json publishes for the fields of a Responses API request
(`gateway/responses_api/request.py`), which the model keeps as plain dicts and translates into
a chat request: `input` items, `tools`, `tool_choice`, `text`. Each says exactly what the
translation and the chat request it makes accept, so a body the document calls valid is
one the gateway takes (up to what no schema can say: see gateway/openapi_answers.py).

The "x-" markers are filled in per server by gateway/openapi_document.py, as in
gateway/protocol.py: "x-media" parts leave with a text model, "x-tools" / "x-tool-choice"
follow the chat template and --enable-auto-tool-choice.
"""

from __future__ import annotations

from gateway.schema_rules import JsonSchema

_TEXT_PART: JsonSchema = {"type": "object", "properties": {
    "type": {"enum": ["input_text", "output_text", "text"]}, "text": {"type": "string"}},
    "required": ["type", "text"]}
_IMAGE_BY_URL: JsonSchema = {
    "type": "object", "x-media": True,
    "description": "An image by URL (http(s):// or data:); `detail` is ignored.",
    "properties": {"type": {"const": "input_image"}, "image_url": {"type": "string", "minLength": 1},
                   "file_id": {"type": "null"}},
    "required": ["type", "image_url"]}
_IMAGE_BY_FILE: JsonSchema = {
    "type": "object", "x-media": True,
    "description": "An image uploaded to /v1/files, by its id (a 400 `file_not_found` when no such file is "
                   "there for this API key); `detail` is ignored.",
    "properties": {"type": {"const": "input_image"}, "file_id": {"type": "string", "minLength": 1},
                   "image_url": {"type": "null"}},
    "required": ["type", "file_id"]}


def _content(media: bool) -> JsonSchema:
    parts = [_TEXT_PART, _IMAGE_BY_URL, _IMAGE_BY_FILE] if media else [_TEXT_PART]
    return {"anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": parts}}]}


_MESSAGE_ITEM: JsonSchema = {
    "type": "object", "title": "message",
    "properties": {"type": {"const": "message"}, "role": {"enum": ["user", "system", "developer", "assistant"]},
                   "content": _content(media=True)},
    "required": ["role", "content"],
    # only a user turn carries an image
    "if": {"properties": {"role": {"not": {"const": "user"}}}},
    "then": {"properties": {"content": _content(media=False)}}}
_FUNCTION_CALL_ITEM: JsonSchema = {
    "type": "object", "title": "function_call",
    "description": "A call the model made earlier: `call_id`, `name`, `arguments` (JSON text).",
    "properties": {"type": {"const": "function_call"}, "call_id": {}, "name": {}, "arguments": {}},
    "required": ["type"]}
_FUNCTION_CALL_OUTPUT_ITEM: JsonSchema = {
    "type": "object", "title": "function_call_output",
    "properties": {"type": {"const": "function_call_output"}, "call_id": {"type": "string"},
                   "output": _content(media=False)},
    "required": ["type", "call_id", "output"]}

INPUT: JsonSchema = {
    "anyOf": [{"type": "string"},
              {"type": "array", "items": {"anyOf": [_MESSAGE_ITEM, _FUNCTION_CALL_ITEM, _FUNCTION_CALL_OUTPUT_ITEM]}}],
    "description": "A user message, or the conversation: message items (text, input_text / output_text "
                   "and input_image parts), function_call items and function_call_output items."}

TOOLS: JsonSchema = {
    "anyOf": [{"type": "array", "items": {
        "type": "object",
        "properties": {"type": {"const": "function"}, "name": {"type": "string", "minLength": 1, "maxLength": 64},
                       "description": {"type": ["string", "null"]}, "parameters": {"type": ["object", "null"]},
                       "strict": {"type": ["boolean", "null"]}},
        "required": ["type", "name"]}},
        {"type": "null"}],
    "x-tools": True,
    "description": "Function tools only; no built-in tools run on this server."}

TOOL_CHOICE: JsonSchema = {
    "anyOf": [{"enum": ["none", "auto", "required"]},
              {"type": "object", "properties": {"type": {"const": "function"},
                                                "name": {"type": "string", "minLength": 1}},
               "required": ["type", "name"]},
              {"type": "object", "properties": {
                  "type": {"const": "function"},
                  "function": {"type": "object", "properties": {"name": {"type": "string", "minLength": 1}},
                               "required": ["name"]}},
               "required": ["type", "function"], "not": {"required": ["name"]}},
              {"type": "null"}],
    "x-tool-choice": True}

_FORMAT: JsonSchema = {"anyOf": [
    {"type": "object", "properties": {"type": {"enum": ["text", "json_object"]}, "json_schema": {"type": "null"}},
     "required": ["type"]},
    {"type": "object", "properties": {
        "type": {"const": "json_schema"}, "name": {"type": "string", "minLength": 1, "maxLength": 64},
        "description": {"type": ["string", "null"]}, "schema": {"type": ["object", "null"]},
        "strict": {"type": ["boolean", "null"]}},
     "required": ["type", "name"]},
    {"type": "null"}]}
TEXT: JsonSchema = {"anyOf": [{"type": "object", "properties": {"format": _FORMAT}}, {"type": "null"}],
                    "description": "`format` is chat's response_format, json_schema flattened."}

_NO_STATE = "this server keeps no state between responses; send the whole conversation in `input`"
STATELESS: JsonSchema = {"type": "null", "description": f"Refused (400) unless null: {_NO_STATE}."}
STATELESS_OR_FALSE: JsonSchema = {"enum": [None, False],
                                  "description": f"Refused (400) unless null or false: {_NO_STATE}."}

# An empty `input` list needs instructions (then the only message is the system one).
INPUT_NOT_EMPTY: JsonSchema = {
    "if": {"properties": {"input": {"type": "array", "maxItems": 0}}, "required": ["input"]},
    "then": {"properties": {"instructions": {"type": "string", "minLength": 1}}, "required": ["instructions"]}}
