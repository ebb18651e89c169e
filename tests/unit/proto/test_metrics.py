"""Metrics without the network: the histogram recorder and its rendering, the scheduler's
request-phase and step recorder against a BatchScheduler and the fake worker, the
scheduler's /metrics server, and the gateway's per-choice meter around a Generation."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from compose.launcher import free_port
from gateway.generation import GenerationOutput
from gateway.metrics import GatewayMetrics
from proto.messages import NewRequest, SamplingParams, StepHistograms, WorkerStats, stats_decoder, stream_encoder
from proto import worker_pb2
from proto.metrics import HistogramRecorder, StepRecorder, WorkerStatsCollector, histogram_family, serve_metrics
from proto.metrics_scrape import parse_samples
from scheduler_svc.metrics import SchedulerMetrics, WorkerRecorder, worker_stats
from tests.support.scheduler_harness import Harness


def render(collector) -> str:
    registry = CollectorRegistry()
    registry.register(collector)
    return generate_latest(registry).decode()


def test_histogram_buckets_are_prometheus_le_and_cumulative():
    rec = HistogramRecorder([1.0, 2.0])
    for value in (0.5, 1.0, 1.5, 3.0, 2.0):
        rec.observe(value)
    h = rec.snapshot()
    assert h.counts == [2, 2, 1] and h.sum == 8.0  # (.., 1], (1, 2], (2, +Inf)
    collector = type("C", (), {"collect": lambda self: [histogram_family("x_seconds", "x", ["w"], [(["a"], h)])]})()
    got = parse_samples(render(collector))
    assert got[("x_seconds_bucket", (("le", "1.0"), ("w", "a")))] == 2
    assert got[("x_seconds_bucket", (("le", "2.0"), ("w", "a")))] == 4
    assert got[("x_seconds_bucket", (("le", "+Inf"), ("w", "a")))] == 5
    assert got[("x_seconds_count", (("w", "a"),))] == 5
    assert got[("x_seconds_sum", (("w", "a"),))] == 8.0


def _request(rid: str, prompt_len: int, max_tokens: int, arrival: float, n: int = 1) -> NewRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return NewRequest(rid, list(range(1, prompt_len + 1)), params, "out:gw", arrival, n=n)


def test_worker_recorder_times_every_sequence_once():
    # A small pool: preemptions re-admit requests, which must not be queued twice.
    h = Harness(num_blocks=12, block_size=4, max_num_batched_tokens=16)
    recorder = WorkerRecorder()
    t0 = time.time()  # arrival times are the gateway's wall clock
    reqs = [_request(f"r{i}", 6 + i, 8, arrival=t0 + i * 1e-3) for i in range(5)]
    reqs.append(_request("fork", 9, 4, arrival=t0 + 0.005, n=3))
    h.add(_request("gone", 5, 30, arrival=t0 - 1), *reqs)
    num_steps = batch = tokens = gaps = 0
    while h.sched.has_work():
        step = h.sched.schedule()
        recorder.scheduled(h.sched, step)
        result = h.worker.step(step)
        result.execute_seconds = 0.01
        if num_steps % 2:  # a worker sets it only after a step that left work going on
            result.gap_seconds = 0.002
            gaps += 1
        finished = h.sched.update(step, result)
        recorder.stepped(h.sched, step, result, finished)
        h.finished.update((r.request_id, r) for r in finished)
        num_steps += 1
        batch += len(step.num_scheduled_tokens)
        tokens += sum(step.num_scheduled_tokens.values())
        gone = h.sched.get_request("gone")
        if gone is not None and gone.num_output_tokens == 2:
            assert h.sched.abort_request("gone")  # aborted after its first tokens
    h.assert_done()
    assert h.sched.preemptor.num_preemptions >= 1, "the pool was meant to preempt"
    assert h.sched.queues.num_aborted == 1
    stats = worker_stats(h.sched, "w", check=True, recorder=recorder)
    assert recorder.num_timed == 0, "times of finished and aborted requests are dropped"
    sequences = 5 + 3 + 1  # five requests, three forked children, the aborted one
    assert len(h.finished) == 8
    req, steps = stats.requests, stats.steps
    assert sum(req.queue_time.counts) == sum(req.prefill_time.counts) == sequences
    assert sum(req.decode_time.counts) == sum(req.inference_time.counts) == 8
    assert min(req.queue_time.sum, req.prefill_time.sum, req.decode_time.sum) >= 0
    assert req.queue_time.sum < 60  # from the arrival times, not from 1970
    assert sum(steps.duration.counts) == num_steps == stats.num_steps
    assert steps.duration.sum == pytest.approx(0.01 * num_steps)
    assert (steps.batch_size.sum, steps.tokens.sum) == (batch, tokens)
    assert sum(steps.gap.counts) == gaps and steps.gap.sum == pytest.approx(0.002 * gaps)

    # The message travels through Redis and renders the same at the scheduler and the gateway.
    wire = stats_decoder.decode(stream_encoder.encode(stats))
    assert wire == stats
    collector = WorkerStatsCollector()
    collector.snapshot = [wire]
    got = parse_samples(render(collector))
    w = (("worker", "w"),)
    assert got[("pagedserve:request_queue_time_seconds_count", w)] == sequences
    assert got[("pagedserve:request_decode_time_seconds_count", w)] == 8
    assert got[("pagedserve:step_duration_seconds_count", w)] == num_steps
    assert got[("pagedserve:iteration_tokens_total_sum", w)] == tokens
    assert got[("pagedserve:step_gap_seconds_count", w)] == gaps
    assert got[("pagedserve:num_preemptions_total", w)] == h.sched.preemptor.num_preemptions
    assert got[("pagedserve:kv_integrity_ok", w)] == 1.0


def test_scheduler_metrics_server_serves_the_latest_stats_of_live_workers():
    metrics = SchedulerMetrics()
    port = free_port()
    server = metrics.serve("127.0.0.1", port)
    try:
        for worker in ("a", "b"):
            metrics.publish(WorkerStats(worker_id=worker, num_blocks=10, num_free_blocks=4, num_running=2,
                                        num_waiting=1, num_preemptions=0, num_steps=3, num_used_blocks=6,
                                        group_windows=(0, 48), group_used_blocks=(4, 2)))
        metrics.forget_worker("b")
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        server.close()
    got = parse_samples(text)
    assert got[("pagedserve:kv_cache_usage_perc", (("worker", "a"),))] == 0.6  # the whole pool
    # each KV cache group's blocks (a global group and a sliding one)
    assert got[("pagedserve:kv_group_blocks_used", (("group", "0"), ("window", "0"), ("worker", "a")))] == 4
    assert got[("pagedserve:kv_group_blocks_used", (("group", "1"), ("window", "48"), ("worker", "a")))] == 2
    assert got[("pagedserve:num_requests_running", (("worker", "a"),))] == 2
    assert ("pagedserve:num_requests_running", (("worker", "b"),)) not in got
    assert metrics.serve("127.0.0.1", 0) is None  # port 0: no server


class FakeGeneration:
    """What MeteredGeneration needs of a Generation: n, outputs() as (index, output), close()."""

    def __init__(self, outputs: list[tuple[int, GenerationOutput]], n: int, fail: Exception | None = None):
        self.n, self.request_id, self._outputs, self._fail = n, "req", outputs, fail
        self.closed = False

    async def outputs(self):
        for item in self._outputs:
            await asyncio.sleep(0)
            yield item
        if self._fail is not None:
            raise self._fail

    def close(self):
        self.closed = True


def _out(ids: list[int], total: int, reason: str | None = None) -> GenerationOutput:
    return GenerationOutput(text="x", token_ids=ids, num_tokens=total, finish_reason=reason)


def test_gateway_meter_counts_per_choice():
    metrics = GatewayMetrics("m")
    outputs = [(0, _out([1], 1)), (1, _out([5], 1)), (0, _out([2], 2)), (1, _out([6], 2, "stop")),
               (0, _out([3], 3)), (0, _out([], 3, "length"))]
    generation = metrics.meter(FakeGeneration(outputs, n=2), num_prompt_tokens=7)

    async def consume():
        return [item async for item in generation.outputs()]

    assert asyncio.run(consume()) == outputs
    generation.close()
    assert generation._generation.closed and generation.request_id == "req"  # the rest is the generation's
    got = parse_samples(generate_latest(metrics.registry).decode())
    m = (("model_name", "m"),)
    assert got[("pagedserve:time_to_first_token_seconds_count", m)] == 2
    assert got[("pagedserve:inter_token_latency_seconds_count", m)] == 3  # 5 tokens, 2 choices
    assert got[("pagedserve:e2e_request_latency_seconds_count", m)] == 2
    assert got[("pagedserve:request_time_per_output_token_seconds_count", m)] == 2
    assert got[("pagedserve:prompt_tokens_total", m)] == 7  # the prompt once, as usage counts it
    assert got[("pagedserve:generation_tokens_total", m)] == 5
    assert got[("pagedserve:request_success_total", (("finished_reason", "stop"), *m))] == 1
    assert got[("pagedserve:request_success_total", (("finished_reason", "length"), *m))] == 1


def test_gateway_meter_counts_unfinished_choices_as_abort_or_error():
    metrics = GatewayMetrics("m")
    left = metrics.meter(FakeGeneration([(0, _out([1], 1)), (0, _out([2], 2))], n=1), num_prompt_tokens=3)
    failed = metrics.meter(FakeGeneration([], n=2, fail=RuntimeError("boom")), num_prompt_tokens=3)

    async def run():
        stream = left.outputs()
        await stream.__anext__()
        await stream.aclose()  # the client went away after one token
        with pytest.raises(RuntimeError):
            async for _ in failed.outputs():
                pass

    asyncio.run(run())
    got = parse_samples(generate_latest(metrics.registry).decode())
    m = ("model_name", "m")
    assert got[("pagedserve:request_success_total", (("finished_reason", "abort"), m))] == 1
    assert got[("pagedserve:request_success_total", (("finished_reason", "error"), m))] == 2
    assert got[("pagedserve:e2e_request_latency_seconds_count", (m,))] == 0
    assert got[("pagedserve:prompt_tokens_total", (m,))] == 3  # the abandoned one had its first token


def test_step_histograms_without_a_gap_render_without_one():
    """WorkerStats from a scheduler that predates the gap histogram: no step_gap series."""
    empty = HistogramRecorder([1.0]).snapshot()
    stats = WorkerStats(worker_id="old", num_blocks=1, num_free_blocks=1, num_running=0, num_waiting=0,
                        num_preemptions=0, num_steps=0,
                        steps=StepHistograms(duration=empty, batch_size=empty, tokens=empty))
    collector = WorkerStatsCollector()
    collector.snapshot = [stats]
    names = {name for name, _ in parse_samples(render(collector))}
    assert "pagedserve:step_duration_seconds_count" in names
    assert not any(name.startswith("pagedserve:step_gap_seconds") for name in names)


def test_step_recorder_counts_each_step_with_its_requests_tokens_and_gap():
    """A step is one observation in each histogram; the gap only when the worker measured one."""
    recorder = StepRecorder()
    recorder.observe(worker_pb2.StepRequest(step_id=1, num_scheduled_tokens={"a": 5, "b": 1}),
                     worker_pb2.StepResult(step_id=1, execute_seconds=0.06, gap_seconds=0.004))
    recorder.observe(worker_pb2.StepRequest(step_id=2, num_scheduled_tokens={"a": 1}),
                     worker_pb2.StepResult(step_id=2, execute_seconds=0.01))
    steps = recorder.snapshot()
    assert sum(steps.duration.counts) == 2 and steps.duration.sum == pytest.approx(0.07)
    assert sum(steps.batch_size.counts) == 2 and steps.batch_size.sum == 3
    assert steps.tokens.sum == 7
    assert sum(steps.gap.counts) == 1 and steps.gap.sum == pytest.approx(0.004)


def test_a_metrics_server_answers_health_with_200_or_503_beside_its_metrics():
    state = {"healthy": True}
    server = serve_metrics(WorkerStatsCollector(), "127.0.0.1", free_port(),
                           health=lambda: (state["healthy"], {"status": "ok" if state["healthy"] else "down"}))
    try:
        base = f"http://127.0.0.1:{server.port}"
        with urllib.request.urlopen(f"{base}/health", timeout=5) as reply:
            assert reply.status == 200 and json.load(reply) == {"status": "ok"}
        state["healthy"] = False
        with pytest.raises(urllib.error.HTTPError) as failed:
            urllib.request.urlopen(f"{base}/health", timeout=5)
        assert failed.value.code == 503 and json.load(failed.value) == {"status": "down"}
        with urllib.request.urlopen(f"{base}/metrics", timeout=5) as reply:
            assert reply.status == 200
    finally:
        server.close()


def test_the_images_of_workers_and_encoders_render_side_by_side():
    """A worker's StepResult.images summed by its scheduler (WorkerStats.vision, through
    msgpack as Redis carries it) and an encoder's EncoderStats, in one family per metric:
    labelled `worker` and `encoder`, as the gateway's /metrics shows the stack."""
    from proto.encoder_messages import EncoderStats, encoder_stats_decoder
    from proto.metrics import EncoderRecorder

    scheduler = Harness().sched
    recorder = WorkerRecorder()
    step = worker_pb2.StepRequest(step_id=1)
    for images in (worker_pb2.ImageStepStats(queries=3, cache_hits=1, published_hits=1, items_encoded=1, seconds=0.02),
                   worker_pb2.ImageStepStats(queries=2, published_hits=2)):
        result = worker_pb2.StepResult(step_id=1, execute_seconds=0.01)
        result.images.CopyFrom(images)
        recorder.stepped(scheduler, step, result, [])
    recorder.stepped(scheduler, step, worker_pb2.StepResult(step_id=1), [])  # a text step
    stats = stats_decoder.decode(stream_encoder.encode(worker_stats(scheduler, "w0", False, recorder)))
    text_only = worker_stats(scheduler, "w1", False, WorkerRecorder())
    assert stats.vision is not None and text_only.vision is None
    own = EncoderRecorder()
    own.observe(4, 0, 0.5)
    encoder = encoder_stats_decoder.decode(stream_encoder.encode(EncoderStats(
        "e0", own.snapshot(), items_published=4, bytes_published=4096, items_found=1)))

    collector = WorkerStatsCollector()
    collector.snapshot, collector.encoders = [stats, text_only], [encoder]
    samples = parse_samples(render(collector))
    assert samples[("pagedserve:mm_items_encoded_total", (("worker", "w0"),))] == 1
    assert samples[("pagedserve:mm_items_encoded_total", (("encoder", "e0"),))] == 4
    assert samples[("pagedserve:mm_cache_queries_total", (("worker", "w0"),))] == 5
    assert samples[("pagedserve:mm_cache_hits_total", (("worker", "w0"),))] == 4
    assert samples[("pagedserve:encoder_cache_hits_total", (("worker", "w0"),))] == 1
    assert samples[("pagedserve:encoder_seconds_count", (("worker", "w0"),))] == 1
    assert samples[("pagedserve:encoder_seconds_sum", (("encoder", "e0"),))] == 0.5
    assert samples[("pagedserve:mm_embeddings_published_bytes_total", (("encoder", "e0"),))] == 4096
    assert samples[("pagedserve:mm_embeddings_found_total", (("encoder", "e0"),))] == 1
    assert not any(labels == (("worker", "w1"),) for name, labels in samples if "mm_" in name)
    text_stack = WorkerStatsCollector()
    text_stack.snapshot = [text_only]
    assert "mm_" not in render(text_stack)  # a text model's stack shows no image metrics
