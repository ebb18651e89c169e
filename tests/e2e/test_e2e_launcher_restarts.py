"""`pagedserve up` restarts a service that dies instead of stopping the stack: the
launcher's stack with its scheduler, a worker and the gateway killed in turn, each restarted
and serving again. The backoff rule alone: tests/unit/compose/test_launcher_restarts.py."""

from __future__ import annotations

import signal
import time

import httpx
import openai

from tests.support.stack_helpers import running_stack


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
