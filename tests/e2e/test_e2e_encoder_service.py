"""The encoder service through the whole stack (official openai client → gateway → Redis →
encoder service; scheduler → gRPC → worker) on the tiny `gemma3-vision` checkpoint, fp32:
frames uploaded with the Files API (and one sent inline) are encoded by the encoder, once
each, before the question; the worker encodes nothing, finds every embedding ready, and
answers with transformers' greedy tokens. The gateway's /metrics shows the image counters
of the worker and of the encoder, as their own /metrics do (issue 46)."""

from __future__ import annotations

import io
import signal
import time

import openai
import pytest
from PIL import Image

from proto.metrics_scrape import metric, scrape
from tests.support.media_helpers import data_url, file_bytes, picture
from tests.support.stack_helpers import running_stack
from tests.e2e.test_e2e_images import hf_greedy

QUESTION = "What moved between these frames? Answer in a few words."


@pytest.fixture(scope="module")
def vision(vision_dir, processor, hf_vlm, redis_url, tmp_path_factory):
    with running_stack(vision_dir, redis_url, tmp_path_factory.mktemp("run-encoder"), encoders=1) as stack:
        yield stack, hf_vlm, processor


def counters(stack) -> dict[str, float]:
    worker, encoder = scrape(stack.metrics_urls["worker-0"]), scrape(stack.metrics_urls["encoder-0"])
    return {"worker_encoded": metric(worker, "pagedserve:mm_items_encoded_total"),
            "queries": metric(worker, "pagedserve:mm_cache_queries_total"),
            "ready": metric(worker, "pagedserve:mm_cache_hits_total"),
            "encoder_encoded": metric(encoder, "pagedserve:mm_items_encoded_total")}


def test_uploaded_and_inline_frames_are_encoded_once_by_the_encoder(vision):
    stack, hf, processor = vision
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=300)
    frames = [file_bytes(picture(seed, 96, 64), "JPEG") for seed in (31, 32, 33)]
    uploaded = [client.files.create(file=(f"f{i}.jpg", f, "image/jpeg"), purpose="vision").id
                for i, f in enumerate(frames[:2])]
    content = [*({"type": "file", "file": {"file_id": fid}} for fid in uploaded),
               {"type": "image_url", "image_url": {"url": data_url(frames[2], "image/jpeg")}},
               {"type": "text", "text": QUESTION}]
    answer = client.chat.completions.create(model=stack.served_model_name, max_tokens=10, temperature=0,
                                            messages=[{"role": "user", "content": content}],
                                            extra_body={"return_token_ids": True})
    hf_messages = [{"role": "user", "content": [{"type": "image"}] * 3 + [{"type": "text", "text": QUESTION}]}]
    images = [Image.open(io.BytesIO(f)) for f in frames]
    assert answer.choices[0].token_ids == hf_greedy(hf, processor, hf_messages, images, 10)
    seen = counters(stack)
    assert seen == {"worker_encoded": 0, "queries": 3, "ready": 3, "encoder_encoded": 3}

    again = client.chat.completions.create(model=stack.served_model_name, max_tokens=10, temperature=0,
                                           messages=[{"role": "user", "content": content}],
                                           extra_body={"return_token_ids": True})
    assert again.choices[0].token_ids == answer.choices[0].token_ids
    assert counters(stack)["encoder_encoded"] == 3 and counters(stack)["worker_encoded"] == 0


def ask_about(stack, client: openai.OpenAI, seed: int) -> None:
    frame = file_bytes(picture(seed, 96, 64), "JPEG")
    content = [{"type": "image_url", "image_url": {"url": data_url(frame, "image/jpeg")}},
               {"type": "text", "text": QUESTION}]
    client.chat.completions.create(model=stack.served_model_name, max_tokens=2, temperature=0,
                                   messages=[{"role": "user", "content": content}])


def test_the_gateway_shows_the_image_counters_of_workers_and_encoders(vision):
    stack = vision[0]
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=300)
    ask_about(stack, client, 42)  # announced, encoded by the encoder
    encoder = stack.procs["encoder-0"]
    encoder.send_signal(signal.SIGSTOP)  # behind: the worker takes its new frame over and encodes it
    try:
        ask_about(stack, client, 41)
    finally:
        encoder.send_signal(signal.SIGCONT)  # it comes to that frame's job and finds it published
    deadline = time.monotonic() + 30

    worker_own, encoder_own = {"worker": "worker-0"}, {"encoder": "encoder-0"}
    same = ("pagedserve:mm_items_encoded_total", "pagedserve:mm_cache_queries_total",
            "pagedserve:mm_cache_hits_total", "pagedserve:encoder_cache_hits_total",
            "pagedserve:encoder_seconds_count")
    encoders_only = ("pagedserve:mm_items_encoded_total", "pagedserve:encoder_seconds_count",
                     "pagedserve:mm_embeddings_published_total", "pagedserve:mm_embeddings_found_total",
                     "pagedserve:mm_encode_failed_total")
    while True:  # the stats reach the gateway within a second (the scheduler's, the encoder's heartbeat)
        gateway = scrape(stack.metrics_urls["gateway"])
        worker, enc = scrape(stack.metrics_urls["worker-0"]), scrape(stack.metrics_urls["encoder-0"])
        seen = {name: (metric(gateway, name, **worker_own), metric(worker, name)) for name in same}
        seen.update({f"encoder {name}": (metric(gateway, name, **encoder_own), metric(enc, name))
                     for name in encoders_only})
        found = metric(gateway, "pagedserve:mm_embeddings_found_total", **encoder_own)
        if all(at_gateway == own for at_gateway, own in seen.values()) and found or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert all(at_gateway == own for at_gateway, own in seen.values()), seen
    worker_encoded = metric(gateway, "pagedserve:mm_items_encoded_total", **worker_own)
    encoder_encoded = metric(gateway, "pagedserve:mm_items_encoded_total", **encoder_own)
    assert worker_encoded >= 1 and encoder_encoded >= 1  # both encoded a frame
    assert metric(gateway, "pagedserve:mm_embeddings_found_total", **encoder_own) >= 1  # the one taken over
    assert metric(gateway, "pagedserve:mm_items_encoded_total") == worker_encoded + encoder_encoded
