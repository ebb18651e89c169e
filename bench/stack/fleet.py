"""A simulated fleet of GPU workers driven by the real schedulers and gateways.

    python bench/stack/fleet.py --workers 64 --schedulers 1 --step-ms 30 --duration 30 --json fleet.json

Starts a redis-server (or uses `--redis-url`); N simulated workers (bench/stack/sim_worker.py: the
real worker's gRPC, registration and publishing, tests/support/fake_worker.py's bookkeeping, a sleep
of `step_ms + per_token_ms x tokens + per_seq_ms x sequences` for the model) over
`--sim-procs` processes; S real schedulers sharing `--shards` (default S) and G real gateways,
by compose/launcher.py's `Stack`; closed-loop clients (bench/stack/fleet_load.py: `--concurrency`
streams over the gateways, each prompt one of `--prefixes` shared system prompts and a
suffix of its own, `--output-tokens` out). The gateways serve a `tiny` checkpoint (made once
in the run folder, or `--model`); the workers sample ids of its vocabulary.

Measured over `--duration` seconds after `--warmup`:
* output_tokens_per_s: tokens the workers sampled in steps that ended in the window;
* ideal_fraction: that / (N x one worker's tokens/s), one worker's measured first, in the
  same invocation: one worker, scheduler and gateway at concurrency C/N, same workload,
  for `--baseline-duration` s;
* busy_fraction: the mean share of the window a worker spent inside a step; idle_gap_ms:
  gaps from a step's end to its worker's next step while requests were left to go on
  (median, p90; all workers' together);
* prefix_hit_rate: prompt tokens found in the prefix cache / looked up (the schedulers'
  WorkerStats in Redis, window end minus start);
* scheduler_cpu_ms_per_step: CPU (/proc) of all scheduler processes / steps the fleet ran,
  in the window; `cpu_s`: every kind of process's CPU seconds;
* overshoot_ms: steps past the model's time (a sim process short of CPU shows here first).

Sizing (a 2-core VM): a simulated step costs ~1.25 ms of CPU, the scheduler ~0.6-0.9 ms a
step, the gateway ~0.16 ms and the client ~0.125 ms a streamed token; the defaults of
--sim-procs and --load-procs follow, --gateways is yours. Every process is stopped on exit
(SIGTERM, then SIGKILL), Ctrl-C and errors included; logs in `--run-dir`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the repository root on sys.path, this folder off it (bench/README.md)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent)]

import redis  # noqa: E402

from compose.launcher import Stack, StackConfig, die_with_parent, free_port, redis_server_argv  # noqa: E402
from proto.keys import RedisKeys  # noqa: E402
from proto.messages import stats_decoder  # noqa: E402
from proto.registry import WorkerRegistry  # noqa: E402
from bench.common.proc_cpu import cpu_by_process, cpu_used  # noqa: E402
from bench.stack.sim_worker import RECORD_FIELDS, StepModel, worker_id  # noqa: E402

SERVED_NAME = "fleet-sim"
# Sizing the default processes at about half a core each, from a 2-core VM's costs: a
# simulated step's CPU (gRPC, bookkeeping, publishing), a client's tokens/s (~0.125 ms each).
SIM_CPU_MS = 1.25
CLIENT_TOKENS_PER_S = 4000


class Children:
    """Processes this run starts itself (Redis, the simulated workers, the load): each
    logs to <run dir>/<name>.log; stopped newest first, SIGTERM then SIGKILL."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir, self.procs = run_dir, {}

    def start(self, name: str, argv: list[str]) -> None:
        with open(self.run_dir / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                                preexec_fn=die_with_parent)  # none outlives a killed run

    def check(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                tail = (self.run_dir / f"{name}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{name} exited with {proc.returncode}; the end of its log:\n{tail}")

    def stop(self, prefix: str = "") -> None:
        names = [n for n in reversed(self.procs) if n.startswith(prefix)]
        for name in names:
            if self.procs[name].poll() is None:
                self.procs[name].send_signal(signal.SIGTERM)
        for name in names:
            proc = self.procs.pop(name)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def model_facts(model_dir: Path) -> tuple[int, int]:
    """(vocab size, first EOS id) of the checkpoint the gateways serve."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    eos = json.loads((model_dir / "generation_config.json").read_text()).get("eos_token_id", 0)
    return vocab, (eos[0] if isinstance(eos, list) else eos)


def start_redis(children: Children) -> str:
    port = free_port()
    children.start("redis", redis_server_argv(shutil.which("redis-server") or "redis-server", port, children.run_dir))
    url = f"redis://127.0.0.1:{port}/0"
    wait_until(lambda: redis.Redis.from_url(url).ping(), children, "redis-server to answer")
    return url


def wait_until(ready, children: Children, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        children.check()
        with contextlib.suppress(OSError, redis.RedisError):
            if ready():
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}; logs in {children.run_dir}")
        time.sleep(0.1)


def split(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]  # as even as can be


def snapshot(client: redis.Redis, keys: RedisKeys, worker_ids: list[str]) -> tuple[float, dict, dict]:
    """(now, WorkerStats by worker id, CPU seconds by process) at one moment."""
    values = client.mget([keys.worker_stats(w) for w in worker_ids])
    stats = {w: stats_decoder.decode(v) for w, v in zip(worker_ids, values) if v is not None}
    return time.monotonic(), stats, cpu_by_process(os.getpid())


def step_figures(workers: list[dict], t0: float, t1: float, model: StepModel) -> dict:
    """What the simulated workers' step records say about the window [t0, t1)."""
    steps = sampled = seqs = tokens = 0
    busy, gaps, overshoot, errors = [], [], [], []
    for w in workers:
        start, end, tok, seq, samp, pending = (w[f] for f in RECORD_FIELDS)
        inside = 0.0
        for i in range(len(start)):
            inside += max(0.0, min(end[i], t1) - max(start[i], t0))
            if t0 <= end[i] < t1:
                steps, sampled, seqs, tokens = steps + 1, sampled + samp[i], seqs + seq[i], tokens + tok[i]
                overshoot.append(end[i] - start[i] - model.seconds(tok[i], seq[i]))
            if i and pending[i - 1] and t0 <= start[i] < t1:
                gaps.append(start[i] - end[i - 1])
        busy.append(inside / (t1 - t0))
        errors += w["errors"]
    return {"steps": steps, "output_tokens": sampled, "busy_fraction": statistics.fmean(busy) if busy else 0.0,
            "idle_gap_ms": quantiles_ms(gaps), "overshoot_ms": quantiles_ms(overshoot),
            "mean_seqs_per_step": seqs / max(1, steps), "mean_tokens_per_step": tokens / max(1, steps),
            "step_errors": errors[:10], "num_step_errors": sum(w["num_errors"] for w in workers),
            "resets": sum(w["resets"] for w in workers), "publish_errors": sum(w["publish_errors"] for w in workers)}


def quantiles_ms(values: list[float]) -> dict:
    ordered = sorted(values)  # p90: the nearest rank below
    return {"median": 1000 * statistics.median(ordered) if ordered else None, "count": len(ordered),
            "p90": 1000 * ordered[int(0.9 * (len(ordered) - 1))] if ordered else None}


def start_sims(args, children: Children, redis_url: str, key_prefix: str, workers: int) -> int:
    """The simulated workers, spread over processes; how many processes."""
    vocab, eos = model_facts(Path(args.model))
    procs = args.sim_procs or min(os.cpu_count() or 1, math.ceil(workers * SIM_CPU_MS / (args.step_ms / 2)))
    procs = min(workers, procs)
    counts = split(workers, procs)
    for p, count in enumerate(counts):
        children.start(f"sim-{p}", [
            sys.executable, str(HERE / "sim_worker.py"), "--redis-url", redis_url, "--key-prefix", key_prefix,
            "--model", SERVED_NAME, "--count", str(count), "--first", str(sum(counts[:p])),
            "--vocab-size", str(vocab), "--eos-token-id", str(eos), "--num-blocks", str(args.num_blocks),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--step-ms", str(args.step_ms),
            "--per-token-ms", str(args.per_token_ms), "--per-seq-ms", str(args.per_seq_ms),
            "--records", str(children.run_dir / f"sim-{p}.json")])
    return procs


def start_load(args, children: Children, ports: list[int], concurrency: int) -> int:
    """The clients, spread over processes; how many processes."""
    urls = [a for port in ports for a in ("--base-url", f"http://127.0.0.1:{port}/v1")]
    vocab, _ = model_facts(Path(args.model))
    loads = args.load_procs or min(os.cpu_count() or 1,
                                   max(len(ports), math.ceil(concurrency * 1000 / args.step_ms / CLIENT_TOKENS_PER_S)))
    for i, c in enumerate(split(concurrency, loads)):
        children.start(f"load-{i}", [
            sys.executable, str(HERE / "fleet_load.py"), *urls, "--model", SERVED_NAME, "--concurrency", str(c),
            "--prefixes", str(args.prefixes), "--prefix-tokens", str(args.prefix_tokens),
            "--suffix-tokens", str(args.suffix_tokens), "--output-tokens", str(args.output_tokens),
            "--vocab-size", str(vocab), "--seed", str(args.seed),
            "--ramp-s", str(args.ramp_s), "--process-index", str(i),
            "--out", str(children.run_dir / f"load-{i}.json")])
    return loads


def run_stack(args, redis_url: str, key_prefix: str, workers: int, schedulers: int, shards: int, gateways: int,
              concurrency: int, duration: float) -> dict:
    """One fleet from start to stop; its figures over the window after the warm-up."""
    run_dir = Path(args.run_dir) / key_prefix
    run_dir.mkdir(parents=True, exist_ok=True)
    keys, children, stacks = RedisKeys(key_prefix), Children(run_dir), []
    client = redis.Redis.from_url(redis_url)
    scheduler_args = ["--max-num-batched-tokens", str(args.max_num_batched_tokens),
                      *(("--shards", str(shards)) if shards > 1 else ()), *args.scheduler_arg]
    gateway_args = ["--served-model-name", SERVED_NAME, "--log-level", "warning", *args.gateway_arg]
    worker_ids = [worker_id(i) for i in range(workers)]
    try:
        procs = start_sims(args, children, redis_url, key_prefix, workers)
        wait_until(lambda: len(WorkerRegistry(keys).read_blocking(client).live) >= workers, children, "the workers")
        ports = [free_port() for _ in range(gateways)]
        for g, port in enumerate(ports):
            stacks.append(Stack(StackConfig(
                model=args.model, port=port, workers=0, schedulers=0 if g else schedulers, redis_url=redis_url,
                key_prefix=key_prefix, run_dir=run_dir / f"stack-{g}", scheduler_args=tuple(scheduler_args),
                gateway_args=tuple(gateway_args), startup_timeout_s=180)))
            stacks[-1].start()
        loads = start_load(args, children, ports, concurrency)
        sleep_checking(args.warmup, children, stacks)
        t0, stats0, cpu0 = snapshot(client, keys, worker_ids)
        sleep_checking(duration, children, stacks)
        t1, stats1, cpu1 = snapshot(client, keys, worker_ids)
        children.stop("load-")
        loads_out = [json.loads((run_dir / f"load-{i}.json").read_text()) for i in range(loads)]
    finally:
        for stack in reversed(stacks):
            stack.stop()
        children.stop()
    sims = [w for p in range(procs) for w in json.loads((run_dir / f"sim-{p}.json").read_text())["workers"]]
    window, figures, cpu = t1 - t0, step_figures(sims, t0, t1, StepModel(args.step_ms, args.per_token_ms,
                                                                         args.per_seq_ms)), cpu_used(cpu0, cpu1)
    queries = sum(_delta(stats0, stats1, w, "prefix_cache_queries") for w in worker_ids)
    hits = sum(_delta(stats0, stats1, w, "prefix_cache_hits") for w in worker_ids)
    done = [d for load in loads_out for d in load["done"]]
    failures = [f for load in loads_out for f in load["failures"]]
    return {
        "workers": workers, "schedulers": schedulers, "shards": shards, "gateways": gateways,
        "concurrency": concurrency, "sim_procs": procs, "load_procs": loads, "window_s": window,
        "output_tokens_per_s": figures["output_tokens"] / window, **figures, "steps_per_s": figures["steps"] / window,
        "prefix_cache_queries": queries, "prefix_cache_hits": hits,
        "prefix_hit_rate": hits / queries if queries else None,
        "scheduler_cpu_ms_per_step": 1000 * cpu.get("scheduler", 0.0) / figures["steps"] if figures["steps"] else None,
        "cpu_s": {name: round(s, 3) for name, s in sorted(cpu.items())},
        "client_completed_tokens_per_s": sum(d[1] for d in done if t0 <= d[0] < t1) / window,
        "requests_completed": len(done), "requests_failed": len(failures),
        "request_errors": sorted({f[1] for f in failures})[:5],
    }


def _delta(before: dict, after: dict, worker_id: str, field: str) -> int:
    """A counter's growth over the window (a scheduler that took the worker on anew restarts it)."""
    end = getattr(after[worker_id], field) if worker_id in after else 0
    start = getattr(before[worker_id], field) if worker_id in before else 0
    return end - start if end >= start else end


def sleep_checking(seconds: float, children: Children, stacks: list[Stack]) -> None:
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        children.check()
        for stack, name, proc in [(s, n, p) for s in stacks for n, p in s.procs.items() if p.poll() is not None]:
            raise RuntimeError(f"{name} exited with {proc.returncode}; see {stack.config.run_dir / name}.log")
        time.sleep(min(0.5, left))


def run(args: argparse.Namespace) -> dict:
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        args.model = str(run_dir / "model")
        if not (Path(args.model) / "config.json").exists():
            from tools.make_model import make_model  # torch: only to make it once

            make_model(Path(args.model), preset="tiny", seed=0)
    children = Children(run_dir)
    try:
        redis_url = args.redis_url or start_redis(children)
        tag = f"{args.key_prefix}-{os.getpid()}"
        baseline = None
        if args.baseline_duration > 0:
            baseline = run_stack(args, redis_url, f"{tag}-base", 1, 1, 1, 1,
                                 max(1, round(args.concurrency / args.workers)), args.baseline_duration)
        fleet = run_stack(args, redis_url, f"{tag}-fleet", args.workers, args.schedulers,
                          args.shards or args.schedulers, args.gateways, args.concurrency, args.duration)
    finally:
        children.stop()
    one = baseline["output_tokens_per_s"] if baseline else args.one_worker_tokens_per_s
    ideal = one * args.workers if one else None
    return {
        **fleet, "ideal_tokens_per_s": ideal, "one_worker_tokens_per_s": one,
        "ideal_fraction": fleet["output_tokens_per_s"] / ideal if ideal else None,
        "step_model": {"step_ms": args.step_ms, "per_token_ms": args.per_token_ms, "per_seq_ms": args.per_seq_ms},
        "workload": {"prefixes": args.prefixes, "prefix_tokens": args.prefix_tokens,
                     "suffix_tokens": args.suffix_tokens, "output_tokens": args.output_tokens},
        "warmup_s": args.warmup, "baseline": baseline,
    }


def report(r: dict) -> str:
    def ms(q: dict) -> str:
        return "-" if q["median"] is None else f"{q['median']:.2f} / {q['p90']:.2f} ms"

    def num(value, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    return "\n".join([
        f"fleet: {r['workers']} simulated workers ({r['sim_procs']} processes), {r['schedulers']} scheduler(s), "
        f"{r['gateways']} gateway(s), concurrency {r['concurrency']}, step {r['step_model']['step_ms']} ms "
        f"+ {r['step_model']['per_token_ms']} ms/token + {r['step_model']['per_seq_ms']} ms/seq, "
        f"window {r['window_s']:.1f} s",
        f"  output {r['output_tokens_per_s']:.0f} tok/s (clients: {r['client_completed_tokens_per_s']:.0f}); "
        f"ideal {num(r['ideal_tokens_per_s'], '.0f')} (one worker {num(r['one_worker_tokens_per_s'], '.1f')}); "
        f"ideal_fraction {num(r['ideal_fraction'], '.3f')}",
        f"  busy_fraction {r['busy_fraction']:.3f}; idle gap median / p90 {ms(r['idle_gap_ms'])}; "
        f"{r['steps']} steps ({r['steps_per_s']:.0f}/s), {r['mean_seqs_per_step']:.1f} seqs "
        f"and {r['mean_tokens_per_step']:.1f} tokens a step; sim overshoot {ms(r['overshoot_ms'])}",
        f"  prefix_hit_rate {num(r['prefix_hit_rate'], '.3f')}; scheduler_cpu_ms_per_step "
        f"{num(r['scheduler_cpu_ms_per_step'], '.3f')}; CPU s {r['cpu_s']}",
        f"  requests: {r['requests_completed']} completed, {r['requests_failed']} failed {r['request_errors']}; "
        f"step errors {r['num_step_errors']} {r['step_errors'][:2]}"])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4, help="simulated workers (N)")
    p.add_argument("--schedulers", type=int, default=1, help="scheduler processes (S)")
    p.add_argument("--shards", type=int, help="scheduler shards (default: S)")
    p.add_argument("--gateways", type=int, default=1, help="gateway processes (G)")
    p.add_argument("--concurrency", type=int, help="requests in flight (default: 8 per worker)")
    for name in ("step_ms", "per_token_ms", "per_seq_ms"):  # the simulated step's time
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(StepModel, name))
    p.add_argument("--duration", type=float, default=30.0, help="seconds measured")
    p.add_argument("--warmup", type=float, help="seconds of load before the window (default: two requests' "
                                                "lives, output tokens x step, at least 5)")
    p.add_argument("--baseline-duration", type=float, default=10.0,
                   help="seconds measured of the one-worker baseline (0: none, no ideal)")
    p.add_argument("--one-worker-tokens-per-s", type=float,
                   help="with --baseline-duration 0: one worker's tokens/s from an earlier baseline run")
    p.add_argument("--prefixes", type=int, default=4, help="shared system prompts")
    for name, default in (("prefix-tokens", 512), ("suffix-tokens", 64), ("output-tokens", 128)):
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--ramp-s", type=float, help="clients start over this long (default: one request's life, "
                                                "output tokens x step, at most the warm-up)")
    p.add_argument("--num-blocks", type=int, default=2048, help="KV blocks of each simulated worker")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--sim-procs", type=int, help="processes hosting the workers (default: about half a core "
                                                  "of steps each, at most one per CPU)")
    p.add_argument("--load-procs", type=int, help="client processes (default: one per gateway, or more for "
                                                   "~4,000 tokens/s each, at most one per CPU)")
    p.add_argument("--model", help="checkpoint folder the gateways serve (default: a tiny one made in the run dir)")
    p.add_argument("--redis-url", help="use this Redis (default: start a redis-server)")
    p.add_argument("--key-prefix", default="fleet")
    p.add_argument("--run-dir", default=".run/fleet", help="logs, records, the tiny model")
    p.add_argument("--scheduler-arg", action="append", default=[], help="extra flag for every scheduler")
    p.add_argument("--gateway-arg", action="append", default=[], help="extra flag for every gateway")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the result here")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    args.concurrency = args.concurrency or 8 * args.workers
    life = args.output_tokens * args.step_ms / 1000  # a request's, about: its arrivals spread over one
    args.warmup = args.warmup if args.warmup is not None else max(5.0, 2 * life)
    args.ramp_s = min(args.warmup, life if args.ramp_s is None else args.ramp_s)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: every child is stopped
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C too, even started in the background
    result = run(args)
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
