"""The CPU decode-attention kernel of this tree against the kernel of a git revision,
interleaved, on one decode step's shapes.

    python bench/compute/cpu_attention.py --baseline HEAD                 # the `small` preset's layout
    python bench/compute/cpu_attention.py --baseline HEAD --batch 8 --hot

The baseline's cpu_attention.h must declare the struct this tree's does (load_library
checks it): revisions from the one that gave the caches their own `kv_bf16` flag on.

Both sources (kernels/cpu_attention.c and .h at the revision, and this tree's) are built as
the worker builds them (kernels.cpu_attention.compile_library: -O3 -march=native, OpenMP on
torch's runtime) and run on the same inputs: `--batch` requests of `--context` tokens, one
query row each, `--heads` query heads over `--kv-heads` KV heads of `--head-dim`, blocks of
`--block-size` scattered over a pool of `--pool-blocks`. As in a model's step, each call
reads another layer's caches (`--layers` of them), so the K/V come from memory; `--hot`
reuses one layer's caches, which then stay in the CPU's caches and time the arithmetic
alone. A round times `--calls` calls of each kernel, one kernel after the other (the order
alternates between rounds); the report gives each kernel's median time per call (one layer)
over the rounds, the ratio with every round's, and the largest difference between the two
outputs (the first call's), in each dtype.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the repository root on sys.path, this folder off it (bench/README.md)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent)]

from kernels import cpu_attention  # noqa: E402


def kernels_at(rev: str) -> cpu_attention.CpuKernels:
    """The kernel as kernels/cpu_attention.c and .h are at git revision `rev`."""
    folder = Path(tempfile.mkdtemp())
    for name in ("cpu_attention.c", "cpu_attention.h"):
        source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:kernels/{name}"],
                                check=True, capture_output=True, text=True).stdout
        (folder / name).write_text(source)
    return cpu_attention.CpuKernels(cpu_attention.compile_library(
        source=folder / "cpu_attention.c", header=folder / "cpu_attention.h"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, help="git revision whose kernel to compare against")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=320)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--pool-blocks", type=int, default=8192)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hot", action="store_true", help="one layer's caches, reused (they stay cached)")
    p.add_argument("--calls", type=int, default=48)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    args = p.parse_args(argv)

    blocks_each = -(-args.context // args.block_size)
    if args.batch * blocks_each > args.pool_blocks:
        p.error(f"{args.batch} requests of {blocks_each} blocks do not fit --pool-blocks {args.pool_blocks}")
    contenders = {"this tree": cpu_attention.CpuKernels(), f"baseline ({args.baseline})": kernels_at(args.baseline)}
    layers = 1 if args.hot else args.layers
    print(f"decode attention, one layer: batch {args.batch}, context {args.context}, {args.heads} heads "
          f"over {args.kv_heads} KV heads of {args.head_dim}, blocks of {args.block_size} scattered over "
          f"{args.pool_blocks}; {'one layer reused (hot)' if args.hot else f'{layers} layers in turn'}; "
          f"{torch.get_num_threads()} threads; medians of {args.rounds} rounds of {args.calls} calls")
    torch.manual_seed(0)
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        shape = (args.pool_blocks, args.block_size, args.kv_heads, args.head_dim)
        caches = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(layers)]
        tables = torch.randperm(args.pool_blocks)[: args.batch * blocks_each].view(args.batch, -1)
        seq_lens = torch.full((args.batch,), args.context)
        query_start_loc = torch.arange(args.batch + 1)
        plan = cpu_attention.plan_attention(tables, seq_lens, query_start_loc, args.block_size)
        # every request named: a baseline kernel older than 4e9013b takes no NULL index list
        plan = dataclasses.replace(plan, short_reqs=torch.arange(args.batch, dtype=torch.int32))
        query = torch.randn(args.batch, args.heads, args.head_dim).to(dtype)
        scale = args.head_dim ** -0.5

        def call(kernels: cpu_attention.CpuKernels, layer: int) -> torch.Tensor:
            k, v = caches[layer % layers]
            return cpu_attention.paged_attention(kernels, query, k, v, tables, seq_lens,
                                                 query_start_loc, scale, plan=plan)

        first = [call(kernels, 0).float() for kernels in contenders.values()]
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for r in range(args.rounds):
            for name in (list(contenders) if r % 2 == 0 else list(contenders)[::-1]):
                start = time.perf_counter()
                for i in range(args.calls):
                    call(contenders[name], i)
                times[name].append((time.perf_counter() - start) / args.calls * 1e3)
        ours, base = times.values()
        ratios = [a / b for a, b in zip(ours, base)]
        print(f"{dtype_name}: this tree {statistics.median(ours):.3f} ms, baseline "
              f"{statistics.median(base):.3f} ms, ratio {statistics.median(ratios):.3f} "
              f"(rounds {', '.join(f'{x:.2f}' for x in ratios)}); largest output difference "
              f"{(first[0] - first[1]).abs().max().item():.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
