"""Prometheus metrics of the real stack: after requests from the official `openai` client,
the gateway's /metrics, the scheduler's and the worker's own count exactly what was served,
the gateway re-exports the scheduler's numbers unchanged, and every metric the Grafana
dashboard queries is one that the service it queries exports. Latency values are only
checked to be >= 0 (no timing assertions). (`pagedserve engine`'s: tests/e2e/test_e2e_engine.py.)"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import openai
import pytest

from proto.metrics_scrape import metric, scrape
from tests.support.stack_helpers import running_stack, wait_until_idle

DASHBOARD = Path(__file__).resolve().parents[2] / "compose" / "grafana" / "pagedserve-dashboard.json"
PROMPT = [11, 22, 33, 44, 55, 66, 77]


@pytest.fixture(scope="module")
def stack(tiny_model_dir, redis_url, tmp_path_factory):
    with running_stack(tiny_model_dir, redis_url, tmp_path_factory.mktemp("run")) as s:
        yield s


def serve_some(base_url: str, model: str) -> list:
    """Completions and chat, streamed and not, one with a stop token and one with n = 2;
    returns (finish reasons, completion tokens, prompt tokens) of each request."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    first = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
    stop_token = first.choices[0].token_ids[3]
    served = [([c.finish_reason for c in first.choices], first.usage)]
    stopped = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                        extra_body={"stop_token_ids": [stop_token], "ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop"
    served.append(([c.finish_reason for c in stopped.choices], stopped.usage))

    async def concurrently():
        async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as aclient:
            async def chat_stream(i):
                chunks = [c async for c in await aclient.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": f"Count to {i}"}], max_tokens=6,
                    stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})]
                return [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason], \
                    chunks[-1].usage

            async def complete(i, n=1):
                resp = await aclient.completions.create(model=model, prompt=f"{i} apples", max_tokens=5, n=n,
                                                        temperature=0.8, seed=i, extra_body={"ignore_eos": True})
                return [c.finish_reason for c in resp.choices], resp.usage

            return await asyncio.gather(chat_stream(3), chat_stream(4), complete(1), complete(2), complete(3, n=2))

    served += asyncio.run(concurrently())
    return served


def test_each_service_counts_what_was_served(stack):
    served = serve_some(stack.base_url, stack.served_model_name)
    wait_until_idle(stack)
    urls = stack.metrics_urls
    assert set(urls) == {"gateway", "scheduler", "worker-0"}
    gateway, scheduler, worker = (scrape(urls[name]) for name in ("gateway", "scheduler", "worker-0"))

    reasons = [r for finish, _ in served for r in finish]
    choices = len(reasons)
    assert choices == 8 and reasons.count("stop") == 1
    completion_tokens = sum(usage.completion_tokens for _, usage in served)
    model = {"model_name": stack.served_model_name}

    # The gateway: what clients saw, per choice.
    assert metric(gateway, "pagedserve:time_to_first_token_seconds_count", **model) == choices
    assert metric(gateway, "pagedserve:e2e_request_latency_seconds_count", **model) == choices
    # TPOT: choices of 2+ tokens (all but the stopped one may be 1 token; n = 2 makes 5 + 5).
    several = sum(len(finish) for finish, usage in served if usage.completion_tokens >= 2 * len(finish))
    assert metric(gateway, "pagedserve:request_time_per_output_token_seconds_count", **model) == several
    # One token per step per sequence: every token after a choice's first is one gap.
    assert metric(gateway, "pagedserve:inter_token_latency_seconds_count", **model) == completion_tokens - choices
    assert metric(gateway, "pagedserve:generation_tokens_total", **model) == completion_tokens
    assert metric(gateway, "pagedserve:prompt_tokens_total", **model) == sum(u.prompt_tokens for _, u in served)
    for reason in ("stop", "length"):
        assert (metric(gateway, "pagedserve:request_success_total", finished_reason=reason, **model)
                == reasons.count(reason))
    assert metric(gateway, "pagedserve:request_success_total", **model) == choices  # no abort, no error
    for name in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        assert metric(gateway, f"pagedserve:{name}_seconds_sum", **model) >= 0

    # The scheduler: every sequence queued, prefilled and decoded once, on worker-0.
    w = {"worker": "worker-0"}
    for phase in ("queue", "prefill", "decode", "inference"):
        assert metric(scheduler, f"pagedserve:request_{phase}_time_seconds_count", **w) == choices, phase
        assert metric(scheduler, f"pagedserve:request_{phase}_time_seconds_sum", **w) >= 0
    assert metric(scheduler, "pagedserve:num_requests_running", **w) == 0
    assert metric(scheduler, "pagedserve:kv_cache_usage_perc", **w) == 0
    assert metric(scheduler, "pagedserve:prefix_cache_queries_total", **w) > 0

    # The worker: its own steps, the same ones the scheduler counted from their results.
    steps = metric(worker, "pagedserve:step_duration_seconds_count", **w)
    assert steps == metric(scheduler, "pagedserve:scheduler_steps_total", **w) > 0
    assert metric(worker, "pagedserve:step_gap_seconds_count", **w) > 0  # decodes went on between steps
    for name in ("step_duration_seconds", "step_batch_size", "iteration_tokens_total", "step_gap_seconds"):
        for part in ("count", "sum"):
            assert metric(worker, f"pagedserve:{name}_{part}", **w) == pytest.approx(
                metric(scheduler, f"pagedserve:{name}_{part}", **w)), name
    assert metric(worker, "pagedserve:step_batch_size_sum", **w) >= steps
    assert metric(worker, "pagedserve:iteration_tokens_total_sum", **w) >= completion_tokens

    # The gateway re-exports the scheduler's numbers as they are (one renderer, one message).
    for key, v in scheduler.items():
        if key[0].startswith("pagedserve:"):
            assert gateway.get(key) == pytest.approx(v), key

    check_dashboard({"gateway": gateway, "scheduler": scheduler, "worker": worker})


def check_dashboard(scrapes: dict[str, dict]) -> None:
    """Every panel's expressions name metrics that the job they select exports."""
    dashboard = json.loads(DASHBOARD.read_text())
    jobs = {f"${v['name']}": v["current"]["value"] for v in dashboard["templating"]["list"]}
    names = {job: {name for name, _ in samples} for job, samples in scrapes.items()}
    checked = 0
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            uses = re.findall(r'(pagedserve:[A-Za-z0-9_:]+)\{job="(\$\w+)"\}', expr)
            assert uses and len(uses) == expr.count("pagedserve:"), f"a metric without a job: {expr}"
            for used, variable in uses:
                job = jobs[variable]
                assert used in names[job], f"panel {panel['title']!r}: {job} does not export {used}"
                checked += 1
    assert checked >= 20
