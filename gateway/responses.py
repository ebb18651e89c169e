"""The two response shapes, behind one interface so streaming and collecting code is shared.

Streams follow OpenAI: chat sends a first chunk with `delta.role`, then content deltas, then a
chunk with an empty delta and the finish_reason; completions send text chunks, then one with
the finish_reason. With `stream_options.include_usage` every chunk carries `"usage": null`
and one more chunk with empty `choices` and the usage goes last.
"""

from __future__ import annotations

from typing import Protocol

from pydantic import BaseModel

from gateway.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                              ChatCompletionResponse, CompletionChoice, CompletionChunk,
                              CompletionResponse, Delta, Usage, now)


class ResponseFormat(Protocol):
    def first_chunk(self) -> BaseModel | None: ...

    def chunk(self, text: str, finish_reason: str | None) -> BaseModel: ...

    def usage_chunk(self, usage: Usage) -> BaseModel: ...

    def response(self, text: str, finish_reason: str | None, usage: Usage) -> BaseModel: ...


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)


class CompletionFormat:
    def __init__(self, request_id: str, model: str):
        self.request_id, self.model, self.created = request_id, model, now()

    def first_chunk(self) -> None:
        return None

    def chunk(self, text: str, finish_reason: str | None) -> CompletionChunk:
        return CompletionChunk(id=self.request_id, created=self.created, model=self.model,
                               choices=[CompletionChoice(text=text, finish_reason=finish_reason)])

    def usage_chunk(self, usage: Usage) -> CompletionChunk:
        return CompletionChunk(id=self.request_id, created=self.created, model=self.model,
                               choices=[], usage=usage)

    def response(self, text: str, finish_reason: str | None, usage: Usage) -> CompletionResponse:
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                  choices=[CompletionChoice(text=text, finish_reason=finish_reason)],
                                  usage=usage)


class ChatFormat:
    def __init__(self, request_id: str, model: str):
        self.request_id, self.model, self.created = request_id, model, now()

    def first_chunk(self) -> ChatCompletionChunk:
        return self._chunk(Delta(role="assistant", content=""), None)

    def chunk(self, text: str, finish_reason: str | None) -> ChatCompletionChunk:
        return self._chunk(Delta(content=text) if text else Delta(), finish_reason)

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model,
                                   choices=[], usage=usage)

    def response(self, text: str, finish_reason: str | None, usage: Usage) -> ChatCompletionResponse:
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=finish_reason)
        return ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                      choices=[choice], usage=usage)

    def _chunk(self, delta: Delta, finish_reason: str | None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model,
                                   choices=[ChatChunkChoice(delta=delta, finish_reason=finish_reason)])
