"""bench/stack/serve.py, the serving benchmark's client: its SSE reader, and a run against the real
stack (tiny model) whose token counts are known in advance."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.support.stack_helpers import running_stack
from tests.bench.test_bench_compare import bench_module


@pytest.fixture(scope="module")
def serve():
    return bench_module("stack.serve")


async def _collect(serve, pieces: list[bytes]) -> list[bytes]:
    async def stream():
        for piece in pieces:
            yield piece

    return [data async for data in serve.sse_data(stream())]


def test_sse_events_split_anywhere(serve):
    body = (b": a comment\n\ndata: {\"a\": 1}\n\ndata:{\"b\": 2}\r\n\r\n"
            b"event: x\ndata: {\"c\": 3}\n\ndata: [DONE]\n\ndata: {\"after\": 0}\n\n")
    want = [b'{"a": 1}', b'{"b": 2}', b'{"c": 3}']
    assert asyncio.run(_collect(serve, [body])) == want
    for cut in range(1, len(body)):  # every split into two pieces, \r\n halves included
        assert asyncio.run(_collect(serve, [body[:cut], body[cut:]])) == want, cut
    assert asyncio.run(_collect(serve, [bytes([c]) for c in body])) == want  # a byte at a time
    assert asyncio.run(_collect(serve, [b"data: 1\n\ndata: 2"])) == [b"1"]  # unfinished event: not yet


@pytest.fixture(scope="module")
def stack(tiny_model_dir, redis_url, tmp_path_factory):
    with running_stack(tiny_model_dir, redis_url, tmp_path_factory.mktemp("bench-serve-run")) as s:
        yield s


def _args(serve, stack, tiny_model_dir, *extra: str):
    return serve.build_parser().parse_args([
        "--base-url", stack.base_url, "--model", stack.served_model_name, "--tokenizer", str(tiny_model_dir),
        "--vocab-high", "1500", "--max-model-len", "512", "--quiet", *extra])


def test_run_counts_every_token(serve, stack, tiny_model_dir):
    args = _args(serve, stack, tiny_model_dir, "--num-requests", "6", "--concurrency", "3",
                 "--input-mean", "24", "--output-mean", "8", "--per-request", "--slo", "ttft:60000")
    result = asyncio.run(serve.run(args))
    assert result["failed"] == 0, result["errors"]
    wanted = [r["max_tokens"] for r in result["requests"]]
    assert [r["output_tokens"] for r in result["requests"]] == wanted  # --ignore-eos: exact lengths
    assert result["total_output_tokens"] == sum(wanted)
    assert all(r["ttft_s"] > 0 and r["latency_s"] >= r["ttft_s"] for r in result["requests"])
    assert result["goodput"] == pytest.approx(result["request_throughput"])  # a 60 s TTFT SLO: all meet it
    assert set(result["itl_s"]) == {"mean", "p50", "p90", "p99"}


def test_one_request_sees_each_token_as_it_streams(serve, stack, tiny_model_dir):
    args = _args(serve, stack, tiny_model_dir)

    async def go():
        async with httpx.AsyncClient(base_url=stack.base_url + "/", timeout=60) as client:
            return await serve.one(client, args, [400, 401, 402, 403], 4, 7)

    r = asyncio.run(go())
    assert r.error is None and r.output_tokens == 7 and r.prompt_tokens == 4
    assert len(r.itl_s) == 6  # one chunk per token (return_token_ids), the first one is the TTFT


def test_server_errors_are_reported_per_request(serve, stack, tiny_model_dir):
    args = _args(serve, stack, tiny_model_dir, "--num-requests", "2", "--output-mean", "2")
    args.model = "no-such-model"
    result = asyncio.run(serve.run(args))
    assert result["failed"] == 2
    assert any("HTTP 404" in e and "no-such-model" in e for e in result["errors"]), result["errors"]
