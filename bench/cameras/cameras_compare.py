"""The camera load (bench/cameras/cameras.py) against several servers in one run: the stack with the
encoder service and frames uploaded as they are captured, the stack with frames by uuid (the
workers encode), the stack with text prompts of the same length (the TTFT yardstick), and
`transformers serve` with every frame's data in every question (it has no uuids or files).

    .venv/bin/pip install -c constraints.txt -e '.[bench]'            # accelerate, for transformers serve
    python bench/cameras/cameras_compare.py --model-dir models/gemma3-vision-small --rounds 3 \
        --cameras 1 --fps 2 --ask-every 1 --frames 8 --duration 60 --json bench/results/cameras.json

Contenders (--contenders, in this order in each round; the order reversed every other round):
  encoder   `pagedserve up --encoders E` (--encoders, 1), cameras.py --upload
  uuid      `pagedserve up`, cameras.py (default uuid mode)
  text      `pagedserve up`, cameras.py --text-only
  hf-serve  `transformers serve --continuous-batching`, cameras.py --no-uuid, EOS on and no
            token ids (it has neither extension; answers may be shorter than --max-tokens)
With --pin, every thread of the worker runs on CPU 0 and every thread of the encoders on CPU
1 (each with --threads 1; the gateway, scheduler, Redis and this client where the kernel
puts them): the encoder on a core of its own, as on a machine with cores (or a GPU) to
spare for it; the uuid and text runs get the same worker pinning. Each starts fresh (its
own Redis, no cache from before) and stops before the next. The
stack's runs read every service's /metrics (gateway, worker, encoders) for the counters;
transformers serve has none. Prints a table of medians over the rounds and writes every
run to --json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import uuid
from pathlib import Path

import uvloop

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the repository root on sys.path, this folder off it (bench/README.md)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent)]

from bench.cameras import cameras  # noqa: E402
from bench.stack import compare  # noqa: E402  (transformers serve)
from compose.launcher import Stack, StackConfig, free_port  # noqa: E402

CONTENDERS = ("encoder", "uuid", "text", "hf-serve")
COLUMNS = (("ttft p50 ms", lambda r: 1000 * r["ttft_s"].get("p50", float("nan"))),
           ("ttft p99 ms", lambda r: 1000 * r["ttft_s"].get("p99", float("nan"))),
           ("answer p50 ms", lambda r: 1000 * r["latency_s"].get("p50", float("nan"))),
           ("sent", lambda r: r["questions_sent"]), ("skipped", lambda r: r["questions_skipped"]),
           ("failed", lambda r: r["questions_failed"]))


def bench_args(args, name: str, base_url: str, model: str, metrics: list[str]) -> argparse.Namespace:
    argv = ["--base-url", base_url, "--model", model, "--cameras", str(args.cameras), "--fps", str(args.fps),
            "--ask-every", str(args.ask_every), "--frames", str(args.frames), "--duration", str(args.duration),
            "--width", str(args.width), "--height", str(args.height), "--max-tokens", str(args.max_tokens)]
    argv += {"encoder": ["--upload"], "uuid": [], "text": ["--text-only"], "hf-serve": ["--no-uuid"]}[name]
    if metrics:
        argv += ["--metrics-url", *metrics]
    ns = cameras.build_parser().parse_args(argv)
    ns.ignore_eos = ns.token_ids = name != "hf-serve"  # what bench/stack/serve.py's `one` sends
    return ns


def run_stack(args, name: str, run_dir: Path) -> dict:
    encoders = args.encoders if name == "encoder" else 0
    config = StackConfig(model=str(Path(args.model_dir).resolve()), port=free_port(), run_dir=run_dir,
                         key_prefix=f"cams-{uuid.uuid4().hex[:8]}", encoders=encoders,
                         encoder_args=tuple(args.encoder_arg), worker_args=tuple(args.worker_arg),
                         scheduler_args=tuple(args.scheduler_arg), startup_timeout_s=600)
    with Stack(config) as stack:
        if args.pin:
            for service, proc in stack.procs.items():
                if service.startswith(("worker", "encoder")):
                    pin(proc.pid, {0} if service.startswith("worker") else {1})
        ns = bench_args(args, name, stack.base_url, stack.served_model_name, list(stack.metrics_urls.values()))
        return uvloop.run(cameras.run(ns))


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` onto `cpus`."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setaffinity(int(task.name), cpus)


def run_hf_serve(args, run_dir: Path) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    server = argparse.Namespace(model_dir=args.model_dir, device="cpu", dtype=args.dtype, quantization="none",
                                kv_cache_dtype="auto", threads=None, gpu_memory_utilization=None)
    proc, base_url, extra = compare.start_server("hf-serve", server, free_port(), run_dir / "hf-serve.log")
    try:
        ns = bench_args(args, "hf-serve", base_url, extra[extra.index("--model") + 1], [])
        ns.metrics_url = []
        return uvloop.run(cameras.run(ns))
    finally:
        compare.stop(proc)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=CONTENDERS)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--encoders", type=int, default=1)
    p.add_argument("--dtype", default="float32", help="transformers serve's (the stack's is --worker-arg)")
    for flag, default in (("--cameras", 1), ("--frames", 8)):
        p.add_argument(flag, type=int, default=default)
    for flag, default in (("--fps", 2.0), ("--ask-every", 1.0), ("--duration", 60.0)):
        p.add_argument(flag, type=float, default=default)
    p.add_argument("--width", type=int, default=640)
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--worker-arg", action="append", default=[])
    p.add_argument("--scheduler-arg", action="append", default=[])
    p.add_argument("--encoder-arg", action="append", default=[])
    p.add_argument("--pin", action="store_true", help="worker on CPU 0, encoders on CPU 1 (--threads 1 each)")
    p.add_argument("--run-dir", default="/tmp/cameras-compare")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.pin:
        args.worker_arg.append("--threads=1")
        args.encoder_arg.append("--threads=1")
    runs: dict[str, list[dict]] = {name: [] for name in args.contenders}
    for r in range(args.rounds):
        for name in (args.contenders if r % 2 == 0 else list(reversed(args.contenders))):
            run_dir = Path(args.run_dir) / f"r{r}-{name}"
            result = run_hf_serve(args, run_dir) if name == "hf-serve" else run_stack(args, name, run_dir)
            runs[name].append(result)
            print(f"round {r} {name}:\n{cameras.report(result)}", flush=True)
    print("| contender | " + " | ".join(c for c, _ in COLUMNS) + " | encoded by workers / encoders | exactly once |")
    print("|---|" + "---|" * (len(COLUMNS) + 2))
    for name, results in runs.items():
        cells = [f"{statistics.median(f(x) for x in results):.0f}" for _, f in COLUMNS]
        last = results[-1]
        encoded = f"{last['server'].get('encoded_by_workers')} / {last['server'].get('encoded_by_encoders')}"
        print(f"| {name} | " + " | ".join(cells) + f" | {encoded} | {last.get('encoded_once')} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=2))
    return 1 if any(x["questions_failed"] for rs in runs.values() for x in rs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
