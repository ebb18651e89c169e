"""What the generating routes share: a request's admitted prompts made into their metered
`Generation` (a `GenerationGroup` when one /v1/completions request has several prompts), and
that generation answered, streamed as server-sent events or collected into one JSON body
(gateway/serving.py). /v1/completions, /v1/chat/completions and /v1/responses all answer
through `answer`: they differ only in their output format and in how a stream is written."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from gateway.generation import Generation
from gateway.generation_group import Generating, GenerationGroup
from gateway.preflight import Admitted
from gateway.serving import BodyFormat, collect

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

# A stream's SSE text, from the generation and the number of prompt tokens (for its usage).
EventStream = Callable[[Generating, int], AsyncIterator[str]]


async def answer(request: Request, batch: list[Admitted], fmt: BodyFormat, *,
                 stream: EventStream | None) -> Response:
    """Generate `batch` (the admitted prompts of one request) and answer: with `stream`'s
    events, or (None) one JSON body that `fmt` shapes."""
    state = request.app.state
    members = [state.metrics.meter(Generation(state.backend, state.tokenizer, admitted.request,
                                              text=admitted.text, timeout_s=state.config.request_timeout_s),
                                   num_prompt_tokens=admitted.num_prompt_tokens) for admitted in batch]
    generation: Generating = members[0] if len(members) == 1 else GenerationGroup(batch[0].request_id, members)
    num_prompt_tokens = sum(admitted.num_prompt_tokens for admitted in batch)
    if stream is not None:
        return StreamingResponse(stream(generation, num_prompt_tokens), media_type="text/event-stream",
                                 headers=_SSE_HEADERS)
    return await collect(generation, fmt, num_prompt_tokens=num_prompt_tokens, request=request)
