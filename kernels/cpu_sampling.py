"""The cpu backend's sampling race: worker_svc/sampler.py's `exponential_race` in C.

The torch version makes the keyed Exp(1) noise as about ten elementwise passes over int64
[S, V] temporaries, then divides and reduces. On one CPU thread that was most of a sampled
step's sampling (~2.4 ms of a 64-row step over a 1,536-token vocabulary; 25 ms at 32 rows
of 32,000). This kernel (kernels/cpu_sampling.c) walks each row once, the noise in registers, and
skips the logarithm where it cannot matter, in chunks of 256 entries:

    u[i] = ((top 23 bits of splitmix64(seed, v)) + 0.5) * 2**-23      # exact in fp32; vectorized
    maybe[i] = not (p[v] * (1 + 2**-18) <= best * (1 - u[i]))          # vectorized; NaN stays in
    for the entries still in (tested again against the running best):
        x = p[v] / -logf(u)                         # a NaN counts as the largest
        if x > best: best, best_v = x, v            # strictly: ties keep the first

The bound is rigorous: -log(u) >= 1 - u, and the margin covers logf's error (within two
ulp), the division's rounding and the test's own, so a skipped entry's x is below `best`.
Those relative error bounds hold for normal floats, so nothing is skipped while `best` is
below 2**-100 (then every product the test makes is normal; a softmax row's best is far
above it: its winner's x is >= 1 / (17 V)).
Few entries pass it: an entry passes with probability about p / best, so a row computes
about 1 / best + log(V) logarithms in all.

Numerics: the noise's bits and u are exact, as in torch; `logf` is the C library's where
torch's CPU kernel uses its own vectorized log, and the two may differ in the last bit of
a few entries. A draw can then differ from the torch race's only where two entries' p / E
tie to the last bit (tests/unit/kernels/test_exponential_race.py compares them draw for draw).

Built and loaded as the attention kernel is (kernels/cpu_kernel_build.py's compile_library:
once per machine, cached, the binding generated from kernels/cpu_sampling.h).
"""

from pathlib import Path

import torch

from kernels.cpu_kernel_build import compile_library, import_library

_KERNEL_DIR = Path(__file__).resolve().parent
SOURCE = _KERNEL_DIR / "cpu_sampling.c"
HEADER = _KERNEL_DIR / "cpu_sampling.h"


class CpuRace:
    """The compiled race, loaded once per backend (per worker): call it as
    `exponential_race(probs, seeds)`. RuntimeError when it cannot be built."""

    def __init__(self, library: Path | None = None):
        torch.get_num_threads()  # torch's OpenMP runtime is loaded first; the kernel shares it
        module = import_library(library or compile_library(source=SOURCE, header=HEADER), SOURCE)
        self._kernel, ffi = module.lib.exponential_race, module.ffi
        self._floats, self._longs = ffi.typeof("float *"), ffi.typeof("int64_t *")
        self._cast = ffi.cast

    def __call__(self, probs: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
        """int64 [S]: per row of `probs` (fp32 [S, V] on the CPU, rows contiguous; finite
        or NaN) the first index of the largest `probs / keyed_exponential(seeds, V)`;
        `seeds` int64 [S]."""
        if (probs.dim() != 2 or probs.dtype != torch.float32 or probs.device.type != "cpu"
                or probs.stride(-1) != 1):
            raise ValueError(f"probs must be fp32 [S, V] on the CPU with contiguous rows, got "
                             f"{probs.dtype} {tuple(probs.shape)} on {probs.device} strides {probs.stride()}")
        if seeds.shape != probs.shape[:1] or seeds.dtype != torch.int64 or seeds.device.type != "cpu":
            raise ValueError(f"seeds must be int64 [{probs.shape[0]}] on the CPU, got {seeds.dtype} "
                             f"{tuple(seeds.shape)} on {seeds.device}")
        rows, vocab = probs.shape
        seeds = seeds.contiguous()
        out = torch.zeros(rows, dtype=torch.int64)
        if rows and vocab:
            torch.get_num_threads()  # sets this thread's OpenMP thread count to torch's
            self._kernel(self._cast(self._floats, probs.data_ptr()), probs.stride(0),
                         self._cast(self._longs, seeds.data_ptr()), self._cast(self._longs, out.data_ptr()),
                         rows, vocab)
        return out
