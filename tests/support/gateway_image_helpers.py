"""Chat requests with images for the gateway's tests (test_gateway_images.py,
test_gateway_image_refusals.py): images of each kind and odd sizes, a video, the gateway
on the tiny gemma3-vision checkpoint with the real Redis, what it queues, what it refuses."""

from __future__ import annotations

import io

import pytest
import redis
from PIL import Image

from tests.support.gateway_helpers import MODEL, FakeWorker, gateway_client, make_config, register_worker, token_events
from tests.support.media_helpers import data_url, make_video
from proto.keys import RedisKeys
from proto.messages import NewRequest

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


@pytest.fixture
def config(vision_dir, redis_url):
    config = make_config(vision_dir, redis_url, request_timeout_s=5.0)
    register_worker(config, max_model_len=MAX_MODEL_LEN)
    return config


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
