"""A co-located CPU load for benchmarks: one process spinning on each given core (pinned
there), as another tenant of a shared host would -- what a worker's compute threads must
live with (modeling/cpu_threads.py).

    with cpu_hogs([0]):   # core 0 taken for the duration
        ...
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

_SPIN = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


@contextmanager
def cpu_hogs(cpus: Sequence[int]) -> Iterator[None]:
    procs = [subprocess.Popen([sys.executable, "-c", _SPIN, str(cpu)]) for cpu in cpus]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
