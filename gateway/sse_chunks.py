"""The stream's common chunk, text only, as JSON without a pydantic model per token.

Most chunks of a stream carry nothing but new text: no logprobs, token ids, tool calls or
usage so far. Building and dumping a pydantic chunk for each cost the gateway about a fifth
of its CPU per streamed token (bench/stack/token_path.py). Here the chunk is dumped once per
choice index by pydantic itself, with a marker string in place of the text, and split
around it; each token's chunk is then the two halves around the text encoded by msgspec.
The JSON is byte for byte what pydantic writes for the same chunk (tests/unit/gateway/test_sse_chunks.py
compares them over every ASCII character and a range of others).

    chunks = TextChunks(lambda index, text: fmt.text_chunk(index, text), include_usage=False)
    chunks.event(0, "Hello")   # 'data: {"id":...,"choices":[{"index":0,"delta":{"content":"Hello"},...}\n\n'
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
from pydantic import BaseModel

# Stands for the text in the dumped prototype; only the chunk's other fields (the request
# id, the served model name) could hold it, and `_template` refuses a chunk where they do.
_MARKER = "\x00<pagedserve-text>\x00"


class TextChunks:
    """SSE events of text-only chunks; `prototype(index, text)` builds the pydantic chunk
    of choice `index` carrying `text` (the format's own model, so the shape is the format's)."""

    def __init__(self, prototype: Callable[[int, str], BaseModel], include_usage: bool):
        self._prototype = prototype
        self._exclude = None if include_usage else {"usage"}
        self._templates: dict[int, tuple[str, str]] = {}
        self._encode = msgspec.json.Encoder().encode

    def event(self, index: int, text: str) -> str:
        """`data: <chunk JSON>` and the blank line ending the event."""
        template = self._templates.get(index)
        if template is None:
            template = self._templates[index] = self._template(index)
        return template[0] + self._encode(text).decode() + template[1]

    def _template(self, index: int) -> tuple[str, str]:
        dumped = self._prototype(index, _MARKER).model_dump_json(exclude=self._exclude)
        marker = self._encode(_MARKER).decode()
        before, found, after = dumped.partition(marker)
        if not found or marker in after:
            raise ValueError(f"the chunk of choice {index} does not carry its text exactly once")
        return f"data: {before}", f"{after}\n\n"
