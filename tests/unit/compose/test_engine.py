"""The in-process engine (BatchScheduler + ModelRunner, no transport) against transformers.
`pagedserve engine` serving the OpenAI API as a process: tests/e2e/test_e2e_engine.py."""

from __future__ import annotations

import random
import time


from compose.engine import EngineConfig, InProcessEngine
from tests.support.engine_helpers import Collector, assert_greedy_matches_transformers, serve_on_thread
from proto.messages import NewRequest, SamplingParams
from scheduler_svc.policy.config import SchedulerConfig
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

    assert_greedy_matches_transformers(tiny_model_dir, cases, sink)


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
