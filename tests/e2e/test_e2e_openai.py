"""The OpenAI API through the real stack, with the official `openai` client as the caller:
sampling parameters, logprobs and echo, n, usage and finish reasons, chat roles and template
switches, and structured output. Streamed and non-streamed answers are compared wherever both
exist. API keys and every error the issue lists: test_e2e_openai_errors.py."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import jsonschema
import openai
import pydantic
import pytest
from transformers import AutoTokenizer

from tests.support.e2e_openai_helpers import stack  # noqa: F401  (the fixture)
from tests.support.stack_helpers import ids_of

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def complete(client, stack, **kwargs):
    return client.completions.create(model=stack.served_model_name, **{"prompt": PROMPT, **kwargs})


def stream_complete(client, stack, **kwargs):
    return list(client.completions.create(model=stack.served_model_name, stream=True,
                                          **{"prompt": PROMPT, **kwargs}))


# ---- 1. sampling ----------------------------------------------------------------------------

def test_temperature_zero_is_greedy(client, stack):
    greedy = complete(client, stack, max_tokens=16, temperature=0, extra_body={"return_token_ids": True})
    top_k_one = complete(client, stack, max_tokens=16, temperature=1.5, seed=3,
                         extra_body={"top_k": 1, "return_token_ids": True})
    min_p_one = complete(client, stack, max_tokens=16, temperature=1.0,
                         extra_body={"min_p": 1.0, "return_token_ids": True})
    assert ids_of(greedy.choices[0]) == ids_of(top_k_one.choices[0]) == ids_of(min_p_one.choices[0])


def test_seeded_sampling_is_reproducible_across_batch_compositions(stack):
    mine = dict(prompt="Once upon a time", max_tokens=24, temperature=1.0, top_p=0.95, seed=1234,
                presence_penalty=0.3, frequency_penalty=0.2,
                extra_body={"return_token_ids": True, "ignore_eos": True, "repetition_penalty": 1.1})

    async def one(client, **kwargs):
        response = await client.completions.create(model=stack.served_model_name, **kwargs)
        return ids_of(response.choices[0])

    async def crowd(size):
        # closed inside this event loop: a client left to the garbage collector closes its
        # connections in whatever loop runs next (another test's)
        async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0,
                                      timeout=120) as client:
            others = [one(client, prompt=f"Neighbour {i} says", max_tokens=8 + 3 * i, temperature=0.9,
                          seed=(i if i % 2 else None), extra_body={"return_token_ids": True, "min_p": 0.05})
                      for i in range(size)]
            mid = len(others) // 2
            results = await asyncio.gather(*others[:mid], one(client, **mine), *others[mid:])
        return results[mid]

    alone = asyncio.run(crowd(0))
    assert asyncio.run(crowd(5)) == alone
    assert asyncio.run(crowd(9)) == alone
    mine["seed"] = 99
    assert asyncio.run(crowd(0)) != alone  # the seed matters


def test_logit_bias_forces_and_bans_tokens(client, stack, tokenizer):
    forced = tokenizer.encode(" fox", add_special_tokens=False)[0]
    response = complete(client, stack, max_tokens=6, temperature=0.8, logit_bias={str(forced): 100},
                        extra_body={"return_token_ids": True})
    assert ids_of(response.choices[0]) == [forced] * 6
    greedy = ids_of(complete(client, stack, max_tokens=1, temperature=0,
                             extra_body={"return_token_ids": True}).choices[0])
    banned = complete(client, stack, max_tokens=1, temperature=0, logit_bias={str(greedy[0]): -100},
                      extra_body={"return_token_ids": True})
    assert ids_of(banned.choices[0]) != greedy


def test_penalties_reduce_repetition(client, stack):
    def repeats(**kwargs):
        response = complete(client, stack, prompt="a a a a a a a a", max_tokens=40, temperature=0,
                            extra_body={"return_token_ids": True, "ignore_eos": True, **kwargs.pop("extra", {})},
                            **kwargs)
        ids = ids_of(response.choices[0])
        return max(Counter(ids).values()), ids

    plain_max, plain = repeats()
    assert plain_max >= 4, "the tiny model should repeat itself under greedy decoding"
    for kwargs in (dict(frequency_penalty=2.0), dict(presence_penalty=2.0),
                   dict(extra={"repetition_penalty": 2.0})):
        most, ids = repeats(**kwargs)
        assert ids != plain and most < plain_max, kwargs


def test_stop_token_ids_min_tokens_ignore_eos_and_max_tokens(client, stack):
    base = ids_of(complete(client, stack, max_tokens=12, temperature=0,
                           extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0])
    stop_id = base[4]
    first = base.index(stop_id)
    cut = complete(client, stack, max_tokens=12, temperature=0,
                   extra_body={"return_token_ids": True, "ignore_eos": True, "stop_token_ids": [stop_id]})
    assert ids_of(cut.choices[0]) == base[:first + 1]
    assert cut.choices[0].finish_reason == "stop"
    # min_tokens bans the stop id until that many tokens exist
    late = complete(client, stack, max_tokens=12, temperature=0,
                    extra_body={"return_token_ids": True, "ignore_eos": True, "stop_token_ids": [stop_id],
                                "min_tokens": first + 2})
    late_ids = ids_of(late.choices[0])
    assert stop_id not in late_ids[:first + 2] and len(late_ids) >= first + 2
    capped = complete(client, stack, max_tokens=7, temperature=0, extra_body={"ignore_eos": True})
    assert capped.usage.completion_tokens == 7 and capped.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model=stack.served_model_name, max_completion_tokens=5,
                                          messages=[{"role": "user", "content": "hi"}], temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 5 and chat.choices[0].finish_reason == "length"


def test_stop_strings_string_or_list(client, stack):
    text = complete(client, stack, max_tokens=30, temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    assert len(text) > 8
    for stop in (text[4:7], [text[4:7], "zzzz-never"]):
        cut = complete(client, stack, max_tokens=30, temperature=0, stop=stop, extra_body={"ignore_eos": True})
        assert cut.choices[0].text == text[:text.index(text[4:7])]
        assert cut.choices[0].finish_reason == "stop"
        streamed = stream_complete(client, stack, max_tokens=30, temperature=0, stop=stop,
                                   extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.choices[0].text


# ---- 2. logprobs and echo ---------------------------------------------------------------------

def test_completion_logprobs_streamed_equals_non_streamed(client, stack, tokenizer):
    kwargs = dict(max_tokens=12, temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    full = complete(client, stack, **kwargs).choices[0]
    lp = full.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 12
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    special = set(tokenizer.all_special_tokens)
    for token, offset in zip(lp.tokens, lp.text_offset):
        if token.startswith("bytes:") or token in special:
            break  # from here on, offsets of pieces of characters are approximate
        assert full.text[offset:offset + len(token)] == token
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 3 <= len(top) <= 4
        assert top[token] == pytest.approx(max(top.values()))  # greedy picks the most likely
    chunks = [c for c in stream_complete(client, stack, **kwargs) if c.choices]
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == lp.tokens
    streamed = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-4)  # separate runs: float noise


def test_logprobs_do_not_depend_on_sampling_settings(client, stack):
    """Raw model logprobs: temperature, penalties and bias change what is drawn, not the
    reported distribution of the token that was drawn."""
    greedy = complete(client, stack, max_tokens=1, temperature=0, logprobs=2).choices[0].logprobs
    biased = complete(client, stack, max_tokens=1, temperature=0.3, logprobs=2,
                      logit_bias={"7": 100}).choices[0].logprobs
    assert biased.tokens != greedy.tokens
    assert len(greedy.top_logprobs[0]) == 2  # the top 2; the greedy token is one of them
    for token, logprob in greedy.top_logprobs[0].items():
        assert biased.top_logprobs[0][token] == pytest.approx(logprob, abs=1e-4)
    assert biased.top_logprobs[0][biased.tokens[0]] == pytest.approx(biased.token_logprobs[0])


def test_echo_with_and_without_logprobs(client, stack, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT)
    plain = complete(client, stack, max_tokens=5, temperature=0)
    echoed = complete(client, stack, max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    assert echoed.usage == plain.usage
    scored = complete(client, stack, max_tokens=3, temperature=0, echo=True, logprobs=1).choices[0]
    lp = scored.logprobs
    assert len(lp.tokens) == len(prompt_ids) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert lp.text_offset[len(prompt_ids)] == len(PROMPT)
    streamed = [c for c in stream_complete(client, stack, max_tokens=3, temperature=0, echo=True, logprobs=1)
                if c.choices]
    assert "".join(c.choices[0].text for c in streamed) == scored.text
    streamed_lps = [x for c in streamed if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed_lps[0] is None
    assert streamed_lps[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)
    tokens = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


def test_echo_of_long_prompt_survives_chunked_prefill(client, stack, tokenizer):
    prompt = " ".join(f"word{i}" for i in range(60))  # well over the 64-token step budget
    scored = complete(client, stack, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=0)
    lp = scored.choices[0].logprobs
    assert len(lp.tokens) == len(tokenizer.encode(prompt)) + 1
    assert lp.token_logprobs[0] is None and None not in lp.token_logprobs[1:]


def test_chat_logprobs_with_bytes(client, stack):
    kwargs = dict(model=stack.served_model_name, temperature=0, max_tokens=10, logprobs=True, top_logprobs=2,
                  messages=[{"role": "user", "content": "Say something"}], extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs).choices[0]
    content = full.logprobs.content
    assert len(content) == 10
    assert b"".join(bytes(c.bytes) for c in content).decode("utf-8", "replace").startswith(full.message.content)
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)
    no_top = client.chat.completions.create(**{**kwargs, "top_logprobs": None}).choices[0]
    assert all(e.top_logprobs == [] for e in no_top.logprobs.content)
    without = client.chat.completions.create(**{**kwargs, "logprobs": None, "top_logprobs": None})
    assert without.choices[0].logprobs is None


# ---- 3. n ------------------------------------------------------------------------------------

def test_n_choices_streamed_interleaved_with_indices(client, stack):
    kwargs = dict(max_tokens=10, temperature=1.0, seed=7, n=3, extra_body={"ignore_eos": True})
    full = complete(client, stack, **kwargs)
    assert [c.index for c in full.choices] == [0, 1, 2]
    assert len({c.text for c in full.choices}) > 1  # distinct derived seeds
    assert full.usage.completion_tokens == 30
    assert all(c.finish_reason == "length" for c in full.choices)
    chunks = stream_complete(client, stack, stream_options={"include_usage": True}, **kwargs)
    texts = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
             for i in range(3)}
    assert texts == {c.index: c.text for c in full.choices}
    finishes = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(c.index for c in finishes) == [0, 1, 2]
    assert chunks[-1].usage.completion_tokens == 30 and chunks[-1].choices == []
    # choice 0 of n is the request with its own seed
    one = complete(client, stack, **{**kwargs, "n": 1})
    assert one.choices[0].text == full.choices[0].text


def test_n_chat(client, stack):
    kwargs = dict(model=stack.served_model_name, temperature=0, max_tokens=6, n=2,
                  messages=[{"role": "user", "content": "hi"}])
    full = client.chat.completions.create(**kwargs)
    assert [c.index for c in full.choices] == [0, 1]
    assert full.choices[0].message.content == full.choices[1].message.content  # greedy: equal
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]
    for i in (0, 1):
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        assert text == full.choices[i].message.content


# ---- 4. usage and finish reasons ------------------------------------------------------------

def test_usage_everywhere(client, stack, tokenizer):
    response = complete(client, stack, max_tokens=4, temperature=0)
    assert response.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    chunks = stream_complete(client, stack, max_tokens=4, temperature=0)
    assert all(c.usage is None for c in chunks)
    chunks = stream_complete(client, stack, max_tokens=4, temperature=0, stream_options={"include_usage": True})
    assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].usage == response.usage


def test_finish_reason_stop_on_eos(client, stack, tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    response = complete(client, stack, max_tokens=20, temperature=0, logit_bias={str(eos): 100})
    assert response.choices[0].finish_reason == "stop" and response.usage.completion_tokens == 1
    assert response.choices[0].text == ""


# ---- 5. chat --------------------------------------------------------------------------------

def test_chat_roles_parts_and_template_switches(client, stack, tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": [{"type": "text", "text": "Really"}, {"type": "text", "text": "brief."}]},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "4"},
        {"role": "assistant", "content": "It is 4."},
        {"role": "user", "content": "Thanks"},
    ]
    kwargs = dict(model=stack.served_model_name, messages=messages, max_tokens=4, temperature=0)
    with_prompt = client.chat.completions.create(**kwargs)
    expected = tokenizer.apply_chat_template(
        [{"role": "system" if m["role"] == "developer" else m["role"],
          "content": "Really\nbrief." if m["role"] == "developer" else (m["content"] or "")} for m in messages],
        add_generation_prompt=True, tokenize=False)
    assert with_prompt.usage.prompt_tokens == len(tokenizer.encode(expected, add_special_tokens=False))
    without = client.chat.completions.create(extra_body={"add_generation_prompt": False,
                                                         "chat_template_kwargs": {"anything": 1}}, **kwargs)
    assert without.usage.prompt_tokens < with_prompt.usage.prompt_tokens
    continued = client.chat.completions.create(
        model=stack.served_model_name, max_tokens=3, temperature=0,
        messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello the"}],
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert continued.choices[0].finish_reason in ("stop", "length")


# ---- 6. structured output ---------------------------------------------------------------------

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    "member": {"type": "boolean"}},
    "required": ["name", "age", "pets", "member"], "additionalProperties": False}


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=150)
    member: bool


def test_structured_output_batched_with_unconstrained_requests(stack, tokenizer):
    # A random model rarely picks a token with a quote: nudge strings to close (json_object
    # leaves keys and strings unbounded).
    closers = {str(t): 4 for t in range(len(tokenizer)) if set(tokenizer.decode([t])) & set('"}')}
    messages = [{"role": "user", "content": "Describe a person as JSON."}]

    async def main():
        async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0,
                                      timeout=120) as client:
            def chat(**kwargs):
                return client.chat.completions.create(model=stack.served_model_name, messages=messages, **kwargs)
            plain = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})
            alone = await chat(**plain)
            schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
            together = await asyncio.gather(
                *(chat(response_format=schema, temperature=1.0, seed=i, max_tokens=300) for i in range(4)),
                *(chat(response_format={"type": "json_object"}, temperature=1.0, seed=i, max_tokens=200,
                       logit_bias=closers) for i in range(3)),
                chat(**plain), chat(**plain))
            streamed = [c async for c in await chat(response_format=schema, temperature=1.0, seed=2,
                                                    max_tokens=300, stream=True)]
            return alone, together, streamed

    alone, together, streamed = asyncio.run(main())
    constrained, objects, plain = together[:4], together[4:7], together[7:]
    for response in constrained:
        choice = response.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    finished = [r.choices[0].message.content for r in objects if r.choices[0].finish_reason == "stop"]
    assert finished and all(isinstance(json.loads(text), dict) for text in finished)
    assert all(r.choices[0].message.content == alone.choices[0].message.content for r in plain)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) \
        == constrained[2].choices[0].message.content


def test_structured_output_through_the_sdk_parse_helper(client, stack):
    """The SDK turns a pydantic model into a strict json_schema and parses the answer."""
    completion = client.chat.completions.parse(
        model=stack.served_model_name, messages=[{"role": "user", "content": "A person, please."}],
        response_format=Person, temperature=0.7, seed=5, max_tokens=200)
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 150
