"""Large tensors without page faults: glibc's malloc set to keep the memory a step frees.

glibc serves an allocation of 32 MiB or more with a fresh mmap (in a thread's own arena,
anything over its 64 MiB heaps too) and gives it back to the kernel when it is freed; and
torch allocates with posix_memalign, whose small leftover chunks go to the thread cache
(tcache), where they keep a freed chunk from merging with its neighbours, so a tensor of
the same size rarely fits in it again. A worker's steps make such tensors every time --
[64, 151936] fp32 logits (39 MB), a 2048-token prefill's MLP activations ([2048, 17920]
bf16 on Qwen2.5-1.5B, 73 MB) -- and the kernel zero-fills each of their pages on first
touch, step after step: a bf16 -> fp32 copy of those logits took 11 ms instead of 1.5, and a
2048-token prefill step of Qwen2.5-1.5B's shapes 7.3-7.7 s instead of 6.6-6.7 s
(docs/performance.md, "Large tensors without page faults").

MALLOC_TUNABLES is glibc's fix, in its own words (GLIBC_TUNABLES, read when a process
starts): no thread cache, every thread on the main arena (whose heap has no size limit), and
a freed block of less than 1 GiB kept in the heap, not unmapped or trimmed. The process's
resident memory then stays at the peak of a step instead of falling back between steps --
what tcmalloc and jemalloc do too, which vLLM's CPU backend preloads for the same reason.

`pagedserve worker` and `pagedserve engine` on the CPU start over in that environment
(`run_with_malloc_tunables`: the same command line, the same process id, right after the
flags are parsed; on a GPU the large tensors are the device's), once: REEXEC_MARKER says a
process did, whatever glibc made of GLIBC_TUNABLES (a secure-execution process may have it
removed). bench/compute/roofline.py does the same on the CPU, to measure what the worker runs. The
environment wins where it tunes malloc itself (a MALLOC_* variable, or glibc.malloc in
GLIBC_TUNABLES: MALLOC_ARENA_MAX=8, say, keeps glibc's own settings with at most 8
arenas), and nothing changes where the C library is not glibc. Measured with glibc 2.36;
an older glibc may refuse the 1 GiB mmap threshold (the other settings still hold).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

KEEP_BYTES = 1 << 30  # a freed block below this size stays in the heap
REEXEC_MARKER = "PAGEDSERVE_MALLOC_SET"  # set in the environment a process starts over in
MALLOC_TUNABLES = ":".join([
    "glibc.malloc.tcache_count=0",
    "glibc.malloc.arena_max=1",
    f"glibc.malloc.mmap_threshold={KEEP_BYTES}",
    f"glibc.malloc.trim_threshold={KEEP_BYTES}",
])


def user_tunes_malloc(environ: Mapping[str, str]) -> bool:
    """Whether the environment sets glibc's malloc parameters itself."""
    return (any(name.startswith("MALLOC_") for name in environ)
            or "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""))


def this_libc() -> str:
    """'glibc' where this process runs on glibc, else ''."""
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION") or ""  # "glibc 2.36"
    except (ValueError, OSError):  # a C library that does not know the name
        return ""
    return version.split()[0] if version.startswith("glibc") else ""


def malloc_environment(environ: Mapping[str, str], libc: str | None = None) -> dict[str, str] | None:
    """`environ` with MALLOC_TUNABLES added to GLIBC_TUNABLES (after any tunables it has)
    and REEXEC_MARKER set, or None where it is to stay as it is: the process started over
    already, the environment tunes malloc, or the C library (`libc`: default, this
    process's) is not glibc."""
    libc = this_libc() if libc is None else libc
    if REEXEC_MARKER in environ or libc != "glibc" or user_tunes_malloc(environ):
        return None
    tunables = ":".join(filter(None, [environ.get("GLIBC_TUNABLES", ""), MALLOC_TUNABLES]))
    return {**environ, "GLIBC_TUNABLES": tunables, REEXEC_MARKER: "1"}


def run_with_malloc_tunables(device: str) -> None:
    """For a process that computes on `device`: on the CPU, start it over in
    malloc_environment (the same command line, the same process id; never returns then);
    return where the environment stays as it is, or on another device (its large tensors
    are the device's). Call it first thing in a process's entry point, before any thread
    starts."""
    environ = malloc_environment(os.environ) if device == "cpu" else None
    if environ is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, sys.orig_argv, environ)
