"""Media by uuid through the gateway (gateway/media/uuids.py, vLLM's per-part `uuid`): a part
sent with data and a uuid, then a part with the uuid alone, make the same NewRequest (same
prompt, same content hashes, so the worker's encoder cache and the prefix cache hit) with
no second fetch or decode; an unknown or expired uuid is a 400 `media_not_found` at once;
the newest data under a uuid wins; uuids are per API key when the gateway has keys; a part
by uuid counts against --limit-mm-per-prompt. Tiny gemma3-vision checkpoint, real Redis,
a fake worker."""

from __future__ import annotations

import asyncio
import hashlib
import time

import pytest
import redis
import redis.asyncio as aioredis

import gateway.media.loader as loader_module
from compose.launcher import free_port
from gateway.errors import OpenAIError
from gateway.media.fetch import MediaFetcher
from gateway.media.loaded import MediaPart
from gateway.media.uuids import SHARED_SCOPE, MediaUUIDs, media_scope
from tests.support.gateway_helpers import MODEL, FakeWorker, gateway_client, make_config, register_worker, token_events
from tests.support.gateway_image_helpers import IMAGES, MAX_MODEL_LEN, MP4, config, image_part  # noqa: F401 (a fixture)
from tests.support.media_helpers import data_url
from proto.keys import RedisKeys
from proto.messages import NewRequest

pytestmark = pytest.mark.anyio


def ask(*parts: dict, question: str = "What is in front of the camera?") -> dict:
    return {"model": MODEL, "max_tokens": 1,
            "messages": [{"role": "user", "content": [{"type": "text", "text": question}, *parts]}]}


def sent(i: int, uuid: str) -> dict:
    """Image `i` with its data and a uuid."""
    return {**image_part(i), "uuid": uuid}


def by_uuid(uuid: str, kind: str = "image_url") -> dict:
    """The media sent before under `uuid`, without data (vLLM's shape: the data field null)."""
    return {"type": kind, kind: None, "uuid": uuid}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def post_all(config, *bodies: dict, headers: dict | None = None) -> tuple[list[NewRequest], list, str]:
    """Each body posted in turn to one gateway: the NewRequest each queued (None when
    refused), each response, and the gateway's /metrics at the end."""
    requests: list = []
    responses = []
    async with FakeWorker(config, lambda r: token_events(r.request_id, [40], "length")) as worker:
        async with gateway_client(config) as client:
            for body in bodies:
                response = await client.post("/v1/chat/completions", json=body, headers=headers or {})
                responses.append(response)
                if response.status_code == 200:  # (the stream may hold earlier tests' requests)
                    (request,) = [r for r in await worker.wait_for(NewRequest)
                                  if r.request_id == response.json()["id"]]
                    requests.append(request)
                else:
                    requests.append(None)
            metrics = (await client.get("/metrics")).text
    return requests, responses, metrics


async def refused(config, body: dict, code: str, *words: str, param: str) -> None:
    """`body` gets a 400 with `code` (`words` in its message, `param` named) and queues nothing."""
    stream = redis.Redis.from_url(config.redis_url)
    queued = stream.xlen(RedisKeys(config.key_prefix).requests)
    async with gateway_client(config) as client:
        response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == code and error["param"] == param, error
    for word in words:
        assert word in error["message"], error["message"]
    assert stream.xlen(RedisKeys(config.key_prefix).requests) == queued


def metric(text: str, name: str) -> float:
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.fixture
def loads(monkeypatch):
    """Counts of fetches and decodes by the gateway's loader."""
    counts = {"fetch": 0, "image": 0, "video": 0}
    fetch, check_image, decode_video = MediaFetcher.fetch, loader_module.check_image, loader_module.decode_video

    async def counting_fetch(self, *args, **kwargs):
        counts["fetch"] += 1
        return await fetch(self, *args, **kwargs)

    def counting(kind, real):
        def wrapped(*args, **kwargs):
            counts[kind] += 1
            return real(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(MediaFetcher, "fetch", counting_fetch)
    monkeypatch.setattr(loader_module, "check_image", counting("image", check_image))
    monkeypatch.setattr(loader_module, "decode_video", counting("video", decode_video))
    return counts


async def test_a_uuid_alone_is_the_image_sent_before_without_fetching_or_decoding(config, loads):
    keys, client = RedisKeys(config.key_prefix), redis.Redis.from_url(config.redis_url)
    (first, again), responses, metrics = await post_all(config, ask(sent(0, "cam0-frame-17")),
                                                        ask(by_uuid("cam0-frame-17")))
    assert [r.status_code for r in responses] == [200, 200]
    assert loads == {"fetch": 1, "image": 1, "video": 0}  # the second request fetched and decoded nothing
    assert [m.content_hash for m in again.mm_inputs] == [sha256(IMAGES[0])]
    assert again.mm_inputs == first.mm_inputs  # same placeholders, same hash: the encoder and prefix caches hit
    assert again.prompt_token_ids == first.prompt_token_ids
    assert metric(metrics, "pagedserve:mm_media_by_uuid_total") == 1
    assert metric(metrics, "pagedserve:mm_images_received_total") == 1
    # the record and the image live as long as the media (--media-ttl-s), and a use refreshes both
    record, item = keys.media_uuid(SHARED_SCOPE, "image", "cam0-frame-17"), keys.media(sha256(IMAGES[0]))
    assert 3_590_000 < client.pttl(record) <= 3_600_000 and 3_590_000 < client.pttl(item) <= 3_600_000
    client.pexpire(record, 5000)
    client.pexpire(item, 5000)
    (third,), _, _ = await post_all(config, ask({"type": "image_url", "uuid": "cam0-frame-17"}))  # absent: as null
    assert third.mm_inputs == first.mm_inputs
    assert client.pttl(record) > 3_590_000 and client.pttl(item) > 3_590_000
    assert loads["fetch"] == 1


async def test_a_video_by_uuid_is_its_frames_as_sampled_when_sent(config, loads):
    video = {"type": "video_url", "video_url": {"url": data_url(MP4, "video/mp4")}, "uuid": "clip-1"}
    first_body = {**ask(video), "media_io_kwargs": {"video": {"num_frames": 3}}}
    later_body = {**ask(by_uuid("clip-1", "video_url")), "media_io_kwargs": {"video": {"num_frames": 5}}}
    (first, again), _, _ = await post_all(config, first_body, later_body)
    assert loads["video"] == 1 and loads["fetch"] == 1
    assert len(first.mm_inputs) == 3 and again.mm_inputs == first.mm_inputs
    assert again.prompt_token_ids == first.prompt_token_ids  # the frames' timestamps too
    # image and video uuids are apart: an image part does not name the video
    await refused(config, ask(by_uuid("clip-1")), "media_not_found",
                  "No image is known by uuid 'clip-1'", param="messages[0].content[1].uuid")


async def test_an_unknown_uuid_is_a_400_at_once(config, loads):
    start = time.monotonic()
    await refused(config, ask(image_part(1), by_uuid("never-sent")), "media_not_found",
                  "uuid 'never-sent'", "Send it again", param="messages[0].content[2].uuid")
    assert time.monotonic() - start < 5
    assert loads["fetch"] == 0  # checked before the other parts are fetched


async def test_expired_media_are_a_400(vision_dir, redis_url):
    config = make_config(vision_dir, redis_url, request_timeout_s=5.0, media_ttl_s=0.5)
    register_worker(config, max_model_len=MAX_MODEL_LEN)
    (first,), _, _ = await post_all(config, ask(sent(2, "short-lived")))
    assert first is not None
    await asyncio.sleep(0.8)
    await refused(config, ask(by_uuid("short-lived")), "media_not_found",
                  "uuid 'short-lived'", "or it expired", param="messages[0].content[1].uuid")


async def test_a_record_whose_media_are_gone_is_a_400(config):
    await post_all(config, ask(sent(3, "evicted")))
    redis.Redis.from_url(config.redis_url).delete(RedisKeys(config.key_prefix).media(sha256(IMAGES[3])))
    await refused(config, ask(by_uuid("evicted")), "media_not_found",
                  "its media expired", param="messages[0].content[1].uuid")


async def test_the_newest_data_under_a_uuid_wins(config):
    (_, _, latest), _, _ = await post_all(config, ask(sent(0, "cam0")), ask(sent(1, "cam0")), ask(by_uuid("cam0")))
    assert [m.content_hash for m in latest.mm_inputs] == [sha256(IMAGES[1])]
    # within one request: a part by uuid is what a part with data under that uuid sent there
    (both,), _, _ = await post_all(config, ask(by_uuid("cam0"), sent(4, "cam0"), by_uuid("cam0")))
    assert [m.content_hash for m in both.mm_inputs] == [sha256(IMAGES[4])] * 3


async def test_a_part_by_uuid_counts_against_the_limit(vision_dir, redis_url, loads):
    config = make_config(vision_dir, redis_url, request_timeout_s=5.0, limit_mm_per_prompt='{"image": 1}')
    register_worker(config, max_model_len=MAX_MODEL_LEN)
    await post_all(config, ask(sent(0, "one")))
    await refused(config, ask(image_part(1), by_uuid("one")), "too_many_media_items",
                  "At most 1 image(s)", "has 2", param="messages[0].content[2].uuid")
    assert loads["fetch"] == 1


async def test_uuids_are_per_api_key(vision_dir, redis_url):
    config = make_config(vision_dir, redis_url, request_timeout_s=5.0, api_keys=("key-a", "key-b"))
    register_worker(config, max_model_len=MAX_MODEL_LEN)
    a, b = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
    (first,), _, _ = await post_all(config, ask(sent(0, "cam0")), headers=a)
    _, (foreign,), _ = await post_all(config, ask(by_uuid("cam0")), headers=b)  # b cannot name a's frame ...
    assert foreign.status_code == 400 and foreign.json()["error"]["code"] == "media_not_found"
    await post_all(config, ask(sent(5, "cam0")), headers=b)  # ... nor replace it
    (again,), _, _ = await post_all(config, ask(by_uuid("cam0")), headers=a)
    assert again.mm_inputs == first.mm_inputs
    assert media_scope("Bearer key-a", keyed=True) != media_scope("Bearer key-b", keyed=True)
    assert media_scope("Bearer key-a", keyed=False) == media_scope(None, keyed=False) == SHARED_SCOPE


async def test_an_unreachable_store_is_a_503():
    client = aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}")
    uuids = MediaUUIDs(client, RedisKeys("nowhere"), ttl_s=60)
    try:
        with pytest.raises(OpenAIError) as exc_info:
            await uuids.recall(SHARED_SCOPE, [MediaPart("image", None, "messages[0].content[0].uuid", uuid="u")])
        assert exc_info.value.status == 503 and exc_info.value.code == "redis_unavailable"
    finally:
        await client.aclose()
