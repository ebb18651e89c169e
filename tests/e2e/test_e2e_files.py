"""A camera client's frame uploaded once through the Files API and named by its file_id,
through the whole stack (official openai client → gateway → Redis → scheduler → gRPC →
worker) on the tiny `gemma3-vision` checkpoint, fp32: `client.files.create` stores the JPEG;
asked about by file_id -- chat's `file` part and the Responses API's `input_image` -- it
answers with the same greedy tokens as the frame sent inline as a data URL, and hits the
prefix cache; the file is listed, read back and deleted with the client, and a deleted id
is a 400 `file_not_found`."""

from __future__ import annotations

import openai
import pytest

from tests.support.media_helpers import data_url, file_bytes, picture
from tests.support.stack_helpers import ids_of, running_stack, wait_until_idle

BLOCK_SIZE = 16  # the stack's default
QUESTION = "What is in front of the robot? Answer in a few words, then say where it is."
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def stack(vision_dir, redis_url, tmp_path_factory):
    with running_stack(vision_dir, redis_url, tmp_path_factory.mktemp("run-files"),
                       scheduler_args=("--stats-interval", "0.05")) as stack:
        yield stack


def chat(client: openai.OpenAI, stack, image: dict) -> tuple[list[int], str]:
    answer = client.chat.completions.create(
        model=stack.served_model_name, max_tokens=MAX_TOKENS, temperature=0, extra_body={"return_token_ids": True},
        messages=[{"role": "user", "content": [image, {"type": "text", "text": QUESTION}]}])
    return ids_of(answer.choices[0]), answer.choices[0].message.content


def respond(client: openai.OpenAI, stack, image: dict) -> tuple[str, int]:
    answer = client.responses.create(
        model=stack.served_model_name, max_output_tokens=MAX_TOKENS, temperature=0,
        input=[{"role": "user", "content": [image, {"type": "input_text", "text": QUESTION}]}])
    return answer.output_text, answer.usage.output_tokens


def test_an_uploaded_frame_answers_as_the_frame_sent_inline(stack):
    frame = file_bytes(picture(21, 96, 64), "JPEG")
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=300)
    inline_url = data_url(frame, "image/jpeg")

    inline_ids, inline_text = chat(client, stack, {"type": "image_url", "image_url": {"url": inline_url}})
    uploaded = client.files.create(file=("frame.jpg", frame, "image/jpeg"), purpose="vision")
    assert uploaded.id.startswith("file-") and uploaded.object == "file" and uploaded.bytes == len(frame)
    assert uploaded.filename == "frame.jpg" and uploaded.purpose == "vision"
    assert uploaded.expires_at > uploaded.created_at
    (before,) = wait_until_idle(stack).values()
    by_file_ids, by_file_text = chat(client, stack, {"type": "file", "file": {"file_id": uploaded.id}})
    (after,) = wait_until_idle(stack).values()
    assert by_file_ids == inline_ids and by_file_text == inline_text and len(inline_ids) > 0
    # the same content hash: the first block, which holds the image, hits (the question behind it too)
    assert after.prefix_cache_hits - before.prefix_cache_hits >= BLOCK_SIZE

    by_file = respond(client, stack, {"type": "input_image", "file_id": uploaded.id, "detail": "auto"})
    inline = respond(client, stack, {"type": "input_image", "image_url": inline_url, "detail": "auto"})
    assert by_file == inline == (inline_text, len(inline_ids))

    assert client.files.retrieve(uploaded.id) == uploaded
    assert [f.id for f in client.files.list()] == [uploaded.id]
    assert client.files.content(uploaded.id).read() == frame
    assert client.files.delete(uploaded.id).deleted is True
    for ask in (lambda: chat(client, stack, {"type": "file", "file": {"file_id": uploaded.id}}),
                lambda: respond(client, stack, {"type": "input_image", "file_id": uploaded.id, "detail": "auto"})):
        with pytest.raises(openai.BadRequestError) as refused:
            ask()
        assert refused.value.code == "file_not_found" and uploaded.id in refused.value.message
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)
