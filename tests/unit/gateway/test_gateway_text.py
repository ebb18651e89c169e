"""Text handling without Redis: incremental detokenization and stop-string cutting."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.detokenizer import IncrementalDetokenizer
from gateway.stop_strings import StopStringMatcher
from gateway.tokenizer import PromptTokenizer

TEXTS = [
    "Hello, world! def main():\n    return 42",
    "日本語のテキスト — naïve café, façade; Ελληνικά, русский",
    "emoji 🙂👍🏽 and flags 🇫🇷 split across byte tokens",
    "  leading spaces\ttabs\n\nand newlines  ",
]


def stream(tokenizer: PromptTokenizer, ids: list[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer)
    return [detokenizer.step(t) for t in ids] + [detokenizer.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_join_to_full_decode(tokenizer, text):
    ids = tokenizer.encode_text(text)
    pieces = stream(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert any(p == "" for p in pieces[:-1]) or text.isascii()  # multi-byte chars span tokens


def test_special_tokens_are_skipped(tokenizer):
    ids = tokenizer.encode_text("hi there") + tokenizer.hf.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert "".join(stream(tokenizer, ids)) == "hi there"


def test_incomplete_character_at_the_end_is_flushed(tokenizer):
    ids = tokenizer.encode_text("ok 🙂")
    for cut in range(1, len(ids)):
        assert "".join(stream(tokenizer, ids[:cut])) == tokenizer.decode(ids[:cut])


@settings(max_examples=50, deadline=None)
@given(raw_ids=st.lists(st.integers(min_value=0, max_value=2**20), max_size=40))
def test_any_ids_join_to_full_decode(tokenizer, raw_ids):
    """Random ids: broken UTF-8, special tokens, ids that end mid-character."""
    ids = [t % tokenizer.vocab_size for t in raw_ids]
    assert "".join(stream(tokenizer, ids)) == tokenizer.decode(ids)


def feed_all(stops: list[str], chunks: list[str], check_from: int = 0) -> tuple[list[str], bool]:
    matcher = StopStringMatcher(stops)
    out = []
    for i, chunk in enumerate(chunks):
        result = matcher.feed(chunk, check=i >= check_from)
        out.append(result.text)
        if result.stopped:
            return out, True
    out.append(matcher.flush())
    return out, False


def test_stop_string_cut_and_excluded():
    out, stopped = feed_all(["END"], ["hello ", "world END and more"])
    assert stopped and "".join(out) == "hello world "


def test_hold_back_across_chunk_boundaries():
    out, stopped = feed_all(["END"], ["abc E", "N", "D tail"])
    assert stopped
    assert out == ["abc ", "", ""]  # "E" and "EN" were held, never sent


def test_held_text_released_when_it_does_not_match():
    out, stopped = feed_all(["END"], ["abc E", "N", "X"])
    assert not stopped
    assert out == ["abc ", "", "ENX", ""]


def test_held_text_released_at_the_end():
    out, stopped = feed_all(["</s>"], ["answer </"])
    assert not stopped and out == ["answer ", "</"]


def test_earliest_of_several_stops_wins():
    out, stopped = feed_all(["world", "lo w"], ["hel", "lo world"])
    assert stopped and "".join(out) == "hel"


def test_overlapping_prefix_hold_back():
    # "aab" must be found although "aa" alone looked like a failed start of "ab".
    out, stopped = feed_all(["ab"], ["xa", "a", "b"])
    assert stopped and "".join(out) == "xa"


def test_stops_inactive_before_min_tokens():
    out, stopped = feed_all(["STOP"], ["STOP early ", "then STOP"], check_from=1)
    assert stopped and "".join(out) == "STOP early then "


def test_overlapping_stops_first_complete_wins():
    for chunks in (["DaD"], ["Da", "D"], ["D", "a", "D"]):
        out, stopped = feed_all(["a", "DaD"], chunks)
        assert stopped and "".join(out) == "D"


def test_no_stops_passes_everything():
    out, stopped = feed_all([], ["a", "b"])
    assert not stopped and out == ["a", "b", ""]


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abE ND", max_size=30), stops=st.lists(st.text(alphabet="abEND", min_size=1,
       max_size=4), min_size=1, max_size=3), cuts=st.lists(st.integers(0, 30), max_size=8))
def test_streamed_equals_one_shot(text, stops, cuts):
    """However the text is chunked, the output is the text before the stop string that is
    complete first."""
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    out, stopped = feed_all(stops, chunks)
    hits = [(i + len(s), i) for s, i in ((s, text.find(s)) for s in stops) if i >= 0]
    expected = text[:min(hits)[1]] if hits else text
    assert "".join(out) == expected and stopped == bool(hits)
