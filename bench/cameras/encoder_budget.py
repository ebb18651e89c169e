"""What the scheduler's encoder budget buys running decodes when a burst of new images comes.

    python bench/cameras/encoder_budget.py --model models/gemma3-vision-small --budgets 0 2 --rounds 3 \
        --decoders 8 --decode-tokens 160 --burst 8 --frames 4 --json bench/results/encoder-budget.json

Each round starts the stack (`pagedserve up`: one worker, no encoder service) once per
`--budgets` value (the scheduler's `--encoder-budget`; 0 = no bound), the values' order
alternating between rounds. Against it: a warm-up request with an image, then --decoders
text completions streaming --decode-tokens tokens each (ignore_eos); once every one of
them has its first token, a burst of --burst chat requests at once, each with --frames new
synthetic JPEG camera frames (bench/common/workloads.py camera_frame, none seen before: the
worker must encode every one) and a short question, --image-tokens out. Measured: the
decoders' gaps between tokens while the burst is being taken in (from the burst's start
until the last image request's first token) -- their largest and p99 -- and the image
requests' TTFT (p50, max). Medians over the rounds, per budget.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the repository root on sys.path, this folder off it (bench/README.md)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent)]

from bench.common.workloads import camera_frame  # noqa: E402
from bench.kv.kv_common import running_stack  # noqa: E402
from bench.stack.serve import RequestResult, one  # noqa: E402


def frame_part(seed: int, width: int, height: int) -> dict:
    data = base64.b64encode(camera_frame(seed, width, height)).decode()
    return {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{data}"}}


async def measure_once(base_url: str, model: str, args, seed: int) -> dict:
    opts = argparse.Namespace(model=model, ignore_eos=True, token_ids=True, api_key="unused")
    async with httpx.AsyncClient(base_url=base_url, timeout=3600,
                                 limits=httpx.Limits(max_connections=args.decoders + args.burst + 4)) as client:
        warm = [{"role": "user", "content": [frame_part(seed * 1000 + 999, args.width, args.height),
                                              {"type": "text", "text": "What is this?"}]}]
        await one(client, opts, warm, 0, 2)
        prompt = "Describe, at length, everything a robot's camera could show on a factory floor:"
        firsts: list[asyncio.Event] = [asyncio.Event() for _ in range(args.decoders)]
        stamps: list[list[float]] = [[] for _ in range(args.decoders)]

        async def decode(i: int) -> None:
            body = {"model": model, "prompt": f"{prompt} ({i})", "max_tokens": args.decode_tokens,
                    "temperature": 0, "stream": True, "ignore_eos": True, "return_token_ids": True}
            async with client.stream("POST", "completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        stamps[i].append(time.perf_counter())
                        firsts[i].set()

        decoders = [asyncio.create_task(decode(i)) for i in range(args.decoders)]
        await asyncio.gather(*(e.wait() for e in firsts))
        burst_start = time.perf_counter()
        frames = [[frame_part(seed * 1000 + r * args.frames + f, args.width, args.height)
                   for f in range(args.frames)] for r in range(args.burst)]
        images: list[RequestResult] = await asyncio.gather(*(
            one(client, opts, [{"role": "user", "content": [*frames[r], {"type": "text", "text": "What moved?"}]}],
                0, args.image_tokens) for r in range(args.burst)))
        burst_end = burst_start + max(r.ttft_s for r in images)
        await asyncio.gather(*decoders)
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:]) if burst_start <= b and a <= burst_end]
    errors = [r.error for r in images if r.error]
    return {"decode_gap_max_s": max(gaps, default=0.0), "decode_gap_p99_s": _pctl(gaps, 0.99),
            "image_ttft_p50_s": statistics.median(r.ttft_s for r in images),
            "image_ttft_max_s": max(r.ttft_s for r in images), "burst_s": burst_end - burst_start,
            "errors": errors}


def _pctl(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--budgets", type=int, nargs="+", default=[0, 2])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--decoders", type=int, default=8)
    p.add_argument("--decode-tokens", type=int, default=160)
    p.add_argument("--burst", type=int, default=8)
    p.add_argument("--frames", type=int, default=4)
    p.add_argument("--image-tokens", type=int, default=4)
    p.add_argument("--width", type=int, default=640)
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--run-dir", default="/tmp/encoder-budget-runs")
    p.add_argument("--json")
    args = p.parse_args(argv)
    runs: dict[int, list[dict]] = {b: [] for b in args.budgets}
    for r in range(args.rounds):
        order = args.budgets if r % 2 == 0 else list(reversed(args.budgets))
        for budget in order:
            with running_stack(args.model, Path(args.run_dir) / f"r{r}-b{budget}",
                               scheduler_args=("--encoder-budget", str(budget))) as stack:
                run = asyncio.run(measure_once(stack.base_url, stack.served_model_name, args, seed=r + 1))
            runs[budget].append(run)
            print(f"round {r} budget {budget}: " + json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                                                                for k, v in run.items()}), flush=True)
    keys = [k for k in runs[args.budgets[0]][0] if k != "errors"]
    summary = {b: {k: statistics.median(x[k] for x in rs) for k in keys} for b, rs in runs.items()}
    print("| budget | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for b, s in summary.items():
        print(f"| {b or 'none'} | " + " | ".join(f"{s[k]:.3f}" for k in keys) + " |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs, "summary": summary}, indent=2))
    return 0 if not any(x["errors"] for rs in runs.values() for x in rs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
