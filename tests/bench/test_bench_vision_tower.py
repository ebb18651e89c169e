"""bench/compute/vision_tower.py: its FLOP count per image against torch's own FlopCounterMode on
the same encoder, Gemma 3's 896-px tower at 5.46 TFLOP an image, and its smoke run."""

import json
import subprocess
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from tests.bench.test_bench_compare import BENCH, bench_module


def test_flops_per_image_are_what_torch_counts():
    vt = bench_module("compute.vision_tower")
    cfg = vt.vision_config({**vt.SMOKE, "num_hidden_layers": 3}, 96, "float32")
    encoder = vt.Gemma3VisionEncoder(cfg)
    pixels = torch.randn(2, 3, cfg.image_size, cfg.image_size)
    # SDPA's math path: its two products are matmuls the counter sees
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        encoder(pixels)
    assert counter.get_total_flops() == 2 * vt.flops_per_image(cfg)


def test_gemma3s_tower_at_896_px():
    vt = bench_module("compute.vision_tower")
    cfg = vt.vision_config(vt.SIGLIP_896, 3840, "bfloat16")
    assert cfg.tower.num_patches == 4096 and cfg.tower.num_layers == 27
    assert round(vt.flops_per_image(cfg) / 1e12, 2) == 5.46


def test_smoke_run_writes_its_rows(tmp_path):
    out = tmp_path / "vision.json"
    subprocess.run([sys.executable, str(BENCH / "compute" / "vision_tower.py"), "--smoke", "--json", str(out)],
                   check=True, timeout=300)
    result = json.loads(out.read_text())
    assert result["env"]["layers"] == 2 and [r["path"] for r in result["rows"]] == ["default"]
    assert result["rows"][0]["images_per_s"] > 0 and result["rows"][0]["max_rel_error"] == 0
