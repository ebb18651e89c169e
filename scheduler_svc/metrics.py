"""What the scheduler measures for Prometheus, beside BatchScheduler.stats()' accounting.

Per worker, a `WorkerRecorder` (held by the service's WorkerHandle, or by the in-process
engine) times each request's phases as vLLM names them, from two hooks around a step:

    step = scheduler.schedule()
    recorder.scheduled(scheduler, step)                   # arrival → first scheduled
    result = <the worker runs the step>
    finished = scheduler.update(step, result)
    recorder.stepped(scheduler, step, result, finished)   # first token; finished; the step

  queue time      NewRequest.arrival_time (the gateway's clock) → first scheduled here
  prefill time    first scheduled → first token
  decode time     first token → finished by the worker ("stop" / "length")
  inference time  first scheduled → finished

Each StepResult that carries `images` (a vision worker's step that computed image soft
tokens) adds them to an EncoderRecorder: the worker's image counters, in WorkerStats.vision.

A preempted request keeps its first times (it is not queued again); the n children of a
forked request are timed from their parent's scheduling (each is a sequence; the parent is
not). A request re-routed after its worker died is timed afresh on its new worker. Both
hooks cost O(requests in the step); `snapshot` (about once a second) also drops the times of
requests gone without finishing (aborted), O(requests timed).

`SchedulerMetrics` is the scheduler's own /metrics: the WorkerStats it last wrote for each
live worker, rendered by proto/metrics.py, the renderer the gateway uses for the same stats.
"""

from __future__ import annotations

import time
from dataclasses import asdict

from proto import worker_pb2
from proto.messages import RequestHistograms, StepHistograms, VisionStats, WorkerStats
from proto.metrics import (REQUEST_SECONDS, EncoderRecorder, Health, HistogramRecorder, MetricsServer,
                           StepRecorder, WorkerStatsCollector, serve_metrics)


class WorkerRecorder:
    def __init__(self) -> None:
        self.queue_time = HistogramRecorder(REQUEST_SECONDS)
        self.prefill_time = HistogramRecorder(REQUEST_SECONDS)
        self.decode_time = HistogramRecorder(REQUEST_SECONDS)
        self.inference_time = HistogramRecorder(REQUEST_SECONDS)
        self.steps = StepRecorder()
        self.images: EncoderRecorder | None = None  # from the first step with images (a vision worker's)
        self._scheduled_at: dict[str, float] = {}  # request id → first scheduled (time.time())
        self._first_token_at: dict[str, float] = {}

    def scheduled(self, scheduler, step: worker_pb2.StepRequest) -> None:
        """Right after `scheduler.schedule()` returned `step`: its new requests are scheduled now."""
        now = time.time()
        for new in step.new_requests:
            rid = new.request_id
            req = scheduler.get_request(rid)
            if rid in self._scheduled_at or req is None:  # re-admitted after a preemption
                continue
            at = self._scheduled_at.get(req.parent_id, now) if req.parent_id is not None else now
            self._scheduled_at[rid] = at
            if req.n == 1:  # a parent of n > 1 is not a sequence; its children are
                self.queue_time.observe(max(0.0, at - req.arrival_time))

    def stepped(self, scheduler, step: worker_pb2.StepRequest, result: worker_pb2.StepResult,
                finished) -> None:
        """Right after `scheduler.update(step, result)` returned `finished`."""
        now = time.time()
        self.steps.observe(step, result)
        if result.HasField("images"):
            if self.images is None:
                self.images = EncoderRecorder()
            self.images.observe_step(result.images)
        scheduled_at, first_token_at = self._scheduled_at, self._first_token_at
        for sampled in result.sampled:
            rid = sampled.request_id
            if rid not in first_token_at and rid in scheduled_at:
                first_token_at[rid] = now
                self.prefill_time.observe(now - scheduled_at[rid])
        for req in finished:
            at = scheduled_at.pop(req.request_id, None)
            token_at = first_token_at.pop(req.request_id, None)
            if at is not None and token_at is not None:
                self.decode_time.observe(now - token_at)
                self.inference_time.observe(now - at)

    def snapshot(self, scheduler) -> tuple[RequestHistograms, StepHistograms]:
        """The histograms now; forgets the times of requests that left `scheduler`
        unfinished (a forked parent stays while it has children: they inherit its time)."""
        gone = [rid for rid in self._scheduled_at
                if scheduler.get_request(rid) is None and not scheduler.has_children(rid)]
        for rid in gone:
            del self._scheduled_at[rid]
            self._first_token_at.pop(rid, None)
        requests = RequestHistograms(
            queue_time=self.queue_time.snapshot(), prefill_time=self.prefill_time.snapshot(),
            decode_time=self.decode_time.snapshot(), inference_time=self.inference_time.snapshot())
        return requests, self.steps.snapshot()

    def images_snapshot(self) -> VisionStats | None:
        """The images of the worker's steps so far (StepResult.images summed); None until one had any."""
        return self.images.snapshot() if self.images is not None else None

    @property
    def num_timed(self) -> int:
        """Requests whose times are kept (for tests: nothing leaks)."""
        return len(self._scheduled_at)


class SchedulerMetrics:
    """The latest WorkerStats of each live worker, as the scheduler's /metrics renders them."""

    def __init__(self) -> None:
        self.collector = WorkerStatsCollector()
        self._latest: dict[str, WorkerStats] = {}

    def publish(self, stats: WorkerStats) -> None:
        self._latest[stats.worker_id] = stats
        self.collector.snapshot = list(self._latest.values())  # replaced whole: scrapes run on a thread

    def forget_worker(self, worker_id: str) -> None:
        self._latest.pop(worker_id, None)
        self.collector.snapshot = list(self._latest.values())

    def serve(self, host: str, port: int, health: Health | None = None) -> MetricsServer | None:
        return serve_metrics(self.collector, host, port, health)


def worker_stats(scheduler, worker_id: str, check: bool, recorder: WorkerRecorder) -> WorkerStats:
    """`scheduler`'s accounting and `recorder`'s histograms
    as the WorkerStats message; with `check`, after running check_integrity() (O(blocks):
    callers do it when idle) and recording its complaint."""
    problem = None
    if check:
        try:
            scheduler.check_integrity()
        except AssertionError as exc:
            problem = str(exc) or "check_integrity failed"
    requests, steps = recorder.snapshot(scheduler)
    return WorkerStats(worker_id=worker_id, integrity_error=problem, updated_at=time.time(),
                       requests=requests, steps=steps, vision=recorder.images_snapshot(),
                       **asdict(scheduler.stats()))
