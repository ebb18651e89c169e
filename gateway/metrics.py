"""Prometheus metrics of one gateway, served at /metrics: requests by route and status,
requests in flight. One CollectorRegistry per app (no process-global state)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models")


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("pagedserve_gateway_requests", "HTTP requests answered",
                                ["route", "status"], registry=self.registry)
        self.in_flight = Gauge("pagedserve_gateway_requests_in_flight", "HTTP requests being answered",
                               registry=self.registry)
        self.latency = Histogram("pagedserve_gateway_request_seconds", "time to the last byte",
                                 ["route"], registry=self.registry)

    def response(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


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
