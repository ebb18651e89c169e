"""Where the time goes in a serving run: every service sampled by py-spy while bench/stack/serve.py
drives the full stack.

    pip install py-spy     # (a profiler; not a dependency of pagedserve)
    python bench/stack/profile_stack.py --model-dir models/small -- --concurrency 32 \
        --num-requests 64 --input-mean 256 --output-mean 128

Starts the stack (compose.launcher.Stack: redis-server, worker, scheduler, gateway), attaches
`py-spy record` to each service (Python frames, 100 samples/s, active threads only), runs
bench/stack/serve.py with the arguments after `--`, and reports per service: CPU seconds used
during the run (from /proc), and the share of samples by "inclusive" function (a sample
counts for every function on its stack) for the functions given in CATEGORIES, plus the
top leaf functions. Raw collapsed stacks are kept in --out-dir for flame graphs.
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the repository root on sys.path, this folder off it (bench/README.md)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent)]

from bench.common.proc_cpu import cpu_seconds  # noqa: E402
from bench.stack import serve  # noqa: E402
from compose.launcher import Stack, StackConfig, free_port  # noqa: E402

# (label, substring of a py-spy frame "function (file:line)"), per service; a sample counts
# for a label when any frame of its stack contains the substring.
CATEGORIES = {
    "worker": [
        ("ModelRunner.step (all of a step)", "step (worker_svc/model_runner.py"),
        ("  model forward", "forward (modeling/decoder.py"),
        ("    linear layers (packed oneDNN)", "forward (modeling/layers.py"),
        ("    decode attention (C kernel)", "short_attention (kernels/cpu_attention.py"),
        ("    prefill attention (gather + SDPA)", "paged_attention (kernels/torch_attention.py"),
        ("  sampling", "_sample (worker_svc/model_runner.py"),
        ("  flat batch + attention plan", "prepare (worker_svc/input_batch.py"),
        ("publishing token events (Redis)", "publish"),
    ],
    "scheduler": [
        ("BatchScheduler.schedule", "schedule (scheduler_svc/policy/batching.py"),
        ("BatchScheduler.update", "update (scheduler_svc/policy/batching.py"),
        ("gRPC Step call", "grpc"),
        ("Redis (stream reads, stats)", "redis"),
    ],
    "gateway": [
        ("detokenizing", "detokenizer.py"),
        ("SSE / response building", "serving.py"),
        ("Redis pub/sub + event routing", "backend.py"),
        ("request preflight (tokenize, validate)", "preflight.py"),
        ("metrics", "metrics.py"),
    ],
}


def summarize(collapsed: Path, categories: list[tuple[str, str]], top: int) -> dict:
    total = 0
    inclusive: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        for label, needle in categories:
            if any(needle in f for f in frames):
                inclusive[label] += n
        leaves[frames[-1]] += n
    return {"samples": total,
            "categories": {label: inclusive[label] / total if total else 0.0 for label, _ in categories},
            "top_leaves": [(f, n / total) for f, n in leaves.most_common(top)] if total else []}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default="models/small")
    p.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--out-dir", default="bench/results/profile")
    args = p.parse_args(own)
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        raise SystemExit("py-spy is not installed: pip install py-spy")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as run_dir, \
            Stack(StackConfig(model=args.model_dir, port=free_port(), run_dir=Path(run_dir))) as stack:
        common = ["--base-url", stack.base_url, "--model", stack.served_model_name,
                  "--tokenizer", args.model_dir]
        serve.measure(serve.build_parser().parse_args(
            [*common, "--num-requests", "4", "--concurrency", "4", "--output-mean", "8", "--quiet"]))
        pids = {name: proc.pid for name, proc in stack.procs.items()
                if name.split("-")[0] in CATEGORIES}
        spies = {name: subprocess.Popen(
            [py_spy, "record", "--pid", str(pid), "--rate", str(args.rate), "--format", "raw",
             "--output", str(out_dir / f"{name}.collapsed"), "--nonblocking"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for name, pid in pids.items()}
        time.sleep(1.0)  # let py-spy attach
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        start = time.perf_counter()
        served = serve.measure(serve.build_parser().parse_args([*common, *serve_args]))
        wall = time.perf_counter() - start
        used = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
        for spy in spies.values():
            spy.send_signal(signal.SIGINT)
        for spy in spies.values():
            spy.wait(timeout=60)
    report = {"wall_s": wall, "output_throughput": served["output_throughput"], "services": {}}
    print(f"{served['num_requests']} requests, {wall:.1f} s, {served['output_throughput']:.0f} output tok/s")
    for name in pids:
        kind = name.split("-")[0]
        summary = summarize(out_dir / f"{name}.collapsed", CATEGORIES[kind], args.top)
        report["services"][name] = {"cpu_s": used[name], "cpu_share_of_wall": used[name] / wall, **summary}
        print(f"\n{name}: {used[name]:.1f} CPU s ({used[name] / wall:.2f} cores), {summary['samples']} samples")
        for label, share in summary["categories"].items():
            print(f"  {share * 100:5.1f}%  {label}")
        print("  top leaf frames:")
        for frame, share in summary["top_leaves"]:
            print(f"  {share * 100:5.1f}%    {frame}")
    (out_dir / "profile.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
