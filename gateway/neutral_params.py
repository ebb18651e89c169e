"""Parameters OpenAI or vLLM define that change the output and that are not implemented:
declared anyway (frameworks send them), accepted only at their neutral value, published in
the OpenAPI schema with those values as the only ones and the reason, and refused (400,
naming the parameter) at any other value."""

from __future__ import annotations

import json
from typing import Any

from pydantic import WithJsonSchema

# The neutral values of each such parameter, and why anything else is refused.
NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "best_of": ((None, 1), "only one sequence is generated per choice"),
    "suffix": ((None, ""), "insertion (text after the completion) needs a fill-in-the-middle model"),
    "functions": ((None, []), "use 'tools'"),
    "function_call": ((None, "none", "auto"), "use 'tool_choice'"),
    # vLLM's extensions we do not implement
    "use_beam_search": ((None, False), "beam search is not implemented"),
    "length_penalty": ((None, 1, 1.0), "it only applies to beam search, which is not implemented"),
    "early_stopping": ((None, False), "it only applies to beam search, which is not implemented"),
    "prompt_logprobs": ((None,), "on /v1/completions use echo with logprobs"),
    "spaces_between_special_tokens": ((None, True), "special tokens are decoded as they are"),
    "bad_words": ((None, []), "use logit_bias"),
    "allowed_token_ids": ((None,), "use logit_bias or structured output"),
    "logits_processors": ((None, []), "custom logits processors are not loaded"),
    "detokenize": ((None, True), "use return_token_ids"),
    "return_tokens_as_token_ids": ((None, False), "use return_token_ids"),
    "cache_salt": ((None,), "the prefix cache is shared by every request"),
    "kv_transfer_params": ((None,), "disaggregated prefill is not implemented"),
    "vllm_xargs": ((None,), "there are no custom sampling extensions"),
    "echo": ((None, False), "chat answers never repeat the prompt"),
    "documents": ((None,), "documents are not passed to chat templates"),
    "chat_template": ((None,), "the model's own chat template is always used"),
    "guided_whitespace_pattern": ((None,), "JSON is generated with compact separators"),
    "whitespace_pattern": ((None,), "JSON is generated with compact separators"),
    "structural_tag": ((None,), "use tools with tool_choice, or a grammar"),
}


def same_json(a: Any, b: Any) -> bool:
    """Equal as JSON values: 1 == 1.0, but false is not 0 (Python's == says it is)."""
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return a is b
    return a == b and (type(a) in (int, float)) == (type(b) in (int, float))


def neutral_schema(name: str) -> WithJsonSchema:
    """The schema of a parameter accepted only at its neutral value: those values, and why."""
    allowed, why = NEUTRAL[name]
    values: list[Any] = []
    for value in allowed:  # 1 and 1.0 are one JSON value
        if not any(same_json(v, value) for v in values):
            values.append(value)
    shown = " or ".join(json.dumps(v) for v in values)
    return WithJsonSchema({"enum": values, "description": f"Refused (400) unless {shown}: {why}."})


def require_neutral(name: str, value: Any) -> Any:
    allowed, why = NEUTRAL[name]
    if not any(same_json(value, neutral) for neutral in allowed):
        raise ValueError(f"'{name}' is not supported (got {value!r}): {why}")
    return value


