"""Backpressure under overload: a stream of requests at several times what the stack can
serve, against a local stack with a bounded waiting queue.

    python bench/stack/overload.py --model models/small --factor 3 --seconds 30

The stack: its own redis-server, one worker, a scheduler with `--max-num-seqs S` and
`--max-waiting-requests W`. First it measures capacity (requests per second with S
streams back to back), then sends requests open-loop at `factor` times that rate for
`--seconds`, each streamed, `ignore_eos`, `--max-tokens` long, no retries. It reports the
answers by status (200; 429 and whether each carried Retry-After; 503 with its code; any
other), timeouts, and the time to first token of the admitted ones (p50, p99, max).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the repository root on sys.path, this folder off it (bench/README.md)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent)]

from compose.launcher import Stack, StackConfig, free_port  # noqa: E402


async def one(client, model: str, max_tokens: int) -> tuple[str, float | None]:
    """(outcome, TTFT seconds of an admitted request)."""
    start = time.monotonic()
    try:
        stream = await client.completions.create(model=model, prompt="once upon a time", max_tokens=max_tokens,
                                                 temperature=0.8, stream=True, extra_body={"ignore_eos": True})
        ttft = None
        async for chunk in stream:
            if ttft is None and chunk.choices and chunk.choices[0].text:
                ttft = time.monotonic() - start
        return "200", ttft
    except openai.RateLimitError as exc:
        return ("429 with Retry-After" if exc.response.headers.get("retry-after") else "429 without Retry-After"), None
    except openai.APITimeoutError:
        return "timeout", None
    except openai.APIStatusError as exc:
        code = (exc.body or {}).get("code") if isinstance(exc.body, dict) else None
        return f"{exc.status_code} {code or ''}".strip(), None


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def measure(stack: Stack, args) -> None:
    model = stack.served_model_name
    async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0,
                                  timeout=args.timeout_s) as client:
        start = time.monotonic()
        done = await asyncio.gather(*(one(client, model, args.max_tokens) for _ in range(args.max_num_seqs * 2)))
        rate = len(done) / (time.monotonic() - start)
        target = rate * args.factor
        print(f"capacity about {rate:.2f} requests/s; sending {target:.2f}/s for {args.seconds:g} s")
        tasks = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < args.seconds:
            tasks.append(asyncio.create_task(one(client, model, args.max_tokens)))
            await asyncio.sleep(1.0 / target)
        results = await asyncio.gather(*tasks)
    counts = Counter(outcome for outcome, _ in results)
    ttfts = [t for outcome, t in results if outcome == "200" and t is not None]
    print(f"sent {len(results)}: " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    print(f"admitted TTFT p50 {quantile(ttfts, 0.5):.3f} s, p99 {quantile(ttfts, 0.99):.3f} s, "
          f"max {max(ttfts, default=float('nan')):.3f} s")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--factor", type=float, default=3.0, help="offered load, in multiples of capacity")
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--max-waiting-requests", type=int, default=4)
    p.add_argument("--timeout-s", type=float, default=120.0)
    args = p.parse_args(argv)
    config = StackConfig(model=args.model, port=free_port(), workers=1,
                         run_dir=Path(tempfile.mkdtemp(prefix="overload-")),
                         worker_args=("--threads", "1"),
                         scheduler_args=("--max-num-seqs", str(args.max_num_seqs),
                                         "--max-waiting-requests", str(args.max_waiting_requests)))
    with Stack(config) as stack:
        asyncio.run(measure(stack, args))


if __name__ == "__main__":
    main()
