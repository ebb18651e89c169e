"""Turning the `Generation` of one request into an HTTP answer: an SSE stream, or one JSON body.

Both abort the request at the scheduler when the client goes away: the stream through
`Generation.close()` in its cleanup (Starlette cancels the generator on disconnect), the
JSON path by watching `request.is_disconnected()` while it collects. With n > 1 the choices'
outputs interleave in arrival order (the scheduler steps them together); the first error of
any of them ends the whole answer (and aborts the others).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from gateway.completion_models import Usage
from gateway.completion_output import ChoiceResult, OutputFormat, usage
from gateway.errors import OpenAIError
from gateway.generation_group import Generating
from gateway.sse_chunks import TextChunks

logger = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.25
_DONE = "data: [DONE]\n\n"


class BodyFormat(Protocol):
    """What `collect` needs of an output format: the finished choices as one body (an
    `OutputFormat`, or the Responses API's `ResponsesFormat`)."""

    def response(self, choices: list[ChoiceResult], usage: Usage) -> BaseModel: ...


def _event(chunk: BaseModel, include_usage: bool) -> str:
    # Without include_usage the key is left out entirely; with it, null until the last chunk.
    exclude = None if include_usage else {"usage"}
    return f"data: {chunk.model_dump_json(exclude=exclude)}\n\n"


async def stream_sse(generation: Generating, fmt: OutputFormat, *, include_usage: bool,
                     num_prompt_tokens: int, continuous_usage: bool = False) -> AsyncIterator[str]:
    """SSE lines ending in `data: [DONE]`. An error after the stream started can only be
    reported inside it: one `data: {"error": {...}}` event, then [DONE]. With
    `continuous_usage` (vLLM's continuous_usage_stats) every chunk carries the usage so far."""
    num_tokens = [0] * generation.n
    first = [True] * generation.n  # no chunk of this choice sent yet
    # Text-only chunks from a template (gateway/sse_chunks.py); the others through pydantic.
    texts = None if continuous_usage else TextChunks(fmt.text_chunk, include_usage)
    try:
        for chunk in fmt.first_chunks(generation.n):
            yield _event(chunk, include_usage)
        async for index, output in generation.outputs():
            num_tokens[index] = output.num_tokens
            # A choice's first chunk goes out even when empty: it may carry the echo or ids.
            so_far = usage(num_prompt_tokens, sum(num_tokens), generation.num_cached_tokens) \
                if continuous_usage else None
            if texts is not None and output.text and fmt.text_only(first[index]):
                yield texts.event(index, output.text)
                first[index] = False
            elif fmt.worth_a_chunk(output, first[index]) or (first[index] and output.finish_reason):
                chunk = fmt.chunk(index, output, first[index])
                if chunk is not None:
                    chunk.usage = so_far
                    yield _event(chunk, include_usage)
                    first[index] = False
            if output.finish_reason is not None:
                chunk = fmt.finish_chunk(index, output.finish_reason)
                chunk.usage = so_far
                yield _event(chunk, include_usage)
        if include_usage:  # OpenAI's: the prompt once, the completion tokens of every choice
            yield _event(fmt.usage_chunk(usage(num_prompt_tokens, sum(num_tokens), generation.num_cached_tokens)),
                         include_usage)
    except OpenAIError as exc:
        yield f"data: {json.dumps(exc.body())}\n\n"
    except Exception:
        logger.exception("stream of %s failed", generation.request_id)
        error = OpenAIError(500, "The server had an error while processing your request.",
                            type="server_error", code="internal_error")
        yield f"data: {json.dumps(error.body())}\n\n"
    finally:
        generation.close()  # no-op when finished; else (client gone, error) an abort
    yield _DONE


async def collect(generation: Generating, fmt: BodyFormat, *, num_prompt_tokens: int,
                  request: Request) -> Response:
    """Run the generation to its end and answer with one JSON body; abort if the client
    disconnects first (OpenAIErrors propagate to the app's handler)."""
    results = [ChoiceResult() for _ in range(generation.n)]
    collecting = asyncio.ensure_future(_collect(generation, results))
    watching = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (collecting, watching):
            task.cancel()
        await asyncio.gather(collecting, watching, return_exceptions=True)
        generation.close()
    if not collecting.done() or collecting.cancelled():
        # The client is gone; nobody reads this, but the ASGI call still needs an answer.
        return Response(status_code=499)
    collecting.result()  # raises the generation's error
    num_tokens = sum(len(r.token_ids) for r in results)  # the prompt once, every choice's outputs
    body = fmt.response(results, usage(num_prompt_tokens, num_tokens, generation.num_cached_tokens))
    return JSONResponse(body.model_dump(mode="json"))


async def _collect(generation: Generating, results: list[ChoiceResult]) -> None:
    async for index, output in generation.outputs():
        results[index].add(output)


async def _wait_for_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(_DISCONNECT_POLL_S)
