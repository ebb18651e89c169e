"""How many long requests a Gemma 3 worker runs at once in one KV memory: five of every six
layers sliding (KV cache groups: each sliding group keeps only the blocks its window
reaches, kvstore/kv_cache_groups.py), against the same weights with every layer global.

    python bench/kv/kv_hybrid.py --model models/gemma3-small --window 64 --prompt-tokens 896 \
        --output-tokens 128 --kv-cache-memory-mib 100 --out bench/results/kv-hybrid.json

The checkpoint (a Gemma 3, e.g. `make-model --arch gemma3 --preset small`) is copied twice
with its first six layers: `layer_types` five sliding and one global (with `--window`
replacing its `sliding_window`, so a CPU run can make requests of 16 windows), and every
layer global. Each copy gets a fresh stack with the same `--kv-cache-memory`. A request is
`--prompt-tokens` random token ids and `--output-tokens` generated (ignore_eos): prompt +
output = 16 windows with the defaults. For each copy, rounds of N requests sent at once; a
round is clean when it preempts nothing and has all N running together at some point. The
theoretical capacity is the pool's blocks over the blocks one request holds once it has all
its tokens (kvstore/kv_cache_groups.py blocks_per_request: every block in a global group,
the window's in a sliding one); a prefill chunk briefly holds more in the sliding groups.
The search (search_capacity) starts at the theory and goes up while rounds run clean, or
down while they fail, in steps that double, then bisects: the measured capacity is the
largest N that ran clean, next to the first N that failed, so the measurement can land
above the theory as well as below it, and the bracket shows it is tight. It stops at
`--cap-factor` times the theory and says so (no failing N then: the capacity is at least that).
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import openai
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the repository root on sys.path, this folder off it (bench/README.md)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent)]

from bench.kv.kv_common import StatsSampler, parser, registration, running_stack, write_json  # noqa: E402
from kvstore.kv_cache_groups import blocks_per_request, group_layers  # noqa: E402

LAYERS = 6  # five sliding, one global: Gemma 3's pattern
SLIDING, FULL = "sliding_attention", "full_attention"


def write_copy(model: Path, out: Path, layer_types: list[str], window: int) -> None:
    """`model`'s first LAYERS layers with these layer types and window, in `out`."""
    shutil.copytree(model, out, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    cfg = json.loads((model / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    if text["num_hidden_layers"] < LAYERS:
        raise SystemExit(f"{model} has {text['num_hidden_layers']} layers, fewer than {LAYERS}")
    text.update(num_hidden_layers=LAYERS, layer_types=layer_types, sliding_window=window)
    text.pop("sliding_window_pattern", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    tensors = {}
    for path in sorted(model.glob("*.safetensors")):
        tensors.update(load_file(path))
    keep = {name: t for name, t in tensors.items()
            if ".layers." not in name or int(name.split(".layers.")[1].split(".")[0]) < LAYERS}
    save_file(keep, out / "model.safetensors", metadata={"format": "pt"})


async def _round(base_url: str, model: str, n: int, prompt_tokens: int, output_tokens: int,
                 vocab: int, seed: int) -> None:
    rng = random.Random(seed)  # prompts of their own each round: no prefix hits across rounds
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=3600) as client:
        async def one() -> None:
            prompt = [rng.randrange(10, vocab) for _ in range(prompt_tokens)]
            await client.completions.create(model=model, prompt=prompt, max_tokens=output_tokens,
                                            temperature=0, extra_body={"ignore_eos": True})
        await asyncio.gather(*(one() for _ in range(n)))


@dataclass(frozen=True)
class Capacity:
    """What search_capacity found: `measured` ran clean and `first_failed` (measured + 1 unless
    the cap was reached) did not; `tried` is every N in the order it ran."""

    measured: int  # the largest N that ran clean; 0 when not even one request did
    first_failed: int | None  # the smallest N above it that failed; None when the cap ran clean
    cap: int
    tried: tuple[int, ...]

    @property
    def capped(self) -> bool:
        return self.first_failed is None


def search_capacity(theoretical: int, run_round: Callable[[int], tuple[int, int]], cap: int) -> Capacity:
    """The largest N whose round is clean, `run_round(n)` giving (preemptions, peak running):
    clean when it preempts nothing and had all n running at once. Starts at the theory (1 at
    least) and goes up while rounds run clean (to `cap` at most), or down while they fail, by
    steps of 1, 2, 4, ...; then bisects the gap to one. Each N runs at most once. Assumes a
    larger N fails where a smaller one does, as preemptions do in a fixed pool; what each
    round ran is in `tried` for a reader to check that."""
    clean: dict[int, bool] = {}

    def is_clean(n: int) -> bool:
        if n not in clean:
            preemptions, peak_running = run_round(n)
            clean[n] = preemptions == 0 and peak_running == n
        return clean[n]

    start = min(max(theoretical, 1), cap)
    step = 1
    if is_clean(start):
        lo, hi = start, None  # lo ran clean, hi failed
        while hi is None and lo < cap:
            n = min(lo + step, cap)
            if is_clean(n):
                lo, step = n, step * 2
            else:
                hi = n
        if hi is None:
            return Capacity(lo, None, cap, tuple(clean))
    else:
        lo, hi = 0, start
        while hi - lo > 1:
            n = max(hi - step, 1)
            if is_clean(n):
                lo = n
                break
            hi, step = n, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if is_clean(mid):
            lo = mid
        else:
            hi = mid
    return Capacity(lo, hi, cap, tuple(clean))


def measure(model_dir: Path, windows: list[int | None], args, run_dir: Path, vocab: int) -> dict:
    """One copy's stack: its pool, the theory, and search_capacity's rounds against it."""
    worker_args = ("--kv-cache-memory", f"{args.kv_cache_memory_mib}MiB", *args.worker_arg)
    scheduler_args = ("--max-num-batched-tokens", str(args.max_num_batched_tokens),
                      "--stats-interval", "0.05", *args.scheduler_arg)
    layout = group_layers(windows)
    with running_stack(str(model_dir), run_dir, worker_args=worker_args, scheduler_args=scheduler_args) as stack:
        reg = registration(stack)
        bs = reg.block_size
        per_request = blocks_per_request(layout, args.prompt_tokens + args.output_tokens, bs)
        theoretical = reg.num_blocks // sum(per_request)
        rounds: list[dict] = []

        def run_round(n: int) -> tuple[int, int]:
            with StatsSampler(stack, interval_s=0.02) as sampler:
                before = sampler.latest()
                asyncio.run(_round(stack.base_url, stack.served_model_name, n, args.prompt_tokens,
                                   args.output_tokens, vocab, seed=n))
                after = sampler.wait_idle()
            preempted = after.num_preemptions - (before.num_preemptions if before else 0)
            peak_running = max((s["num_running"] for s in sampler.samples), default=0)
            peak_used = max((s["num_used_blocks"] for s in sampler.samples), default=0)
            rounds.append({"requests": n, "preemptions": preempted, "peak_running": peak_running,
                           "peak_used_blocks": peak_used})
            print(f"  {n} requests: {preempted} preemptions, {peak_running} running at most, "
                  f"{peak_used} of {reg.num_blocks} blocks in use at most", flush=True)
            return preempted, peak_running

        found = search_capacity(theoretical, run_round, cap=args.cap_factor * max(theoretical, 1))
    if found.capped:
        print(f"  every round up to the cap ({found.cap} requests, {args.cap_factor}x the theory) ran clean: "
              f"the capacity is at least {found.measured}; raise --cap-factor to bound it", flush=True)
    else:
        print(f"  capacity {found.measured}: {found.first_failed} requests did not run clean", flush=True)
    return {"groups": [{"window": g.window, "layers": list(g.layers)} for g in layout.groups],
            "group_size": layout.group_size, "block_size": bs, "num_blocks": reg.num_blocks,
            "blocks_per_request": per_request, "theoretical": theoretical, "measured": found.measured,
            "first_failed": found.first_failed, "cap": found.cap, "rounds": rounds}


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--window", type=int, default=64, help="the sliding layers' window (replaces the checkpoint's)")
    p.add_argument("--prompt-tokens", type=int, default=896)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--kv-cache-memory-mib", type=int, default=100, help="the worker's KV cache, both runs")
    p.add_argument("--max-num-batched-tokens", type=int, default=256, help="the scheduler's token budget a step")
    p.add_argument("--cap-factor", type=int, default=4,
                   help="the search stops at this many times the theoretical capacity")
    args = p.parse_args(argv)
    if args.cap_factor < 1:
        p.error("--cap-factor must be at least 1")
    model = Path(args.model)
    cfg = json.loads((model / "config.json").read_text())
    vocab = cfg.get("text_config", cfg)["vocab_size"]
    kinds = {"hybrid": [SLIDING] * (LAYERS - 1) + [FULL], "global": [FULL] * LAYERS}
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, layer_types in kinds.items():
            copy = Path(tmp) / name
            write_copy(model, copy, layer_types, args.window)
            windows = [args.window if t == SLIDING else None for t in layer_types]
            print(f"{name}: {layer_types}", flush=True)
            runs[name] = measure(copy, windows, args, Path(tmp) / f"run-{name}", vocab)
    hybrid, full = runs["hybrid"], runs["global"]
    tokens = args.prompt_tokens + args.output_tokens
    theory = hybrid["theoretical"] / full["theoretical"]
    ratio = hybrid["measured"] / full["measured"] if full["measured"] else float("nan")
    print(f"\n{tokens}-token requests ({tokens / args.window:g} windows of {args.window}), "
          f"{args.kv_cache_memory_mib} MiB of KV cache, blocks of {hybrid['block_size']} tokens")
    print("| layers | blocks in the pool | blocks a request holds | concurrent requests: theory "
          "| measured | first failed |")
    print("|---|---|---|---|---|---|")
    for name, run in runs.items():
        failed = run["first_failed"] if run["first_failed"] is not None else f"none up to {run['cap']}"
        print(f"| {name} | {run['num_blocks']} of {run['group_size']} layers "
              f"| {' + '.join(map(str, run['blocks_per_request']))} | {run['theoretical']} | {run['measured']} "
              f"| {failed} |")
    # A run that reached its cap measured a lower bound of its capacity, so the ratio is a bound.
    ratio_is_bound = any(run["first_failed"] is None for run in runs.values())
    print(f"\nhybrid / global: {ratio:.2f}x measured{' (a bound: a run reached its cap)' if ratio_is_bound else ''}, "
          f"{theory:.2f}x in theory")
    write_json(args.out, {"window": args.window, "prompt_tokens": args.prompt_tokens,
                          "output_tokens": args.output_tokens, "kv_cache_memory_mib": args.kv_cache_memory_mib,
                          "cap_factor": args.cap_factor, "ratio": ratio, "ratio_is_bound": ratio_is_bound,
                          "theoretical_ratio": theory, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
