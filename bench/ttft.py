"""TTFT under light load: the full stack against a bare in-process prefill, in one run.

    python bench/ttft.py --model-dir models/small --num-requests 20 --input-mean 256

1. In process: ModelRunner.step on each prompt alone (the prefill that samples the first
   token; no scheduler, gateway, Redis or gRPC in the timing), median over the prompts.
2. The full stack (`pagedserve up` as compose.launcher.Stack starts it: redis-server,
   worker, scheduler, gateway), one request at a time with bench/serve.py (streaming, the
   same token-id prompts): median TTFT as the client sees it.
The ratio (2) / (1) is what the services add to a lone request's first token; the
issue's target is at most 1.2. Writes JSON with --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from compose.launcher import Stack, StackConfig, free_port  # noqa: E402
from proto.messages import NewRequest, SamplingParams  # noqa: E402
from scheduler_svc.batching import BatchScheduler  # noqa: E402
from scheduler_svc.config import SchedulerConfig  # noqa: E402
from worker_svc.config import RunnerConfig  # noqa: E402
from worker_svc.model_runner import ModelRunner  # noqa: E402

sys.path.append(str(ROOT / "bench"))  # after ROOT: bench/kernels.py must not shadow kernels/
import serve  # noqa: E402
from workloads import WorkloadSpec, make_workload  # noqa: E402


def in_process_prefill(model_dir: str, prompts: list[list[int]]) -> list[float]:
    """Seconds of the one ModelRunner.step that prefills each prompt and samples."""
    runner = ModelRunner(RunnerConfig(model=model_dir))
    info = runner.describe()
    times = []
    for i, prompt in enumerate([prompts[0], *prompts]):  # the first one warms up
        scheduler = BatchScheduler(SchedulerConfig(enable_prefix_caching=False),
                                   num_blocks=info.num_blocks, block_size=info.block_size,
                                   max_model_len=info.max_model_len, num_cpu_blocks=0)
        scheduler.add_request(NewRequest(f"p{i}", prompt, SamplingParams(max_tokens=1, temperature=0),
                                         "ttft", time.time()))
        step = scheduler.schedule()
        if sum(step.num_scheduled_tokens.values()) != len(prompt):
            raise SystemExit("a prompt does not fit one step's token budget: shorten --input-mean")
        start = time.perf_counter()
        runner.step(step)
        times.append(time.perf_counter() - start)
        runner.requests.clear()
    return times[1:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default="models/small")
    p.add_argument("--num-requests", type=int, default=20)
    p.add_argument("--input-mean", type=int, default=256)
    p.add_argument("--spread", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out")
    args = p.parse_args(argv)
    spec = WorkloadSpec(num_requests=args.num_requests, input_mean=args.input_mean, output_mean=2,
                        spread=args.spread, seed=args.seed)
    prompts = [ids for ids, _ in make_workload(spec, args.model_dir)]
    prefill = in_process_prefill(args.model_dir, prompts)

    port = free_port()
    with tempfile.TemporaryDirectory() as run_dir, \
            Stack(StackConfig(model=args.model_dir, port=port, run_dir=Path(run_dir))) as stack:
        common = ["--base-url", stack.base_url, "--model", stack.served_model_name,
                  "--tokenizer", args.model_dir, "--concurrency", "1", "--quiet"]
        asyncio.run(serve.run(serve.build_parser().parse_args(
            [*common, "--num-requests", "2", "--output-mean", "2"])))  # warm-up
        served = asyncio.run(serve.run(serve.build_parser().parse_args(
            [*common, "--num-requests", str(args.num_requests), "--input-mean", str(args.input_mean),
             "--output-mean", "2", "--spread", str(args.spread), "--seed", str(args.seed)])))
    if served["failed"]:
        raise SystemExit(f"{served['failed']} requests failed: {served['errors']}")
    result = {
        "num_requests": args.num_requests, "input_mean": args.input_mean,
        "in_process_prefill_ms": {"p50": statistics.median(prefill) * 1e3,
                                  "min": min(prefill) * 1e3, "max": max(prefill) * 1e3},
        "stack_ttft_ms": {k: v * 1e3 for k, v in served["ttft_s"].items()},
    }
    result["ratio_p50"] = result["stack_ttft_ms"]["p50"] / result["in_process_prefill_ms"]["p50"]
    print(f"{args.num_requests} prompts of ~{args.input_mean} tokens, one at a time: in-process "
          f"prefill p50 {result['in_process_prefill_ms']['p50']:.1f} ms; full stack TTFT p50 "
          f"{result['stack_ttft_ms']['p50']:.1f} ms -> {result['ratio_p50']:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
