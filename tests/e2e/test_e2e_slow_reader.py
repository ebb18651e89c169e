"""A client that stops reading its stream, against a real stack (tiny model) with a raw
socket that never reads: its request is aborted once `--max-unread-events` token events wait
unread (its blocks freed, the gateway's memory per stream bounded), and other streams go on
meanwhile. The gateway's backend with a full queue alone: tests/unit/gateway/test_gateway_slow_reader.py."""

from __future__ import annotations

import json
import socket
import time
import urllib.parse

import openai
import pytest

from tests.support.stack_helpers import running_stack, wait_until_idle, worker_stats

MAX_UNREAD = 100


@pytest.fixture(scope="module")
def stack(tiny_model_dir, redis_url, tmp_path_factory):
    with running_stack(tiny_model_dir, redis_url, tmp_path_factory.mktemp("slow-reader"),
                       gateway_args=("--max-unread-events", str(MAX_UNREAD))) as s:
        yield s


def _stalled_stream(stack, max_tokens: int) -> socket.socket:
    """A streamed chat sent over a socket with a tiny receive buffer that is never read."""
    url = urllib.parse.urlsplit(stack.base_url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.connect((url.hostname, url.port))
    # 16 choices with top logprobs: ~30 kB a step, more than the socket buffers on both sides
    # take (loopback's grow to megabytes) within a few hundred steps
    body = json.dumps({"model": stack.served_model_name, "max_tokens": max_tokens, "ignore_eos": True,
                       "stream": True, "logprobs": True, "top_logprobs": 20, "n": 16,
                       "messages": [{"role": "user", "content": "go on"}]}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return sock


def test_a_stalled_stream_is_aborted_while_others_go_on(stack):
    before = sum(s.num_aborted for s in worker_stats(stack).values())
    sock = _stalled_stream(stack, max_tokens=990)
    try:
        client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=60)
        for _ in range(3):  # the stalled stream holds nobody up
            stream = client.chat.completions.create(
                model=stack.served_model_name, max_tokens=50, stream=True, extra_body={"ignore_eos": True},
                messages=[{"role": "user", "content": "hello"}])
            assert sum(1 for c in stream if c.choices and c.choices[0].delta.content is not None) > 1
        deadline = time.monotonic() + 60
        while sum(s.num_aborted for s in worker_stats(stack).values()) == before:
            assert time.monotonic() < deadline, "the stalled stream was never aborted"
            time.sleep(0.2)
        wait_until_idle(stack)  # its blocks are free
    finally:
        sock.close()
