"""Everything a request must pass before it is queued (DESIGN.md step 1): body size, JSON and
schema, model name, a live worker, tokenization, vocabulary and context length (the API key
is checked before routing, by `gateway.auth`).
Each failure is an `OpenAIError` with the status OpenAI would use."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from redis.exceptions import RedisError

from gateway.backend import RedisBackend
from gateway.config import GatewayConfig
from gateway.errors import OpenAIError, from_validation_errors, invalid
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.structured_output import grammar_for
from gateway.tokenizer import PromptTokenizer
from proto.messages import Grammar, NewRequest, SamplingParams

Body = TypeVar("Body", bound=BaseModel)


@dataclass(frozen=True)
class Admitted:
    """A request that passed every check, ready for its `Generation`: one NewRequest, also
    for n > 1 (the scheduler computes the prompt once and forks n sequences sharing its
    KV blocks, seeded and named by proto/parallel.py)."""

    request: NewRequest
    stop: list[str] | None

    @property
    def request_id(self) -> str:  # the response's id
        return self.request.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refusing (413) anything over `limit` bytes without reading all of it."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(len(body), limit)
    return bytes(body)


def _too_large(size: int, limit: int) -> OpenAIError:
    return OpenAIError(413, f"The request body is {size} bytes or more; the limit is {limit} bytes.",
                       code="request_too_large")


def parse(model: type[Body], body: bytes) -> Body:
    try:
        return model.model_validate_json(body, strict=True)
    except ValidationError as exc:
        raise from_validation_errors(list(exc.errors(include_url=False))) from None


class Preflight:
    def __init__(self, config: GatewayConfig, backend: RedisBackend, tokenizer: PromptTokenizer):
        self.config = config
        self.backend = backend
        self.tokenizer = tokenizer

    async def max_model_len(self, requested_model: str | None) -> int:
        """404 for a model this gateway does not serve, 503 when no live worker serves it;
        else the smallest max_model_len among those workers (any of them may get it)."""
        name = self.config.model_name
        if requested_model is not None and requested_model != name:
            raise OpenAIError(404, f"The model '{requested_model}' does not exist; this server "
                                   f"serves '{name}'.", param="model", code="model_not_found")
        try:
            workers = [w for w in await self.backend.live_workers() if w.model == name]
        except (RedisError, OSError) as exc:
            raise OpenAIError(503, f"The worker registry is unreachable: {exc}", code="redis_unavailable") from exc
        if not workers:
            raise OpenAIError(503, f"No live worker serves the model '{name}' right now; retry later.",
                              code="no_live_worker")
        return min(w.max_model_len for w in workers)

    async def admit_completion(self, body: CompletionRequest) -> Admitted:
        max_model_len = await self.max_model_len(body.model)
        if isinstance(body.prompt, str):
            prompt_ids = await asyncio.to_thread(self.tokenizer.encode_text, body.prompt)
        else:
            self.tokenizer.check_ids(body.prompt, "prompt")
            prompt_ids = list(body.prompt)
        max_tokens = body.max_tokens if body.max_tokens is not None else self.config.default_max_tokens
        prompt_logprobs = body.logprobs if body.echo else None
        return self._admit(body, "cmpl", prompt_ids, max_tokens, max_model_len, where="prompt",
                           logprobs=body.logprobs, prompt_logprobs=prompt_logprobs)

    async def admit_chat(self, body: ChatCompletionRequest) -> Admitted:
        max_model_len = await self.max_model_len(body.model)
        messages = [m.template_dict() for m in body.messages]
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        prompt_ids = await asyncio.to_thread(
            self.tokenizer.encode_chat, messages, tools=tools,
            add_generation_prompt=bool(body.add_generation_prompt),
            continue_final_message=bool(body.continue_final_message),
            template_kwargs=body.chat_template_kwargs or {})
        max_tokens = body.requested_max_tokens
        if max_tokens is None:  # as much as the context leaves (at least 1, checked below)
            max_tokens = max(1, max_model_len - len(prompt_ids))
        grammar = await asyncio.to_thread(grammar_for, body.response_format)
        return self._admit(body, "chatcmpl", prompt_ids, max_tokens, max_model_len, where="messages",
                           logprobs=body.num_logprobs, prompt_logprobs=None, grammar=grammar)

    def _admit(self, body: CompletionRequest | ChatCompletionRequest, id_prefix: str,
               prompt_ids: list[int], max_tokens: int, max_model_len: int, where: str, *,
               logprobs: int | None, prompt_logprobs: int | None,
               grammar: Grammar | None = None) -> Admitted:
        if not prompt_ids:
            raise invalid("The prompt is empty after tokenization.", param=where)
        total = len(prompt_ids) + max_tokens
        if total > max_model_len:
            raise invalid(
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {total} tokens ({len(prompt_ids)} in the {where}, {max_tokens} in the "
                f"completion). Please reduce the length of the {where} or completion.",
                param=where, code="context_length_exceeded")
        sampling = self._sampling(body, max_tokens, logprobs, prompt_logprobs, grammar)
        request = NewRequest(request_id=f"{id_prefix}-{uuid.uuid4().hex}", prompt_token_ids=prompt_ids,
                             sampling=sampling, reply_channel=self.backend.reply_channel,
                             arrival_time=time.time(), priority=0, n=body.n or 1)
        return Admitted(request, body.stop)

    def _sampling(self, body: CompletionRequest | ChatCompletionRequest, max_tokens: int,
                  logprobs: int | None, prompt_logprobs: int | None,
                  grammar: Grammar | None) -> SamplingParams:
        # EOS is not added to stop_token_ids: the worker knows the model's EOS ids (from
        # generation_config.json) and applies ignore_eos and min_tokens to them itself.
        stop_token_ids = list(body.stop_token_ids or [])
        self.tokenizer.check_ids(stop_token_ids, "stop_token_ids")
        min_tokens = body.min_tokens or 0
        if min_tokens > max_tokens:
            raise invalid(f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens}).",
                          param="min_tokens", code="invalid_value")
        logit_bias = body.token_logit_bias
        self.tokenizer.check_ids(list(logit_bias), "logit_bias")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if body.top_k in (None, -1) else body.top_k,
            seed=body.seed, stop_token_ids=stop_token_ids, ignore_eos=bool(body.ignore_eos),
            min_tokens=min_tokens,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            min_p=body.min_p or 0.0,
            logit_bias=logit_bias,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            grammar=grammar,
        )
