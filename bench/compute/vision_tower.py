"""The Gemma 3 vision encoder on the device: images/s and TFLOP/s of SigLIP at 896 px with
the projector, against the device's own bf16 matmul rate, per batch of frames and per
attention path.

    python bench/compute/vision_tower.py --json vision.json        # CUDA, bf16, batches of 1, 4, 8 frames
    python bench/compute/vision_tower.py --smoke                   # the CPU: a 2-layer tower, checks the script

`bench/compute/kernels.py` runs it too, so `make gpu-check`'s kernels step reports it.

Gemma 3 4B, 12B and 27B share the tower: 27 layers of width 1152, 16 heads, an MLP of 4304,
14-px patches, so 4,096 patches at 896 px, full attention over them; the projector pools
them to 256 soft tokens and maps those to the text model's width (`--text-hidden`, 3840 for
12B). The weights are random (the speed does not depend on them). FLOPs per image, counted
per matmul (`flops_per_image`): 5.46 TFLOP, 99.9% of it in the 27 layers.

The attention paths: torch's SDPA as the encoder calls it (the default dispatch), then
forced to flash, cuDNN and memory-efficient attention (torch.nn.attention.sdpa_kernel),
each where the device has it. Every forced path's embeddings are first checked against
the default path's, so a wrong kernel is never timed. Timings: the median of CUDA-event
intervals (wall clock on the CPU).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the repository root on sys.path, this folder off it (bench/README.md)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent)]

from bench.compute.device_timing import device_time, matmul_rate  # noqa: E402
from modeling.gemma3_vision import Gemma3VisionConfig, Gemma3VisionEncoder, read_vision_config  # noqa: E402

# Gemma 3's vision_config (the same for 4B, 12B and 27B), as its config.json gives it
SIGLIP_896 = {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304, "num_attention_heads": 16,
              "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}
SMOKE = {**SIGLIP_896, "num_hidden_layers": 2, "image_size": 224, "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 4}
PATHS = ("default", "flash", "cudnn", "efficient")


def vision_config(tower: dict, text_hidden: int, dtype: str) -> Gemma3VisionConfig:
    return read_vision_config({"architectures": ["Gemma3ForConditionalGeneration"], "mm_tokens_per_image": 256,
                               "text_config": {"hidden_size": text_hidden}, "vision_config": tower,
                               "torch_dtype": dtype})


def flops_per_image(cfg: Gemma3VisionConfig) -> float:
    """Multiply-adds x 2 of one image: the patch embedding, each layer's QKV, O, MLP and the
    attention's two products over every patch, and the projector's matmul."""
    t = cfg.tower
    p, d = t.num_patches, t.hidden_size
    patch = 2 * p * t.num_channels * t.patch_size**2 * d
    layer = 2 * p * d * 3 * d + 2 * p * d * d + 2 * 2 * p * d * t.intermediate_size + 4 * p * p * d
    return patch + t.num_layers * layer + 2 * cfg.mm_tokens_per_image * d * cfg.text_hidden_size


def attention_path(name: str):
    """A context manager forcing SDPA onto `name`'s kernel (none for "default")."""
    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    return nullcontext() if name == "default" else sdpa_kernel(backends[name])


def bench(device: torch.device, dtype: torch.dtype, smoke: bool, batches: list[int], iters: int,
          text_hidden: int = 3840) -> dict:
    """{"env": the device and its matmul rate, "rows": one per (batch, attention path)}."""
    cfg = vision_config(SMOKE if smoke else SIGLIP_896, 64 if smoke else text_hidden,
                        "bfloat16" if dtype == torch.bfloat16 else "float32")
    gen = torch.Generator().manual_seed(0)
    encoder = Gemma3VisionEncoder(cfg)
    with torch.no_grad():
        for p in encoder.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    encoder = encoder.to(device=device, dtype=dtype).eval()
    no_flush = torch.empty(0, device=device)  # a frame's work dwarfs the L2: nothing to empty
    rate = matmul_rate(dtype, no_flush, iters, 256 if smoke else 8192)
    flops = flops_per_image(cfg)
    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."), "image_size": cfg.image_size,
           "patches": cfg.tower.num_patches, "layers": cfg.tower.num_layers,
           "TFLOP_per_image": flops / 1e12, "matmul_TFLOP_per_s": rate / 1e12}
    rows = []
    side = cfg.image_size
    for batch in batches:
        pixels = torch.randn(batch, 3, side, side, generator=gen).to(device=device, dtype=dtype)
        with torch.inference_mode():
            reference = encoder(pixels).float()
            if not reference.isfinite().all():
                raise SystemExit(f"the default attention path's embeddings at batch {batch} are not finite")
            for path in PATHS if device.type == "cuda" else ("default",):
                try:
                    with attention_path(path):
                        out = encoder(pixels).float()
                        seconds = device_time(lambda: encoder(pixels), iters, no_flush)
                except RuntimeError as exc:  # no such kernel for these shapes on this device
                    rows.append({"batch": batch, "path": path, "unavailable": str(exc).splitlines()[0][:200]})
                    continue
                error = ((out - reference).abs().max() / reference.abs().max().clamp_min(1e-6)).item()
                if not error <= 0.05:  # NaN too
                    raise SystemExit(f"attention path {path} at batch {batch}: embeddings off by {error:.3g} "
                                     "(relative to the largest), against the default path")
                rows.append({"batch": batch, "path": path, "ms": seconds * 1e3, "images_per_s": batch / seconds,
                             "TFLOP_per_s": batch * flops / seconds / 1e12,
                             "of_matmul_rate": batch * flops / seconds / rate, "max_rel_error": error})
    return {"env": env, "rows": rows}


def print_table(result: dict) -> None:
    env = result["env"]
    print(f"\nvision tower: {env['layers']} layers at {env['image_size']} px ({env['patches']} patches), "
          f"{env['TFLOP_per_image']:.2f} TFLOP an image, {env['dtype']} on {env['device']}; "
          f"matmul {env['matmul_TFLOP_per_s']:.1f} TFLOP/s")
    print("| frames | attention | ms | images/s | TFLOP/s | of the matmul rate |\n|---|---|---|---|---|---|")
    for r in result["rows"]:
        if "unavailable" in r:
            print(f"| {r['batch']} | {r['path']} | unavailable: {r['unavailable']} | | | |")
        else:
            print(f"| {r['batch']} | {r['path']} | {r['ms']:.2f} | {r['images_per_s']:.1f} | "
                  f"{r['TFLOP_per_s']:.1f} | {r['of_matmul_rate']:.0%} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--text-hidden", type=int, default=3840, help="the text model's width (12B: 3840)")
    ap.add_argument("--smoke", action="store_true", help="the CPU, a 2-layer tower at 224 px: checks the script")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.smoke:
        device, dtype, args.batches, args.iters = torch.device("cpu"), torch.float32, [2], 2
    elif torch.cuda.is_available():
        device, dtype = torch.device("cuda"), torch.bfloat16
    else:
        sys.exit("bench/compute/vision_tower.py measures a CUDA GPU; --smoke checks the script on the CPU")
    result = bench(device, dtype, args.smoke, args.batches, args.iters, args.text_hidden)
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
