"""The output of /v1/completions and /v1/chat/completions: a Generation's outputs made into
their `text_completion` / `chat.completion` bodies and stream chunks (gateway/completion_models.py),
the two formats behind one interface (`OutputFormat`) so that streaming and collecting code
is shared (gateway/serving.py). The Responses API answers in its own shapes
(gateway/responses_api/output.py).

Streams follow OpenAI: chat sends a first chunk per choice with `delta.role`, then content
deltas, then a chunk with an empty delta and the finish_reason; completions send text
chunks, then one with the finish_reason. With `stream_options.include_usage` every chunk
carries `"usage": null` and one more chunk with empty `choices` and the usage goes last.
With n > 1 the choices' chunks interleave, each naming its `index`.

Logprobs ride on the chunk (or choice) of the tokens they belong to. Completions with
`echo` prepend the prompt to the first chunk of each choice (and, with logprobs, the
prompt's logprobs: null for its first token, which nothing predicts).

With `return_token_ids` (vLLM's extension) choices also carry `token_ids` (in a stream: the
chunk's new ids) and the prompt's ids come once: on each completion choice's first chunk,
or at the top of a chat response (in a stream: in the first chunk).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from pydantic import BaseModel

from gateway.completion_models import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                       ChatCompletionResponse, ChatLogprobs, ChatTokenLogprob,
                                       CompletionChoice, CompletionChunk, CompletionLogprobs,
                                       CompletionResponse, Delta, FunctionCall, FunctionCallDelta,
                                       PromptTokensDetails, ToolCall, ToolCallDelta, TopLogprob, Usage, now)
from gateway.generation import GenerationOutput
from gateway.token_text import TokenTexts
from gateway.tool_parsers.calls import ToolParser
from gateway.tool_parsers.stream import ToolCallStream, extract_tool_calls
from proto.messages import Logprobs

MIN_LOGPROB = -9999.0  # what OpenAI reports for impossible tokens (JSON has no -Infinity)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    """`cached_tokens`: of the prompt tokens, those served from the prefix cache."""
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


def _clamp(logprob: float) -> float:
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB  # also maps NaN to the floor


@dataclass
class ChoiceResult:
    """One choice of a non-streamed response: its outputs put together."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] | None = None
    text_offsets: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: dict[int, Logprobs] | None = None

    def add(self, output: GenerationOutput) -> None:
        self.text += output.text
        self.token_ids += output.token_ids
        self.text_offsets += output.text_offsets or []
        if output.logprobs is not None:
            self.logprobs = (self.logprobs or []) + output.logprobs
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        self.finish_reason = output.finish_reason or self.finish_reason

    def as_output(self) -> GenerationOutput:
        return GenerationOutput(self.text, self.token_ids, len(self.token_ids), self.finish_reason,
                                logprobs=self.logprobs, text_offsets=self.text_offsets,
                                prompt_logprobs=self.prompt_logprobs)


class OutputFormat(Protocol):
    return_token_ids: bool

    def first_chunks(self, n: int) -> list[BaseModel]: ...

    def worth_a_chunk(self, output: GenerationOutput, first: bool) -> bool: ...

    def chunk(self, index: int, output: GenerationOutput, first: bool) -> BaseModel | None: ...

    def text_only(self, first: bool) -> bool: ...

    def text_chunk(self, index: int, text: str) -> BaseModel: ...

    def finish_chunk(self, index: int, finish_reason: str) -> BaseModel: ...

    def usage_chunk(self, usage: Usage) -> BaseModel: ...

    def response(self, choices: list[ChoiceResult], usage: Usage) -> BaseModel: ...


class _Format:
    def __init__(self, request_id: str, model: str, prompt_token_ids: list[int], return_token_ids: bool,
                 token_texts: TokenTexts, num_logprobs: int | None):
        self.request_id, self.model, self.created = request_id, model, now()
        self.return_token_ids = return_token_ids
        self.prompt_ids = prompt_token_ids
        self.texts = token_texts
        self.num_logprobs = num_logprobs  # None: no logprobs asked for

    def _ids(self, token_ids: list[int]) -> list[int] | None:
        return list(token_ids) if self.return_token_ids else None

    def worth_a_chunk(self, output: GenerationOutput, first: bool) -> bool:
        """Whether a stream sends `output` as a chunk: text, or ids / logprobs the client
        asked for (text may lag behind ids mid-character or before a stop string)."""
        asked_ids = self.return_token_ids or self.num_logprobs is not None
        return bool(output.text or (asked_ids and output.token_ids))

    def text_only(self, first: bool) -> bool:
        """Whether a chunk of a choice's text carries nothing else (no logprobs, ids, tool
        calls or echo): then `text_chunk` is its whole shape (gateway/sse_chunks.py)."""
        return self.num_logprobs is None and not self.return_token_ids


@dataclass(frozen=True)
class Echo:
    """The prompt as echoed by /v1/completions."""

    text: str
    token_offsets: list[int]  # where each prompt token's text starts in `text`


@dataclass(frozen=True)
class CompletionPrompt:
    """One prompt of a /v1/completions request: its ids, and its echo when asked for."""

    token_ids: list[int]
    echo: Echo | None = None


class CompletionFormat(_Format):
    """Choices prompt-major: choice i belongs to prompt i // n."""

    def __init__(self, request_id: str, model: str, prompts: list[CompletionPrompt], n: int,
                 return_token_ids: bool, token_texts: TokenTexts, num_logprobs: int | None):
        super().__init__(request_id, model, prompts[0].token_ids, return_token_ids, token_texts, num_logprobs)
        self.prompts = prompts
        self.n = n

    def first_chunks(self, n: int) -> list[BaseModel]:
        return []

    def worth_a_chunk(self, output: GenerationOutput, first: bool) -> bool:
        return (first and self.prompts[0].echo is not None) or super().worth_a_chunk(output, first)

    def chunk(self, index: int, output: GenerationOutput, first: bool) -> CompletionChunk:
        return CompletionChunk(id=self.request_id, created=self.created, model=self.model,
                               choices=[self._choice(index, output, first, None)])

    def text_only(self, first: bool) -> bool:
        return super().text_only(first) and not (first and self.prompts[0].echo is not None)

    def text_chunk(self, index: int, text: str) -> CompletionChunk:
        return CompletionChunk(id=self.request_id, created=self.created, model=self.model,
                               choices=[CompletionChoice(index=index, text=text)])

    def finish_chunk(self, index: int, finish_reason: str) -> CompletionChunk:
        choice = CompletionChoice(index=index, text="", finish_reason=finish_reason,
                                  token_ids=self._ids([]))
        return CompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=[choice])

    def usage_chunk(self, usage: Usage) -> CompletionChunk:
        return CompletionChunk(id=self.request_id, created=self.created, model=self.model,
                               choices=[], usage=usage)

    def response(self, choices: list[ChoiceResult], usage: Usage) -> CompletionResponse:
        return CompletionResponse(
            id=self.request_id, created=self.created, model=self.model, usage=usage,
            choices=[self._choice(i, c.as_output(), True, c.finish_reason) for i, c in enumerate(choices)])

    def _choice(self, index: int, output: GenerationOutput, first: bool,
                finish_reason: str | None) -> CompletionChoice:
        """A choice carrying `output`; the first one of an index also carries the echo."""
        prompt = self.prompts[index // self.n]
        echo = prompt.echo if first else None
        text = (echo.text if echo else "") + output.text
        logprobs = None
        if self.num_logprobs is not None:
            logprobs = CompletionLogprobs()
            if echo is not None:
                self._add_prompt_logprobs(logprobs, prompt, echo, output.prompt_logprobs or {})
            shift = len(prompt.echo.text) if prompt.echo else 0
            for token_id, lp, offset in zip(output.token_ids, output.logprobs or [], output.text_offsets or []):
                self._add_token(logprobs, token_id, lp, offset + shift)
        return CompletionChoice(
            index=index, text=text, logprobs=logprobs, finish_reason=finish_reason,
            token_ids=self._ids(output.token_ids),
            prompt_token_ids=list(prompt.token_ids) if self.return_token_ids and first else None)

    def _add_prompt_logprobs(self, logprobs: CompletionLogprobs, prompt: CompletionPrompt, echo: Echo,
                             prompt_logprobs: dict[int, Logprobs]) -> None:
        for position, (token_id, offset) in enumerate(zip(prompt.token_ids, echo.token_offsets)):
            lp = prompt_logprobs.get(position)
            if lp is None:  # position 0: nothing predicts the first token
                logprobs.tokens.append(self.texts.text(token_id))
                logprobs.token_logprobs.append(None)
                logprobs.top_logprobs.append(None)
                logprobs.text_offset.append(offset)
            else:
                self._add_token(logprobs, token_id, lp, offset)

    def _add_token(self, logprobs: CompletionLogprobs, token_id: int, lp: Logprobs, offset: int) -> None:
        logprobs.tokens.append(self.texts.text(token_id))
        logprobs.token_logprobs.append(_clamp(lp.logprob))
        # OpenAI: "the API will always return the logprob of the sampled token, so there
        # may be up to logprobs+1 elements".
        top = {self.texts.text(i): _clamp(v) for i, v in zip(lp.top_ids, lp.top_logprobs)}
        top.setdefault(self.texts.text(token_id), _clamp(lp.logprob))
        logprobs.top_logprobs.append(top)
        logprobs.text_offset.append(offset)


class ChatFormat(_Format):
    """With a tool parser, each choice's text goes through it: calls come out as
    `tool_calls` (deltas in a stream) and finish_reason "tool_calls" ("stop" for a named
    tool_choice, as OpenAI); the rest is content."""

    def __init__(self, *args, tool_parser: ToolParser | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.tool_parser = tool_parser
        self._tool_streams: dict[int, ToolCallStream] = {}

    def first_chunks(self, n: int) -> list[BaseModel]:
        chunks = []
        for index in range(n):
            choice = ChatChunkChoice(index=index, delta=Delta(role="assistant", content=""),
                                     token_ids=self._ids([]))
            chunks.append(ChatCompletionChunk(
                id=self.request_id, created=self.created, model=self.model, choices=[choice],
                prompt_token_ids=list(self.prompt_ids) if self.return_token_ids and index == 0 else None))
        return chunks

    def chunk(self, index: int, output: GenerationOutput, first: bool) -> ChatCompletionChunk | None:
        delta = Delta(content=output.text) if output.text else Delta()
        if self.tool_parser is not None:
            delta = self._tool_delta(self._tool_streams.setdefault(index, ToolCallStream(self.tool_parser)),
                                     output.text, final=False)
            if delta == Delta() and not (self.return_token_ids or self.num_logprobs is not None):
                return None  # text held back (maybe a call starting): nothing to send yet
        choice = ChatChunkChoice(index=index, delta=delta, logprobs=self._logprobs(output),
                                 token_ids=self._ids(output.token_ids))
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model,
                                   choices=[choice])

    def text_only(self, first: bool) -> bool:
        return super().text_only(first) and self.tool_parser is None

    def text_chunk(self, index: int, text: str) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model,
                                   choices=[ChatChunkChoice(index=index, delta=Delta(content=text))])

    def finish_chunk(self, index: int, finish_reason: str) -> ChatCompletionChunk:
        delta = Delta()
        stream = self._tool_streams.get(index)
        if stream is not None:
            delta = self._tool_delta(stream, "", final=True)
            if stream.called and finish_reason == "stop":
                finish_reason = self.tool_parser.finish_reason
        choice = ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason,
                                 token_ids=self._ids([]))
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model,
                                   choices=[choice])

    @staticmethod
    def _tool_delta(stream: ToolCallStream, text: str, final: bool) -> Delta:
        content, calls = stream.finish() if final else stream.feed(text)
        tool_calls = [ToolCallDelta(index=c.index, id=c.id, type="function" if c.id else None,
                                    function=FunctionCallDelta(name=c.name, arguments=c.arguments))
                      for c in calls]
        return Delta(content=content or None, tool_calls=tool_calls or None)

    def _message(self, choice: ChoiceResult) -> tuple[AssistantMessage, str | None]:
        if self.tool_parser is None:
            return AssistantMessage(content=choice.text), choice.finish_reason
        content, calls = extract_tool_calls(self.tool_parser, choice.text)
        if not calls:
            return AssistantMessage(content=choice.text), choice.finish_reason
        message = AssistantMessage(content=content, tool_calls=[
            ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls])
        return message, self.tool_parser.finish_reason if choice.finish_reason == "stop" else choice.finish_reason

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model,
                                   choices=[], usage=usage)

    def response(self, choices: list[ChoiceResult], usage: Usage) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=self.request_id, created=self.created, model=self.model, usage=usage,
            prompt_token_ids=list(self.prompt_ids) if self.return_token_ids else None,
            choices=[ChatChoice(index=i, message=message, logprobs=self._logprobs(c.as_output()),
                                finish_reason=finish_reason, token_ids=self._ids(c.token_ids))
                     for i, c in enumerate(choices) for message, finish_reason in [self._message(c)]])

    def _logprobs(self, output: GenerationOutput) -> ChatLogprobs | None:
        if self.num_logprobs is None:
            return None
        content = []
        for token_id, lp in zip(output.token_ids, output.logprobs or []):
            top = [TopLogprob(token=self.texts.text(i), logprob=_clamp(v), bytes=list(self.texts.bytes(i)))
                   for i, v in zip(lp.top_ids, lp.top_logprobs)]
            content.append(ChatTokenLogprob(token=self.texts.text(token_id), logprob=_clamp(lp.logprob),
                                            bytes=list(self.texts.bytes(token_id)), top_logprobs=top))
        return ChatLogprobs(content=content)
