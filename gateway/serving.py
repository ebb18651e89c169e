"""Turning a `Generation` into an HTTP answer: an SSE stream, or one JSON body.

Both abort the request at the scheduler when the client goes away: the stream through
`Generation.close()` in its cleanup (Starlette cancels the generator on disconnect), the
JSON path by watching `request.is_disconnected()` while it collects.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from gateway.errors import OpenAIError
from gateway.generation import Generation
from gateway.responses import ResponseFormat, usage

logger = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.25
_DONE = "data: [DONE]\n\n"


def _event(chunk: BaseModel, include_usage: bool) -> str:
    # Without include_usage the key is left out entirely; with it, null until the last chunk.
    exclude = None if include_usage else {"usage"}
    return f"data: {chunk.model_dump_json(exclude=exclude)}\n\n"


async def stream_sse(generation: Generation, fmt: ResponseFormat, *, include_usage: bool,
                     num_prompt_tokens: int) -> AsyncIterator[str]:
    """SSE lines ending in `data: [DONE]`. An error after the stream started can only be
    reported inside it: one `data: {"error": {...}}` event, then [DONE]."""
    num_tokens = 0
    try:
        first = fmt.first_chunk()
        if first is not None:
            yield _event(first, include_usage)
        async for output in generation.outputs():
            num_tokens = output.num_tokens
            if output.text or (fmt.return_token_ids and output.token_ids):
                yield _event(fmt.chunk(output.text, None, output.token_ids), include_usage)
            if output.finish_reason is not None:
                yield _event(fmt.chunk("", output.finish_reason, []), include_usage)
        if include_usage:
            yield _event(fmt.usage_chunk(usage(num_prompt_tokens, num_tokens)), include_usage)
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


async def collect(generation: Generation, fmt: ResponseFormat, *, num_prompt_tokens: int,
                  request: Request) -> Response:
    """Run the generation to its end and answer with one JSON body; abort if the client
    disconnects first (OpenAIErrors propagate to the app's handler)."""
    collecting = asyncio.ensure_future(_collect_text(generation))
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
    text, token_ids, finish_reason = collecting.result()  # raises the generation's error
    body = fmt.response(text, finish_reason, usage(num_prompt_tokens, len(token_ids)), token_ids)
    return JSONResponse(body.model_dump(mode="json"))


async def _collect_text(generation: Generation) -> tuple[str, list[int], str | None]:
    pieces: list[str] = []
    token_ids: list[int] = []
    finish_reason = None
    async for output in generation.outputs():
        pieces.append(output.text)
        token_ids += output.token_ids
        finish_reason = output.finish_reason
    return "".join(pieces), token_ids, finish_reason


async def _wait_for_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(_DISCONNECT_POLL_S)
