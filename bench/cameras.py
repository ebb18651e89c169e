"""Camera streams: K cameras, each F frames a second, each asking every T seconds a short
question about its last N frames -- a robot's perception loop -- against a vision model.

    pagedserve make-model models/gemma3-vision-small --arch gemma3-vision --preset small
    pagedserve up --model models/gemma3-vision-small --port 8000     # prints every metrics URL
    python bench/cameras.py --base-url http://127.0.0.1:8000/v1 --model gemma3-vision-small \
        --cameras 4 --fps 2 --ask-every 1 --frames 8 --duration 60 \
        --metrics-url http://127.0.0.1:8000/metrics http://127.0.0.1:PORT/metrics --json cams.json

Frames: synthetic --width x --height JPEGs (bench/workloads.py's camera_frame as each
camera's scene, a box and a disc moving across it, the camera, frame number and seed written
in), every frame distinct, all made and base64-encoded before the clock starts. Frame i of a
camera is captured at (i - N + 1) / F seconds, so the first question already has N frames.
Camera k asks at k·T/K + j·T (the cameras staggered) for j = 0, 1, ... while that is under
--duration: one chat completion, streamed, greedy, ignore_eos, --max-tokens out: a text part
(camera, question number), the last N frames as `image_url` parts, the camera's question.

  uuid mode (default)  each frame carries the uuid `s<seed>-cam<k>-<i>`: a frame not sent yet
                       goes with its data, a frame already sent by its uuid alone
                       (`"image_url": null`; README: "A camera stream"). A frame counts as
                       sent once a question holding it has been answered.
  --no-uuid            every frame's data in every question (what other servers need)
  --text-only          no frames: a text of the same prompt length in tokens (calibrated on
                       the gateway's /tokenize against the warm-up's image prompts), so TTFT
                       can be compared with and without images

Late questions are SKIPPED: at most one question per camera is in flight; when a camera's
time to ask comes while its previous question is still being answered, that question is not
sent (a robot acts on fresh frames; a queue would only grow) and counts as skipped. The
next one goes at its own time, about the frames of then. The run ends when the last question
sent has its answer. Before the clock starts, one warm-up question per camera (frames of its
own, data, no uuid) gives each camera's image prompt length; its work is before the metrics'
first scrape.

Measured per question: TTFT (the first token, return_token_ids) and the answer's latency,
from the moment it is sent; the send's lag behind its schedule; frames sent with data and by
uuid, bytes of frame data uploaded. From --metrics-url (the gateway's /metrics, and each
vision worker's --metrics-port: the encoder's counters are only there), scraped before and
after: frames the gateway received (decoded), stored, found stored (reused), named by uuid;
frames the worker encoded, encoder-cache hits, the encoder's busy seconds. The check: every
distinct frame sent encoded exactly once (encoded == distinct frames), which holds in both
modes (the store and the encoder cache go by the bytes' hash), if no run before this one
against the same server sent the same frames: the default seed is new every run.
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
from dataclasses import asdict, dataclass
from pathlib import Path
import httpx
import uvloop

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the repository before bench/: bench/kernels.py must not shadow kernels/
sys.path.append(str(HERE))

from proto.metrics_scrape import Samples, metric, scrape  # noqa: E402
from serve import RequestResult, one, percentiles  # noqa: E402  (bench/serve.py)
from workloads import QUESTIONS, camera_frame  # noqa: E402

COUNTERS = {  # what the summary calls it → the metric, summed over every --metrics-url
    "received": "pagedserve:mm_images_received_total",  # gateway: fetched, decoded, checked
    "stored": "pagedserve:mm_items_stored_total", "reused": "pagedserve:mm_items_reused_total",
    "stored_bytes": "pagedserve:mm_stored_bytes_total", "by_uuid": "pagedserve:mm_media_by_uuid_total",
    "encoded": "pagedserve:mm_items_encoded_total", "cache_hits": "pagedserve:encoder_cache_hits_total",  # worker
    "encoder_s": "pagedserve:encoder_seconds_sum", "encoder_steps": "pagedserve:encoder_seconds_count"}
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


async def warm_up(client: httpx.AsyncClient, args) -> list[int]:
    """One question per camera with frames of its own (data, no uuid), all at once: the
    image prompt length of each camera's questions."""
    frames = draw_frames(args.seed + WARMUP_SEED_OFFSET, 0, args.frames, args.width, args.height, args.quality)

    async def ask(k: int) -> RequestResult:
        messages = image_messages(args, frames, k, 0, range(args.frames), None, Question(k, 0, 0.0))
        return await one(client, args, messages, 0, args.max_tokens)

    results = await asyncio.gather(*(ask(k) for k in range(args.cameras)))
    if failed := [r.error for r in results if r.error]:
        raise SystemExit(f"the warm-up failed: {failed[0]}")
    return [r.prompt_tokens for r in results]


def scrape_all(urls: list[str]) -> list[Samples]:
    return [scrape(url) for url in urls]


def server_counters(before: list[Samples], after: list[Samples]) -> dict[str, float | None]:
    """Each counter's growth, summed over the URLs that export it; None where none does."""
    out: dict[str, float | None] = {}
    for key, name in COUNTERS.items():
        pairs = [(b, a) for b, a in zip(before, after) if any(n == name for n, _ in a)]
        out[key] = sum(metric(a, name) - metric(b, name) for b, a in pairs) if pairs else None
    return out


async def run(args) -> dict:
    if args.seed is None:
        args.seed = random.randrange(1_000_000)
    plan = schedule(args)
    total = newest_frame(args, args.duration) + 1
    frames = [] if args.text_only else [draw_frames(args.seed, k, total, args.width, args.height, args.quality)
                                        for k in range(args.cameras)]
    client = httpx.AsyncClient(base_url=args.base_url.rstrip("/") + "/", timeout=3600,
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
    image_tokens = await warm_up(client, args)
    words = [await filler_words(client, args, k, image_tokens[k]) for k in range(args.cameras)] \
        if args.text_only else []
    before = scrape_all(args.metrics_url)
    sent: list[set[int]] = [set() for _ in range(args.cameras)]
    questions: list[Question] = []
    skipped: list[tuple[int, int]] = []
    in_flight: list[asyncio.Task | None] = [None] * args.cameras
    cpu0, start = time.process_time(), time.perf_counter()

    async def ask(q: Question) -> None:
        newest = newest_frame(args, q.at_s)
        window = range(max(0, newest - args.frames + 1), newest + 1)
        if args.text_only:
            messages = text_message(args.seed, q.camera, q.index, window.start, words[q.camera][0])
        else:
            messages = image_messages(args, frames[q.camera], q.camera, q.index, window,
                                      None if args.no_uuid else sent[q.camera], q)
        q.newest_frame, q.lag_s = newest, time.perf_counter() - start - q.at_s
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
    await client.aclose()
    after = scrape_all(args.metrics_url)
    return summarize(args, plan, questions, skipped, sent, wall_s, client_cpu_s,
                     server_counters(before, after), image_tokens, words)


def summarize(args, plan, questions: list[Question], skipped, sent, wall_s: float, client_cpu_s: float,
              server: dict, image_tokens: list[int], words: list[tuple[int, int]]) -> dict:
    ok = [q for q in questions if q.error is None]
    distinct = sum(len({i for q in questions if q.camera == k
                        for i in range(max(0, q.newest_frame - args.frames + 1), q.newest_frame + 1)})
                   for k in range(args.cameras)) if not args.text_only else 0
    mode = "text-only" if args.text_only else ("no-uuid" if args.no_uuid else "uuid")
    encoded = server.get("encoded")
    return {
        "mode": mode, "seed": args.seed, "base_url": args.base_url, "model": args.model,
        "cameras": args.cameras, "fps": args.fps, "ask_every_s": args.ask_every, "frames_per_question": args.frames,
        "duration_s": args.duration, "frame_size": [args.width, args.height], "max_tokens": args.max_tokens,
        "wall_s": wall_s, "client_cpu_s": client_cpu_s,
        "questions_scheduled": len(plan), "questions_sent": len(questions), "questions_skipped": len(skipped),
        "questions_failed": len(questions) - len(ok), "questions_answered_per_s": len(ok) / wall_s,
        "errors": sorted({q.error for q in questions if q.error})[:5],
        "skipped_per_camera": [sum(1 for k, _ in skipped if k == c) for c in range(args.cameras)],
        "ttft_s": pctl([q.ttft_s for q in ok]), "latency_s": pctl([q.latency_s for q in ok]),
        "send_lag_s": pctl([q.lag_s for q in questions]),
        "prompt_tokens_mean": sum(q.prompt_tokens for q in ok) / len(ok) if ok else None,
        "warmup_image_prompt_tokens": image_tokens,
        "text_filler": [{"words": w, "tokens": n} for w, n in words],
        "output_tokens": sum(q.output_tokens for q in ok),
        "frames_distinct": distinct, "frames_with_data": sum(q.with_data for q in questions),
        "frames_by_uuid": sum(q.by_uuid for q in questions),
        "upload_mb": sum(q.upload_bytes for q in questions) / 1e6,
        "frame_kb_mean": (sum(q.upload_bytes for q in questions) / max(1, sum(q.with_data for q in questions))
                          * 3 / 4 / 1e3),  # base64 → JPEG bytes
        "server": server,
        "encoder_busy_share": server["encoder_s"] / wall_s if server.get("encoder_s") is not None else None,
        "encoded_once": (encoded == distinct) if encoded is not None and not args.text_only else None,
        "args": vars(args) | {"api_key": None},
        "questions": [asdict(q) for q in questions],
    }


def pctl(values: list[float]) -> dict[str, float]:
    """bench/serve.py's percentiles, and the max (a robot's deadline is about the worst)."""
    return {**percentiles(values), "max": max(values)} if values else {}


def report(r: dict) -> str:
    s = r["server"]

    def ms(d: dict) -> str:
        return "  ".join(f"{k} {v * 1000:7.0f} ms" for k, v in d.items()) if d else "-"

    def n(v) -> str:
        return "-" if v is None else f"{v:.0f}"

    rows = [
        ("run", f"{r['mode']}: {r['cameras']} cameras x {r['fps']:g} fps, a question every {r['ask_every_s']:g} s "
                f"about the last {r['frames_per_question']} frames ({r['frame_size'][0]}x{r['frame_size'][1]}), "
                f"{r['duration_s']:g} s, {r['max_tokens']} tokens out, seed {r['seed']}"),
        ("questions", f"{r['questions_scheduled']} due, {r['questions_sent']} sent, {r['questions_skipped']} "
                      f"skipped (late), {r['questions_failed']} failed; {r['questions_answered_per_s']:.2f} "
                      f"answered/s over {r['wall_s']:.1f} s"),
        ("TTFT", ms(r["ttft_s"])), ("latency", ms(r["latency_s"])), ("send lag", ms(r["send_lag_s"])),
        ("prompt", f"{n(r['prompt_tokens_mean'])} tokens a question (mean)"),
        ("frames sent", "none (text only)" if r["mode"] == "text-only" else
         f"{r['frames_distinct']} distinct, {r['frames_with_data']} with data ({r['upload_mb']:.1f} MB base64, "
         f"{r['frame_kb_mean']:.1f} KB a JPEG), {r['frames_by_uuid']} by uuid"),
        ("gateway", f"{n(s['received'])} received (decoded), {n(s['stored'])} stored, {n(s['reused'])} reused, "
                    f"{n(s['by_uuid'])} by uuid"),
        ("worker", f"{n(s['encoded'])} encoded, {n(s['cache_hits'])} encoder-cache hits, encoder busy "
                   + ("-" if s["encoder_s"] is None else f"{s['encoder_s']:.2f} s ({r['encoder_busy_share']:.0%}"
                      f" of the run) in {n(s['encoder_steps'])} steps")),
        ("check", "-" if r["encoded_once"] is None else
         f"every distinct frame encoded once: {'yes' if r['encoded_once'] else 'NO'} "
         f"({n(s['encoded'])} encoded, {r['frames_distinct']} distinct)"),
        ("client", f"{r['client_cpu_s']:.2f} CPU-s over the run"),
    ]
    return "\n".join(f"{name:12s} {value}" for name, value in rows) + "".join(f"\nerror: {e}" for e in r["errors"])


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
    p.add_argument("--seed", type=int, help="the frames' (default: new every run, so no cache knows them)")
    p.add_argument("--metrics-url", nargs="+",
                   help="/metrics pages to read before and after (default: the gateway's); add each vision "
                        "worker's (`pagedserve up` prints them) for the encoder's counters")
    p.add_argument("--json", help="write every number (and every question) here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.metrics_url = args.metrics_url or [args.base_url.rstrip("/").removesuffix("/v1") + "/metrics"]
    args.ignore_eos = args.token_ids = True  # what bench/serve.py's `one` reads
    result = uvloop.run(run(args))
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 1 if result["questions_failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
