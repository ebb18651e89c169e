"""A mixed step -- a prefill chunk beside running decodes -- against the floors of its parts.

    python bench/compute/mixed_step.py --model-dir models/small --batch 32 --chunk 256
    python bench/compute/mixed_step.py --model-dir models/1b --device cuda --batch 64 --chunk 512

`--batch` requests decode at ~`--context` tokens of context; then, `--rounds` times, a new
request's `--chunk`-token prompt is computed in one step beside them (the step budget is
raised to hold both; a first round, untimed, warms the shapes up). Each such step is
timed (ModelRunner.step, as bench/compute/roofline.py times it) and set against:

* its own floor: max(FLOPs / matmul rate, bytes / bandwidth) of the decodes and the chunk
  together (bench/compute/roofline.py's cost model: every weight read once for the step);
* the sum of its parts' floors: the decodes' step and the chunk's step each at its own
  floor, as if run as two steps (each reads every weight): what mixing saves at best;
* the parts measured: the decode-only steps just before it (median), and the same chunk
  as a step of its own on an idle runner (median of `--rounds` fresh prompts).

Prints one line and writes JSON (--out). The machine's rates are bench/compute/roofline.py's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the repository root on sys.path, this folder off it (bench/README.md)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent)]

from bench.compute import roofline  # noqa: E402
from modeling.loader import resolve_dtype  # noqa: E402
from modeling.registry import load_config  # noqa: E402


def random_prompt(driver: roofline.Driver, length: int, gen: torch.Generator) -> list[int]:
    return torch.randint(300, driver.cfg.vocab_size - 1, (length,), generator=gen).tolist()


def measure(args, rate: float, bandwidth: float) -> dict:
    driver = roofline.Driver(args)
    gen = torch.Generator().manual_seed(args.seed)
    for _ in range(args.batch):
        driver.add(random_prompt(driver, args.context, gen), max_tokens=driver.runner.max_model_len - args.context)
    while True:  # prefill everything: the decodes run
        step, *_ = driver.step()
        if len(step.num_scheduled_tokens) == args.batch and set(step.num_scheduled_tokens.values()) == {1}:
            break
    decode_s, mixed = [], []
    for i in range(args.rounds + 1):  # the first round warms the mixed shapes up, untimed
        for _ in range(3):
            decode_s.append(driver.step()[2])
        driver.add(random_prompt(driver, args.chunk, gen), max_tokens=1)
        step, _, elapsed, cost = driver.step()
        work = driver.work
        decode_part = [w for w in work if w[1] == 1]
        chunk_part = [w for w in work if w[1] > 1]
        if len(decode_part) != args.batch or [w[1] for w in chunk_part] != [args.chunk]:
            raise SystemExit(f"the step is not {args.batch} decodes beside one {args.chunk}-token chunk: "
                             f"{dict(step.num_scheduled_tokens)}")
        if i:
            parts = driver.cost(decode_part).floor(rate, bandwidth) + driver.cost(chunk_part).floor(rate, bandwidth)
            mixed.append((elapsed, cost.floor(rate, bandwidth), parts))
    decode_s = decode_s[3:]
    driver.runner.forget_all()
    alone = roofline.Driver(args, driver.runner)
    alone_s = []
    for i in range(args.rounds + 1):  # the first untimed
        alone.add(random_prompt(alone, args.chunk, gen), max_tokens=1)
        elapsed = alone.step()[2]
        if [w[1] for w in alone.work] != [args.chunk]:
            raise SystemExit(f"the chunk alone is not one {args.chunk}-token step: {alone.work}")
        if i:
            alone_s.append(elapsed)
    step_s = statistics.median(t for t, _, _ in mixed)
    floor_s = statistics.median(f for _, f, _ in mixed)
    parts_floor_s = statistics.median(p for _, _, p in mixed)
    decode_ms, alone_ms = statistics.median(decode_s) * 1e3, statistics.median(alone_s) * 1e3
    return dict(batch=args.batch, context=args.context, chunk=args.chunk, rounds=args.rounds,
                decodes_in_step=len(decode_part), chunk_tokens_in_step=sum(w[1] for w in chunk_part),
                mixed_step_ms=step_s * 1e3, floor_ms=floor_s * 1e3, parts_floor_ms=parts_floor_s * 1e3,
                over_floor=step_s / floor_s, over_parts_floor=step_s / parts_floor_s,
                decode_step_ms=decode_ms, chunk_alone_ms=alone_ms,
                over_parts_measured=step_s * 1e3 / (decode_ms + alone_ms))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default="models/small")
    p.add_argument("--device", default="cpu", help="cpu|cuda|cuda:N")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--threads", type=int)
    p.add_argument("--batch", type=int, default=32, help="requests decoding")
    p.add_argument("--context", type=int, default=320, help="their tokens of context")
    p.add_argument("--chunk", type=int, default=256, help="the prefill chunk computed beside them")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out")
    args = p.parse_args(argv)
    # what bench/compute/roofline.py's Driver and make_runner read
    args.quantization, args.kv_cache_dtype, args.temperature = None, "auto", 0.0
    args.max_num_batched_tokens = args.batch + args.chunk
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype, _ = resolve_dtype(args.dtype, load_config(args.model_dir), device)
    rate, bandwidth = roofline.machine_limits(device, dtype)
    result = measure(args, rate, bandwidth)
    r = result
    print(f"mixed step: {r['batch']} decodes at ~{r['context']} + a {r['chunk']}-token chunk: "
          f"{r['mixed_step_ms']:.2f} ms = {r['over_floor']:.2f}x its floor ({r['floor_ms']:.2f} ms), "
          f"{r['over_parts_floor']:.2f}x the parts' floors summed ({r['parts_floor_ms']:.2f} ms); "
          f"the parts measured: decodes {r['decode_step_ms']:.2f} ms + the chunk alone {r['chunk_alone_ms']:.2f} ms "
          f"-> {r['over_parts_measured']:.2f}x their sum")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=str(device), dtype=str(dtype).removeprefix("torch."),
                                                  matmul_gflops=rate / 1e9, bandwidth_gbps=bandwidth / 1e9,
                                                  **result), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
