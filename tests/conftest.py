"""Shared fixtures: a real redis-server and a tiny model checkpoint made locally. And the
marker a test's folder gives it (CONTRIBUTING.md, "Tests"): every test under tests/e2e/ is
`e2e`, under tests/gpu/ `gpu`, under tests/bench/ `bench`; tests/unit/ and
tests/architecture/ give none. A test whose needs differ from its folder's marks itself: the
CUDA cases of a kernel test in tests/unit/ (`gpu`), a benchmark's smoke test that starts the
stack (`e2e`), the stack in containers (`compose`)."""

import os
import shutil
import subprocess
import time
import warnings
from pathlib import Path

import pytest

from compose.launcher import free_port, redis_server_argv

REDIS_IMAGE = "redis:7"
TESTS = Path(__file__).resolve().parent
# tests/<folder>/... -> the marker every test in it gets (registered in pyproject.toml)
FOLDER_MARKERS = {"e2e": "e2e", "gpu": "gpu", "bench": "bench"}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        path = Path(item.path).resolve()
        if path.is_relative_to(TESTS) and (marker := FOLDER_MARKERS.get(path.relative_to(TESTS).parts[0])):
            item.add_marker(marker)


def _local_docker_image(name: str) -> bool:
    """True when a Docker engine answers and already holds image `name`. Nothing is pulled:
    an engine that answers may still be unable to reach a registry (no Docker Hub here)."""
    try:
        import docker

        docker.from_env(timeout=2).images.get(name)
        return True
    except Exception:
        return False


def _wait_for_redis(url: str, timeout: float = 10.0) -> None:
    import redis

    deadline = time.monotonic() + timeout
    while True:
        try:
            redis.Redis.from_url(url).ping()
            return
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _redis_container():
    """Yield a container's URL (once), or return False when it cannot be started here."""
    from testcontainers.core.config import testcontainers_config
    from testcontainers.redis import RedisContainer

    if not _local_docker_image(testcontainers_config.ryuk_image):
        testcontainers_config.ryuk_disabled = True  # its reaper image cannot be pulled either
    container = RedisContainer(REDIS_IMAGE)
    try:
        container.start()
    except Exception as exc:  # an engine that cannot run it: fall back to the binary
        warnings.warn(f"Redis container could not start ({exc}); using redis-server")
        return False
    try:
        yield f"redis://{container.get_container_host_ip()}:{container.get_exposed_port(6379)}/0"
    finally:
        container.stop()
    return True


@pytest.fixture
def anyio_backend():
    """Every anyio test runs on asyncio (the services' loop), not trio too."""
    return "asyncio"


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real Redis: REDIS_URL if set, else a `redis:7` container where the engine has that
    image already, else a redis-server binary started here on a free loopback port."""
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    if _local_docker_image(REDIS_IMAGE):
        served = yield from _redis_container()
        if served:
            return
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("no redis-server on PATH: run `make test` (it installs one) or set REDIS_URL")
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(redis_server_argv(binary, port, workdir),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        _wait_for_redis(url)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A `tiny` preset checkpoint (random weights, local BPE tokenizer), made once per session."""
    from tools.make_model import make_model

    out = tmp_path_factory.mktemp("tiny-model")
    make_model(out, preset="tiny", seed=0)
    return out


@pytest.fixture(scope="session")
def family_model_dir(tmp_path_factory):
    """`family_model_dir(arch)`: that family's `tiny` checkpoint, made once per session."""
    from tools.make_model import make_model

    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = make_model(tmp_path_factory.mktemp(f"tiny-{arch}"), preset="tiny", arch=arch)
        return made[arch]

    return get


@pytest.fixture(scope="session")
def vision_dir(family_model_dir) -> Path:
    """The `tiny` gemma3-vision checkpoint (Gemma3ForConditionalGeneration with its
    processor), made once per session."""
    return family_model_dir("gemma3-vision")


@pytest.fixture(scope="session")
def processor(vision_dir):
    """The vision checkpoint's AutoProcessor: the reference for prompts and pixel values."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(vision_dir)


@pytest.fixture(scope="session")
def hf_vlm(vision_dir):
    """The vision checkpoint in transformers, fp32: the reference for outputs with images."""
    import torch
    from transformers import Gemma3ForConditionalGeneration

    return Gemma3ForConditionalGeneration.from_pretrained(vision_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir):
    """The tiny checkpoint in transformers, the reference for model outputs."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def client(stack):
    """The official openai client on the calling module's own `stack` fixture."""
    import openai

    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)
