"""The FastAPI app: its state, lifespan, middleware and /openapi.json. The routes are
routers by surface (gateway/routes/), thin over Preflight (checks), Generation (the
request's life) and serving (SSE or JSON). Everything stateful lives on `app.state`, made
here and read by the routes through `request.app.state`:

    config, tokenizer, token_texts, metrics, encoder_registry   made by `create_app`
    backend, preflight, peer_metrics, files                      made in the lifespan
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress

from fastapi import FastAPI

from gateway.auth import APIKeyMiddleware, APIKeys
from gateway.backend import RedisBackend
from gateway.completion_models import ChatCompletionChunk, CompletionChunk
from gateway.config import GatewayConfig
from gateway.errors import install_error_handlers
from gateway.files.references import FileReferences
from gateway.files.store import FileSettings, FileStore
from gateway.gateway_metrics_peers import PUBLISH_INTERVAL_S, PeerGatewayMetrics
from gateway.image_tokens import ImageTokens
from gateway.media.loader import MediaLoader
from gateway.metrics import GatewayMetrics, MetricsMiddleware
from gateway.mm_prompt import MediaPrompts
from gateway.openapi_document import ServedFacts, install_openapi
from gateway.preflight import Preflight, first
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.responses_api.request import ResponsesRequest
from gateway.routes import completions, files, health, models, responses, tokenize
from gateway.sampling_defaults import SamplingDefaults
from gateway.token_text import TokenTexts
from gateway.tokenize_models import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from gateway.tokenizer import PromptTokenizer
from proto.encoder_registry import EncoderRegistry
from proto.keys import RedisKeys
from proto.model_source import resolve_model

logger = logging.getLogger(__name__)


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
    image_tokens = ImageTokens.read(model_dir, tokenizer.hf)  # None: a text model
    file_settings = FileSettings.from_config(config) if backend_factory is None else None
    metrics = GatewayMetrics(config.model_name)

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
    app.state.token_texts = TokenTexts(tokenizer)
    app.state.metrics = metrics
    app.state.encoder_registry = EncoderRegistry(RedisKeys(config.key_prefix))
    install_error_handlers(app)
    app.include_router(health.router)
    if file_settings is not None:  # the stack: files live in Redis
        app.include_router(files.router(config.file_ttl_s))
    for surface in (models, tokenize, completions, responses):
        app.include_router(surface.router)
    app.add_middleware(APIKeyMiddleware, keys=APIKeys(config.api_keys),
                       protect_metrics=config.protect_metrics)
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # outermost: sees 401s too

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
