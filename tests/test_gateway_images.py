"""Chat requests with images and video through the gateway (gateway/mm_prompt.py, preflight,
the content parts, the Responses API's input_image) on the tiny gemma3-vision checkpoint,
against the real Redis and a fake worker: the prompt's token ids equal what transformers'
AutoProcessor makes of the same messages, `mm_inputs` point at each image's soft tokens,
the NewRequest carries hashes and never pixels, a video is the prompt of its frames with
their timestamps, and every bad input is a 400 before anything is queued."""

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
from gateway.app import create_app
from gateway_helpers import MODEL, FakeWorker, gateway_client, make_config, register_worker, token_events
from media_helpers import data_url, make_video
from proto.keys import RedisKeys
from proto.messages import NewRequest, stream_encoder

pytestmark = pytest.mark.anyio

MAX_MODEL_LEN = 512
SOFT_PER_IMAGE = 4  # the tiny preset's mm_tokens_per_image


# ---- media made here ---------------------------------------------------------------------


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, fmt)
    return out.getvalue()


# PNG, JPEG, RGBA, grayscale, palette; odd sizes and aspect ratios
IMAGES = [encoded(Image.new("RGB", (33, 17), (200, 30, 40))),
          encoded(Image.new("RGB", (64, 48), (10, 120, 240)), "JPEG"),
          encoded(Image.new("RGBA", (20, 70), (0, 255, 0, 128))),
          encoded(Image.new("L", (41, 41), 99)),
          encoded(Image.new("P", (90, 11), 3)),
          encoded(Image.new("RGB", (5, 5), (1, 2, 3))),
          encoded(Image.new("RGB", (128, 9), (250, 250, 0)), "JPEG"),
          encoded(Image.new("RGB", (12, 100), (0, 0, 0)))]
MIMES = ["image/png", "image/jpeg", "image/png", "image/png", "image/png", "image/png", "image/jpeg", "image/png"]


def image_part(i: int) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(IMAGES[i], MIMES[i]), "detail": "low"}}


MP4 = make_video()


# ---- fixtures ---------------------------------------------------------------------------


@pytest.fixture
def config(vision_dir, redis_url):
    config = make_config(vision_dir, redis_url, request_timeout_s=5.0)
    register_worker(config, max_model_len=MAX_MODEL_LEN)
    return config


def reference_ids(processor, messages: list[dict], images: list[Image.Image]) -> list[int]:
    """What transformers makes of `messages` (HF's form: images as {"type": "image"})."""
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(processor(text=text, images=images or None, add_special_tokens=False)["input_ids"][0])


def pil(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data))


def with_budget(path: str, body: dict) -> dict:
    """`body` for `path` with the served model and a one-token budget, as that API names it."""
    budget = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
    return {"model": MODEL, budget: 1, **body}


async def submitted(config, path: str, body: dict) -> tuple[NewRequest, dict]:
    """The NewRequest the gateway queues for `body`, and its answer (one token)."""
    async with FakeWorker(config, lambda r: token_events(r.request_id, [40], "length")) as worker:
        async with gateway_client(config) as client:
            response = await client.post(path, json=with_budget(path, body))
            assert response.status_code == 200, response.text
            request = (await worker.wait_for(NewRequest))[-1]  # the stream may hold earlier ones
    return request, response.json()


async def refused(config, path: str, body: dict, code: str | None, *words: str, param: str | None = None) -> None:
    """`body` gets a 400 with `code` (and `words` in its message, `param` named), and nothing
    reaches the requests stream."""
    async with gateway_client(config) as client:
        response = await client.post(path, json=with_budget(path, body))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == code, error
    for word in words:
        assert word in error["message"], error["message"]
    if param is not None:
        assert error["param"] == param, error
    assert redis.Redis.from_url(config.redis_url).xlen(RedisKeys(config.key_prefix).requests) == 0


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
        {"type": "text", "text": "What moves?"}, {"type": "video_url", "video_url": {"url": data_url(MP4, "video/mp4")}},
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
    assert schemas["VideoURLPart"]["properties"]["video_url"] == {"$ref": "#/components/schemas/VideoURL"}


# ---- refusals -------------------------------------------------------------------------


def user(*parts: dict) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "Look"}, *parts]}]}


VIDEO = {"type": "video_url", "video_url": {"url": data_url(MP4, "video/mp4")}}
URL0 = "messages[0].content[1].image_url.url"


@pytest.mark.parametrize("body, code, words, param", [
    (user({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@not base64@@"}}),
     "invalid_base64", ["not valid base64"], URL0),
    (user({"type": "image_url", "image_url": {"url": data_url(b"no image here" * 9)}}),
     "invalid_image", ["not a valid image"], URL0),
    (user({"type": "image_url", "image_url": {"url": data_url(IMAGES[0][:60])}}),
     "invalid_image", ["truncated or corrupt"], URL0),
    (user({"type": "image_url", "image_url": {"url": "/etc/hostname"}}),
     "local_media_not_allowed", ["reads no local files"], URL0),
    (user({"type": "video_url", "video_url": {"url": data_url(b"not a video" * 40, "video/mp4")}}),
     "invalid_video", ["could not be decoded"], "messages[0].content[1].video_url.url"),
    (user(*[image_part(i % 8) for i in range(9)]),
     "too_many_media_items", ["At most 8 image(s)", "has 9"], "messages[0].content[9].image_url.url"),
    (user(VIDEO, VIDEO), "too_many_media_items", ["At most 1 video(s)"], "messages[0].content[2].video_url.url"),
    (user(image_part(0), {"type": "image_url", "image_url": {}}),
     "missing_required_parameter", ["messages[0].content[2].image_url.url"], "messages[0].content[2].image_url.url"),
    (user({"type": "image_url", "image_url": {"url": "x", "detail": "max"}}),
     "invalid_value", ["'auto', 'low' or 'high'"], "messages[0].content[1].image_url.detail"),
    (user({"type": "input_audio", "input_audio": {}}),
     "invalid_value", ["type 'input_audio'", "'image_url' or 'video_url'"], "messages[0].content"),
    ({"messages": [{"role": "system", "content": [image_part(0)]}, {"role": "user", "content": "hi"}]},
     "invalid_value", ["only 'user' turns may carry image_url or video_url parts", "is 'system'"], "messages[0]"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [VIDEO]}]},
     "invalid_value", ["this one is 'assistant'"], "messages[1]"),
    ({**user(image_part(0)), "mm_processor_kwargs": {"do_pan_and_scan": True}},
     "invalid_value", ["pan-and-scan", "not supported"], "mm_processor_kwargs"),
    ({**user(VIDEO), "media_io_kwargs": {"video": {"num_frames": 0}}},
     "invalid_value", ["num_frames must be a positive number"], "media_io_kwargs"),
    ({**user(image_part(0)), "truncate_prompt_tokens": 5},
     "unsupported_parameter", ["cut through an image"], "truncate_prompt_tokens"),
    (user(image_part(0), {"type": "text", "text": "<start_of_image>"}),
     "invalid_image_tokens", ["2 image placeholders", "for 1 images"], "messages"),
    (user(image_part(0), {"type": "text", "text": "<image_soft_token>"}),
     "invalid_image_tokens", ["soft tokens"], "messages"),
    ({"messages": [{"role": "user", "content": "a <image_soft_token> without an image"}]},
     "invalid_image_tokens", ["image soft token"], "messages"),
], ids=["bad base64", "not an image", "truncated image", "local file", "bad video", "9 images", "2 videos",
        "no url", "bad detail", "audio part", "system image", "assistant video", "pan and scan",
        "bad sampling", "truncation", "typed start_of_image", "typed soft token", "soft token in text"])
async def test_bad_chat_input_is_refused_before_queueing(config, body, code, words, param):
    await refused(config, "/v1/chat/completions", body, code, *words, param=param)


async def test_a_chat_template_that_drops_images_is_refused(vision_dir, redis_url):
    text_only = ("{{ bos_token }}{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}"
                 "{% else %}{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }}{% endif %}"
                 "{% endfor %}{% endif %}{% endfor %}")
    config = make_config(vision_dir, redis_url, chat_template=text_only)
    register_worker(config, max_model_len=MAX_MODEL_LEN)
    await refused(config, "/v1/chat/completions", user(image_part(0), image_part(1)), "chat_template_dropped_images",
                  "placed 0 of the 2 images", param="messages")


async def test_limits_and_nothing_stored_for_a_request_over_them(vision_dir, redis_url):
    config = make_config(vision_dir, redis_url, limit_mm_per_prompt='{"image": 2, "video": 0}')
    register_worker(config, max_model_len=MAX_MODEL_LEN)
    await refused(config, "/v1/chat/completions", user(image_part(0), image_part(1), image_part(2)),
                  "too_many_media_items", "At most 2 image(s)", "has 3", param="messages[0].content[3].image_url.url")
    await refused(config, "/v1/chat/completions", user(VIDEO), "too_many_media_items",
                  "does not accept video input")
    client = redis.Redis.from_url(config.redis_url)
    assert not list(client.scan_iter(f"{config.key_prefix}:media:*"))


async def test_completions_token_ids_cannot_carry_soft_tokens(config, processor):
    soft = processor.tokenizer.convert_tokens_to_ids("<image_soft_token>")
    await refused(config, "/v1/completions", {"prompt": [2, 40, soft, 41]}, "invalid_image_tokens", param="prompt")


@pytest.mark.parametrize("part, code, words, param", [
    ({"type": "input_image", "file_id": "file-123"}, "unsupported_parameter",
     ["'file_id' is not supported yet", "image_url"], "input[0].content[1].file_id"),
    ({"type": "input_image"}, "missing_required_parameter", ["needs 'image_url'"], "input[0].content[1].image_url"),
    ({"type": "input_file", "file_id": "f"}, None, ["only input_text and input_image parts"], "input[0].content"),
])
async def test_responses_refusals(config, part, code, words, param):
    body = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "x"}, part]}]}
    await refused(config, "/v1/responses", body, code, *words, param=param)


@pytest.mark.parametrize("instructions", [None, "Be brief."])
async def test_responses_errors_name_the_input_item(config, instructions):
    """A chat error about a message is named at the input item it came from (the system
    message of `instructions` comes first in chat, not in `input`)."""
    body = {"instructions": instructions, "input": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
        {"role": "user", "content": [{"type": "input_text", "text": "and"},
                                     {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]}
    await refused(config, "/v1/responses", body, "invalid_image", "not a valid image",
                  param="input[2].content[1].image_url")
    body["input"][0]["content"] = [{"type": "input_image", "image_url": data_url(IMAGES[0])}]
    body["input"][0]["role"] = "developer"
    await refused(config, "/v1/responses", body, "invalid_value", "only 'user' turns", param="input[0]")


@pytest.mark.parametrize("part, what", [(image_part(0), "images"), (VIDEO, "video")])
async def test_a_text_model_refuses_media(tiny_model_dir, redis_url, part, what):
    config = make_config(tiny_model_dir, redis_url)
    register_worker(config)
    await refused(config, "/v1/chat/completions", user(part), "model_not_multimodal",
                  f"The model '{MODEL}' does not accept {what}", param="messages[0].content")


async def test_tokenize_refuses_media(config):
    async with gateway_client(config) as client:
        response = await client.post("/tokenize", json=user(image_part(0)))
    assert response.status_code == 400 and response.json()["error"]["code"] == "unsupported_content_part"


class NoRedisBackend:
    """What `pagedserve engine` gives the gateway in place of Redis (compose/inprocess_backend.py):
    a backend that is not a RedisBackend; media are refused before it is asked anything."""

    reply_channel = "in-process"

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


async def test_the_in_process_engine_refuses_media_pointing_at_the_stack(vision_dir):
    import httpx

    config = make_config(vision_dir, "redis://127.0.0.1:1/0")
    app = create_app(config, backend_factory=NoRedisBackend)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine") as client:
            response = await client.post("/v1/chat/completions", json={"model": MODEL, **user(VIDEO)})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "media_not_supported" and error["param"] == "messages[0].content"
    assert "pagedserve engine" in error["message"] and "`pagedserve up`" in error["message"]
