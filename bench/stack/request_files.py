"""The project files whose code runs for one chat completion through the stack.

    python bench/stack/request_files.py [--model-dir models/tiny]

A measure of how many files a reader follows for one request (docs/architecture.md,
"One request's life"). Starts the stack (compose.launcher.Stack) with a hook in every
service process that records the file of every Python function called -- on any of its
threads -- between SIGUSR1 and SIGUSR2. After one warm-up request (so that first-use
imports and set-ups do not count) it records one `chat.completions.create` (n = 1,
non-streaming, 8 tokens, the official openai client) from just before it is sent until
the scheduler has acknowledged it, and prints the repository files each service ran
(tests, bench/ and generated protobuf modules left out), then their number. Background
loops that run meanwhile (worker discovery, heartbeats, stats) count too: they are part
of what serves a request.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the repository root on sys.path, this folder off it (bench/README.md)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent)]

import openai  # noqa: E402
import redis  # noqa: E402

from compose.launcher import Stack, StackConfig, free_port  # noqa: E402
from proto.keys import SCHEDULER_GROUP  # noqa: E402

SERVICES = ("gateway", "scheduler", "worker-0")

HOOK = textwrap.dedent('''
    """Installed by bench/stack/request_files.py through PYTHONPATH: records the file of every
    Python function called between SIGUSR1 and SIGUSR2, then writes them to a file."""
    import os, signal, sys, threading

    _files, _on = set(), [False]

    def _profile(frame, event, arg):
        if _on[0] and event == "call":
            _files.add(frame.f_code.co_filename)

    def _start(*_):
        _files.clear()
        _on[0] = True

    def _stop(*_):
        _on[0] = False
        path = os.path.join(os.environ["PAGEDSERVE_TRACE_DIR"], f"{os.getpid()}.txt")
        with open(path + ".part", "w") as f:
            f.write("\\n".join(sorted(_files)))
        os.replace(path + ".part", path)

    if os.environ.get("PAGEDSERVE_TRACE_DIR"):
        sys.setprofile(_profile)
        threading.setprofile(_profile)
        signal.signal(signal.SIGUSR1, _start)
        signal.signal(signal.SIGUSR2, _stop)
''')


def project_file(path: str) -> str | None:
    """`path` relative to the repository if it is one of its source files we count."""
    if not os.path.isabs(path):  # "<frozen abc>", "<string>": not a file
        return None
    try:
        rel = Path(path).resolve().relative_to(ROOT)
    except ValueError:
        return None
    first = rel.parts[0]
    if first.startswith(".") or first in ("tests", "bench") or rel.name.endswith(("_pb2.py", "_pb2_grpc.py")):
        return None
    return str(rel)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default="models/tiny", help="made with `pagedserve make-model` if missing")
    args = p.parse_args(argv)
    model = Path(args.model_dir)
    if not (model / "config.json").exists():
        from tools.make_model import make_model
        make_model(model, preset="tiny", seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        hook_dir, trace_dir = Path(tmp, "hook"), Path(tmp, "trace")
        hook_dir.mkdir()
        trace_dir.mkdir()
        (hook_dir / "sitecustomize.py").write_text(HOOK)
        config = StackConfig(model=str(model), port=free_port(), run_dir=Path(tmp, "run"),
                             worker_args=("--threads", "1"),
                             env={"PYTHONPATH": str(hook_dir), "PAGEDSERVE_TRACE_DIR": str(trace_dir)})
        with Stack(config) as stack:
            client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
            messages = [{"role": "user", "content": "Once upon a time"}]

            def one_request() -> None:
                client.chat.completions.create(model=stack.served_model_name, messages=messages,
                                               max_tokens=8, temperature=0.0)
                wait_acknowledged(stack)

            one_request()  # warm-up
            pids = {name: stack.procs[name].pid for name in SERVICES}
            for pid in pids.values():
                os.kill(pid, signal.SIGUSR1)
            time.sleep(0.5)  # the signals are handled
            one_request()
            for pid in pids.values():
                os.kill(pid, signal.SIGUSR2)
            files = {name: read_trace(trace_dir / f"{pid}.txt") for name, pid in pids.items()}
    every = set()
    for name, ran in files.items():
        print(f"{name}: {len(ran)} files\n  " + "\n  ".join(ran))
        every.update(ran)
    print(f"{len(every)} files in all")
    return 0


def wait_acknowledged(stack: Stack, timeout: float = 30.0) -> None:
    """Until the scheduler has acknowledged every request it read (no entry pending)."""
    client = redis.Redis.from_url(stack.redis_url)
    deadline = time.monotonic() + timeout
    try:
        while client.xpending(stack.keys.requests, SCHEDULER_GROUP)["pending"]:
            if time.monotonic() > deadline:
                raise TimeoutError("the request was not acknowledged")
            time.sleep(0.05)
    finally:
        client.close()


def read_trace(path: Path, timeout: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no trace at {path}")
        time.sleep(0.05)
    return sorted({f for line in path.read_text().splitlines() if (f := project_file(line))})


if __name__ == "__main__":
    sys.exit(main())
