"""/v1/completions and /v1/chat/completions: a body parsed and admitted by Preflight
(gateway/preflight.py), its output format made (gateway/completion_output.py), and the
generation answered by `answer` (gateway/routes/answer.py), as `data:` chunks ending in
[DONE] when the request asked for `stream: true`."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.completion_models import ChatCompletionResponse, CompletionResponse
from gateway.completion_output import ChatFormat, CompletionFormat, CompletionPrompt, Echo, OutputFormat
from gateway.generation_group import Generating
from gateway.media.uuids import media_scope
from gateway.openapi_answers import (CHAT_BEYOND, COMPLETION_BEYOND, GENERATE_ERRORS, chunk_events,
                                     error_responses, json_or_event_stream)
from gateway.preflight import parse, read_body
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.routes.answer import EventStream, answer
from gateway.serving import stream_sse

router = APIRouter()


def _chunks(fmt: OutputFormat, *, include_usage: bool, continuous_usage: bool) -> EventStream:
    """A stream of `fmt`'s chunks (gateway/serving.py's `stream_sse`)."""

    def events(generation: Generating, num_prompt_tokens: int) -> AsyncIterator[str]:
        return stream_sse(generation, fmt, include_usage=include_usage, num_prompt_tokens=num_prompt_tokens,
                          continuous_usage=continuous_usage)

    return events


@router.post("/v1/completions", responses={**json_or_event_stream(CompletionResponse, chunk_events("CompletionChunk")),
                                           **error_responses(*GENERATE_ERRORS, beyond=COMPLETION_BEYOND)})
async def completions(request: Request) -> Response:
    state = request.app.state
    body = parse(CompletionRequest, await read_body(request, state.config.max_body_bytes))
    batch = await state.preflight.admit_completion(body)
    prompts = []
    for prompt, admitted in zip(body.prompt, batch):
        echo = None
        if body.echo:
            text, offsets = state.tokenizer.text_with_offsets(admitted.prompt_token_ids)
            echo = Echo(prompt if isinstance(prompt, str) else text, offsets)
        prompts.append(CompletionPrompt(admitted.prompt_token_ids, echo))
    fmt = CompletionFormat(batch[0].request_id, state.config.model_name, prompts, body.n or 1,
                           bool(body.return_token_ids), state.token_texts, body.logprobs)
    return await answer(request, batch, fmt, stream=_chunks(
        fmt, include_usage=body.include_usage, continuous_usage=body.continuous_usage) if body.stream else None)


@router.post("/v1/chat/completions", responses={
    **json_or_event_stream(ChatCompletionResponse, chunk_events("ChatCompletionChunk")),
    **error_responses(*GENERATE_ERRORS, 501, beyond=CHAT_BEYOND)})
async def chat_completions(request: Request) -> Response:
    state = request.app.state
    body = parse(ChatCompletionRequest, await read_body(request, state.config.max_body_bytes))
    scope = media_scope(request.headers.get("authorization"), keyed=bool(state.config.api_keys))
    admitted = await state.preflight.admit_chat(body, scope)
    fmt = ChatFormat(admitted.request_id, state.config.model_name, admitted.prompt_token_ids,
                     bool(body.return_token_ids), state.token_texts, body.num_logprobs,
                     tool_parser=admitted.tool_parser)
    return await answer(request, [admitted], fmt, stream=_chunks(
        fmt, include_usage=body.include_usage, continuous_usage=body.continuous_usage) if body.stream else None)
