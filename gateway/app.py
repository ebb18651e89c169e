"""The FastAPI app: thin routes over Preflight (checks), Generation (the request's life) and
serving (SSE or JSON). Everything stateful lives on `app.state`, made by `create_app`."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pydantic import BaseModel

from gateway.backend import RedisBackend
from gateway.config import GatewayConfig
from gateway.errors import OpenAIError, install_error_handlers
from gateway.generation import Generation
from gateway.auth import APIKeyMiddleware, APIKeys
from gateway.metrics import GatewayMetrics, MetricsMiddleware
from gateway.preflight import Admitted, Preflight, parse, read_body
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.response_models import ModelCard, ModelList
from gateway.responses import ChatFormat, CompletionFormat, Echo, ResponseFormat
from gateway.serving import collect, stream_sse
from gateway.token_text import TokenTexts
from gateway.tokenizer import PromptTokenizer
from proto.keys import RedisKeys

logger = logging.getLogger(__name__)
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def create_app(config: GatewayConfig, backend_factory: Callable[[], RedisBackend] | None = None) -> FastAPI:
    """The gateway app. Loads the tokenizer now; connects to Redis in the lifespan."""
    tokenizer = PromptTokenizer(config.model)
    token_texts = TokenTexts(tokenizer)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Redis by default; `pagedserve engine` passes the in-process engine's backend,
        # which has the same methods (compose/inprocess_backend.py).
        backend = backend_factory() if backend_factory else RedisBackend(
            config.redis_url, RedisKeys(config.key_prefix), config.worker_cache_ttl_s)
        await backend.start()
        app.state.backend = backend
        app.state.preflight = Preflight(config, backend, tokenizer)
        try:
            yield
        finally:
            await backend.stop()

    app = FastAPI(title="pagedserve gateway", lifespan=lifespan)
    app.state.config = config
    app.state.tokenizer = tokenizer
    install_error_handlers(app)
    app.add_middleware(APIKeyMiddleware, keys=APIKeys(config.api_keys),
                       protect_metrics=config.protect_metrics)
    metrics = GatewayMetrics(config.model_name)
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # outermost: sees 401s too

    @app.get("/health")
    async def health(request: Request) -> Response:
        if await request.app.state.backend.ping():
            return JSONResponse({"status": "ok"})
        return OpenAIError(503, "Redis does not answer.", code="redis_unavailable").response()

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics(request: Request) -> Response:
        try:  # the scheduler's accounting of every live worker, fresh for this scrape
            metrics.worker_stats.snapshot = await request.app.state.backend.worker_stats()
        except Exception as exc:  # a scrape must not fail because Redis blinked: serve the last one
            logger.warning("could not read worker stats: %s", exc)
        return metrics.response()

    @app.get("/v1/models")
    async def models(request: Request) -> ModelList:
        """The served model, listed while at least one live worker serves it."""
        preflight: Preflight = request.app.state.preflight
        try:
            max_model_len = await preflight.max_model_len(None)
        except OpenAIError as exc:
            if exc.code != "no_live_worker":
                raise
            return ModelList(data=[])
        return ModelList(data=[ModelCard(id=config.model_name, root=config.model,
                                         max_model_len=max_model_len)])

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = parse(CompletionRequest, await read_body(request, config.max_body_bytes))
        admitted = await request.app.state.preflight.admit_completion(body)
        echo = None
        if body.echo:
            text, offsets = tokenizer.text_with_offsets(admitted.prompt_token_ids)
            echo = Echo(body.prompt if isinstance(body.prompt, str) else text, offsets)
        fmt = CompletionFormat(admitted.request_id, config.model_name, admitted.prompt_token_ids,
                               bool(body.return_token_ids), token_texts, body.logprobs, echo=echo)
        return await _answer(request, admitted, fmt, stream=bool(body.stream),
                             include_usage=body.include_usage)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = parse(ChatCompletionRequest, await read_body(request, config.max_body_bytes))
        admitted = await request.app.state.preflight.admit_chat(body)
        fmt = ChatFormat(admitted.request_id, config.model_name, admitted.prompt_token_ids,
                         bool(body.return_token_ids), token_texts, body.num_logprobs)
        return await _answer(request, admitted, fmt, stream=bool(body.stream),
                             include_usage=body.include_usage)

    async def _answer(request: Request, admitted: Admitted, fmt: ResponseFormat, *, stream: bool,
                      include_usage: bool) -> Response:
        generation = metrics.meter(Generation(request.app.state.backend, tokenizer, admitted.request,
                                              stop=admitted.stop, timeout_s=config.request_timeout_s),
                                   num_prompt_tokens=admitted.num_prompt_tokens)
        if stream:
            events = stream_sse(generation, fmt, include_usage=include_usage,
                                num_prompt_tokens=admitted.num_prompt_tokens)
            return StreamingResponse(events, media_type="text/event-stream", headers=_SSE_HEADERS)
        return await collect(generation, fmt, num_prompt_tokens=admitted.num_prompt_tokens,
                             request=request)

    install_openapi_bodies(app, {"/v1/completions": CompletionRequest,
                                 "/v1/chat/completions": ChatCompletionRequest})
    return app


def install_openapi_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Publish the request body schemas in /openapi.json. The routes read and validate the
    raw body themselves (size limit first, OpenAI-shaped errors), so FastAPI cannot infer
    them; clients and the fuzz test read them here."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                schema["paths"][path]["post"]["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
