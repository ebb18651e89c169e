"""KV cache waste on a mixed-length workload, against contiguous preallocation.

    python bench/kv/kv_usage.py --model models/small --runs 3 --out bench/results/kv-usage.json \
        -- --dataset sharegpt --num-requests 96 --concurrency 32

Each run starts a fresh stack, drives bench/stack/serve.py's load (flags after `--`) and samples
the scheduler's WorkerStats meanwhile (about once a second under load). Per sample:

  allocated  = used blocks × block size             the slots paged allocation holds
  held       = (1 − kv_waste) × allocated            tokens whose K/V are in the cache
  paged waste = 1 − held ÷ allocated                 the last, partly filled block of each request

and what contiguous preallocation would have reserved for the requests running at the
same moment, as the PagedAttention paper compares:

  max-length  each running request reserves max_model_len slots
  oracle      each running request reserves prompt + max_tokens slots (its exact final
              length): the mean of that over the requests the client had in flight then,
              times the number running (the stats name no requests; in flight = running
              + waiting)

with waste = 1 − held ÷ reserved. Reports time averages (the mean over samples) and peaks
per run, then medians over runs.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the repository root on sys.path, this folder off it (bench/README.md)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent)]

from bench.kv.kv_common import (StatsSampler, median, parser, registration, run_load, running_stack,  # noqa: E402
                       split_argv, write_json)


def analyse(samples: list[dict], requests: list[dict], block_size: int, max_model_len: int) -> dict:
    ok = [r for r in requests if r["error"] is None]
    start = min(r["started_at"] for r in ok)
    end = max(r["started_at"] + r["latency_s"] for r in ok)
    rows = []
    for s in samples:
        t = s["updated_at"]
        if not start <= t <= end or not s["num_running"]:
            continue
        allocated = s["num_used_blocks"] * block_size
        held = (1 - s["kv_waste"]) * allocated
        in_flight = [r for r in ok if r["started_at"] <= t < r["started_at"] + r["latency_s"]]
        final_lengths = [r["prompt_tokens"] + r["max_tokens"] for r in in_flight]
        rows.append({"t": t - start, "running": s["num_running"], "waiting": s["num_waiting"],
                     "in_flight": len(in_flight), "allocated": allocated, "held": held,
                     "max_length": s["num_running"] * max_model_len,
                     "oracle": s["num_running"] * sum(final_lengths) / max(1, len(final_lengths)),
                     "preemptions": s["num_preemptions"]})
    if not rows:
        raise RuntimeError("no WorkerStats sample fell inside the run")

    def waste(row: dict, reserved: str) -> float:
        return 1 - row["held"] / row[reserved] if row[reserved] else 0.0

    peak = max(rows, key=lambda r: r["allocated"])
    out = {"samples": len(rows), "samples_with_waiting": sum(r["waiting"] > 0 for r in rows),
           "preemptions": rows[-1]["preemptions"] - rows[0]["preemptions"],
           "peak_allocated_slots": peak["allocated"], "peak_held_tokens": round(peak["held"])}
    for reserved in ("allocated", "max_length", "oracle"):
        name = {"allocated": "paged"}.get(reserved, reserved)
        values = [waste(r, reserved) for r in rows]
        out[f"{name}_waste_mean"] = sum(values) / len(values)
        out[f"{name}_waste_peak"] = max(values)
        out[f"{name}_waste_at_peak_use"] = waste(peak, reserved)
        out[f"{name}_peak_slots"] = max(r[reserved] for r in rows)
    out["max_length_peak_over_paged_peak"] = out["max_length_peak_slots"] / out["paged_peak_slots"]
    out["oracle_peak_over_paged_peak"] = out["oracle_peak_slots"] / out["paged_peak_slots"]
    out["rows"] = rows
    return out


def one_run(args, load_argv: list[str], run_dir: Path) -> dict:
    with running_stack(args.model, run_dir, scheduler_args=tuple(args.scheduler_arg),
                       worker_args=tuple(args.worker_arg)) as stack:
        worker = registration(stack)
        with StatsSampler(stack) as sampler:
            result = run_load(["--base-url", stack.base_url, "--model", stack.served_model_name,
                               "--max-model-len", str(worker.max_model_len), "--quiet",
                               "--per-request", *load_argv])
            sampler.wait_idle()
        analysis = analyse(sampler.samples, result["requests"], worker.block_size, worker.max_model_len)
    analysis.update(num_blocks=worker.num_blocks, block_size=worker.block_size,
                    max_model_len=worker.max_model_len, failed=result["failed"],
                    duration_s=result["duration_s"], output_throughput=result["output_throughput"])
    return analysis


SUMMARY_KEYS = ("paged_waste_mean", "paged_waste_peak", "paged_waste_at_peak_use", "paged_peak_slots",
                "max_length_waste_mean", "max_length_waste_at_peak_use", "max_length_peak_slots",
                "oracle_waste_mean", "oracle_waste_at_peak_use", "oracle_peak_slots",
                "max_length_peak_over_paged_peak", "oracle_peak_over_paged_peak", "samples",
                "samples_with_waiting", "preemptions", "output_throughput")


def main(argv: list[str] | None = None) -> int:
    ours, load_argv = split_argv(sys.argv[1:] if argv is None else argv)
    p = parser(__doc__)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args(ours)
    runs = []
    with tempfile.TemporaryDirectory(prefix="kv-usage-") as tmp:
        for i in range(args.runs):
            run = one_run(args, load_argv, Path(tmp) / f"run-{i}")
            runs.append(run)
            print(f"run {i + 1}: " + ", ".join(f"{k} {run[k]:.4g}" for k in SUMMARY_KEYS), flush=True)
    summary = {k: median([r[k] for r in runs]) for k in SUMMARY_KEYS}
    print("median: " + ", ".join(f"{k} {v:.4g}" for k, v in summary.items()))
    write_json(args.out, {"median": summary, "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
