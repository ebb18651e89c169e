"""Benchmark workloads, made locally and deterministically (no dataset is downloaded).

Each request is (prompt token ids, max output tokens). Kinds:
  random         input/output lengths uniform in mean·(1 ± spread)
  shared-prefix  one system prompt shared by every request (--shared-fraction of the input),
                 then a unique tail — what prefix caching is for
  long-prompt    long inputs (mean 1536 by default), short outputs
  sharegpt       lengths shaped like ShareGPT conversations: log-normal inputs (median ~190
                 tokens) and outputs (median ~150), clipped to the context
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

KINDS = ("random", "shared-prefix", "long-prompt", "sharegpt")


@dataclass(frozen=True)
class WorkloadSpec:
    kind: str = "random"
    num_requests: int = 96
    input_mean: int = 256
    output_mean: int = 128
    spread: float = 0.5
    shared_fraction: float = 0.9
    token_low: int = 300  # prompt ids are drawn from [token_low, token_high): ordinary tokens
    token_high: int = 30000
    max_model_len: int = 2048
    seed: int = 0


def make_workload(spec: WorkloadSpec, tokenizer_dir: str | None = None) -> list[tuple[list[int], int]]:
    """The requests of `spec`. With a tokenizer, ids are drawn below its vocabulary's size
    too (decode drops ids it does not know), and every prompt is replaced by the ids its text
    encodes to (encode(decode(ids))), so a server that takes only text sees the same tokens."""
    if tokenizer_dir is None:
        return _draw(spec)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    workload = _draw(replace(spec, token_high=min(spec.token_high, len(tokenizer))))
    return [(tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False), n) for ids, n in workload]


def _draw(spec: WorkloadSpec) -> list[tuple[list[int], int]]:
    rng = random.Random(spec.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(spec.token_low, spec.token_high) for _ in range(n)]

    def around(mean: float) -> int:
        return max(1, int(rng.uniform(mean * (1 - spec.spread), mean * (1 + spec.spread))))

    def fit(n_in: int, n_out: int) -> tuple[int, int]:
        n_in = max(1, min(n_in, spec.max_model_len - 2))
        return n_in, max(1, min(n_out, spec.max_model_len - n_in))

    out = []
    if spec.kind == "random":
        for _ in range(spec.num_requests):
            n_in, n_out = fit(around(spec.input_mean), around(spec.output_mean))
            out.append((tokens(n_in), n_out))
    elif spec.kind == "shared-prefix":
        shared = tokens(min(int(spec.input_mean * spec.shared_fraction), spec.max_model_len - 3))
        for _ in range(spec.num_requests):
            n_in, n_out = fit(len(shared) + max(1, spec.input_mean - len(shared)), around(spec.output_mean))
            out.append((shared + tokens(n_in - len(shared)), n_out))
    elif spec.kind == "long-prompt":
        for _ in range(spec.num_requests):
            n_in, n_out = fit(around(max(spec.input_mean, 1536)), around(min(spec.output_mean, 64)))
            out.append((tokens(n_in), n_out))
    elif spec.kind == "sharegpt":
        for _ in range(spec.num_requests):
            n_in = int(rng.lognormvariate(math.log(190), 0.9))
            n_out = int(rng.lognormvariate(math.log(150), 0.8))
            n_in, n_out = fit(max(4, n_in), max(4, min(n_out, 1024)))
            out.append((tokens(n_in), n_out))
    else:
        raise ValueError(f"unknown workload kind {spec.kind!r}; one of {', '.join(KINDS)}")
    return out


# ---- image requests (chat with camera frames) ------------------------------------------------

@dataclass(frozen=True)
class ImageSpec:
    """Chat requests of a short text and `images_per_request` synthetic camera frames each
    (JPEG, width x height), every frame distinct, the same bytes for every contender."""

    num_requests: int = 16
    images_per_request: int = 1
    width: int = 640
    height: int = 480
    quality: int = 85  # JPEG quality, as a camera pipeline might encode
    output_tokens: int = 32  # max_tokens of every request
    seed: int = 0


@dataclass(frozen=True)
class ImageRequest:
    text: str  # the user's words, before the images
    images: tuple[bytes, ...]  # JPEG files
    max_tokens: int


QUESTIONS = ("What does the robot see in front of it?", "Is the gripper holding anything?",
             "Where is the red box on the table?", "Describe the scene in one sentence.",
             "Has anything moved since the last frame?", "How many objects are on the table?",
             "Is the path ahead clear?", "What color is the nearest object?")


def camera_frame(seed: int, width: int, height: int, quality: int = 85) -> bytes:
    """A deterministic JPEG that compresses like a camera frame, not like noise: a lit
    background (wall above a floor), a few boxes and discs in front of it, sensor noise.
    640x480 at quality 85 comes to ~26 KB (uniform noise of that size: ~230 KB)."""
    import io

    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    horizon = int(height * rng.uniform(0.35, 0.65))
    rows = np.arange(height, dtype=np.float32)[:, None, None]
    wall, floor = rng.uniform(60, 220, 3), rng.uniform(30, 160, 3)
    shade = np.where(rows < horizon, wall * (0.75 + 0.25 * rows / max(horizon, 1)),
                     floor * (0.6 + 0.4 * (rows - horizon) / max(height - horizon, 1)))
    pixels = np.broadcast_to(shade, (height, width, 3)).copy()
    image = Image.fromarray(pixels.clip(0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(3, 7))):
        w, h = (int(rng.uniform(0.08, 0.3) * d) + 1 for d in (width, height))
        x, y = int(rng.integers(0, max(width - w, 1))), int(rng.integers(0, max(height - h, 1)))
        color = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.rectangle if rng.random() < 0.6 else draw.ellipse)([x, y, x + w, y + h], fill=color)
    noisy = np.asarray(image, dtype=np.float32) + 3.0 * rng.standard_normal((height, width, 3), dtype=np.float32)
    out = io.BytesIO()
    Image.fromarray(noisy.clip(0, 255).astype(np.uint8)).save(out, format="JPEG", quality=quality)
    return out.getvalue()


def make_image_workload(spec: ImageSpec) -> list[ImageRequest]:
    """The requests of `spec`: request i asks QUESTIONS[i % 8] (with its number, so no two
    prompts share more than the chat template's first tokens) about its own frames."""
    out = []
    for i in range(spec.num_requests):
        frames = tuple(camera_frame(spec.seed * 1_000_003 + i * 1_009 + k, spec.width, spec.height, spec.quality)
                       for k in range(spec.images_per_request))
        text = f"Request {i}: {QUESTIONS[i % len(QUESTIONS)]}"
        out.append(ImageRequest(text=text, images=frames, max_tokens=spec.output_tokens))
    return out
