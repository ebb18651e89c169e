"""The in-process engine: BatchScheduler + ModelRunner driven in one process.

No Redis and no gRPC: requests go straight into the scheduler core, steps straight into
the runner, events straight back to the caller. Tests use it to check scheduling against a
real model quickly, and `bench/` uses it as the yardstick for what the service split
costs (the same cores, minus the transport).

The engine loads the model and runs its loop on one background thread, the same one
(worker_svc/compute_thread.py says why), so the caller's asyncio loop stays free for HTTP;
submissions and aborts cross over through a lock-protected inbox, events go out
through a callback the caller supplies (`on_events`, called on the engine thread).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from proto.messages import NewRequest, TokenEvent, WorkerStats
from scheduler_svc.policy.batching import BatchScheduler
from scheduler_svc.policy.config import SchedulerConfig
from scheduler_svc.metrics import WorkerRecorder
from scheduler_svc.metrics import worker_stats
from worker_svc.compute_thread import ComputeThread
from worker_svc.config import RunnerConfig
from worker_svc.model_runner import ModelRunner
from worker_svc.step_gap import StepGap

log = logging.getLogger("pagedserve.engine")

STATS_INTERVAL_S = 1.0

EventSink = Callable[[dict[str, list[TokenEvent]]], None]


def _log_crash(loop: Future) -> None:
    """The engine loop ends only when stopped; anything else it raised must not go unseen."""
    if not loop.cancelled() and loop.exception() is not None:
        log.error("the engine loop died", exc_info=loop.exception())


@dataclass(frozen=True)
class EngineConfig:
    runner: RunnerConfig
    batching: SchedulerConfig = field(default_factory=SchedulerConfig)


class InProcessEngine:
    def __init__(self, config: EngineConfig, on_events: EventSink):
        self._compute = ComputeThread("engine")
        self.runner = self._compute.setup(ModelRunner, config.runner, worker_id="in-process")
        self.info = info = self.runner.describe()
        self.scheduler = BatchScheduler.for_worker(config.batching, info)
        self._on_events = on_events
        self._inbox: list[NewRequest | str] = []  # NewRequest to add, str = request id to abort
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._loop: Future | None = None  # the engine loop, once started
        self.stats: WorkerStats | None = None  # refreshed on the engine thread, read anywhere
        self.recorder = WorkerRecorder()  # request phases and steps, in stats as the service's
        self._gap = StepGap()  # the engine thread's idle between steps, as a worker's
        self._stats_at = 0.0

    # ---- called from any thread ------------------------------------------------------

    def start(self) -> None:
        self._loop = self._compute.submit(self._run)
        self._loop.add_done_callback(_log_crash)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._compute.close(timeout=30)

    def submit(self, request: NewRequest) -> None:
        with self._lock:
            self._inbox.append(request)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._inbox.append(request_id)
        self._wake.set()

    # ---- the engine thread -----------------------------------------------------------

    def _drain_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            self._wake.clear()
        for item in inbox:
            if isinstance(item, str):
                self.scheduler.abort_request(item)
                continue
            error = self.scheduler.add_request(item)
            if error is not None:
                self._on_events({item.reply_channel: [error]})

    def _refresh_stats(self, idle: bool) -> None:
        """The same WorkerStats the scheduler service writes to Redis, about once a second."""
        now = time.monotonic()
        if not idle and now - self._stats_at < STATS_INTERVAL_S:
            return
        self._stats_at = now
        self.stats = worker_stats(self.scheduler, self.info.worker_id, check=idle, recorder=self.recorder)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._run_once()
            except Exception:  # a bug anywhere in a step: fail what it held, keep serving
                log.exception("engine loop failed")
                try:
                    self._fail(self.scheduler.drain(), "the engine failed; see the server log")
                except Exception:
                    log.exception("failing the engine's requests failed too")

    def _run_once(self) -> None:
        self._drain_inbox()
        step = self.scheduler.schedule()
        if step is None:
            self._refresh_stats(idle=True)
            self._wake.wait(timeout=STATS_INTERVAL_S)
            return
        self._refresh_stats(idle=False)
        self.recorder.scheduled(self.scheduler, step)
        try:
            gap = self._gap.start()
            output = self.runner.step(step)
            self._gap.end(step, output.result, gap)
        except Exception:  # fail what ran, keep serving the rest
            log.exception("step %d failed", step.step_id)
            self._fail(self.scheduler.drain(), "the model step failed; see the server log")
            return
        if output.events:
            self._on_events(output.events)
        finished = self.scheduler.update(step, output.result)
        self.recorder.stepped(self.scheduler, step, output.result, finished)

    def is_alive(self) -> bool:
        """True while the engine loop runs."""
        return self._loop is not None and not self._loop.done()

    def _fail(self, states, message: str) -> None:
        events: dict[str, list[TokenEvent]] = {}
        for state in states:
            events.setdefault(state.reply_channel, []).append(TokenEvent(
                state.request_id, index=state.num_output_tokens, finish_reason="error", error=message))
        if events:
            self._on_events(events)
