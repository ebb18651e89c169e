"""bench/stack/fleet.py, short: two simulated workers under the real scheduler and gateway, against
the one-worker baseline; and bench/stack/sim_worker.py's incremental bookkeeping, which must
answer every step exactly as tests/support/fake_worker.py's FakeWorker does and fail where it fails."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from proto import worker_pb2
from proto.messages import NewRequest, SamplingParams
from scheduler_svc.policy.batching import BatchScheduler
from scheduler_svc.policy.config import SchedulerConfig
from tests.support.fake_worker import FakeWorker
from tests.bench.test_bench_compare import bench_module

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sim_worker():
    return bench_module("stack.sim_worker")


def _request(i: int, prompt: list[int], max_tokens: int, n: int = 1) -> NewRequest:
    return NewRequest(request_id=f"r{i}", prompt_token_ids=prompt, reply_channel="c", arrival_time=time.time(),
                      sampling=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=i % 2 == 0), n=n)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_incremental_bookkeeping_answers_as_fake_worker(sim_worker, mode):
    """A small pool under shared prefixes, forks (n = 2) and preemptions: every step's result
    is FakeWorker's, byte for byte."""
    import random

    rng = random.Random(1)
    prefixes = [[rng.randrange(300, 1500) for _ in range(100)] for _ in range(3)]
    scheduler = BatchScheduler(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=32, preemption_mode=mode),
                               num_blocks=120, block_size=16, max_model_len=4096, num_cpu_blocks=200)
    reference = FakeWorker(120, 16, 256, vocab_size=1536, eos_token_id=0, num_cpu_blocks=200)
    incremental = sim_worker.IncrementalFakeWorker(120, 16, 256, vocab_size=1536, eos_token_id=0, num_cpu_blocks=200)
    added = 0
    for _ in range(600):
        queues = scheduler.queues
        while len(queues.waiting) + len(queues.running) + len(queues.swapped) < 24:
            added += 1
            prompt = prefixes[added % 3] + [rng.randrange(300, 1500) for _ in range(rng.randrange(1, 60))]
            scheduler.add_request(_request(added, prompt, rng.randrange(5, 80), n=2 if added % 7 == 0 else 1))
        step = scheduler.schedule()
        assert step is not None
        result = reference.step(step)
        assert incremental.step(step) == result, step.step_id
        scheduler.update(step, result)
    stats = scheduler.stats()
    assert stats.prefix_cache_hits > 0 and stats.num_cow_copies > 0
    assert stats.num_preemptions > 0 and (mode == "recompute" or stats.num_swapped_out > 0)


def test_incremental_bookkeeping_fails_where_fake_worker_fails(sim_worker):
    """A request sent as computed up to blocks that hold another prefix (a prefix hit gone
    wrong) fails the step in both."""
    workers = [FakeWorker(16, 4, 64, vocab_size=100), sim_worker.IncrementalFakeWorker(16, 4, 64, vocab_size=100)]
    sampling = worker_pb2.SamplingParams(max_tokens=4, ignore_eos=True)
    first = worker_pb2.StepRequest(step_id=1, num_scheduled_tokens={"a": 8}, new_requests=[worker_pb2.NewRequestData(
        request_id="a", token_ids=list(range(8)), num_prompt_tokens=8, block_ids=[1, 2], sampling=sampling)])
    wrong = worker_pb2.StepRequest(step_id=2, num_scheduled_tokens={"b": 1}, new_requests=[worker_pb2.NewRequestData(
        request_id="b", token_ids=[9, *range(1, 8)], num_prompt_tokens=8, block_ids=[1, 3], num_computed_tokens=7,
        sampling=sampling)], finished_request_ids=["a"])
    for worker in workers:
        worker.step(first)
        with pytest.raises(AssertionError, match="not its prefix's K/V"):
            worker.step(wrong)


@pytest.mark.e2e
def test_fleet_of_two_against_one(tiny_model_dir, redis_url, tmp_path):
    out = tmp_path / "fleet.json"
    proc = subprocess.run(
        [sys.executable, "bench/stack/fleet.py", "--workers", "2", "--schedulers", "1", "--step-ms", "20",
         "--duration", "5", "--warmup", "3", "--baseline-duration", "3", "--concurrency", "8",
         "--prefixes", "2", "--prefix-tokens", "256", "--suffix-tokens", "32", "--output-tokens", "48",
         "--model", str(tiny_model_dir), "--redis-url", redis_url, "--run-dir", str(tmp_path / "run"),
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["workers"] == 2 and r["schedulers"] == 1 and r["baseline"]["workers"] == 1
    assert r["steps"] > 0 and r["output_tokens_per_s"] > 0 and r["one_worker_tokens_per_s"] > 0
    # two workers serve more than one did alone (measured in its own run): the fleet scales
    assert 0.6 < r["ideal_fraction"] < 2.0, r["ideal_fraction"]
    assert r["output_tokens_per_s"] > 1.2 * r["one_worker_tokens_per_s"], r
    assert 0.0 < r["busy_fraction"] <= 1.0
    assert r["idle_gap_ms"]["count"] > 0 and r["idle_gap_ms"]["median"] >= 0
    # 256 of each 288-token prompt are shared: every admission after a prefix's first hits
    # its 16 blocks (the suffix's last, partial block never)
    assert 0.5 < r["prefix_hit_rate"] <= 256 / 288 + 1e-9, r["prefix_hit_rate"]
    assert r["scheduler_cpu_ms_per_step"] > 0 and r["cpu_s"]["scheduler"] > 0
    assert r["requests_completed"] > 0 and r["requests_failed"] == 0, r["request_errors"]
    assert r["num_step_errors"] == 0 and r["publish_errors"] == 0, r["step_errors"]
    # a step runs at most what the clients keep in flight (8), spread over the two workers
    assert 0 < r["mean_seqs_per_step"] <= 8, r["mean_seqs_per_step"]
