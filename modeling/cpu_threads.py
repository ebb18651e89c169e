"""How many threads a CPU worker computes with (and an encoder service, at start): what the
process may use, and what the other processes on its CPUs leave it.

At start (`choose_threads`): `--threads N` (or PAGEDSERVE_THREADS) when given; else the CPUs
the process may run on (`os.sched_getaffinity`: taskset, cpusets, Kubernetes' static CPU
manager) capped by its cgroup's CPU quota (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us` /
`cpu.cfs_period_us`: `docker run --cpus`, Kubernetes `resources.limits.cpu`), rounded down,
at least one. torch's own default counts the host's cores, quota or not: a worker limited
to one CPU of two then runs two threads that the CFS throttles in turn.

While serving (`CpuShare`, when the count was not given): the threads of one parallel
region wait for each other at its end, so a thread whose core another process took stalls
every region (hundreds a step) for a scheduler time slice -- a step of a few hundred
milliseconds alone then takes tens of seconds. A thread of the worker's own reads, every
`READING_S`, how busy its CPUs were (/proc/stat, steal included) against the process's own
CPU time: what other processes took, in cores, leaves `allowed - taken`, and that many threads
(rounded, at least one) become the target once the readings have asked for that count long
enough: `DOWN_WHOLE_S` when others held whole cores all along (a CPU hog, a busy benchmark
client), `DOWN_S` when they took part of one (a client's start-up burst of a few seconds is
not worth halving the threads for), `UP_S` to take a thread back. It reads while the worker
is idle too, so the first step of a burst of requests already computes with what the other
processes leave. The compute thread takes up the target between steps (`threads()`).
"""

from __future__ import annotations

import logging
import math
import os
import resource
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
READING_S = 0.5  # how often the counters are read (between steps)
DOWN_WHOLE_S = 1.0  # readings in a row asking for fewer threads, others holding whole cores
DOWN_S = 4.0  # the same, others taking part of a core (a client starting: 0.75 of one for ~2 s)
UP_S = 2.0  # readings in a row asking for more threads
WHOLE = 0.9  # others "hold whole cores" when they take at least this much of each thread given up


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    allowed: int  # CPUs the process may use (affinity and quota)
    why: str
    fixed: bool  # given by the user: never changed while serving


def affinity_cpus() -> set[int]:
    return set(os.sched_getaffinity(0))


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, self_cgroup: str | None = None) -> float | None:
    """The CPUs' worth of time the process's cgroup (or an ancestor) allows per period, or
    None when unlimited. `self_cgroup`: /proc/self/cgroup's text (read when None)."""
    if self_cgroup is None:
        try:
            self_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            self_cgroup = ""
    limits = []
    for line in self_cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # v2: cpu.max in the unified tree
            for d in _dirs(root, root / "unified", path):
                limits.append(_v2_quota(d / "cpu.max"))
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's hierarchy
            for base in (root / controllers, root / "cpu", root / "cpu,cpuacct"):
                for d in _dirs(base, None, path):
                    limits.append(_v1_quota(d))
    found = [q for q in limits if q is not None]
    return min(found) if found else None


def _dirs(root: Path, alt: Path | None, path: str) -> list[Path]:
    """The cgroup's directory and its ancestors up to the mount (inside a container the
    mount is the container's own cgroup: `root` itself)."""
    out = []
    for base in (root, alt):
        if base is None:
            continue
        d = base / path.strip("/")
        while True:
            out.append(d)
            if d == base:
                break
            d = d.parent
    return out


def _v2_quota(cpu_max: Path) -> float | None:
    try:
        quota, period = cpu_max.read_text().split()
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(d: Path) -> float | None:
    try:
        quota = int((d / "cpu.cfs_quota_us").read_text())
        period = int((d / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 else quota / period


def choose_threads(requested: int | None, cpus: set[int] | None = None,
                   quota: float | None | str = "read") -> ThreadChoice:
    """The threads to start with, and why (`cpus`, `quota`: read from the process when not
    given; quota None: unlimited)."""
    cpus = affinity_cpus() if cpus is None else cpus
    quota = cgroup_cpu_quota() if quota == "read" else quota
    allowed = len(cpus) if quota is None else max(1, min(len(cpus), math.floor(quota + 1e-9)))
    if requested:
        return ThreadChoice(requested, allowed, f"--threads {requested}", fixed=True)
    why = f"{len(cpus)} CPUs in the affinity mask"
    if quota is not None:
        why += f", a cgroup CPU quota of {quota:g}"
    return ThreadChoice(allowed, allowed, why, fixed=False)


@dataclass
class _Sample:
    wall: float
    busy: float  # seconds the process's CPUs were busy (any process), steal included
    own: float  # seconds of CPU the process used


def read_busy_seconds(cpus: set[int], proc_stat: Path = Path("/proc/stat")) -> float:
    """Seconds the CPUs in `cpus` spent on anything but idle and iowait since boot."""
    hz = os.sysconf("SC_CLK_TCK")
    busy = 0
    for line in proc_stat.read_text().splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        values = [int(v) for v in fields]
        busy += sum(values[:8]) - values[3] - values[4]  # user..steal without idle, iowait
    return busy / hz


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class CpuShare:
    """`read()` (every `interval_s`, on the thread `start()` runs) decides how many threads
    to compute with, from what other processes took of the `choice.allowed` CPUs; `threads()`
    (on the compute thread, between steps) says when to change to it (None: keep the
    current count). A reading costs tens of microseconds."""

    def __init__(self, choice: ThreadChoice, cpus: set[int] | None = None, interval_s: float = READING_S,
                 busy_seconds: Callable[[], float] | None = None,
                 own_seconds: Callable[[], float] = own_cpu_seconds,
                 clock: Callable[[], float] = time.monotonic):
        cpus = affinity_cpus() if cpus is None else cpus
        self._allowed = choice.allowed
        self.current = choice.threads  # the compute thread's count (threads() changes it)
        self.target = choice.threads  # what the readings decided (read() changes it)
        self._interval_s = interval_s
        self._busy = busy_seconds or (lambda: read_busy_seconds(cpus))
        self._own, self._clock = own_seconds, clock
        self._last = self._sample()
        self._pending: int | None = None  # the count the readings since `_since` ask for
        self._since = 0.0
        self._whole = True  # and whether others held whole cores in every one of them
        self.taken = 0.0  # cores other processes took over the last reading

    def _sample(self) -> _Sample:
        return _Sample(self._clock(), self._busy(), self._own())

    def read(self) -> None:
        """One reading: what others took since the last, and the target it leads to."""
        sample, start = self._sample(), self._last.wall
        if sample.wall <= start:
            return
        others = (sample.busy - self._last.busy) - (sample.own - self._last.own)
        self._last = sample
        self.taken = max(0.0, others / (sample.wall - start))
        want = max(1, min(self._allowed, round(self._allowed - self.taken)))
        if want == self.target:
            self._pending = None
            return
        whole = self.taken >= WHOLE * (self._allowed - want)
        if self._pending != want:
            self._pending, self._since, self._whole = want, start, whole
        self._whole = self._whole and whole
        need = UP_S if want > self.target else DOWN_WHOLE_S if self._whole else DOWN_S
        if sample.wall - self._since >= need - 1e-9:
            self._pending, self.target = None, want

    def threads(self) -> int | None:
        """The count to compute with from now on, when it changed; else None."""
        target = self.target
        if target == self.current:
            return None
        log.info("compute threads %d -> %d: other processes took %.2f of %d CPUs",
                 self.current, target, self.taken, self._allowed)
        self.current = target
        return target

    def start(self) -> threading.Thread:
        """Read every `interval_s` on a daemon thread, until this object is gone."""
        thread = threading.Thread(target=_read_while_alive, args=(weakref.ref(self), self._interval_s),
                                  name="cpu-share", daemon=True)
        thread.start()
        return thread


def _read_while_alive(ref: weakref.ref, interval_s: float) -> None:
    while True:
        time.sleep(interval_s)
        share = ref()
        if share is None:
            return
        share.read()
        del share
