"""Turning the `Generation`s of one request (n of them for `n` choices) into an HTTP answer:
an SSE stream, or one JSON body.

Both abort the requests at the scheduler when the client goes away: the stream through
`Generation.close()` in its cleanup (Starlette cancels the generator on disconnect), the
JSON path by watching `request.is_disconnected()` while it collects. With n > 1 the
generations run concurrently and their outputs interleave in arrival order; the first error
of any of them ends the whole answer (and aborts the others).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from gateway.errors import OpenAIError
from gateway.generation import Generation, GenerationOutput
from gateway.responses import ChoiceResult, ResponseFormat, usage

logger = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.25
_DONE = "data: [DONE]\n\n"


def _event(chunk: BaseModel, include_usage: bool) -> str:
    # Without include_usage the key is left out entirely; with it, null until the last chunk.
    exclude = None if include_usage else {"usage"}
    return f"data: {chunk.model_dump_json(exclude=exclude)}\n\n"


async def merged_outputs(generations: Sequence[Generation]) -> AsyncIterator[tuple[int, GenerationOutput]]:
    """(choice index, output) from every generation, in arrival order; raises the first error.

    Choices 1..n-1 are submitted once choice 0 has its first token: its prompt has been
    prefilled by then, so the prefix cache holds the prompt's full blocks and the other
    choices reuse them instead of computing the prompt n times (one prefill of latency)."""
    if len(generations) == 1:
        async for output in generations[0].outputs():
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, GenerationOutput | None, Exception | None]] = asyncio.Queue()
    prefilled = asyncio.Event()

    async def pump(index: int, generation: Generation) -> None:
        try:
            if index > 0:
                await prefilled.wait()
            async for output in generation.outputs():
                prefilled.set()
                queue.put_nowait((index, output, None))
        except Exception as exc:
            queue.put_nowait((index, None, exc))
        else:
            queue.put_nowait((index, None, None))
        finally:
            if index == 0:
                prefilled.set()

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(generations)]
    try:
        running = len(tasks)
        while running:
            index, output, error = await queue.get()
            if error is not None:
                raise error
            if output is None:
                running -= 1
            else:
                yield index, output
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _close_all(generations: Sequence[Generation]) -> None:
    for generation in generations:
        generation.close()  # no-op when finished; else (client gone, error) an abort


async def stream_sse(generations: Sequence[Generation], fmt: ResponseFormat, *, include_usage: bool,
                     num_prompt_tokens: int) -> AsyncIterator[str]:
    """SSE lines ending in `data: [DONE]`. An error after the stream started can only be
    reported inside it: one `data: {"error": {...}}` event, then [DONE]."""
    num_tokens = [0] * len(generations)
    first = [True] * len(generations)  # no chunk of this choice sent yet
    try:
        for chunk in fmt.first_chunks(len(generations)):
            yield _event(chunk, include_usage)
        async for index, output in merged_outputs(generations):
            num_tokens[index] = output.num_tokens
            # A choice's first chunk goes out even when empty: it may carry the echo or ids.
            if fmt.worth_a_chunk(output, first[index]) or (first[index] and output.finish_reason):
                yield _event(fmt.chunk(index, output, first[index]), include_usage)
                first[index] = False
            if output.finish_reason is not None:
                yield _event(fmt.finish_chunk(index, output.finish_reason), include_usage)
        if include_usage:
            yield _event(fmt.usage_chunk(usage(num_prompt_tokens, sum(num_tokens))), include_usage)
    except OpenAIError as exc:
        yield f"data: {json.dumps(exc.body())}\n\n"
    except Exception:
        logger.exception("stream of %s failed", generations[0].request_id)
        error = OpenAIError(500, "The server had an error while processing your request.",
                            type="server_error", code="internal_error")
        yield f"data: {json.dumps(error.body())}\n\n"
    finally:
        _close_all(generations)
    yield _DONE


async def collect(generations: Sequence[Generation], fmt: ResponseFormat, *, num_prompt_tokens: int,
                  request: Request) -> Response:
    """Run the generations to their end and answer with one JSON body; abort if the client
    disconnects first (OpenAIErrors propagate to the app's handler)."""
    results = [ChoiceResult() for _ in generations]
    collecting = asyncio.ensure_future(_collect(generations, results))
    watching = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (collecting, watching):
            task.cancel()
        await asyncio.gather(collecting, watching, return_exceptions=True)
        _close_all(generations)
    if not collecting.done() or collecting.cancelled():
        # The client is gone; nobody reads this, but the ASGI call still needs an answer.
        return Response(status_code=499)
    collecting.result()  # raises the generation's error
    num_tokens = sum(len(r.token_ids) for r in results)
    body = fmt.response(results, usage(num_prompt_tokens, num_tokens))
    return JSONResponse(body.model_dump(mode="json"))


async def _collect(generations: Sequence[Generation], results: list[ChoiceResult]) -> None:
    async for index, output in merged_outputs(generations):
        results[index].add(output)


async def _wait_for_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(_DISCONNECT_POLL_S)
