"""The probes and the scrape, none of them under /v1 (so none wants an API key unless
`--protect-metrics` is set):

    /health        Redis answers (503 `redis_unavailable` if not)
    /health/live   the process serves HTTP: restart it if not
    /health/ready  a generate would succeed now (gateway/readiness.py): take it out of
                   rotation if not
    /metrics       Prometheus text: this gateway's metrics summed with its live peers'
                   (gateway/gateway_metrics_peers.py), then the stack's workers and encoders
                   (left out of /openapi.json)
"""

from __future__ import annotations

import logging
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from gateway.backend import RedisBackend
from gateway.errors import OpenAIError
from gateway.openapi_answers import error_responses
from gateway.readiness import readiness

logger = logging.getLogger(__name__)
router = APIRouter()


class HealthStatus(BaseModel):
    """/health: Redis answers."""

    status: Literal["ok"] = "ok"


class LiveStatus(BaseModel):
    """/health/live: the process serves HTTP."""

    status: Literal["live"] = "live"


class ReadyStatus(BaseModel):
    """/health/ready: a generation would be taken now, by these schedulers and workers."""

    status: Literal["ready"] = "ready"
    schedulers: list[str]
    workers: list[str]


@router.get("/health", response_model=HealthStatus, responses=error_responses(500, 503))
async def health(request: Request) -> Response:
    if await request.app.state.backend.ping():
        return JSONResponse({"status": "ok"})
    return OpenAIError(503, "Redis does not answer.", code="redis_unavailable").response()


@router.get("/health/live", response_model=LiveStatus, responses=error_responses(500))
async def live() -> Response:
    return JSONResponse({"status": "live"})


@router.get("/health/ready", response_model=ReadyStatus, responses=error_responses(500, 503))
async def ready(request: Request) -> Response:
    state = await readiness(request.app.state.backend)
    if not state.ready:
        return OpenAIError(503, state.message, code=state.reason).response()
    return JSONResponse({"status": "ready", "schedulers": [s.scheduler_id for s in state.schedulers],
                         "workers": state.worker_ids})


@router.get("/metrics", include_in_schema=False)
async def prometheus_metrics(request: Request) -> Response:
    state = request.app.state
    metrics, backend = state.metrics, state.backend
    try:  # the scheduler's accounting of every live worker, fresh for this scrape
        metrics.worker_stats.snapshot = await backend.worker_stats()
        if isinstance(backend, RedisBackend):  # and each live encoder service's counters
            metrics.worker_stats.encoders = await state.encoder_registry.stats(backend.redis)
    except Exception as exc:  # a scrape must not fail because Redis blinked: serve the last one
        logger.warning("could not read worker or encoder stats: %s", exc)
    peers: list[str] = []
    if state.peer_metrics is not None:  # the other live gateways' own metrics, summed with ours
        try:
            await state.peer_metrics.publish(metrics.own_exposition())
            peers = [record.text for record in await state.peer_metrics.peers()]
        except Exception as exc:  # Redis blinked: this gateway's own alone
            logger.warning("could not read the other gateways' metrics: %s", exc)
    return metrics.response(peers)
