"""Tool-call parsers on the exact text each model family writes: whole answers (content,
calls, ill-formed calls left as content) and the same text streamed in many small pieces,
whose deltas must add up to the same calls (OpenAI's shape: index, id and name once,
arguments in pieces)."""

from __future__ import annotations

import json

import pytest

from gateway.tool_parsers import TOOL_PARSERS, tool_parser
from gateway.tool_parsers.forced import NamedCallParser, RequiredCallsParser
from gateway.tool_parsers.stream import ToolCallStream, extract_tool_calls

WEATHER = {"city": "Paris", "unit": "celsius", "note": "a \"quoted\" {brace} [x]"}
TIME = {"tz": "Europe/Paris"}

HERMES = ("Let me check.\n<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": WEATHER})
          + "\n</tool_call>\n<tool_call>\n" + json.dumps({"name": "get_time", "arguments": TIME}) + "\n</tool_call>")
LLAMA3 = (json.dumps({"name": "get_weather", "parameters": WEATHER}) + "; "
          + json.dumps({"name": "get_time", "parameters": TIME}))
MISTRAL_V3 = "[TOOL_CALLS][" + json.dumps({"name": "get_weather", "arguments": WEATHER}) + ", " \
             + json.dumps({"name": "get_time", "arguments": TIME}) + "]"
MISTRAL_V11 = "[TOOL_CALLS]get_weather[ARGS]" + json.dumps(WEATHER) + "[TOOL_CALLS]get_time[ARGS]" + json.dumps(TIME)

FORMATS = [
    ("hermes", HERMES, "Let me check.\n"),
    ("llama3_json", LLAMA3, None),
    ("llama3_json", "<|python_tag|>" + LLAMA3, None),
    ("mistral", MISTRAL_V3, None),
    ("mistral", "Sure. " + MISTRAL_V11, "Sure. "),
]


def reassemble(stream: ToolCallStream, pieces: list[str]) -> tuple[str, dict[int, dict]]:
    content, calls = "", {}
    for piece in [*pieces, None]:
        text, deltas = stream.feed(piece) if piece is not None else stream.finish()
        content += text
        for delta in deltas:
            if delta.index not in calls:
                assert delta.id and delta.id.startswith("call_") and delta.name, delta  # first delta
                assert delta.index == len(calls)  # in order
                calls[delta.index] = {"id": delta.id, "name": delta.name, "arguments": ""}
            else:
                assert delta.id is None and delta.name is None, delta  # id and name once
            calls[delta.index]["arguments"] += delta.arguments
    return content, calls


@pytest.mark.parametrize("name,text,content", FORMATS)
def test_whole_answer(name, text, content):
    got_content, calls = extract_tool_calls(tool_parser(name), text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", WEATHER), ("get_time", TIME)]
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("name,text,content", FORMATS)
def test_streamed_in_pieces(name, text, content, size):
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    got_content, calls = reassemble(ToolCallStream(tool_parser(name)), pieces)
    assert got_content == (content or "")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", WEATHER), ("get_time", TIME)]


def test_arguments_arrive_in_pieces():
    stream = ToolCallStream(tool_parser("hermes"))
    text = '<tool_call>\n{"name": "f", "arguments": {"a": "long value here"}}\n</tool_call>'
    pieces = [text[i:i + 4] for i in range(0, len(text), 4)]
    argument_deltas = [d for p in pieces for d in stream.feed(p)[1] if d.arguments]
    assert len(argument_deltas) > 3


@pytest.mark.parametrize("name", list(TOOL_PARSERS))
def test_plain_text_is_content(name):
    text = "The weather is fine, no call needed. <tool"
    assert extract_tool_calls(tool_parser(name), text) == (text, [])
    content, calls = reassemble(ToolCallStream(tool_parser(name)), list(text))
    assert (content, calls) == (text, {})


@pytest.mark.parametrize("name,text", [
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}'),  # cut off
    ("hermes", '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>'),  # no name
    ("llama3_json", '{"name": "f", "parameters": [1, 2]}'),  # arguments not an object
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": tru'),
])
def test_ill_formed_calls_stay_content(name, text):
    assert extract_tool_calls(tool_parser(name), text) == (text, [])


def test_hermes_holds_back_a_partial_marker():
    stream = ToolCallStream(tool_parser("hermes"))
    assert stream.feed("Hi <tool_")[0] == "Hi "
    assert stream.feed("call>\n{")[0] == ""
    assert stream.finish()[0] == ""


def test_forced_named_and_required():
    content, calls = extract_tool_calls(NamedCallParser("get_weather"), json.dumps(WEATHER))
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", WEATHER)]
    text = json.dumps([{"name": "get_weather", "parameters": WEATHER}, {"name": "get_time", "parameters": TIME}])
    _, streamed = reassemble(ToolCallStream(RequiredCallsParser()), [text[i:i + 5] for i in range(0, len(text), 5)])
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == [
        ("get_weather", WEATHER), ("get_time", TIME)]


def test_unknown_parser_name():
    with pytest.raises(ValueError, match="hermes"):
        tool_parser("nope")
