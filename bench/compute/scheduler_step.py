"""Scheduler bookkeeping per step: BatchScheduler.schedule() + update() with no model.

    python bench/compute/scheduler_step.py                      # 256 running requests, caching on
    python bench/compute/scheduler_step.py --no-prefix-caching  # the same without prefix caching

Keeps `--running` requests in the system: each has a shared system prompt (`--shared`
tokens, so admissions hit the prefix cache) plus its own suffix, and a random output
length; a request that finishes is replaced by a new one at once, so steps mix decodes,
block-boundary crossings (allocation + hashing), finishes and admissions with prefill --
the steady state of a busy worker. The worker is a stand-in that samples a fixed token
for every request a step catches up (building its StepResult is not timed).

Prints the median, p90 and p99 of schedule() + update() per step, in milliseconds, over
`--steps` steps after `--warmup` steps.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the repository root on sys.path, this folder off it (bench/README.md)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent)]

from proto import worker_pb2  # noqa: E402
from proto.messages import NewRequest, SamplingParams  # noqa: E402
from scheduler_svc.policy.batching import BatchScheduler  # noqa: E402
from scheduler_svc.policy.config import SchedulerConfig  # noqa: E402


def stand_in_result(sched: BatchScheduler, step: worker_pb2.StepRequest) -> worker_pb2.StepResult:
    """What a worker would return: one token for each request the step caught up."""
    result = worker_pb2.StepResult(step_id=step.step_id)
    for rid in step.num_scheduled_tokens:
        req = sched.get_request(rid)
        if req is not None and req.num_computed_tokens == req.num_tokens:
            done = req.num_output_tokens + 1 >= req.sampling.max_tokens
            result.sampled.add(request_id=rid, token_id=7, finish_reason="length" if done else "")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--running", type=int, default=256, help="requests kept in the system")
    p.add_argument("--shared", type=int, default=256, help="tokens of the shared system prompt")
    p.add_argument("--suffix", type=int, default=64, help="mean tokens of each request's own suffix")
    p.add_argument("--output", type=int, default=256, help="mean output tokens")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=16384)
    p.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    config = SchedulerConfig(max_num_batched_tokens=args.budget, max_num_seqs=args.running,
                             enable_prefix_caching=not args.no_prefix_caching)
    sched = BatchScheduler(config, args.num_blocks, args.block_size, max_model_len=8192)
    rng = random.Random(args.seed)
    shared = [rng.randrange(1000, 30000) for _ in range(args.shared)]
    counter = 0

    def add_one() -> None:
        nonlocal counter
        suffix = [rng.randrange(1000, 30000) for _ in range(rng.randint(1, 2 * args.suffix))]
        params = SamplingParams(max_tokens=rng.randint(1, 2 * args.output), temperature=0.0,
                                ignore_eos=True)
        sched.add_request(NewRequest(f"r{counter}", shared + suffix, params, "out:bench", float(counter)))
        counter += 1

    for _ in range(args.running):
        add_one()
    times: list[float] = []
    running: list[int] = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        step = sched.schedule()
        t1 = time.perf_counter()
        result = stand_in_result(sched, step)
        t2 = time.perf_counter()
        finished = sched.update(step, result)
        t3 = time.perf_counter()
        if i >= args.warmup:
            times.append((t1 - t0) + (t3 - t2))
            running.append(len(step.num_scheduled_tokens))
        for _ in finished:
            add_one()
    sched.check_integrity()

    ms = sorted(t * 1e3 for t in times)
    q = statistics.quantiles(ms, n=100)
    stats = sched.stats()
    print(f"scheduler step (schedule + update), {len(ms)} steps, "
          f"{statistics.mean(running):.0f} requests/step on average (min {min(running)}), "
          f"prefix caching {'on' if config.enable_prefix_caching else 'off'}")
    print(f"  median {statistics.median(ms):.3f} ms   p90 {q[89]:.3f} ms   p99 {q[98]:.3f} ms")
    print(f"  prefix cache: {stats.prefix_cache_hits} of {stats.prefix_cache_queries} tokens hit; "
          f"{stats.num_evicted_blocks} cached blocks evicted; {stats.num_preemptions} preemptions; "
          f"KV waste {stats.kv_waste:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
