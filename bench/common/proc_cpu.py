"""CPU seconds (user + system) used by processes, read from /proc (Linux).

    before = cpu_by_process(server.pid)       # the server and every process under it
    ...                                       # the measured run
    used = cpu_used(before, cpu_by_process(server.pid))   # {"worker": 47.9, "gateway": 1.4, ...}

A process is named by what it runs: the service of `python -m compose.cli <service>`, the
module of `python -m <module>`, the script of `python <script>`, else its program's file
name (redis-server). Processes that end between the two readings are not counted.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process so far."""
    return _stat(pid)[1]


Reading = dict[tuple[int, int], tuple[str, float]]  # (pid, start time) -> (name, CPU seconds)


def cpu_by_process(root: int) -> Reading:
    """(name, CPU seconds so far) of `root` and all its descendants, by (pid, start time):
    a pid used again by a later process is another key."""
    table: dict[int, tuple[int, float, int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                table[int(entry)] = _stat(int(entry))
            except (OSError, IndexError, ValueError):  # ended meanwhile
                pass
    tree, grew = {root}, True
    while grew:
        grown = {pid for pid, (parent, _, _) in table.items() if parent in tree}
        grew = not grown <= tree
        tree |= grown
    named = {}
    for pid in tree & table.keys():
        try:
            name = process_name(Path(f"/proc/{pid}/cmdline").read_bytes())
        except OSError:
            continue
        named[(pid, table[pid][2])] = (name, table[pid][1])
    return named


def cpu_used(before: Reading, after: Reading) -> dict[str, float]:
    """CPU seconds used between two readings, summed by process name."""
    used: dict[str, float] = defaultdict(float)
    for key, (name, seconds) in after.items():
        used[name] += seconds - (before[key][1] if key in before else 0.0)
    return dict(used)


def process_name(cmdline: bytes) -> str:
    argv = [a.decode(errors="replace") for a in cmdline.split(b"\0") if a]
    if not argv:
        return "?"
    program = os.path.basename(argv[0].split(" ")[0])  # redis-server sets its title: "path host:port"
    if not program.startswith("python"):
        return program
    rest = argv[1:]  # what the interpreter runs, past its options (-u, -X opt, ...)
    while rest and rest[0].startswith("-") and rest[0] not in ("-m", "-c"):
        rest = rest[2:] if rest[0] in ("-X", "-W") else rest[1:]
    if len(rest) > 1 and rest[0] == "-m":
        return rest[2] if rest[1] == "compose.cli" and len(rest) > 2 else rest[1]
    return os.path.basename(rest[0]) if rest and rest[0] != "-c" else program


def _stat(pid: int) -> tuple[int, float, int]:
    """(parent pid, CPU seconds so far, start time in ticks) from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK, int(fields[19])
