"""How many threads a CPU worker computes with: what the process may use, and what the other
processes on its CPUs leave it.

At start (`choose_threads`): `--threads N` (or PAGEDSERVE_THREADS) when given; else the CPUs
the process may run on (`os.sched_getaffinity`: taskset, cpusets, Kubernetes' static CPU
manager) capped by its cgroup's CPU quota (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us` /
`cpu.cfs_period_us`: `docker run --cpus`, Kubernetes `resources.limits.cpu`), rounded down,
at least one. torch's own default counts the host's cores, quota or not: a worker limited
to one CPU of two then runs two threads that the CFS throttles in turn.

While serving (`CpuShare`, when the count was not given): the threads of one parallel
region wait for each other at its end, so a thread whose core another process took stalls
every region (hundreds a step) for a scheduler time slice. Between steps, about once a
second, the worker reads how busy its CPUs were (/proc/stat, steal included) against its own
CPU time: what other processes took, in cores, leaves `allowed - taken`, and the worker
computes with that many threads (rounded, at least one) once `DOWN_READINGS` readings in a
row ask for fewer (a neighbour's burst of a few seconds, such as a client starting, is not
worth halving the threads for) or `UP_READINGS` ask for more.
"""

from __future__ import annotations

import logging
import math
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
DOWN_READINGS = 4  # one-second readings in a row that ask for fewer threads before the worker drops one
UP_READINGS = 2


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
    """Between steps, `threads()` says how many threads to compute with now, from what
    other processes took of the `choice.allowed` CPUs over the last `interval_s` (None:
    keep the current count). Reading the counters costs tens of microseconds, once per
    interval."""

    def __init__(self, choice: ThreadChoice, cpus: set[int] | None = None, interval_s: float = 1.0,
                 busy_seconds: Callable[[], float] | None = None,
                 own_seconds: Callable[[], float] = own_cpu_seconds,
                 clock: Callable[[], float] = time.monotonic):
        cpus = affinity_cpus() if cpus is None else cpus
        self._allowed = choice.allowed
        self.current = choice.threads
        self._interval_s = interval_s
        self._busy = busy_seconds or (lambda: read_busy_seconds(cpus))
        self._own, self._clock = own_seconds, clock
        self._last = self._sample()
        self._pending: int | None = None  # the count the last readings asked for
        self._readings = 0  # how many in a row
        self.taken = 0.0  # cores other processes took over the last interval

    def _sample(self) -> _Sample:
        return _Sample(self._clock(), self._busy(), self._own())

    def threads(self) -> int | None:
        now = self._clock()
        if now - self._last.wall < self._interval_s:
            return None
        sample = self._sample()
        elapsed = sample.wall - self._last.wall
        others = (sample.busy - self._last.busy) - (sample.own - self._last.own)
        self._last = sample
        self.taken = max(0.0, others / elapsed)
        want = max(1, min(self._allowed, round(self._allowed - self.taken)))
        if want == self.current:
            self._pending, self._readings = None, 0
            return None
        if self._pending != want:
            self._pending, self._readings = want, 0
        self._readings += 1
        if self._readings < (DOWN_READINGS if want < self.current else UP_READINGS):
            return None
        self._pending, self._readings = None, 0
        log.info("compute threads %d -> %d: other processes took %.2f of %d CPUs",
                 self.current, want, self.taken, self._allowed)
        self.current = want
        return want
