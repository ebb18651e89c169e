"""Every way a request can be refused: status code and the OpenAI error shape
`{"error": {"message", "type", "param", "code"}}`. No generation happens here: where a request
must pass the model check, a WorkerRegistration is written straight into Redis."""

from __future__ import annotations

import pytest

from tests.support.gateway_helpers import MODEL, gateway_client, make_config, register_worker

pytestmark = pytest.mark.anyio

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
USER_HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def config(tiny_model_dir, redis_url):
    return make_config(tiny_model_dir, redis_url)


@pytest.fixture
def live_config(config):
    register_worker(config, max_model_len=64)
    return config


def assert_error(response, status: int, *, param=None, code=None, type_="invalid_request_error"):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == type_
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


async def post(config, path, json=None, content=None, headers=None):
    async with gateway_client(config) as client:
        return await client.post(path, json=json, content=content, headers=headers)


@pytest.mark.parametrize("body", [b"{", b"{\"prompt\": \"hi\",}", b"not json", b"\xff\xfe"])
async def test_malformed_json(config, body):
    response = await post(config, COMPLETIONS, content=body, headers={"content-type": "application/json"})
    assert_error(response, 400, code="invalid_json")


async def test_body_not_an_object(config):
    assert_error(await post(config, CHAT, json=[1, 2]), 400)


@pytest.mark.parametrize("path,body,param", [
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "max_tokens": 2.5}, "max_tokens"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "temperature": "hot"}, "temperature"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "stream": "yes"}, "stream"),
    (COMPLETIONS, {"model": MODEL, "prompt": {"text": "hi"}}, "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": [1, "two"]}, "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "stop": 5}, "stop"),
    (COMPLETIONS, {"model": 7, "prompt": "hi"}, "model"),
    (CHAT, {"model": MODEL, "messages": "hi"}, "messages"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (CHAT, {"model": MODEL, "messages": [{"content": "hi"}]}, "messages[0].role"),
])
async def test_wrong_types(config, path, body, param):
    assert_error(await post(config, path, json=body), 400, param=param)


@pytest.mark.parametrize("path,body,param", [
    (COMPLETIONS, {"model": MODEL}, "prompt"),
    (CHAT, {"model": MODEL}, "messages"),
])
async def test_missing_required(config, path, body, param):
    assert_error(await post(config, path, json=body), 400, param=param, code="missing_required_parameter")


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", 2.5), ("top_p", 0), ("top_p", 1.5), ("max_tokens", 0),
    ("top_k", -2), ("min_tokens", -1), ("n", 0), ("presence_penalty", 3), ("seed", 2**64),
])
async def test_out_of_range(config, field, value):
    error = assert_error(await post(config, COMPLETIONS, json={"model": MODEL, "prompt": "hi", field: value}),
                         400, param=field)
    assert field in error["message"]


async def test_out_of_range_chat(config):
    body = {"model": MODEL, "messages": USER_HI, "max_completion_tokens": 0}
    assert_error(await post(config, CHAT, json=body), 400, param="max_completion_tokens")


@pytest.mark.parametrize("path,field,value", [
    (COMPLETIONS, "best_of", 2), (COMPLETIONS, "suffix", "end"),
    (CHAT, "functions", [{"name": "f"}]), (CHAT, "function_call", {"name": "f"}),
])
async def test_unsupported_params(config, path, field, value):
    body = {"model": MODEL, field: value, **({"prompt": "hi"} if path == COMPLETIONS else {"messages": USER_HI})}
    error = assert_error(await post(config, path, json=body), 400, param=field)
    assert "not supported" in error["message"]


async def test_tools_need_a_template_that_reads_them(live_config):
    body = {"model": MODEL, "messages": USER_HI, "tools": [{"type": "function", "function": {"name": "f"}}]}
    error = assert_error(await post(live_config, CHAT, json=body), 400, param="tools",
                         code="unsupported_parameter")
    assert "not supported" in error["message"] and "template" in error["message"]


@pytest.mark.parametrize("path,field,value", [
    (COMPLETIONS, "logprobs", 21), (COMPLETIONS, "logprobs", -1), (CHAT, "top_logprobs", 21),
    (COMPLETIONS, "logit_bias", {"5": 101}), (COMPLETIONS, "logit_bias", {"x": 1}),
    (COMPLETIONS, "repetition_penalty", 0), (COMPLETIONS, "min_p", 1.5), (COMPLETIONS, "n", 129),
    (COMPLETIONS, "frequency_penalty", -2.5),
])
async def test_out_of_range_new_params(config, path, field, value):
    body = {"model": MODEL, field: value, **({"prompt": "hi"} if path == COMPLETIONS else {"messages": USER_HI})}
    if field == "top_logprobs":
        body["logprobs"] = True
    assert_error(await post(config, path, json=body), 400, param=field)


@pytest.mark.parametrize("response_format,param", [
    ({"type": "json_schema"}, "response_format"),
    ({"type": "json_object", "json_schema": {"name": "x"}}, "response_format"),
    ({"type": "yaml"}, "response_format.type"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
])
async def test_malformed_response_format(config, response_format, param):
    body = {"model": MODEL, "messages": USER_HI, "response_format": response_format}
    assert_error(await post(config, CHAT, json=body), 400, param=param)


@pytest.mark.parametrize("schema,words", [
    ({"type": "wat"}, "wat"), ({"$ref": "#/nope"}, "nope"), ({"type": "string", "pattern": "(a"}, "regex"),
])
async def test_schema_that_cannot_be_enforced(live_config, schema, words):
    body = {"model": MODEL, "messages": USER_HI,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    error = assert_error(await post(live_config, CHAT, json=body), 400, param="response_format",
                         code="invalid_json_schema")
    assert words in error["message"]


async def test_top_logprobs_need_logprobs(config):
    body = {"model": MODEL, "messages": USER_HI, "top_logprobs": 2}
    error = assert_error(await post(config, CHAT, json=body), 400, param="top_logprobs")
    assert "logprobs" in error["message"]


async def test_logit_bias_token_out_of_vocab(live_config):
    body = {"model": MODEL, "prompt": "hi", "logit_bias": {"999999": 5}}
    assert_error(await post(live_config, COMPLETIONS, json=body), 400, param="logit_bias", code="invalid_token_id")


async def test_unknown_fields_are_ignored_with_one_warning(config, caplog):
    # No worker is registered: passing validation means getting as far as the 503.
    body = {"model": MODEL, "prompt": "hi", "foo": 1, "stream": True,
            "stream_options": {"include_usage": True, "bar": 2}}
    with caplog.at_level("WARNING", logger="gateway.preflight"):
        assert_error(await post(config, COMPLETIONS, json=body), 503, code="no_live_worker",
                     type_="service_unavailable")
    warnings = [r.getMessage() for r in caplog.records if "unknown fields" in r.getMessage()]
    assert warnings == ["CompletionRequest: ignoring unknown fields foo, stream_options.bar"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi", "x_meta": 1}], "metadata": {"a": "b"}}
    assert_error(await post(config, CHAT, json=chat), 503, code="no_live_worker", type_="service_unavailable")


@pytest.mark.parametrize("path,field,value,words", [
    (COMPLETIONS, "use_beam_search", True, "beam search"), (COMPLETIONS, "prompt_logprobs", 2, "echo"),
    (COMPLETIONS, "bad_words", ["x"], "logit_bias"), (COMPLETIONS, "allowed_token_ids", [1], "logit_bias"),
    (CHAT, "chat_template", "{{ messages }}", "chat template"), (CHAT, "echo", True, "prompt"),
    (COMPLETIONS, "spaces_between_special_tokens", False, "special"), (COMPLETIONS, "cache_salt", "s", "prefix"),
    (COMPLETIONS, "suffix", "tail", "fill-in-the-middle"),
])
async def test_vllm_extensions_refused_by_name(config, path, field, value, words):
    body = {"model": MODEL, field: value, **({"prompt": "hi"} if path == COMPLETIONS else {"messages": USER_HI})}
    error = assert_error(await post(config, path, json=body), 400, param=field)
    assert "not supported" in error["message"] and words in error["message"]


async def test_neutral_values_of_unsupported_params_pass_validation(config):
    # No worker is registered: passing validation means getting as far as the 503.
    body = {"model": MODEL, "prompt": "hi", "logprobs": None, "echo": False, "best_of": 1, "n": 1,
            "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "suffix": "", "user": "u"}
    assert_error(await post(config, COMPLETIONS, json=body), 503, code="no_live_worker",
                 type_="service_unavailable")
    chat = {"model": MODEL, "messages": USER_HI, "logprobs": False, "tools": [], "tool_choice": "none",
            "response_format": {"type": "text"}, "parallel_tool_calls": True}
    assert_error(await post(config, CHAT, json=chat), 503, code="no_live_worker", type_="service_unavailable")


@pytest.mark.parametrize("message,param", [
    ({"role": "function", "content": "x", "name": "f"}, "messages[0].role"),
    ({"role": "wizard", "content": "x"}, "messages[0].role"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]},
     "messages[0].content"),
    ({"role": "tool", "content": "x"}, "messages[0]"),  # no tool_call_id
    ({"role": "user", "content": "x", "tool_calls": [{"id": "1"}]}, "messages[0]"),
    ({"role": "user"}, "messages[0]"),  # no content
])
async def test_unsupported_messages(config, message, param):
    assert_error(await post(config, CHAT, json={"model": MODEL, "messages": [message]}), 400, param=param)


async def test_stream_options_need_stream(config):
    body = {"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}
    assert_error(await post(config, COMPLETIONS, json=body), 400, param="stream_options")


async def test_unknown_model(live_config):
    error = assert_error(await post(live_config, COMPLETIONS, json={"model": "gpt-9", "prompt": "hi"}),
                         404, param="model", code="model_not_found")
    assert "gpt-9" in error["message"]


@pytest.mark.parametrize("prompt", ["", [], [[]], ["a", ""], [[1], []], ["a"] * 17, [["a"]], [1.5], None])
async def test_empty_or_malformed_prompt(config, prompt):
    assert_error(await post(config, COMPLETIONS, json={"model": MODEL, "prompt": prompt}), 400, param="prompt")


async def test_empty_messages(config):
    assert_error(await post(config, CHAT, json={"model": MODEL, "messages": []}), 400, param="messages")


async def test_token_ids_out_of_vocab(live_config):
    error = assert_error(await post(live_config, COMPLETIONS, json={"model": MODEL, "prompt": [5, 10**6]}),
                         400, param="prompt", code="invalid_token_id")
    assert str(10**6) in error["message"]
    body = {"model": MODEL, "prompt": "hi", "stop_token_ids": [-1]}
    assert_error(await post(live_config, COMPLETIONS, json=body), 400, param="stop_token_ids")


async def test_prompt_too_long_names_both_numbers(live_config):  # max_model_len 64
    error = assert_error(await post(live_config, COMPLETIONS, json={"model": MODEL, "prompt": [5] * 60}),
                         400, param="prompt", code="context_length_exceeded")
    assert "64" in error["message"] and "76" in error["message"]  # 60 + default max_tokens 16
    body = {"model": MODEL, "messages": USER_HI, "max_tokens": 100}
    error = assert_error(await post(live_config, CHAT, json=body), 400, param="messages",
                         code="context_length_exceeded")
    assert "64" in error["message"] and "100 in the completion" in error["message"]


async def test_context_limit_is_the_smallest_live_worker(config):
    register_worker(config, max_model_len=4096, worker_id="big")
    register_worker(config, max_model_len=40, worker_id="small")
    error = assert_error(await post(config, COMPLETIONS, json={"model": MODEL, "prompt": [5] * 30}), 400,
                         param="prompt", code="context_length_exceeded")
    assert "40 tokens" in error["message"]


async def test_min_tokens_above_max_tokens(live_config):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "min_tokens": 3}
    assert_error(await post(live_config, COMPLETIONS, json=body), 400, param="min_tokens")


async def test_no_live_worker(config, redis_url):
    assert_error(await post(config, COMPLETIONS, json={"model": MODEL, "prompt": "hi"}), 503,
                 code="no_live_worker", type_="service_unavailable")
    # A worker that serves another model, and one whose registration expired, do not count.
    register_worker(config, model="other", worker_id="other")
    register_worker(config, worker_id="dead", ttl_s=1)
    import redis

    redis.Redis.from_url(redis_url).delete(f"{config.key_prefix}:worker:dead")
    assert_error(await post(config, CHAT, json={"model": MODEL, "messages": USER_HI}), 503,
                 code="no_live_worker", type_="service_unavailable")


async def test_oversized_body(tiny_model_dir, redis_url):
    config = make_config(tiny_model_dir, redis_url, max_body_bytes=1000)
    assert_error(await post(config, COMPLETIONS, json={"model": MODEL, "prompt": "x" * 2000}), 413,
                 code="request_too_large")


async def test_unexpected_exception_is_a_500_without_trace(live_config):
    async with gateway_client(live_config) as client:
        async def boom(body):
            raise RuntimeError("secret internals")

        client.app.state.preflight.admit_completion = boom
        response = await client.post(COMPLETIONS, json={"model": MODEL, "prompt": "hi"})
    assert_error(response, 500, type_="server_error")
    assert "secret" not in response.text and "Traceback" not in response.text


async def test_unknown_route_and_method(config):
    async with gateway_client(config) as client:
        assert_error(await client.get("/v1/nothing"), 404)
        assert_error(await client.get(COMPLETIONS), 405)


async def test_api_keys(tiny_model_dir, redis_url):
    config = make_config(tiny_model_dir, redis_url, api_keys=("sekrit", "other-key"))
    register_worker(config)
    async with gateway_client(config) as client:
        error = assert_error(await client.get("/v1/models"), 401, code="invalid_api_key",
                             type_="authentication_error")
        assert "Missing" in error["message"]
        wrong = {"authorization": "Bearer nope"}
        response = await client.post(COMPLETIONS, json={"prompt": "hi"}, headers=wrong)
        assert_error(response, 401, type_="authentication_error")
        assert response.headers["www-authenticate"] == "Bearer"
        # Before routing and parsing: unknown /v1 paths and broken bodies are 401s too.
        assert_error(await client.get("/v1/nothing"), 401, type_="authentication_error")
        assert_error(await client.post(COMPLETIONS, content=b"{", headers=wrong), 401,
                     type_="authentication_error")
        assert_error(await client.get("/v1/models", headers={"authorization": "Basic sekrit"}), 401,
                     type_="authentication_error")
        for key in ("sekrit", "other-key"):
            ok = await client.get("/v1/models", headers={"authorization": f"Bearer {key}"})
            assert ok.status_code == 200
        assert (await client.get("/health")).status_code == 200  # probes need no key
        assert_error(await client.post("/v1/responses", json={"input": "hi"}), 401, type_="authentication_error")
        metrics = await client.get("/metrics")
        assert metrics.status_code == 200
        assert 'pagedserve_gateway_requests_total{route="/v1/models",status="401"}' in metrics.text
        assert 'pagedserve_gateway_requests_total{route="/v1/responses",status="401"}' in metrics.text


async def test_protect_metrics(tiny_model_dir, redis_url):
    config = make_config(tiny_model_dir, redis_url, api_keys=("k",), protect_metrics=True)
    async with gateway_client(config) as client:
        assert_error(await client.get("/metrics"), 401, type_="authentication_error")
        assert_error(await client.get("/health"), 401, type_="authentication_error")
        ok = await client.get("/metrics", headers={"authorization": "Bearer k"})
        assert ok.status_code == 200


async def test_health_and_models(config):
    async with gateway_client(config) as client:
        assert (await client.get("/health")).json() == {"status": "ok"}
        assert (await client.get("/v1/models")).json() == {"object": "list", "data": []}
        register_worker(config, max_model_len=77)
        models = (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 77 and models["data"][0]["object"] == "model"


async def test_redis_down(tiny_model_dir):
    from compose.launcher import free_port

    config = make_config(tiny_model_dir, f"redis://127.0.0.1:{free_port()}/0")
    async with gateway_client(config) as client:
        assert_error(await client.get("/health"), 503, type_="service_unavailable")
        assert_error(await client.post(COMPLETIONS, json={"prompt": "hi"}), 503, type_="service_unavailable")
