"""Baseline for image requests: `transformers` `generate()` of a Gemma 3 vision checkpoint with
its processor, on static padded batches, offline.

    python bench/cameras/static_generate_images.py --model-dir models/gemma3-vision-small \
        --batch-size 8 --num-requests 16 --images-per-request 8 --output-tokens 32

The requests bench/stack/serve.py --images-per-request sends (bench/common/workloads.py's ImageSpec: the
same text, the same JPEG bytes, the same seed), cut into batches of --batch-size in order.
Each batch is timed from the JPEG bytes: decoding, the processor (chat template, image
preprocessing, left padding) and `generate()` with exactly --output-tokens new tokens (EOS
suppressed, as `--ignore-eos` does for the servers). A request's TTFT is its batch's first
token less the batch's start -- what bench/stack/serve.py measures from the moment a request is
sent when --concurrency is the batch size.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path

import torch
from PIL import Image
from transformers import AutoProcessor, Gemma3ForConditionalGeneration
from transformers.generation.streamers import BaseStreamer

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the repository root on sys.path, this folder off it (bench/README.md)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent)]

from bench.common.workloads import ImageRequest, ImageSpec, make_image_workload  # noqa: E402
from bench.stack.serve import percentiles  # noqa: E402


class FirstToken(BaseStreamer):
    """Notes when generate() hands over its first new tokens (its first put() is the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first_at: float | None = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_at = time.perf_counter()

    def end(self) -> None:
        pass


def processor_inputs(processor, batch: list[ImageRequest], device: torch.device):
    """The batch as the processor makes it: the chat template over a text part and one image
    part per frame (what the servers' chat templates see), the frames decoded from their bytes."""
    texts, images = [], []
    for r in batch:
        messages = [{"role": "user", "content": [{"type": "text", "text": r.text},
                                                 *({"type": "image"} for _ in r.images)]}]
        texts.append(processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        images.append([Image.open(io.BytesIO(b)).convert("RGB") for b in r.images])
    return processor(text=texts, images=images, padding=True, add_special_tokens=False,
                     return_tensors="pt").to(device)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--images-per-request", type=int, default=1)
    p.add_argument("--image-width", type=int, default=640)
    p.add_argument("--image-height", type=int, default=480)
    p.add_argument("--image-quality", type=int, default=85)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-seed", type=int, default=999_999, help="the warm-up request's frames")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--device", default="cpu", help="cpu|cuda|cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's)|float32|bfloat16|float16")
    p.add_argument("--label", default="transformers generate (static batches)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    def spec(num_requests: int, seed: int) -> ImageSpec:
        return ImageSpec(num_requests=num_requests, images_per_request=args.images_per_request,
                         width=args.image_width, height=args.image_height, quality=args.image_quality,
                         output_tokens=args.output_tokens, seed=seed)

    workload = make_image_workload(spec(args.num_requests, args.seed))
    device = torch.device(args.device)
    model = Gemma3ForConditionalGeneration.from_pretrained(args.model_dir, dtype=args.dtype).to(device).eval()
    processor = AutoProcessor.from_pretrained(args.model_dir)
    processor.tokenizer.padding_side = "left"
    pad = processor.tokenizer.pad_token_id or 0
    with torch.no_grad():  # warm-up, as the servers get: allocators, lazy init, the vision tower's first call
        model.generate(**processor_inputs(processor, make_image_workload(spec(1, args.warmup_seed)), device),
                       max_new_tokens=4, do_sample=False, pad_token_id=pad)
    useful, ttfts = 0, []
    start = time.perf_counter()
    for i in range(0, len(workload), args.batch_size):
        batch = workload[i:i + args.batch_size]
        batch_start = time.perf_counter()
        inputs = processor_inputs(processor, batch, device)
        new = max(r.max_tokens for r in batch)
        first = FirstToken()
        with torch.no_grad():
            model.generate(**inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=pad, streamer=first)
        ttfts += [first.first_at - batch_start] * len(batch)
        useful += sum(r.max_tokens for r in batch)
        print(f"\rbatch {i // args.batch_size + 1}/{-(-len(workload) // args.batch_size)}", end="",
              file=sys.stderr, flush=True)
    duration = time.perf_counter() - start
    print(file=sys.stderr)
    n = len(workload)
    result = {"label": args.label, "num_requests": n, "failed": 0, "batch_size": args.batch_size,
              "images_per_request": args.images_per_request, "image_size": [args.image_width, args.image_height],
              "duration_s": duration, "request_throughput": n / duration,
              "image_throughput": n * args.images_per_request / duration,
              "output_throughput": useful / duration, "total_output_tokens": useful,
              "ttft_s": percentiles(ttfts), "args": vars(args)}
    print(f"{args.label}: {n} requests of {args.images_per_request} image(s) in {duration:.1f}s — "
          f"{result['request_throughput']:.2f} req/s, {result['output_throughput']:.1f} output tok/s, "
          f"TTFT p50 {result['ttft_s']['p50'] * 1000:.0f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
