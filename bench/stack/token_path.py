"""The serving path's price per streamed token: what each process of the stack spends on a
token besides the model.

    python bench/stack/token_path.py --concurrency 64 --max-tokens 256 --waves 3

Starts the stack as `make up` does (compose.launcher.Stack: redis-server, one worker with one
compute thread, the scheduler, the gateway under uvicorn) on a tiny llama (made in a
temporary folder unless --model-dir names one), whose forward costs next to nothing, so the
path around the model is what is measured. Each wave sends --concurrency streamed chat
completions at once, each `max_tokens` = --max-tokens with `ignore_eos`, and reads their
server-sent events; between waves it reads every process's CPU time from /proc
(bench/common/proc_cpu.py) and the worker's step histograms from its /metrics: each step's time on
the compute thread, and of it the model's forward and the sampler's pass (StepResult's
forward_seconds and sample_seconds; with one compute thread, wall time there is its CPU).

Reported per wave and as the median over waves: output tokens/s, and CPU microseconds per
streamed token of the gateway, the scheduler, redis-server, this client and the worker,
the worker's split three ways: `worker_forward` (the model's forward), `worker_sample` (the
sampler) and `worker_outside_forward` (everything else the worker process spends: the
step's host work -- message, batch layout, results, events -- gRPC and the publish to Redis,
sampling included: on a GPU the sampler runs on the device, here on the CPU); and per step:
the worker's host work (outside the forward and the sampler), the scheduler, the forward
and the sampler. The first wave after start warms up and is not counted (--waves counts the others).

`--smoke` (the test suite's) runs a small wave and checks the report's shape only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the repository root on sys.path, this folder off it (bench/README.md)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent)]

from bench.common.proc_cpu import cpu_by_process, cpu_used  # noqa: E402
from compose.launcher import Stack, StackConfig, free_port  # noqa: E402

# Process names as bench/common/proc_cpu.py gives them → the report's names.
SERVICES = {"gateway": "gateway", "worker": "worker", "scheduler": "scheduler",
            "redis-server": "redis", "token_path.py": "client"}
_STEP_SECONDS = "pagedserve:step_duration_seconds"
_FORWARD_SECONDS = "pagedserve:step_forward_seconds"
_SAMPLE_SECONDS = "pagedserve:step_sample_seconds"


@dataclass(frozen=True)
class Wave:
    requests: int
    tokens: int  # completion tokens, from the streams' usage
    seconds: float
    steps: int  # the worker's steps in the wave
    forward_seconds: float  # of their time on the compute thread: the model's forward
    sample_seconds: float  # and the sampler's pass
    cpu_s: dict[str, float]  # by SERVICES name

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    def us_per_token(self) -> dict[str, float]:
        per = {name: 1e6 * s / self.tokens for name, s in self.cpu_s.items()}
        worker = self.cpu_s.get("worker", 0.0)
        per["worker_forward"] = 1e6 * self.forward_seconds / self.tokens
        per["worker_sample"] = 1e6 * self.sample_seconds / self.tokens
        per["worker_outside_forward"] = 1e6 * (worker - self.forward_seconds) / self.tokens
        return per

    def us_per_step(self) -> dict[str, float]:
        steps = max(self.steps, 1)
        host = self.cpu_s.get("worker", 0.0) - self.forward_seconds - self.sample_seconds
        return {"worker_host": 1e6 * host / steps,
                "scheduler": 1e6 * self.cpu_s.get("scheduler", 0.0) / steps,
                "worker_forward": 1e6 * self.forward_seconds / steps,
                "worker_sample": 1e6 * self.sample_seconds / steps}


async def _chat(client: httpx.AsyncClient, model: str, max_tokens: int, i: int) -> int:
    """One streamed chat; its completion tokens (the usage chunk's). The client reads raw
    bytes and parses only the usage chunk at the end: its own CPU per token stays small."""
    body = {"model": model, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 1.0,
            "messages": [{"role": "user", "content": f"Describe frame {i} of the left camera."}]}
    tail = b""
    async with client.stream("POST", "/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for data in response.aiter_raw():
            tail = (tail + data)[-4096:]  # the usage chunk and [DONE] end the stream
    for event in reversed(tail.split(b"\n\n")):
        if event.startswith(b"data: {") and b'"usage":{' in event:
            return json.loads(event[6:])["usage"]["completion_tokens"]
    raise RuntimeError(f"a stream ended without its usage chunk: ...{tail[-300:]!r}")


async def _wave(base_url: str, model: str, concurrency: int, max_tokens: int) -> tuple[int, float]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        counts = await asyncio.gather(*(_chat(client, model, max_tokens, i) for i in range(concurrency)))
        return sum(counts), time.perf_counter() - start


def _step_counters(metrics_url: str) -> tuple[int, float, float]:
    """(steps, their forward seconds, their sampling seconds) so far, from the worker's /metrics."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    wanted = {_STEP_SECONDS + "_count": 0, _FORWARD_SECONDS + "_sum": 1, _SAMPLE_SECONDS + "_sum": 2}
    found = [0.0, 0.0, 0.0]
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                found[wanted[sample.name]] += sample.value
    return int(found[0]), found[1], found[2]


def measure_wave(stack: Stack, concurrency: int, max_tokens: int) -> Wave:
    worker_metrics = [url for name, url in stack.metrics_urls.items() if name.startswith("worker")]
    steps0 = [_step_counters(u) for u in worker_metrics]
    cpu0 = cpu_by_process(os.getpid())
    tokens, seconds = asyncio.run(_wave(stack.base_url, stack.served_model_name, concurrency, max_tokens))
    used = cpu_used(cpu0, cpu_by_process(os.getpid()))
    steps1 = [_step_counters(u) for u in worker_metrics]
    cpu_s: dict[str, float] = {}
    for process, seconds_used in used.items():
        name = SERVICES.get(process)
        if name is not None:
            cpu_s[name] = cpu_s.get(name, 0.0) + seconds_used
    return Wave(requests=concurrency, tokens=tokens, seconds=seconds,
                steps=sum(b[0] - a[0] for a, b in zip(steps0, steps1)),
                forward_seconds=sum(b[1] - a[1] for a, b in zip(steps0, steps1)),
                sample_seconds=sum(b[2] - a[2] for a, b in zip(steps0, steps1)), cpu_s=cpu_s)


def summarize(waves: list[Wave]) -> dict:
    def median(values):
        return round(statistics.median(values), 1)

    names = sorted({k for w in waves for k in w.us_per_token()})
    return {
        "waves": len(waves),
        "tokens_per_s": median([w.tokens_per_s for w in waves]),
        "us_per_token": {n: median([w.us_per_token().get(n, 0.0) for w in waves]) for n in names},
        "us_per_step": {n: median([w.us_per_step()[n] for w in waves]) for n in waves[0].us_per_step()},
        "tokens_per_step": median([w.tokens / max(w.steps, 1) for w in waves]),
        "per_wave": [dict(asdict(w), tokens_per_s=round(w.tokens_per_s, 1)) for w in waves],
    }


def run(model_dir: Path, concurrency: int, max_tokens: int, waves: int, run_dir: Path,
        worker_args: tuple[str, ...] = (), gateway_args: tuple[str, ...] = ()) -> dict:
    config = StackConfig(model=str(model_dir), port=free_port(), run_dir=run_dir,
                         worker_args=("--threads", "1", *worker_args),
                         gateway_args=gateway_args, startup_timeout_s=300)
    with Stack(config) as stack:
        measure_wave(stack, concurrency, min(max_tokens, 16))  # warm-up: connections, first steps
        measured = [measure_wave(stack, concurrency, max_tokens) for _ in range(waves)]
    return summarize(measured)


def _print(report: dict) -> None:
    print(f"output {report['tokens_per_s']:.0f} tok/s (median of {report['waves']} waves), "
          f"{report['tokens_per_step']:.1f} tokens per step")
    print("CPU µs per streamed token: " + ", ".join(f"{k} {v:.1f}" for k, v in report["us_per_token"].items()))
    print("CPU µs per step:           " + ", ".join(f"{k} {v:.1f}" for k, v in report["us_per_step"].items()))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, help="checkpoint to serve (default: a tiny llama made here)")
    p.add_argument("--concurrency", type=int, default=64, help="streamed chats per wave, all at once")
    p.add_argument("--max-tokens", type=int, default=256, help="completion tokens of each (ignore_eos)")
    p.add_argument("--waves", type=int, default=3, help="measured waves (after one warm-up wave)")
    p.add_argument("--worker-arg", action="append", default=[], help="extra worker flag (repeatable)")
    p.add_argument("--gateway-arg", action="append", default=[], help="extra gateway flag (repeatable)")
    p.add_argument("--smoke", action="store_true", help="a small run that checks the report's shape")
    p.add_argument("--out", type=Path, help="write the JSON report here")
    args = p.parse_args(argv)
    if args.smoke:
        args.concurrency, args.max_tokens, args.waves = 4, 8, 1
    with tempfile.TemporaryDirectory(prefix="token-path-") as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            from tools.make_model import make_model
            model_dir = make_model(Path(tmp) / "tiny", preset="tiny", seed=0)
        report = run(model_dir, args.concurrency, args.max_tokens, args.waves, Path(tmp) / "run",
                     tuple(args.worker_arg), tuple(args.gateway_arg))
    report["config"] = {"concurrency": args.concurrency, "max_tokens": args.max_tokens,
                        "cpus": os.cpu_count()}
    _print(report)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    if args.smoke:
        wave = report["per_wave"][0]
        assert wave["tokens"] == args.concurrency * args.max_tokens, wave
        # Every service's process is found and counted; the scheduler's few ms in a short wave
        # may read 0 at the clock's 10 ms tick, the gateway's and the worker's do not.
        assert {"gateway", "worker", "scheduler"} <= set(wave["cpu_s"]), wave
        assert wave["cpu_s"]["gateway"] > 0 and wave["cpu_s"]["worker"] > 0, wave
        assert wave["steps"] >= args.max_tokens, wave
        assert 0 < wave["forward_seconds"] < wave["cpu_s"]["worker"], wave
        assert 0 < wave["sample_seconds"] < wave["cpu_s"]["worker"], wave
    return report


if __name__ == "__main__":
    main()
