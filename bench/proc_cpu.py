"""CPU seconds (user + system) used by processes, read from /proc (Linux).

    before = cpu_by_process(server.pid)       # the server and every process under it
    ...                                       # the measured run
    used = cpu_used(before, cpu_by_process(server.pid))   # {"worker": 47.9, "gateway": 1.4, ...}

A process is named by what it runs: the service of `python -m compose.cli <service>`, the
module of `python -m <module>`, the script of `python <script>`, else its program's file
name (redis-server). Processes that end between the two
readings are not counted.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process so far."""
    return _stat(pid)[1]


def cpu_by_process(root: int) -> dict[int, tuple[str, float]]:
    """{pid: (name, CPU seconds so far)} for `root` and all its descendants."""
    table: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                table[int(entry)] = _stat(int(entry))
            except (OSError, IndexError, ValueError):  # ended meanwhile
                pass
    tree, grew = {root}, True
    while grew:
        grown = {pid for pid, (parent, _) in table.items() if parent in tree}
        grew = not grown <= tree
        tree |= grown
    named = {}
    for pid in tree & table.keys():
        try:
            named[pid] = (process_name(Path(f"/proc/{pid}/cmdline").read_bytes()), table[pid][1])
        except OSError:
            pass
    return named


def cpu_used(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds used between two readings, summed by process name."""
    used: dict[str, float] = defaultdict(float)
    for pid, (name, seconds) in after.items():
        used[name] += seconds - (before[pid][1] if pid in before else 0.0)
    return dict(used)


def process_name(cmdline: bytes) -> str:
    argv = [a.decode(errors="replace") for a in cmdline.split(b"\0") if a]
    if not argv:
        return "?"
    if os.path.basename(argv[0]).startswith("python") and len(argv) > 1:  # what it runs
        if argv[1] == "-m" and len(argv) > 2:
            return argv[3] if argv[2] == "compose.cli" and len(argv) > 3 else argv[2]
        return os.path.basename(argv[1])
    return os.path.basename(argv[0].split(" ")[0])  # redis-server sets its title: "path host:port"


def _stat(pid: int) -> tuple[int, float]:
    """(parent pid, CPU seconds so far) from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK
