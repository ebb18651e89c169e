"""Schemathesis hooks for fuzzing the gateway against its own /openapi.json
(tests/e2e/test_e2e_openapi_contract.py, docs/api.md "The OpenAPI document is the contract"):

    SCHEMATHESIS_HOOKS=tests/support/openapi_contract_hooks.py schemathesis run \
        http://127.0.0.1:8000/openapi.json --checks all

One kind of failure the `filter_failure` hook lets through: a body the document calls valid,
refused with a 400 whose error code the operation's own 400 response lists under
`x-beyond-schema` (gateway/openapi_answers.py): the rules no JSON Schema can state (a
prompt too long for the context, min_tokens above max_tokens, a grammar llguidance cannot
compile, what an image URL holds, ...). Every other refusal of a valid body, and every
other check, still fails the run; schemathesis counts the dropped failures in its summary.
`after_call` keeps a tally of every call (with $CONTRACT_TALLY set) for the test's own checks.
"""

from __future__ import annotations

import json
import os

import schemathesis
from schemathesis.openapi.checks import RejectedPositiveData


def beyond_schema_codes(case) -> list[str]:
    """The error codes the operation's 400 lists as refusals of valid bodies."""
    responses = case.operation.definition.raw.get("responses", {})
    return list(responses.get("400", {}).get("x-beyond-schema", []))


@schemathesis.hook
def filter_failure(context, failure, case, response) -> bool:
    """False (drop it) for a valid body refused by a rule the document lists as beyond its schema."""
    if not isinstance(failure, RejectedPositiveData) or response.status_code != 400:
        return True
    try:
        code = json.loads(response.content)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return True
    return code not in beyond_schema_codes(case)


@schemathesis.hook
def after_call(context, case, response) -> None:
    """With $CONTRACT_TALLY set, one JSON line per call there: the operation, whether the
    body was generated valid, and the status (the test requires a share of valid bodies
    to be served, not only excused)."""
    path = os.environ.get("CONTRACT_TALLY")
    if not path or case.meta is None:
        return
    with open(path, "a") as tally:
        tally.write(json.dumps({"operation": case.operation.label, "status": response.status_code,
                                "positive": case.meta.generation.mode.is_positive}) + "\n")
