"""Structured-output request fields → the Grammar in the NewRequest, on both endpoints (a
fake worker reads the request stream), and the 400s naming the field that cannot be used."""

from __future__ import annotations

import json

import pytest

from tests.support.gateway_helpers import MODEL, FakeWorker, gateway_client, token_events
from proto.messages import Grammar, NewRequest

pytestmark = pytest.mark.anyio
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
USER_HI = [{"role": "user", "content": "hi"}]


CASES = [
    ({"response_format": {"type": "json_object"}}, Grammar("json_schema", json.dumps({"type": "object"}))),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}},
     Grammar("json_schema", json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": SCHEMA}}, Grammar("json_schema", json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, Grammar("json_schema", json.dumps(SCHEMA))),
    ({"structured_outputs": {"json_object": True}}, Grammar("json_schema", json.dumps({"type": "object"}))),
    ({"structured_outputs": {"regex": "[0-9]+"}}, Grammar("regex", "[0-9]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, Grammar("choice", json.dumps(["yes", "no"]))),
    ({"structured_outputs": {"grammar": 'start: "a"+'}}, Grammar("lark", 'start: "a"+')),
    ({"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"}, Grammar("json_schema", json.dumps(SCHEMA))),
    ({"guided_regex": "a|b"}, Grammar("regex", "a|b")),
    ({"guided_choice": ["x"]}, Grammar("choice", '["x"]')),
    ({"guided_grammar": 'start: "b"'}, Grammar("lark", 'start: "b"')),
    ({"response_format": {"type": "text"}}, None),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_every_structured_field_reaches_the_worker(config, path):
    async with FakeWorker(config, lambda r: token_events(r.request_id, [5], "length")) as worker:
        async with gateway_client(config) as client:
            for fields, _ in CASES:
                body = {"model": MODEL, "max_tokens": 1, **fields,
                        **({"prompt": "hi"} if path == "/v1/completions" else {"messages": USER_HI})}
                response = await client.post(path, json=body)
                assert response.status_code == 200, (fields, response.text)
    grammars = [m.sampling.grammar for m in worker.messages if isinstance(m, NewRequest)]
    assert grammars == [grammar for _, grammar in CASES]


@pytest.mark.parametrize("fields,param,code,words", [
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex", "invalid_grammar", "unclosed"),
    ({"guided_grammar": "start: foo"}, "guided_grammar", "invalid_grammar", "foo"),
    ({"guided_choice": []}, "guided_choice", "invalid_grammar", "choice"),
    ({"guided_json": "{not json"}, "guided_json", "invalid_json_schema", "not valid JSON"),
    ({"structured_outputs": {"json": {"type": "wat"}}}, "structured_outputs.json", "invalid_json_schema", "wat"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "conflicting_parameters",
     "response_format, guided_regex"),
    ({"structured_outputs": {"whitespace_pattern": " *"}}, "structured_outputs.whitespace_pattern", "invalid_value",
     "compact"),
    ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern", "invalid_value", "compact"),
])
async def test_unusable_structured_output_is_a_400_naming_the_field(config, fields, param, code, words):
    async with gateway_client(config) as client:
        response = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, code) and words in error["message"], error
