"""The checkpoint's generation_config.json as sampling defaults (vLLM's --generation-config)
and --chat-template: read at startup, applied by the gateway to the NewRequest the scheduler
sees (the real Redis stream; a fake worker answers)."""

from __future__ import annotations

import json
import shutil

import pytest

from gateway.sampling_defaults import SamplingDefaults
from gateway.tokenizer import PromptTokenizer
from tests.support.gateway_helpers import MODEL, FakeWorker, gateway_client, make_config, register_worker, token_events

GENERATION = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
              "repetition_penalty": 1.1, "max_new_tokens": 7, "eos_token_id": [2, 3]}


@pytest.fixture
def model_with_defaults(tiny_model_dir, tmp_path):
    """The tiny checkpoint with sampling defaults in its generation_config.json."""
    folder = shutil.copytree(tiny_model_dir, tmp_path / "with-defaults")
    generation = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**generation, **GENERATION}))
    return folder


def test_auto_reads_the_model_folder(model_with_defaults):
    defaults = SamplingDefaults.load("auto", model_with_defaults)
    assert defaults == SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20, min_p=0.05,
                                        repetition_penalty=1.1, max_tokens=7)


def test_vllm_ignores_it_and_a_folder_is_read_instead(model_with_defaults, tiny_model_dir, tmp_path):
    assert SamplingDefaults.load("vllm", model_with_defaults) == SamplingDefaults()
    assert SamplingDefaults.load(str(model_with_defaults), tiny_model_dir).temperature == 0.6
    assert SamplingDefaults.load("auto", tmp_path) == SamplingDefaults()  # no file: no defaults
    with pytest.raises(ValueError, match="expected 'auto', 'vllm' or a folder"):
        SamplingDefaults.load("greedy", tiny_model_dir)
    with pytest.raises(ValueError, match="no generation_config.json"):
        SamplingDefaults.load(str(tmp_path), tiny_model_dir)


@pytest.mark.anyio
async def test_a_request_falls_back_to_the_defaults_and_its_own_values_win(model_with_defaults, redis_url):
    config = make_config(model_with_defaults, redis_url)
    register_worker(config, max_model_len=256)
    script = lambda r: token_events(r.request_id, [5], "length")  # noqa: E731
    async with FakeWorker(config, script) as worker, gateway_client(config) as client:
        bare = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello"})
        own = await client.post("/v1/completions", json={
            "model": MODEL, "prompt": "Hello", "temperature": 0, "top_p": 1, "top_k": -1,
            "min_p": 0, "repetition_penalty": 1, "max_tokens": 3})
        chat = await client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert bare.status_code == own.status_code == chat.status_code == 200, (bare.text, own.text, chat.text)
    first, second, third = (m.sampling for m in worker.messages)
    assert (first.temperature, first.top_p, first.top_k, first.min_p, first.repetition_penalty,
            first.max_tokens) == (0.6, 0.9, 20, 0.05, 1.1, 7)
    assert (second.temperature, second.top_p, second.top_k, second.min_p, second.repetition_penalty,
            second.max_tokens) == (0.0, 1.0, 0, 0.0, 1.0, 3)
    assert (third.temperature, third.max_tokens) == (0.6, 7)  # chat: the default, within the context


@pytest.mark.anyio
async def test_generation_config_vllm_keeps_openai_defaults(model_with_defaults, redis_url):
    config = make_config(model_with_defaults, redis_url, generation_config="vllm")
    register_worker(config, max_model_len=256)
    async with FakeWorker(config, lambda r: token_events(r.request_id, [5], "length")) as worker, \
            gateway_client(config) as client:
        response = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello"})
    assert response.status_code == 200, response.text
    [request] = worker.messages
    assert (request.sampling.temperature, request.sampling.top_k, request.sampling.max_tokens) == (1.0, 0, 16)


def test_chat_template_from_a_file_or_inline_replaces_the_models(tiny_model_dir, tmp_path):
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    messages = [{"role": "user", "content": "hi there"}]
    for source in (str(tmp_path / "t.jinja"), template):
        tokenizer = PromptTokenizer(tiny_model_dir, source)
        assert tokenizer.hf.decode(tokenizer.encode_chat(messages)) == "[user] hi there\n"
    with pytest.raises(ValueError, match="no such file"):
        PromptTokenizer(tiny_model_dir, str(tmp_path / "missing.jinja"))
