"""One request's life inside the gateway, after validation (DESIGN.md steps 2 and 8).

    generation = Generation(backend, tokenizer, new_request, stop=..., ...)
    try:
        async for output in generation.outputs():   # submits, then yields text increments
            ...
    finally:
        generation.close()                           # aborts it if it did not finish

Token events are deduplicated by `index` (a request re-routed after a worker died resumes at
the right index, possibly repeating tokens we have), detokenized incrementally, and cut at
stop strings; a stop-string hit sends an AbortRequest so the scheduler frees the blocks.
Failures reach the caller as `OpenAIError`s.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from redis.exceptions import RedisError

from gateway.backend import RedisBackend
from gateway.detokenizer import IncrementalDetokenizer
from gateway.errors import OpenAIError
from gateway.stop_strings import StopStringMatcher
from gateway.tokenizer import PromptTokenizer
from proto.messages import Logprobs, NewRequest, TokenEvent

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationOutput:
    text: str  # new text since the previous output (may be "": ids mid-character, or the end)
    token_ids: list[int]  # the output ids that arrived since the previous output
    num_tokens: int  # completion tokens so far
    finish_reason: str | None  # "stop" or "length" in the last output, else None
    # With sampling.logprobs: one per token_ids entry. text_offsets: where each token's text
    # starts in the whole output text (before any stop-string cut).
    logprobs: list[Logprobs] | None = None
    text_offsets: list[int] | None = None
    # With sampling.prompt_logprobs, in the first output only: prompt position → logprobs
    # (positions 1 .. len(prompt) - 1).
    prompt_logprobs: dict[int, Logprobs] | None = None


class Generation:
    def __init__(self, backend: RedisBackend, tokenizer: PromptTokenizer, request: NewRequest,
                 *, stop: list[str] | None, timeout_s: float):
        self.request = request
        self._backend = backend
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._stop = StopStringMatcher(stop)
        self._timeout_s = timeout_s
        self._submitted = False
        self._finished = False  # the scheduler is done with it, or we already aborted it
        self._text_length = 0  # characters the detokenizer produced so far
        self._prompt_logprobs: dict[int, Logprobs] = {}
        self._sent_prompt_logprobs = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    async def outputs(self) -> AsyncIterator[GenerationOutput]:
        # Submitted lazily, on first iteration: a stream the server never starts (client gone
        # before the first byte) then leaves nothing behind at the scheduler.
        queue = self._backend.open(self.request_id)
        self._submitted = True  # before the XADD: if it is cancelled midway, close() aborts
        try:
            await self._backend.submit(self.request)
        except (RedisError, OSError) as exc:
            raise OpenAIError(503, f"The request queue is unreachable: {exc}") from exc
        while not self._finished:
            event = await self._next_event(queue)
            output = await self._apply(event)
            if output is not None:
                yield output

    def close(self) -> None:
        """Release the event queue; abort at the scheduler if the request is still running
        (client gone, timeout, or the caller stopped iterating)."""
        self._backend.close(self.request_id)
        if self._submitted and not self._finished:
            self._finished = True
            self._backend.abort_soon(self.request_id)

    async def _next_event(self, queue: asyncio.Queue[TokenEvent]) -> TokenEvent:
        try:
            return await asyncio.wait_for(queue.get(), self._timeout_s)
        except TimeoutError:
            raise OpenAIError(504, f"No tokens arrived for {self._timeout_s:g}s; the request was "
                                   "aborted.", code="timeout") from None

    async def _apply(self, event: TokenEvent) -> GenerationOutput | None:
        if event.finish_reason in ("error", "abort"):
            self._finished = True  # the scheduler has already dropped it
            if event.finish_reason == "abort":
                raise OpenAIError(503, "The request was aborted by the server.", code="aborted")
            raise OpenAIError(500, f"The model failed on this request: {event.error or 'unknown error'}",
                              type="server_error", code="generation_error")
        for i, logprobs in enumerate(event.prompt_logprobs or ()):  # a recompute may resend
            self._prompt_logprobs.setdefault(event.prompt_index + i, logprobs)
        pieces: list[str] = []
        taken: list[int] = []
        offsets: list[int] = []
        new_ids, new_logprobs = self._new_tokens(event)
        for token_id in new_ids:
            taken.append(token_id)
            offsets.append(self._text_length)
            piece = self._detokenizer.step(token_id)
            self._text_length += len(piece)
            check = self._stop.feed(piece, check=self._stops_active())
            pieces.append(check.text)
            if check.stopped:
                await self._stop_string_hit(event)
                return self._output(pieces, taken, "stop", new_logprobs, offsets)
        if event.finish_reason is None:
            return self._output(pieces, taken, None, new_logprobs, offsets) if taken else None
        # The scheduler finished it ("stop": EOS / stop token, "length": max_tokens).
        self._finished = True
        check = self._stop.feed(self._detokenizer.flush(), check=self._stops_active())
        pieces.append(check.text)
        pieces.append(self._stop.flush())
        return self._output(pieces, taken, "stop" if check.stopped else event.finish_reason,
                            new_logprobs, offsets)

    def _output(self, pieces: list[str], token_ids: list[int], finish_reason: str | None,
                logprobs: list[Logprobs] | None, offsets: list[int]) -> GenerationOutput:
        prompt_logprobs = None
        if self.request.sampling.prompt_logprobs is not None and not self._sent_prompt_logprobs:
            prompt_logprobs, self._sent_prompt_logprobs = self._prompt_logprobs, True
        if logprobs is not None:
            logprobs = logprobs[:len(token_ids)]  # a stop string may end the output early
        return GenerationOutput("".join(pieces), token_ids, self._detokenizer.num_tokens, finish_reason,
                                logprobs=logprobs, text_offsets=offsets, prompt_logprobs=prompt_logprobs)

    def _new_tokens(self, event: TokenEvent) -> tuple[list[int], list[Logprobs] | None]:
        """The event's tokens we do not have yet, and their logprobs. Events of one request
        arrive in order, but after a re-route the new worker may resend positions we have."""
        have = self._detokenizer.num_tokens
        if event.index > have:
            logger.warning("request %s: tokens %d..%d never arrived; continuing at %d",
                           self.request_id, have, event.index - 1, event.index)
        skip = max(0, have - event.index)
        wanted = self.request.sampling.logprobs is not None
        logprobs = list(event.logprobs or [])[skip:] if wanted else None
        return event.token_ids[skip:], logprobs

    def _stops_active(self) -> bool:
        # Like vLLM: stop strings count only once more than min_tokens tokens exist.
        return self._detokenizer.num_tokens > self.request.sampling.min_tokens

    async def _stop_string_hit(self, event: TokenEvent) -> None:
        self._finished = True
        if event.finish_reason is None:  # still running at the scheduler: free its blocks
            try:
                await self._backend.abort(self.request_id)
            except (RedisError, OSError):
                logger.warning("could not abort %s after its stop string", self.request_id, exc_info=True)
