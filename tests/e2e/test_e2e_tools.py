"""Agents' requests through the real stack with the official `openai` client: tool calls
forced by tool_choice "required" or a named function (streamed and not; arguments validate
against the tool's schema whatever the random weights), the SDK's own helpers
(`pydantic_function_tool` with `chat.completions.parse`, `chat.completions.stream`), vLLM's
extension fields and unknown fields, structured output and prompt batches on
/v1/completions. One stack, on the tiny Qwen2 checkpoint (its template lists tools), with
`--tool-call-parser hermes --enable-auto-tool-choice`; "auto" is covered by the parser
tests (tests/unit/gateway/test_tool_parsers.py), since a random model calls nothing on its own."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.support.stack_helpers import running_stack

FORECAST = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Oslo", "Lima"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "forecast", "parameters": FORECAST}},
         {"type": "function", "function": {"name": "clock", "parameters": CLOCK}}]
SCHEMAS = {"forecast": FORECAST, "clock": CLOCK}
USER = [{"role": "user", "content": "What will the weather be?"}]


@pytest.fixture(scope="module")
def stack(family_model_dir, redis_url, tmp_path_factory):
    with running_stack(family_model_dir("qwen2"), redis_url, tmp_path_factory.mktemp("tools-run"),
                       gateway_args=("--tool-call-parser", "hermes", "--enable-auto-tool-choice")) as s:
        yield s


def check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed_calls(stream) -> tuple[list[dict], str | None]:
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                if delta.id is not None:
                    calls[delta.index] = {"name": delta.function.name, "arguments": ""}
                calls[delta.index]["arguments"] += delta.function.arguments or ""
    return list(calls.values()), finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "clock"}}])
def test_forced_tool_calls(client, stack, tool_choice):
    # One call at most: a random model would go on adding calls to the array until max_tokens.
    kwargs = dict(model=stack.served_model_name, messages=USER, tools=TOOLS, tool_choice=tool_choice,
                  max_tokens=60, temperature=1.0, seed=1, parallel_tool_calls=False)
    response = client.chat.completions.create(**kwargs)
    [choice] = response.choices
    expected_finish = "stop" if isinstance(tool_choice, dict) else "tool_calls"  # OpenAI's
    assert choice.finish_reason == expected_finish, choice
    check_calls(choice.message.tool_calls)
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in choice.message.tool_calls] == ["clock"]
    calls, finish = streamed_calls(client.chat.completions.create(stream=True, **kwargs))
    assert finish == expected_finish and calls
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


class Forecast(BaseModel):
    city: Literal["Paris", "Oslo", "Lima"]
    days: int = Field(ge=1, le=7)


def test_sdk_parse_with_pydantic_function_tool(client, stack):
    completion = client.chat.completions.parse(
        model=stack.served_model_name, messages=USER, tools=[openai.pydantic_function_tool(Forecast)],
        tool_choice={"type": "function", "function": {"name": "Forecast"}}, max_tokens=40)
    [call] = completion.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Forecast)


def test_sdk_stream_helper(client, stack):
    with client.chat.completions.stream(
            model=stack.served_model_name, messages=USER, tools=[openai.pydantic_function_tool(Forecast)],
            tool_choice="required", parallel_tool_calls=False, max_tokens=60) as stream:
        kinds = {event.type for event in stream}
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in kinds
    [call] = final.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Forecast)


def test_unknown_and_vllm_fields_are_accepted(client, stack):
    response = client.chat.completions.create(
        model=stack.served_model_name, messages=USER, max_tokens=4,
        extra_body={"some_framework_field": {"x": 1}, "skip_special_tokens": True, "priority": 1,
                    "include_stop_str_in_output": False})
    assert response.choices[0].finish_reason in ("stop", "length")


def test_structured_output_and_batches_on_completions(client, stack):
    model = stack.served_model_name
    regex = client.completions.create(model=model, prompt="Code:", max_tokens=12,
                                      extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{2}"}})
    assert re.fullmatch("[A-Z]{2}-[0-9]{2}", regex.choices[0].text)
    batch = client.completions.create(model=model, prompt=["Pick:", "Choose:"], n=2, max_tokens=5,
                                      extra_body={"guided_choice": ["left", "right"]})
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert all(c.text in ("left", "right") for c in batch.choices)


# ---- the Responses API ------------------------------------------------------------------------

def test_responses_create(client, stack):
    model = stack.served_model_name
    response = client.responses.create(model=model, input="Say something.", instructions="Be brief.",
                                       max_output_tokens=6, temperature=0)
    assert response.object == "response" and response.status in ("completed", "incomplete")
    assert response.output[0].type == "message" and response.output_text == response.output[0].content[0].text
    assert response.usage.output_tokens >= 1 and response.instructions == "Be brief."
    events = list(client.responses.create(model=model, input=[{"role": "user", "content": "Say something."}],
                                          instructions="Be brief.",
                                          max_output_tokens=6, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text == response.output_text  # greedy: the same text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_function_tools(client, stack):
    tools = [{"type": "function", "name": "clock", "parameters": CLOCK, "strict": True}]
    kwargs = dict(model=stack.served_model_name, input="What time is it?", tools=tools,
                  tool_choice={"type": "function", "name": "clock"}, max_output_tokens=30)
    response = client.responses.create(**kwargs)
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "clock" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), CLOCK)
    # the call and its output sent back as input items reach the template
    followup = client.responses.create(model=stack.served_model_name, max_output_tokens=3, tools=tools, input=[
        {"role": "user", "content": "What time is it?"},
        {"type": "function_call", "call_id": call.call_id, "name": "clock", "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}])
    assert followup.status in ("completed", "incomplete")
    events = list(client.responses.create(stream=True, **kwargs))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].name == "clock"
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert pieces == done[0].arguments and json.loads(pieces)["tz"] in ("UTC", "CET")


def test_responses_refuses_state(client, stack):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=stack.served_model_name, input="hi", previous_response_id="resp_1")
    assert err.value.body["param"] == "previous_response_id" and "state" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=stack.served_model_name, input="hi", tools=[{"type": "web_search"}])
    assert err.value.body["param"] == "tools[0].type"
