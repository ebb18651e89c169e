"""Reading JSON that may still be arriving: where a (partial) object's top-level values lie,
and where a (partial) array's elements start. Stdlib only, no decoding: the tool parsers
stream argument text exactly as the model wrote it, so they need positions, not values.

`scan_object(text, i)` with text[i] == "{": each top-level key → (start, end) of its value's
text (`end` None while the value is still open), and the index just past the closing "}"
(None while the object is open). `scan_array(text, i)` with text[i] == "[": the start of each
element and the index past the closing "]" (None while open).
"""

from __future__ import annotations

from dataclasses import dataclass, field

_WS = " \t\r\n"


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def value_end(text: str, i: int) -> int | None:
    """Index just past the JSON value starting at text[i] (None while it is incomplete).
    A bare number or literal ends at the first delimiter, so at the end of `text` it counts
    as incomplete."""
    if i >= len(text):
        return None
    first = text[i]
    if first == '"':
        j = i + 1
        while j < len(text):
            if text[j] == "\\":
                j += 2
                continue
            if text[j] == '"':
                return j + 1
            j += 1
        return None
    if first in "{[":
        depth, j, in_string = 0, i, False
        while j < len(text):
            c = text[j]
            if in_string:
                if c == "\\":
                    j += 1
                elif c == '"':
                    in_string = False
            elif c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in ",}] \t\r\n":
        j += 1
    return j if j < len(text) else None


@dataclass
class ScannedObject:
    values: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    end: int | None = None  # past the closing brace


def scan_object(text: str, i: int) -> ScannedObject:
    out = ScannedObject()
    i = _skip_ws(text, i + 1)  # past "{"
    while i < len(text):
        if text[i] == "}":
            out.end = i + 1
            return out
        if text[i] == ",":
            i = _skip_ws(text, i + 1)
            continue
        if text[i] != '"':
            return out  # not JSON: stop here
        key_end = value_end(text, i)
        if key_end is None:
            return out
        key = text[i + 1:key_end - 1]
        i = _skip_ws(text, key_end)
        if i >= len(text) or text[i] != ":":
            return out
        start = _skip_ws(text, i + 1)
        if start >= len(text):
            return out
        end = value_end(text, start)
        out.values[key] = (start, end)
        if end is None:
            return out
        i = _skip_ws(text, end)
    return out


def scan_array(text: str, i: int) -> tuple[list[int], int | None]:
    starts: list[int] = []
    i = _skip_ws(text, i + 1)  # past "["
    while i < len(text):
        if text[i] == "]":
            return starts, i + 1
        if text[i] == ",":
            i = _skip_ws(text, i + 1)
            continue
        starts.append(i)
        end = value_end(text, i)
        if end is None:
            return starts, None
        i = _skip_ws(text, end)
    return starts, None
