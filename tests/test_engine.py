"""The in-process engine (BatchScheduler + ModelRunner, no transport) against transformers."""

from __future__ import annotations

import random
import time

import torch
from transformers import AutoModelForCausalLM

from compose.engine import EngineConfig, InProcessEngine
from engine_helpers import Collector, serve_on_thread
from proto.messages import NewRequest, SamplingParams
from proto.metrics_scrape import metric, scrape
from scheduler_svc.policy.config import SchedulerConfig
from tests.stack_helpers import wait_until_answers
from worker_svc.config import RunnerConfig


def test_engine_greedy_equals_transformers_under_preemption(tiny_model_dir):
    rng = random.Random(1)
    cases = [([rng.randrange(3, 900) for _ in range(rng.randint(2, 90))], rng.randint(1, 30)) for _ in range(16)]
    sink = Collector(len(cases))
    engine = InProcessEngine(EngineConfig(
        runner=RunnerConfig(model=str(tiny_model_dir), num_blocks=24),
        batching=SchedulerConfig(max_num_batched_tokens=40)), sink)
    serve_on_thread(engine, sink, [
        NewRequest(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                   reply_channel="c", arrival_time=time.time())
        for i, (prompt, max_tokens) in enumerate(cases)])
    assert engine.scheduler.preemptor.num_preemptions >= 1
    engine.scheduler.check_integrity()
    assert engine.scheduler.kv.num_free_blocks == 24

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for i, (prompt, max_tokens) in enumerate(cases):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        expected = out[0, len(prompt):].tolist()
        got = [sink.tokens[f"r{i}"][k] for k in sorted(sink.tokens[f"r{i}"])]
        assert got == expected, f"request {i}"


def test_engine_seeded_sampling_is_the_same_with_and_without_preemption(tiny_model_dir):
    """Seeded draws depend on (seed, output position) only: requests recomputed after
    preemptions (a pool of 24 blocks) give the texts they give with no preemption."""
    rng = random.Random(2)
    cases = [([rng.randrange(3, 900) for _ in range(rng.randint(2, 30))], rng.randint(40, 80)) for _ in range(16)]

    def run(num_blocks: int) -> tuple[dict[str, list[int]], int]:
        sink = Collector(len(cases))
        engine = InProcessEngine(EngineConfig(
            runner=RunnerConfig(model=str(tiny_model_dir), num_blocks=num_blocks),
            batching=SchedulerConfig(max_num_batched_tokens=40)), sink)
        serve_on_thread(engine, sink, [
            NewRequest(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=100 + i,
                                                       ignore_eos=True),
                       reply_channel="c", arrival_time=time.time())
            for i, (prompt, max_tokens) in enumerate(cases)])
        texts = {rid: [t[k] for k in sorted(t)] for rid, t in sink.tokens.items()}
        return texts, engine.scheduler.preemptor.num_preemptions

    preempted, num_preemptions = run(24)
    calm, none = run(512)
    assert num_preemptions >= 1 and none == 0
    assert preempted == calm
    assert all(len(calm[f"r{i}"]) == max_tokens for i, (_, max_tokens) in enumerate(cases))


def test_engine_abort_frees_blocks(tiny_model_dir):
    sink = Collector(1)
    engine = InProcessEngine(EngineConfig(runner=RunnerConfig(model=str(tiny_model_dir), num_blocks=64)), sink)
    engine.start()
    try:
        engine.submit(NewRequest("long", [5, 6, 7], SamplingParams(max_tokens=500, ignore_eos=True, temperature=0.0),
                                 reply_channel="c", arrival_time=time.time()))
        deadline = time.monotonic() + 30
        while len(sink.tokens.get("long", {})) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        engine.abort("long")
        while engine.scheduler.has_work() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        engine.stop()
    assert not engine.scheduler.has_work()
    assert engine.scheduler.kv.num_free_blocks == 64
    assert len(sink.tokens["long"]) < 500


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
