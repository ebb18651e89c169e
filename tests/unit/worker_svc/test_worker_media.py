"""The worker's media over Redis and what it reports: RedisMediaSource reads the items the
gateway stores (found, missing, not msgpack, Redis unreachable), the worker's /metrics count
encoded images and encoder-cache hits, and a real worker service reads a request's media
from its own Redis and fails an expired one alone."""

import threading
import urllib.request
import uuid

import grpc
import msgspec
import pytest
import redis
from tests.support.image_cases import IMAGE, make_case, prompt_text, stored
from tests.support.media_helpers import picture
from prometheus_client import CollectorRegistry, generate_latest
from tests.support.runner_helpers import FakeMediaSource, mm_inputs

from compose.launcher import free_port
from kvstore.kv_cache_groups import group_layers
from proto import worker_pb2, worker_pb2_grpc
from proto.keys import RedisKeys
from proto.messages import MediaItem, events_decoder, registration_decoder
from proto.metrics import EncoderRecorder, StepCollector, StepRecorder
from worker_svc import server
from worker_svc.service_config import WorkerServiceConfig
from worker_svc.config import RunnerConfig
from vision.media_source import MISSING, MediaUnavailableError, RedisMediaSource
from modeling.registry import load_config

# ---- the Redis media source, the metrics -----------------------------------------------------

def test_redis_media_source_reads_the_gateways_items(redis_url):
    keys = RedisKeys("test-media-source")
    client = redis.Redis.from_url(redis_url)
    items = {"a" * 64: MediaItem("encoded", 2, 2, b"png bytes", "image/png"),
             "b" * 64: MediaItem("rgb8", 1, 1, b"\1\2\3")}
    for digest, item in items.items():
        client.set(keys.media(digest), msgspec.msgpack.encode(item), px=60_000)
    client.set(keys.media("c" * 64), b"\xc1 not msgpack")
    source = RedisMediaSource.from_url(redis_url, keys.prefix)
    try:
        assert source.fetch(list(items)) == items
        assert source.fetch([]) == {}
        with pytest.raises(MediaUnavailableError) as caught:
            source.fetch(["a" * 64, "d" * 64, "c" * 64])
        assert caught.value.found == {"a" * 64: items["a" * 64]}
        assert caught.value.reasons["d" * 64] == MISSING
        assert caught.value.reasons["c" * 64].startswith("the stored value is not a MediaItem")
        assert "d" * 64 in str(caught.value)
    finally:
        source.close()
        client.delete(*[keys.media(h) for h in (*items, "c" * 64)])
        client.close()
    unreachable = RedisMediaSource.from_url("redis://127.0.0.1:1/0", "x", timeout_s=0.5)
    with pytest.raises(MediaUnavailableError, match="the media store is unreachable"):
        unreachable.fetch(["a" * 64])


def test_worker_metrics_count_encoded_images_and_cache_hits():
    encoder = EncoderRecorder()
    encoder.observe(3, 0, 0.02)
    encoder.observe(0, 2, 0.0)  # every image from the cache: no encoding time observed
    encoder.observe(1, 1, 0.5)
    registry = CollectorRegistry()
    registry.register(StepCollector("w", StepRecorder(), encoder))
    text = generate_latest(registry).decode()
    assert 'pagedserve:mm_items_encoded_total{worker="w"} 4.0' in text
    assert 'pagedserve:encoder_cache_hits_total{worker="w"} 3.0' in text
    assert 'pagedserve:encoder_seconds_count{worker="w"} 2.0' in text
    assert 'pagedserve:encoder_seconds_sum{worker="w"} 0.52' in text
    plain = CollectorRegistry()
    plain.register(StepCollector("w", StepRecorder()))  # a text model's worker
    assert "encoder" not in generate_latest(plain).decode()


def test_the_worker_service_reads_media_from_its_redis(vision_dir, processor, redis_url):
    """serve(): the runner gets a RedisMediaSource on the service's Redis and key prefix;
    an image request is served, one whose media expired fails alone, /metrics counts."""
    metrics_port = free_port()
    prefix = f"images-{uuid.uuid4().hex[:8]}"
    config = WorkerServiceConfig(runner=RunnerConfig(model=str(vision_dir), num_blocks=256),
                                        port=0, redis_url=redis_url, key_prefix=prefix,
                                        metrics_port=metrics_port)
    client = redis.Redis.from_url(redis_url)
    media = FakeMediaSource()
    case = make_case(processor, media, prompt_text(processor, 70, 1), [stored(picture(71, 30, 40), "PNG")])
    (digest,) = case.hashes
    client.set(RedisKeys(prefix).media(digest), msgspec.msgpack.encode(media.items[digest]), px=60_000)
    ready, stop = threading.Event(), threading.Event()
    serving = threading.Thread(target=server.serve, args=(config, ready, stop), daemon=True)
    serving.start()
    subscription = client.pubsub()
    try:
        assert ready.wait(timeout=60)
        address = registration_decoder.decode(client.get(RedisKeys(prefix).worker(config.worker_id))).address
        subscription.subscribe("out:images")
        step = worker_pb2.StepRequest(step_id=1)
        # a table per KV cache group (the tiny Gemma 3's global and sliding layers), each request's own
        per_request = group_layers(load_config(vision_dir).sliding_windows).num_groups * (len(case.ids) // 16 + 1)
        for rid, h in (("ok", digest), ("gone", "ef" * 32)):
            first = 0 if rid == "ok" else per_request
            step.new_requests.add(request_id=rid, token_ids=case.ids, num_prompt_tokens=len(case.ids),
                                  block_ids=list(range(first, first + per_request)),
                                  sampling=worker_pb2.SamplingParams(max_tokens=1), reply_channel="out:images",
                                  mm_inputs=mm_inputs(case.ids, IMAGE, [h]))
            step.num_scheduled_tokens[rid] = len(case.ids)
        with grpc.insecure_channel(address) as channel:
            result = worker_pb2_grpc.WorkerStub(channel).Step(step, timeout=60)
        sampled = {s.request_id: s for s in result.sampled}
        assert {rid: s.finish_reason for rid, s in sampled.items()} == {"ok": "length", "gone": "error"}
        events = {}
        while len(events) < 2:
            message = subscription.get_message(timeout=10)
            assert message is not None
            if message["type"] == "message":
                events.update({e.request_id: e for e in events_decoder.decode(message["data"])})
        assert events["ok"].token_ids == [sampled["ok"].token_id] and events["ok"].finish_reason == "length"
        assert events["gone"].error == f"image 0 (content hash {'ef' * 32}): {MISSING}"
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        assert f'pagedserve:mm_items_encoded_total{{worker="{config.worker_id}"}} 1.0' in text
        assert f'pagedserve:encoder_seconds_count{{worker="{config.worker_id}"}} 1.0' in text
    finally:
        subscription.close()
        client.delete(RedisKeys(prefix).media(digest))
        client.close()
        stop.set()
        serving.join(timeout=30)
