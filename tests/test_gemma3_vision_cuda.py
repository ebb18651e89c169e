"""The Gemma 3 vision encoder (SigLIP tower + projector) on a CUDA device against
transformers' `get_image_features` on the same device (`gpu` marker; `make gpu-check`'s
vision step): fp32 equal to a tight tolerance, bf16 and fp16 close, on the `tiny`
`gemma3-vision` checkpoint and a batch of images of odd sizes."""

import numpy as np
import pytest
import torch
from PIL import Image

from worker_svc.make_model import make_model
from worker_svc.model.gemma3_vision import load_vision_encoder
from worker_svc.model.registry import load_vision_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def vision_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tiny-gemma3-vision"), preset="tiny", arch="gemma3-vision")


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
