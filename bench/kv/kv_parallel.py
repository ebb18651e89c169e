"""`n = 4` through the API: KV blocks with copy-on-write sharing vs four separate requests.

    python bench/kv/kv_parallel.py --model models/small --rounds 3 --prompt-len 1000 --max-tokens 512 \
        --out bench/results/kv-parallel.json

One prompt of --prompt-len random tokens, 4 samples of exactly --max-tokens tokens each
(temperature 1, seeded, ignore_eos), asked two ways against the same stack, alternately:
  n4        one request with n = 4: the prompt is computed once and its blocks shared
  separate  four concurrent requests with n = 1 (each computes its prompt; with prefix
            caching on they may share the full blocks one of them cached first)
Each round does both on a stack with prefix caching on, then on one with it off. The peak of
the worker's used blocks comes from the scheduler's WorkerStats, sampled about once a second
(so it may miss the last second's growth); beside it the exact peak the block arithmetic
gives: a sequence of final length L holds ceil((L - 1) / block_size) blocks, and with
sharing the prompt's floor((prompt - 1) / block_size) full blocks are held once.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the repository root on sys.path, this folder off it (bench/README.md)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent)]

from bench.kv.kv_common import StatsSampler, median, parser, registration, running_stack, write_json  # noqa: E402

N = 4


async def ask(stack, prompt: list[int], max_tokens: int, shared: bool) -> float:
    kwargs = dict(model=stack.served_model_name, prompt=prompt, max_tokens=max_tokens, temperature=1.0,
                  extra_body={"ignore_eos": True})
    async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0,
                                  timeout=3600) as client:
        start = time.perf_counter()
        if shared:
            response = await client.completions.create(n=N, seed=1, **kwargs)
            lengths = [response.usage.completion_tokens]
        else:
            responses = await asyncio.gather(*(client.completions.create(n=1, seed=1 + i, **kwargs)
                                               for i in range(N)))
            lengths = [r.usage.completion_tokens for r in responses]
        assert sum(lengths) == N * max_tokens, lengths
        return time.perf_counter() - start


def measure(stack, prompt: list[int], max_tokens: int, shared: bool) -> dict:
    with StatsSampler(stack) as sampler:
        before = sampler.wait_idle()
        seconds = asyncio.run(ask(stack, prompt, max_tokens, shared))
        after = sampler.wait_idle()
    return {"peak_used_blocks": max(s["num_used_blocks"] for s in sampler.samples), "seconds": seconds,
            "forks": after.num_forks - before.num_forks, "cow_copies": after.num_cow_copies - before.num_cow_copies,
            "prefix_hits_tokens": after.prefix_cache_hits - before.prefix_cache_hits}


def expected_peaks(prompt_len: int, max_tokens: int, block_size: int) -> dict:
    per_sequence = math.ceil((prompt_len + max_tokens - 1) / block_size)
    shared_prompt = (prompt_len - 1) // block_size
    return {"n4": shared_prompt + N * (per_sequence - shared_prompt), "separate_no_sharing": N * per_sequence}


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kv-parallel-") as tmp:
        for i in range(args.rounds):
            for caching in (True, False):
                off = () if caching else ("--no-prefix-caching",)
                with running_stack(args.model, Path(tmp) / f"round-{i}-{caching}", worker_args=tuple(args.worker_arg),
                                   scheduler_args=(*off, *args.scheduler_arg)) as stack:
                    block_size = registration(stack).block_size
                    for shared in (True, False):  # a fresh prompt each: nothing cached from before
                        prompt = [rng.randrange(300, 30000) for _ in range(args.prompt_len)]
                        row = {"round": i, "caching": caching, "way": "n4" if shared else "separate",
                               **measure(stack, prompt, args.max_tokens, shared)}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    summary = {f"{way} caching {'on' if caching else 'off'}": {
        k: median([r[k] for r in rows if r["way"] == way and r["caching"] == caching])
        for k in ("peak_used_blocks", "seconds", "forks", "cow_copies", "prefix_hits_tokens")}
        for caching in (True, False) for way in ("n4", "separate")}
    summary["expected_peak_blocks"] = expected_peaks(args.prompt_len, args.max_tokens, block_size)
    summary["separate_over_n4_caching_off"] = median([
        s["peak_used_blocks"] / n4["peak_used_blocks"]  # within each round's caching-off stack
        for n4, s in zip(rows[2::4], rows[3::4]) if n4["peak_used_blocks"]])  # (0: no sample caught it)
    print(json.dumps(summary, indent=1))
    write_json(args.out, {"median": summary, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
