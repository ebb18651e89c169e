"""Prometheus metrics of one gateway, served at /metrics, and the rest of the stack's.

The gateway's own: HTTP requests by route and status, and what a client observes of each
completion request, as vLLM names it (`vllm:x` → `pagedserve:x`, labelled `model_name`):
time to first token, inter-token latency, time per output token, end-to-end latency,
prompt and generation tokens, finished requests by reason. `MeteredGeneration` measures
them around a `Generation` (one per HTTP request, n choices), per choice.

Beside them, `WorkerStatsCollector` (proto/metrics.py) renders the scheduler's WorkerStats
of every live worker — KV accounting, request phases, steps, the images its steps needed —
and the EncoderStats of every live encoder service, which the /metrics handler refreshes
from the backend and Redis before each scrape; `MediaStatsCollector` renders what this
gateway's MediaLoader took in and its MediaStore wrote (vision checkpoints: images, videos,
kept video frames, media items and bytes stored in Redis; zeros otherwise).

Two CollectorRegistries per app: `registry`, this gateway's own metrics (media included),
and `stack_registry`, the stack's collectors read from Redis. Where several gateways serve
one stack, each publishes its own (gateway/gateway_metrics_peers.py) and a scrape of any of
them renders every live gateway's own, summed, then the stack's once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.gateway_metrics_peers import SummedCollector, sum_expositions
from gateway.generation import Generation, GenerationOutput
from gateway.media.fetch import FetchStats
from gateway.media.loader import LoaderStats, MediaLoader
from gateway.media.store import StoreStats
from proto.metrics import (FIRST_TOKEN_SECONDS, REQUEST_SECONDS, TOKEN_SECONDS, HistogramRecorder,
                           WorkerStatsCollector, histogram_family)

logger = logging.getLogger(__name__)

_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models")


class GatewayMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()  # this gateway's own metrics, which peers sum
        self.stack_registry = CollectorRegistry()  # the stack's, read from Redis: rendered once
        self.model_name = model_name
        r, model = self.registry, ["model_name"]
        self.requests = Counter("pagedserve_gateway_requests", "HTTP requests answered",
                                ["route", "status"], registry=r)
        self.in_flight = Gauge("pagedserve_gateway_requests_in_flight", "HTTP requests being answered",
                               registry=r)
        self.latency = Histogram("pagedserve_gateway_request_seconds", "time to the last byte",
                                 ["route"], registry=r)
        self.ttft = Histogram("pagedserve:time_to_first_token_seconds",
                              "request admitted to its choice's first token", model,
                              buckets=FIRST_TOKEN_SECONDS, registry=r).labels(model_name)
        # Per token: recorded without prometheus_client's locks (one event loop observes).
        self.tokens = TokenCollector(model_name)
        r.register(self.tokens)
        self.tpot = Histogram("pagedserve:request_time_per_output_token_seconds",
                              "(first token to last) / (tokens - 1), per finished choice of 2+ tokens",
                              model, buckets=TOKEN_SECONDS, registry=r).labels(model_name)
        self.e2e = Histogram("pagedserve:e2e_request_latency_seconds",
                             "request admitted to its choice's last token (stop or length)", model,
                             buckets=REQUEST_SECONDS, registry=r).labels(model_name)
        self.prompt_tokens = Counter("pagedserve:prompt_tokens", "prompt tokens of requests that got a token",
                                     model, registry=r).labels(model_name)
        self.success = Counter("pagedserve:request_success", "choices finished, by finish reason",
                               ["model_name", "finished_reason"], registry=r)
        # The scheduler's accounting of every live worker and the encoder services' counters;
        # refreshed by the /metrics handler.
        self.worker_stats = WorkerStatsCollector()
        self.stack_registry.register(self.worker_stats)
        # The media this gateway took in; the app sets its loader once Redis is connected.
        self.media = MediaStatsCollector(model_name)
        r.register(self.media)

    def meter(self, generation: Generation, num_prompt_tokens: int) -> MeteredGeneration:
        """`generation`, timed from now (its request was just admitted)."""
        return MeteredGeneration(generation, self, num_prompt_tokens)

    def own_exposition(self) -> str:
        """This gateway's own metrics as Prometheus text: what it publishes for its peers."""
        return generate_latest(self.registry).decode()

    def response(self, peers: Sequence[str] = ()) -> Response:
        """The scrape's answer: this gateway's own metrics, summed with the `peers`' (the
        expositions other live gateways published), then the stack's. Without peers, its own
        are rendered as they are."""
        own = None
        if peers:
            try:
                summed = sum_expositions([self.own_exposition(), *peers])
            except ValueError as exc:  # a peer's text that does not parse (another version's)
                logger.warning("could not sum the other gateways' metrics, showing this one's: %s", exc)
            else:
                registry = CollectorRegistry()
                registry.register(SummedCollector(summed))
                own = generate_latest(registry)
        if own is None:
            own = generate_latest(self.registry)
        return Response(own + generate_latest(self.stack_registry), media_type=CONTENT_TYPE_LATEST)


class MediaStatsCollector:
    """Renders the counters of `loader` (None: no media taken, all zeros) at each scrape:

        pagedserve:mm_images_received_total        images fetched, checked and stored
        pagedserve:mm_videos_received_total        videos decoded
        pagedserve:mm_video_frames_received_total  their frames kept after sampling
        pagedserve:mm_items_stored_total           media items this gateway wrote to Redis
        pagedserve:mm_items_reused_total           items it found there already (TTL refreshed)
        pagedserve:mm_stored_bytes_total           bytes of the items it wrote
        pagedserve:mm_media_by_uuid_total          parts without data, named by a uuid sent before
        pagedserve:mm_fetch_refused_total{reason}  http(s) media URLs refused before any connection:
                                                   domain_not_allowed, private_address, unresolvable,
                                                   redirect (gateway/media/address_policy.py)
    """

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.loader: MediaLoader | None = None

    def describe(self) -> Iterator[Metric]:
        return self.collect()

    def collect(self) -> Iterator[Metric]:
        loader = self.loader
        taken = loader.stats if loader is not None else LoaderStats()
        stored = loader.store.stats if loader is not None else StoreStats()
        for name, doc, value in (
                ("mm_images_received", "images fetched, checked and stored", taken.images),
                ("mm_videos_received", "videos decoded", taken.videos),
                ("mm_video_frames_received", "video frames kept after sampling", taken.video_frames),
                ("mm_items_stored", "media items written to Redis", stored.items_written),
                ("mm_items_reused", "media items Redis held already (TTL refreshed)", stored.items_reused),
                ("mm_stored_bytes", "bytes of the media items written to Redis", stored.bytes_written),
                ("mm_media_by_uuid", "media parts without data, named by a uuid sent before (nothing "
                                     "fetched or decoded)", taken.by_uuid)):
            family = CounterMetricFamily(f"pagedserve:{name}", doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        fetched = loader.fetcher.stats if loader is not None else FetchStats()
        refused = CounterMetricFamily("pagedserve:mm_fetch_refused", "http(s) media URLs refused before any "
                                      "connection, by reason", labels=["model_name", "reason"])
        for reason, value in fetched.refused.items():
            refused.add_metric([self.model_name, reason], value)
        yield refused


class TokenCollector:
    """What the gateway observes per streamed token: the inter-token latency histogram and
    the completion tokens sent. Kept as plain numbers (HistogramRecorder, an int): the event
    loop is the only writer, and prometheus_client's locked counters cost ~10% of the
    gateway's CPU per token (bench/stack/token_path.py)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.itl = HistogramRecorder(TOKEN_SECONDS)
        self.generation_tokens = 0

    def collect(self) -> Iterator[Metric]:
        yield histogram_family("pagedserve:inter_token_latency_seconds",
                               "between two successive token arrivals of one choice", ["model_name"],
                               [([self.model_name], self.itl.snapshot())])
        sent = CounterMetricFamily("pagedserve:generation_tokens", "completion tokens sent",
                                   labels=["model_name"])
        sent.add_metric([self.model_name], self.generation_tokens)
        yield sent


@dataclass
class _ChoiceClock:
    first_at: float = 0.0
    last_at: float = 0.0
    num_tokens: int = 0
    finish_reason: str | None = None


class MeteredGeneration:
    """A Generation whose outputs are timed per choice; everything else is the generation's.

    Per output carrying tokens: TTFT (the choice's first) or ITL, and the tokens; an output of
    k tokens (events merged: gateway/generation.py) has k - 1 more gaps of 0, as its client
    sees them, so ITL counts every token after a choice's first. Per
    choice that finishes: finished reason; with "stop" / "length" also e2e and TPOT. A
    choice that never finishes counts as "abort" (the client left) or "error"."""

    def __init__(self, generation: Generation, metrics: GatewayMetrics, num_prompt_tokens: int):
        self._generation = generation
        self._metrics = metrics
        self._num_prompt_tokens = num_prompt_tokens
        self._start = time.perf_counter()
        self._choices = [_ChoiceClock() for _ in range(generation.n)]
        self._prompt_counted = False

    def __getattr__(self, name: str):
        return getattr(self._generation, name)

    async def outputs(self) -> AsyncIterator[tuple[int, GenerationOutput]]:
        unfinished = "abort"
        try:
            async for index, output in self._generation.outputs():
                self._observe(self._choices[index], output, time.perf_counter())
                yield index, output
        except Exception:
            unfinished = "error"
            raise
        finally:
            success = self._metrics.success
            for choice in self._choices:
                if choice.finish_reason is None:
                    success.labels(self._metrics.model_name, unfinished).inc()

    def _observe(self, choice: _ChoiceClock, output: GenerationOutput, now: float) -> None:
        m = self._metrics
        if output.token_ids:
            if not choice.num_tokens:
                m.ttft.observe(now - self._start)
                choice.first_at = now
                if not self._prompt_counted:
                    m.prompt_tokens.inc(self._num_prompt_tokens)
                    self._prompt_counted = True
            else:
                m.tokens.itl.observe(now - choice.last_at)
            if len(output.token_ids) > 1:  # tokens that came together: no gap
                m.tokens.itl.observe(0.0, times=len(output.token_ids) - 1)
            choice.last_at = now
            choice.num_tokens += len(output.token_ids)
            m.tokens.generation_tokens += len(output.token_ids)
        if output.finish_reason is not None and choice.finish_reason is None:
            choice.finish_reason = output.finish_reason
            m.success.labels(m.model_name, output.finish_reason).inc()
            m.e2e.observe(now - self._start)
            if choice.num_tokens > 1:
                m.tpot.observe((choice.last_at - choice.first_at) / (choice.num_tokens - 1))


class MetricsMiddleware:
    """Counts /v1 requests by route (unknown paths pooled as "other") and status."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/v1"):
            await self.app(scope, receive, send)
            return
        route = path if path in _ROUTES else "other"
        status = 500
        start = time.perf_counter()

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, recording_send)
        finally:
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - start)
