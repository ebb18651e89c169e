"""`pagedserve up` restarts a service that dies instead of stopping the stack: the backoff
rule alone, and the launcher's stack with its scheduler and a worker killed."""

from __future__ import annotations

import signal
import time

import httpx
import openai
import pytest

from compose.restarts import RestartBackoff
from tests.stack_helpers import running_stack


def test_backoff_doubles_and_resets_after_a_stable_run():
    backoff = RestartBackoff(initial_s=1.0, max_s=4.0, stable_s=60.0)
    assert backoff.due("w", 100.0) == 0.0  # the first crash: at once
    backoff.restarted("w", 100.0)
    assert backoff.due("w", 101.0) == 1.0  # crashed again 1 s later: wait 1 s
    assert backoff.due("w", 101.5) == 0.5
    backoff.restarted("w", 102.0)
    assert backoff.due("w", 103.0) == 2.0
    backoff.restarted("w", 105.0)
    assert backoff.due("w", 105.0) == 4.0
    backoff.restarted("w", 109.0)
    assert backoff.due("w", 110.0) == 4.0  # capped
    backoff.restarted("w", 114.0)
    assert backoff.due("w", 200.0) == 0.0  # it ran 86 s: at once again
    assert backoff.due("other", 200.0) == 0.0  # each service has its own


@pytest.mark.e2e
def test_killed_services_are_restarted_and_serve_again(tiny_model_dir, redis_url, tmp_path_factory):
    with running_stack(tiny_model_dir, redis_url, tmp_path_factory.mktemp("run")) as stack:
        client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=300)

        def complete() -> str:
            return client.completions.create(model=stack.served_model_name, prompt="hello",
                                              max_tokens=4).choices[0].finish_reason

        def ready() -> bool:
            url = f"http://{stack.config.host}:{stack.config.port}/health/ready"
            try:
                return httpx.get(url, timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        assert complete() in ("stop", "length")
        for name in ("scheduler", "worker-0", "gateway"):
            before = stack.procs[name].pid
            stack.procs[name].send_signal(signal.SIGKILL)
            stack.procs[name].wait(timeout=10)
            deadline = time.monotonic() + 30
            while name not in stack.supervise():
                assert time.monotonic() < deadline, f"{name} was not restarted"
                time.sleep(0.2)
            assert stack.procs[name].pid != before
            deadline = time.monotonic() + 120  # a worker loads its model again
            while not ready():
                assert stack.procs[name].poll() is None, f"{name} died again"
                assert time.monotonic() < deadline, f"not ready after restarting {name}"
                time.sleep(0.2)
            assert complete() in ("stop", "length")
