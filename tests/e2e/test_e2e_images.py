"""Gemma 3 with images through the whole stack (official openai client → gateway → Redis →
scheduler → gRPC → worker) on the tiny `gemma3-vision` checkpoint, fp32, against
`Gemma3ForConditionalGeneration.generate()` on the processor's inputs (its
`token_type_ids`, so transformers applies the bidirectional image mask):

- 18 concurrent greedy chats with 1, 2 and 8 images (PNG, JPEG, RGBA, grayscale, palette,
  odd sizes and aspect ratios), most longer than the 48-token sliding window, with chunked
  prefill (a 64-token budget) and a KV pool small enough to preempt, token for token and
  each token's logprob (the tiny model's greedy tokens alone do not follow its images: a
  control shows that other images move the reference's logprobs);
- a repeated image is a prefix-cache hit and answers the same; a different image behind the
  same placeholder tokens is not;
- a streamed answer; a short video equal to its sampled frames sent as images with the same
  "Frame at MM:SS.ss:" texts; the Responses API's input_image;
- pan-and-scan (`mm_processor_kwargs`) against the processor with do_pan_and_scan: a
  square image (no crops), 2:1, 1:3 and 10:1 ones (the most crops) and all four at once,
  then one image cut into other crops behind partly the same tokens, and sent without
  pan-and-scan -- prompt ids, greedy tokens and their logprobs (the tiny model's greedy
  tokens alone hardly depend on a crop's pixels).
"""

from __future__ import annotations

import asyncio
import io

import numpy as np
import openai
import pytest
import torch
from PIL import Image

from tests.support.media_helpers import data_url, file_bytes, make_video, picture
from tests.support.stack_helpers import running_stack, wait_until_idle, worker_stats

NUM_BLOCKS = 48  # 768 token slots for 18 requests needing ~2,000: forces preemption
TOKEN_BUDGET = 64


@pytest.fixture(scope="module")
def vision(vision_dir, processor, hf_vlm, redis_url, tmp_path_factory):
    with running_stack(vision_dir, redis_url, tmp_path_factory.mktemp("run-vision"),
                       worker_args=("--num-blocks", str(NUM_BLOCKS)),
                       scheduler_args=("--max-num-batched-tokens", str(TOKEN_BUDGET),
                                       "--stats-interval", "0.05")) as stack:
        yield stack, hf_vlm, processor


KINDS = [("RGB", "PNG"), ("RGB", "JPEG"), ("RGBA", "PNG"), ("L", "PNG"), ("P", "PNG"), ("L", "JPEG")]
SIZES = [(91, 37), (56, 56), (13, 200), (640, 480), (300, 301), (1, 1), (77, 5), (120, 90)]


def media(seed: int) -> tuple[bytes, str]:
    mode, fmt = KINDS[seed % len(KINDS)]
    w, h = SIZES[seed % len(SIZES)]
    return file_bytes(picture(seed, w, h, mode), fmt), f"image/{fmt.lower()}"


def chat_case(seed: int, num_images: int, words: int) -> tuple[list[dict], list[dict], list[Image.Image]]:
    """(the API's messages, the processor's messages, the images as the processor gets them:
    decoded from the very bytes the API sends)."""
    rng = np.random.default_rng(1000 + seed)
    vocab = ["robot", "camera", "frame", "left", "right", "arm", "red", "box", "moves", "still", "what", "where"]
    api, hf, images = [], [], []
    for i in range(num_images):
        text = " ".join(rng.choice(vocab, size=int(rng.integers(1, words + 1))))
        data, mime = media(seed * 10 + i)
        api += [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": data_url(data, mime)}}]
        hf += [{"type": "text", "text": text}, {"type": "image"}]
        images.append(Image.open(io.BytesIO(data)))
    tail = " ".join(rng.choice(vocab, size=words))
    api.append({"type": "text", "text": tail})
    hf.append({"type": "text", "text": tail})
    return [{"role": "user", "content": api}], [{"role": "user", "content": hf}], images


def hf_greedy(hf, processor, messages: list[dict], images: list[Image.Image], max_tokens: int,
              **processor_kwargs) -> list[int]:
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=text, images=images or None, add_special_tokens=False, return_tensors="pt",
                       **processor_kwargs)
    assert "token_type_ids" in inputs  # transformers' bidirectional image mask is on
    with torch.no_grad():
        out = hf.generate(**inputs, do_sample=False, max_new_tokens=max_tokens)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def chat_ids(stack, messages: list[dict], max_tokens: int, **kwargs) -> list[int]:
    async def one():
        async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=300) as c:
            resp = await c.chat.completions.create(model=stack.served_model_name, messages=messages,
                                                   max_tokens=max_tokens, temperature=0,
                                                   extra_body={"return_token_ids": True, **kwargs})
            return resp.choices[0].token_ids
    return asyncio.run(one())


def test_concurrent_chats_with_images_equal_transformers(vision):
    stack, hf, processor = vision
    cases = [chat_case(seed, num_images=(1, 2, 8)[seed % 3], words=(3, 12)[seed % 2]) for seed in range(18)]
    max_tokens = [8 + seed % 13 for seed in range(18)]

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=300) as c:
            return await asyncio.gather(*(
                c.chat.completions.create(model=stack.served_model_name, messages=api, max_tokens=m,
                                          temperature=0, logprobs=True, extra_body={"return_token_ids": True})
                for (api, _, _), m in zip(cases, max_tokens)))

    answers = asyncio.run(all_of_them())
    long_prompts = changed = 0
    for seed, ((_, messages, images), m, answer) in enumerate(zip(cases, max_tokens, answers)):
        # the tiny model's greedy tokens barely follow its images; their logprobs do
        expected, expected_logprobs = hf_logprobs(hf, processor, messages, images, m)
        choice = answer.choices[0]
        assert choice.token_ids == expected, seed
        logprobs = [t.logprob for t in choice.logprobs.content]
        assert max(abs(a - b) for a, b in zip(logprobs, expected_logprobs)) < 2e-4, seed
        long_prompts += answer.usage.prompt_tokens > 48
        if seed < 6:  # the control: other images, the same words: the reference's logprobs move
            others = [Image.open(io.BytesIO(media(900 + 10 * seed + i)[0])) for i in range(len(images))]
            _, other_logprobs = hf_logprobs(hf, processor, messages, others, m)
            changed += max(abs(a - b) for a, b in zip(other_logprobs, expected_logprobs)) > 2e-3
    assert long_prompts >= 12  # most prompts outgrow the sliding window
    assert changed >= 5, changed  # other images move the reference by far more than the tolerance
    (stats,) = wait_until_idle(stack).values()
    assert stats.integrity_error is None and stats.num_free_blocks == stats.num_blocks
    assert stats.num_preemptions >= 1, "the pool was meant to be small enough to preempt"


def test_a_repeated_image_hits_the_prefix_cache_and_a_different_one_does_not(vision):
    stack, hf, processor = vision
    api, messages, images = chat_case(100, num_images=2, words=20)
    (before,) = worker_stats(stack).values()
    first = chat_ids(stack, api, 12)
    again = chat_ids(stack, api, 12)
    (after,) = wait_until_idle(stack).values()
    assert first == again == hf_greedy(hf, processor, messages, images, 12)
    assert after.prefix_cache_hits > before.prefix_cache_hits
    # the same words around another second image: the blocks up to that image hit, not past it
    other_api, other_messages, other_images = chat_case(100, num_images=2, words=20)
    data, mime = media(7)
    other_api[0]["content"][3]["image_url"]["url"] = data_url(data, mime)
    other_images[1] = Image.open(io.BytesIO(data))
    assert chat_ids(stack, other_api, 12) == hf_greedy(hf, processor, other_messages, other_images, 12)


def test_a_streamed_answer_equals_transformers(vision):
    stack, hf, processor = vision
    api, messages, images = chat_case(200, num_images=2, words=6)

    async def streamed():
        ids = []
        async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=300) as c:
            stream = await c.chat.completions.create(model=stack.served_model_name, messages=api, max_tokens=15,
                                                     temperature=0, stream=True,
                                                     extra_body={"return_token_ids": True})
            async for chunk in stream:
                if chunk.choices:
                    ids.extend(chunk.choices[0].token_ids or [])
        return ids

    assert asyncio.run(streamed()) == hf_greedy(hf, processor, messages, images, 15)


def test_a_video_answers_as_its_frames_sent_as_images(vision):
    from gateway.media.options import VideoSampling
    from gateway.media.video import decode_video
    from gateway.mm_prompt import frame_label

    stack, hf, processor = vision
    video = make_video(frames=12, rate=6)
    sampling = {"video": {"num_frames": 4}}
    as_video = [{"role": "user", "content": [
        {"type": "text", "text": "What moves?"},
        {"type": "video_url", "video_url": {"url": data_url(video, "video/mp4")}}]}]
    frames = decode_video(video, sampling=VideoSampling(num_frames=4), max_pixels=2**25, max_frames=9000,
                          param="").frames
    as_images, hf_content = [{"type": "text", "text": "What moves?"}], [{"type": "text", "text": "What moves?"}]
    images = []
    for f in frames:
        image = Image.frombytes("RGB", (f.width, f.height), f.rgb)
        png = file_bytes(image, "PNG")
        as_images += [{"type": "text", "text": frame_label(f.timestamp_s)},
                      {"type": "image_url", "image_url": {"url": data_url(png, "image/png")}}]
        hf_content += [{"type": "text", "text": frame_label(f.timestamp_s)}, {"type": "image"}]
        images.append(Image.open(io.BytesIO(png)))
    expected = hf_greedy(hf, processor, [{"role": "user", "content": hf_content}], images, 12)
    assert chat_ids(stack, as_video, 12, media_io_kwargs=sampling) == expected
    assert chat_ids(stack, [{"role": "user", "content": as_images}], 12) == expected


def test_responses_input_image(vision):
    stack, hf, processor = vision
    data, mime = media(3)
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)
    response = client.responses.create(model=stack.served_model_name, max_output_tokens=10, temperature=0,
                                       input=[{"role": "user", "content": [
                                           {"type": "input_text", "text": "Describe"},
                                           {"type": "input_image", "image_url": data_url(data, mime)}]}])
    chat = client.chat.completions.create(model=stack.served_model_name, max_tokens=10, temperature=0,
                                          messages=[{"role": "user", "content": [
                                              {"type": "text", "text": "Describe"},
                                              {"type": "image_url", "image_url": {"url": data_url(data, mime)}}]}])
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens


PAS_SIZES = {"square": (40, 40), "2:1 wide": (96, 48), "1:3 tall": (30, 90), "max crops": (200, 20)}
PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 8}  # the tower sees 56 px


def pas_case(names: list[str], words: int = 4) -> tuple[list[dict], list[dict], list[Image.Image]]:
    """chat_case's shape for the images `names` (PAS_SIZES), PNG files."""
    api, hf, images = [], [], []
    for i, name in enumerate(names):
        data = file_bytes(picture(300 + list(PAS_SIZES).index(name), *PAS_SIZES[name]), "PNG")
        api += [{"type": "text", "text": f"picture {i}"},
                {"type": "image_url", "image_url": {"url": data_url(data, "image/png")}}]
        hf += [{"type": "text", "text": f"picture {i}"}, {"type": "image"}]
        images.append(Image.open(io.BytesIO(data)))
    tail = " ".join(["what", "is", "there"][:words])
    api.append({"type": "text", "text": tail})
    hf.append({"type": "text", "text": tail})
    return [{"role": "user", "content": api}], [{"role": "user", "content": hf}], images


def test_pan_and_scan_equals_transformers(vision):
    stack, hf, processor = vision
    cases = [[name] for name in PAS_SIZES] + [list(PAS_SIZES)]

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=300) as c:
            return await asyncio.gather(*(
                c.chat.completions.create(model=stack.served_model_name, messages=pas_case(names)[0], max_tokens=10,
                                          temperature=0, logprobs=True,
                                          extra_body={"return_token_ids": True, "mm_processor_kwargs": PAN_AND_SCAN})
                for names in cases))

    for names, answer in zip(cases, asyncio.run(all_of_them())):
        _, messages, images = pas_case(names)
        text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        inputs = processor(text=text, images=images, add_special_tokens=False, **PAN_AND_SCAN)
        assert answer.prompt_token_ids == list(inputs["input_ids"][0]), names
        expected, expected_logprobs = hf_logprobs(hf, processor, messages, images, 10, **PAN_AND_SCAN)
        assert answer.choices[0].token_ids == expected, names
        logprobs = [t.logprob for t in answer.choices[0].logprobs.content]
        assert max(abs(a - b) for a, b in zip(logprobs, expected_logprobs)) < 2e-4, names
    # the 10:1 image cut into 4 crops, then into 6 of other boxes (the second prompt's first
    # 85 tokens are the first's), then whole: each equals transformers, logprobs too (the tiny
    # model's greedy tokens hardly depend on a crop's pixels). That a prefix-cache hit never
    # reaches another crop's K/V is the scheduler's test (test_scheduler_images.py): here the
    # small pool and the sliding window's blocks decide how far a hit goes.
    api, messages, images = pas_case(["max crops"], words=3)
    six = {**PAN_AND_SCAN, "pan_and_scan_max_num_crops": 6}
    for kwargs in (PAN_AND_SCAN, six, {"do_pan_and_scan": False}):
        ids, logprobs = chat_logprobs(stack, api, 6, mm_processor_kwargs=kwargs)
        expected, expected_logprobs = hf_logprobs(hf, processor, messages, images, 6, **kwargs)
        assert ids == expected, kwargs
        assert max(abs(a - b) for a, b in zip(logprobs, expected_logprobs)) < 2e-4, kwargs
    (stats,) = wait_until_idle(stack).values()
    assert stats.integrity_error is None and stats.num_free_blocks == stats.num_blocks


def hf_logprobs(hf, processor, messages: list[dict], images: list[Image.Image], max_tokens: int,
                **processor_kwargs) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and each one's logprob."""
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=text, images=images, add_special_tokens=False, return_tensors="pt", **processor_kwargs)
    with torch.no_grad():
        out = hf.generate(**inputs, do_sample=False, max_new_tokens=max_tokens, output_logits=True,
                          return_dict_in_generate=True)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    return tokens, [step[0].float().log_softmax(-1)[t].item() for step, t in zip(out.logits, tokens)]


def chat_logprobs(stack, messages: list[dict], max_tokens: int, **kwargs) -> tuple[list[int], list[float]]:
    async def one():
        async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=300) as c:
            resp = await c.chat.completions.create(model=stack.served_model_name, messages=messages,
                                                   max_tokens=max_tokens, temperature=0, logprobs=True,
                                                   extra_body={"return_token_ids": True, **kwargs})
            choice = resp.choices[0]
            return choice.token_ids, [t.logprob for t in choice.logprobs.content]
    return asyncio.run(one())
