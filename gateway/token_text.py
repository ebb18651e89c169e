"""What one token is, as text and as bytes, for logprobs.

A byte-level BPE token is a run of bytes that need not be valid UTF-8 on its own ("日" may be
split over two tokens). OpenAI reports each token's exact `bytes` and, as `token`, its text
when the bytes decode, else `bytes:\\xe6\\x97` (the escaped bytes). We do the same:
- byte-level vocabularies (GPT-2 style, the `make-model` tokenizer, Llama 3, Qwen): the
  token's characters map back to bytes through GPT-2's bytes_to_unicode table;
- SentencePiece style: `<0xAB>` byte-fallback tokens are that byte, `▁` is a space;
- added / special tokens (`<|im_end|>`): their content in UTF-8.
"""

from __future__ import annotations

import re
from functools import lru_cache

from gateway.tokenizer import PromptTokenizer

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode: printable stand-ins back to bytes."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes)}


class TokenTexts:
    """Token id → (text, bytes), cached per id (a vocabulary is finite)."""

    def __init__(self, tokenizer: PromptTokenizer):
        self._hf = tokenizer.hf
        self._added = {i: t.content for i, t in self._hf.added_tokens_decoder.items()}
        decoder = tokenizer.backend.decoder
        self._byte_level = decoder is not None and "ByteLevel" in type(decoder).__name__ + repr(decoder)
        self._cache: dict[int, tuple[str, bytes]] = {}

    def text(self, token_id: int) -> str:
        return self._lookup(token_id)[0]

    def bytes(self, token_id: int) -> bytes:
        return self._lookup(token_id)[1]

    def _lookup(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            raw = self._bytes(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            hit = self._cache[token_id] = (text, raw)
        return hit

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self._hf.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if self._byte_level:
            table = _unicode_to_byte()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
            return piece.encode()
        match = _BYTE_FALLBACK.match(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        return piece.replace("▁", " ").encode()
