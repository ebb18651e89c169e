"""Baseline: `transformers` `generate()` with static padded batches, offline.

    python bench/stack/static_generate.py --model-dir models/small --batch-size 32 \
        --dataset random --num-requests 96 --input-mean 256 --output-mean 128

The same workload as bench/stack/serve.py (same spec, same seed), cut into batches of
--batch-size in arrival order, left-padded; each batch runs until its longest request is
done (EOS suppressed, as `--ignore-eos` does for the servers). Output throughput counts
only the tokens each request asked for: padding and overshoot are the static batch's waste.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the repository root on sys.path, this folder off it (bench/README.md)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent)]

from bench.common.workloads import KINDS, WorkloadSpec, make_workload  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--dataset", default="random", choices=KINDS)
    p.add_argument("--num-requests", type=int, default=96)
    p.add_argument("--input-mean", type=int, default=256)
    p.add_argument("--output-mean", type=int, default=128)
    p.add_argument("--spread", type=float, default=0.5)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--vocab-high", type=int, default=30000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--device", default="cpu", help="cpu|cuda|cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's)|float32|bfloat16|float16")
    p.add_argument("--label", default="transformers generate (static batches)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = WorkloadSpec(kind=args.dataset, num_requests=args.num_requests, input_mean=args.input_mean,
                        output_mean=args.output_mean, spread=args.spread, max_model_len=args.max_model_len,
                        token_high=args.vocab_high, seed=args.seed)
    workload = make_workload(spec, args.model_dir)  # the servers' exact prompts (bench/stack/serve.py --tokenizer)
    device = torch.device(args.device)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=args.dtype).to(device).eval()
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else 0
    with torch.no_grad():  # warm-up, as the servers get: allocators, lazy init
        model.generate(input_ids=torch.tensor([workload[0][0][:8]], device=device), max_new_tokens=4, do_sample=False,
                       pad_token_id=pad)
    useful = 0
    start = time.perf_counter()
    for i in range(0, len(workload), args.batch_size):
        batch = workload[i:i + args.batch_size]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids, _ in batch], device=device)
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in batch], device=device)
        new = max(m for _, m in batch)
        with torch.no_grad():
            model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=pad)
        useful += sum(m for _, m in batch)
        print(f"\rbatch {i // args.batch_size + 1}/{-(-len(workload) // args.batch_size)}", end="",
              file=sys.stderr, flush=True)
    duration = time.perf_counter() - start
    print(file=sys.stderr)
    result = {"label": args.label, "dataset": args.dataset, "num_requests": len(workload),
              "batch_size": args.batch_size, "duration_s": duration, "output_throughput": useful / duration,
              "total_output_tokens": useful, "args": vars(args)}
    print(f"{args.label}: {len(workload)} requests in {duration:.1f}s — {result['output_throughput']:.1f} output tok/s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
