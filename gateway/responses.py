"""The two response shapes, behind one interface so streaming and collecting code is shared.

Streams follow OpenAI: chat sends a first chunk with `delta.role`, then content deltas, then a
chunk with an empty delta and the finish_reason; completions send text chunks, then one with
the finish_reason. With `stream_options.include_usage` every chunk carries `"usage": null`
and one more chunk with empty `choices` and the usage goes last.

With `return_token_ids` (vLLM's extension) choices also carry `token_ids` (in a stream: the
chunk's new ids) and the prompt's ids come once: on the completion choice, or at the top of a
chat response (in a stream: in the first chunk).
"""

from __future__ import annotations

from typing import Protocol

from pydantic import BaseModel

from gateway.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                              ChatCompletionResponse, CompletionChoice, CompletionChunk,
                              CompletionResponse, Delta, Usage, now)


class ResponseFormat(Protocol):
    return_token_ids: bool

    def first_chunk(self) -> BaseModel | None: ...

    def chunk(self, text: str, finish_reason: str | None, token_ids: list[int]) -> BaseModel: ...

    def usage_chunk(self, usage: Usage) -> BaseModel: ...

    def response(self, text: str, finish_reason: str | None, usage: Usage,
                 token_ids: list[int]) -> BaseModel: ...


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)


class _Format:
    def __init__(self, request_id: str, model: str, prompt_token_ids: list[int], return_token_ids: bool):
        self.request_id, self.model, self.created = request_id, model, now()
        self.return_token_ids = return_token_ids
        self._prompt_ids = prompt_token_ids if return_token_ids else None  # sent once

    def _ids(self, token_ids: list[int]) -> list[int] | None:
        return list(token_ids) if self.return_token_ids else None

    def _take_prompt_ids(self) -> list[int] | None:
        ids, self._prompt_ids = self._prompt_ids, None
        return ids


class CompletionFormat(_Format):
    def first_chunk(self) -> None:
        return None

    def chunk(self, text: str, finish_reason: str | None, token_ids: list[int]) -> CompletionChunk:
        choice = CompletionChoice(text=text, finish_reason=finish_reason, token_ids=self._ids(token_ids),
                                  prompt_token_ids=self._take_prompt_ids())
        return CompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=[choice])

    def usage_chunk(self, usage: Usage) -> CompletionChunk:
        return CompletionChunk(id=self.request_id, created=self.created, model=self.model,
                               choices=[], usage=usage)

    def response(self, text: str, finish_reason: str | None, usage: Usage,
                 token_ids: list[int]) -> CompletionResponse:
        choice = CompletionChoice(text=text, finish_reason=finish_reason, token_ids=self._ids(token_ids),
                                  prompt_token_ids=self._take_prompt_ids())
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                  choices=[choice], usage=usage)


class ChatFormat(_Format):
    def first_chunk(self) -> ChatCompletionChunk:
        chunk = self.chunk("", None, [])
        chunk.choices[0].delta = Delta(role="assistant", content="")
        chunk.prompt_token_ids = self._take_prompt_ids()
        return chunk

    def chunk(self, text: str, finish_reason: str | None, token_ids: list[int]) -> ChatCompletionChunk:
        choice = ChatChunkChoice(delta=Delta(content=text) if text else Delta(),
                                 finish_reason=finish_reason, token_ids=self._ids(token_ids))
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model,
                                   choices=[choice])

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model,
                                   choices=[], usage=usage)

    def response(self, text: str, finish_reason: str | None, usage: Usage,
                 token_ids: list[int]) -> ChatCompletionResponse:
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=finish_reason,
                            token_ids=self._ids(token_ids))
        return ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                      choices=[choice], usage=usage, prompt_token_ids=self._take_prompt_ids())
