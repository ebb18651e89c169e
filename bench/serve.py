"""Serving benchmark against any OpenAI-compatible base URL.

    python bench/serve.py --base-url http://127.0.0.1:8000/v1 --model small \
        --num-requests 96 --concurrency 32 --input-mean 256 --output-mean 128

Requests carry prompts of random token ids (lengths drawn around --input-mean ± --spread)
and `ignore_eos` with a fixed max_tokens drawn around --output-mean, so every server
generates exactly the same number of tokens. Streams every request to measure, as vLLM's
serving benchmark defines them: TTFT, TPOT (per request, after the first token), ITL and
end-to-end latency; request and output token throughput. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import openai


@dataclass
class RequestResult:
    prompt_tokens: int
    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None


def make_workload(args) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)

    def around(mean: int) -> int:
        return max(1, int(rng.uniform(mean * (1 - args.spread), mean * (1 + args.spread))))

    low, high = args.token_range
    return [([rng.randrange(low, high) for _ in range(around(args.input_mean))], around(args.output_mean))
            for _ in range(args.num_requests)]


async def one(client: openai.AsyncOpenAI, model: str, prompt: list[int], max_tokens: int) -> RequestResult:
    result = RequestResult(prompt_tokens=len(prompt))
    start = last = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                if result.ttft_s == 0.0:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
            if chunk.usage is not None:
                result.output_tokens = chunk.usage.completion_tokens
    except Exception as exc:  # a failed request is reported, not fatal
        result.error = f"{type(exc).__name__}: {exc}"
    result.latency_s = time.perf_counter() - start
    return result


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"mean": statistics.fmean(ordered), "p50": statistics.median(ordered),
            "p90": pick(0.90), "p99": pick(0.99)}


async def run(args) -> dict:
    client = openai.AsyncOpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=3600)
    workload = make_workload(args)
    gate = asyncio.Semaphore(args.concurrency)
    done = 0

    async def gated(prompt, max_tokens):
        nonlocal done
        async with gate:
            r = await one(client, args.model, prompt, max_tokens)
        done += 1
        print(f"\r{done}/{len(workload)} requests", end="", file=sys.stderr, flush=True)
        return r

    start = time.perf_counter()
    results = await asyncio.gather(*(gated(p, m) for p, m in workload))
    duration = time.perf_counter() - start
    print(file=sys.stderr)
    ok = [r for r in results if r.error is None]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "base_url": args.base_url, "model": args.model, "num_requests": len(results),
        "failed": len(results) - len(ok), "errors": sorted({r.error for r in results if r.error})[:5],
        "concurrency": args.concurrency, "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / duration,
        "ttft_s": percentiles([r.ttft_s for r in ok]), "tpot_s": percentiles(tpot),
        "itl_s": percentiles([x for r in ok for x in r.itl_s]),
        "e2e_latency_s": percentiles([r.latency_s for r in ok]),
        "args": {k: v for k, v in vars(args).items() if k != "api_key"},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default="small")
    p.add_argument("--api-key", default="unused")
    p.add_argument("--num-requests", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--input-mean", type=int, default=256)
    p.add_argument("--output-mean", type=int, default=128)
    p.add_argument("--spread", type=float, default=0.5, help="lengths uniform in mean·(1±spread)")
    p.add_argument("--token-range", type=int, nargs=2, default=(300, 30000),
                   help="prompt token ids are drawn from [low, high)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the JSON result here")
    args = p.parse_args(argv)
    result = asyncio.run(run(args))
    print(f"{result['num_requests']} requests ({result['failed']} failed) in {result['duration_s']:.1f}s at "
          f"concurrency {args.concurrency}: {result['output_throughput']:.1f} output tok/s, "
          f"{result['request_throughput']:.2f} req/s")
    for name in ("ttft_s", "tpot_s", "itl_s", "e2e_latency_s"):
        row = result[name]
        if row:
            print(f"  {name:14s} " + "  ".join(f"{k} {v * 1000:8.1f}ms" for k, v in row.items()))
    if result["errors"]:
        print("  errors:", *result["errors"], sep="\n    ")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
