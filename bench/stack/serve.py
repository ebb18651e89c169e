"""Serving benchmark against any OpenAI-compatible base URL.

    python bench/stack/serve.py --base-url http://127.0.0.1:8000/v1 --model small \
        --dataset random --num-requests 96 --concurrency 32 --input-mean 256 --output-mean 128

Arrivals: a Poisson process at --request-rate requests/s (default: all at once), with at
most --concurrency in flight. Every request streams, so the client measures, as vLLM's
serving benchmark defines them: TTFT (first token), TPOT ((latency − TTFT) / (tokens − 1)
per request), ITL (every gap between streamed chunks), end-to-end latency; request, output
and total token throughput; goodput (requests/s meeting every --slo). Prompts go as token
ids by default; `--prompt-mode text` decodes them with --tokenizer first (for servers that
take only text). `--ignore-eos` makes output lengths exact on servers that support it.

`--images-per-request N` (N > 0) sends chat completions instead: each request a short text
and N synthetic camera frames (JPEG, --image-width x --image-height, every frame distinct,
bench/common/workloads.py's ImageSpec) as `image_url` parts with `data:` URLs, and --output-mean
as every request's max_tokens; the report adds images per second (bench/cameras/images.py).

The client is plain HTTP (httpx) reading the server-sent events itself, as vLLM's serving
benchmark does with aiohttp: the official `openai` client spends ~5 ms of CPU per request
before it sends anything and parses every chunk into pydantic models, which on a 2-core
machine is time taken from the server under test and added to every TTFT. For the same
reason it runs on uvloop.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import random
import statistics
import sys
import time
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import msgspec
import numpy
import uvloop
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the repository root on sys.path, this folder off it (bench/README.md)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent)]

from bench.common.workloads import (KINDS, ImageRequest, ImageSpec, WorkloadSpec,  # noqa: E402
                                    make_image_workload, make_workload)


@dataclass
class RequestResult:
    prompt_tokens: int
    max_tokens: int = 0
    started_at: float = 0.0  # time.time() when sent (to line up with server-side samples)
    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None


def image_messages(request: ImageRequest) -> list[dict]:
    """One user message: the text, then every frame as an `image_url` part with a data: URL."""
    parts = [{"type": "text", "text": request.text}]
    parts += [{"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(b).decode()}}
              for b in request.images]
    return [{"role": "user", "content": parts}]


async def one(client: httpx.AsyncClient, args, prompt, num_prompt_tokens: int, max_tokens: int) -> RequestResult:
    """One streamed request: a completion of `prompt` (ids or text), or a chat completion
    when `prompt` is messages (a list of dicts: --images-per-request, bench/cameras/cameras.py)."""
    result = RequestResult(prompt_tokens=num_prompt_tokens, max_tokens=max_tokens, started_at=time.time())
    chat = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)
    body = {"model": args.model, ("messages" if chat else "prompt"): prompt, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.token_ids:  # a chunk per token even before it makes visible text (vLLM's extension)
        body["return_token_ids"] = True
    start = last = time.perf_counter()
    try:
        path = "chat/completions" if chat else "completions"
        async with client.stream("POST", path, content=msgspec.json.encode(body),
                                 headers={"Authorization": f"Bearer {args.api_key}",
                                          "Content-Type": "application/json"}) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {response.status_code}: {text[:200]}")
            async for data in sse_data(response.aiter_bytes()):
                now = time.perf_counter()
                chunk = msgspec.json.decode(data)
                if chunk.get("error"):
                    raise RuntimeError(f"error event: {chunk['error']}")
                choice = chunk["choices"][0] if chunk.get("choices") else None
                if choice is not None and (choice.get("text") or choice.get("token_ids")
                                           or (choice.get("delta") or {}).get("content")):
                    if result.ttft_s == 0.0:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                    result.prompt_tokens = chunk["usage"].get("prompt_tokens") or num_prompt_tokens
        if result.ttft_s == 0.0:
            raise RuntimeError("the stream ended without a token")
        if result.output_tokens == 0:  # a server that sends no usage: count chunks
            result.output_tokens = len(result.itl_s) + 1
    except Exception as exc:  # a failed request is reported, not fatal
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    result.latency_s = time.perf_counter() - start
    return result


async def sse_data(pieces: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """The `data:` payloads of a server-sent event stream (its body as it arrives, in pieces
    of any size), each as soon as its event is complete, up to `[DONE]`; the rest of the
    body is read and dropped (so the connection goes back to the pool). Events end at a
    blank line (\n\n or \r\n\r\n)."""
    buffer = b""
    done = False
    async for piece in pieces:
        if done:
            continue
        buffer = (buffer + piece).replace(b"\r\n", b"\n")  # the leftover keeps a split \r
        *events, buffer = buffer.split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    yield data
            if done:
                break


def percentiles(values: list[float]) -> dict[str, float]:
    """Mean and p50/p90/p99, linearly interpolated (numpy's default, as vLLM reports them)."""
    if not values:
        return {}
    p50, p90, p99 = numpy.percentile(values, [50, 90, 99])
    return {"mean": statistics.fmean(values), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def parse_slos(items: list[str]) -> dict[str, float]:
    """['ttft:500', 'tpot:100'] → {'ttft_s': 0.5, 'tpot_s': 0.1} (milliseconds in)."""
    slos = {}
    for item in items:
        name, _, ms = item.partition(":")
        if name not in ("ttft", "tpot", "e2e_latency"):
            raise SystemExit(f"--slo {item!r}: the metric is one of ttft, tpot, e2e_latency")
        slos[f"{name}_s"] = float(ms) / 1000
    return slos


def meets(r: RequestResult, slos: dict[str, float]) -> bool:
    tpot = (r.latency_s - r.ttft_s) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
    values = {"ttft_s": r.ttft_s, "tpot_s": tpot, "e2e_latency_s": r.latency_s}
    return all(values[k] <= limit for k, limit in slos.items())


async def run(args) -> dict:
    if args.images_per_request > 0:  # chat requests with camera frames; prompt lengths come from usage
        image_requests = make_image_workload(ImageSpec(
            num_requests=args.num_requests, images_per_request=args.images_per_request, width=args.image_width,
            height=args.image_height, quality=args.image_quality, output_tokens=args.output_mean, seed=args.seed))
        workload = [([], r.max_tokens) for r in image_requests]
        prompts: list = [image_messages(r) for r in image_requests]
    else:
        spec = WorkloadSpec(kind=args.dataset, num_requests=args.num_requests, input_mean=args.input_mean,
                            output_mean=args.output_mean, spread=args.spread, max_model_len=args.max_model_len,
                            token_high=args.vocab_high, seed=args.seed)
        workload = make_workload(spec, args.tokenizer)
        prompts = [ids for ids, _ in workload]
    if args.prompt_mode == "text" and args.images_per_request == 0:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        prompts = [tokenizer.decode(ids) for ids in prompts]
    client = httpx.AsyncClient(base_url=args.base_url.rstrip("/") + "/", timeout=3600,
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
    gate = asyncio.Semaphore(args.concurrency)
    rng = random.Random(args.seed + 1)
    bar = tqdm(total=len(workload), desc="requests", unit="req", file=sys.stderr, disable=args.quiet)

    async def gated(prompt, ids, max_tokens):
        async with gate:
            r = await one(client, args, prompt, len(ids), max_tokens)
        bar.update(1)
        return r

    start, start_cpu = time.perf_counter(), time.process_time()
    tasks = []
    for prompt, (ids, max_tokens) in zip(prompts, workload):
        tasks.append(asyncio.create_task(gated(prompt, ids, max_tokens)))
        if args.request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(args.request_rate))
    try:
        results = await asyncio.gather(*tasks)
    finally:
        await client.aclose()
    duration, client_cpu = time.perf_counter() - start, time.process_time() - start_cpu
    bar.close()
    ok = [r for r in results if r.error is None]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    slos = parse_slos(args.slo)
    return {
        "label": args.label or args.base_url, "base_url": args.base_url, "model": args.model,
        "dataset": args.dataset, "num_requests": len(results), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "concurrency": args.concurrency, "request_rate": args.request_rate, "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / duration,
        "total_output_tokens": out_tokens,
        **({"images_per_request": args.images_per_request, "image_throughput": len(ok) * args.images_per_request
            / duration, "image_size": [args.image_width, args.image_height]} if args.images_per_request else {}),
        "client_cpu_s": client_cpu,  # this process's CPU over the run: it shares the machine
        "goodput": (sum(meets(r, slos) for r in ok) / duration) if slos else None, "slos": slos,
        "ttft_s": percentiles([r.ttft_s for r in ok]), "tpot_s": percentiles(tpot),
        "itl_s": percentiles([x for r in ok for x in r.itl_s]),
        "e2e_latency_s": percentiles([r.latency_s for r in ok]),
        "args": {k: v for k, v in vars(args).items() if k != "api_key"},
        **({"requests": [{k: v for k, v in asdict(r).items() if k != "itl_s"} for r in results]}
           if args.per_request else {}),
    }


def report(result: dict) -> str:
    lines = [f"{result['label']}: {result['num_requests']} requests ({result['failed']} failed), "
             f"{result['dataset']}, concurrency {result['concurrency']}, {result['duration_s']:.1f}s — "
             f"{result['output_throughput']:.1f} output tok/s, {result['total_token_throughput']:.1f} total tok/s, "
             f"{result['request_throughput']:.2f} req/s"
             + (f", {result['image_throughput']:.2f} images/s ({result['images_per_request']} a request)"
                if result.get("images_per_request") else "")
             + (f", goodput {result['goodput']:.2f} req/s" if result["goodput"] is not None else "")]
    for name in ("ttft_s", "tpot_s", "itl_s", "e2e_latency_s"):
        if result[name]:
            lines.append(f"  {name:14s} " + "  ".join(f"{k} {v * 1000:9.1f}ms" for k, v in result[name].items()))
    lines += [f"  error: {e}" for e in result["errors"]]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default="small", help="the `model` field sent")
    p.add_argument("--api-key", default="unused")
    p.add_argument("--label", help="name of this run in reports and plots")
    p.add_argument("--dataset", default="random", choices=KINDS)
    p.add_argument("--num-requests", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals, req/s")
    p.add_argument("--input-mean", type=int, default=256)
    p.add_argument("--output-mean", type=int, default=128)
    p.add_argument("--spread", type=float, default=0.5, help="lengths uniform in mean·(1±spread)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--vocab-high", type=int, default=30000, help="prompt ids are drawn below this")
    p.add_argument("--prompt-mode", choices=["ids", "text"], default="ids")
    p.add_argument("--tokenizer", help="checkpoint folder: prompts become ids that survive decode→encode, "
                                       "so text and id prompts are the same tokens (needed by --prompt-mode text)")
    p.add_argument("--token-ids", action=argparse.BooleanOptionalAction, default=True,
                   help="ask for return_token_ids, so TTFT is the first token, not the first visible text")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--slo", action="append", default=[], help="goodput SLO, e.g. ttft:500 or tpot:100 (ms)")
    p.add_argument("--images-per-request", type=int, default=0,
                   help="N > 0: chat completions, each a short text and N synthetic JPEG camera frames")
    p.add_argument("--image-width", type=int, default=640, help="of each frame (--images-per-request)")
    p.add_argument("--image-height", type=int, default=480, help="of each frame (--images-per-request)")
    p.add_argument("--image-quality", type=int, default=85, help="JPEG quality of each frame")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--per-request", action="store_true",
                   help="also list every request (lengths, send time, TTFT, latency) in the JSON")
    p.add_argument("--out", help="write the JSON result here")
    return p


def measure(args: argparse.Namespace) -> dict:
    """`run` on its own event loop: uvloop's, which spends less of the cores shared with
    the server under test on reading the streams than asyncio's (~10% less CPU here)."""
    return uvloop.run(run(args))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = measure(args)
    print(report(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
