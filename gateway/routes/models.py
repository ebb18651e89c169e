"""/v1/models and /v1/models/{model_id}: the served names (--served-model-name, or the
model itself), listed while at least one live worker serves the model, each with the
context length that worker reports."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from gateway.completion_models import now
from gateway.errors import OpenAIError
from gateway.openapi_answers import error_responses

router = APIRouter()


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "pagedserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


async def live_max_model_len(request: Request) -> int | None:
    """The served model's context length, None while no live worker serves it."""
    try:
        return await request.app.state.preflight.max_model_len(None)
    except OpenAIError as exc:
        if exc.code != "no_live_worker":
            raise
        return None


@router.get("/v1/models", responses=error_responses(500, 503))
async def models(request: Request) -> ModelList:
    """Every served name, listed while at least one live worker serves the model."""
    config = request.app.state.config
    max_model_len = await live_max_model_len(request)
    if max_model_len is None:
        return ModelList(data=[])
    return ModelList(data=[ModelCard(id=name, root=config.model, max_model_len=max_model_len)
                           for name in config.model_names])


@router.get("/v1/models/{model_id:path}", responses=error_responses(404, 500, 503))
async def model(request: Request, model_id: str) -> ModelCard:
    config = request.app.state.config
    if model_id not in config.model_names:
        raise OpenAIError(404, f"The model '{model_id}' does not exist.", param="model",
                          code="model_not_found")
    return ModelCard(id=model_id, root=config.model, max_model_len=await live_max_model_len(request))
