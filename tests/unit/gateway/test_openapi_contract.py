"""The OpenAPI document is the contract (docs/api.md, "The OpenAPI document is the
contract"): checks of the document itself that need no stack -- what it says for a text
model, a model whose template reads tools, a gateway with API keys, a vision model; that
schemathesis can generate every request body of it; and the hook that lets through only the
refusals a route lists under `x-beyond-schema` (tests/support/openapi_contract_hooks.py).
schemathesis against a real stack: tests/e2e/test_e2e_openapi_contract.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema_rs
import pytest
from schemathesis.openapi.checks import RejectedPositiveData

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.openapi_answers import BEYOND_SCHEMA, MEDIA_BEYOND_SCHEMA
from tests.support.openapi_contract_hooks import filter_failure

TOOLS_TEMPLATE = ("{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m['role'] }}: "
                  "{{ m['content'] }}\n{% endfor %}")


# ---- the document itself ----------------------------------------------------------------

def document(model_dir, **config) -> dict:
    return create_app(GatewayConfig(model=str(model_dir), **config)).openapi()


@pytest.fixture(scope="module")
def text_doc(tiny_model_dir) -> dict:
    return document(tiny_model_dir)


def test_every_route_documents_its_answers(text_doc):
    paths = text_doc["paths"]
    for path, methods in paths.items():
        for method, operation in methods.items():
            responses = operation["responses"]
            assert "422" not in responses, (method, path)  # validation errors are OpenAI 400s here
            for status, response in responses.items():
                if status != "200":
                    schema = response["content"]["application/json"]["schema"]
                    assert schema == {"$ref": "#/components/schemas/ErrorBody"}, (path, status)
            if method == "post" and path != "/v1/files":  # (an upload names no model)
                assert {"400", "404", "413", "500"} <= set(responses), path
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        responses = paths[path]["post"]["responses"]
        assert {"400", "404", "413", "429", "500", "503", "504"} <= set(responses), path
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}, path
        assert responses["429"]["headers"]["Retry-After"]["required"] is True
        assert "context_length_exceeded" in responses["400"]["x-beyond-schema"], path
    error = text_doc["components"]["schemas"]["ErrorDetail"]
    assert set(error["required"]) == {"message", "type", "param", "code"}
    assert "HTTPValidationError" not in text_doc["components"]["schemas"]


def test_refused_fields_are_documented_as_refused(text_doc):
    schemas = text_doc["components"]["schemas"]
    completion, chat = schemas["CompletionRequest"], schemas["ChatCompletionRequest"]
    responses = schemas["ResponsesRequest"]
    assert completion["properties"]["best_of"]["enum"] == [None, 1]
    assert completion["properties"]["suffix"]["enum"] == [None, ""]
    assert completion["properties"]["use_beam_search"]["enum"] == [None, False]
    assert chat["properties"]["echo"]["enum"] == [None, False]
    assert responses["properties"]["background"]["enum"] == [None, False]
    assert responses["properties"]["previous_response_id"]["type"] == "null"
    for schema in (completion["properties"]["best_of"], responses["properties"]["background"]):
        assert schema["description"].startswith("Refused (400) unless")


def test_the_document_is_this_servers(text_doc, tiny_model_dir):
    """Served names, the vocabulary, tools and media follow the model and the flags."""
    from gateway.tokenizer import PromptTokenizer

    vocab = PromptTokenizer(tiny_model_dir).vocab_size
    schemas = text_doc["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["model"]["anyOf"][0] == {"enum": [tiny_model_dir.name]}
    assert schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] == vocab - 1
    logit_bias = schemas["CompletionRequest"]["properties"]["logit_bias"]
    pattern = re.compile(logit_bias["anyOf"][0]["propertyNames"]["pattern"])
    assert pattern.match(str(vocab - 1)) and pattern.match("0007") and not pattern.match(str(vocab))
    # the tiny model's template reads no tools, and it takes no images
    assert chat["tools"]["anyOf"][0] == {"type": "array", "maxItems": 0}
    assert chat["tool_choice"]["anyOf"] == [{"enum": ["none"]}, {"type": "null"}]
    assert "ImageURLPart" not in schemas and "VideoURLPart" not in schemas
    chat_400 = text_doc["paths"]["/v1/chat/completions"]["post"]["responses"]["400"]
    assert "invalid_image" not in chat_400["x-beyond-schema"]
    # /tokenize: either shape; with messages, text only
    body = text_doc["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert len(body["anyOf"]) == 2
    messages = schemas["TokenizeChatRequest"]["properties"]["messages"]
    assert messages["items"] == {"$ref": "#/components/schemas/TextChatMessage"}
    assert "security" not in text_doc["paths"]["/v1/models"]["get"]


def test_tools_and_keys_change_the_document(tiny_model_dir, tmp_path):
    template = tmp_path / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    doc = document(tiny_model_dir, chat_template=str(template), api_keys=("k",))
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert chat["tools"]["anyOf"][0]["items"] == {"$ref": "#/components/schemas/ToolDefinition"}
    assert chat["tool_choice"]["anyOf"][0] == {"enum": ["none", "required"]}  # no auto without the flags
    for path, methods in doc["paths"].items():
        for operation in methods.values():
            guarded = path.startswith("/v1/")
            assert ("security" in operation) == guarded and ("401" in operation["responses"]) == guarded, path
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    auto = document(tiny_model_dir, chat_template=str(template), enable_auto_tool_choice=True,
                    tool_call_parser="hermes")
    assert auto["components"]["schemas"]["ChatCompletionRequest"]["properties"]["tool_choice"]["anyOf"][0] == \
        {"enum": ["none", "auto", "required"]}


def test_a_vision_model_documents_images_and_video(vision_dir):
    doc = document(vision_dir)
    schemas = doc["components"]["schemas"]
    items = schemas["ChatMessage"]["properties"]["content"]["anyOf"][1]["items"]["oneOf"]
    for part in ("ImageURLPart", "VideoURLPart"):
        assert {"$ref": f"#/components/schemas/{part}"} in items
    assert "invalid_image" in doc["paths"]["/v1/chat/completions"]["post"]["responses"]["400"]["x-beyond-schema"]
    assert '"x-media"' not in json.dumps(doc)  # the marker (not --max-media-bytes)


def request_bodies(doc: dict) -> dict[str, dict]:
    """Each request body's schema, standalone (components as $defs)."""
    defs = json.loads(json.dumps(doc["components"]["schemas"]).replace("#/components/schemas/", "#/$defs/"))
    out = {}
    for path, methods in doc["paths"].items():
        body = methods.get("post", {}).get("requestBody")
        if body:
            (media,) = body["content"].values()  # JSON, or the Files API's multipart upload
            schema = json.loads(json.dumps(media["schema"]).replace("#/components/schemas/", "#/$defs/"))
            out[path] = {**schema, "$defs": defs}
    return out


@pytest.mark.parametrize("variant", ["text", "tools", "vision"])
def test_schemathesis_can_generate_every_body(variant, tiny_model_dir, vision_dir, tmp_path):
    """schemathesis rewrites a schema into a union of plain ones before generating; past a
    few rules spanning fields it gives up on the operation (gateway/schema_rules.py)."""
    template = tmp_path / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    doc = {"text": lambda: document(tiny_model_dir),
           "tools": lambda: document(tiny_model_dir, chat_template=str(template), enable_auto_tool_choice=True,
                                     tool_call_parser="hermes"),
           "vision": lambda: document(vision_dir)}[variant]()
    for path, schema in request_bodies(doc).items():
        canonical = jsonschema_rs.canonicalize(schema, draft=jsonschema_rs.Draft202012)
        assert canonical.kind != jsonschema_rs.canonical.CanonicalKind.RAW, (variant, path)
        assert canonical.satisfiability() != jsonschema_rs.canonical.Satisfiability.NO, (variant, path)


def test_beyond_schema_codes_are_the_gateways():
    """Every code the document may list is one the gateway raises (so the hook can match it)."""
    source = "\n".join(p.read_text() for p in Path(__file__).parents[3].joinpath("gateway").rglob("*.py")
                       if p.name != "openapi_answers.py")
    for code, _ in BEYOND_SCHEMA + MEDIA_BEYOND_SCHEMA:
        assert re.search(rf"""["']{code}["']""", source), code


class _Response:
    def __init__(self, status_code: int, body: dict):
        self.status_code = status_code
        self.content = json.dumps(body).encode()


class _Case:
    def __init__(self, codes: list[str]):
        self.operation = type("Op", (), {"definition": type("Def", (), {
            "raw": {"responses": {"400": {"x-beyond-schema": codes}}}})()})()


def test_the_hook_drops_only_listed_refusals():
    rejected = RejectedPositiveData(operation="POST /v1/completions", message="", status_code=400,
                                    allowed_statuses=["2xx"])
    case = _Case(["context_length_exceeded"])

    def error(code):
        return _Response(400, {"error": {"message": "m", "type": "invalid_request_error", "param": None, "code": code}})

    assert filter_failure(None, rejected, case, error("context_length_exceeded")) is False
    assert filter_failure(None, rejected, case, error("invalid_value")) is True
    assert filter_failure(None, rejected, _Case([]), error("context_length_exceeded")) is True
    assert filter_failure(None, object(), case, error("context_length_exceeded")) is True


# ---- what the fuzzer found, kept found ------------------------------------------------------

@pytest.mark.parametrize("model,body", [
    ("CompletionRequest", {"prompt": [1.0, 2], "max_tokens": 3.0, "n": 2.0, "stop_token_ids": [4.0]}),
    ("DetokenizeRequest", {"tokens": [17.0, 3]}),
])
def test_whole_floats_are_integers(model, body):
    """JSON Schema's "integer" takes 17.0, so the gateway does too (but not 17.5, "17" or true)."""
    from gateway.protocol import CompletionRequest
    from gateway.tokenize_models import DetokenizeRequest

    cls = {"CompletionRequest": CompletionRequest, "DetokenizeRequest": DetokenizeRequest}[model]
    parsed = cls.model_validate_json(json.dumps(body), strict=True)
    assert all(type(v) is int for v in (parsed.tokens if model == "DetokenizeRequest" else
                                        [*parsed.prompt[0], parsed.max_tokens, parsed.n, *parsed.stop_token_ids]))
    for bad in (17.5, "17", True):
        with pytest.raises(ValueError):
            CompletionRequest.model_validate_json(json.dumps({"prompt": "x", "max_tokens": bad}), strict=True)


@pytest.mark.parametrize("model,body", [
    ("ChatCompletionRequest", {"messages": [{"role": "user", "content": "x"}],
                               "mm_processor_kwargs": {"do_pan_and_scan": 0}}),
    ("ResponsesRequest", {"input": "x", "conversation": 0}),
    ("CompletionRequest", {"prompt": "x", "use_beam_search": 0}),
    ("TokenizeChatRequest", {"messages": [{"role": "user", "content": "x"}],
                             "chat_template_kwargs": {"truncation": ""}}),
])
def test_what_the_schema_refuses_the_gateway_refuses(model, body):
    """0 is not false (the document's enum says so), and /tokenize refuses the template
    call's own arguments in chat_template_kwargs as chat does."""
    from gateway.protocol import ChatCompletionRequest, CompletionRequest
    from gateway.responses_api.request import ResponsesRequest
    from gateway.tokenize_models import TokenizeChatRequest

    cls = {c.__name__: c for c in (ChatCompletionRequest, CompletionRequest, ResponsesRequest,
                                   TokenizeChatRequest)}[model]
    with pytest.raises(ValueError):
        cls.model_validate_json(json.dumps(body), strict=True)
