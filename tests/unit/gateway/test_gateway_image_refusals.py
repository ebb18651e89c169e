"""Chat and Responses requests with images or video that the gateway refuses: every bad
input is an OpenAI-style 400 naming the problem and the part, before anything is queued
(the requests stream stays empty) -- on the tiny gemma3-vision checkpoint, a text model, the
in-process engine, and /tokenize."""

from __future__ import annotations

import pytest
import redis
from PIL import Image

from gateway.app import create_app
from tests.support.gateway_helpers import MODEL, gateway_client, make_config, register_worker
from tests.support.gateway_image_helpers import IMAGES, MAX_MODEL_LEN, MP4, config, encoded, image_part, refused  # noqa: F401  (config: a fixture)
from tests.support.media_helpers import data_url

pytestmark = pytest.mark.anyio


# ---- refusals -------------------------------------------------------------------------


def user(*parts: dict) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "Look"}, *parts]}]}


STRIP = encoded(Image.new("RGB", (1000, 1), (9, 9, 9)))  # 1000 one-pixel crops at most
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
    (user({"type": "image_url", "image_url": None}),  # neither data nor a uuid naming media sent before
     "invalid_value", ["needs 'image_url'", "'uuid'"], "messages[0].content[1]"),
    (user({"type": "video_url", "uuid": None}), "invalid_value", ["needs 'video_url'"], "messages[0].content[1]"),
    (user({"type": "image_url", "image_url": None, "uuid": "never-sent"}),
     "media_not_found", ["uuid 'never-sent'", "Send it again"], "messages[0].content[1].uuid"),
    (user({"type": "image_url", "image_url": {"url": "x", "detail": "max"}}),
     "invalid_value", ["'auto', 'low' or 'high'"], "messages[0].content[1].image_url.detail"),
    (user({"type": "input_audio", "input_audio": {}}),
     "invalid_value", ["type 'input_audio'", "'image_url' or 'video_url'"], "messages[0].content"),
    ({"messages": [{"role": "system", "content": [image_part(0)]}, {"role": "user", "content": "hi"}]},
     "invalid_value", ["only 'user' turns may carry image_url or video_url parts", "is 'system'"], "messages[0]"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [VIDEO]}]},
     "invalid_value", ["this one is 'assistant'"], "messages[1]"),
    ({**user(image_part(0)), "mm_processor_kwargs": {"do_pan_and_scan": 1}},
     "invalid_value", ["'do_pan_and_scan' must be true or false, not 1"], "mm_processor_kwargs"),
    ({**user(image_part(0)), "mm_processor_kwargs": {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 0}},
     "invalid_value", ["'pan_and_scan_min_crop_size' must be an integer of at least 1, not 0"], "mm_processor_kwargs"),
    ({**user(image_part(0)), "mm_processor_kwargs": {"pan_and_scan_max_num_crops": 2.5}},
     "invalid_value", ["'pan_and_scan_max_num_crops' must be an integer of at least 1, not 2.5"],
     "mm_processor_kwargs"),
    ({**user(image_part(0)), "mm_processor_kwargs": {"pan_and_scan_min_ratio_to_activate": -1}},
     "invalid_value", ["'pan_and_scan_min_ratio_to_activate' must be a finite number above 0, not -1"],
     "mm_processor_kwargs"),
    # no float holds it
    ({**user(image_part(0)), "mm_processor_kwargs": {"pan_and_scan_min_ratio_to_activate": 10**400}},
     "invalid_value", ["'pan_and_scan_min_ratio_to_activate' must be a finite number above 0"],
     "mm_processor_kwargs"),
    ({**user(image_part(0)), "mm_processor_kwargs": {"do_pan_and_scan": True, "pan_and_scan_crops": 3}},
     "invalid_value", ["'pan_and_scan_crops' is not a processor setting", "'pan_and_scan_max_num_crops'"],
     "mm_processor_kwargs"),
    ({**user(image_part(0)), "mm_processor_kwargs": {"num_crops": 3}},
     "invalid_value", ["'num_crops' is not a processor setting"], "mm_processor_kwargs"),
    ({**user({"type": "image_url", "image_url": {"url": data_url(STRIP)}}),
      "mm_processor_kwargs": {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 1,
                              "pan_and_scan_max_num_crops": 1000}},
     "context_length_exceeded", ["maximum context length is 512", "1000 of them pan-and-scan crops"], "messages"),
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
        "no url", "no data nor uuid", "no video nor uuid", "unknown uuid", "bad detail", "audio part", "system image",
        "assistant video",
        "pan and scan not a bool", "min crop 0", "max crops not whole", "ratio negative", "ratio past any float",
        "unknown pan_and_scan_ key",
        "unknown key", "too many crops",
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
    ({"type": "input_image", "file_id": "file-123"}, "file_not_found",  # no such upload (test_gateway_files.py)
     ["'file-123'", "/v1/files"], "input[0].content[1].file_id"),
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
