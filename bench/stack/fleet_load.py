"""Closed-loop load with shared system prompts, until told to stop (bench/stack/fleet.py's load).

    python bench/stack/fleet_load.py --base-url http://127.0.0.1:8000/v1 --model sim --concurrency 64 \
        --prefixes 4 --prefix-tokens 512 --suffix-tokens 64 --output-tokens 128 --vocab-size 1536 --out load.json

`--concurrency` clients (started one after another over `--ramp-s`, so the schedulers'
waiting queues and the gateways' admission see no wall of arrivals at once) each send one
streamed completion after another, round-robin over the `--base-url`s: a prompt of token
ids, one of `--prefixes` shared system prompts (`--prefix-tokens` each, the same in every
process for a given `--seed`) then `--suffix-tokens` ids of its own, `--output-tokens`
tokens out exactly (ignore_eos, greedy). Requests go through bench/stack/serve.py's `one` (plain
HTTP, the SSE read as it arrives) on uvloop. SIGTERM or SIGINT stops it: requests in
flight are cancelled (the gateway aborts them) and not counted, and the JSON `--out`
lists the finished ones: [monotonic end time, output tokens] each, failures with their
error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import uvloop

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the repository root on sys.path, this folder off it (bench/README.md)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent)]

from bench.common.workloads import WorkloadSpec  # noqa: E402
from bench.stack.serve import one  # noqa: E402

TOKEN_LOW = WorkloadSpec.token_low  # prompt ids from [TOKEN_LOW, vocab): ordinary tokens


def system_prompts(count: int, tokens: int, vocab_size: int, seed: int) -> list[list[int]]:
    """The shared prefixes: the same for every process given the seed."""
    rng = random.Random(seed)
    return [[rng.randrange(TOKEN_LOW, vocab_size) for _ in range(tokens)] for _ in range(count)]


async def run(args: argparse.Namespace) -> dict:
    prefixes = system_prompts(args.prefixes, args.prefix_tokens, args.vocab_size, args.seed)
    rng = random.Random(f"{args.seed}/{args.process_index}")  # suffixes of its own in each process
    request_args = SimpleNamespace(model=args.model, ignore_eos=True, token_ids=True, api_key="unused")
    clients = [httpx.AsyncClient(base_url=url.rstrip("/") + "/", timeout=3600,
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
               for url in args.base_url]
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    done: list[list[float]] = []
    failed: list[list] = []
    sent = [0]

    async def client_loop(i: int) -> None:
        await asyncio.sleep(args.ramp_s * i / max(1, args.concurrency))
        while True:
            k = sent[0]
            sent[0] += 1
            prompt = prefixes[k % len(prefixes)] + [rng.randrange(TOKEN_LOW, args.vocab_size)
                                                    for _ in range(args.suffix_tokens)]
            result = await one(clients[i % len(clients)], request_args, prompt, len(prompt), args.output_tokens)
            if result.error is None:
                done.append([time.monotonic(), result.output_tokens])
            else:
                failed.append([time.monotonic(), result.error])

    tasks = [asyncio.create_task(client_loop(i)) for i in range(args.concurrency)]
    await stop.wait()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for client in clients:
        await client.aclose()
    return {"done": done, "failures": failed}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", action="append", required=True, help="a gateway's /v1 URL; repeat for several")
    p.add_argument("--model", required=True)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--prefixes", type=int, default=4, help="shared system prompts")
    p.add_argument("--prefix-tokens", type=int, default=512)
    p.add_argument("--suffix-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--vocab-size", type=int, required=True, help="the checkpoint's: prompt ids stay below it")
    p.add_argument("--ramp-s", type=float, default=1.0, help="clients start evenly over this long")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--process-index", type=int, default=0, help="this load process among several")
    p.add_argument("--out", required=True, help="the JSON written when stopped")
    return p


def main() -> None:
    args = build_parser().parse_args()
    result = uvloop.run(run(args))
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
