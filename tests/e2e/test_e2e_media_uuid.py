"""A camera client's frame by uuid through the whole stack (official openai client → gateway
→ Redis → scheduler → gRPC → worker) on the tiny `gemma3-vision` checkpoint, fp32: the frame
sent once with its data and a uuid, then named by the uuid alone (`"image_url": null`, vLLM's
shape), answers the same question with the same greedy tokens -- transformers' -- and the
second request hits the prefix cache; a uuid never sent is a 400 `media_not_found`."""

from __future__ import annotations

import io

import openai
import pytest
from PIL import Image

from tests.support.media_helpers import data_url, file_bytes, picture
from tests.support.stack_helpers import running_stack, wait_until_idle
from tests.e2e.test_e2e_images import hf_greedy

BLOCK_SIZE = 16  # the stack's default
QUESTION = "What is in front of the robot? Answer in a few words, then say where it is."


@pytest.fixture(scope="module")
def vision(vision_dir, processor, hf_vlm, redis_url, tmp_path_factory):
    with running_stack(vision_dir, redis_url, tmp_path_factory.mktemp("run-media-uuid"),
                       scheduler_args=("--stats-interval", "0.05")) as stack:
        yield stack, hf_vlm, processor


def ask(client: openai.OpenAI, stack, frame: dict) -> list[int]:
    answer = client.chat.completions.create(
        model=stack.served_model_name, max_tokens=12, temperature=0, extra_body={"return_token_ids": True},
        messages=[{"role": "user", "content": [frame, {"type": "text", "text": QUESTION}]}])
    return answer.choices[0].token_ids


def test_a_frame_named_by_its_uuid_answers_as_the_frame_sent(vision):
    stack, hf, processor = vision
    frame = file_bytes(picture(17, 96, 64), "JPEG")
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=300)
    with_data = {"type": "image_url", "image_url": {"url": data_url(frame, "image/jpeg")}, "uuid": "cam0-frame-17"}
    by_uuid = {"type": "image_url", "image_url": None, "uuid": "cam0-frame-17"}

    sent = ask(client, stack, with_data)
    (before,) = wait_until_idle(stack).values()
    named = ask(client, stack, by_uuid)
    (after,) = wait_until_idle(stack).values()
    hf_messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    assert sent == named == hf_greedy(hf, processor, hf_messages, [Image.open(io.BytesIO(frame))], 12)
    # the same hash: the first block, which holds the image, hits (the question behind it too)
    assert after.prefix_cache_hits - before.prefix_cache_hits >= BLOCK_SIZE

    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, stack, {"type": "image_url", "image_url": None, "uuid": "cam0-frame-18"})
    assert refused.value.code == "media_not_found" and "cam0-frame-18" in refused.value.message
