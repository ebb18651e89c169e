"""vLLM's /tokenize and /detokenize, /v1/models/{id}, and several served names, through the
gateway app (a registered worker for the context length; a fake worker where a request
runs)."""

from __future__ import annotations

import argparse

import pytest

from gateway.config import add_cli_args, config_from_args
from tests.support.gateway_helpers import FakeWorker, gateway_client, make_config, register_worker, token_events
from proto.env_flags import EnvFlags

pytestmark = pytest.mark.anyio


@pytest.fixture
def config(tiny_model_dir, redis_url):
    config = make_config(tiny_model_dir, redis_url, served_model_name="tiny,tiny-alias", request_timeout_s=5.0)
    register_worker(config, max_model_len=256)
    return config


def assert_error(response, status: int, param: str | None, code: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and (error["param"], error["code"]) == (param, code)
    return error


async def test_tokenize_and_detokenize(config, tokenizer):
    messages = [{"role": "user", "content": "hello there"}]
    async with gateway_client(config) as client:
        text = await client.post("/tokenize", json={"model": "tiny", "prompt": "def f(x): return x",
                                                    "return_token_strs": True})
        chat = await client.post("/tokenize", json={"messages": messages})
        back = await client.post("/detokenize", json={"model": "tiny-alias", "tokens": text.json()["tokens"]})
        plain = await client.post("/tokenize", json={"prompt": "hi", "add_special_tokens": False})
    ids = tokenizer.encode_text("def f(x): return x")
    body = text.json()
    assert (body["count"], body["max_model_len"], body["tokens"]) == (len(ids), 256, ids)
    assert len(body["token_strs"]) == len(ids) and "".join(body["token_strs"]) == tokenizer.decode(ids)
    assert chat.json()["tokens"] == tokenizer.encode_chat(messages)
    assert back.json() == {"prompt": "def f(x): return x"}
    assert plain.json()["tokens"] == tokenizer.encode_text("hi", False)


async def test_tokenize_errors(config):
    async with gateway_client(config) as client:
        assert_error(await client.post("/detokenize", json={"tokens": [10**7]}), 400, "tokens", "invalid_token_id")
        assert_error(await client.post("/tokenize", json={"model": "gpt-9", "prompt": "x"}), 404, "model",
                     "model_not_found")
        assert_error(await client.post("/tokenize", json={"prompt": 5}), 400, "prompt", "invalid_value")
        assert_error(await client.post("/tokenize", content=b"[1, 2"), 400, None, "invalid_json")


async def test_several_served_names(config):
    async with FakeWorker(config, lambda r: token_events(r.request_id, [5], "length")):
        async with gateway_client(config) as client:
            listed = await client.get("/v1/models")
            one = await client.get("/v1/models/tiny-alias")
            missing = await client.get("/v1/models/gpt-9")
            answer = await client.post("/v1/completions", json={"model": "tiny-alias", "prompt": "hi", "max_tokens": 1})
    assert [m["id"] for m in listed.json()["data"]] == ["tiny", "tiny-alias"]
    assert one.json()["id"] == "tiny-alias" and one.json()["object"] == "model" and one.json()["max_model_len"] == 256
    error = assert_error(missing, 404, "model", "model_not_found")
    assert "gpt-9" in error["message"]
    assert answer.status_code == 200 and answer.json()["model"] == "tiny"


@pytest.mark.parametrize("argv,env", [
    (["--served-model-name", "a", "b"], {}), (["--served-model-name", "a,b"], {}),
    ([], {"PAGEDSERVE_SERVED_MODEL_NAME": "a, b"}),
])
def test_served_model_name_flag_takes_several(argv, env):
    parser = argparse.ArgumentParser()
    add_cli_args(EnvFlags(parser, environ=env))
    config = config_from_args(parser.parse_args(["--model", "m", *argv]))
    assert config.model_names == ["a", "b"] and config.model_name == "a"
