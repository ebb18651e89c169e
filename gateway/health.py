"""Probes: `/health/live` (the process serves HTTP: restart it if not) and `/health/ready`
(a generate would succeed now: gateway/readiness.py; take it out of rotation if not).
`/health` itself (gateway/app.py) stays a Redis check. None of them wants an API key
unless `--protect-metrics` is set."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from gateway.errors import OpenAIError
from gateway.readiness import readiness

router = APIRouter()


@router.get("/health/live")
async def live() -> Response:
    return JSONResponse({"status": "live"})


@router.get("/health/ready")
async def ready(request: Request) -> Response:
    state = await readiness(request.app.state.backend)
    if not state.ready:
        return OpenAIError(503, state.message, code=state.reason).response()
    return JSONResponse({"status": "ready", "schedulers": [s.scheduler_id for s in state.schedulers],
                         "workers": state.worker_ids})
