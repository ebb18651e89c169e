"""A shared system prompt with prefix caching on vs off, in one run.

    python bench/kv/kv_prefix.py --model models/small --rounds 3 --out bench/results/kv-prefix.json \
        -- --dataset shared-prefix --num-requests 64 --concurrency 64 --input-mean 1024 --output-mean 64

Rounds alternate on, off, on, off, ... (so slow drifts of a shared machine hit both alike);
each starts a fresh stack (the scheduler with or without `--no-prefix-caching`), warms it
up with a few short requests of other tokens (so the measured prefix is not cached in
advance), then drives bench/stack/serve.py's load (flags after `--`). Reports per round and the
medians over rounds: median and p90 TTFT, output throughput, and the prefix-cache hit rate
the scheduler counted (hits ÷ queries, in tokens), plus the ratios on vs off, each taken
within a round (on and off back to back), then the median over rounds.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the repository root on sys.path, this folder off it (bench/README.md)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent)]

from bench.kv.kv_common import (StatsSampler, median, parser, run_load, running_stack, split_argv,  # noqa: E402
                       write_json)

WARMUP = ["--dataset", "random", "--num-requests", "4", "--concurrency", "4", "--input-mean", "64",
          "--output-mean", "8", "--seed", "12345", "--quiet"]


def one_round(args, caching: bool, load_argv: list[str], run_dir: Path) -> dict:
    scheduler_args = () if caching else ("--no-prefix-caching",)
    with running_stack(args.model, run_dir, scheduler_args=(*scheduler_args, *args.scheduler_arg),
                       worker_args=tuple(args.worker_arg)) as stack:
        target = ["--base-url", stack.base_url, "--model", stack.served_model_name]
        sampler = StatsSampler(stack)
        run_load([*target, *WARMUP])
        before = sampler.wait_idle()
        result = run_load([*target, "--quiet", *load_argv])
        after = sampler.wait_idle()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    return {"caching": caching, "failed": result["failed"], "duration_s": result["duration_s"],
            "ttft_p50_s": result["ttft_s"]["p50"], "ttft_p90_s": result["ttft_s"]["p90"],
            "tpot_p50_s": result["tpot_s"]["p50"], "output_throughput": result["output_throughput"],
            "prefix_hit_rate": hits / queries if queries else 0.0, "num_preemptions": after.num_preemptions}


def main(argv: list[str] | None = None) -> int:
    ours, load_argv = split_argv(sys.argv[1:] if argv is None else argv)
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=3, help="rounds of (on, off)")
    args = p.parse_args(ours)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="kv-prefix-") as tmp:
        for i in range(args.rounds):
            for caching in (True, False):
                r = one_round(args, caching, load_argv, Path(tmp) / f"round-{i}-{'on' if caching else 'off'}")
                rounds.append(r)
                print(f"round {i + 1} caching {'on ' if caching else 'off'}: TTFT p50 {r['ttft_p50_s'] * 1000:.0f} ms, "
                      f"p90 {r['ttft_p90_s'] * 1000:.0f} ms, TPOT p50 {r['tpot_p50_s'] * 1000:.0f} ms, "
                      f"{r['output_throughput']:.1f} output tok/s, hit rate {r['prefix_hit_rate']:.1%}, "
                      f"{r['failed']} failed", flush=True)
    keys = ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "output_throughput", "prefix_hit_rate", "duration_s")
    summary = {state: {k: median([r[k] for r in rounds if r["caching"] == (state == "on")]) for k in keys}
               for state in ("on", "off")}
    pairs = list(zip(rounds[0::2], rounds[1::2]))  # (on, off) of the same round
    summary["ttft_p50_off_over_on"] = median([off["ttft_p50_s"] / on["ttft_p50_s"] for on, off in pairs])
    summary["throughput_on_over_off"] = median([on["output_throughput"] / off["output_throughput"]
                                                for on, off in pairs])
    print(json.dumps(summary, indent=1))
    write_json(args.out, {"median": summary, "rounds": rounds})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
