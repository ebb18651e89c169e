"""The FastAPI app: thin routes over Preflight (checks), Generation (the request's life) and
serving (SSE or JSON). Everything stateful lives on `app.state`, made by `create_app`."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pydantic import ValidationError

from gateway.backend import RedisBackend
from gateway.config import GatewayConfig
from gateway.errors import OpenAIError, from_validation_errors, install_error_handlers
from gateway.files.references import FileReferences
from gateway.files.routes import install_files_api
from gateway.files.store import FileSettings, FileStore
from gateway.gateway_metrics_peers import PUBLISH_INTERVAL_S, PeerGatewayMetrics
from gateway.generation import Generation
from gateway.generation_group import Generating, GenerationGroup
from gateway.health import router as health_router
from gateway.auth import APIKeyMiddleware, APIKeys
from gateway.image_tokens import ImageTokens
from gateway.media.loader import MediaLoader
from gateway.media.uuids import media_scope
from gateway.metrics import GatewayMetrics, MetricsMiddleware
from gateway.mm_prompt import MediaPrompts
from gateway.openapi_document import ServedFacts, install_openapi
from gateway.openapi_responses import (BODY_ERRORS, CHAT_BEYOND, COMPLETION_BEYOND, GENERATE_ERRORS, RESPONSES_BEYOND,
                                       TOKENIZE_BEYOND, chunk_events, error_responses, json_or_event_stream,
                                       response_events)
from gateway.preflight import Admitted, Preflight, first, parse, read_body
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.response_models import (ChatCompletionChunk, ChatCompletionResponse, CompletionChunk, CompletionResponse,
                                     HealthStatus, ModelCard, ModelList)
from gateway.tokenize_models import (DetokenizeRequest, DetokenizeResponse, TokenizeChatRequest,
                                     TokenizeCompletionRequest, TokenizeResponse)
from gateway.responses_output import ResponseObject, ResponsesFormat
from gateway.responses_request import ResponsesRequest, as_responses_error, chat_body
from gateway.responses import ChatFormat, CompletionFormat, CompletionPrompt, Echo, OutputFormat
from gateway.sampling_defaults import SamplingDefaults
from gateway.serving import collect, stream_sse
from gateway.token_text import TokenTexts
from gateway.tokenizer import PromptTokenizer
from proto.encoder_registry import EncoderRegistry
from proto.keys import RedisKeys
from proto.model_source import resolve_model

logger = logging.getLogger(__name__)
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def create_app(config: GatewayConfig, backend_factory: Callable[[], RedisBackend] | None = None) -> FastAPI:
    """The gateway app. Loads the tokenizer now (a folder, or a Hub id from the cache, found
    the way the worker finds it), and a vision checkpoint's image tokens; connects to Redis
    in the lifespan, where a vision checkpoint's MediaLoader stores media through the
    backend's client, as the Files API (gateway/files/) stores uploads. A backend without
    Redis (the in-process engine's) gets no loader and no Files API: images and video are
    then refused with a 400 that points at the stack."""
    model_dir = resolve_model(config.model)
    tokenizer = PromptTokenizer(model_dir, config.chat_template)
    sampling_defaults = SamplingDefaults.load(config.generation_config, model_dir)
    token_texts = TokenTexts(tokenizer)
    image_tokens = ImageTokens.read(model_dir, tokenizer.hf)  # None: a text model
    file_settings = FileSettings.from_config(config) if backend_factory is None else None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Redis by default; `pagedserve engine` passes the in-process engine's backend,
        # which has the same methods (compose/inprocess_backend.py) but no Redis.
        backend = backend_factory() if backend_factory else RedisBackend(
            config.redis_url, RedisKeys(config.key_prefix), config.worker_cache_ttl_s,
            config.max_unread_events)
        await backend.start()
        app.state.backend = backend
        loader: MediaLoader | None = None
        publishing: asyncio.Task | None = None
        stop_publishing = asyncio.Event()
        app.state.peer_metrics = None
        try:
            if file_settings is not None and isinstance(backend, RedisBackend):
                keys = RedisKeys(config.key_prefix)
                # other gateways of the stack sum this one's metrics into theirs, and it theirs
                app.state.peer_metrics = PeerGatewayMetrics(backend.redis, keys, backend.gateway_id)
                publishing = asyncio.create_task(_publish_metrics(app.state.peer_metrics, metrics, stop_publishing),
                                                 name="gateway-metrics-publish")
                if image_tokens is not None:
                    loader = MediaLoader.from_config(
                        config, backend.redis, files=FileReferences(backend.redis, keys, config.media_ttl_s))
                # one media store: uploads count in its stats (/metrics) as inline media do
                app.state.files = FileStore(backend.redis, keys, file_settings,
                                            media=loader.store if loader is not None else None)
            media = MediaPrompts(config.model_name, tokenizer, image_tokens, loader)
            app.state.preflight = Preflight(config, backend, tokenizer, sampling_defaults, media)
            metrics.media.loader = loader
            yield
        finally:
            if publishing is not None:
                # Stopped by the event, the cancel only cuts its sleep short: redis-py swallows
                # a cancellation that lands in a pipeline's execute, and a task that outlives
                # the app keeps publishing (and hangs whoever later cancels and awaits it).
                stop_publishing.set()
                publishing.cancel()
                await asyncio.wait({publishing}, timeout=2)
                try:
                    await app.state.peer_metrics.withdraw()
                except Exception as exc:  # Redis gone: the record expires on its own
                    logger.warning("could not withdraw this gateway's metrics: %s", exc)
            if loader is not None:
                await loader.aclose()
            await backend.stop()

    app = FastAPI(title="pagedserve gateway", lifespan=lifespan, description=_DESCRIPTION)
    app.state.config = config
    app.state.tokenizer = tokenizer
    install_error_handlers(app)
    app.include_router(health_router)
    if file_settings is not None:  # the stack: files live in Redis
        install_files_api(app, config)
    app.add_middleware(APIKeyMiddleware, keys=APIKeys(config.api_keys),
                       protect_metrics=config.protect_metrics)
    metrics = GatewayMetrics(config.model_name)
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # outermost: sees 401s too

    @app.get("/health", response_model=HealthStatus, responses=error_responses(500, 503))
    async def health(request: Request) -> Response:
        if await request.app.state.backend.ping():
            return JSONResponse({"status": "ok"})
        return OpenAIError(503, "Redis does not answer.", code="redis_unavailable").response()

    encoder_registry = EncoderRegistry(RedisKeys(config.key_prefix))

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics(request: Request) -> Response:
        backend = request.app.state.backend
        try:  # the scheduler's accounting of every live worker, fresh for this scrape
            metrics.worker_stats.snapshot = await backend.worker_stats()
            if isinstance(backend, RedisBackend):  # and each live encoder service's counters
                metrics.worker_stats.encoders = await encoder_registry.stats(backend.redis)
        except Exception as exc:  # a scrape must not fail because Redis blinked: serve the last one
            logger.warning("could not read worker or encoder stats: %s", exc)
        peers: list[str] = []
        peer_metrics = request.app.state.peer_metrics
        if peer_metrics is not None:  # the other live gateways' own metrics, summed with ours
            try:
                await peer_metrics.publish(metrics.own_exposition())
                peers = [record.text for record in await peer_metrics.peers()]
            except Exception as exc:  # Redis blinked: this gateway's own alone
                logger.warning("could not read the other gateways' metrics: %s", exc)
        return metrics.response(peers)

    async def live_max_model_len(request: Request) -> int | None:
        """The served model's context length, None while no live worker serves it."""
        try:
            return await request.app.state.preflight.max_model_len(None)
        except OpenAIError as exc:
            if exc.code != "no_live_worker":
                raise
            return None

    @app.get("/v1/models", responses=error_responses(500, 503))
    async def models(request: Request) -> ModelList:
        """Every served name, listed while at least one live worker serves the model."""
        max_model_len = await live_max_model_len(request)
        if max_model_len is None:
            return ModelList(data=[])
        return ModelList(data=[ModelCard(id=name, root=config.model, max_model_len=max_model_len)
                               for name in config.model_names])

    @app.get("/v1/models/{model_id:path}", responses=error_responses(404, 500, 503))
    async def model(request: Request, model_id: str) -> ModelCard:
        if model_id not in config.model_names:
            raise OpenAIError(404, f"The model '{model_id}' does not exist.", param="model",
                              code="model_not_found")
        return ModelCard(id=model_id, root=config.model, max_model_len=await live_max_model_len(request))

    @app.post("/tokenize", responses=error_responses(*BODY_ERRORS, 503, beyond=TOKENIZE_BEYOND))
    async def tokenize(request: Request) -> TokenizeResponse:
        """vLLM's: a prompt's token ids as /v1/completions (`prompt`) or chat (`messages`) makes them."""
        raw = await read_body(request, config.max_body_bytes)
        try:
            is_chat = "messages" in json.loads(raw)
        except (ValueError, TypeError):
            is_chat = False  # not a JSON object: parse() below says what is wrong
        body = parse(TokenizeChatRequest if is_chat else TokenizeCompletionRequest, raw)
        request.app.state.preflight.check_model(body.model)
        if isinstance(body, TokenizeChatRequest) and any(m.has_media for m in body.messages):
            raise OpenAIError(400, "/tokenize does not take image or video parts yet; send the text "
                                   "parts only.", param="messages", code="unsupported_content_part")
        if isinstance(body, TokenizeChatRequest):
            ids = await asyncio.to_thread(
                tokenizer.encode_chat, [m.template_dict() for m in body.messages],
                tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
                add_generation_prompt=bool(body.add_generation_prompt),
                continue_final_message=bool(body.continue_final_message),
                template_kwargs=body.chat_template_kwargs or {}, add_special_tokens=bool(body.add_special_tokens))
        else:
            ids = await asyncio.to_thread(tokenizer.encode_text, body.prompt, bool(body.add_special_tokens))
        strs = [token_texts.text(i) for i in ids] if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=await live_max_model_len(request),
                                tokens=ids, token_strs=strs)

    @app.post("/detokenize", responses=error_responses(*BODY_ERRORS))
    async def detokenize(request: Request) -> DetokenizeResponse:
        body = parse(DetokenizeRequest, await read_body(request, config.max_body_bytes))
        request.app.state.preflight.check_model(body.model)
        tokenizer.check_ids(body.tokens, "tokens")
        return DetokenizeResponse(prompt=await asyncio.to_thread(tokenizer.decode, body.tokens))

    @app.post("/v1/completions", responses={**json_or_event_stream(CompletionResponse, chunk_events("CompletionChunk")),
                                            **error_responses(*GENERATE_ERRORS, beyond=COMPLETION_BEYOND)})
    async def completions(request: Request) -> Response:
        body = parse(CompletionRequest, await read_body(request, config.max_body_bytes))
        batch = await request.app.state.preflight.admit_completion(body)
        prompts = []
        for prompt, admitted in zip(body.prompt, batch):
            echo = None
            if body.echo:
                text, offsets = tokenizer.text_with_offsets(admitted.prompt_token_ids)
                echo = Echo(prompt if isinstance(prompt, str) else text, offsets)
            prompts.append(CompletionPrompt(admitted.prompt_token_ids, echo))
        fmt = CompletionFormat(batch[0].request_id, config.model_name, prompts, body.n or 1,
                               bool(body.return_token_ids), token_texts, body.logprobs)
        return await _answer(request, batch, fmt, stream=bool(body.stream), include_usage=body.include_usage,
                             continuous_usage=body.continuous_usage)

    @app.post("/v1/chat/completions", responses={
        **json_or_event_stream(ChatCompletionResponse, chunk_events("ChatCompletionChunk")),
        **error_responses(*GENERATE_ERRORS, 501, beyond=CHAT_BEYOND)})
    async def chat_completions(request: Request) -> Response:
        body = parse(ChatCompletionRequest, await read_body(request, config.max_body_bytes))
        scope = media_scope(request.headers.get("authorization"), keyed=bool(config.api_keys))
        admitted = await request.app.state.preflight.admit_chat(body, scope)
        fmt = ChatFormat(admitted.request_id, config.model_name, admitted.prompt_token_ids,
                         bool(body.return_token_ids), token_texts, body.num_logprobs,
                         tool_parser=admitted.tool_parser)
        return await _answer(request, [admitted], fmt, stream=bool(body.stream), include_usage=body.include_usage,
                             continuous_usage=body.continuous_usage)

    @app.post("/v1/responses", responses={**json_or_event_stream(ResponseObject, response_events("ResponseObject")),
                                          **error_responses(*GENERATE_ERRORS, 501, beyond=RESPONSES_BEYOND)})
    async def responses(request: Request) -> Response:
        """OpenAI's Responses API, stateless: served as the chat request it amounts to."""
        body = parse(ResponsesRequest, await read_body(request, config.max_body_bytes))
        scope = media_scope(request.headers.get("authorization"), keyed=bool(config.api_keys))
        try:
            try:
                chat = ChatCompletionRequest.model_validate(chat_body(body))
            except ValidationError as exc:
                raise from_validation_errors(list(exc.errors(include_url=False))) from None
            admitted = await request.app.state.preflight.admit_chat(chat, scope)
        except OpenAIError as exc:
            raise as_responses_error(exc, body) from None
        echo = {key: value for key, value in (
            ("instructions", body.instructions), ("metadata", body.metadata), ("temperature", body.temperature),
            ("top_p", body.top_p), ("max_output_tokens", body.max_output_tokens), ("tools", body.tools),
            ("tool_choice", body.tool_choice), ("parallel_tool_calls", body.parallel_tool_calls),
            ("text", body.text)) if value is not None}
        fmt = ResponsesFormat(f"resp_{admitted.request_id.partition('-')[2]}", config.model_name, echo,
                              admitted.tool_parser)
        generation = metrics.meter(Generation(request.app.state.backend, tokenizer, admitted.request,
                                              text=admitted.text, timeout_s=config.request_timeout_s),
                                   num_prompt_tokens=admitted.num_prompt_tokens)
        if body.stream:
            return StreamingResponse(fmt.stream(generation, admitted.num_prompt_tokens),
                                     media_type="text/event-stream", headers=_SSE_HEADERS)
        return await collect(generation, fmt, num_prompt_tokens=admitted.num_prompt_tokens, request=request)

    async def _answer(request: Request, batch: list[Admitted], fmt: OutputFormat, *, stream: bool,
                      include_usage: bool, continuous_usage: bool) -> Response:
        members = [metrics.meter(Generation(request.app.state.backend, tokenizer, admitted.request,
                                            text=admitted.text, timeout_s=config.request_timeout_s),
                                 num_prompt_tokens=admitted.num_prompt_tokens) for admitted in batch]
        generation: Generating = members[0] if len(members) == 1 else GenerationGroup(batch[0].request_id, members)
        num_prompt_tokens = sum(admitted.num_prompt_tokens for admitted in batch)
        if stream:
            events = stream_sse(generation, fmt, include_usage=include_usage, num_prompt_tokens=num_prompt_tokens,
                                continuous_usage=continuous_usage)
            return StreamingResponse(events, media_type="text/event-stream", headers=_SSE_HEADERS)
        return await collect(generation, fmt, num_prompt_tokens=num_prompt_tokens, request=request)

    install_openapi(app, {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                          "/v1/responses": ResponsesRequest, "/detokenize": DetokenizeRequest,
                          "/tokenize": (TokenizeChatRequest, TokenizeCompletionRequest)},
                    (CompletionChunk, ChatCompletionChunk),
                    ServedFacts(model_names=tuple(config.model_names), vocab_size=tokenizer.vocab_size,
                                takes_media=image_tokens is not None and backend_factory is None,
                                tools=tokenizer.template_supports_tools,
                                auto_tool_choice=config.enable_auto_tool_choice and config.tool_call_parser is not None,
                                completion_max_tokens=first(sampling_defaults.max_tokens, config.default_max_tokens),
                                api_keys=bool(config.api_keys), protect_metrics=config.protect_metrics))
    return app


async def _publish_metrics(peers: PeerGatewayMetrics, metrics: GatewayMetrics, stop: asyncio.Event) -> None:
    """Publish this gateway's own metrics about every second, for the scrapes its peers answer,
    until `stop` is set; a failed write is retried at the next tick (logged once per outage)."""
    failing = False
    while not stop.is_set():
        try:
            await peers.publish(metrics.own_exposition())
            failing = False
        except Exception as exc:
            if not failing:
                logger.warning("could not publish this gateway's metrics (retrying each second): %s", exc)
            failing = True
        with suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), PUBLISH_INTERVAL_S)


_DESCRIPTION = ("OpenAI's API as pagedserve serves it. This document is the contract: a body it calls "
                "valid is accepted, up to the refusals listed with each 400 (what JSON Schema cannot say, "
                "such as a prompt too long for the context); every error has OpenAI's error body.")
