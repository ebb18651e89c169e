"""Pan-and-scan at the gateway (gateway/mm_prompt.py, proto/pan_and_scan.py) on the tiny
gemma3-vision checkpoint, the real Redis and a fake worker: the prompt's token ids equal what
transformers' AutoProcessor makes with do_pan_and_scan for images of several aspect ratios,
`mm_inputs` carry each image whole then each crop with its box over its own soft tokens;
a checkpoint whose image processor turns it on gets the crops without asking, and a
request's false turns them off; a video's frames are cropped as the same frames sent as
images (the settings' refusals: test_gateway_image_refusals.py)."""

from __future__ import annotations

import io
import json
import shutil

import pytest
from PIL import Image

from gateway.image_tokens import ImageTokens
from gateway.media.options import VideoSampling
from gateway.media.store import content_hash
from gateway.media.video import decode_video
from gateway.mm_prompt import frame_label
from tests.support.gateway_helpers import make_config, register_worker
from tests.support.gateway_image_helpers import MAX_MODEL_LEN, MP4, SOFT_PER_IMAGE, config, encoded, submitted  # noqa: F401
from tests.support.media_helpers import data_url, picture
from proto.pan_and_scan import CropBox, PanAndScan

pytestmark = pytest.mark.anyio

MIN_CROP = 8  # the tiny tower sees 56 px: crops of 8 px or more
# square: no crops; 2:1 wide: 2; 1:3 tall: 3; 10:1: 4, the most
SIZES = [(40, 40), (96, 48), (30, 90), (200, 20)]
CROPS = [0, 2, 3, 4]
FILES = [encoded(picture(90 + i, w, h)) for i, (w, h) in enumerate(SIZES)]
KWARGS = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": MIN_CROP}


def sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def chat(files: list[bytes]) -> tuple[list[dict], list[dict]]:
    """(the request's messages, transformers' messages) with `files` as images between texts."""
    ours: list[dict] = [{"type": "text", "text": "Look:"}]
    theirs: list[dict] = [{"type": "text", "text": "Look:"}]
    for i, data in enumerate(files):
        ours += [{"type": "image_url", "image_url": {"url": data_url(data)}}, {"type": "text", "text": f"and {i}"}]
        theirs += [{"type": "image"}, {"type": "text", "text": f"and {i}"}]
    return [{"role": "user", "content": ours}], [{"role": "user", "content": theirs}]


def reference(processor, messages: list[dict], images: list[Image.Image], **kwargs) -> tuple[list[int], int]:
    """transformers' prompt ids for `messages`, and how many pixel pieces it made."""
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    out = processor(text=text, images=images, add_special_tokens=False, **kwargs)
    return list(out["input_ids"][0]), len(out["pixel_values"])


def assert_pieces(request, tokens: ImageTokens, images: list[tuple[str, int, int]], settings: PanAndScan) -> None:
    """mm_inputs: per image (hash, width, height) the whole image, then its crop boxes, each
    over a run of soft tokens."""
    expected = [(h, crop) for h, w, ht in images for crop in (None, *settings.boxes(ht, w))]
    assert [(m.content_hash, m.crop) for m in request.mm_inputs] == expected
    ids = request.prompt_token_ids
    assert ids.count(tokens.soft_id) == SOFT_PER_IMAGE * len(expected)
    for m in request.mm_inputs:
        assert m.length == SOFT_PER_IMAGE and ids[m.offset:m.offset + m.length] == [tokens.soft_id] * m.length
        assert ids[m.offset - 1] == tokens.boi_id and ids[m.offset + m.length] == tokens.eoi_id


@pytest.mark.parametrize("which", [[0], [1], [2], [3], [0, 1, 2, 3]],
                         ids=["square", "2:1 wide", "1:3 tall", "max crops", "all four"])
async def test_prompt_equals_the_processors_with_pan_and_scan(config, vision_dir, processor, which):
    files = [FILES[i] for i in which]
    ours, theirs = chat(files)
    request, answer = await submitted(config, "/v1/chat/completions", {"messages": ours, "mm_processor_kwargs": KWARGS})
    expected, pieces = reference(processor, theirs, [Image.open(io.BytesIO(f)) for f in files], **KWARGS)
    assert request.prompt_token_ids == expected
    assert pieces == len(request.mm_inputs) == sum(1 + CROPS[i] for i in which)
    settings = PanAndScan(enabled=True, min_crop_size=MIN_CROP)
    tokens = ImageTokens.read(vision_dir, processor.tokenizer)
    assert_pieces(request, tokens, [(sha256(FILES[i]), *SIZES[i]) for i in which], settings)
    assert answer["usage"]["prompt_tokens"] == len(request.prompt_token_ids)
    if which == [1]:
        assert [m.crop for m in request.mm_inputs] == [None, CropBox(0, 0, 48, 48), CropBox(0, 48, 48, 48)]
    # the request's other settings, as transformers names them
    fewer = {**KWARGS, "pan_and_scan_max_num_crops": 2, "pan_and_scan_min_ratio_to_activate": 2.5}
    request, _ = await submitted(config, "/v1/chat/completions", {"messages": ours, "mm_processor_kwargs": fewer})
    assert request.prompt_token_ids == reference(processor, theirs, [Image.open(io.BytesIO(f)) for f in files],
                                                 **fewer)[0]
    assert_pieces(request, tokens, [(sha256(FILES[i]), *SIZES[i]) for i in which],
                  PanAndScan(True, MIN_CROP, 2, 2.5))


@pytest.fixture
def pan_and_scan_dir(vision_dir, tmp_path):
    """The tiny checkpoint with its image processor's pan-and-scan on (8-px crops, 3 at most)."""
    copy = tmp_path / "pan-and-scan"
    shutil.copytree(vision_dir, copy)
    config = json.loads((copy / "processor_config.json").read_text())
    config["image_processor"].update(do_pan_and_scan=True, pan_and_scan_min_crop_size=MIN_CROP,
                                     pan_and_scan_max_num_crops=3)
    (copy / "processor_config.json").write_text(json.dumps(config))
    return copy


async def test_a_checkpoint_that_turns_it_on_and_a_request_that_turns_it_off(pan_and_scan_dir, redis_url, processor):
    """The checkpoint's settings apply without asking (vLLM's rule; transformers' AutoProcessor
    passes its own defaults over them, so its reference is called with them explicitly)."""
    config = make_config(pan_and_scan_dir, redis_url, request_timeout_s=5.0)
    register_worker(config, max_model_len=MAX_MODEL_LEN)
    ours, theirs = chat(FILES)
    images = [Image.open(io.BytesIO(f)) for f in FILES]
    settings = {**KWARGS, "pan_and_scan_max_num_crops": 3}
    request, _ = await submitted(config, "/v1/chat/completions", {"messages": ours})
    assert request.prompt_token_ids == reference(processor, theirs, images, **settings)[0]
    assert [m.crop is not None for m in request.mm_inputs].count(True) == 0 + 2 + 3 + 3
    tokens = ImageTokens.read(pan_and_scan_dir, processor.tokenizer)
    assert tokens.pan_and_scan == PanAndScan(True, MIN_CROP, 3)
    off, _ = await submitted(config, "/v1/chat/completions",
                             {"messages": ours, "mm_processor_kwargs": {"do_pan_and_scan": False}})
    assert off.prompt_token_ids == reference(processor, theirs, images)[0]
    assert [m.crop for m in off.mm_inputs] == [None] * 4
    # a request's setting over the checkpoint's others
    more, _ = await submitted(config, "/v1/chat/completions",
                              {"messages": ours, "mm_processor_kwargs": {"pan_and_scan_max_num_crops": 4}})
    assert more.prompt_token_ids == reference(processor, theirs, images, **KWARGS)[0]


async def test_a_videos_frames_are_cropped_as_the_same_frames_sent_as_images(config, processor):
    sampling = {"video": {"num_frames": 2}}
    kwargs = {**KWARGS, "pan_and_scan_min_ratio_to_activate": 1.3}  # the 64x48 frames: 4:3
    video = [{"role": "user", "content": [{"type": "text", "text": "What moves?"},
                                          {"type": "video_url", "video_url": {"url": data_url(MP4, "video/mp4")}}]}]
    request, _ = await submitted(config, "/v1/chat/completions",
                                 {"messages": video, "media_io_kwargs": sampling, "mm_processor_kwargs": kwargs})
    frames = decode_video(MP4, sampling=VideoSampling(num_frames=2), max_pixels=2**25, max_frames=9000,
                          param="").frames
    images = [Image.frombytes("RGB", (f.width, f.height), f.rgb) for f in frames]
    hf: list[dict] = [{"type": "text", "text": "What moves?"}]
    for f in frames:
        hf += [{"type": "text", "text": frame_label(f.timestamp_s)}, {"type": "image"}]
    expected, pieces = reference(processor, [{"role": "user", "content": hf}], images, **kwargs)
    assert request.prompt_token_ids == expected and pieces == len(request.mm_inputs) == 2 * 3
    assert [m.content_hash for m in request.mm_inputs] == [content_hash(f.item()) for f in frames for _ in range(3)]
