"""The Prometheus face of the stats messages: every metric the scheduler's and the workers'
messages carry, named once here, and the one renderer of them that every service uses.

    HistogramRecorder   a fixed-bucket histogram, O(log buckets) per observe; its
                        snapshot() is the `Histogram` message that travels in WorkerStats
    StepRecorder        one worker's steps: duration (and its forward and sampling),
                        requests, tokens, the gap before each (StepHistograms)
    EncoderRecorder     a vision worker's images: encoded, encoder-cache hits, seconds
                        of each step's encoding (the worker's own /metrics only)
    WorkerStatsCollector  renders WorkerStats (the scheduler's per-worker accounting and
                        histograms) at the scheduler's /metrics and the gateway's, and at
                        the gateway's the encoder services' EncoderStats too
    vision_families     the image counters of workers and encoder services (VisionStats,
                        EncoderStats), one renderer for every /metrics that shows them
    StepCollector       renders a worker's own StepRecorder (and EncoderRecorder) at the
                        worker's /metrics
    serve_metrics       a /metrics HTTP server for a registry (scheduler, worker)

Names follow vLLM's (`vllm:x` → `pagedserve:x`) where they mean the same; every series is
labelled `worker` (an encoder service's: `encoder`). docs/metrics.md ("Metrics") lists them all, with the gateway's own.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator, Sequence

import json
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily,
                                    Metric)

from proto import worker_pb2
from proto.encoder_messages import EncoderStats
from proto.messages import Histogram, StepHistograms, VisionStats, WorkerStats

# Seconds of a request phase, and of a whole request (vLLM's request_latency_buckets, with
# finer ones below 0.3 s for fast prefills and GPUs).
REQUEST_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0,
                   15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Seconds between tokens or of one step (vLLM's inter-token buckets, finer below 10 ms).
TOKEN_SECONDS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# Time to first token (vLLM's buckets).
FIRST_TOKEN_SECONDS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                       5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# Idle seconds between two steps (finer still: a GPU step is a few milliseconds).
GAP_SECONDS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1,
               0.25, 1.0)
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
STEP_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class HistogramRecorder:
    """Counts per bucket and the sum. observe() is one bisect and two adds; one thread
    observes (a worker's steps are serialised, a scheduler's loop is one thread)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]):
        self.bounds = list(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += times  # le: value <= bound
        self.sum += value * times

    def snapshot(self) -> Histogram:
        return Histogram(bounds=self.bounds, counts=list(self.counts), sum=self.sum)


class StepRecorder:
    """One worker's steps, observed where they run (the worker) and where their results
    come back (the scheduler, for WorkerStats): the same four histograms either way."""

    def __init__(self) -> None:
        self.duration = HistogramRecorder(TOKEN_SECONDS)
        self.batch_size = HistogramRecorder(BATCH_SIZES)
        self.tokens = HistogramRecorder(STEP_TOKENS)
        self.gap = HistogramRecorder(GAP_SECONDS)
        self.forward = HistogramRecorder(TOKEN_SECONDS)
        self.sample = HistogramRecorder(TOKEN_SECONDS)

    def observe(self, step: worker_pb2.StepRequest, result: worker_pb2.StepResult) -> None:
        scheduled = step.num_scheduled_tokens
        self.duration.observe(result.execute_seconds)
        self.batch_size.observe(len(scheduled))
        self.tokens.observe(sum(scheduled.values()))
        if result.HasField("gap_seconds"):
            self.gap.observe(result.gap_seconds)
        if result.HasField("forward_seconds"):  # the step ran the model
            self.forward.observe(result.forward_seconds)
            self.sample.observe(result.sample_seconds)

    def snapshot(self) -> StepHistograms:
        return StepHistograms(duration=self.duration.snapshot(), batch_size=self.batch_size.snapshot(),
                              tokens=self.tokens.snapshot(), gap=self.gap.snapshot(),
                              forward=self.forward.snapshot(), sample=self.sample.snapshot())


class EncoderRecorder:
    """A vision worker's images, observed per step that had images to embed (the runner's
    StepOutput.vision, worker_svc/vision_step.py): counters of the distinct images (video
    frames included) steps needed (queries), of those found ready (in the encoder cache,
    or published by the encoder service) and of those encoded, and a histogram of the
    seconds each step spent getting embeddings it lacked (fetch, decode, preprocess, encode).
    One thread observes (the servicer's, after each step), as StepRecorder. The scheduler
    keeps one per vision worker from its StepResults (WorkerStats.vision, so the gateway
    shows them), and the encoder service (encoder_svc/) counts its own encodings with one
    too (no queries)."""

    def __init__(self) -> None:
        self.items_encoded = 0
        self.cache_hits = 0  # in this process's encoder cache
        self.published_hits = 0  # published by the encoder service
        self.queries = 0
        self.seconds = HistogramRecorder(TOKEN_SECONDS)

    def observe(self, items_encoded: int, cache_hits: int, seconds: float,
                published_hits: int = 0, queries: int = 0) -> None:
        self.items_encoded += items_encoded
        self.cache_hits += cache_hits
        self.published_hits += published_hits
        self.queries += queries
        if items_encoded:
            self.seconds.observe(seconds)

    def observe_step(self, images: worker_pb2.ImageStepStats) -> None:
        """One StepResult's images (the scheduler's recorder of a worker, for WorkerStats)."""
        self.observe(images.items_encoded, images.cache_hits, images.seconds,
                     images.published_hits, images.queries)

    def snapshot(self) -> VisionStats:
        return VisionStats(items_encoded=self.items_encoded, cache_hits=self.cache_hits,
                           published_hits=self.published_hits, queries=self.queries,
                           seconds=self.seconds.snapshot())


def histogram_family(name: str, help_text: str, labels: Sequence[str],
                     series: Iterable[tuple[Sequence[str], Histogram]]) -> HistogramMetricFamily:
    """One Prometheus histogram family from Histogram messages, one series per label values."""
    family = HistogramMetricFamily(name, help_text, labels=list(labels))
    for values, h in series:
        cumulative, buckets = 0, []
        for bound, count in zip([*h.bounds, float("inf")], h.counts):
            cumulative += count
            buckets.append((_le(bound), cumulative))
        family.add_metric(list(values), buckets, h.sum)
    return family


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


# ---- WorkerStats: the scheduler's view of each worker ---------------------------------------

Value = Callable[[WorkerStats], float]

# (name, help, value) — gauges: a level now.
_GAUGES: tuple[tuple[str, str, Value], ...] = (
    ("pagedserve:kv_cache_usage_perc", "fraction of KV blocks held by requests (1 = full)",
     lambda s: s.num_used_blocks / s.num_blocks if s.num_blocks else 0.0),
    ("pagedserve:kv_cache_waste_perc", "1 - tokens held / slots of the blocks they hold",
     lambda s: s.kv_waste),
    ("pagedserve:num_requests_running", "requests scheduled on the worker", lambda s: s.num_running),
    ("pagedserve:num_requests_waiting", "requests queued for the worker", lambda s: s.num_waiting),
    ("pagedserve:num_requests_swapped", "requests swapped out to CPU blocks", lambda s: s.num_swapped),
    ("pagedserve:kv_blocks_total", "KV blocks of the worker", lambda s: s.num_blocks),
    ("pagedserve:kv_blocks_used", "KV blocks held by requests", lambda s: s.num_used_blocks),
    ("pagedserve:kv_blocks_cached", "free KV blocks still holding a reusable prefix", lambda s: s.num_cached_blocks),
    ("pagedserve:kv_blocks_free", "KV blocks held by no request (cached ones included)", lambda s: s.num_free_blocks),
    ("pagedserve:kv_integrity_ok", "1 while the scheduler's check_integrity() holds",
     lambda s: 0.0 if s.integrity_error else 1.0),
)
# Counters: cumulative since the scheduler took the worker on ("_total" is appended).
_COUNTERS: tuple[tuple[str, str, Value], ...] = (
    ("pagedserve:prefix_cache_queries", "prompt tokens looked up in the prefix cache",
     lambda s: s.prefix_cache_queries),
    ("pagedserve:prefix_cache_hits", "prompt tokens found in the prefix cache", lambda s: s.prefix_cache_hits),
    ("pagedserve:num_preemptions", "requests preempted (recompute or swap)", lambda s: s.num_preemptions),
    ("pagedserve:num_swap_outs", "preemptions by swap", lambda s: s.num_swapped_out),
    ("pagedserve:kv_blocks_evicted", "cached blocks taken for other contents", lambda s: s.num_evicted_blocks),
    ("pagedserve:num_aborted_requests", "requests aborted while waiting, running or swapped",
     lambda s: s.num_aborted),
    ("pagedserve:cow_copies", "shared, partly filled blocks copied on write", lambda s: s.num_cow_copies),
    ("pagedserve:scheduler_steps", "steps the scheduler ran on the worker", lambda s: s.num_steps),
    ("pagedserve:scheduler_steps_ahead", "steps planned while the step before ran (async scheduling)",
     lambda s: s.num_steps_ahead),
)
# Histograms of RequestHistograms: (name, help, field).
_REQUEST_HISTOGRAMS = (
    ("pagedserve:request_queue_time_seconds", "arrival at the gateway to first scheduled", "queue_time"),
    ("pagedserve:request_prefill_time_seconds", "first scheduled to first token", "prefill_time"),
    ("pagedserve:request_decode_time_seconds", "first token to finished (stop or length)", "decode_time"),
    ("pagedserve:request_inference_time_seconds", "first scheduled to finished (stop or length)",
     "inference_time"),
)
# Histograms of StepHistograms: (name, help, field).
_STEP_HISTOGRAMS = (
    ("pagedserve:step_duration_seconds", "one step on the worker's compute thread: the host's work, "
     "the forward and sampling", "duration"),
    ("pagedserve:step_forward_seconds", "the model's forward in one step (on a GPU: launching it)", "forward"),
    ("pagedserve:step_sample_seconds", "the sampling after a step's forward, the sampled ids' copy to the "
     "host included (on a GPU: waiting for the forward)", "sample"),
    ("pagedserve:step_batch_size", "requests in one step", "batch_size"),
    ("pagedserve:iteration_tokens_total", "tokens computed in one step", "tokens"),
    ("pagedserve:step_gap_seconds", "the worker idle between two steps while requests went on: "
     "the round trip between steps (worker_svc/step_gap.py)", "gap"),
)


def step_families(series: Sequence[tuple[str, StepHistograms]]) -> Iterator[Metric]:
    """The step histograms, one series per (worker id, its StepHistograms)."""
    for name, help_text, field in _STEP_HISTOGRAMS:
        yield histogram_family(name, help_text, ["worker"],
                               (([worker], getattr(steps, field)) for worker, steps in series
                                if getattr(steps, field) is not None))


def worker_stats_families(stats: Sequence[WorkerStats]) -> Iterator[Metric]:
    """Every metric WorkerStats carries, one series per worker (per KV cache group of each
    worker for the group's blocks)."""
    for kind, table in ((GaugeMetricFamily, _GAUGES), (CounterMetricFamily, _COUNTERS)):
        for name, help_text, value in table:
            family = kind(name, help_text, labels=["worker"])
            for s in stats:
                family.add_metric([s.worker_id], float(value(s)))
            yield family
    family = GaugeMetricFamily("pagedserve:kv_group_blocks_used",
                               "KV blocks held by requests in one KV cache group (window 0: full attention)",
                               labels=["worker", "group", "window"])
    for s in stats:
        for group, (window, used) in enumerate(zip(s.group_windows, s.group_used_blocks)):
            family.add_metric([s.worker_id, str(group), str(window)], float(used))
    yield family
    with_requests = [s for s in stats if s.requests is not None]
    for name, help_text, field in _REQUEST_HISTOGRAMS:
        yield histogram_family(name, help_text, ["worker"],
                               (([s.worker_id], getattr(s.requests, field)) for s in with_requests))
    yield from step_families([(s.worker_id, s.steps) for s in stats if s.steps is not None])


class WorkerStatsCollector:
    """Renders `snapshot`, the latest WorkerStats of each live worker, and `encoders`, the
    latest EncoderStats of each live encoder service (the gateway's: the whole stack's
    image counters in one place; the scheduler leaves it empty). Its owner replaces the
    lists (never mutates them), so a scrape on another thread reads consistent ones."""

    def __init__(self) -> None:
        self.snapshot: list[WorkerStats] = []
        self.encoders: list[EncoderStats] = []

    def collect(self) -> Iterator[Metric]:
        stats, encoders = self.snapshot, self.encoders
        yield from worker_stats_families(stats)
        yield from vision_families([(s.worker_id, s.vision) for s in stats if s.vision is not None], encoders)


# VisionStats' and EncoderStats' metrics: (name, help, value); counters get "_total" appended.
VisionValue = Callable[[VisionStats], float]
EncoderValue = Callable[[EncoderStats], float]
# Of workers (label `worker`) and encoder services (label `encoder`) alike.
_IMAGE_COUNTERS: tuple[tuple[str, str, VisionValue], ...] = (
    ("pagedserve:mm_items_encoded", "images and video frames run through the vision encoder",
     lambda v: v.items_encoded),
)
# Of workers only: what their steps needed.
_WORKER_IMAGE_COUNTERS: tuple[tuple[str, str, VisionValue], ...] = (
    ("pagedserve:mm_cache_queries", "images and video frames steps needed (each once a step)", lambda v: v.queries),
    ("pagedserve:mm_cache_hits", "images and video frames a step needed whose embeddings were ready: in the "
     "worker's encoder cache or published by the encoder service", lambda v: v.cache_hits + v.published_hits),
    ("pagedserve:encoder_cache_hits", "images and video frames a step needed whose embeddings the encoder "
     "cache held", lambda v: v.cache_hits),
)
# Of encoder services only: what became of their jobs' media.
_ENCODER_COUNTERS: tuple[tuple[str, str, EncoderValue], ...] = (
    ("pagedserve:mm_embeddings_published", "media whose embeddings this encoder published",
     lambda e: e.items_published),
    ("pagedserve:mm_embeddings_published_bytes", "bytes of the embeddings it published", lambda e: e.bytes_published),
    ("pagedserve:mm_embeddings_found", "media of its jobs already published when it came to them",
     lambda e: e.items_found),
    ("pagedserve:mm_encode_failed", "media of its jobs that could not be had or decoded", lambda e: e.items_failed),
)
ENCODER_SECONDS = ("pagedserve:encoder_seconds", "one batch of images the process had to encode: "
                   "fetching, decoding, preprocessing, the encoder's forward")


def vision_families(workers: Sequence[tuple[str, VisionStats]],
                    encoders: Sequence[EncoderStats] = ()) -> Iterator[Metric]:
    """The image counters of each (worker id, its VisionStats), labelled `worker`, and of
    each encoder service, labelled `encoder` -- one family per metric holding both, as
    Prometheus would hold them after scraping each process (sum over both labels for the
    stack's total). A family without any series is left out (a text model's stack)."""
    for name, help_text, value in _IMAGE_COUNTERS:
        family = _counter(name, help_text, "worker", ((w, value(v)) for w, v in workers))
        family.samples += _counter(name, help_text, "encoder",
                                   ((e.encoder_id, value(e.vision)) for e in encoders)).samples
        if family.samples:
            yield family
    if workers:
        for name, help_text, value in _WORKER_IMAGE_COUNTERS:
            yield _counter(name, help_text, "worker", ((w, value(v)) for w, v in workers))
    if encoders:
        for name, help_text, value in _ENCODER_COUNTERS:
            yield _counter(name, help_text, "encoder", ((e.encoder_id, value(e)) for e in encoders))
    family = histogram_family(*ENCODER_SECONDS, ["worker"],
                              (([w], v.seconds) for w, v in workers if v.seconds is not None))
    family.samples += histogram_family(*ENCODER_SECONDS, ["encoder"],
                                       (([e.encoder_id], e.vision.seconds) for e in encoders
                                        if e.vision.seconds is not None)).samples
    if family.samples:
        yield family


def _counter(name: str, help_text: str, label: str, series: Iterable[tuple[str, float]]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, help_text, labels=[label])
    for value_of_label, value in series:
        family.add_metric([value_of_label], float(value))
    return family


class StepCollector:
    """Renders a worker's own StepRecorder, and its EncoderRecorder when it has one (a
    vision model). Read without a lock while a step may observe: each bucket list is copied
    whole, so a scrape is at most one step behind in places."""

    def __init__(self, worker_id: str, recorder: StepRecorder, encoder: EncoderRecorder | None = None):
        self._worker_id, self._recorder, self._encoder = worker_id, recorder, encoder

    def collect(self) -> Iterator[Metric]:
        yield from step_families([(self._worker_id, self._recorder.snapshot())])
        if self._encoder is not None:
            yield from vision_families([(self._worker_id, self._encoder.snapshot())])


Health = Callable[[], tuple[bool, dict]]  # (healthy, what to say) for GET /health


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args) -> None:  # a scrape a second is not news
        pass


class MetricsServer:
    """`registry` served at http://host:port/metrics from a thread, until close(); with
    `health`, also GET /health: its answer as JSON, 200 when healthy, else 503."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int, health: Health | None = None):
        metrics_app = make_wsgi_app(registry)

        def app(environ, start_response):
            if health is not None and environ.get("PATH_INFO") == "/health":
                healthy, body = health()
                start_response("200 OK" if healthy else "503 Service Unavailable",
                               [("Content-Type", "application/json")])
                return [json.dumps(body).encode()]
            return metrics_app(environ, start_response)

        self._server = make_server(host, port, app, _ThreadingServer, handler_class=_QuietHandler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics", daemon=True)
        self._thread.start()
        self.port = self._server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve_metrics(collector, host: str, port: int, health: Health | None = None) -> MetricsServer | None:
    """A /metrics server (and /health, given `health`) for one collector on its own
    registry; None when port is 0 (off)."""
    if not port:
        return None
    registry = CollectorRegistry()
    registry.register(collector)
    return MetricsServer(registry, host, port, health)
