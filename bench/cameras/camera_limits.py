"""The physical limit of the camera workload on one device: how many cameras a GPU could
serve if every FLOP ran at its matmul rate and every byte at its copy bandwidth. Arithmetic
on a checkpoint's config.json (a `make-model --config-only` folder will do), nothing run.

    python bench/cameras/camera_limits.py --model-dir models/gemma-3-12b-it              # the H200's rates
    python bench/cameras/camera_limits.py --model-dir models/gemma-3-12b-it --tflops 790 --tbps 4.27 --json out.json

The workload (bench/cameras/cameras.py's): each camera sends `--fps` frames a second and asks one
question a second about its last `--frames` frames (a line of `--text-tokens` tokens),
answered in `--answer-tokens` tokens. Since the window of frames slides, no prefix is shared
between questions: every question is a whole prefill. Frames are encoded once each.

Per question:
- prefill FLOPs: 2 x every linear weight x prompt tokens (bench/compute/roofline.py's `step_cost`,
  the LM head for one row), plus QK^T and PV over each query's keys, a sliding layer's
  keys capped by its window (the image spans' bidirectional extra, < 1%, left out);
- SigLIP FLOPs per frame: bench/compute/vision_tower.py's `flops_per_image`, `--fps` new frames per
  camera-second;
- decode bytes per step: every weight once, plus each running answer's K/V (a sliding
  layer's capped by its window); with K cameras, K answers run together for
  `--answer-tokens` steps a second.
One second of K cameras needs K x (prefill + fps x SigLIP + the answer's FLOPs) / rate
seconds of compute and answer_tokens x (weights + K x K/V) / bandwidth seconds of memory
reads; the limit is the largest K for which both fit in one second (a roofline: the two
overlap, as the scheduler runs decodes beside prefill chunks in one step). Also reported:
the K if they did not overlap at all (the sum of the two within one second). The defaults are
the H200's measured rates (../shared/GPU-NOTES.md: bf16 matmul ~790 TFLOP/s, device copy ~4.27
TB/s); quote a measured run against them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the repository root on sys.path, this folder off it (bench/README.md)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent)]

from bench.compute.roofline import step_cost  # noqa: E402
from bench.compute.vision_tower import flops_per_image  # noqa: E402
from modeling.config import DecoderConfig  # noqa: E402
from modeling.registry import load_config, load_vision_config  # noqa: E402

# Gemma3Processor's wrapping of one image ("\n\n", <start_of_image>, <end_of_image>, "\n\n"),
# and bench/cameras/cameras.py's "Frame at MM:SS.ss:" label before it: about this many text tokens
TOKENS_AROUND_A_FRAME = 12


def attended_keys(cfg: DecoderConfig, context: int, new: int) -> int:
    """Keys attended by `new` query tokens after `context`, summed over the layers: the
    query at position p sees min(p + 1, window) keys, so a layer's sum over k = context + 1
    .. context + new of min(k, window) is the k up to the window plus the window for the rest."""
    lo, hi = context + 1, context + new
    total = 0
    for window in cfg.sliding_windows:
        top = hi if window is None else min(hi, window)
        below = (lo + top) * (top - lo + 1) // 2 if top >= lo else 0
        total += below + (0 if window is None else max(0, hi - max(lo - 1, window)) * window)
    return total


def kv_tokens(cfg: DecoderConfig, length: int) -> int:
    """Token slots of K/V a request of `length` tokens holds, summed over the layers."""
    return sum(min(length, w) if w else length for w in cfg.sliding_windows)


def limits(cfg: DecoderConfig, vision, args) -> dict:
    elem = 2  # bf16
    prompt = args.frames * (vision.mm_tokens_per_image + TOKENS_AROUND_A_FRAME) + args.text_tokens
    linears = step_cost(cfg, elem, [(0, prompt, True)]).linears
    attention_flops = 4 * cfg.num_heads * cfg.head_dim * attended_keys(cfg, 0, prompt)
    prefill = linears.flops + attention_flops
    frame = flops_per_image(vision)
    weights = linears.bytes  # what a decode step reads; the tower waits for frames
    resident = weights + vision_params(vision) * elem
    kv_per_answer = kv_tokens(cfg, prompt + args.answer_tokens // 2) * 2 * cfg.num_kv_heads * cfg.head_dim * elem
    rate, bandwidth = args.tflops * 1e12, args.tbps * 1e12
    decode_flops = args.answer_tokens * linears.flops / prompt  # 2 x every weight a token
    compute = (prefill + args.fps * frame + decode_flops) / rate  # device seconds a camera-second
    fixed = args.answer_tokens * weights / bandwidth  # the weights, read by every decode step
    per_answer = args.answer_tokens * kv_per_answer / bandwidth
    # the roofline: FLOPs and bytes overlap (the planner puts decodes beside prefill chunks)
    by_bytes = (1 - fixed) / per_answer if fixed < 1 else 0.0
    cameras = math.floor(min(1 / compute, by_bytes))
    serial = math.floor((1 - fixed) / (compute + per_answer)) if fixed < 1 else 0  # nothing overlapped
    return {"prompt_tokens": prompt, "prefill_TFLOP_per_question": prefill / 1e12,
            "prefill_ms_per_question": prefill / rate * 1e3, "siglip_TFLOP_per_frame": frame / 1e12,
            "siglip_ms_per_frame": frame / rate * 1e3, "weights_GB": resident / 1e9,
            "kv_GB_per_answer": kv_per_answer / 1e9,
            "decode_step_ms_at_limit": (weights + cameras * kv_per_answer) / bandwidth * 1e3,
            "compute_ms_per_camera_second": compute * 1e3, "decode_weights_ms_per_second": fixed * 1e3,
            "cameras_per_device": cameras, "bound": "compute" if 1 / compute <= by_bytes else "memory",
            "cameras_not_overlapped": serial, "ttft_floor_ms": (prefill + frame) / rate * 1e3}


def vision_params(vision) -> int:
    """The tower's and projector's weights: resident beside the decoder's, read only by the
    steps that encode frames (whose FLOPs, not bytes, bound them)."""
    t = vision.tower
    d = t.hidden_size
    layer = 4 * d * d + 2 * d * t.intermediate_size
    return (t.num_channels * t.patch_size**2 * d + t.num_patches * d + t.num_layers * layer
            + d * vision.text_hidden_size)


def print_table(name: str, args, r: dict) -> None:
    print(f"{name}: {args.frames} frames + {args.text_tokens} text tokens a question "
          f"({r['prompt_tokens']} tokens), {args.fps} new frames per camera-second, "
          f"{args.answer_tokens}-token answers; {args.tflops:g} TFLOP/s, {args.tbps:g} TB/s")
    print("| quantity | value |\n|---|---|")
    rows = [("prefill per question",
             f"{r['prefill_TFLOP_per_question']:.1f} TFLOP = {r['prefill_ms_per_question']:.0f} ms"),
            ("SigLIP per frame", f"{r['siglip_TFLOP_per_frame']:.2f} TFLOP = {r['siglip_ms_per_frame']:.1f} ms"),
            ("weights (decoder + tower)", f"{r['weights_GB']:.1f} GB"),
            ("K/V one answer reads a step", f"{r['kv_GB_per_answer']:.2f} GB"),
            ("decode: the weights, every step", f"{r['decode_weights_ms_per_second']:.0f} ms of each second"),
            ("one camera-second's FLOPs (prefill, frames, answer)",
             f"{r['compute_ms_per_camera_second']:.0f} ms of the device"),
            ("TTFT floor (prefill + one new frame)", f"{r['ttft_floor_ms']:.0f} ms"),
            ("**cameras (= questions/s) per device**", f"**{r['cameras_per_device']}** ({r['bound']}-bound)"),
            ("the same if decode's reads did not overlap the prefills", f"{r['cameras_not_overlapped']}"),
            ("decode step at that many", f"{r['decode_step_ms_at_limit']:.1f} ms")]
    for label, value in rows:
        print(f"| {label} | {value} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", required=True, help="a Gemma 3 vision checkpoint (config.json is enough)")
    parser.add_argument("--frames", type=int, default=8, help="frames a question is about")
    parser.add_argument("--fps", type=float, default=2.0, help="new frames per camera a second")
    parser.add_argument("--text-tokens", type=int, default=30, help="the question's own tokens")
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--tflops", type=float, default=790.0, help="matmul rate (bf16), TFLOP/s")
    parser.add_argument("--tbps", type=float, default=4.27, help="memory bandwidth, TB/s")
    parser.add_argument("--json", type=Path, help="write the numbers here")
    args = parser.parse_args(argv)
    vision = load_vision_config(args.model_dir)
    if vision is None:
        parser.error(f"{args.model_dir} has no vision tower: the camera workload needs one")
    result = limits(load_config(args.model_dir), vision, args)
    print_table(Path(args.model_dir).name, args, result)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
