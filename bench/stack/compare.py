"""One benchmark run of every contender, on the same checkpoint and the same prompts.

    python bench/stack/compare.py --model-dir models/small --runs 3 --concurrency 32 \
        --num-requests 96 --input-mean 256 --output-mean 128 --out-dir bench/results/small

Contenders, each started here, measured with bench/stack/serve.py (or bench/stack/static_generate.py
for the offline one), then stopped before the next starts — one at a time, so none steals
the other's cores:
  stack          the full pagedserve stack (`pagedserve up`: Redis, worker, scheduler, gateway)
  stack-async    the same with the scheduler's --async-scheduling on (on a CPU worker the
                 default is off: each step planned after the previous one's result)
  engine         the in-process engine behind the same gateway (`pagedserve engine`): no
                 Redis, no gRPC — what the service split costs is stack / engine
  hf-serve       `transformers serve --continuous-batching` (Hugging Face's own server)
  hf-static      `transformers` generate() with static padded batches, offline
`--hog-cpus 0` keeps a process spinning on core 0 while each contender serves
(bench/common/cpu_hog.py): a co-located load, as another tenant of a shared host.
Rounds interleave the contenders (A B C D, A B C D, …) so slow drifts of a shared machine
hit all of them alike. Writes every run's JSON, a summary JSON with medians, and prints a
Markdown table with ratios against the stack. For the stack and the engine it also reads the
server's /metrics before and after each measured run: the mean step on the worker
(`pagedserve:step_duration_seconds`) and the mean gap between two steps
(`pagedserve:step_gap_seconds`) — the two numbers that say where a difference between the
stack and the engine comes from. And for every server, the CPU seconds each of its
processes used during the measured run (bench/common/proc_cpu.py: worker, scheduler, gateway,
redis-server …), with the benchmark client's own.

`--dtype auto|float32|bfloat16` serves every contender in that dtype (`auto`: each its own
rule -- pagedserve the checkpoint's where the CPU computes it natively, transformers the
checkpoint's); `--quantization int8` quantizes the stack's and the engine's weights and
`--kv-cache-dtype bfloat16` keeps their KV cache in bf16 (Hugging Face's contenders run in
`--dtype`). Every table names the machine (CPU model and
the flags that decide the dtype paths: avx512_bf16, amx_bf16, amx_int8, VNNI ...). A
server that exits before or during its run fails the benchmark with the end of its log.

`--device cuda` runs every contender on a GPU (the stack's and the engine's workers,
`transformers serve --device`, static generate() with the model there).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the repository root on sys.path, this folder off it (bench/README.md)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent)]

from bench.common.cpu_hog import cpu_hogs  # noqa: E402
from bench.common.proc_cpu import cpu_by_process, cpu_used  # noqa: E402
from compose.launcher import free_port  # noqa: E402
from kernels.cpu_features import cpu_features  # noqa: E402
from proto.metrics_scrape import Samples, metric, scrape  # noqa: E402
CONTENDERS = ("stack", "engine", "hf-serve", "hf-static", "stack-async")
STEPS, GAPS = "pagedserve:step_duration_seconds", "pagedserve:step_gap_seconds"


class ServerDied(RuntimeError):
    """A contender's server exited: the message carries the end of its log."""


def log_tail(log: Path, chars: int = 4000) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def check_alive(proc: subprocess.Popen, name: str, log: Path) -> None:
    if proc.poll() is not None:
        raise ServerDied(f"{name} exited with status {proc.returncode}; the end of its log "
                         f"({log}):\n{log_tail(log)}")


def wait_http(url: str, proc: subprocess.Popen, name: str, log: Path, timeout: float = 600.0) -> None:
    """Until `url` answers; ServerDied as soon as the server exits, TimeoutError after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        check_alive(proc, name, log)
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url}: no answer in {timeout:.0f} s; the end of {name}'s log:\n{log_tail(log)}")


def run_client(cmd: list[str], proc: subprocess.Popen, name: str, log: Path, **kwargs) -> None:
    """Run a bench/stack/serve.py command against a live server; if the server exits first, stop
    the client and raise ServerDied (the client would otherwise wait on its requests)."""
    client = subprocess.Popen(cmd, **kwargs)
    try:
        while client.poll() is None:
            if proc.poll() is not None:
                client.kill()
                client.wait()
                check_alive(proc, name, log)
            time.sleep(0.2)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
    if client.returncode != 0:
        raise subprocess.CalledProcessError(client.returncode, cmd)


BENCH_EXTRAS = "pip install -c constraints.txt -e '.[bench]' (`make bench` does)"


def transformers_cli() -> str:
    """The `transformers` command of this Python's environment (a venv's bin/ need not be on
    PATH when its python is run by path), else the one on PATH."""
    search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    found = shutil.which("transformers", path=search)
    if found is None:
        raise SystemExit(f"hf-serve needs the `transformers` command: {BENCH_EXTRAS}")
    return found


def check_contenders(contenders: list[str]) -> None:
    """Fail before the first round, not in it, when a contender cannot start here."""
    if "hf-serve" in contenders:
        transformers_cli()
        if importlib.util.find_spec("accelerate") is None:  # `transformers serve` loads with a device_map
            raise SystemExit(f"hf-serve needs accelerate: {BENCH_EXTRAS}")


def start_server(name: str, args, port: int, log: Path) -> tuple[subprocess.Popen, str, list[str]]:
    """Returns (process, base_url, extra bench/stack/serve.py args)."""
    model = str(Path(args.model_dir).resolve())
    served = Path(model).name
    runner = ["--device", args.device, "--dtype", args.dtype,
              *(["--quantization", args.quantization] if args.quantization != "none" else []),
              *(["--kv-cache-dtype", args.kv_cache_dtype] if args.kv_cache_dtype != "auto" else []),
              *(["--threads", str(args.threads)] if args.threads else []),
              *(["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
                if args.gpu_memory_utilization else [])]
    if name in ("stack", "stack-async"):
        cmd = [sys.executable, "-m", "compose.cli", "up", "--model", model, "--port", str(port),
               "--run-dir", str(log.parent / f"run-{name}"),
               *(f"--worker-arg={a}" for a in runner)]  # one argv item each: --dtype, then its value
        if name == "stack-async":
            cmd.append("--scheduler-arg=--async-scheduling=on")
        extra = ["--model", served]
    elif name == "engine":
        cmd = [sys.executable, "-m", "compose.cli", "engine", "--model", model, "--port", str(port), *runner]
        extra = ["--model", served]
    elif name == "hf-serve":
        cmd = [transformers_cli(), "serve", "--continuous-batching", "--device", args.device, "--dtype", args.dtype,
               "--port", str(port), model]
        # It takes text only and has no ignore_eos: text prompts, EOS left on (a random model
        # rarely emits it; output throughput counts the tokens actually produced).
        extra = ["--model", model, "--prompt-mode", "text", "--no-ignore-eos", "--no-token-ids"]
    else:
        raise ValueError(name)
    env = {**os.environ}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    with open(log, "ab") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{base}/v1/models" if name != "hf-serve" else f"{base}/health", proc, name, log)
        if name.startswith("stack"):  # the gateway answers before it sees workers: wait for the model too
            deadline = time.monotonic() + 600
            while served.encode() not in urllib.request.urlopen(f"{base}/v1/models").read():
                check_alive(proc, name, log)  # `up` restarts a crashing worker: its log says so
                if time.monotonic() > deadline:
                    raise TimeoutError(f"stack never listed the model; the end of its log:\n{log_tail(log)}")
                time.sleep(0.5)
    except BaseException:
        stop(proc)
        raise
    return proc, f"{base}/v1", extra


def settled_samples(base: str, timeout_s: float = 15.0) -> Samples:
    """The server's /metrics once its step count stops moving: the stack's gateway shows
    the worker's steps as the scheduler last wrote them (about once a second)."""
    url = f"{base}/metrics"
    last = scrape(url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(1.2)
        now = scrape(url)
        if metric(now, f"{STEPS}_count") == metric(last, f"{STEPS}_count"):
            return now
        last = now
    return last


def step_split(before: Samples, after: Samples) -> dict:
    """Steps between two scrapes, their mean time on the worker and the mean gap between them."""
    def delta(name: str) -> float:
        return metric(after, name) - metric(before, name)

    steps, gaps = delta(f"{STEPS}_count"), delta(f"{GAPS}_count")
    return {"steps": int(steps),
            "step_mean_s": delta(f"{STEPS}_sum") / steps if steps else None,
            "gap_mean_s": delta(f"{GAPS}_sum") / gaps if gaps else None}


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM) if proc.pid else None
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def workload_args(args) -> list[str]:
    """The same requests for every contender: prompts are ids that survive decode → encode
    with the checkpoint's tokenizer, so text-only servers get the very same tokens."""
    return ["--tokenizer", args.model_dir, "--dataset", args.dataset, "--num-requests", str(args.num_requests),
            "--input-mean", str(args.input_mean), "--output-mean", str(args.output_mean),
            "--spread", str(args.spread), "--seed", str(args.seed)]


def run_one(name: str, args, round_no: int, out_dir: Path) -> dict:
    out = out_dir / f"{name}-{round_no}.json"
    log = out_dir / f"{name}.log"
    if name == "hf-static":
        cmd = [sys.executable, str(HERE / "static_generate.py"), "--model-dir", args.model_dir,
               "--batch-size", str(args.concurrency), *workload_args(args)[2:], "--out", str(out),
               "--device", args.device, "--dtype", args.dtype]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        with cpu_hogs(args.hog_cpus):
            subprocess.run(cmd, check=True)
    else:
        proc, base_url, extra = start_server(name, args, free_port(), log)
        try:
            with cpu_hogs(args.hog_cpus):  # from the warm-up on: the server adapts to it first
                measure_server(name, args, proc, base_url, extra, out, log)
        finally:
            stop(proc)
    return json.loads(out.read_text())


def measure_server(name: str, args, proc: subprocess.Popen, base_url: str, extra: list[str],
                   out: Path, log: Path) -> None:
    # A short warm-up (allocators, lazy imports, first compiles) that is not measured.
    run_client([sys.executable, str(HERE / "serve.py"), "--base-url", base_url, *extra,
                "--tokenizer", args.model_dir, "--num-requests", "4", "--concurrency", "4",
                "--output-mean", "8", "--quiet"], proc, name, log, stdout=subprocess.DEVNULL)
    server = base_url.removesuffix("/v1")
    before = settled_samples(server) if name != "hf-serve" else None
    cpu_before = cpu_by_process(proc.pid)
    run_client([sys.executable, str(HERE / "serve.py"), "--base-url", base_url, *extra,
                "--label", name, "--concurrency", str(args.concurrency), *workload_args(args),
                "--out", str(out)], proc, name, log)
    result = json.loads(out.read_text())
    result["server_cpu_s"] = cpu_used(cpu_before, cpu_by_process(proc.pid))
    if before is not None:
        result["server_steps"] = step_split(before, settled_samples(server))
    out.write_text(json.dumps(result, indent=2))


def cpu_medians(results: list[dict]) -> dict[str, float]:
    """Per process name, the median over runs of the CPU seconds it used in the measured run
    (the server's processes, then the benchmark client's, which shares the machine)."""
    names = sorted({proc for r in results for proc in r.get("server_cpu_s", {})},
                   key=lambda proc: -max(r.get("server_cpu_s", {}).get(proc, 0.0) for r in results))
    medians = {proc: statistics.median(r.get("server_cpu_s", {}).get(proc, 0.0) for r in results)
               for proc in names}
    clients = [r["client_cpu_s"] for r in results if "client_cpu_s" in r]
    if clients:
        medians["benchmark client"] = statistics.median(clients)
    return medians


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default="models/small")
    p.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=CONTENDERS)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--dataset", default="random")
    p.add_argument("--num-requests", type=int, default=96)
    p.add_argument("--input-mean", type=int, default=256)
    p.add_argument("--output-mean", type=int, default=128)
    p.add_argument("--spread", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch threads of every contender")
    p.add_argument("--device", default="cpu", help="cpu|cuda|cuda:N, for every contender")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="every contender's dtype (auto: each its own default)")
    p.add_argument("--quantization", default="none", choices=["none", "int8"],
                   help="the stack's and the engine's weights (pagedserve --quantization)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16"],
                   help="the stack's and the engine's KV cache (pagedserve --kv-cache-dtype)")
    p.add_argument("--gpu-memory-utilization", type=float,
                   help="on a GPU, the stack's and the engine's KV cache fills this share of the device")
    p.add_argument("--hog-cpus", type=int, nargs="*", default=[],
                   help="a process spinning on each of these cores while each contender serves "
                        "(bench/common/cpu_hog.py): a co-located load, as on a shared host")
    p.add_argument("--out-dir", default="bench/results/compare")
    args = p.parse_args(argv)
    check_contenders(args.contenders)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {c: [] for c in args.contenders}
    for round_no in range(args.runs):
        for name in args.contenders:
            print(f"== round {round_no + 1}/{args.runs}: {name}", file=sys.stderr, flush=True)
            runs[name].append(run_one(name, args, round_no, out_dir))
    machine = cpu_features().describe()
    summary = {"args": vars(args), "machine": machine, "contenders": {}}
    for name, results in runs.items():
        thr = [r["output_throughput"] for r in results]
        row = {"output_throughput_runs": thr, "output_throughput_median": statistics.median(thr)}
        for latency in ("ttft_s", "tpot_s", "e2e_latency_s"):
            vals = [r[latency]["p50"] for r in results if r.get(latency)]
            if vals:
                row[f"{latency}_p50_median"] = statistics.median(vals)
        for key in ("step_mean_s", "gap_mean_s"):
            vals = [r["server_steps"][key] for r in results if (r.get("server_steps") or {}).get(key)]
            if vals:
                row[f"{key}_median"] = statistics.median(vals)
        row["cpu_s_median"] = cpu_medians(results)
        summary["contenders"][name] = row
    base_runs = summary["contenders"].get("stack", {}).get("output_throughput_runs")
    for row in summary["contenders"].values():  # round by round: the same drift on both sides
        if base_runs:
            row["stack_over_this_runs"] = [b / x if x else None
                                           for b, x in zip(base_runs, row["output_throughput_runs"])]
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    base = summary["contenders"].get("stack", {}).get("output_throughput_median")
    quant = f", stack/engine weights {args.quantization}" if args.quantization != "none" else ""
    if args.kv_cache_dtype != "auto":
        quant += f", stack/engine KV cache {args.kv_cache_dtype}"
    print(f"\nmachine: {machine}; device {args.device}, dtype {args.dtype}{quant}")
    print(f"{args.dataset}, {args.num_requests} requests, concurrency {args.concurrency}, "
          f"input mean {args.input_mean}, output mean {args.output_mean}; medians of {args.runs} runs\n")
    print("| contender | output tok/s (median) | runs | stack ÷ this | per round | TTFT p50 | TPOT p50 "
          "| step / gap (mean) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, row in summary["contenders"].items():
        ratio = f"{base / row['output_throughput_median']:.2f}×" if base and row["output_throughput_median"] else "—"
        ttft = f"{row['ttft_s_p50_median'] * 1000:.0f} ms" if "ttft_s_p50_median" in row else "—"
        tpot = f"{row['tpot_s_p50_median'] * 1000:.0f} ms" if "tpot_s_p50_median" in row else "—"
        runs_txt = ", ".join(f"{x:.0f}" for x in row["output_throughput_runs"])
        rounds = ", ".join(f"{x:.2f}" for x in row.get("stack_over_this_runs", []) if x)
        split = (f"{row['step_mean_s_median'] * 1000:.1f} / {row['gap_mean_s_median'] * 1000:.2f} ms"
                 if "step_mean_s_median" in row and "gap_mean_s_median" in row else "—")
        print(f"| {name} | {row['output_throughput_median']:.1f} | {runs_txt} | {ratio} | {rounds or '—'} "
              f"| {ttft} | {tpot} | {split} |")
    print("\nCPU seconds used during the measured run (medians), by process:\n")
    for name, row in summary["contenders"].items():
        if row["cpu_s_median"]:
            print(f"- {name}: " + ", ".join(
                  f"{proc} {sec:.2f}" for proc, sec in row["cpu_s_median"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
