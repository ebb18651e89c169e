"""The stack in containers: the images built from compose/Dockerfile and the stack started
with the README's compose commands (`--scale worker=2`, the `tiny` preset), checked with
the official openai client; then the same stack on a tiny vision checkpoint with two
encoder services (`--profile encoder --scale encoder=2`). `make test-compose` runs it
(compose/testing/test-compose.sh sets PAGEDSERVE_COMPOSE_TEST=1 and the images' build
inputs); the normal suite skips it. The tests run in file order, on one stack; the last
one takes it down."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from proto.metrics_scrape import Samples, metric, parse_samples
from tests.support.media_helpers import data_url, file_bytes, picture
from tests.support.runner_helpers import hf_greedy
from tests.support.stack_helpers import greedy_completions, ids_of

pytestmark = [
    pytest.mark.compose,
    pytest.mark.skipif(os.environ.get("PAGEDSERVE_COMPOSE_TEST") != "1",
                       reason="builds images and runs containers: `make test-compose`"),
]

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = "compose/docker-compose.yml"
PROJECT = "pagedserve-test"
MODEL = "tiny"
PROMPTS = ["The quick brown fox", "def main():\n    return", "import os\nimport sys\n", "class Stack:"]
MAX_TOKENS = 48
# The README's Docker section, command by command (tests/unit/compose/test_compose.py holds them equal).
BUILD = ("build",)
UP = ("up", "-d", "--scale", "worker=2")
PORT = ("port", "gateway", "8000")
SCALE_UP = ("up", "-d", "--scale", "worker=3", "--no-recreate")
DOWN = ("down", "-v")
README_COMMANDS = [BUILD, UP, PORT, SCALE_UP, DOWN]
# The vision variant (docker-compose.yml's header): make-model writes the tiny gemma3-vision
# checkpoint into the volume; the encoders run only with their profile.
VISION = {"MODEL": "tiny-vision", "PRESET": "tiny", "ARCH": "gemma3-vision"}
ENCODERS = ("--profile", "encoder")
ENCODER_METRICS_PORT = 9103  # --metrics-port in docker-compose.yml
DASHBOARD = ROOT / "compose" / "grafana" / "pagedserve-dashboard.json"


@dataclass(frozen=True)
class ComposeStack:
    """What tests.stack_helpers.greedy_completions needs of a stack."""
    base_url: str
    served_model_name: str


def compose_binary() -> list[str]:
    """Compose v2 where the docker client has it, else v1."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    assert shutil.which("docker-compose"), "neither `docker compose` nor `docker-compose`: `make docker-compose`"
    return ["docker-compose"]


def run_compose(*args: str, timeout: float = 900, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`docker compose -f compose/docker-compose.yml ARGS` from the repository root, as the
    README has users type it; the test's settings through the documented variables (`env`:
    others over them)."""
    env = {**os.environ, "COMPOSE_PROJECT_NAME": PROJECT, "MODEL": MODEL, "PRESET": MODEL,
           "GATEWAY_PORTS": "18000-18009", "KV_CACHE_MEMORY": "32MiB", "WORKER_CPUS": "1",
           "ENCODER_CPUS": "1", **(env or {})}
    return subprocess.run([*compose_binary(), "-f", COMPOSE_FILE, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def service_logs() -> str:
    """The last lines every container of the stack wrote, exited ones included: what a
    failure message needs to say why a service did not come up."""
    proc = run_compose("logs", "--no-color", "--tail", "40", timeout=120)
    return f"--- compose logs ---\n{proc.stdout}{proc.stderr}"


def compose(*args: str, timeout: float = 900, env: dict[str, str] | None = None) -> str:
    proc = run_compose(*args, timeout=timeout, env=env)
    if proc.returncode != 0:
        logs = service_logs() if "up" in args else ""
        raise AssertionError(f"compose {args}: {proc.stdout}\n{proc.stderr}\n{logs}")
    return proc.stdout


def docker(*args: str, check: bool = True) -> str:
    proc = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 or not check, f"docker {args}: {proc.stderr}"
    return proc.stdout


def containers(service: str | None = None, all_states: bool = False) -> list[str]:
    filters = ["--filter", f"label=com.docker.compose.project={PROJECT}"]
    if service:
        filters += ["--filter", f"label=com.docker.compose.service={service}"]
    return docker("ps", "-q", *(["-a"] if all_states else []), *filters).split()


def health(container: str) -> str:
    return docker("inspect", "--format", "{{if .State.Health}}{{.State.Health.Status}}{{end}}", container).strip()


def registered(service: str = "worker") -> int:
    """The workers (or encoders) whose registration is live in Redis."""
    (redis,) = containers("redis")
    out = docker("exec", redis, "redis-cli", "--scan", "--pattern", f"pagedserve:{service}:*")
    return len(out.split())


def registered_workers() -> int:
    return registered("worker")


def wait_for(what: str, ready, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            ps = docker("ps", "-a", "--filter", f"label=com.docker.compose.project={PROJECT}")
            raise AssertionError(f"not {what} after {timeout}s:\n{ps}\n{service_logs()}")
        time.sleep(1)


def wait_healthy(workers: int, encoders: int = 0) -> None:
    """Every container healthy, `workers` worker and `encoders` encoder containers among
    them, all registered."""
    def ready() -> bool:
        running = containers()
        return (len(containers("worker")) == workers and len(containers("encoder")) == encoders
                and all(health(c) == "healthy" for c in running)
                and registered_workers() == workers and registered("encoder") == encoders)
    wait_for(f"healthy with {workers} workers and {encoders} encoders", ready)


def http_get(container: str, port: int, path: str) -> tuple[int, str]:
    """GET http://127.0.0.1:PORT/PATH inside the container: (status, body)."""
    code = ("import sys, urllib.request, urllib.error\n"
            "try:\n    r = urllib.request.urlopen(sys.argv[1], timeout=5); s, b = r.status, r.read()\n"
            "except urllib.error.HTTPError as e:\n    s, b = e.code, e.read()\n"
            "print(s); sys.stdout.write(b.decode())")
    out = docker("exec", container, "python3", "-c", code, f"http://127.0.0.1:{port}{path}")
    status, body = out.split("\n", 1)
    return int(status), body


def scraped(container: str, port: int) -> Samples:
    status, body = http_get(container, port, "/metrics")
    assert status == 200, body
    return parse_samples(body)


def images_row_metrics() -> list[tuple[str, str, str]]:
    """(panel title, job, metric) of every expression of the dashboard's collapsed images
    row (vision models only), its job variables at their defaults."""
    dashboard = json.loads(DASHBOARD.read_text())
    jobs = {f"${v['name']}": v["current"]["value"] for v in dashboard["templating"]["list"]}
    (row,) = [p for p in dashboard["panels"] if p["type"] == "row" and p["title"].startswith("Images")]
    found = []
    for panel in row["panels"]:
        for target in panel["targets"]:
            uses = re.findall(r'(pagedserve:[A-Za-z0-9_:]+)\{job="(\$\w+)"\}', target["expr"])
            assert uses and len(uses) == target["expr"].count("pagedserve:"), target["expr"]
            found += [(panel["title"], jobs[variable], name) for name, variable in uses]
    return found


def worker_requests(container: str) -> int:
    """The worker's own count of requests it holds, from its gRPC Health."""
    code = ("import grpc; from proto import worker_pb2 as m, worker_pb2_grpc as g; "
            "print(g.WorkerStub(grpc.insecure_channel('127.0.0.1:50051'))"
            ".Health(m.HealthRequest(), timeout=3).num_requests)")
    return int(docker("exec", container, "python3", "-c", code).strip())


@pytest.fixture(scope="module")
def stack():
    compose(*ENCODERS, *DOWN, "--remove-orphans")
    started = time.monotonic()
    compose(*BUILD)
    built = time.monotonic()
    compose(*UP)
    wait_healthy(workers=2)
    port = compose(*PORT).strip().rsplit(":", 1)[1]
    print(f"\ncompose build {built - started:.0f} s, up until healthy {time.monotonic() - built:.0f} s")
    print(docker("image", "ls", "--format", "{{.Repository}}:{{.Tag}} {{.Size}}", "pagedserve-*"))
    try:
        yield ComposeStack(base_url=f"http://127.0.0.1:{port}/v1", served_model_name=MODEL)
    finally:
        compose(*ENCODERS, *DOWN, "--remove-orphans")


@pytest.fixture(scope="module")
def model_dir(stack, tmp_path_factory) -> Path:
    """The checkpoint the make-model service wrote into the models volume, copied out."""
    out = tmp_path_factory.mktemp("compose-model")
    docker("cp", f"{containers('worker')[0]}:/models/{MODEL}", str(out))
    return out / MODEL


@pytest.fixture(scope="module")
def cases(model_dir) -> list[tuple[list[int], int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [(tokenizer.encode(p), MAX_TOKENS) for p in PROMPTS]


@pytest.fixture(scope="module")
def expected(model_dir, cases) -> list[list[int]]:
    """transformers' own greedy generate() on the same checkpoint."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    return [hf_greedy(hf, prompt, max_tokens) for prompt, max_tokens in cases]


def test_images_light_without_torch_and_nobody_runs_as_root(stack):
    (gateway,) = containers("gateway")
    (scheduler,) = containers("scheduler")
    for container in (gateway, scheduler):
        code = "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)"
        docker("exec", container, "python3", "-c", code)  # fails where torch is installed
    for container in (gateway, scheduler, *containers("worker")):
        assert docker("exec", container, "id", "-u").strip() != "0"


def test_a_worker_limited_to_one_cpu_computes_with_one_thread(stack):
    """WORKER_CPUS=1 (`cpus: 1`: a CFS quota, as `docker run --cpus 1`): the worker reads the
    quota and computes with one thread, not one per core of the host."""
    for worker in containers("worker"):
        proc = subprocess.run(["docker", "logs", worker], capture_output=True, text=True, timeout=60)
        logs = proc.stdout + proc.stderr
        assert "compute threads: 1 (" in logs and "a cgroup CPU quota of 1)" in logs, logs[-3000:]


def test_greedy_output_is_transformers(stack, cases, expected):
    choices = greedy_completions(stack, cases)
    assert [ids_of(c) for c in choices] == expected


def _client(stack: ComposeStack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=300)


async def _stream(client: openai.AsyncOpenAI, prompt: list[int], max_tokens: int, started: asyncio.Event | None = None):
    """A streamed greedy completion's text, in the chunks it came in."""
    chunks = []
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                             temperature=0, stream=True)
    async for chunk in stream:
        chunks.append(chunk.choices[0].text if chunk.choices else "")
        if started is not None and len(chunks) >= 2:
            started.set()
    return chunks


def test_streaming_gives_the_same_text(stack, cases):
    whole = [c.text for c in greedy_completions(stack, cases)]

    async def run():
        async with _client(stack) as client:
            return await asyncio.gather(*(_stream(client, p, m) for p, m in cases))

    streamed = asyncio.run(run())
    assert all(len(chunks) > 2 for chunks in streamed)
    assert ["".join(chunks) for chunks in streamed] == whole


def test_a_worker_killed_mid_stream_the_requests_complete(stack):
    """Long streams on both workers; one worker container is killed while they run: the
    scheduler re-routes what it held and every stream ends with the text it gives unharmed."""
    long_cases = [([5 + i, 17, 42, 99], 1000) for i in range(4)]  # max_model_len is 1024
    whole = [c.text for c in greedy_completions(stack, long_cases)]

    async def run():
        async with _client(stack) as client:
            started = [asyncio.Event() for _ in long_cases]
            streams = [asyncio.create_task(_stream(client, p, m, s)) for (p, m), s in zip(long_cases, started)]
            await asyncio.gather(*(s.wait() for s in started))
            workers = containers("worker")
            held = await asyncio.gather(*(asyncio.to_thread(worker_requests, c) for c in workers))
            busy = [c for c, n in zip(workers, held) if n > 0]
            assert busy, "no worker holds a request"
            assert not all(s.done() for s in streams), "the streams ended before the kill"
            await asyncio.to_thread(docker, "kill", busy[0])
            return await asyncio.gather(*streams)

    streamed = asyncio.run(run())
    assert ["".join(chunks) for chunks in streamed] == whole
    compose(*UP, "--no-recreate")  # back to two, restarted or not
    wait_healthy(workers=2)


def test_scale_to_three_workers_and_back_while_requests_run(stack, cases, expected):
    """Four clients send greedy requests back to back from before the scale-up until after
    the scale-down; every answer is still transformers' output, and answers kept coming
    while three workers served and while the third one left."""
    async def run():
        finished: list[tuple[str, int, list[int]]] = []  # (phase, case, token ids)
        phase = ["two"]
        done = asyncio.Event()

        async def client_loop(client, first: int):
            i = first
            while not done.is_set():
                prompt, max_tokens = cases[i % len(cases)]
                resp = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                                       temperature=0, extra_body={"return_token_ids": True})
                finished.append((phase[0], i % len(cases), ids_of(resp.choices[0])))
                i += 1

        async def a_request_finishes_in(p: str, timeout_s: float = 120) -> None:
            deadline = time.monotonic() + timeout_s
            while not any(q == p for q, _, _ in finished):
                assert time.monotonic() < deadline, f"no answer in phase {p!r}"
                await asyncio.sleep(0.2)

        async with _client(stack) as client:
            loops = [asyncio.create_task(client_loop(client, k)) for k in range(4)]
            await asyncio.to_thread(compose, *SCALE_UP)
            await asyncio.to_thread(wait_healthy, 3)
            phase[0] = "three"
            await a_request_finishes_in("three")
            phase[0] = "leaving"
            await asyncio.to_thread(compose, *UP, "--no-recreate")
            await asyncio.to_thread(wait_healthy, 2)
            phase[0] = "two again"
            await a_request_finishes_in("two again")
            done.set()
            await asyncio.gather(*loops)
        return finished

    finished = asyncio.run(run())
    assert all(ids == expected[case] for _, case, ids in finished)
    phases = {p for p, _, _ in finished}
    assert {"two", "three", "leaving", "two again"} <= phases, phases
    assert registered_workers() == 2


def test_two_encoders_encode_the_images_of_a_vision_model(stack):
    """The stack again on the tiny gemma3-vision checkpoint (make-model writes it into the
    volume; every service on it is re-created), one worker and two encoders: an image sent
    through the gateway is encoded by an encoder; both answer 200 on /health; and the
    dashboard's images row queries metrics the worker and the encoders export."""
    started = time.monotonic()
    # The text stack's services, idle, stopped at once: otherwise `up` stops the old workers
    # one after the other, each with its drain (over a minute in all, measured here).
    compose("stop", "-t", "1", "gateway", "scheduler", "worker")
    compose(*ENCODERS, "up", "-d", "--scale", "worker=1", "--scale", "encoder=2", env=VISION)
    wait_healthy(workers=1, encoders=2)
    print(f"\nvision stack with two encoders up in {time.monotonic() - started:.0f} s")
    port = compose(*PORT, env=VISION).strip().rsplit(":", 1)[1]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
    image = data_url(file_bytes(picture(7, 96, 64), "PNG"))
    answer = client.chat.completions.create(
        model=VISION["MODEL"], max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                               {"type": "text", "text": "What is in this picture?"}]}])
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.usage.prompt_tokens > 4

    encoders = containers("encoder")
    assert len(encoders) == 2
    for encoder in encoders:
        status, body = http_get(encoder, ENCODER_METRICS_PORT, "/health")
        assert status == 200 and json.loads(body)["status"] == "ok", body

    def encoded() -> float:
        return sum(metric(scraped(c, ENCODER_METRICS_PORT), "pagedserve:mm_items_encoded_total") for c in encoders)
    wait_for("an image encoded by an encoder", lambda: encoded() >= 1, timeout=60)

    (worker,) = containers("worker")
    names = {"worker": {n for n, _ in scraped(worker, 9102)},
             "encoder": {n for c in encoders for n, _ in scraped(c, ENCODER_METRICS_PORT)}}
    for title, job, name in images_row_metrics():
        assert name in names[job], f"panel {title!r}: {job} does not export {name}"
    print(f"encoder phase {time.monotonic() - started:.0f} s")
    # Gone before the README's `down` below, which names no profile (Compose v2 may leave the
    # containers of a profile it is not given).
    compose(*ENCODERS, "rm", "-s", "-f", "encoder", env=VISION)


def test_down_leaves_nothing(stack):
    compose(*DOWN)
    label = f"label=com.docker.compose.project={PROJECT}"
    assert containers(all_states=True) == []
    assert docker("network", "ls", "-q", "--filter", label).split() == []
    assert docker("volume", "ls", "-q", "--filter", label).split() == []
    assert docker("volume", "ls", "-q", "--filter", f"name={PROJECT}_").split() == []
