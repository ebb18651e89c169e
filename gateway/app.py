"""The FastAPI app: thin routes over Preflight (checks), Generation (the request's life) and
serving (SSE or JSON). Everything stateful lives on `app.state`, made by `create_app`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway.backend import RedisBackend
from gateway.config import GatewayConfig
from gateway.errors import OpenAIError, install_error_handlers
from gateway.generation import Generation
from gateway.preflight import Admitted, Preflight, check_api_key, parse, read_body
from gateway.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from gateway.responses import ChatFormat, CompletionFormat, ResponseFormat
from gateway.serving import collect, stream_sse
from gateway.tokenizer import PromptTokenizer
from proto.keys import RedisKeys

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def create_app(config: GatewayConfig) -> FastAPI:
    """The gateway app. Loads the tokenizer now; connects to Redis in the lifespan."""
    tokenizer = PromptTokenizer(config.model)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        backend = RedisBackend(config.redis_url, RedisKeys(config.key_prefix), config.worker_cache_ttl_s)
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

    def authorized(request: Request) -> None:
        check_api_key(config, request)

    v1 = [Depends(authorized)]

    @app.get("/health")
    async def health(request: Request) -> Response:
        if await request.app.state.backend.ping():
            return JSONResponse({"status": "ok"})
        return OpenAIError(503, "Redis does not answer.", code="redis_unavailable").response()

    @app.get("/v1/models", dependencies=v1)
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

    @app.post("/v1/completions", dependencies=v1)
    async def completions(request: Request) -> Response:
        body = parse(CompletionRequest, await read_body(request, config.max_body_bytes))
        admitted = await request.app.state.preflight.admit_completion(body)
        fmt = CompletionFormat(admitted.request.request_id, config.model_name,
                               admitted.request.prompt_token_ids, bool(body.return_token_ids))
        return await _answer(request, admitted, fmt, stream=bool(body.stream),
                             include_usage=body.include_usage)

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat_completions(request: Request) -> Response:
        body = parse(ChatCompletionRequest, await read_body(request, config.max_body_bytes))
        admitted = await request.app.state.preflight.admit_chat(body)
        fmt = ChatFormat(admitted.request.request_id, config.model_name,
                         admitted.request.prompt_token_ids, bool(body.return_token_ids))
        return await _answer(request, admitted, fmt, stream=bool(body.stream),
                             include_usage=body.include_usage)

    async def _answer(request: Request, admitted: Admitted, fmt: ResponseFormat, *, stream: bool,
                      include_usage: bool) -> Response:
        generation = Generation(request.app.state.backend, tokenizer, admitted.request,
                                stop=admitted.stop, timeout_s=config.request_timeout_s)
        if stream:
            events = stream_sse(generation, fmt, include_usage=include_usage,
                                num_prompt_tokens=admitted.num_prompt_tokens)
            return StreamingResponse(events, media_type="text/event-stream", headers=_SSE_HEADERS)
        return await collect(generation, fmt, num_prompt_tokens=admitted.num_prompt_tokens,
                             request=request)

    return app
