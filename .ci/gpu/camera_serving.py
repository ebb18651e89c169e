"""The GPU check's camera step: Gemma 3 12B at its real size -- its release's configuration
(`make-model --preset gemma-3-12b-it --config-only`), random weights made on the device
(`--load-format dummy`), bf16 -- served by the stack with one encoder service, and the
camera workload (bench/cameras/cameras.py) against it at a growing number of cameras.

    python .ci/gpu/camera_serving.py --device cuda --json cameras.json            # on the lent GPU
    python .ci/gpu/camera_serving.py --device cpu --json cameras.json             # the dry run: tiny preset

Two stacks, one after the other (the weights made on the device each time, in seconds); in
each, at every `--cameras` K, each run `--duration` seconds of questions (2 frames a second
per camera, a question a second about the last 8 frames, 16-token answers):
  with one encoder service:
    encoder  frames uploaded as captured, questions name them by file_id; the encoder
             service encodes each upload as it is stored
    text     a text prompt of the same length in tokens, no frames: the yardstick
  without:
    worker   the same uploads and questions; the worker encodes each frame when a step
             first needs it
A mode stops growing K at the first run that is not kept: a question failed, or skipped (a
camera's question comes while its last is still out), or TTFT p90 past `--ttft-p90-limit-s`
(1 s). Each stack gets its share of the time box (`--budget-s`) and starts no run that
would end past it. Per run: questions
answered per second, TTFT p50/p90, frames encoded per second (workers and encoder), output
tokens per second; per mode, the largest K kept. Set
against the physical limit of the same workload on the device's rates
(bench/cameras/camera_limits.py). The JSON (`--json`) is rewritten after every run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from pathlib import Path

import uvloop

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository's packages and bench/

from bench.cameras import camera_limits, cameras  # noqa: E402
from bench.cameras.cameras_compare import bench_args  # noqa: E402
from compose.launcher import Stack, StackConfig, free_port  # noqa: E402

# each stack's modes (encoder services: modes), ours -> bench/cameras/cameras_compare.py's contender
STACKS = {1: {"encoder": "encoder", "text": "text"}, 0: {"worker": "encoder"}}
START_S = 20  # a run's warm-up, settle and metric scrapes beyond its --duration
FPS, FRAMES, ANSWER_TOKENS = 2.0, 8, 16  # the workload: frames a camera-second, a question's, an answer's


def make_release(args) -> Path:
    from tools.make_model import make_model

    out = args.work / args.preset
    if not (out / "config.json").exists():
        make_model(out, preset=args.preset, arch="gemma3-vision", config_only=True)
    return out


def stack_config(args, model: Path, encoders: int) -> StackConfig:
    device = ("--device", args.device, "--dtype", args.dtype)
    worker = (*device, "--max-model-len", str(args.max_model_len))
    if args.device.startswith("cuda"):
        worker += ("--gpu-memory-utilization", str(args.gpu_memory_utilization))
    return StackConfig(model=str(model), port=free_port(), run_dir=args.work / f"stack-{encoders}-encoders",
                       key_prefix=f"gpu-cams-{uuid.uuid4().hex[:8]}", encoders=encoders, worker_args=worker,
                       encoder_args=device, env={"PAGEDSERVE_LOAD_FORMAT": "dummy"}, startup_timeout_s=600)


def run_one(args, stack: Stack, contender: str, k: int) -> dict:
    workload = argparse.Namespace(cameras=k, fps=FPS, ask_every=1.0, frames=FRAMES, duration=args.duration,
                                  width=640, height=480, max_tokens=ANSWER_TOKENS)
    ns = bench_args(workload, contender, stack.base_url, stack.served_model_name,
                    list(stack.metrics_urls.values()))
    r = uvloop.run(cameras.run(ns))
    server = r.get("server", {})
    encoded = (server.get("encoded_by_workers") or 0) + (server.get("encoded_by_encoders") or 0)
    return {"cameras": k, "questions_per_s": r["questions_answered_per_s"], "questions_failed": r["questions_failed"],
            "questions_skipped": r["questions_skipped"], "ttft_p50_s": r["ttft_s"].get("p50"),
            "ttft_p90_s": r["ttft_s"].get("p90"), "encoded_images_per_s": encoded / r["wall_s"],
            "encoded_by_workers": server.get("encoded_by_workers"),
            "encoded_by_encoders": server.get("encoded_by_encoders"),
            "output_tokens_per_s": r["output_tokens"] / r["wall_s"], "prompt_tokens_mean": r["prompt_tokens_mean"]}


def sweep(args, stack: Stack, modes: dict[str, str], result: dict, save, deadline: float) -> None:
    growing = dict.fromkeys(modes, True)
    for k in args.cameras:
        for mode, contender in modes.items():
            if not growing[mode]:
                continue
            if deadline - time.monotonic() < args.duration + START_S:
                result["stopped"] = f"no room in the time box for {mode} at {k} cameras"
                return
            row = run_one(args, stack, contender, k)
            result["runs"].setdefault(mode, []).append(row)
            # kept: every question of the run answered (none failed, none skipped because the
            # camera's previous one was still out) with TTFT p90 within the limit
            kept = [r["cameras"] for r in result["runs"][mode]
                    if r["ttft_p90_s"] is not None and r["ttft_p90_s"] <= args.ttft_p90_limit_s
                    and not r["questions_failed"] and not r["questions_skipped"]]
            result["largest_k_within_limit"][mode] = max(kept, default=0)
            growing[mode] = k in kept
            save()
            print(f"{mode} x{k}: {row['questions_per_s']:.2f} questions/s ({row['questions_skipped']} skipped, "
                  f"{row['questions_failed']} failed), TTFT p50 {seconds(row['ttft_p50_s'])} "
                  f"p90 {seconds(row['ttft_p90_s'])}, {row['encoded_images_per_s']:.1f} images/s encoded, "
                  f"{row['output_tokens_per_s']:.0f} tok/s", flush=True)


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", default=None, help="default: gemma-3-12b-it on a GPU, tiny on the CPU")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    p.add_argument("--cameras", type=int, nargs="+", default=None, help="default: 2 4 8 12 16 (1 on the CPU)")
    p.add_argument("--duration", type=float, default=None, help="seconds of questions a run (20; 4 on the CPU)")
    p.add_argument("--ttft-p90-limit-s", type=float, default=1.0)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.8, help="the worker's (the encoder beside it)")
    p.add_argument("--tflops", type=float, default=790.0, help="the device's bf16 matmul rate, for the limit")
    p.add_argument("--tbps", type=float, default=4.27, help="its copy bandwidth, for the limit")
    p.add_argument("--budget-s", type=float, default=420.0, help="start no run that would end past this")
    p.add_argument("--work", type=Path, default=Path("/tmp/pagedserve-gpu-cameras"))
    p.add_argument("--json", type=Path, required=True)
    args = p.parse_args(argv)
    gpu = args.device.startswith("cuda")
    args.preset = args.preset or ("gemma-3-12b-it" if gpu else "tiny")
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    args.cameras = args.cameras or ([2, 4, 8, 12, 16] if gpu else [1])
    args.duration = args.duration or (20.0 if gpu else 4.0)
    deadline = time.monotonic() + args.budget_s
    args.work.mkdir(parents=True, exist_ok=True)
    result: dict = {"preset": args.preset, "device": args.device, "dtype": args.dtype, "load_format": "dummy",
                    "workload": "2 fps a camera, a question a second about the last 8 frames, 16-token answers",
                    "ttft_p90_limit_s": args.ttft_p90_limit_s, "runs": {}, "largest_k_within_limit": {}}

    def save() -> None:
        args.json.write_text(json.dumps(result, indent=1))

    model = make_release(args)
    limit_args = argparse.Namespace(frames=FRAMES, fps=FPS, text_tokens=30, answer_tokens=ANSWER_TOKENS,
                                    tflops=args.tflops, tbps=args.tbps)
    from modeling.registry import load_config, load_vision_config

    result["physical_limit"] = camera_limits.limits(load_config(model), load_vision_config(model), limit_args)
    save()
    for i, (encoders, modes) in enumerate(STACKS.items()):
        # each stack its share of what is left, so the last one runs too
        share = time.monotonic() + (deadline - time.monotonic()) / (len(STACKS) - i)
        if share - time.monotonic() < args.duration + START_S + 60:
            result["stopped"] = f"no room in the time box for the stack with {encoders} encoder(s)"
            break
        t0 = time.monotonic()
        with Stack(stack_config(args, model, encoders)) as stack:
            result.setdefault("stack_start_s", {})[f"{encoders} encoders"] = round(time.monotonic() - t0, 1)
            save()
            sweep(args, stack, modes, result, save, share)
    save()
    print(f"largest K with TTFT p90 <= {args.ttft_p90_limit_s} s: {result['largest_k_within_limit']}; "
          f"physical limit {result['physical_limit']['cameras_per_device']} cameras", flush=True)
    failed = any(r["questions_failed"] for rows in result["runs"].values() for r in rows)
    return 1 if failed or not result["runs"] else 0


if __name__ == "__main__":
    sys.exit(main())
