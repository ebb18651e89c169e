"""A step finished (ModelRunner.finish, step 5 of worker_svc/model_runner.py): the sampled
ids, on the host now, appended to their requests under the finish rule (worker_svc/stop.py,
and the request's grammar), and what the step tells: a SampledToken per sampled token in
the StepResult, and a TokenEvent per request grouped by its reply channel (the event of a
request's first output token also carries num_cached_tokens). Also a request failed in
its step, uncomputed: its error event and a SampledToken without a token.

Functions of their arguments: the requests' states are the only thing they change.
"""

import logging
import time
from dataclasses import dataclass

from proto import worker_pb2
from proto.messages import NO_TOKEN_ID, TokenEvent
from worker_svc.launched_step import LaunchedStep, Produced
from worker_svc.request_state import RequestState
from worker_svc.vision_step import VisionStepStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepOutput:
    result: worker_pb2.StepResult
    events: dict[str, list[TokenEvent]]  # reply channel → that channel's events this step
    vision: VisionStepStats | None = None  # what the step's images cost; None: no image in the step


def finish_step(launched: LaunchedStep, max_model_len: int) -> StepOutput:
    """Step 5: the sampled ids on the host, appended, and the step's result and events.
    A request that the step before finished while this one was launched ahead of it
    was computed for nothing: it gets nothing here."""
    start = time.perf_counter()
    extras, result, events = launched.produced, launched.result, launched.events
    add = result.sampled.add
    for state, token_id in zip(launched.sampled, launched.ids.tolist() if launched.ids is not None else ()):
        out = extras.pop(id(state), None) if extras else None
        if state.finish_reason is not None:
            continue
        reason = append_token(state, token_id, max_model_len)
        if reason:
            add(request_id=state.request_id, token_id=token_id, finish_reason=reason)
        else:
            add(request_id=state.request_id, token_id=token_id)
        token_event(events, state, [token_id], reason, out)
    for out in extras.values():  # prompt logprobs of a chunk that samples nothing
        if out.state.finish_reason is None:
            token_event(events, out.state, [], None, out)
    # the step's own time: its launch and its finish, not what ran between them
    result.execute_seconds = launched.launch_seconds + time.perf_counter() - start
    return StepOutput(result=result, events=events, vision=launched.vision)


def token_event(events: dict[str, list[TokenEvent]], state: RequestState, sampled: list[int],
                reason: str | None, out: Produced | None) -> None:
    """`state`'s TokenEvent of this step: its token (if it sampled one), its finish and
    what else it got (`out`: logprobs, prompt logprobs)."""
    index = len(state.token_ids) - state.num_prompt_tokens - len(sampled)
    channel = events.get(state.reply_channel)
    if channel is None:
        channel = events[state.reply_channel] = []
    if out is None and index and reason is None:  # the common case: a token, no more
        channel.append(TokenEvent(state.request_id, index, sampled))
        return
    channel.append(TokenEvent(
        request_id=state.request_id, index=index,
        token_ids=sampled, finish_reason=reason,
        error=(state.grammar.error or None) if reason == "error" else None,
        logprobs=[out.logprobs] if out is not None and out.logprobs is not None else None,
        prompt_logprobs=(out.prompt_logprobs or None) if out is not None else None,
        prompt_index=out.prompt_index if out is not None else 0,
        num_cached_tokens=state.num_cached_tokens if sampled and index == 0 else 0))


def fail_request(state: RequestState, message: str, result: worker_pb2.StepResult,
                 events: dict[str, list[TokenEvent]]) -> None:
    """Finish `state` with "error" in this step, uncomputed: its error event and a
    SampledToken without a token, so the scheduler finishes it too."""
    log.warning("request %s failed: %s", state.request_id, message)
    state.finish_reason = "error"
    result.sampled.add(request_id=state.request_id, token_id=NO_TOKEN_ID, finish_reason="error")
    events.setdefault(state.reply_channel, []).append(TokenEvent(
        request_id=state.request_id, index=state.num_output_tokens, finish_reason="error",
        error=message))


def append_token(state: RequestState, token_id: int, max_model_len: int) -> str | None:
    """`token_id` appended to `state`'s tokens; returns (and sets) its finish reason, or None."""
    state.token_ids.append(token_id)
    num_tokens = len(state.token_ids)
    state.finish_reason = state.stop.reason(num_tokens - state.num_prompt_tokens, token_id, num_tokens,
                                            max_model_len)
    grammar = state.grammar
    if grammar is not None:
        if grammar.error or not grammar.advance(token_id):
            # The mask allows only what the grammar accepts, so this is a grammar the
            # worker could not compile (the gateway checks them first) or a library bug.
            log.error("request %s: grammar failed: %s", state.request_id, grammar.error)
            state.finish_reason = "error"
        elif state.finish_reason is None and grammar.done:
            state.finish_reason = "stop"  # the output is complete: only EOS could follow
    return state.finish_reason
