"""Errors of the OpenAI API through the real stack, with the official `openai` client as the
caller: every error the issue lists, through the client and as raw HTTP; then API keys, and
an error after a stream has started, on a second stack (a tiny KV cache, a gateway that wants
keys)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from compose.launcher import free_port
from tests.support.e2e_openai_helpers import stack  # noqa: F401  (the fixture)
from tests.support.stack_helpers import running_stack, wait_until_answers, wait_until_idle


# ---- 8. errors ------------------------------------------------------------------------------

def error_of(excinfo) -> dict:
    body = excinfo.value.body
    assert set(body) == {"message", "type", "param", "code"}, body
    return body


def test_errors_through_the_openai_client(client, stack):
    model = stack.served_model_name
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=4)
    assert error_of(err)["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="hi " * 1100, max_tokens=10)
    body = error_of(err)
    assert body["code"] == "context_length_exceeded" and "1024" in body["message"]
    cases = [
        (dict(temperature=3.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(logprobs=30), "logprobs"),
        (dict(presence_penalty=-5.0), "presence_penalty"), (dict(n=0), "n"),
        (dict(best_of=3), "best_of"), (dict(suffix="tail"), "suffix"), (dict(prompt=""), "prompt"),
        (dict(prompt=[1, 2, 10**7]), "prompt"), (dict(max_tokens="ten"), "max_tokens"),
        (dict(logit_bias={"abc": 1}), "logit_bias"), (dict(extra_body={"top_k": "5"}), "top_k"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(**{"model": model, "prompt": "hi", "max_tokens": 2, **kwargs})
        assert error_of(err)["param"] == param, kwargs
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                       tools=[{"type": "function", "function": {"name": "f"}}])
    assert error_of(err)["param"] == "tools" and "not supported" in error_of(err)["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": 5}])
    assert error_of(err)["param"] == "messages[0].content"


def test_raw_http_errors(stack):
    url = stack.base_url
    with httpx.Client(timeout=30) as http:
        for body in (b"{", b"[]", b'{"prompt": "hi", "max_tokens": 1.5}', b'{"prompt": "hi"} trailing'):
            response = http.post(f"{url}/completions", content=body, headers={"content-type": "application/json"})
            assert response.status_code == 400, body
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        huge = http.post(f"{url}/completions", content=b'{"prompt": "' + b"x" * (9 * 2**20) + b'"}')
        assert huge.status_code == 413 and huge.json()["error"]["code"] == "request_too_large"


def _response(sock: socket.socket) -> bytes:
    """One HTTP/1.1 response with a Content-Length, read off a raw socket (b"" if it closed)."""
    data = b""
    while b"\r\n\r\n" not in data:
        piece = sock.recv(65536)
        if not piece:
            return data
        data += piece
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return head


def test_an_idle_connection_outlives_the_clients_keep_alive(stack):
    """httpx and the openai client reuse a connection idle for up to 5 s; the gateway keeps one
    longer, so it is never closing a connection a client reuses (with uvicorn's 5 s on both
    sides, that request meets a reset: httpx.ReadError, one in 512 at concurrency 256)."""
    url = urlsplit(stack.base_url)
    request = f"GET /v1/models HTTP/1.1\r\nHost: {url.netloc}\r\n\r\n".encode()
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(request)
        assert _response(sock).startswith(b"HTTP/1.1 200")
        time.sleep(6)
        sock.sendall(request)
        assert _response(sock).startswith(b"HTTP/1.1 200")


# ---- 7. API keys, and an error after a stream started -----------------------------------------

@pytest.fixture(scope="module")
def keyed_stack(tiny_model_dir, redis_url, tmp_path_factory):
    """A second stack with a tiny KV cache (the scheduler refuses what can never fit, after
    the stream has started), plus a gateway on it that wants API keys."""
    run_dir = tmp_path_factory.mktemp("keyed-run")
    with running_stack(tiny_model_dir, redis_url, run_dir, worker_args=("--num-blocks", "8")) as s:
        port = free_port()
        env = {**os.environ, "PAGEDSERVE_API_KEYS": "key-one,key-two"}
        with open(run_dir / "keyed-gateway.log", "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "compose.cli", "gateway", "--model", str(tiny_model_dir),
                 "--redis-url", s.redis_url, "--key-prefix", s.config.key_prefix, "--port", str(port),
                 "--api-key", "key-three"], stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_until_answers(f"http://127.0.0.1:{port}/health", proc, 120, "keyed gateway did not start")
            yield s, f"http://127.0.0.1:{port}/v1"
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def test_api_keys_through_the_stack(keyed_stack):
    stack, url = keyed_stack
    for key in ("key-one", "key-two", "key-three"):
        client = openai.OpenAI(base_url=url, api_key=key, max_retries=0)
        assert client.completions.create(model=stack.served_model_name, prompt="hi", max_tokens=2).usage
    bad = openai.OpenAI(base_url=url, api_key="key-four", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        bad.models.list()
    assert err.value.status_code == 401 and error_of(err)["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=stack.served_model_name, messages=[{"role": "user", "content": "x"}])
    with httpx.Client() as http:
        assert http.get(url.removesuffix("/v1") + "/health").status_code == 200
        assert http.get(url.removesuffix("/v1") + "/metrics").status_code == 200


def test_error_after_the_stream_started(keyed_stack):
    stack, _ = keyed_stack
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    # 8 blocks of 16 tokens: 300 tokens can never fit; the scheduler says so after the HTTP
    # stream has begun (the chat stream's first chunk is already out).
    stream = client.chat.completions.create(model=stack.served_model_name, max_tokens=300,
                                            messages=[{"role": "user", "content": "hi"}], stream=True)
    with pytest.raises(openai.APIError) as err:
        list(stream)
    assert "error" in str(err.value).lower() or err.value.body
    with httpx.Client(timeout=30) as http:
        raw = http.post(f"{stack.base_url}/chat/completions", json={
            "model": stack.served_model_name, "max_tokens": 300, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]})
    events = [line.removeprefix("data: ") for line in raw.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])
    assert set(error) == {"error"} and set(error["error"]) == {"message", "type", "param", "code"}
    wait_until_idle(stack)
