"""Probes: `/health/live` (the process serves HTTP: restart it if not) and `/health/ready`
(a generate would succeed now: gateway/readiness.py; take it out of rotation if not).
`/health` itself (gateway/app.py) stays a Redis check. None of them wants an API key
unless `--protect-metrics` is set."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from gateway.errors import OpenAIError
from gateway.openapi_responses import error_responses
from gateway.readiness import readiness
from gateway.response_models import LiveStatus, ReadyStatus

router = APIRouter()


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
