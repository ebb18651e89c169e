"""The Gemma 3 vision encoder (SigLIP tower + projector) on a CUDA device against
transformers' `get_image_features` on the same device (`gpu` marker; `make gpu-check`'s
vision step): fp32 equal to a tight tolerance, bf16 and fp16 close, on the `tiny`
`gemma3-vision` checkpoint and a batch of images of odd sizes."""

import numpy as np
import pytest
import torch
from PIL import Image

from modeling.gemma3_vision import load_vision_encoder
from modeling.registry import load_vision_config

# `gpu` comes from the folder (tests/conftest.py)
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def pixels(vision_dir) -> torch.Tensor:
    from transformers import AutoProcessor

    rng = np.random.default_rng(0)
    pictures = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
                for w, h in [(91, 37), (56, 56), (13, 200), (640, 480)]]
    return AutoProcessor.from_pretrained(vision_dir).image_processor(pictures, return_tensors="pt")["pixel_values"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_encoder_on_cuda_matches_transformers(vision_dir, dtype):
    from transformers import Gemma3ForConditionalGeneration

    x = pixels(vision_dir).cuda()
    hf = Gemma3ForConditionalGeneration.from_pretrained(vision_dir, dtype=dtype).cuda().eval()
    encoder = load_vision_encoder(vision_dir, load_vision_config(vision_dir), dtype, "cuda")
    with torch.no_grad():
        expected = hf.get_image_features(x.to(dtype)).pooler_output.float()
        got = encoder(x).float()
    scale = expected.abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 0.03
    assert (got - expected).abs().max().item() <= tol * scale


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_images_through_the_runner_on_cuda_equal_generate(vision_dir, enforce_eager):
    """The whole image path of a worker on CUDA (Triton kernels with bidir_spans, the encoder,
    the placement), fp32: greedy tokens of two requests with 1 and 3 images, chunked at image
    starts, equal transformers' generate() on the processor's inputs on the same device --
    with the decode steps replayed as CUDA graphs (worker_svc/cuda_graphs.py), and eagerly."""
    from tests.support.media_helpers import file_bytes, picture
    from tests.support.runner_helpers import FakeMediaSource, MiniScheduler, make_runner, mm_inputs
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    from proto.messages import MediaItem

    processor = AutoProcessor.from_pretrained(vision_dir)
    hf = Gemma3ForConditionalGeneration.from_pretrained(vision_dir, dtype=torch.float32).cuda().eval()
    image_id = processor.tokenizer.convert_tokens_to_ids("<image_soft_token>")
    media = FakeMediaSource()
    runner = make_runner(vision_dir, block_size=16, num_blocks=64, device="cuda", dtype="float32", media=media,
                         enforce_eager=enforce_eager, max_cudagraph_capture_size=8)
    assert runner.backend.name == "triton" and runner.vision is not None
    assert (runner.graphs is None) == enforce_eager
    sched = MiniScheduler(runner, block_size=16, num_blocks=64, token_budget=24)
    expected = {}
    for rid, sizes in (("a", [(91, 37)]), ("b", [(56, 56), (13, 200), (640, 480)])):
        files = [file_bytes(picture(len(rid) * 10 + i, w, h, ("RGB", "RGBA", "L")[i % 3]), "PNG")
                 for i, (w, h) in enumerate(sizes)]
        content = [part for f in files for part in ({"type": "text", "text": "look at"}, {"type": "image"})]
        messages = [{"role": "user", "content": content + [{"type": "text", "text": "now?"}]}]
        text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        images = [Image.open(__import__("io").BytesIO(f)) for f in files]
        inputs = processor(text=text, images=images, add_special_tokens=False, return_tensors="pt").to("cuda")
        with torch.no_grad():
            out = hf.generate(**inputs, do_sample=False, max_new_tokens=12)
        ids = inputs["input_ids"][0].tolist()
        expected[rid] = out[0, len(ids):].tolist()
        hashes = [media.put(MediaItem("encoded", im.width, im.height, f, "image/png")) for im, f in zip(images, files)]
        sched.add(rid, ids, 12, mm_inputs(ids, image_id, hashes))
    sched.run()
    assert {rid: sched.outputs(rid) for rid in expected} == expected
    assert enforce_eager or runner.graphs.replays > 0
