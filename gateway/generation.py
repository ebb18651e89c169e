"""One request's life inside the gateway, after validation (DESIGN.md steps 2 and 8).

    generation = Generation(backend, tokenizer, new_request, text=TextOptions(stop=...), ...)
    try:
        async for index, output in generation.outputs():  # submits, then yields text increments
            ...                                           # of choice `index` (0 .. n-1)
    finally:
        generation.close()                                # aborts what did not finish

Token events are deduplicated by `index` (a request re-routed after a worker died resumes at
the right index, possibly repeating tokens we have; one sent again after a lost subscription
starts over, and events past the gap are dropped until it gets there), detokenized incrementally, and cut at
stop strings; a stop-string hit sends an AbortRequest for its sequence so the scheduler frees
its blocks. Every event queued when the request reads is taken at once, and a choice's
outputs from them are merged into one (`GenerationOutput.then`): a reader that fell behind
catches up in fewer, larger chunks. Failures reach the caller as `OpenAIError`s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from redis.exceptions import RedisError

from gateway.backend import RedisBackend
from gateway.detokenizer import IncrementalDetokenizer
from gateway.errors import OpenAIError
from gateway.event_queues import RequestQueue
from gateway.stop_strings import StopStringMatcher
from gateway.tokenizer import PromptTokenizer
from proto.messages import Logprobs, NewRequest, TokenEvent
from proto.parallel import sequence_ids

logger = logging.getLogger(__name__)

# How long a choice may see only events past a gap (the tokens before it lost) before the
# request fails: the gateway sends such a request again within ~10 s (gateway/backend.py),
# and every event of the new copy, even one repeating tokens we have, restarts the clock.
GAP_GRACE_S = 15.0


@dataclass(frozen=True)
class TextOptions:
    """How a request's output ids become text (the gateway's part of the sampling params)."""

    stop: list[str] | None = None
    skip_special_tokens: bool = True
    include_stop_str: bool = False  # vLLM's include_stop_str_in_output


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

    def then(self, later: GenerationOutput) -> GenerationOutput:
        """This output and the one after it of the same choice, as one."""
        logprobs = None if self.logprobs is None and later.logprobs is None \
            else (self.logprobs or []) + (later.logprobs or [])
        offsets = None if self.text_offsets is None and later.text_offsets is None \
            else (self.text_offsets or []) + (later.text_offsets or [])
        return GenerationOutput(self.text + later.text, self.token_ids + later.token_ids, later.num_tokens,
                                later.finish_reason, logprobs=logprobs, text_offsets=offsets,
                                prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs)


class Generation:
    """One request's life in the gateway: one NewRequest, `request.n` choices.

    With n > 1 the scheduler forks the request into sequences `<id>/<i>` after computing
    its prompt once (proto/parallel.py); their events, and the parent's own (prompt
    logprobs, an error before the fork), arrive on one queue and are taken apart here by
    id. A stop string ends only its choice (an abort of that sequence's id); `close()`
    aborts the request's own id, which aborts whatever of it is still running."""

    def __init__(self, backend: RedisBackend, tokenizer: PromptTokenizer, request: NewRequest,
                 *, text: TextOptions, timeout_s: float):
        self.request = request
        self._backend = backend
        self._timeout_s = timeout_s
        self._submitted = False
        self._shard = 0  # the scheduler shard it went to (RedisBackend.shard_for)
        self._prompt_logprobs: dict[int, Logprobs] = {}  # shared: every choice has the same prompt
        ids = sequence_ids(request.request_id, request.n)
        self._choices = {rid: _Choice(i, rid, tokenizer, text, request, self._prompt_logprobs)
                         for i, rid in enumerate(ids)}
        self._event_ids = ids if request.n == 1 else [request.request_id, *ids]
        self._num_cached_tokens: int | None = None  # None until a first output token's event

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache (usage's cached tokens): 0 until the
        first output token's event says; the prompt counts once, whatever n."""
        return self._num_cached_tokens or 0

    @property
    def n(self) -> int:
        return self.request.n

    async def outputs(self) -> AsyncIterator[tuple[int, GenerationOutput]]:
        """(choice index, output) as events arrive, until every choice has finished."""
        # Submitted lazily, on first iteration: a stream the server never starts (client gone
        # before the first byte) then leaves nothing behind at the scheduler.
        queue = self._backend.open(self._event_ids)
        try:
            self._shard = await self._backend.shard_for(self.request)
            self._submitted = True  # before the XADD: if it is cancelled midway, close() aborts
            await self._backend.submit(self.request, self._shard)
        except (RedisError, OSError) as exc:
            raise OpenAIError(503, f"The request queue is unreachable: {exc}") from exc
        while any(not c.finished for c in self._choices.values()):
            # Every event already queued is taken at once, and a choice's outputs from them
            # go out as one: a client (or a gateway) that fell behind gets fewer, larger chunks.
            merged: dict[int, GenerationOutput] = {}
            failure = None
            for event in await self._next_events(queue):
                try:
                    output = await self._apply(event)
                except OpenAIError as exc:  # what came before it still goes out first
                    failure = exc
                    break
                if output is not None:
                    index = self._choices[event.request_id].index
                    merged[index] = merged[index].then(output) if index in merged else output
            for index, output in merged.items():
                yield index, output
            if failure is not None:
                raise failure

    async def _apply(self, event: TokenEvent) -> GenerationOutput | None:
        """One event into its choice's output (None: nothing new to show)."""
        for i, logprobs in enumerate(event.prompt_logprobs or ()):  # a recompute may resend
            self._prompt_logprobs.setdefault(event.prompt_index + i, logprobs)
        if self._num_cached_tokens is None and event.index == 0 and event.token_ids:
            # the first one that says (every choice's says the same); a copy of the request
            # sent again may hit more, but the count is the first scheduling's
            self._num_cached_tokens = event.num_cached_tokens
        choice = self._choices.get(event.request_id)
        if choice is None:  # the parent of n > 1: prompt logprobs, or an error before the fork
            if event.finish_reason is not None:
                for c in self._choices.values():
                    c.finished = True  # the scheduler has already dropped the request
                _raise_failure(event)
            return None
        if choice.finished:  # late events of a choice its stop string ended
            return None
        output = choice.apply(event)
        if choice.finished and event.finish_reason is None:
            # Its stop string, while the scheduler still runs it: free its blocks.
            await self._abort(choice.request_id)
        return output

    def close(self) -> None:
        """Release the event queue; abort at the scheduler whatever of the request still
        runs (client gone, timeout, an error, or the caller stopped iterating)."""
        aborted = self._backend.close(self._event_ids)  # a copy sent again is aborted there
        running = [c for c in self._choices.values() if not c.finished]
        if self._submitted and running and not aborted:
            for choice in running:
                choice.finished = True
            self._backend.abort_soon(self.request_id, self._shard)

    async def _next_events(self, queue: RequestQueue) -> list[TokenEvent]:
        """The next event and every one queued behind it, within the request timeout; while
        a choice waits for tokens lost in a gap, within what is left of its grace (then a
        503: they are not coming)."""
        gaps = [c.gap_since for c in self._choices.values() if c.gap_since is not None]
        left = GAP_GRACE_S - (time.monotonic() - min(gaps)) if gaps else None
        if left is not None and left <= 0:
            raise OpenAIError(503, f"Token events of this request were lost and did not come again "
                                   f"within {GAP_GRACE_S:g}s; the request was aborted, retry it.",
                              code="aborted")
        try:
            return await queue.take(self._timeout_s if left is None else min(left, self._timeout_s))
        except TimeoutError:
            if left is not None and left < self._timeout_s:
                return await self._next_events(queue)  # raises the 503 above
            raise OpenAIError(504, f"No tokens arrived for {self._timeout_s:g}s; the request was "
                                   "aborted.", code="timeout") from None

    async def _abort(self, request_id: str) -> None:
        try:
            await self._backend.abort(request_id, self._shard)
        except (RedisError, OSError):
            logger.warning("could not abort %s after its stop string", request_id, exc_info=True)


def _raise_failure(event: TokenEvent) -> None:
    """An "error" or "abort" event ends its sequence at the scheduler; the answer fails."""
    if event.finish_reason == "abort":  # with the reason when the gateway itself ended it
        raise OpenAIError(503, event.error or "The request was aborted by the server.", code="aborted")
    if event.finish_reason == "error" and event.rejected:
        raise OpenAIError(400, f"The request cannot be served: {event.error or 'rejected'}",
                          code="request_rejected")
    if event.finish_reason == "error":
        raise OpenAIError(500, f"The model failed on this request: {event.error or 'unknown error'}",
                          type="server_error", code="generation_error")


class _Choice:
    """One sequence's events -> text: deduplicated by index, detokenized, cut at stop strings."""

    def __init__(self, index: int, request_id: str, tokenizer: PromptTokenizer, text: TextOptions,
                 request: NewRequest, prompt_logprobs: dict[int, Logprobs]):
        self.index = index
        self.request_id = request_id
        self.finished = False  # the scheduler is done with it, or it is being aborted
        self._sampling = request.sampling
        self._detokenizer = IncrementalDetokenizer(tokenizer, text.skip_special_tokens)
        # Special tokens kept in the text (skip_special_tokens false): the one that stopped
        # the output (EOS, <|im_end|>) is still left out, unless include_stop_str_in_output,
        # as vLLM does.
        self._silent_stop_ids = frozenset() if text.skip_special_tokens or text.include_stop_str \
            else tokenizer.special_ids
        self._stop = StopStringMatcher(text.stop, text.include_stop_str)
        self._text_length = 0  # characters the detokenizer produced so far
        self._prompt_logprobs = prompt_logprobs
        self._sent_prompt_logprobs = False
        self.gap_since: float | None = None  # since when events past a gap arrive, none before it

    def apply(self, event: TokenEvent) -> GenerationOutput | None:
        if event.finish_reason in ("error", "abort"):
            self.finished = True  # the scheduler has already dropped it
            _raise_failure(event)
        if event.index > self._detokenizer.num_tokens:
            # The tokens before it were lost (a dropped subscription): the gateway sent the
            # request again, and the new copy sends them, in order, from the start. Until
            # its events come (any event at or before what we have), the gap's grace runs.
            if self.gap_since is None:
                self.gap_since = time.monotonic()
                logger.warning("request %s: tokens from %d on were lost; waiting for them again",
                               self.request_id, self._detokenizer.num_tokens)
            return None
        self.gap_since = None
        pieces: list[str] = []
        taken: list[int] = []
        offsets: list[int] = []
        new_ids, new_logprobs = self._new_tokens(event)
        for i, token_id in enumerate(new_ids):
            taken.append(token_id)
            offsets.append(self._text_length)
            if event.finish_reason == "stop" and i == len(new_ids) - 1 and token_id in self._silent_stop_ids:
                self._detokenizer.count_silently(token_id)
                continue
            piece = self._detokenizer.step(token_id)
            self._text_length += len(piece)
            check = self._stop.feed(piece, check=self._stops_active())
            pieces.append(check.text)
            if check.stopped:
                self.finished = True
                return self._output(pieces, taken, "stop", new_logprobs, offsets)
        if event.finish_reason is None:
            return self._output(pieces, taken, None, new_logprobs, offsets) if taken else None
        # The scheduler finished it ("stop": EOS / stop token, "length": max_tokens).
        self.finished = True
        check = self._stop.feed(self._detokenizer.flush(), check=self._stops_active())
        pieces.append(check.text)
        pieces.append(self._stop.flush())
        return self._output(pieces, taken, "stop" if check.stopped else event.finish_reason,
                            new_logprobs, offsets)

    def _output(self, pieces: list[str], token_ids: list[int], finish_reason: str | None,
                logprobs: list[Logprobs] | None, offsets: list[int]) -> GenerationOutput:
        prompt_logprobs = None
        if self._sampling.prompt_logprobs is not None and not self._sent_prompt_logprobs:
            prompt_logprobs, self._sent_prompt_logprobs = self._prompt_logprobs, True
        if logprobs is not None:
            logprobs = logprobs[:len(token_ids)]  # a stop string may end the output early
        return GenerationOutput("".join(pieces), token_ids, self._detokenizer.num_tokens, finish_reason,
                                logprobs=logprobs, text_offsets=offsets, prompt_logprobs=prompt_logprobs)

    def _new_tokens(self, event: TokenEvent) -> tuple[list[int], list[Logprobs] | None]:
        """The event's tokens we do not have yet, and their logprobs. Events of one sequence
        arrive in order, but after a re-route the new worker may resend positions we have."""
        skip = self._detokenizer.num_tokens - event.index  # >= 0: `apply` drops gaps
        wanted = self._sampling.logprobs is not None
        logprobs = list(event.logprobs or [])[skip:] if wanted else None
        return event.token_ids[skip:], logprobs

    def _stops_active(self) -> bool:
        # Like vLLM: stop strings count only once more than min_tokens tokens exist.
        return self._detokenizer.num_tokens > self._sampling.min_tokens
