"""The gateway tests' shared fixtures: the tiny model's tokenizer, a gateway config with a
registered (fake) worker, the tiny Qwen2 checkpoint (its template lists tools), and a local
media server. A test module that needs another of these defines its own, which wins."""

import pytest

from gateway.tokenizer import PromptTokenizer
from tests.support.gateway_helpers import make_config, register_worker
from tests.support.media_server import media_server


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> PromptTokenizer:
    return PromptTokenizer(tiny_model_dir)


@pytest.fixture
def config(tiny_model_dir, redis_url):
    """A config with its own key prefix and a 5 s request timeout, one worker registered
    (max_model_len 256) with a scheduler's heartbeat for it; a test that runs a request starts
    a FakeWorker (tests/support/gateway_helpers.py) to answer it."""
    config = make_config(tiny_model_dir, redis_url, request_timeout_s=5.0)
    register_worker(config, max_model_len=256)
    return config


@pytest.fixture(scope="module")
def qwen_dir(family_model_dir):
    return family_model_dir("qwen2")  # its template lists tools


@pytest.fixture(scope="module")
def http_server():
    """The URL of a real local HTTP server of test media (tests/support/media_server.py)."""
    with media_server() as server:
        yield server.url
