"""Everything a request must pass before it is queued (DESIGN.md step 1): body size, JSON and
schema, model name, a live worker, tokenization, vocabulary and context length (the API key
is checked before routing, by `gateway.auth`); for a chat request with images or video, the
media too (gateway/mm_prompt.py: refused before anything is fetched when the server cannot
take them, then fetched, checked, stored, and placed in the prompt, whose image tokens count
toward the context length).
Each failure is an `OpenAIError` with the status OpenAI would use."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from redis.exceptions import RedisError

from gateway.admission import admit
from gateway.backend import RedisBackend
from gateway.config import GatewayConfig
from gateway.errors import OpenAIError, from_validation_errors, invalid
from gateway.generation import TextOptions
from gateway.media.uuids import SHARED_SCOPE
from gateway.mm_prompt import MediaPrompts, media_parts
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.request_part import ignored_fields
from gateway.sampling_defaults import SamplingDefaults
from gateway.structured_output import grammar_for
from gateway.tokenizer import PromptTokenizer
from gateway.tool_parsers.calls import ToolParser
from gateway.tools import plan_tools
from proto.messages import Grammar, MultiModalInput, NewRequest, SamplingParams

Body = TypeVar("Body", bound=BaseModel)
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Admitted:
    """A request that passed every check, ready for its `Generation`: one NewRequest, also
    for n > 1 (the scheduler computes the prompt once and forks n sequences sharing its
    KV blocks, seeded and named by proto/parallel.py)."""

    request: NewRequest
    text: TextOptions
    tool_parser: ToolParser | None = None  # chat with tools: reads calls out of the text

    @property
    def request_id(self) -> str:  # the response's id
        return self.request.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)


# A body over the limit is still read (and dropped) up to this many bytes past the limit
# before the 413 goes out: a client is reading its answer only once it has sent everything,
# and a server that closes with unread data makes the client's TCP stack see a reset instead.
DRAIN_CAP_BYTES = 64 * 2**20


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refusing (413) anything over `limit` bytes without keeping it: the
    rest is drained (up to DRAIN_CAP_BYTES more), then the answer closes the connection."""
    declared = request.headers.get("content-length", "")
    body = bytearray()
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limit and not (declared.isdigit() and int(declared) > limit):
            body += chunk
        elif size > limit + DRAIN_CAP_BYTES:
            break
    if size > limit or (declared.isdigit() and int(declared) > limit):
        raise OpenAIError(413, f"The request body is {max(size, int(declared or 0))} bytes or more; the "
                               f"limit is {limit} bytes.", code="request_too_large",
                          headers={"Connection": "close"})
    return bytes(body)


def parse(model: type[Body], body: bytes) -> Body:
    """The validated body; unknown fields are ignored, with one warning naming them."""
    try:
        parsed = model.model_validate_json(body, strict=True)
    except ValidationError as exc:
        raise from_validation_errors(list(exc.errors(include_url=False))) from None
    ignored = ignored_fields(parsed)
    if ignored:
        logger.warning("%s: ignoring unknown fields %s", model.__name__, ", ".join(ignored))
    return parsed


class Preflight:
    def __init__(self, config: GatewayConfig, backend: RedisBackend, tokenizer: PromptTokenizer,
                 defaults: SamplingDefaults = SamplingDefaults(), media: MediaPrompts | None = None):
        self.config = config
        self.backend = backend
        self.tokenizer = tokenizer
        self.defaults = defaults  # for parameters a request leaves out (generation_config.json)
        # prompts with images or video; by default none are taken (a text model's answer)
        self.media = media or MediaPrompts(config.model_name, tokenizer, None, None)

    def check_model(self, requested_model: str | None) -> None:
        """404 for a model name this gateway does not serve (absent means the served one)."""
        names = self.config.model_names
        if requested_model is not None and requested_model not in names:
            served = ", ".join(f"'{n}'" for n in names)
            raise OpenAIError(404, f"The model '{requested_model}' does not exist; this server "
                                   f"serves {served}.", param="model", code="model_not_found")

    async def max_model_len(self, requested_model: str | None) -> int:
        """404 for a model this gateway does not serve, 503 when no live worker serves it;
        else the smallest max_model_len among those workers (any of them may get it)."""
        self.check_model(requested_model)
        name = self.config.model_name
        try:
            workers = [w for w in await self.backend.live_workers() if w.model == name]
        except (RedisError, OSError) as exc:
            raise OpenAIError(503, f"The worker registry is unreachable: {exc}", code="redis_unavailable") from exc
        if not workers:
            raise OpenAIError(503, f"No live worker serves the model '{name}' right now; retry later.",
                              code="no_live_worker")
        return min(w.max_model_len for w in workers)

    async def admit_completion(self, body: CompletionRequest) -> list[Admitted]:
        """One Admitted per prompt (a batch of prompts is one request each)."""
        max_model_len = await self.max_model_len(body.model)
        await admit(self.backend)
        max_tokens = first(body.max_tokens, self.defaults.max_tokens, self.config.default_max_tokens)
        prompt_logprobs = body.logprobs if body.echo else None
        grammar = await asyncio.to_thread(grammar_for, body)
        admitted = []
        for prompt in body.prompt:
            if isinstance(prompt, str):
                prompt_ids = await asyncio.to_thread(self.tokenizer.encode_text, prompt,
                                                     bool(body.add_special_tokens))
            else:
                self.tokenizer.check_ids(prompt, "prompt")
                prompt_ids = list(prompt)
            admitted.append(self._admit(body, "cmpl", prompt_ids, max_tokens, max_model_len, where="prompt",
                                        logprobs=body.logprobs, prompt_logprobs=prompt_logprobs,
                                        grammar=grammar))
        return admitted

    async def admit_chat(self, body: ChatCompletionRequest, media_scope: str = SHARED_SCOPE) -> Admitted:
        """`media_scope`: whose media uuids the request's parts may name (gateway/media/uuids.py)."""
        parts = media_parts(body.messages) if body.has_media else []
        if parts:  # what no fetch can fix is refused first: a text model, the engine, limits
            self.check_model(body.model)
            self.media.check(body, parts)
        max_model_len = await self.max_model_len(body.model)
        await admit(self.backend)
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        mm_inputs: tuple[MultiModalInput, ...] = ()
        if parts:
            prompt = await self.media.build(body, parts, tools, media_scope, max_model_len)
            prompt_ids, mm_inputs = prompt.token_ids, prompt.mm_inputs
        else:
            prompt_ids = await asyncio.to_thread(
                self.tokenizer.encode_chat, [m.template_dict() for m in body.messages], tools=tools,
                add_generation_prompt=bool(body.add_generation_prompt),
                continue_final_message=bool(body.continue_final_message),
                template_kwargs=body.chat_template_kwargs or {},
                add_special_tokens=bool(body.add_special_tokens))
        max_tokens = body.requested_max_tokens
        if max_tokens is None:  # as much as the context leaves (at least 1), or the model's default
            left = max(1, max_model_len - len(prompt_ids))
            max_tokens = min(left, first(self.defaults.max_tokens, left))
        tools = await asyncio.to_thread(plan_tools, body, self.config.tool_call_parser,
                                        self.config.enable_auto_tool_choice)
        grammar = tools.grammar or await asyncio.to_thread(grammar_for, body)
        admitted = self._admit(body, "chatcmpl", prompt_ids, max_tokens, max_model_len, where="messages",
                               logprobs=body.num_logprobs, prompt_logprobs=None, grammar=grammar,
                               mm_inputs=mm_inputs)
        if tools.parser is None:
            return admitted
        text = admitted.text
        if tools.parser.needs_special_tokens:  # its markers are special tokens (vLLM does the same)
            text = TextOptions(text.stop, skip_special_tokens=False, include_stop_str=text.include_stop_str)
        return Admitted(admitted.request, text, tools.parser)

    def _admit(self, body: CompletionRequest | ChatCompletionRequest, id_prefix: str,
               prompt_ids: list[int], max_tokens: int, max_model_len: int, where: str, *,
               logprobs: int | None, prompt_logprobs: int | None,
               grammar: Grammar | None = None, mm_inputs: tuple[MultiModalInput, ...] = ()) -> Admitted:
        """`mm_inputs`: the images' soft-token ranges in `prompt_ids` (gateway/mm_prompt.py);
        they count toward the context like any token, and truncation never applies to them
        (MediaPrompts.check refuses truncate_prompt_tokens with media)."""
        if body.truncate_prompt_tokens is not None:  # vLLM's: keep the last k tokens
            prompt_ids = prompt_ids[-body.truncate_prompt_tokens:]
        if not prompt_ids:
            raise invalid("The prompt is empty after tokenization.", param=where)
        if not mm_inputs:
            self.media.check_text_prompt(prompt_ids, where)
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
                             arrival_time=time.time(), priority=body.priority or 0, n=body.n or 1,
                             mm_inputs=mm_inputs)
        return Admitted(request, TextOptions(stop=body.stop, skip_special_tokens=body.skip_special_tokens is not False,
                                             include_stop_str=bool(body.include_stop_str_in_output)))

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
                          param="min_tokens", code="min_tokens_above_max_tokens")
        logit_bias = body.token_logit_bias
        self.tokenizer.check_ids(list(logit_bias), "logit_bias")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=first(body.temperature, self.defaults.temperature, 1.0),
            top_p=first(body.top_p, self.defaults.top_p, 1.0),
            top_k=max(0, first(body.top_k, self.defaults.top_k, 0)),  # -1 and 0: no top-k
            seed=body.seed, stop_token_ids=stop_token_ids, ignore_eos=bool(body.ignore_eos),
            min_tokens=min_tokens,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=first(body.repetition_penalty, self.defaults.repetition_penalty, 1.0),
            min_p=first(body.min_p, self.defaults.min_p, 0.0),
            logit_bias=logit_bias,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            grammar=grammar,
        )


def first(*values):
    """The first value that is not None (a request's own, then the model's default, then ours)."""
    return next(v for v in values if v is not None)
