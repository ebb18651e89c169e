"""gateway/sse_chunks.py: a text-only chunk from its template is byte for byte the chunk
pydantic dumps, for chat and completions, every choice index, with and without usage."""

from __future__ import annotations

import pytest

from gateway.completion_output import ChatFormat, CompletionFormat, CompletionPrompt
from gateway.generation import GenerationOutput
from gateway.sse_chunks import TextChunks

TEXTS = [chr(c) for c in range(128)] + [
    "Hello", ' "quoted" ', "back\\slash", "</script>", "日本語", "🙂 and 🤖", "\u2028\u2029",
    "\x7f\x80\x9f\xa0", "é" * 50, "\ufeff", "tab\tnew\nline\r", "\x00<pagedserve>\x00"]


def _formats():
    chat = ChatFormat("chatcmpl-1", "my/model \"x\"", [1, 2, 3], False, None, None)
    completion = CompletionFormat("cmpl-1", "m", [CompletionPrompt([1, 2]), CompletionPrompt([3])],
                                  2, False, None, None)
    return {"chat": chat, "completion": completion}


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_text_chunks_match_pydantic(kind, include_usage):
    fmt = _formats()[kind]
    chunks = TextChunks(fmt.text_chunk, include_usage)
    exclude = None if include_usage else {"usage"}
    for index in (0, 1, 3):
        for text in TEXTS:  # (an empty text never takes this path: stream_sse)
            output = GenerationOutput(text, [7], 1, None)
            want = f"data: {fmt.chunk(index, output, False).model_dump_json(exclude=exclude)}\n\n"
            assert chunks.event(index, text) == want, (index, text)


def test_text_only_leaves_out_chunks_that_carry_more():
    chat, completion = _formats().values()
    assert chat.text_only(False) and chat.text_only(True) and completion.text_only(True)
    assert not ChatFormat("c", "m", [1], True, None, None).text_only(False)  # token ids
    assert not ChatFormat("c", "m", [1], False, None, 2).text_only(False)  # logprobs
    echoed = CompletionFormat("c", "m", [CompletionPrompt([1], echo=object())], 1, False, None, None)
    assert not echoed.text_only(True) and echoed.text_only(False)  # the echo rides on the first


def test_a_chunk_whose_fields_hold_the_marker_is_refused():
    fmt = ChatFormat("chatcmpl-1", "\x00<pagedserve-text>\x00", [1], False, None, None)
    with pytest.raises(ValueError, match="exactly once"):
        TextChunks(fmt.text_chunk, False).event(0, "x")
