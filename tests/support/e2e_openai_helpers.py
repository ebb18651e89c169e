"""The stack the OpenAI-API end-to-end tests (test_e2e_openai.py, test_e2e_openai_errors.py)
run on, the same in both: a module-scoped fixture, so one start per module that imports it."""

import pytest

from tests.support.stack_helpers import running_stack


@pytest.fixture(scope="module")
def stack(tiny_model_dir, redis_url, tmp_path_factory):
    with running_stack(tiny_model_dir, redis_url, tmp_path_factory.mktemp("openai-run"),
                       scheduler_args=("--max-num-batched-tokens", "64")) as s:
        yield s
