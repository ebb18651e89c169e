"""TTFT under light load: the full stack against a bare in-process prefill, in one run.

    python bench/stack/ttft.py --model-dir models/small --num-requests 20 --input-mean 256

For each prompt in turn, interleaved so that both sides see the machine in the same state:
1. in this process, ModelRunner.step on the prompt alone (the prefill that samples the
   first token; no scheduler, gateway, Redis or gRPC in the timing);
2. the same prompt through the full stack (`pagedserve up` as compose.launcher.Stack starts
   it: redis-server, worker, scheduler, gateway), streamed by bench/stack/serve.py's client: TTFT
   as the client sees it.
The ratio of the medians, (2) / (1), is what the services add to a lone request's first
token; the issue's target is at most 1.2. Writes JSON with --out.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the repository root on sys.path, this folder off it (bench/README.md)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent)]

from bench.common.workloads import WorkloadSpec, make_workload  # noqa: E402
from bench.kv.kv_common import running_stack, write_json  # noqa: E402
from bench.stack import serve  # noqa: E402
from compose.launcher import Stack  # noqa: E402
from proto.messages import NewRequest, SamplingParams  # noqa: E402
from scheduler_svc.policy.batching import BatchScheduler  # noqa: E402
from scheduler_svc.policy.config import SchedulerConfig  # noqa: E402
from worker_svc.config import RunnerConfig  # noqa: E402
from worker_svc.model_runner import ModelRunner  # noqa: E402

SETTLE_S = 0.05  # between the two sides: the idle side's OpenMP threads stop spinning


class InProcessPrefill:
    """Seconds of the one ModelRunner.step that prefills a prompt alone and samples."""

    def __init__(self, model_dir: str):
        self.runner = ModelRunner(RunnerConfig(model=model_dir))
        self.info = self.runner.describe()
        self.count = 0

    def __call__(self, prompt: list[int]) -> float:
        info = self.info
        scheduler = BatchScheduler.for_worker(SchedulerConfig(enable_prefix_caching=False), info)
        self.count += 1
        scheduler.add_request(NewRequest(f"p{self.count}", prompt, SamplingParams(max_tokens=1, temperature=0),
                                         "ttft", time.time()))
        step = scheduler.schedule()
        if sum(step.num_scheduled_tokens.values()) != len(prompt):
            raise SystemExit("a prompt does not fit one step's token budget: shorten --input-mean")
        start = time.perf_counter()
        self.runner.step(step)
        seconds = time.perf_counter() - start
        self.runner.requests.clear()
        return seconds


async def interleaved(prefill: InProcessPrefill, stack: Stack, model_dir: str,
                      prompts: list[list[int]]) -> tuple[list[float], list[float]]:
    args = serve.build_parser().parse_args(["--model", stack.served_model_name, "--tokenizer", model_dir])
    in_process, served = [], []
    async with httpx.AsyncClient(base_url=stack.base_url + "/", timeout=600) as client:
        for i, prompt in enumerate(prompts):
            in_process.append(prefill(prompt))
            await asyncio.sleep(SETTLE_S)
            result = await serve.one(client, args, prompt, len(prompt), 2)
            if result.error is not None:
                raise SystemExit(f"request {i} failed: {result.error}")
            served.append(result.ttft_s)
            await asyncio.sleep(SETTLE_S)
    return in_process, served


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default="models/small")
    p.add_argument("--num-requests", type=int, default=20)
    p.add_argument("--input-mean", type=int, default=256)
    p.add_argument("--spread", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=2, help="pairs run first and not counted")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out")
    args = p.parse_args(argv)
    spec = WorkloadSpec(num_requests=args.warmup + args.num_requests, input_mean=args.input_mean,
                        output_mean=2, spread=args.spread, seed=args.seed)
    prompts = [ids for ids, _ in make_workload(spec, args.model_dir)]
    prefill = InProcessPrefill(args.model_dir)
    with tempfile.TemporaryDirectory() as run_dir, running_stack(args.model_dir, Path(run_dir)) as stack:
        in_process, served = asyncio.run(interleaved(prefill, stack, args.model_dir, prompts))
    in_process, served = in_process[args.warmup:], served[args.warmup:]
    result = {
        "num_requests": args.num_requests, "input_mean": args.input_mean,
        "in_process_prefill_ms": {k: v * 1e3 for k, v in serve.percentiles(in_process).items()},
        "stack_ttft_ms": {k: v * 1e3 for k, v in serve.percentiles(served).items()},
    }
    result["ratio_p50"] = result["stack_ttft_ms"]["p50"] / result["in_process_prefill_ms"]["p50"]
    print(f"{args.num_requests} prompts of ~{args.input_mean} tokens, one at a time: in-process "
          f"prefill p50 {result['in_process_prefill_ms']['p50']:.1f} ms; full stack TTFT p50 "
          f"{result['stack_ttft_ms']['p50']:.1f} ms -> {result['ratio_p50']:.2f}x")
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
