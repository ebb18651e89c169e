"""What a camera frame the stack already holds costs a question: the gateway's CPU per image
part and the time to first token added per frame.

    python bench/cameras/frame_path.py --frames 6 --rounds 20

Starts the stack as `make up` does (bench/stack/token_path.py's way) on a tiny Gemma 3 vision
model made in a temporary folder (unless --model-dir names one), sends the --frames camera
frames (distinct 640x480 JPEGs, as data URLs) once so that they are stored and encoded, then
--rounds times, one request at a time, in turn: the same question with those frames again
(as a camera's sliding window re-sends them), and the question as text alone; each streams
one token. Reported: the median TTFT of each and their difference per frame, and the
gateway's CPU per request of each (from /proc) and their difference per image part.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the repository root on sys.path, this folder off it (bench/README.md)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent)]

from bench.common.proc_cpu import cpu_by_process, cpu_used  # noqa: E402
from compose.launcher import Stack, StackConfig, free_port  # noqa: E402

QUESTION = "What moved between these frames?"


def frames(count: int, seed: int = 0) -> list[str]:
    """`count` distinct 640x480 JPEG data URLs (noise over a gradient: a camera-like size)."""
    rng = numpy.random.default_rng(seed)
    urls = []
    for _ in range(count):
        pixels = (numpy.linspace(0, 255, 640)[None, :, None] + rng.integers(0, 60, (480, 640, 3))).clip(0, 255)
        out = io.BytesIO()
        Image.fromarray(pixels.astype(numpy.uint8)).save(out, format="JPEG", quality=85)
        urls.append("data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode())
    return urls


def _body(model: str, images: list[str]) -> dict:
    content = [*({"type": "image_url", "image_url": {"url": u}} for u in images), {"type": "text", "text": QUESTION}]
    return {"model": model, "max_tokens": 1, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": content}]}


def _ttft(client: httpx.Client, body: dict) -> float:
    start = time.perf_counter()
    with client.stream("POST", "/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read()[:300]!r}")
        for line in response.iter_lines():
            if '"content":"' in line and '"role"' not in line:
                return time.perf_counter() - start
    raise RuntimeError("no token came")


def _gateway_cpu() -> float:
    """CPU seconds the gateway process has used so far."""
    return cpu_used({}, cpu_by_process(os.getpid())).get("gateway", 0.0)


def measure(stack: Stack, count: int, rounds: int) -> dict:
    images = frames(count)
    model = stack.served_model_name
    with httpx.Client(base_url=stack.base_url, timeout=120) as client:
        _ttft(client, _body(model, images))  # stored and encoded once
        _ttft(client, _body(model, []))
        ttft = {"frames": [], "text": []}
        cpu = {"frames": 0.0, "text": 0.0}
        for _ in range(rounds):
            for kind, body in (("frames", _body(model, images)), ("text", _body(model, []))):
                before = _gateway_cpu()
                ttft[kind].append(_ttft(client, body))
                cpu[kind] += _gateway_cpu() - before
    median = {kind: statistics.median(values) for kind, values in ttft.items()}
    per_request = {kind: seconds / rounds for kind, seconds in cpu.items()}
    return {
        "frames": count, "rounds": rounds,
        "ttft_ms": {kind: round(1e3 * v, 2) for kind, v in median.items()},
        "ttft_ms_added_per_frame": round(1e3 * (median["frames"] - median["text"]) / count, 2),
        "gateway_cpu_ms_per_request": {kind: round(1e3 * v, 2) for kind, v in per_request.items()},
        "gateway_cpu_ms_per_image_part": round(1e3 * (per_request["frames"] - per_request["text"]) / count, 2),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, help="a vision checkpoint (default: the tiny Gemma 3 made here)")
    p.add_argument("--frames", type=int, default=6, help="frames per question (already stored)")
    p.add_argument("--rounds", type=int, default=20, help="questions of each kind, in turn")
    p.add_argument("--out", type=Path, help="write the JSON report here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="frame-path-") as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            from tools.make_model import make_model
            model_dir = make_model(Path(tmp) / "tiny-vision", preset="tiny", arch="gemma3-vision", seed=0)
        config = StackConfig(model=str(model_dir), port=free_port(), run_dir=Path(tmp) / "run",
                             worker_args=("--threads", "1"), startup_timeout_s=300)
        with Stack(config) as stack:
            report = measure(stack, args.frames, args.rounds)
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
