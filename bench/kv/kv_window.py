"""KV blocks a long generation holds on a model whose every layer slides (Mistral), against
the same weights with full attention.

    python bench/kv/kv_window.py --model models/mistral-small --window 256 --tokens 1536 \
        --streams 4 --out bench/results/kv-window.json

Both runs start a fresh stack on a copy of the checkpoint: once with its window on every
layer (`--window` replaces the checkpoint's `sliding_window`, so a CPU run can show a
window well inside the generation), so the scheduler gives back the blocks wholly behind
it as each request advances; once with `sliding_window: null` (full attention: every block
is kept). `--streams` requests each generate `--tokens` tokens (ignore_eos) from a short
prompt, at once; the scheduler's WorkerStats are sampled meanwhile. Reports, for each run,
the blocks in use against the tokens the requests hold, and the peak.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the repository root on sys.path, this folder off it (bench/README.md)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent)]

from bench.kv.kv_common import StatsSampler, parser, registration, running_stack, write_json  # noqa: E402


async def _generate(base_url: str, model: str, streams: int, tokens: int) -> list[float]:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=3600) as client:
        async def one(i: int) -> float:
            start = time.monotonic()
            await client.completions.create(model=model, prompt=f"Stream {i}: def main():", max_tokens=tokens,
                                            temperature=0, extra_body={"ignore_eos": True})
            return time.monotonic() - start
        return await asyncio.gather(*(one(i) for i in range(streams)))


def measure(model_dir: Path, args, run_dir: Path) -> dict:
    with running_stack(str(model_dir), run_dir, worker_args=tuple(args.worker_arg),
                       scheduler_args=tuple(args.scheduler_arg)) as stack:
        reg = registration(stack)
        with StatsSampler(stack) as sampler:
            asyncio.run(_generate(stack.base_url, stack.served_model_name, args.streams, args.tokens))
            sampler.wait_idle()
    busy = [s for s in sampler.samples if s["num_running"]]
    return {"block_size": reg.block_size, "num_blocks": reg.num_blocks,
            "peak_used_blocks": max(s["num_used_blocks"] for s in busy),
            "samples": [{"t": s["updated_at"], "running": s["num_running"], "used_blocks": s["num_used_blocks"]}
                        for s in busy]}


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--tokens", type=int, default=1536, help="tokens each request generates")
    p.add_argument("--streams", type=int, default=4, help="requests generating at once")
    p.add_argument("--window", type=int, help="measure with this sliding_window instead of the checkpoint's")
    args = p.parse_args(argv)
    model = Path(args.model)
    cfg = json.loads((model / "config.json").read_text())
    window = args.window or cfg.get("sliding_window")
    if not window:
        p.error(f"{model} sets no sliding_window")
    with tempfile.TemporaryDirectory() as tmp:
        copies = {}
        for name, value in (("window", window), ("full", None)):  # same weights, two configs
            copies[name] = Path(tmp) / name
            shutil.copytree(model, copies[name])
            (copies[name] / "config.json").write_text(json.dumps({**cfg, "sliding_window": value}))
        runs = {name: measure(path, args, Path(tmp) / f"run-{name}") for name, path in copies.items()}
    bs = runs["window"]["block_size"]
    per_request_window = -(-window // bs) + 1
    print(f"{args.streams} requests x {args.tokens} tokens, window {window}, blocks of {bs}")
    print("| attention | peak blocks in use | per request | expected per request |")
    print("|---|---|---|---|")
    for name, run in runs.items():
        expected = per_request_window if name == "window" else -(-(args.tokens + 8) // bs)
        print(f"| {name} | {run['peak_used_blocks']} | {run['peak_used_blocks'] / args.streams:.1f} "
              f"| ~{expected} |")
    write_json(args.out, {"window": window, "tokens": args.tokens, "streams": args.streams, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
