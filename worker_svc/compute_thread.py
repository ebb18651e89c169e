"""The one thread of a process that runs torch: it loads the model and runs every step.

Why one, and the same one for loading as for stepping: torch's CPU kernels run on
OpenMP (libgomp), which keeps a team of compute threads per thread that calls into it,
and counts every thread of every team. While that count is at most the number of CPUs,
an idle team thread spins waiting for the next parallel region (300,000 iterations by
default, GOMP_SPINCOUNT in the GCC manual); above it, libgomp throttles the spin to 1,000,
so between any two of the hundreds of parallel regions in a step the team thread goes to
sleep and must be woken by a futex call. A model loaded on the main thread and stepped on another leaves two
teams (four threads on two cores): measured on a 2-core VM, the worker's 256-token prefill
took 18-28% longer than the same step in a bare process (three interleaved runs of 20);
with the loading moved onto the step thread, within 1%.

    compute = ComputeThread("step")
    runner = compute.call(ModelRunner, config)   # the team is born here ...
    output = compute.call(runner.step, request)  # ... and reused by every step
    compute.close()
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent import futures
from typing import TypeVar

T = TypeVar("T")


class ComputeThread:
    """One daemon thread running what is submitted, in order: `call` runs a function on it
    and returns its result (or raises its exception) in the caller; `submit` returns the
    future instead. Daemon, so a loop left running on it never holds up the interpreter's
    exit."""

    def __init__(self, name: str = "compute"):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._lock = threading.Lock()  # a submit never lands behind close()'s stop marker
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args, **kwargs) -> futures.Future[T]:
        future: futures.Future[T] = futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._thread.name}: submit after close")
            self._queue.put((future, fn, args, kwargs))
        return future

    def call(self, fn: Callable[..., T], *args, **kwargs) -> T:
        return self.submit(fn, *args, **kwargs).result()

    def setup(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """`call` for what the thread exists for (loading the model): if it raises, or the
        caller is interrupted (Ctrl-C mid-load), the thread is closed without waiting."""
        try:
            return self.call(fn, *args, **kwargs)
        except BaseException:
            self.close(timeout=0)
            raise

    def close(self, timeout: float | None = None) -> None:
        """Let what was submitted finish (up to `timeout` seconds), then end the thread."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._queue.put(None)
        self._thread.join(timeout)

    def _serve(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # handed to the caller, whatever it is
                future.set_exception(exc)
