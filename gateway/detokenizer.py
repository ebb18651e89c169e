"""Incremental detokenization of one request's output tokens.

`tokenizers.decoders.DecodeStream` does the real work: it keeps a small window of recent ids
and returns only text that is final, holding back ids that end inside a multi-byte UTF-8
character (a byte-level BPE often splits "日" or "🙂" across tokens). Special tokens (EOS,
<|im_end|>) are skipped, as `tokenizer.decode(ids, skip_special_tokens=True)` would, unless
the request says `skip_special_tokens: false`.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from gateway.tokenizer import PromptTokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PromptTokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._emitted: list[str] = []
        self._silent = 0  # tokens counted but never turned into text

    @property
    def num_tokens(self) -> int:
        return len(self._ids) + self._silent

    def count_silently(self, token_id: int) -> None:
        """The output's last token, counted but left out of the text (the special token that
        stopped it, when special tokens are kept)."""
        self._silent += 1

    def step(self, token_id: int) -> str:
        """Text that `token_id` completes ("" while a character is still incomplete)."""
        self._ids.append(token_id)
        piece = self._stream.step(self._tokenizer.backend, token_id)
        if piece:
            self._emitted.append(piece)
        return piece or ""

    def flush(self) -> str:
        """At the end of the output: text DecodeStream still holds (ids that never completed a
        character decode to U+FFFD in a full decode). Makes the pieces join to exactly
        `tokenizer.decode(ids)`; costs one full decode per request."""
        full = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip_special)
        emitted = "".join(self._emitted)
        if len(full) > len(emitted) and full.startswith(emitted):
            rest = full[len(emitted):]
            self._emitted = [full]
            return rest
        return ""
