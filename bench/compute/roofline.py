"""Model steps against this machine's roofline, measured in one run.

    python bench/compute/roofline.py --model-dir models/small                 # decode at batch 64
    python bench/compute/roofline.py --model-dir models/small --batch 32 --host-split   # the host's share
    python bench/compute/roofline.py --model-dir models/small --workload      # + the serving workload
    python bench/compute/roofline.py --model-dir models/1b --device cuda --batch 1 64 256 --count-kernels
    python bench/compute/roofline.py --model-dir models/1b --device cuda --enforce-eager   # without CUDA graphs

1. The machine: the matmul rate in the model's dtype (a large torch.matmul) and memory
   bandwidth, medians of several runs, same threads as the model. On the CPU the bandwidth
   is torch.sum's read rate over a buffer far larger than the caches; on a GPU it is a
   device-to-device copy's (read + write bytes over time), the bandwidth a decode step's
   utilisation is quoted against (`bandwidth_utilisation`: its bytes over its time, over
   that bandwidth).
2. Decode steps at each `--batch` requests (one runner for all), each with a
   `--context`-token context: the median step time of ModelRunner.step (scheduling not
   timed; on a GPU pure-decode steps replay CUDA graphs unless `--enforce-eager`) against
   its floor,
       floor = max(FLOPs / matmul rate, bytes / read bandwidth)
   FLOPs: 2 x (every linear weight) per token, lm_head only for the rows that sample,
   plus QK^T and PV over each query's context. Bytes: every linear weight once per step,
   the K/V each query reads, and the K/V written. Beside it, the phases' floor: the
   linear layers and attention each at that roofline, summed, since a layer runs them one
   after the other (the floor assumes the attention's reads overlap the matmuls).
3. With --workload: bench/stack/serve.py's default workload (same spec flags) run to completion
   through BatchScheduler + ModelRunner at `--concurrency` (a closed loop, as the serving
   benchmark drives it), every step's floor summed against the sum of step times.

Prints a table and writes JSON (--out). Run from the command line on the CPU, it starts
over with glibc's malloc set as `pagedserve worker` sets it (worker_svc/host_memory.py);
MALLOC_ARENA_MAX=8 in the environment keeps glibc's own settings instead.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the repository root on sys.path, this folder off it (bench/README.md)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent)]

import torch  # noqa: E402

from kvstore.cache_tensors import KV_CACHE_DTYPES  # noqa: E402
from proto import worker_pb2  # noqa: E402
from proto.messages import NewRequest, SamplingParams  # noqa: E402
from scheduler_svc.policy.batching import BatchScheduler  # noqa: E402
from scheduler_svc.policy.config import SchedulerConfig  # noqa: E402
from worker_svc.config import RunnerConfig  # noqa: E402
from worker_svc.host_memory import run_with_malloc_tunables  # noqa: E402
from modeling.config import DecoderConfig  # noqa: E402
from modeling.registry import load_config  # noqa: E402
from modeling.loader import resolve_dtype  # noqa: E402
from worker_svc.model_runner import ModelRunner  # noqa: E402
from bench.common.workloads import KINDS, WorkloadSpec, make_workload  # noqa: E402
from bench.compute.kernel_count import count_kernels  # noqa: E402


def _median_time(fn, runs: int, device: torch.device) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()  # warm up
    times = []
    for _ in range(runs):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_rate(n: int = 2048, runs: int = 10, device: torch.device = torch.device("cpu"),
                dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of an n x n x n torch.matmul."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    return 2 * n**3 / _median_time(lambda: a @ b, runs, device)


def read_bandwidth(mib: int = 512, runs: int = 10) -> float:
    """Bytes/s torch.sum reads from a buffer of `mib` MiB (much larger than any cache)."""
    x = torch.ones(mib * 2**20 // 4)
    return x.numel() * 4 / _median_time(lambda: x.sum(), runs, x.device)


def copy_bandwidth(device: torch.device, mib: int = 2048, runs: int = 10) -> float:
    """Bytes/s of a device-to-device copy of `mib` MiB, counting the read and the write."""
    src = torch.empty(mib * 2**20 // 2, dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / _median_time(lambda: dst.copy_(src), runs, device)


def machine_limits(device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """(matmul FLOP/s in `dtype`, memory bytes/s) of the device the model runs on."""
    if device.type == "cpu":
        return matmul_rate(dtype=dtype), read_bandwidth()
    return matmul_rate(8192, device=device, dtype=dtype), copy_bandwidth(device)


@dataclass(frozen=True)
class Cost:
    flops: float
    bytes: float

    def seconds(self, rate: float, bandwidth: float) -> float:
        """The larger of the FLOPs over `rate` and the bytes over `bandwidth`."""
        return max(self.flops / rate, self.bytes / bandwidth)


@dataclass(frozen=True)
class StepCost:
    """A step's cost in its two phases: the linear layers (every weight read once, 2 FLOPs
    a weight per token) and attention (the K/V read and written, QK^T and PV)."""
    linears: Cost
    attention: Cost

    @property
    def flops(self) -> float:
        return self.linears.flops + self.attention.flops

    @property
    def bytes(self) -> float:
        return self.linears.bytes + self.attention.bytes

    def floor(self, rate: float, bandwidth: float) -> float:
        """The roofline: the step's FLOPs and bytes as if compute and reads overlapped."""
        return Cost(self.flops, self.bytes).seconds(rate, bandwidth)

    def phases_floor(self, rate: float, bandwidth: float) -> float:
        """Each phase at its own roofline, one after the other, as a layer runs them (its
        attention needs its QKV projection, its output projection needs the attention)."""
        return self.linears.seconds(rate, bandwidth) + self.attention.seconds(rate, bandwidth)


def step_cost(cfg: DecoderConfig, elem: int, work: list[tuple[int, int, bool]],
              layer_elem: int | None = None, kv_elem: int | None = None) -> StepCost:
    """FLOPs and bytes of one step; `work` = (tokens computed before, tokens now, samples?)
    per request; `layer_elem`: bytes per weight of the layers' linears when they differ
    from `elem` (1 with int8 weights; the LM head keeps `elem`); `kv_elem`: bytes per K/V
    element when the cache's dtype differs from `elem` (--kv-cache-dtype)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer_params = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size \
        + 3 * cfg.hidden_size * cfg.intermediate_size
    head_params = cfg.hidden_size * cfg.vocab_size
    tokens = sum(n for _, n, _ in work)
    samples = sum(1 for *_, s in work if s)
    # query at position p attends p + 1 keys; a request's rows cover positions c .. c+n-1
    attended = sum(n * c + n * (n + 1) // 2 for c, n, _ in work)
    linear_flops = 2 * layer_params * tokens * cfg.num_layers + 2 * head_params * samples
    attention_flops = 4 * cfg.num_heads * cfg.head_dim * attended * cfg.num_layers
    kv_read = sum(c + n for c, n, _ in work) * 2 * kv * (kv_elem or elem) * cfg.num_layers
    kv_written = tokens * 2 * kv * (kv_elem or elem) * cfg.num_layers
    weights = layer_params * cfg.num_layers * (layer_elem or elem) + head_params * elem
    return StepCost(Cost(linear_flops, weights), Cost(attention_flops, kv_read + kv_written))


def make_runner(args) -> ModelRunner:
    return ModelRunner(RunnerConfig(model=args.model_dir, threads=args.threads,
                                    kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30),
                                    block_size=args.block_size, attention_backend=args.attention_backend,
                                    device=args.device, dtype=args.dtype, quantization=args.quantization,
                                    kv_cache_dtype=args.kv_cache_dtype, enforce_eager=args.enforce_eager))


class Driver:
    """BatchScheduler + ModelRunner in this thread; times ModelRunner.step only. `runner`:
    one to reuse (it must hold no requests), else a new one."""

    def __init__(self, args, runner: ModelRunner | None = None):
        self.runner = runner or make_runner(args)
        info = self.runner.describe()
        self.scheduler = BatchScheduler.for_worker(
            SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens), info)
        self.cfg = self.runner.model_config
        self.elem = torch.empty((), dtype=self.runner.dtype).element_size()
        self.layer_elem = 1 if args.quantization == "int8" else None
        self.kv_elem = self.runner.kv_cache.k_caches[0].element_size()
        self.count = 0
        self.temperature = args.temperature
        self.work: list[tuple[int, int, bool]] = []  # the last step's

    def add(self, prompt: list[int], max_tokens: int) -> None:
        self.count += 1
        error = self.scheduler.add_request(NewRequest(
            f"r{self.count}", prompt, SamplingParams(max_tokens=max_tokens, temperature=self.temperature,
                                                     seed=self.count if self.temperature else None,
                                                     ignore_eos=True),
            "roofline", time.time()))
        if error is not None:
            raise SystemExit(f"request rejected: {error.error}")

    def step(self) -> tuple[worker_pb2.StepRequest, worker_pb2.StepResult, float, StepCost] | None:
        step = self.scheduler.schedule()
        if step is None:
            return None
        work = []
        for rid, n in step.num_scheduled_tokens.items():
            req = self.scheduler.get_request(rid)  # schedule() already counted the n tokens
            work.append((req.num_computed_tokens - n, n, req.num_computed_tokens == req.num_tokens))
        self.work = work  # (tokens cached, tokens computed, samples) per request: cost() of a part
        start = time.perf_counter()
        output = self.runner.step(step)
        elapsed = time.perf_counter() - start
        self.scheduler.update(step, output.result)
        return step, output.result, elapsed, self.cost(work)

    def cost(self, work: list[tuple[int, int, bool]]) -> StepCost:
        return step_cost(self.cfg, self.elem, work, self.layer_elem, self.kv_elem)


    def pipelined(self, steps: int) -> float:
        """Median seconds per step over `steps` decode steps, each launched before the one
        before finishes (as the worker service does on an accelerator: ModelRunner.launch /
        finish), the scheduler planning one step ahead."""
        step = self.scheduler.schedule()
        launched = self.runner.launch(step)
        times, last = [], time.perf_counter()
        for _ in range(steps):
            ahead = self.scheduler.schedule()  # planned before the update of the one in flight
            ahead_launched = self.runner.launch(ahead)
            self.scheduler.update(step, self.runner.finish(launched).result)
            now = time.perf_counter()
            times.append(now - last)
            step, launched, last = ahead, ahead_launched, now
        self.scheduler.update(step, self.runner.finish(launched).result)
        return statistics.median(times)


def decode_roofline(args, rate: float, bandwidth: float, batch: int, runner: ModelRunner) -> dict:
    driver = Driver(args, runner)
    split = args.host_split and runner.device.type == "cpu"  # (on a GPU the forward's time is its launch)
    gen = torch.Generator().manual_seed(0)
    for _ in range(batch):
        driver.add(torch.randint(300, driver.cfg.vocab_size - 1, (args.context,), generator=gen).tolist(),
                   max_tokens=driver.runner.max_model_len - args.context)
    while True:  # prefill everything; the first all-decode step starts the measurement
        step, *_ = driver.step()
        if len(step.num_scheduled_tokens) == batch and set(step.num_scheduled_tokens.values()) == {1}:
            break
    for _ in range(args.warmup):
        driver.step()
    times, costs, forwards, samplings = [], [], [], []
    for _ in range(args.steps):
        _, result, elapsed, cost = driver.step()
        times.append(elapsed)
        costs.append(cost)
        if split:  # the step's own timing of its forward and sampler (StepResult)
            forwards.append(result.forward_seconds)
            samplings.append(result.sample_seconds)
    extra = {}
    if forwards:
        extra.update(forward_ms=statistics.median(forwards) * 1e3, sampling_ms=statistics.median(samplings) * 1e3,
                     host_ms=statistics.median(t - f - s for t, f, s in zip(times, forwards, samplings)) * 1e3)
    pipelined_s = driver.pipelined(args.steps)
    if args.count_kernels:
        extra["kernels"] = count_kernels(driver.runner.device, driver.step)
    graphs = runner.graphs
    extra["cuda_graphs"] = bool(graphs is not None and graphs.size_for(batch) is not None)
    runner.forget_all()  # the next batch starts on an empty runner
    cost = costs[len(costs) // 2]  # contexts grow by one token a step: the middle one
    step_s = statistics.median(times)
    floor = cost.floor(rate, bandwidth)
    phases = cost.phases_floor(rate, bandwidth)
    return dict(batch=batch, context=args.context, step_ms=step_s * 1e3, **extra,
                flops=cost.flops, bytes=cost.bytes, compute_ms=cost.flops / rate * 1e3,
                memory_ms=cost.bytes / bandwidth * 1e3, floor_ms=floor * 1e3,
                ratio=step_s / floor, phases_floor_ms=phases * 1e3, phases_ratio=step_s / phases,
                pipelined_step_ms=pipelined_s * 1e3, pipelined_ratio=pipelined_s / floor,
                tokens_per_s=batch / step_s,
                bandwidth_utilisation=cost.bytes / step_s / bandwidth)


def workload_roofline(args, rate: float, bandwidth: float, runner: ModelRunner) -> dict:
    driver = Driver(args, runner)
    spec = WorkloadSpec(kind=args.dataset, num_requests=args.num_requests, input_mean=args.input_mean,
                        output_mean=args.output_mean, spread=args.spread, seed=args.seed)
    pending = collections.deque(make_workload(spec, args.model_dir))
    running = total_s = floor_s = 0.0
    out_tokens = steps = 0
    wall = time.perf_counter()
    while True:
        while running < args.concurrency and pending:  # a closed loop, like bench/stack/serve.py
            driver.add(*pending.popleft())
            running += 1
        stepped = driver.step()
        if stepped is None:
            break
        _, result, elapsed, cost = stepped
        total_s += elapsed
        floor_s += cost.floor(rate, bandwidth)
        out_tokens += len(result.sampled)
        running -= sum(1 for s in result.sampled if s.finish_reason)
        steps += 1
    wall = time.perf_counter() - wall
    return dict(requests=args.num_requests, concurrency=args.concurrency, steps=steps,
                output_tokens=out_tokens, step_time_s=total_s, wall_s=wall, floor_s=floor_s,
                ratio=total_s / floor_s, output_tokens_per_s=out_tokens / wall,
                floor_output_tokens_per_s=out_tokens / floor_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default="models/small")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--device", default="cpu", help="cpu|cuda|cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's where native)|float32|bfloat16|float16")
    p.add_argument("--quantization", choices=["int8"],
                   help="int8 weights (the floor then counts the quantized layers' weights at 1 byte)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the KV cache's dtype (the floor counts its bytes)")
    p.add_argument("--threads", type=int,
                   help="torch threads (default: the worker's choice, modeling/cpu_threads.py)")
    p.add_argument("--batch", type=int, nargs="+", default=[64], help="decode batch sizes, one runner for all")
    p.add_argument("--context", type=int, default=320, help="tokens of context per request")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--enforce-eager", action="store_true", help="on a GPU: no CUDA graphs")
    p.add_argument("--host-split", action="store_true",
                   help="CPU: also report the steps' forward and sampler's pass (their StepResult timings) "
                        "and the host work around them")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="the requests' temperature (> 0: sampled, each with a seed of its own)")
    p.add_argument("--count-kernels", action="store_true",
                   help="count what one decode step launches (CUDA kernels; aten operators on the CPU)")
    p.add_argument("--block-size", type=int, default=RunnerConfig.block_size, help="tokens per KV block")
    p.add_argument("--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens)
    p.add_argument("--workload", action="store_true", help="also the serving workload")
    p.add_argument("--dataset", default="random", choices=KINDS)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-mean", type=int, default=256)
    p.add_argument("--output-mean", type=int, default=128)
    p.add_argument("--spread", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    if argv is None:  # run as a command: malloc as the worker has it
        run_with_malloc_tunables(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype, _ = resolve_dtype(args.dtype, load_config(args.model_dir), device)  # the runner's
    rate, bandwidth = machine_limits(device, dtype)
    kind = "memory read" if device.type == "cpu" else "device copy"
    runner = make_runner(args)
    result = dict(device=str(device), dtype=str(dtype).removeprefix("torch."), threads=torch.get_num_threads(),
                  matmul_gflops=rate / 1e9, read_gbps=bandwidth / 1e9, bandwidth_kind=kind,
                  cuda_graphs=runner.graphs.sizes if runner.graphs is not None else None,
                  decodes=[decode_roofline(args, rate, bandwidth, b, runner) for b in args.batch])
    result["decode"] = result["decodes"][0]
    where = f"{result['threads']} threads" if device.type == "cpu" else torch.cuda.get_device_name(device)
    print(f"machine: {result['dtype']} matmul {rate / 1e9:.1f} GFLOP/s, {kind} {bandwidth / 1e9:.1f} GB/s "
          f"({where})")
    for d in result["decodes"]:
        print(f"decode step, batch {d['batch']}, context ~{d['context']}"
              f"{' (CUDA graph)' if d['cuda_graphs'] else ''}: {d['step_ms']:.2f} ms "
              f"(median of {args.steps}); compute floor {d['compute_ms']:.2f} ms "
              f"({d['flops'] / 1e9:.2f} GFLOP), memory floor {d['memory_ms']:.2f} ms "
              f"({d['bytes'] / 1e6:.0f} MB) -> {d['ratio']:.2f}x the floor, "
              f"{d['bandwidth_utilisation']:.0%} of the {kind} bandwidth; the phases one after the "
              f"other {d['phases_floor_ms']:.2f} ms -> {d['phases_ratio']:.2f}x")
        print(f"  launched ahead (each step before the one before finishes): {d['pipelined_step_ms']:.2f} ms "
              f"a step -> {d['pipelined_ratio']:.2f}x the floor")
        if "host_ms" in d:
            print(f"  forward {d['forward_ms']:.2f} ms, the sampler's pass over the logits "
                  f"{d['sampling_ms']:.3f} ms, the host work around them {d['host_ms']:.3f} ms")
        if "kernels" in d:
            busy = d["kernels"].get("busy_ms")
            print(f"  {d['kernels']['count']} {d['kernels']['kind']} in one step"
                  + (f", busy {busy:.2f} ms of it" if busy is not None else ""))
    if args.workload:
        w = result["workload"] = workload_roofline(args, rate, bandwidth, runner)
        print(f"workload ({w['requests']} requests, concurrency {w['concurrency']}, {w['steps']} steps): "
              f"step time {w['step_time_s']:.1f} s, floor {w['floor_s']:.1f} s -> {w['ratio']:.2f}x; "
              f"{w['output_tokens_per_s']:.0f} output tok/s (floor {w['floor_output_tokens_per_s']:.0f})")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
