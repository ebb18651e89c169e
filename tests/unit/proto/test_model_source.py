"""`--model` as users give it: a folder, or a Hugging Face Hub id resolved through
huggingface_hub and its cache. The cache is laid out by huggingface_hub itself, downloading
from a stand-in Hub on a loopback port (tests/support/fake_hub.py); then, offline and with the
stand-in gone, the worker and the gateway find the model in the cache. huggingface_hub
reads HF_HOME / HF_ENDPOINT / HF_HUB_OFFLINE when imported, so each case runs in a fresh
process with its own environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.support.fake_hub import COMMIT, fake_hub

from proto.model_source import ModelNotFound, resolve_model, served_name, served_names

REPO = "pagedserve-tests/tiny-qwen3"
ROOT = Path(__file__).resolve().parents[3]


def in_process(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env})


RESOLVE = "from proto.model_source import resolve_model; print(resolve_model({!r}))"
RUNNER = ("from worker_svc.config import RunnerConfig; from worker_svc.model_runner import ModelRunner; "
          "r = ModelRunner(RunnerConfig(model={!r}, num_blocks=4)); print(r.describe().model)")
TOKENIZER = "from gateway.tokenizer import PromptTokenizer; from proto.model_source import resolve_model; " \
            "print(PromptTokenizer(resolve_model({!r})).encode_text('def f(x): return x'))"
GATEWAY = ("from gateway.app import create_app; from gateway.config import GatewayConfig; "
           "app = create_app(GatewayConfig(model={!r})); "
           "print(app.state.config.model_name, app.state.tokenizer.encode_text('def f(x): return x'))")


@pytest.fixture(scope="module")
def hub_cache(family_model_dir, tmp_path_factory):
    """HF_HOME holding REPO, downloaded by huggingface_hub from the stand-in Hub."""
    home = tmp_path_factory.mktemp("hf-home")
    with fake_hub(REPO, family_model_dir("qwen3")) as endpoint:
        proc = in_process(RESOLVE.format(REPO), HF_HOME=str(home), HF_ENDPOINT=endpoint)
        assert proc.returncode == 0, proc.stderr
    snapshot = home / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT
    assert Path(proc.stdout.strip()) == snapshot
    assert (home / "hub" / f"models--{REPO.replace('/', '--')}" / "refs" / "main").read_text() == COMMIT
    return home


def test_downloaded_files_are_what_serving_needs(hub_cache, family_model_dir):
    snapshot = next((hub_cache / "hub").glob("models--*/snapshots/*"))
    names = {p.name for p in snapshot.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names
    assert json.loads((snapshot / "config.json").read_text()) == \
        json.loads((family_model_dir("qwen3") / "config.json").read_text())


def test_offline_the_worker_and_the_gateway_load_from_the_cache(hub_cache):
    env = dict(HF_HOME=str(hub_cache), HF_HUB_OFFLINE="1", HF_ENDPOINT="http://127.0.0.1:9")
    proc = in_process(RUNNER.format(REPO), **env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == REPO  # served under its Hub id
    proc = in_process(TOKENIZER.format(REPO), **env)
    assert proc.returncode == 0, proc.stderr
    ids = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ids
    proc = in_process(GATEWAY.format(REPO), **env)  # the gateway app itself, given the Hub id
    assert proc.returncode == 0, proc.stderr
    name, _, gateway_ids = proc.stdout.strip().splitlines()[-1].partition(" ")
    assert name == REPO and json.loads(gateway_ids) == ids


def test_not_cached_and_offline_is_a_clear_error(hub_cache):
    proc = in_process(RESOLVE.format("pagedserve-tests/not-there"), HF_HOME=str(hub_cache), HF_HUB_OFFLINE="1")
    assert proc.returncode != 0
    assert "ModelNotFound: model 'pagedserve-tests/not-there' is not a folder and not in the Hugging " \
           "Face cache" in proc.stderr and "HF_HUB_OFFLINE" in proc.stderr


def test_unknown_on_the_hub_is_a_clear_error(family_model_dir, tmp_path):
    with fake_hub(REPO, family_model_dir("qwen3")) as endpoint:
        proc = in_process(RESOLVE.format("pagedserve-tests/not-there"), HF_HOME=str(tmp_path),
                          HF_ENDPOINT=endpoint)
    assert proc.returncode != 0
    assert f"downloading it from {endpoint} failed" in proc.stderr


def test_a_path_that_is_not_a_folder_never_asks_the_hub(tmp_path):
    with pytest.raises(ModelNotFound, match="no such folder"):
        resolve_model(str(tmp_path / "missing"))
    with pytest.raises(ModelNotFound, match="no such folder"):
        resolve_model("./models/missing")


def test_served_names(tiny_model_dir):
    assert served_name(str(tiny_model_dir)) == tiny_model_dir.name
    assert served_name("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    assert served_name("Qwen/Qwen3-0.6B", "qwen") == "qwen"
    assert served_names("Qwen/Qwen3-0.6B", "qwen,qwen3-small") == ["qwen", "qwen3-small"]
    assert served_name("Qwen/Qwen3-0.6B", "qwen,qwen3-small") == "qwen"
