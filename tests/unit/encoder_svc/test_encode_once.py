"""A medium queued for the encoder service is encoded by exactly one party, however the
worker that needs it and the encoder that took its job interleave (real redis-server, the
tiny Gemma 3 vision checkpoint; the interleavings driven step by step, no timing luck):

* the encoder holds the claim and is encoding when the worker's step needs the medium:
  the worker waits for the published embeddings instead of encoding it a second time
  (the race of issue 46: 8 of 506 frames at overload were encoded twice);
* the worker took the medium over and published it after the encoder had looked for it:
  the encoder's claim is refused, it encodes nothing;
* nothing lost: an encoder that gives its claim up, or dies holding it, leaves the medium
  to the worker, which encodes it then (bounded wait)."""

from __future__ import annotations

import threading
import time
import uuid

import msgspec
import pytest
import redis
import torch
from tests.support.media_helpers import file_bytes, picture

from encoder_svc.config import EncoderServiceConfig
from encoder_svc.service import EncoderService
from gateway.media.store import content_hash
from proto import worker_pb2
from proto.encoder_messages import QUEUED, EncodeJob, job_encoder
from proto.keys import STREAM_FIELD, RedisKeys
from proto.messages import MediaItem
from vision.encoder_cache import EncoderCache
from vision.media_encoder import MediaEncoder
from worker_svc.request_state import RequestState
from worker_svc.vision_step import ImageEmbedder


@pytest.fixture
def keys() -> RedisKeys:
    return RedisKeys(f"test-once-{uuid.uuid4().hex[:8]}")


@pytest.fixture
def service(vision_dir, redis_url, keys):
    s = EncoderService(EncoderServiceConfig(model=str(vision_dir), redis_url=redis_url, key_prefix=keys.prefix,
                                            threads=1, read_block_ms=50, encoder_id="encoder-a"))
    s.jobs.create_group()
    yield s
    s.client.close()


class Counted:
    """A MediaEncoder whose encode_pieces() (what encode() and the worker's steps call) counts
    the media it encodes and may hold, once entered, until `go` is set (an encoder caught
    mid-encoding)."""

    def __init__(self, encoder: MediaEncoder, hold: bool = False):
        self.inner = encoder
        self.encoded: list[str] = []
        self.entered, self.go = threading.Event(), threading.Event()
        if not hold:
            self.go.set()
        self._encode = encoder.encode_pieces
        encoder.encode_pieces = self.encode_pieces  # the instance's own attribute: the service calls it

    def encode_pieces(self, pieces):
        self.entered.set()
        self.go.wait(30)
        self.encoded.extend(p.key for p in pieces)
        return self._encode(pieces)


def stored_frame(client: redis.Redis, keys: RedisKeys, seed: int) -> str:
    image = picture(seed, 64, 48)
    item = MediaItem("encoded", image.width, image.height, file_bytes(image, "JPEG"), "image/jpeg")
    digest = content_hash(item)
    client.set(keys.media(digest), msgspec.msgpack.encode(item), px=60_000)
    return digest


def announce(client: redis.Redis, keys: RedisKeys, digest: str) -> None:
    """What a gateway writes for a medium it stored (gateway/media/encode_jobs.py)."""
    client.set(keys.encoding(digest), QUEUED, nx=True, px=60_000)
    client.xadd(keys.encode_jobs, {STREAM_FIELD: job_encoder.encode(EncodeJob((digest,)))})


def worker_embedder(service: EncoderService, vision_dir) -> tuple[ImageEmbedder, Counted]:
    """A worker's ImageEmbedder reading the service's published embeddings (same fingerprint),
    with its own encoder, counted."""
    own = MediaEncoder.load(vision_dir, service.encoder.cfg, service.encoder.encoder.dtype,
                            service.encoder.device, service.media)
    counted = Counted(own)
    return ImageEmbedder(own, EncoderCache(2**22), service.published), counted


def needing(embedder: ImageEmbedder, *digests: str) -> list[tuple[RequestState, int]]:
    """One scheduled prefill chunk holding an image of each of `digests`."""
    cfg = embedder.cfg
    n = cfg.mm_tokens_per_image
    tokens = [2]
    inputs = []
    for digest in digests:
        inputs.append(worker_pb2.MultiModalInput(content_hash=digest, offset=len(tokens), length=n))
        tokens += [cfg.image_token_id] * n + [5]
    new = worker_pb2.NewRequestData(request_id="r", token_ids=tokens, num_prompt_tokens=len(tokens),
                                    block_ids=[0], mm_inputs=inputs)
    return [(RequestState(new), len(tokens))]


def test_a_worker_waits_for_the_encoder_that_is_encoding_its_frame(service, vision_dir, client, keys):
    digest = stored_frame(client, keys, 11)
    announce(client, keys, digest)
    encoder = Counted(service.encoder, hold=True)
    encoding = threading.Thread(target=service.run_once)
    encoding.start()  # the encoder reads the job, claims the frame, and is caught encoding it
    assert encoder.entered.wait(30)
    embedder, worker = worker_embedder(service, vision_dir)
    out: list = []
    step = threading.Thread(target=lambda: out.append(embedder.prepare(needing(embedder, digest))))
    step.start()  # the scheduler routed the request (the frame only looked QUEUED a moment ago)
    step.join(timeout=3)  # a worker that does not wait is done by now, having encoded it too
    encoder.go.set()
    encoding.join(timeout=30)
    step.join(timeout=30)
    assert not step.is_alive()
    (images,) = out
    assert encoder.encoded == [digest] and worker.encoded == []  # once in all
    assert not images.failed and images.stats.items_encoded == 0 and images.stats.published_hits == 1
    assert torch.equal(images.embeddings[digest], service.published.fetch([digest])[digest])


def test_an_encoder_does_not_encode_what_a_worker_took_over_and_published(service, vision_dir, client, keys,
                                                                           monkeypatch):
    digest = stored_frame(client, keys, 12)
    announce(client, keys, digest)
    encoder = Counted(service.encoder)
    embedder, worker = worker_embedder(service, vision_dir)
    looked = service.published.exists([digest])  # the encoder looks first: nothing published yet
    images = embedder.prepare(needing(embedder, digest))  # the worker takes it over, encodes, publishes
    assert worker.encoded == [digest] and images.stats.items_encoded == 1
    monkeypatch.setattr(service.published, "exists", lambda hashes: looked)  # what it saw before
    service.encode([digest])
    assert encoder.encoded == []  # its claim is refused: the embeddings are published
    assert service.recorder.items_encoded == 0
    assert client.exists(keys.embeddings(service.published.fingerprint, digest))


def test_a_frame_whose_encoder_gave_up_is_encoded_by_the_worker(service, vision_dir, client, keys):
    digest = stored_frame(client, keys, 13)
    client.set(keys.encoding(digest), "encoder-b", px=60_000)  # an encoder on it ...
    embedder, worker = worker_embedder(service, vision_dir)
    gives_up = threading.Timer(0.2, lambda: client.delete(keys.encoding(digest)))  # ... fails and lets go
    gives_up.start()
    began = time.monotonic()
    images = embedder.prepare(needing(embedder, digest))
    gives_up.join()
    assert worker.encoded == [digest] and not images.failed and time.monotonic() - began < 5
    assert service.published.exists([digest]) == {digest}  # it took the claim: it published


def test_a_frame_whose_encoder_died_is_encoded_by_the_worker_after_the_claim_ran_out(
        service, vision_dir, client, keys):
    digest = stored_frame(client, keys, 14)
    client.set(keys.encoding(digest), "encoder-dead", px=300)  # its claim's TTL runs out
    embedder, worker = worker_embedder(service, vision_dir)
    images = embedder.prepare(needing(embedder, digest))
    assert worker.encoded == [digest] and not images.failed


def test_the_worker_waits_a_bounded_time_for_a_claim_that_never_goes(service, vision_dir, client, keys):
    digest = stored_frame(client, keys, 15)
    client.set(keys.encoding(digest), "encoder-stuck", px=60_000)
    embedder, worker = worker_embedder(service, vision_dir)
    embedder.held_wait_s = 0.3
    began = time.monotonic()
    images = embedder.prepare(needing(embedder, digest))
    assert worker.encoded == [digest] and not images.failed and 0.3 <= time.monotonic() - began < 5


def test_two_workers_each_holding_a_frame_the_other_needs_do_not_stall(service, vision_dir, client, keys):
    x, y = stored_frame(client, keys, 16), stored_frame(client, keys, 17)
    (a, counted_a), (b, counted_b) = worker_embedder(service, vision_dir), worker_embedder(service, vision_dir)
    client.set(keys.encoding(x), a.owner, px=60_000)  # each took one over in an earlier look
    client.set(keys.encoding(y), b.owner, px=60_000)
    out: dict[str, object] = {}
    steps = [threading.Thread(target=lambda e=e, k=k: out.update({k: e.prepare(needing(e, x, y))}))
             for e, k in ((a, "a"), (b, "b"))]
    began = time.monotonic()
    for step in steps:
        step.start()
    for step in steps:
        step.join(timeout=30)
    assert time.monotonic() - began < 5  # each encodes its own first, then finds the other's published
    assert counted_a.encoded == [x] and counted_b.encoded == [y]
    assert all(set(images.embeddings) == {x, y} and not images.failed for images in out.values())
