"""Tune the Triton paged attention's tiles on this GPU and keep the fastest in the repository.

    python bench/compute/tune_attention.py --write kernels/triton_tuned.json --json tune.json   # on a GPU
    TRITON_INTERPRET=1 python bench/compute/tune_attention.py --smoke                           # the CPU

For each phase (decode: one token per request; prefill: one causal prompt) and attention
layout of bench/compute/kernels.py (Llama-3-8B's d128-g4, Gemma-3-12B's d256-g2), every
candidate tile set (CANDIDATES: BLOCK_M, TILE_N, num_warps, num_stages) runs each shape of
the phase: decode at batch 64 and 256 over contexts of 512 and 8,192 (equal lengths), prefill
at 1,024, 2,048 and 8,192 tokens. A candidate's output is first compared with SDPA's (a wrong
one is dropped, never timed); a candidate the GPU cannot hold (shared memory) is dropped too.
Time: the median of CUDA-event intervals around a CUDA graph's replay of the call, L2 emptied
before each (bench/compute/device_timing.py `kernel_time`).
The winner of a (phase, layout) is the candidate with the least geometric mean over the
shapes of its time over the shape's best time; the untuned default is among the
candidates, so the winner is never slower than it on that mean.

`--write FILE` merges the winners into FILE under this GPU's architecture ("sm_90"), which
kernels/triton_tiles.py reads; `--json` keeps every timing. The table printed last has a row
per (phase, layout): the winner, its mean slowdown against each shape's best, and the default's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the repository root on sys.path, this folder off it (bench/README.md)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent)]

from bench.compute.device_timing import kernel_time  # noqa: E402
from bench.compute.attention_cases import LAYOUTS, contiguous_kv, paged_batch, rel_error, sdpa_gqa_kwargs  # noqa: E402
from kernels.triton_tiles import TILE_KEYS  # noqa: E402  (no Triton kernel in it: the interpreter's choice stays open)

# (BLOCK_M, TILE_N, num_warps, num_stages) per (phase, head_dim); the first is the untuned default.
CANDIDATES = {
    ("decode", 128): [(16, 32, 4, 2), (16, 64, 4, 2), (16, 64, 4, 3), (16, 128, 4, 2), (16, 128, 4, 3),
                      (16, 64, 8, 3), (16, 128, 8, 3), (16, 32, 4, 4), (16, 128, 8, 2)],
    ("decode", 256): [(16, 32, 4, 2), (16, 64, 4, 2), (16, 64, 4, 3), (16, 32, 4, 3), (16, 64, 8, 2),
                      (16, 32, 4, 4), (16, 128, 8, 2), (16, 32, 8, 3)],
    ("prefill", 128): [(64, 64, 8, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3),
                       (64, 32, 4, 3), (128, 32, 8, 2), (64, 32, 8, 3), (128, 64, 8, 4)],
    ("prefill", 256): [(32, 32, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2), (64, 32, 8, 2), (64, 32, 8, 3),
                       (128, 32, 8, 3), (32, 64, 8, 2), (32, 32, 4, 3), (128, 32, 8, 4)],
}
SHAPES = {"decode": [(64, 512), (64, 8192), (256, 512), (256, 8192)],  # (batch, context)
          "prefill": [(1, 1024), (1, 2048), (1, 8192)]}  # (requests, prompt tokens)
SMOKE = {"decode": [(3, 40)], "prefill": [(1, 48)]}


def case(phase: str, batch: int, n: int, layout, dtype, gen, block_size: int):
    """The paged batch and, beside it, the SDPA output it must match (fp32 on the first 16
    requests for decode; flash/cuDNN causal SDPA for prefill)."""
    heads, kv_heads, head_dim = layout
    group, scale = heads // kv_heads, head_dim**-0.5
    q_lens = [1] * batch if phase == "decode" else [n] * batch
    query, k_cache, v_cache, bt, seq, qsl = paged_batch([n] * batch, q_lens, dtype, block_size, gen, layout)
    k, v = contiguous_kv(k_cache, v_cache, bt, [n] * batch)
    m = min(batch, 16)
    if phase == "decode":
        q4 = query[:m].float().view(m, heads, 1, head_dim)
        expect = F.scaled_dot_product_attention(q4, k[:m].float().repeat_interleave(group, 1),
                                                v[:m].float().repeat_interleave(group, 1), scale=scale)
        expect = expect.view(m, heads, head_dim)
        rows = m
    else:
        q4 = query.view(batch, n, heads, head_dim).transpose(1, 2)
        expect = F.scaled_dot_product_attention(q4, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                                is_causal=True, scale=scale)
        expect = expect.transpose(1, 2).reshape(-1, heads, head_dim)
        rows = query.shape[0]
    del k, v
    return (query, k_cache, v_cache, bt, seq, qsl), expect, rows


def run_candidate(ta, batch, expect, rows: int, tiles: dict, iters: int, flush, graphs: bool) -> float | str:
    """Seconds per call, or why the candidate was dropped."""
    query, k_cache, v_cache, bt, seq, qsl = batch
    out = torch.full_like(query, float("nan"))

    def call():
        ta.paged_attention(query, k_cache, v_cache, bt, seq, qsl, query.shape[-1] ** -0.5, out=out, tiles=tiles)

    try:
        call()
    except Exception as exc:  # out of shared memory or registers on this GPU
        return f"{type(exc).__name__}: {str(exc)[:160]}"
    err = rel_error(out[:rows], expect)
    if not err < 2e-2:
        return f"wrong: relative error {err:.2e} against SDPA"
    return kernel_time(call, iters, flush, graphs, "candidate")


def tune(args, ta, device: str) -> dict:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator(device).manual_seed(0)
    flush = torch.empty(256 * 2**20 if device == "cuda" else 2**20, dtype=torch.uint8, device=device)
    shapes = SMOKE if args.smoke else SHAPES
    result = {}
    for phase in args.phases:
        for name in args.layouts:
            layout = LAYOUTS[name]
            group = layout.heads // layout.kv_heads
            cands = CANDIDATES[(phase, layout.head_dim)]
            if args.smoke:
                cands = cands[:2]
            times = {c: {} for c in cands}
            for batch, n in shapes[phase]:
                inputs, expect, rows = case(phase, batch, n, layout, dtype, gen, args.block_size)
                for c in cands:
                    times[c][f"{batch}x{n}"] = run_candidate(ta, inputs, expect, rows, dict(zip(TILE_KEYS, c)),
                                                             args.iters, flush, not args.no_graphs)
                del inputs, expect
                if device == "cuda":
                    torch.cuda.empty_cache()
            key = f"d{layout.head_dim}-g{group}"
            result[(phase, key)] = score(times)
            print(f"{phase} {name} ({key}): winner {result[(phase, key)]['winner']}", flush=True)
    return result


def score(times: dict) -> dict:
    """The winner by the geometric mean of time / the shape's best, over candidates that
    ran every shape; every candidate's mean (None: dropped) and its timings."""
    shapes = next(iter(times.values())).keys()
    best = {s: min((t[s] for t in times.values() if isinstance(t[s], float)), default=math.nan) for s in shapes}
    means = {}
    for c, t in times.items():
        ok = all(isinstance(t[s], float) for s in shapes)
        means[c] = math.exp(sum(math.log(t[s] / best[s]) for s in shapes) / len(shapes)) if ok else None
    ranked = sorted((m, c) for c, m in means.items() if m is not None)
    default = next(iter(times))
    return {"winner": dict(zip(TILE_KEYS, ranked[0][1])) if ranked else None,
            "winner_mean": ranked[0][0] if ranked else None, "default": dict(zip(TILE_KEYS, default)),
            "default_mean": means[default],
            "candidates": [{"tiles": dict(zip(TILE_KEYS, c)), "mean_over_best": means[c],
                            "us": {s: (v * 1e6 if isinstance(v, float) else v) for s, v in t.items()}}
                           for c, t in times.items()]}


def write_tuned(path: Path, arch: str, result: dict, env: dict) -> None:
    """Merge the winners into `path` under `arch`, keeping other architectures' entries."""
    table = json.loads(path.read_text()) if path.exists() else {}
    table["_about"] = ("Triton paged attention tiles per GPU architecture, phase and layout (d<head_dim>-g<group>),"
                       " measured fastest by bench/compute/tune_attention.py; read by kernels/triton_tiles.py")
    entry = table.setdefault(arch, {})
    for (phase, key), r in result.items():
        if r["winner"] is not None:
            entry.setdefault(phase, {})[key] = r["winner"]
    table.setdefault("_measured", {})[arch] = env
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--phases", nargs="+", default=["decode", "prefill"], choices=["decode", "prefill"])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--no-graphs", action="store_true", help="time launch by launch, not a CUDA graph's replay")
    ap.add_argument("--write", type=Path, help="merge the winners into this tuned-tiles file")
    ap.add_argument("--json", type=Path, help="every candidate's timings")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in Triton's CPU interpreter: "
                                                         "checks this script, measures nothing")
    args = ap.parse_args()
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--smoke runs the kernels in Triton's CPU interpreter: set TRITON_INTERPRET=1")
        device, args.iters = "cpu", 1
    elif torch.cuda.is_available():
        device = "cuda"
    else:
        sys.exit("bench/compute/tune_attention.py needs a CUDA GPU; --smoke checks the script on the CPU")
    import triton

    from kernels import triton_attention as ta

    arch = "sm_{}{}".format(*torch.cuda.get_device_capability()) if device == "cuda" else "interpreter"
    env = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke test)", "arch": arch,
           "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "date": time.strftime("%Y-%m-%d"), "dtype": "bf16" if device == "cuda" else "fp32",
           "block_size": args.block_size}
    t0 = time.monotonic()
    result = tune(args, ta, device)
    env["seconds"] = round(time.monotonic() - t0, 1)
    if args.json:
        args.json.write_text(json.dumps({"env": env, "gqa": bool(sdpa_gqa_kwargs(device)),
                                         "results": {f"{p} {k}": r for (p, k), r in result.items()}}, indent=1))
    if args.write and device == "cuda":
        write_tuned(args.write, arch, result, env)
    print("\n| phase | layout | winner (BLOCK_M, TILE_N, warps, stages) | its mean ÷ best | default's |\n"
          "|---|---|---|---|---|")
    for (phase, key), r in result.items():
        w = r["winner"] and tuple(r["winner"].values())
        means = ["dropped" if x is None else f"{x:.3f}" for x in (r["winner_mean"], r["default_mean"])]
        print(f"| {phase} | {key} | {w} | {means[0]} | {means[1]} |")


if __name__ == "__main__":
    main()
