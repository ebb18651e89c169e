"""Structured output on the worker: grammar masks batched with unconstrained rows, outputs
that parse and validate, completion ends the request, a resumed request replays its outputs."""

import functools
import json

import jsonschema
import torch
from transformers import AutoTokenizer

from proto import worker_pb2
from worker_svc.config import RunnerConfig
from proto.grammars import grammar_error
from worker_svc.grammar import GrammarCompiler
from worker_svc.model_runner import ModelRunner

Params = worker_pb2.SamplingParams

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "ok": {"type": "boolean"}},
    "required": ["name", "age", "tags", "ok"], "additionalProperties": False}


def grammar(schema) -> worker_pb2.Grammar:
    return worker_pb2.Grammar(kind="json_schema", spec=json.dumps(schema))


def run(runner, requests: dict[str, tuple[list[int], Params]], max_steps=400) -> dict[str, tuple[list[int], str]]:
    """Every request to its end, all in one batch each step; (outputs, finish reason)."""
    new, block = [], 1
    for request_id, (prompt, sampling) in requests.items():
        blocks = -(-(len(prompt) + sampling.max_tokens) // runner.config.block_size)
        new.append(worker_pb2.NewRequestData(request_id=request_id, token_ids=prompt, num_prompt_tokens=len(prompt),
                                             block_ids=list(range(block, block + blocks)), sampling=sampling))
        block += blocks
    scheduled = {r.request_id: len(r.token_ids) for r in new}
    out = {r: ([], "") for r in requests}
    for step in range(max_steps):
        result = runner.step(worker_pb2.StepRequest(step_id=step, new_requests=new,
                                                    num_scheduled_tokens=scheduled)).result
        new = []
        for s in result.sampled:
            out[s.request_id] = (out[s.request_id][0] + [s.token_id], s.finish_reason)
        scheduled = {s.request_id: 1 for s in result.sampled if not s.finish_reason}
        if not scheduled:
            return out
    raise AssertionError("did not finish")


@functools.lru_cache(maxsize=4)
def tokenizer_of(model_dir: str):
    return AutoTokenizer.from_pretrained(model_dir)


def text_of(runner, ids):
    return tokenizer_of(runner.config.model).decode(ids, skip_special_tokens=True)


def test_schema_outputs_validate_next_to_unconstrained_rows(tiny_model_dir):
    runner = ModelRunner(RunnerConfig(model=str(tiny_model_dir), block_size=16, num_blocks=256))
    plain = Params(max_tokens=12, temperature=0, ignore_eos=True)
    alone = run(runner, {"plain": ([5, 6, 7, 8], plain)})["plain"]
    requests = {"plain": ([5, 6, 7, 8], plain)}
    for i in range(6):
        requests[f"json{i}"] = ([11 + i, 40, 41], Params(max_tokens=300, temperature=1.0, seed=i,
                                                          grammar=grammar(SCHEMA)))
    # Any object: keys and strings are unbounded, and a random model rarely picks a token
    # with a quote; a logit_bias toward the tokens holding `"` or `}` lets most finish.
    closers = {t: 4.0 for t in range(1536) if set(text_of(runner, [t])) & set('"}')}
    for i in range(4):
        requests[f"object{i}"] = ([3, 4], Params(max_tokens=200, temperature=1.0, seed=i, logit_bias=closers,
                                                  grammar=grammar({"type": "object"})))
    out = run(runner, requests)
    assert out["plain"] == alone  # the masks touch only their own rows
    for request_id in requests:
        ids, reason = out[request_id]
        if request_id.startswith("json"):
            assert reason == "stop", (request_id, text_of(runner, ids))
            jsonschema.validate(json.loads(text_of(runner, ids)), SCHEMA)
        elif request_id.startswith("object") and reason == "stop":
            assert isinstance(json.loads(text_of(runner, ids)), dict)
    assert any(out[f"object{i}"][1] == "stop" for i in range(4))


def test_resumed_request_replays_its_outputs(tiny_model_dir):
    compiler = GrammarCompiler(str(tiny_model_dir), 1536, [0, 2])
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prefix = tok.encode('{"name":"x', add_special_tokens=False)  # compact separators
    fresh = compiler.matcher("json_schema", json.dumps(SCHEMA))
    resumed = compiler.matcher("json_schema", json.dumps(SCHEMA), prefix)
    assert not resumed.error and not resumed.done
    masks = compiler.allowed([fresh, None, resumed], 1536, torch.device("cpu"))
    assert masks[1].all()  # no grammar: everything allowed
    assert not masks[0][tok.encode('"', add_special_tokens=False)[0]]  # must open with {
    assert masks[2][tok.encode('"', add_special_tokens=False)[0]]  # may close the string
    bad = compiler.matcher("json_schema", "not json")
    assert bad.error and bad.done


def test_grammar_errors_are_reported():
    assert grammar_error("json_schema", json.dumps(SCHEMA)) == ""
    assert grammar_error("json_schema", json.dumps({"type": "wat"}))
    assert grammar_error("json_schema", "{")
    assert grammar_error("regex", "a+") == "" and "unclosed" in grammar_error("regex", "(a")
    assert grammar_error("choice", json.dumps(["yes", "no"])) == ""
    assert grammar_error("choice", "[]") and grammar_error("choice", json.dumps(["a", 1]))
    assert grammar_error("lark", 'start: "a" b\nb: /[0-9]+/') == "" and "foo" in grammar_error("lark", "start: foo")
    assert "unknown grammar kind" in grammar_error("yaml", "x")


def test_regex_choice_and_lark_outputs_match(tiny_model_dir):
    import re

    runner = ModelRunner(RunnerConfig(model=str(tiny_model_dir), block_size=16, num_blocks=256))
    kinds = {"regex": ("regex", "[a-c]{2,4}-[0-9]{1,3}"), "choice": ("choice", json.dumps(["red", "green", "blue"])),
             "lark": ("lark", 'start: "n=" num ";"\nnum: /[1-9][0-9]?/')}
    requests = {f"{name}{seed}": ([5, 6, 7], Params(max_tokens=40, temperature=1.0, seed=seed,
                                                    grammar=worker_pb2.Grammar(kind=kind, spec=spec)))
                for name, (kind, spec) in kinds.items() for seed in range(3)}
    out = run(runner, requests)
    for request_id, (ids, reason) in out.items():
        text = text_of(runner, ids)
        if request_id.startswith("regex"):
            assert re.fullmatch("[a-c]{2,4}-[0-9]{1,3}", text), text
        elif request_id.startswith("choice"):
            assert text in ("red", "green", "blue") and reason == "stop", (text, reason)
        else:
            assert re.fullmatch("n=[1-9][0-9]?;", text) and reason == "stop", (text, reason)


def test_a_grammar_complete_before_min_tokens_ends_the_request(tiny_model_dir):
    """An empty regex allows only EOS; with min_tokens it used to leave the row nothing, so
    the raw logits drew a token the grammar refused (a 500 at the gateway). The grammar
    wins: EOS, and the request stops. A choice completed before min_tokens ends the same way."""
    runner = ModelRunner(RunnerConfig(model=str(tiny_model_dir), block_size=16, num_blocks=256))
    eos = runner.model_config.eos_token_ids
    requests = {
        "empty": ([5, 6, 7], Params(max_tokens=8, min_tokens=1, grammar=worker_pb2.Grammar(kind="regex", spec=""))),
        "choice": ([5, 6, 7], Params(max_tokens=40, min_tokens=30, temperature=1.0, seed=1,
                                     grammar=worker_pb2.Grammar(kind="choice", spec=json.dumps(["red", "blue"])))),
    }
    out = run(runner, requests)
    ids, reason = out["empty"]
    assert reason == "stop" and text_of(runner, ids) == "" and all(i in eos for i in ids), (ids, reason)
    ids, reason = out["choice"]
    assert reason == "stop" and text_of(runner, ids) in ("red", "blue"), (ids, reason)
