"""Chat requests with images and video through the gateway (gateway/mm_prompt.py, preflight,
the content parts, the Responses API's input_image) on the tiny gemma3-vision checkpoint,
against the real Redis and a fake worker: the prompt's token ids equal what transformers'
AutoProcessor makes of the same messages, `mm_inputs` point at each image's soft tokens,
the NewRequest carries hashes and never pixels, a video is the prompt of its frames with
their timestamps (refusals: test_gateway_image_refusals.py)."""

from __future__ import annotations

import io

import pytest
import redis
from PIL import Image

from gateway.image_tokens import ImageTokens
from gateway.media.options import VideoSampling
from gateway.media.store import content_hash
from gateway.media.video import decode_video
from gateway.mm_prompt import frame_label
from tests.support.gateway_helpers import FakeWorker, gateway_client, make_config, register_worker, token_events
from tests.support.gateway_image_helpers import (IMAGES, MAX_MODEL_LEN, MP4, SOFT_PER_IMAGE, config, encoded,  # noqa: F401
                                                 image_part, refused, submitted)  # (config: a fixture)
from tests.support.media_helpers import data_url
from proto.keys import RedisKeys
from proto.messages import NewRequest, stream_encoder

pytestmark = pytest.mark.anyio


def reference_ids(processor, messages: list[dict], images: list[Image.Image]) -> list[int]:
    """What transformers makes of `messages` (HF's form: images as {"type": "image"})."""
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(processor(text=text, images=images or None, add_special_tokens=False)["input_ids"][0])


def pil(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data))


def assert_runs(request: NewRequest, tokens: ImageTokens, hashes: list[str]) -> None:
    """mm_inputs: one per image, in order, each over exactly its soft tokens."""
    ids = request.prompt_token_ids
    assert [m.content_hash for m in request.mm_inputs] == hashes
    assert ids.count(tokens.soft_id) == SOFT_PER_IMAGE * len(hashes)
    for m in request.mm_inputs:
        assert m.length == SOFT_PER_IMAGE
        assert ids[m.offset:m.offset + m.length] == [tokens.soft_id] * m.length
        assert ids[m.offset - 1] == tokens.boi_id and ids[m.offset + m.length] == tokens.eoi_id
    assert [m.offset for m in request.mm_inputs] == sorted(m.offset for m in request.mm_inputs)


def chat_and_reference(counts: list[int]) -> tuple[list[dict], list[dict], list[int]]:
    """A conversation whose user turns carry `counts` images (and text around them): the
    request's messages, transformers' messages, and the images' indices in order."""
    ours: list[dict] = [{"role": "system", "content": "You see pictures."}]
    theirs: list[dict] = [{"role": "system", "content": "You see pictures."}]
    order: list[int] = []
    for turn, count in enumerate(counts):
        if turn:
            ours.append({"role": "assistant", "content": f"Answer {turn}."})
            theirs.append({"role": "assistant", "content": f"Answer {turn}."})
        mine, hf = [{"type": "text", "text": f"Turn {turn}, look:"}], [{"type": "text", "text": f"Turn {turn}, look:"}]
        for _ in range(count):
            i = len(order)
            order.append(i)
            mine += [image_part(i), {"type": "text", "text": f"that was {i}"}]
            hf += [{"type": "image"}, {"type": "text", "text": f"that was {i}"}]
        ours.append({"role": "user", "content": mine})
        theirs.append({"role": "user", "content": hf})
    return ours, theirs, order


# ---- prompts equal transformers' --------------------------------------------------------


@pytest.mark.parametrize("counts", [[1], [2], [3, 5]], ids=["1 image", "2 images", "8 images in two turns"])
async def test_prompt_equals_the_processors(config, vision_dir, processor, counts):
    ours, theirs, order = chat_and_reference(counts)
    request, answer = await submitted(config, "/v1/chat/completions", {"messages": ours})
    assert request.prompt_token_ids == reference_ids(processor, theirs, [pil(IMAGES[i]) for i in order])
    tokens = ImageTokens.read(vision_dir, processor.tokenizer)
    hashes = [content_hash_of_file(IMAGES[i]) for i in order]
    assert_runs(request, tokens, hashes)
    assert answer["usage"]["prompt_tokens"] == len(request.prompt_token_ids)
    # Hashes, never pixels: the stream entry is small and holds none of the files, which
    # wait in Redis under their hashes for the worker.
    entry = stream_encoder.encode(request)
    assert len(entry) < 8 * len(request.prompt_token_ids) + 2048
    assert not any(IMAGES[i][-64:] in entry for i in order)
    client = redis.Redis.from_url(config.redis_url)
    keys = RedisKeys(config.key_prefix)
    assert all(client.exists(keys.media(h)) for h in hashes)


def content_hash_of_file(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


async def test_text_only_request_on_a_vision_model_is_the_text_path(config, processor):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Just"}, {"type": "text", "text": "text"}]}]
    request, _ = await submitted(config, "/v1/chat/completions", {"messages": messages})
    assert request.mm_inputs == ()
    assert request.prompt_token_ids == reference_ids(processor, [{"role": "user", "content": "Just\ntext"}], [])


async def test_a_video_is_the_prompt_of_its_frames_with_their_timestamps(config, vision_dir, processor):
    """A video, and its kept frames sent as images after the same "Frame at MM:SS.ss:" texts,
    make one prompt; transformers' processor makes it too from those texts and frames."""
    sampling = {"video": {"num_frames": 4}}  # this request's, over the server's 32
    video_messages = [{"role": "user", "content": [
        {"type": "text", "text": "What moves?"},
        {"type": "video_url", "video_url": {"url": data_url(MP4, "video/mp4")}},
        {"type": "text", "text": "Say it briefly."}]}]
    request, _ = await submitted(config, "/v1/chat/completions",
                                 {"messages": video_messages, "media_io_kwargs": sampling})
    frames = decode_video(MP4, sampling=VideoSampling(num_frames=4), max_pixels=2**25, max_frames=9000,
                          param="").frames
    assert [frame_label(f.timestamp_s) for f in frames] == [
        "Frame at 00:00.00:", "Frame at 00:00.60:", "Frame at 00:01.20:", "Frame at 00:01.90:"]
    pngs = [encoded(Image.frombytes("RGB", (f.width, f.height), f.rgb)) for f in frames]
    as_images: list[dict] = [{"type": "text", "text": "What moves?"}]
    hf: list[dict] = [{"type": "text", "text": "What moves?"}]
    for frame, png in zip(frames, pngs):
        as_images += [{"type": "text", "text": frame_label(frame.timestamp_s)},
                      {"type": "image_url", "image_url": {"url": data_url(png)}}]
        hf += [{"type": "text", "text": frame_label(frame.timestamp_s)}, {"type": "image"}]
    as_images.append({"type": "text", "text": "Say it briefly."})
    hf.append({"type": "text", "text": "Say it briefly."})
    frames_request, _ = await submitted(config, "/v1/chat/completions",
                                        {"messages": [{"role": "user", "content": as_images}]})
    assert request.prompt_token_ids == frames_request.prompt_token_ids
    assert request.prompt_token_ids == reference_ids(processor, [{"role": "user", "content": hf}],
                                                     [pil(p) for p in pngs])
    tokens = ImageTokens.read(vision_dir, processor.tokenizer)
    assert_runs(request, tokens, [content_hash(f.item()) for f in frames])  # the frames, stored raw
    assert_runs(frames_request, tokens, [content_hash_of_file(p) for p in pngs])


async def test_responses_input_image_reaches_the_same_prompt(config):
    chat, _ = await submitted(config, "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Describe"}, image_part(0), image_part(3)]}]})
    response, answer = await submitted(config, "/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "Describe"},
        {"type": "input_image", "image_url": data_url(IMAGES[0]), "detail": "auto"},
        {"type": "input_image", "image_url": data_url(IMAGES[3])}]}]})
    assert answer["object"] == "response" and answer["status"] == "incomplete"
    assert response.prompt_token_ids == chat.prompt_token_ids
    assert response.mm_inputs == chat.mm_inputs


async def test_context_length_counts_image_tokens(vision_dir, redis_url):
    """20 tokens more fit in a context of 40 after the text (14 tokens), not after the text
    and two images (each 4 soft tokens, its two markers and newlines around them)."""
    config = make_config(vision_dir, redis_url)
    register_worker(config, max_model_len=40)
    with_images = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "See"}, image_part(0), image_part(1)]}], "max_tokens": 20}
    await refused(config, "/v1/chat/completions", with_images, "context_length_exceeded",
                  "maximum context length is 40 tokens", param="messages")
    text_only = {"messages": [{"role": "user", "content": "See"}], "max_tokens": 20}
    request, _ = await submitted(config, "/v1/chat/completions", text_only)
    assert len(request.prompt_token_ids) + 20 <= 40


async def test_metrics_count_images_frames_and_bytes(config):
    body = {"messages": [{"role": "user", "content": [
        image_part(0), image_part(1), {"type": "video_url", "video_url": {"url": data_url(MP4, "video/mp4")}}]}],
        "media_io_kwargs": {"video": {"num_frames": 3}}}
    async with FakeWorker(config, lambda r: token_events(r.request_id, [40], "length")):
        async with gateway_client(config) as client:
            assert (await client.post("/v1/chat/completions", json={"max_tokens": 1, **body})).status_code == 200
            text = (await client.get("/metrics")).text
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("pagedserve:mm_")}
    assert values["pagedserve:mm_images_received_total"] == 2
    assert values["pagedserve:mm_videos_received_total"] == 1
    assert values["pagedserve:mm_video_frames_received_total"] == 3
    # this config's own key prefix: every item is new to it
    assert (values["pagedserve:mm_items_stored_total"], values["pagedserve:mm_items_reused_total"]) == (5, 0)
    assert values["pagedserve:mm_stored_bytes_total"] > len(IMAGES[0]) + len(IMAGES[1]) + 3 * 64 * 48 * 3


async def test_openapi_publishes_the_content_parts(config):
    async with gateway_client(config) as client:
        schemas = (await client.get("/openapi.json")).json()["components"]["schemas"]
    content = schemas["ChatMessage"]["properties"]["content"]
    assert {"$ref": "#/components/schemas/ImageURLPart"} in content["anyOf"][1]["items"]["oneOf"]
    assert schemas["ImageURLPart"]["properties"]["type"]["const"] == "image_url"
    assert set(schemas["ImageURL"]["properties"]["detail"]["anyOf"][0]["enum"]) == {"auto", "low", "high"}
    # data, or (null or absent) the media sent before under a uuid: one or the other at least
    assert schemas["VideoURLPart"]["properties"]["video_url"]["anyOf"] == [
        {"$ref": "#/components/schemas/VideoURL"}, {"type": "null"}]
    for part, data in (("ImageURLPart", "image_url"), ("VideoURLPart", "video_url")):
        assert schemas[part]["required"] == ["type"]
        assert schemas[part]["properties"]["uuid"]["anyOf"] == [{"type": "string"}, {"type": "null"}]
        assert schemas[part]["anyOf"] == [{"properties": {data: {"not": {"type": "null"}}}, "required": [data]},
                                          {"properties": {"uuid": {"type": "string"}}, "required": ["uuid"]}]


