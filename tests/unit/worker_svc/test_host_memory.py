"""glibc's malloc in the model processes (worker_svc/host_memory.py): large tensors freed by
one step are reused by the next instead of page-faulting again; the environment's own
malloc settings win. `pagedserve worker|engine` start over in that environment:
tests/e2e/test_e2e_host_memory.py."""

import os
import subprocess
import sys

import pytest

from worker_svc.host_memory import (MALLOC_TUNABLES, REEXEC_MARKER, malloc_environment, this_libc,
                                    user_tunes_malloc)

glibc_only = pytest.mark.skipif(this_libc() != "glibc", reason="glibc's malloc")

# In a thread (as the worker's compute thread), tensors of 80 MB -- over glibc's 32 MiB mmap
# threshold and over a thread arena's 64 MiB heap -- made and freed as steps do; prints the
# page faults of the last five.
FAULTS = """
import resource, threading, torch
def steps(out):
    for _ in range(2):
        torch.empty(80 << 20, dtype=torch.uint8).fill_(1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        torch.empty(80 << 20, dtype=torch.uint8).fill_(1)
    out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
out = []
thread = threading.Thread(target=steps, args=(out,))
thread.start()
thread.join()
print(out[0])
"""


def page_faults(env: dict[str, str]) -> int:
    proc = subprocess.run([sys.executable, "-c", FAULTS], env=env, capture_output=True, text=True,
                          timeout=120, check=True)
    return int(proc.stdout.split()[-1])


def plain_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", REEXEC_MARKER)}


@glibc_only
def test_freed_large_tensors_are_reused_without_page_faults():
    plain = plain_environment()
    tuned = malloc_environment(plain)
    assert tuned is not None
    pages = 5 * (80 << 20) // 4096
    assert page_faults(tuned) < pages // 20  # every byte reused
    assert page_faults(plain) > pages // 2  # glibc's defaults: most of it faulted in again


def test_the_environment_s_own_malloc_settings_win():
    assert malloc_environment({"MALLOC_ARENA_MAX": "8"}, libc="glibc") is None
    assert malloc_environment({"MALLOC_MMAP_THRESHOLD_": "65536"}, libc="glibc") is None
    assert malloc_environment({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=7"}, libc="glibc") is None
    assert malloc_environment({"PATH": "/bin"}, libc="musl") is None
    assert malloc_environment({"PATH": "/bin"}, libc="") is None
    assert malloc_environment({"PATH": "/bin"}, libc="glibc") == {
        "PATH": "/bin", "GLIBC_TUNABLES": MALLOC_TUNABLES, REEXEC_MARKER: "1"}
    # other tunables are kept, ours after them
    other = malloc_environment({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"}, libc="glibc")
    assert other == {"GLIBC_TUNABLES": f"glibc.pthread.rseq=0:{MALLOC_TUNABLES}", REEXEC_MARKER: "1"}
    assert user_tunes_malloc(other)
    # started over once, never again: even where glibc removed GLIBC_TUNABLES (secure execution)
    assert malloc_environment({REEXEC_MARKER: "1"}, libc="glibc") is None
