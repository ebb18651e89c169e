"""`pagedserve engine` as a process: the same gateway over the in-process engine, under
uvicorn, called with the official `openai` client against transformers, and its /metrics.
The engine in process: tests/unit/compose/test_engine.py."""

from __future__ import annotations

import time

import torch
from transformers import AutoModelForCausalLM

from proto.metrics_scrape import metric, scrape
from tests.support.stack_helpers import wait_until_answers


def test_engine_serves_the_openai_api(tiny_model_dir, tmp_path):
    """`pagedserve engine`: the same gateway over the in-process engine, under uvicorn."""
    import subprocess
    import sys

    import openai

    from compose.launcher import free_port

    port = free_port()
    log = open(tmp_path / "engine.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "compose.cli", "engine", "--model", str(tiny_model_dir),
                             "--port", str(port), "--threads", "1"], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_answers(f"http://127.0.0.1:{port}/v1/models", proc, 120, "the engine did not start")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        prompt = [11, 22, 33, 44, 55]
        resp = client.completions.create(model=tiny_model_dir.name, prompt=prompt, max_tokens=12, temperature=0,
                                         extra_body={"return_token_ids": True})
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=tiny_model_dir.name, prompt=prompt, max_tokens=12, temperature=0, stream=True) if c.choices)
        # Its /metrics: the gateway's, and the engine's scheduler and runner as one worker.
        deadline = time.monotonic() + 30
        while True:  # the engine refreshes its stats about once a second
            samples = scrape(f"http://127.0.0.1:{port}/metrics")
            if metric(samples, "pagedserve:request_decode_time_seconds_count") == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    assert resp.choices[0].token_ids == out[0, len(prompt):].tolist()
    assert streamed == resp.choices[0].text
    assert metric(samples, "pagedserve:time_to_first_token_seconds_count") == 2
    for phase in ("queue", "prefill", "decode"):
        assert metric(samples, f"pagedserve:request_{phase}_time_seconds_count", worker="in-process") == 2
    assert metric(samples, "pagedserve:step_duration_seconds_count", worker="in-process") > 0
    assert metric(samples, "pagedserve:step_gap_seconds_count", worker="in-process") > 0
