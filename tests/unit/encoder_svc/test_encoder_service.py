"""The encoder service's parts against a real redis-server and the tiny Gemma 3 vision
checkpoint: embeddings records (fp32, bf16, refused shapes), the claims (QUEUED by a gateway,
taken by one encoder, released), the gateway's announcements (only while an encoder is
registered), the scheduler's wait for media being encoded, and EncoderService rounds -- what
it publishes is what a worker would encode, a worker then encodes nothing, a dead encoder's
jobs are taken over after the claim TTL, bad media are given up, a pan-and-scan checkpoint's
whole images published and their crops left to the worker -- and its /metrics."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
import uuid

import msgspec
import pytest
import redis
import redis.asyncio as aioredis
import torch
from tests.support.media_helpers import file_bytes, picture
from prometheus_client import CollectorRegistry, generate_latest

from compose.launcher import free_port
from encoder_svc.config import EncoderServiceConfig
from encoder_svc.jobs import EncodeJobStream
from encoder_svc.service import EncoderService
from gateway.media.encode_jobs import EncodeJobs
from gateway.media.store import content_hash
from proto import worker_pb2
from proto.encoder_messages import QUEUED, EncodeJob, EncoderRegistration, job_encoder
from proto.keys import STREAM_FIELD, RedisKeys
from proto.messages import MediaItem, MultiModalInput
from proto.pan_and_scan import CropBox, ImagePiece
from scheduler_svc.encoding_wait import EncodingWait
from scheduler_svc.policy.image_ranges import to_pb_mm_inputs
from vision.published_embeddings import PublishedEmbeddings, from_record, to_record
from worker_svc.vision_step import ImageEmbedder
from vision.encoder_cache import EncoderCache
from worker_svc.request_state import RequestState


@pytest.fixture
def keys() -> RedisKeys:
    return RedisKeys(f"test-enc-{uuid.uuid4().hex[:8]}")


def jpeg(seed: int) -> MediaItem:
    image = picture(seed, 64, 48)
    return MediaItem("encoded", image.width, image.height, file_bytes(image, "JPEG"), "image/jpeg")


def transformers_image_features(vision_dir, items: list[MediaItem]) -> list[torch.Tensor]:
    """Gemma3ForConditionalGeneration's image features (fp32, CPU) of each stored file, its
    pixels from AutoProcessor."""
    import io

    from PIL import Image
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    images = [Image.open(io.BytesIO(item.data)).convert("RGB") for item in items]
    pixels = AutoProcessor.from_pretrained(vision_dir).image_processor(images, return_tensors="pt")["pixel_values"]
    hf = Gemma3ForConditionalGeneration.from_pretrained(vision_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return list(hf.get_image_features(pixels).pooler_output.float())


def store(client: redis.Redis, keys: RedisKeys, *items: MediaItem) -> list[str]:
    hashes = []
    for item in items:
        digest = content_hash(item)
        client.set(keys.media(digest), msgspec.msgpack.encode(item), px=60_000)
        hashes.append(digest)
    return hashes


def announce(client: redis.Redis, keys: RedisKeys, hashes: list[str]) -> None:
    """What a gateway writes for media it stored (gateway/media/encode_jobs.py), synchronously."""
    for h in hashes:
        client.set(keys.encoding(h), QUEUED, nx=True, px=5000)
    client.xadd(keys.encode_jobs, {STREAM_FIELD: job_encoder.encode(EncodeJob(tuple(hashes)))})


# ---- records and claims --------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_embeddings_record_round_trips_exactly(dtype):
    embeds = torch.randn(16, 24).to(dtype)
    back = from_record(to_record(embeds), dtype, (16, 24), torch.device("cpu"))
    assert back.dtype == dtype and torch.equal(back, embeds)
    with pytest.raises(ValueError, match="not"):
        from_record(to_record(embeds), dtype, (16, 25), torch.device("cpu"))
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    with pytest.raises(ValueError):
        from_record(to_record(embeds), other, (16, 24), torch.device("cpu"))


def test_claims_queued_by_a_gateway_are_taken_by_one_encoder(client, keys):
    published = PublishedEmbeddings(client, keys, "fp", torch.float32, (2, 3), torch.device("cpu"))
    client.set(keys.encoding("a"), QUEUED)
    assert published.claim("a", "enc-1", 5.0)  # over the gateway's mark
    assert not published.claim("a", "enc-2", 5.0)  # another encoder's
    assert published.claim("b", "enc-2", 5.0)  # a free one
    client.set(keys.encoding("c"), QUEUED)
    published.release(["a", "c"], only_queued=True)  # only the gateway's mark goes
    assert client.get(keys.encoding("a")) == b"enc-1" and client.get(keys.encoding("c")) is None
    published.publish({"a": torch.ones(2, 3)}, ttl_s=60)
    assert client.get(keys.encoding("a")) is None  # published: the claim is given up
    assert not published.claim("a", "enc-3", 5.0)  # and nobody claims it again
    assert 0 < client.pttl(keys.embeddings("fp", "a")) <= 60_000
    assert torch.equal(published.fetch(["a", "b"])["a"], torch.ones(2, 3))
    assert published.exists(["a", "b"]) == {"a"}
    client.set(keys.embeddings("fp", "b"), b"\xc1 not a record")
    assert published.fetch(["b"]) == {}  # unusable: missing, encoded again
    published.release(["b"])
    assert client.get(keys.encoding("b")) is None


def test_the_gateway_announces_only_while_an_encoder_is_registered(redis_url, keys, client):
    async def main() -> tuple[bool, bool]:
        aclient = aioredis.Redis.from_url(redis_url)
        try:
            jobs = EncodeJobs(aclient, keys, recheck_s=0.0)
            before = await jobs.announce(["h1"])
            registration = EncoderRegistration("e", "m", "fp", "float32", "cpu")
            await aclient.set(keys.encoder("e"), msgspec.msgpack.encode(registration), px=5000)
            await aclient.sadd(keys.encoders, "e")
            after = await jobs.announce(["h2", "h3"])
            return before, after
        finally:
            await aclient.aclose()

    assert asyncio.run(main()) == (False, True)
    assert client.get(keys.encoding("h1")) is None and client.get(keys.encoding("h2")) == QUEUED.encode()
    entries = client.xrange(keys.encode_jobs)
    assert len(entries) == 1 and EncodeJob(("h2", "h3")) == msgspec.msgpack.decode(
        entries[0][1][STREAM_FIELD], type=EncodeJob)


def test_the_scheduler_waits_for_media_being_encoded(redis_url, keys, client):
    client.set(keys.encoding("x"), "enc-1", px=5000)

    async def main() -> tuple[bool, bool, float]:
        aclient = aioredis.Redis.from_url(redis_url)
        try:
            wait = EncodingWait(aclient, keys, poll_s=0.002, max_wait_s=5.0)
            assert not await wait.pending(["y"])
            pending = await wait.pending(["y", "x"])
            threading.Timer(0.2, lambda: client.delete(keys.encoding("x"))).start()
            start = time.monotonic()
            await wait.until_done(["x"])
            short = EncodingWait(aclient, keys, max_wait_s=0.1)
            client.set(keys.encoding("z"), "enc-dead", px=60_000)
            began = time.monotonic()
            await short.until_done(["z"])  # bounded: never longer than max_wait_s
            bounded = time.monotonic() - began < 1.0
            client.set(keys.encoding("q"), QUEUED, px=60_000)  # the encoders are behind
            queued = EncodingWait(aclient, keys, max_wait_s=30.0, queued_wait_s=0.2)
            began = time.monotonic()
            await queued.until_done(["q"])  # only queued: waited for queued_wait_s, not max_wait_s
            bounded = bounded and 0.2 <= time.monotonic() - began < 2.0
            return pending, bounded, time.monotonic() - start
        finally:
            await aclient.aclose()

    pending, bounded, waited = asyncio.run(main())
    assert pending and bounded and waited >= 0.2


def test_a_worker_takes_over_media_the_encoders_have_not_reached(vision_dir, redis_url, keys, client):
    service = make_service(vision_dir, redis_url, keys)
    service.jobs.create_group()
    hashes = store(client, keys, jpeg(6), jpeg(7))
    announce(client, keys, hashes)
    client.set(keys.encoding(hashes[1]), "encoder-other", px=5000)  # one an encoder is on
    published = service.published  # as the worker's own (same fingerprint)
    claims = published.take(hashes, "worker-1", 30.0)
    assert claims.taken == [hashes[0]] and claims.held == [hashes[1]] and not claims.free
    assert client.get(keys.encoding(hashes[0])) == b"worker-1"
    embeds, _ = service.encoder.encode([hashes[0]])
    published.publish(embeds, 60.0)
    client.delete(keys.encoding(hashes[1]))  # the other encoder died before it published
    service.run_once()
    assert service.items_found == 1 and service.recorder.items_encoded == 1  # only the other one
    assert service.published.exists(hashes) == set(hashes)
    service.client.close()


# ---- the service ---------------------------------------------------------------------------

def make_service(vision_dir, redis_url, keys, **config) -> EncoderService:
    return EncoderService(EncoderServiceConfig(model=str(vision_dir), redis_url=redis_url, key_prefix=keys.prefix,
                                               threads=1, read_block_ms=50, **config))


def test_the_service_publishes_what_a_worker_would_encode(vision_dir, redis_url, keys, client):
    service = make_service(vision_dir, redis_url, keys, batch=2)
    service.jobs.create_group()
    hashes = store(client, keys, jpeg(1), jpeg(2), jpeg(3))
    announce(client, keys, hashes[:2])
    announce(client, keys, hashes[1:])  # one medium in two jobs: encoded once
    assert service.run_once() == 2
    assert service.recorder.items_encoded == 3 and service.items_published == 3
    assert all(client.get(keys.encoding(h)) is None for h in hashes)  # nobody waits
    assert service.jobs.depth() == 0

    direct, failures = service.encoder.encode(hashes)  # the workers' own path
    published = service.published.fetch(hashes)
    assert not failures and all(torch.equal(published[h], direct[h]) for h in hashes)
    # and what transformers makes of the same files: the reference, not the encoder again
    expected = transformers_image_features(vision_dir, [jpeg(1), jpeg(2), jpeg(3)])
    for h, want in zip(hashes, expected):
        got = published[h].float()
        tol = 1e-5 if published[h].dtype == torch.float32 else 0.03
        assert got.shape == want.shape and (got - want).abs().max().item() <= tol * want.abs().max().item()
    assert not torch.allclose(expected[0], expected[1])  # the images differ, and so do their features
    embedder = ImageEmbedder(service.encoder, EncoderCache(2**20), service.published)
    assert embedder.published.fingerprint == service.published.fingerprint
    found = embedder.published.fetch(hashes)
    assert set(found) == set(hashes)

    announce(client, keys, hashes[:1])  # stored again by another gateway: found, not encoded
    service.run_once()
    assert service.recorder.items_encoded == 3 and service.items_found == 1
    assert client.get(keys.encoding(hashes[0])) is None
    service.client.close()


def test_a_dead_encoders_jobs_are_taken_over(vision_dir, redis_url, keys, client):
    service = make_service(vision_dir, redis_url, keys, claim_ttl_s=0.3)
    service.jobs.create_group()
    hashes = store(client, keys, jpeg(4))
    announce(client, keys, hashes)
    dead = EncodeJobStream(client, keys, "encoder-dead")
    assert len(dead.read(10, 50)) == 1  # read, never acknowledged: it died
    service._next_stale = time.monotonic() + 10  # not due yet: nothing new to read
    assert service.run_once() == 0 and service.recorder.items_encoded == 0
    time.sleep(0.35)
    service._next_stale = 0.0
    assert service.run_once() == 1
    assert service.items_published == 1 and service.jobs.depth() == 0
    service.client.close()


def test_media_that_cannot_be_had_are_given_up(vision_dir, redis_url, keys, client):
    service = make_service(vision_dir, redis_url, keys)
    service.jobs.create_group()
    (bad,) = store(client, keys, MediaItem("encoded", 2, 2, b"not an image", "image/png"))
    announce(client, keys, [bad, "f" * 64])  # undecodable; never stored
    service.run_once()
    assert service.items_failed == 2 and service.items_published == 0
    assert client.get(keys.encoding(bad)) is None and service.jobs.depth() == 0
    service.client.close()


def test_the_service_registers_serves_health_and_metrics(vision_dir, redis_url, keys, client):
    import json
    import urllib.request

    service = make_service(vision_dir, redis_url, keys, encoder_id="enc-t", metrics_port=free_port())
    stop = threading.Event()
    thread = threading.Thread(target=service.run, args=(stop,))
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while client.get(keys.encoder("enc-t")) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        registration = msgspec.msgpack.decode(client.get(keys.encoder("enc-t")), type=EncoderRegistration)
        assert registration.fingerprint == service.published.fingerprint and registration.metrics_address
        announce(client, keys, store(client, keys, jpeg(5)))
        while service.items_published < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        base = f"http://{registration.metrics_address}"
        health = json.loads(urllib.request.urlopen(f"{base}/health", timeout=5).read())
        assert health["status"] == "ok" and health["encoder"] == "enc-t"
        text = urllib.request.urlopen(f"{base}/metrics", timeout=5).read().decode()
        assert 'pagedserve:mm_items_encoded_total{encoder="enc-t"} 1.0' in text
        assert 'pagedserve:mm_embeddings_published_total{encoder="enc-t"} 1.0' in text
        assert 'pagedserve:encoder_queue_depth{encoder="enc-t"} 0.0' in text
    finally:
        stop.set()
        thread.join(timeout=15)
    assert client.get(keys.encoder("enc-t")) is None and b"enc-t" not in client.smembers(keys.encoders)


def test_a_text_checkpoint_has_nothing_to_encode(tiny_model_dir, redis_url, keys):
    with pytest.raises(ValueError, match="no vision tower"):
        make_service(tiny_model_dir, redis_url, keys)


def test_worker_metrics_count_queries_and_ready_embeddings():
    from proto.metrics import EncoderRecorder, StepCollector, StepRecorder

    encoder = EncoderRecorder()
    encoder.observe(1, 2, 0.1, published_hits=3, queries=6)
    registry = CollectorRegistry()
    registry.register(StepCollector("w", StepRecorder(), encoder))
    text = generate_latest(registry).decode()
    assert 'pagedserve:mm_cache_queries_total{worker="w"} 6.0' in text
    assert 'pagedserve:mm_cache_hits_total{worker="w"} 5.0' in text
    assert 'pagedserve:encoder_cache_hits_total{worker="w"} 2.0' in text


def test_announcements_during_the_first_registry_read_share_its_answer(redis_url, keys):
    async def main() -> list[bool]:
        aclient = aioredis.Redis.from_url(redis_url)
        try:
            registration = EncoderRegistration("e", "m", "fp", "float32", "cpu")
            await aclient.set(keys.encoder("e"), msgspec.msgpack.encode(registration), px=5000)
            await aclient.sadd(keys.encoders, "e")
            jobs = EncodeJobs(aclient, keys)
            return await asyncio.gather(*(jobs.announce([f"h{i}"]) for i in range(8)))
        finally:
            await aclient.aclose()

    assert asyncio.run(main()) == [True] * 8


def test_pan_and_scan_whole_images_from_the_service_crops_encoded_by_the_worker(vision_dir, redis_url, keys, client,
                                                                              tmp_path):
    """A checkpoint whose image processor turns pan-and-scan on: the service loads it and
    publishes whole images under their hashes (the gateway announces media, not crops); a
    worker takes a request's whole image from there and encodes its crops itself, each
    under its own key, never published as the image."""
    checkpoint = tmp_path / "pan-and-scan"
    shutil.copytree(vision_dir, checkpoint)
    processor = json.loads((checkpoint / "processor_config.json").read_text())
    processor["image_processor"].update(do_pan_and_scan=True, pan_and_scan_min_crop_size=8)
    (checkpoint / "processor_config.json").write_text(json.dumps(processor))
    service = make_service(checkpoint, redis_url, keys)
    service.jobs.create_group()
    (digest,) = store(client, keys, MediaItem("encoded", 96, 48, file_bytes(picture(9, 96, 48), "PNG"), "image/png"))
    announce(client, keys, [digest])
    assert service.run_once() == 1 and service.published.exists([digest]) == {digest}

    boxes = service.encoder.preprocess.pan_and_scan.boxes(48, 96)
    assert boxes == [CropBox(0, 0, 48, 48), CropBox(0, 48, 48, 48)]
    image_token, n = service.encoder.cfg.image_token_id, service.encoder.cfg.mm_tokens_per_image
    tokens = [2] + ([image_token] * n + [3]) * 3
    pieces = [MultiModalInput(digest, 1 + i * (n + 1), n, crop) for i, crop in enumerate((None, *boxes))]
    state = RequestState(worker_pb2.NewRequestData(request_id="r", token_ids=tokens, num_prompt_tokens=len(tokens),
                                                   mm_inputs=to_pb_mm_inputs(pieces)))
    embedder = ImageEmbedder(service.encoder, EncoderCache(2**20), service.published)
    assert embedder.check(state) is None
    images = embedder.prepare([(state, len(tokens))])
    assert not images.failed
    assert (images.stats.published_hits, images.stats.items_encoded, images.stats.queries) == (1, 2, 3)
    direct, _ = service.encoder.encode_pieces([m.piece for m in pieces])
    assert all(torch.equal(images.embeddings[m.embedding_key], direct[m.embedding_key]) for m in pieces)
    assert torch.equal(images.embeddings[digest], service.published.fetch([digest])[digest])
    assert not torch.equal(direct[digest], direct[ImagePiece(digest, boxes[0]).key])
    assert service.published.exists([m.embedding_key for m in pieces]) == {digest}  # crops stay the worker's
    service.client.close()
