"""The OpenAPI document is the contract, and a third-party fuzzer holds the gateway to it.

`schemathesis` (its CLI, as a user runs it) reads the gateway's own /openapi.json and tests
every operation of a real stack (redis-server, a gRPC worker, the scheduler, the gateway
under uvicorn) on the tiny text model, and on the tiny Gemma 3 vision checkpoint the
operations whose document offers image and video parts and the Files API, in all its phases (coverage,
fuzzing, stateful) with every conformance check:
no 5xx; only documented status codes, media types (JSON, or `text/event-stream` when
streamed), headers and response bodies (each SSE event too); bodies the document calls
invalid refused, bodies it calls valid accepted. The one allowance
(tests/support/openapi_contract_hooks.py): a valid body refused with a 400 whose code the route's
400 lists under `x-beyond-schema`, the rules no JSON Schema can state -- and of the bodies
generated valid for each generating route, at least half must be served (2xx), so that the
allowance cannot hide a route that refuses everything.

Bounded (RUNS: examples per operation and phase; a fixed seed) to fit CI on a small machine;
docs/api.md ("The OpenAPI document is the contract") says how to run it longer against
`make up`. The checks of the document itself, which need no stack:
tests/unit/gateway/test_openapi_contract.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.stack_helpers import running_stack

SEED = 20251103
# (model, max_model_len: short generations, the point is the API surface; examples per
# operation and phase; the operations: on the vision checkpoint those that take images, and
# the Files API, whose links the stateful phase follows)
RUNS = {"text": ("tiny_model_dir", 64, 40, None, 15),
        "vision": ("vision_dir", 128, 20, "^/(v1/chat/completions|v1/responses|tokenize|v1/files.*)$", 8)}
HOOKS = Path(__file__).resolve().parents[1] / "support" / "openapi_contract_hooks.py"
MIN_SERVED_SHARE = 0.5  # of the bodies generated valid for a generating route, served (72-84% here)


@pytest.fixture
def stack(request, redis_url, tmp_path_factory):
    model_fixture, max_model_len, *_ = RUNS[request.param]
    with running_stack(request.getfixturevalue(model_fixture), redis_url, tmp_path_factory.mktemp("contract"),
                       worker_args=("--max-model-len", str(max_model_len))) as stack:
        yield request.param, stack


def schemathesis(url: str, workdir: Path, *args: str) -> subprocess.CompletedProcess:
    """The CLI, with the hook; in `workdir` (it keeps a cache in .schemathesis/ there, and
    the hook its tally of calls in tally.jsonl). `--checks all` includes max_response_time,
    at 10 s unless told: speed is not the contract."""
    command = [str(Path(sys.executable).with_name("schemathesis")), "run", url, "--checks", "all",
               "--max-response-time", "600", "--workers", "1", "--request-timeout", "120", "--no-color",
               "--output-sanitize", "false", *args]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": str(HOOKS), "CONTRACT_TALLY": str(workdir / "tally.jsonl")}
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=workdir)


@pytest.mark.parametrize("stack", list(RUNS), indirect=True)
def test_schemathesis_finds_nothing(stack, tmp_path):
    """Every operation on the tiny text model; on the tiny Gemma 3 vision checkpoint, the
    ones whose document offers image and video parts, and the Files API."""
    kind, running = stack
    _, _, examples, paths, operations = RUNS[kind]
    url = running.base_url.removesuffix("/v1") + "/openapi.json"
    run = schemathesis(url, tmp_path, "--max-examples", str(examples), "--seed", str(SEED),
                       *(("--include-path-regex", paths) if paths else ()))
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-30000:]
    assert "No issues found" in out, out[-30000:]
    assert f"Tested: {operations}" in out, out[-3000:]
    # (the stateful phase follows links between operations: the Files API's, on both)
    for phase in ("Coverage", "Fuzzing", "Stateful"):
        assert re.search(rf"✅ {phase}", out), (phase, out[-3000:])
    generated = int(re.search(r"(\d+) generated", out)[1])
    assert generated >= 100 * operations, out[-3000:]
    # the excused 400s are not all a valid body gets: each generating route serves a share
    calls = [json.loads(line) for line in (tmp_path / "tally.jsonl").read_text().splitlines()]
    for operation in ("POST /v1/chat/completions", "POST /v1/responses", "POST /v1/completions"):
        if kind == "vision" and operation == "POST /v1/completions":
            continue  # not among the vision run's operations
        valid = [c["status"] for c in calls if c["operation"] == operation and c["positive"]]
        served = sum(200 <= s < 300 for s in valid)
        assert served >= MIN_SERVED_SHARE * len(valid) and served >= 5, (operation, len(valid), served)
