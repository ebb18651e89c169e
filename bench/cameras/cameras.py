"""Camera streams: K cameras, each F frames a second, each asking every T seconds a short
question about its last N frames -- a robot's perception loop -- against a vision model.

    pagedserve make-model models/gemma3-vision-small --arch gemma3-vision --preset small
    pagedserve up --model models/gemma3-vision-small --port 8000 [--encoders 1]   # prints every metrics URL
    python bench/cameras/cameras.py --base-url http://127.0.0.1:8000/v1 --model gemma3-vision-small \
        --cameras 4 --fps 2 --ask-every 1 --frames 8 --duration 60 [--upload] \
        --metrics-url http://127.0.0.1:8000/metrics http://127.0.0.1:PORT/metrics ... --json cams.json

Frames: synthetic --width x --height JPEGs (bench/common/workloads.py's camera_frame as each
camera's scene, a box and a disc moving across it, the camera, frame number and seed written
in), every frame distinct, all made and base64-encoded before the clock starts. Frame i of a
camera is captured at (i - N + 1) / F seconds, so the first question already has N frames.
Camera k asks at k·T/K + j·T (the cameras staggered) for j = 0, 1, ... while that is under
--duration: one chat completion, streamed, greedy, ignore_eos, --max-tokens out: a text part
(camera, question number), the last N frames, the camera's question. Four modes, one at a time:

  uuid mode (default)  the frames as `image_url` parts, each with the uuid `s<seed>-cam<k>-<i>`:
                       a frame not sent yet goes with its data, a frame already sent by its
                       uuid alone (`"image_url": null`; docs/models.md: "A camera stream"). A frame
                       counts as sent once a question holding it has been answered.
  --no-uuid            every frame's data in every question (what other servers need)
  --upload             each camera uploads each frame (`POST /v1/files`, purpose "vision") at
                       its capture time, one upload after another (bench/cameras/camera_uploads.py;
                       the frames captured before the start are uploaded before the clock
                       starts), and its questions name the frames by `file_id` (chat `file`
                       parts): a question never carries pixels. A question waits until the
                       uploads of its frames have returned (one late to return delays it; a
                       frame whose upload failed is left out of it). Every file is deleted at
                       the end (best effort). The pattern the encoder service is for
                       (`pagedserve up --encoders 1`): it encodes each upload as it is stored,
                       before a question names it.
  --text-only          no frames: a text of the same prompt length in tokens (calibrated on
                       the gateway's /tokenize against the warm-up's image prompts), so TTFT
                       can be compared with and without images

Late questions are SKIPPED: at most one question per camera is in flight; when a camera's
time to ask comes while its previous question is still being answered, that question is not
sent (a robot acts on fresh frames; a queue would only grow) and counts as skipped. The
next one goes at its own time, about the frames of then. The run ends when the last question
sent has its answer. Before the clock starts, one warm-up question per camera (frames of its
own, data, no uuid; --upload: uploaded once and named by file_id) gives each camera's image
prompt length; its work is before the metrics' first scrape.

Measured per question: TTFT (the first token, return_token_ids) and the answer's latency,
from the moment it is sent; the send's lag behind its schedule; frames sent with data, by
uuid or by file_id, bytes of frame data in the questions; --upload: each upload's latency
(sent to answered) and lag behind its frame's capture, failures, and how long each question
waited for its frames' uploads. From --metrics-url (bench/cameras/camera_metrics.py: the gateway's
/metrics, each vision worker's and each encoder service's, as `pagedserve up` prints them),
scraped before and after (after: once no encoder has a job left): frames the gateway
received (decoded), stored, found stored (reused), named by uuid (uploads are not among
them); frames encoded by the workers and by the encoder services (`mm_items_encoded_total`
by its `worker` / `encoder` label), the frames the workers' steps needed and those found
ready (in their encoder cache, or published by an encoder service), their own encoder-cache
hits, and the busy seconds of each kind of encoding (`encoder_seconds_sum`); each encoder
service's embeddings published, found published, failed, and its jobs left. The check
(bench/cameras/camera_report.py): every distinct frame encoded exactly once, by the workers and the
encoders together (encoded == distinct frames; --upload with an encoder's /metrics: every
frame uploaded, asked about or not), which holds in every mode (the store and the encoder
cache go by the bytes' hash), if no run before this one against the same server sent the
same frames: the default seed is new every run.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
import httpx
import uvloop

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the repository root on sys.path, this folder off it (bench/README.md)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent)]

from bench.cameras.camera_metrics import scrape_all, server_counters, settle  # noqa: E402,F401
from bench.cameras.camera_report import pctl, report, summarize  # noqa: E402,F401
from bench.cameras.camera_uploads import CameraUploads, file_parts, upload_file  # noqa: E402
from bench.common.workloads import QUESTIONS, camera_frame  # noqa: E402
from bench.stack.serve import RequestResult, one  # noqa: E402

FILLER = ("red", "box", "left", "of", "the", "blue", "disc", "near", "wall", "floor", "moved", "still")
WARMUP_SEED_OFFSET = 7_777_777  # the warm-up's frames are none of the run's


@dataclass
class Question:
    camera: int
    index: int
    at_s: float  # when it was due, from the start
    lag_s: float = 0.0  # sent this late (the client's own delay)
    newest_frame: int = 0
    with_data: int = 0
    by_uuid: int = 0
    by_file: int = 0  # --upload: frames named by file_id
    missing: int = 0  # --upload: frames left out, their upload failed
    upload_wait_s: float = 0.0  # --upload: waited this long for its frames' uploads
    upload_bytes: int = 0  # base64 frame data in the request
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    error: str | None = None


def draw_frames(seed: int, camera: int, count: int, width: int, height: int, quality: int) -> list[str]:
    """`count` distinct JPEG frames of one camera, as base64: its scene with a box and a disc
    moving across it and its name, the frame number and the seed written in."""
    from PIL import Image, ImageDraw, ImageFont

    scene = Image.open(io.BytesIO(camera_frame(seed * 1_000 + camera, width, height, quality))).convert("RGB")
    font = ImageFont.load_default(size=max(10, height // 16))
    frames = []
    for i in range(count):
        image = scene.copy()
        draw = ImageDraw.Draw(image)
        x = int((i * 0.05 + camera * 0.25 + seed * 0.01) % 1.0 * (width * 0.8))
        y = int((0.5 + 0.3 * math.sin(i * 0.4 + camera)) * height * 0.8)
        draw.rectangle([x, height // 3, x + width // 6, height // 3 + height // 5], fill=(200, 40, 40))
        draw.ellipse([width - x - width // 8, y, width - x, y + width // 8], fill=(40, 60, 220))
        draw.text((8, 8), f"cam {camera} frame {i} seed {seed}", fill=(255, 255, 0), font=font)
        out = io.BytesIO()
        image.save(out, format="JPEG", quality=quality)
        frames.append(base64.b64encode(out.getvalue()).decode())
    return frames


def schedule(args) -> list[tuple[float, int, int]]:
    """Every question due: (seconds from the start, camera, its index), in time order."""
    times = []
    for k in range(args.cameras):
        offset = k * args.ask_every / args.cameras
        times += [(offset + j * args.ask_every, k, j)
                  for j in range(max(0, math.ceil((args.duration - offset) / args.ask_every)))]
    return sorted(times)


def newest_frame(args, at_s: float) -> int:
    return args.frames - 1 + math.floor(at_s * args.fps + 1e-9)


def header(seed: int, camera: int, index: int, first: int) -> str:
    """The question's own words first: no two prompts, of this run or another, share more
    than the chat template's first tokens (no prefix-cache hit in text-only mode either)."""
    return f"Run {seed:06d}, camera {camera}, question {index:04d}, frames from {first:05d}:"


def question(camera: int) -> str:
    return QUESTIONS[camera % len(QUESTIONS)] + " Answer briefly."


def image_messages(args, frames: list[str], camera: int, index: int, window: range,
                   sent: set[int] | None, q: Question) -> list[dict]:
    """The question with frames `window`; `sent` (uuid mode): the frames to name by uuid."""
    parts: list[dict] = [{"type": "text", "text": header(args.seed, camera, index, window.start)}]
    for i in window:
        part: dict = {"type": "image_url", "image_url": None}
        if sent is None or i not in sent:
            part["image_url"] = {"url": "data:image/jpeg;base64," + frames[i]}
            q.with_data, q.upload_bytes = q.with_data + 1, q.upload_bytes + len(frames[i])
        else:
            q.by_uuid += 1
        if sent is not None:
            part["uuid"] = f"s{args.seed}-cam{camera}-{i}"
        parts.append(part)
    parts.append({"type": "text", "text": question(camera)})
    return [{"role": "user", "content": parts}]


def file_messages(args, camera: int, index: int, window: range, file_ids: list[str | None],
                  q: Question) -> list[dict]:
    """The question naming frames `window` by the ids of their uploads (None: failed, left out)."""
    files = file_parts(file_ids)
    q.by_file, q.missing = len(files), len(file_ids) - len(files)
    return [{"role": "user", "content": [{"type": "text", "text": header(args.seed, camera, index, window.start)},
                                         *files, {"type": "text", "text": question(camera)}]}]


def text_message(seed: int, camera: int, index: int, first: int, words: int) -> list[dict]:
    filler = " ".join(FILLER[i % len(FILLER)] for i in range(words))
    return [{"role": "user", "content": f"{header(seed, camera, index, first)} {filler} {question(camera)}"}]


async def filler_words(client: httpx.AsyncClient, args, camera: int, target: int) -> tuple[int, int]:
    """How many filler words make camera `camera`'s text question `target` tokens long (the
    gateway's /tokenize), and the length that gives (the nearest reached, if not exact)."""
    root = args.base_url.rstrip("/").removesuffix("/v1")

    async def count(words: int) -> int:
        reply = await client.post(f"{root}/tokenize", json={"model": args.model,
                                                            "messages": text_message(args.seed, camera, 0, 0, words)})
        reply.raise_for_status()
        return reply.json()["count"]

    base = await count(0)
    words = max(0, target - base)  # a token a word, first
    n = await count(words) if words else base
    per_word = (n - base) / words if words and n > base else 1.0
    best = (words, n)
    for _ in range(10):
        if n == target:
            break
        step = round((target - n) / per_word) or (1 if n < target else -1)
        words = max(0, words + step)
        n = await count(words)
        if abs(n - target) < abs(best[1] - target):
            best = (words, n)
    return best


async def warm_up(client: httpx.AsyncClient, args) -> tuple[list[int], list[str]]:
    """One question per camera with frames of its own (data, no uuid; --upload: uploaded
    once, named by file_id), all at once: the image prompt length of each camera's
    questions, and the warm-up's files."""
    frames = draw_frames(args.seed + WARMUP_SEED_OFFSET, 0, args.frames, args.width, args.height, args.quality)
    ids: list[str] = []
    if args.upload:
        try:
            ids = list(await asyncio.gather(*(upload_file(client, args, f"warm-up-{i}.jpg", base64.b64decode(f))
                                              for i, f in enumerate(frames))))
        except Exception as exc:
            raise SystemExit(f"the warm-up's upload failed: {exc}") from None

    async def ask(k: int) -> RequestResult:
        q, window = Question(k, 0, 0.0), range(args.frames)
        messages = file_messages(args, k, 0, window, ids, q) if args.upload else \
            image_messages(args, frames, k, 0, window, None, q)
        return await one(client, args, messages, 0, args.max_tokens)

    results = await asyncio.gather(*(ask(k) for k in range(args.cameras)))
    if failed := [r.error for r in results if r.error]:
        raise SystemExit(f"the warm-up failed: {failed[0]}")
    return [r.prompt_tokens for r in results], ids


async def run(args) -> dict:
    if args.seed is None:
        args.seed = random.randrange(1_000_000)
    plan = schedule(args)
    total = newest_frame(args, args.duration) + 1
    frames = [] if args.text_only else [draw_frames(args.seed, k, total, args.width, args.height, args.quality)
                                        for k in range(args.cameras)]
    client = httpx.AsyncClient(base_url=args.base_url.rstrip("/") + "/", timeout=3600,
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
    image_tokens, warmup_files = await warm_up(client, args)
    words = [await filler_words(client, args, k, image_tokens[k]) for k in range(args.cameras)] \
        if args.text_only else []
    uploads = None
    if args.upload:  # each camera's frames up to the newest one a question of its can name
        last = [max((newest_frame(args, at_s) for at_s, k2, _ in plan if k2 == k), default=-1)
                for k in range(args.cameras)]
        uploads = CameraUploads(client, args, [[base64.b64decode(f) for f in camera] for camera in frames], last)
    before = settle(args.metrics_url)  # the warm-up's counters in, on the gateway's page too
    if uploads is not None:
        await uploads.preroll()
    sent: list[set[int]] = [set() for _ in range(args.cameras)]
    questions: list[Question] = []
    skipped: list[tuple[int, int]] = []
    in_flight: list[asyncio.Task | None] = [None] * args.cameras
    cpu0, start = time.process_time(), time.perf_counter()
    if uploads is not None:
        uploads.start(start)

    async def ask(q: Question) -> None:
        newest = newest_frame(args, q.at_s)
        window = range(max(0, newest - args.frames + 1), newest + 1)
        q.newest_frame, q.lag_s = newest, time.perf_counter() - start - q.at_s
        if args.text_only:
            messages = text_message(args.seed, q.camera, q.index, window.start, words[q.camera][0])
        elif uploads is not None:
            file_ids = await uploads.ready(q.camera, window)
            q.upload_wait_s = time.perf_counter() - start - q.at_s - q.lag_s
            messages = file_messages(args, q.camera, q.index, window, file_ids, q)
        else:
            messages = image_messages(args, frames[q.camera], q.camera, q.index, window,
                                      None if args.no_uuid else sent[q.camera], q)
        r = await one(client, args, messages, 0, args.max_tokens)
        q.prompt_tokens, q.output_tokens, q.ttft_s, q.latency_s, q.error = (
            r.prompt_tokens, r.output_tokens, r.ttft_s, r.latency_s, r.error)
        if r.error is None and not args.text_only:
            sent[q.camera].update(window)

    for at_s, k, j in plan:
        await asyncio.sleep(max(0.0, start + at_s - time.perf_counter()))
        if in_flight[k] is not None and not in_flight[k].done():
            skipped.append((k, j))  # the camera's previous question is still being answered
            continue
        q = Question(k, j, at_s)
        questions.append(q)
        in_flight[k] = asyncio.create_task(ask(q))
    await asyncio.gather(*(t for t in in_flight if t is not None))
    wall_s, client_cpu_s = time.perf_counter() - start, time.process_time() - cpu0
    if uploads is not None:
        await uploads.finish()  # every frame a question was due to name (one skipped at the end too)
    after = settle(args.metrics_url)  # the encoders done with every frame stored
    if uploads is not None:
        await uploads.delete_all(warmup_files)
    await client.aclose()
    return summarize(args, plan, questions, skipped, sent, wall_s, client_cpu_s,
                     server_counters(before, after), image_tokens, words, uploads)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default="gemma3-vision-small", help="the `model` field sent")
    p.add_argument("--api-key", default="unused")
    p.add_argument("--cameras", type=int, default=4, help="K")
    p.add_argument("--fps", type=float, default=2.0, help="F: frames a second from each camera")
    p.add_argument("--ask-every", type=float, default=1.0, help="T: seconds between a camera's questions")
    p.add_argument("--frames", type=int, default=8, help="N: the last N frames in each question")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of questions")
    p.add_argument("--width", type=int, default=640)
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--quality", type=int, default=85, help="JPEG quality")
    p.add_argument("--max-tokens", type=int, default=16, help="each answer's length (ignore_eos)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--no-uuid", action="store_true", help="every frame's data in every question")
    mode.add_argument("--text-only", action="store_true", help="a text of the same token length, no frames")
    mode.add_argument("--upload", action="store_true",
                      help="each frame uploaded (POST /v1/files) at its capture time, named by file_id")
    p.add_argument("--seed", type=int, help="the frames' (default: new every run, so no cache knows them)")
    p.add_argument("--metrics-url", nargs="+",
                   help="/metrics pages to read before and after (default: the gateway's); add each vision "
                        "worker's and each encoder service's (`pagedserve up` prints them) for the encoding "
                        "counters")
    p.add_argument("--json", help="write every number (and every question) here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.metrics_url = args.metrics_url or [args.base_url.rstrip("/").removesuffix("/v1") + "/metrics"]
    args.ignore_eos = args.token_ids = True  # what bench/stack/serve.py's `one` reads
    result = uvloop.run(run(args))
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 1 if result["questions_failed"] or result.get("uploads_failed") else 0


if __name__ == "__main__":
    sys.exit(main())
