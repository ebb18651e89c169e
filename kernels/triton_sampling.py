"""The sampler's exponential race as one Triton kernel: for each row of `probs` [S, V] and
its seed, the first index of the largest `probs / E`, E the keyed Exp(1) noise.

The contract and the plain-torch reference are worker_svc/sampler.py's `exponential_race`
(`first_argmax(probs / keyed_exponential(seeds, V))`; `keyed_exponential_one` is each noise
entry in Python integers). The torch version makes the noise as about ten elementwise
passes over int64 [S, V] temporaries, then divides and reduces: ~20 reads and writes of
8 bytes per vocabulary entry. Here the noise is made in registers and never stored: one
read of `probs` (4 bytes an entry) and one int64 written per row.

One program per row, the vocabulary in tiles of BLOCK:

    z = seed + (v + 1) * 0x9E3779B97F4A7C15           # uint64, wrapping: splitmix64's
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9          #   (v+1)-th output from the seed
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    e = -log(((z >> 41) + 0.5) * 2**-23)              # top 23 bits: exact in fp32
    x = p[v] / e                                      # IEEE division, as torch's
    best = the first v of the largest x (a NaN counts as the largest, as first_argmax)

Numerics: the noise's integer part is exact, `log` is CUDA's logf (libdevice), the division
div_rn: the same operations as torch's CUDA kernels, so a compiled run should draw what they
draw bit for bit (tests/unit/kernels/test_exponential_race.py checks it under the `gpu` marker; not yet
run on a GPU). In Triton's CPU interpreter (tests) log is numpy's, which may differ from
torch's in the last bit; a draw can then differ only where two entries' `p / e` tie to the
last bit. A NaN counts as the largest, as +inf would: rows are finite or NaN (a softmax's).

The wrapper reads no tensor on the host: the launch depends on shapes alone, so a CUDA
graph can capture it.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

BLOCK = 2048  # vocabulary entries per tile


@triton.jit
def _log(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        y = libdevice.log(x)  # CUDA's logf, as torch's log kernel calls it
    else:
        y = tl.log(x)
    return y


@triton.jit
def _exponential_race_kernel(probs_ptr, row_stride, seeds_ptr, out_ptr, vocab,
                             BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    row = tl.program_id(0)
    seed = tl.load(seeds_ptr + row).to(tl.uint64, bitcast=True)
    row_ptr = probs_ptr + row.to(tl.int64) * row_stride
    best = tl.full([], -1.0, tl.float32)  # every x is >= 0 (or NaN, made +inf)
    best_index = tl.full([], 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < vocab
        p = tl.load(row_ptr + cols, mask=inside, other=0.0)
        z = seed + (cols + 1).to(tl.uint64) * 0x9E3779B97F4A7C15
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        z = z ^ (z >> 31)
        u = ((z >> 41).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23
        x = tl.math.div_rn(p, -_log(u, LIBDEVICE))
        x = tl.where(x != x, float("inf"), x)  # NaN: the largest, the first of them wins
        x = tl.where(inside, x, -1.0)
        top = tl.max(x, axis=0)
        here = start + tl.argmax(x, axis=0, tie_break_left=True).to(tl.int64)
        best_index = tl.where(top > best, here, best_index)  # strictly: ties keep the earlier tile
        best = tl.maximum(top, best)
    tl.store(out_ptr + row, best_index)


INTERPRETED = type(_exponential_race_kernel).__name__ == "InterpretedFunction"


def exponential_race(probs: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """int64 [S]: per row of `probs` (fp32 [S, V], rows contiguous) the first index of the
    largest `probs / keyed_exponential(seeds, V)`; `seeds` int64 [S] on the same device.
    The contract of worker_svc/sampler.py's `exponential_race`, in one launch."""
    if probs.dim() != 2 or probs.dtype != torch.float32 or probs.stride(-1) != 1:
        raise ValueError(f"probs must be fp32 [S, V] with contiguous rows, got {probs.dtype} "
                         f"{tuple(probs.shape)} strides {probs.stride()}")
    if seeds.shape != probs.shape[:1] or seeds.dtype != torch.int64 or seeds.device != probs.device:
        raise ValueError(f"seeds must be int64 [{probs.shape[0]}] on {probs.device}, got {seeds.dtype} "
                         f"{tuple(seeds.shape)} on {seeds.device}")
    rows, vocab = probs.shape
    out = torch.empty(rows, dtype=torch.int64, device=probs.device)
    if rows and vocab:
        _exponential_race_kernel[(rows,)](probs, probs.stride(0), seeds.contiguous(), out, vocab,
                                          BLOCK=BLOCK, LIBDEVICE=not INTERPRETED, num_warps=8,
                                          enable_fp_fusion=False)
    elif rows:
        out.zero_()
    return out
