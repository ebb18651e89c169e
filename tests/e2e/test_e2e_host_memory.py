"""glibc's malloc in the model processes (worker_svc/host_memory.py): `pagedserve engine`
started as a process starts over in the malloc environment, a `pagedserve gateway` is left as
it was started. The environment itself, and what it does to freed tensors:
tests/unit/worker_svc/test_host_memory.py."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.unit.worker_svc.test_host_memory import glibc_only, plain_environment
from worker_svc.host_memory import REEXEC_MARKER

ROOT = Path(__file__).resolve().parents[2]


@glibc_only
@pytest.mark.parametrize("command", ["engine", "gateway"])
def test_model_commands_start_over_in_the_malloc_environment(tiny_model_dir, command):
    """The engine's process (same pid) runs with MALLOC_TUNABLES; a gateway, which runs no
    model, is left as it was started."""
    from compose.launcher import free_port

    proc = subprocess.Popen([sys.executable, "-m", "compose.cli", command, "--model", str(tiny_model_dir),
                             "--port", str(free_port()), "--redis-url", "redis://127.0.0.1:1/0"],
                            cwd=ROOT, env=plain_environment(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # the engine starts over right after parsing its flags; the gateway is given 3 s
        deadline = time.monotonic() + (30 if command == "engine" else 3)
        environ = b""
        while time.monotonic() < deadline and b"GLIBC_TUNABLES" not in environ:
            time.sleep(0.1)
            assert proc.poll() is None, f"{command} exited with {proc.returncode}"
            environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
        # (some glibc versions cut the variable in /proc after its first tunable as they parse it)
        tunables = [v for v in environ.split(b"\0") if v.startswith(b"GLIBC_TUNABLES=")]
        if command == "engine":
            assert len(tunables) == 1 and tunables[0].startswith(b"GLIBC_TUNABLES=glibc.malloc.")
            assert f"{REEXEC_MARKER}=1".encode() in environ.split(b"\0")
        else:
            assert tunables == []
    finally:
        proc.kill()
        proc.wait(timeout=10)
