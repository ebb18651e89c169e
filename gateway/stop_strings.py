"""Cutting streamed text at the first stop string.

The stop string itself is not part of the output (OpenAI's behaviour), unless the request
asks for it (vLLM's `include_stop_str_in_output`). When stop strings
overlap, the one that is complete first wins ("DaD" with stops "a" and "DaD" gives "D"). While streaming, the
longest tail of the text that could still grow into a stop string is held back: once text is
sent it cannot be taken back, so "…END" must not go out as "…EN" before the "D" arrives.

Invariant: the held tail is the longest suffix of (held + new text) that is a proper prefix
of some stop string. So any stop string that is going to appear starts inside the held tail or
inside later text, and searching `held + new` finds every match.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StopCheck:
    text: str  # safe to send now
    stopped: bool  # a stop string matched; `text` ends right before it


class StopStringMatcher:
    def __init__(self, stops: list[str] | None, include_stop: bool = False):
        self._stops = [s for s in (stops or []) if s]
        self._include_stop = include_stop
        self._held = ""
        self.stopped = False

    def feed(self, text: str, *, check: bool = True) -> StopCheck:
        """Add decoded text; return what may be sent. With check=False (stop strings not active
        yet, e.g. before min_tokens) everything is sent, held text included."""
        if self.stopped:
            return StopCheck("", True)
        buffer = self._held + text
        if not self._stops or not check:
            self._held = ""
            return StopCheck(buffer, False)
        # The stop string that is complete first wins (then the longer one): what a token-by-
        # token check sees, however the text is chunked.
        hits = [(i + len(s), i) for s, i in ((s, buffer.find(s)) for s in self._stops) if i >= 0]
        if hits:
            end, start = min(hits)
            self._held = ""
            self.stopped = True
            return StopCheck(buffer[:end if self._include_stop else start], True)
        keep = self._partial_match_length(buffer)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return StopCheck(buffer[: len(buffer) - keep], False)

    def flush(self) -> str:
        """At the end of the output: the held tail never became a stop string; send it."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_match_length(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:n]):
                    longest = n
                    break
        return longest
