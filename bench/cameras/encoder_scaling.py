"""Encoder scaling: how many frames a second the encoder service (encoder_svc/) encodes with
one encoder against two, on a stack this script starts.

    pagedserve make-model models/gemma3-vision-small --arch gemma3-vision --preset small
    python bench/cameras/encoder_scaling.py --model models/gemma3-vision-small --frames 48 --rounds 3 \
        --threads 1 --json encoder_scaling.json

The stack is the launcher's (compose/launcher.py): its own redis-server, one worker, the
scheduler, the gateway, then two encoders (`pagedserve encoder --threads T`) started side
by side (`set_encoders`). No question is asked: the frames only go in through the Files
API (`POST /v1/files`, --concurrency uploads in flight, as fast as the gateway takes them);
each one stored is announced to the encoders, which encode it and publish its embeddings
(the worker stays idle). One run: --frames M synthetic JPEG camera frames
(bench/common/workloads.py's camera_frame, --width x --height, M distinct scenes), timed from the
first upload until the embeddings of all M are published in Redis (polled every 20 ms);
frames/s = M / that time. The encoders' own /metrics, read before and after, say who
encoded how many (`pagedserve:mm_items_encoded_total`, their sum must be M) and their busy
seconds (`pagedserve:encoder_seconds`). Every run sends the same M pictures with a run tag
in a JPEG comment segment: other bytes, so new to the stack (it keys media by the bytes'
hash), the same pixels, so the same work for every run.

A round measures 2 encoders and 1 (the order alternating from round to round, so a drift
of the machine falls on both); between runs the launcher stops an encoder (SIGTERM) or
starts one, and a warm-up upload gives every encoder a first batch before the clock.
Prints a table (frames/s of each run, the medians over --rounds, the ratio 2 ÷ 1 median
and per round) and with --json writes every number.

The encoders are started, stopped and counted by bench/cameras/encoder_fleet.py (bench/stack/chaos.py's
encoder faults use it too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the repository root on sys.path, this folder off it (bench/README.md)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent)]

from compose.launcher import Stack, StackConfig, free_port  # noqa: E402
from kernels.cpu_features import cpu_features  # noqa: E402
from bench.cameras.encoder_fleet import (ENCODED, digest, encoded_counts, fingerprint, published, queue_depth,  # noqa: E402
                           set_encoders, stop_encoders, tagged)
from bench.common.workloads import camera_frame  # noqa: E402

PUBLISHED = "pagedserve:mm_embeddings_published_total"
BUSY = "pagedserve:encoder_seconds_sum"


async def upload(base_url: str, frames: list[bytes], concurrency: int) -> None:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        async def one(i: int, data: bytes) -> None:
            async with gate:
                reply = await client.post("/files", data={"purpose": "vision"},
                                          files={"file": (f"frame-{i}.jpg", data, "image/jpeg")})
                reply.raise_for_status()

        await asyncio.gather(*(one(i, f) for i, f in enumerate(frames)))


def measure(stack: Stack, frames: list[bytes], concurrency: int, timeout_s: float = 600.0) -> dict:
    """Upload `frames` and time them until all are published; frames/s and who encoded them."""
    fp, hashes = fingerprint(stack), [digest(f) for f in frames]
    before = {k: encoded_counts(stack, ("encoder-",), k) for k in (ENCODED, BUSY)}
    uploaded: list[float] = []
    failed: list[BaseException] = []

    def send() -> None:
        try:
            asyncio.run(upload(stack.base_url, frames, concurrency))
        except BaseException as exc:  # noqa: BLE001 -- reported below
            failed.append(exc)
        uploaded.append(time.perf_counter())

    start = time.perf_counter()
    sender = threading.Thread(target=send, name="upload")
    sender.start()
    deadline = time.monotonic() + timeout_s
    while len(published(stack, fp, hashes)) < len(hashes):
        if failed or time.monotonic() > deadline:
            sender.join()
            raise RuntimeError(f"not all published: {failed or 'timed out'}")
        time.sleep(0.02)
    seconds = time.perf_counter() - start
    sender.join()
    after = {k: encoded_counts(stack, ("encoder-",), k) for k in (ENCODED, BUSY)}
    by_encoder = {n: round(after[ENCODED][n] - before[ENCODED].get(n, 0)) for n in after[ENCODED]}
    busy = {n: round(after[BUSY][n] - before[BUSY].get(n, 0.0), 3) for n in after[BUSY]}
    return {"frames": len(frames), "seconds": round(seconds, 3),
            "frames_per_s": round(len(frames) / seconds, 3), "upload_s": round(uploaded[0] - start, 3),
            "encoded_by": by_encoder, "encoder_busy_s": busy, "queue_depth_after": queue_depth(stack)}


def warm_up(stack: Stack, names: list[str], frame: bytes, concurrency: int, timeout_s: float = 120.0) -> None:
    """Upload fresh copies of `frame` until every encoder in `names` has encoded one, then
    until the job queue is empty (the first call of a new encoder is slow)."""
    deadline = time.monotonic() + timeout_s
    while True:
        counts = encoded_counts(stack, ("encoder-",))
        if all(counts.get(n, 0) > 0 for n in names) and queue_depth(stack) == 0:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"warm-up: encoded {counts}, queue {queue_depth(stack)}")
        batch = [tagged(frame, f"warm-{uuid.uuid4().hex}") for _ in range(2 * len(names))]
        asyncio.run(upload(stack.base_url, batch, concurrency))
        time.sleep(0.5)


# ---- the bench -----------------------------------------------------------------------------

def summarize(args, runs: list[dict], machine: str) -> dict:
    fps = {n: [r["frames_per_s"] for r in runs if r["encoders"] == n] for n in (1, 2)}
    median = {n: statistics.median(v) for n, v in fps.items() if v}
    per_round = [two / one for one, two in zip(fps[1], fps[2]) if one]
    return {"model": args.model, "machine": machine, "frames": args.frames, "width": args.width,
            "height": args.height, "threads": args.threads, "concurrency": args.concurrency,
            "rounds": args.rounds, "runs": runs, "median_frames_per_s": median,
            "ratio_2_over_1": round(median[2] / median[1], 3) if median.get(1) and 2 in median else None,
            "ratio_per_round": [round(r, 3) for r in per_round]}


def table(s: dict) -> str:
    lines = [f"machine: {s['machine']}; {s['model']}, {s['frames']} frames of {s['width']}x{s['height']}, "
             f"--threads {s['threads']} per encoder, {s['concurrency']} uploads in flight", "",
             "| encoders | frames/s (median) | runs | uploads took (s, median) | encoded by (last run) |",
             "|---|---|---|---|---|"]
    for n, med in s["median_frames_per_s"].items():
        runs = [r for r in s["runs"] if r["encoders"] == n]
        up = statistics.median(r["upload_s"] for r in runs)
        each = ", ".join(f"{r['frames_per_s']:.2f}" for r in runs)
        who = ", ".join(f"{k} {v}" for k, v in runs[-1]["encoded_by"].items())
        lines.append(f"| {n} | {med:.2f} | {each} | {up:.2f} | {who} |")
    rounds = ", ".join(f"{r:.2f}" for r in s["ratio_per_round"])
    lines.append(f"\n2 encoders ÷ 1: {s['ratio_2_over_1']}× (medians); per round {rounds}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a vision checkpoint folder")
    p.add_argument("--frames", type=int, default=48, help="M: frames uploaded in one run")
    p.add_argument("--rounds", type=int, default=3, help="R: rounds of 1 and 2 encoders")
    p.add_argument("--threads", type=int, default=1, help="T: each encoder's --threads")
    p.add_argument("--width", type=int, default=640)
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--concurrency", type=int, default=4, help="uploads in flight")
    p.add_argument("--seed", type=int, default=0, help="of the frames' scenes")
    p.add_argument("--encoder-arg", action="append", default=[], help="extra flag for every encoder")
    p.add_argument("--run-dir", help="logs of every process (default: a temporary folder)")
    p.add_argument("--json", help="write every number here")
    args = p.parse_args(argv)
    pictures = [camera_frame(args.seed * 1_000_003 + i, args.width, args.height) for i in range(args.frames)]
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="encoder-scaling-"))
    config = StackConfig(model=str(Path(args.model).resolve()), port=free_port(), workers=1,
                         run_dir=run_dir, key_prefix=f"bench-{uuid.uuid4().hex[:8]}",
                         worker_args=("--threads", "1"), startup_timeout_s=600,
                         encoder_args=("--threads", str(args.threads), *args.encoder_arg))
    runs = []
    tag = uuid.uuid4().hex[:8]
    with Stack(config) as stack:
        try:
            for round_no in range(args.rounds):
                for n in (2, 1) if round_no % 2 == 0 else (1, 2):  # one encoder started a round
                    names = set_encoders(stack, n)
                    warm_up(stack, names, pictures[0], args.concurrency)
                    frames = [tagged(f, f"{tag}-r{round_no}-e{n}-{i}") for i, f in enumerate(pictures)]
                    run = {"round": round_no, "encoders": n, **measure(stack, frames, args.concurrency)}
                    print(json.dumps(run), file=sys.stderr, flush=True)
                    runs.append(run)
        finally:
            stop_encoders(stack)
    summary = summarize(args, runs, cpu_features().describe())
    print(table(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()
