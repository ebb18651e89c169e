"""The GPU check's serving step: decode steps against the device's bandwidth, and the stack
against the in-process engine, on a random checkpoint made from a carried tokenizer.

    python .ci/gpu/serving.py --device cuda --preset 1b --tokenizer .gpu-bundle/tokenizers/llama-1b \
        --json serving.json

1. The checkpoint: `make_model(preset, arch=llama)` with the tokenizer given (nothing is
   trained here: a `1b` vocabulary takes a minute of BPE training), bf16 on a GPU.
2. bench/compute/roofline.py's decode step at each `--roofline-batches` (context 320), with CUDA
   graphs and with --enforce-eager (one process each): its time, the floor, its
   model-bandwidth utilisation (weights + K/V read and written per step, over the step,
   over a measured device-to-device copy's bandwidth), and the CUDA kernels one step runs;
   and the step time with each step launched before the one before finishes, as the
   worker service runs them on a GPU (ModelRunner.launch / finish).
3. For each `--concurrency`: bench/stack/compare.py with the contenders `stack` and `engine`,
   `--rounds` interleaved rounds, `2 x concurrency` requests of the serving workload (input
   mean 256, output mean 128): output tokens/s of each, the stack over the engine, TTFT
   and TPOT p50, the worker's mean step and the mean gap between steps.
4. A mixed step (64 decodes and a 512-token prefill chunk, bench/compute/mixed_step.py) against its
   own floor and its parts' floors summed.
The JSON (`--json`) is rewritten after each part, so a run stopped by its time box keeps
what it measured.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def carried_tokenizer(folder: Path, into: Path) -> Path:
    """A loadable copy of a bundle's tokenizer folder (its tokenizer.json travels gzipped)."""
    into.mkdir(parents=True, exist_ok=True)
    for f in folder.iterdir():
        if f.name.endswith(".gz"):
            with gzip.open(f, "rb") as src, (into / f.name.removesuffix(".gz")).open("wb") as dst:
                shutil.copyfileobj(src, dst)
        else:
            shutil.copy(f, into / f.name)
    return into


def make_checkpoint(args) -> Path:
    from tools.make_model import make_model

    out = args.work / f"llama-{args.preset}"
    if (out / "config.json").exists():
        return out
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = carried_tokenizer(args.tokenizer, Path(tmp) / "tokenizer")
        make_model(out, preset=args.preset, seed=0, arch="llama", tokenizer_dir=tokenizer)
    return out


def compare(args, model: Path, concurrency: int) -> dict:
    out_dir = args.work / f"compare-{concurrency}"
    cmd = [sys.executable, str(ROOT / "bench/stack/compare.py"), "--model-dir", str(model), "--contenders", "stack",
           "engine", "--runs", str(args.rounds), "--concurrency", str(concurrency),
           "--num-requests", str(max(16, 2 * concurrency)), "--input-mean", str(args.input_mean),
           "--output-mean", str(args.output_mean), "--device", args.device, "--dtype", args.dtype,
           "--out-dir", str(out_dir)]
    if args.device.startswith("cuda"):
        cmd += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    subprocess.run(cmd, check=True, cwd=ROOT)
    summary = json.loads((out_dir / "summary.json").read_text())["contenders"]
    row = {name: {k: c.get(k) for k in ("output_throughput_median", "ttft_s_p50_median", "tpot_s_p50_median",
                                        "step_mean_s_median", "gap_mean_s_median")}
           for name, c in summary.items()}
    stack, engine = (summary[n]["output_throughput_median"] for n in ("stack", "engine"))
    row["stack_over_engine"] = stack / engine if engine else None
    return row


def roofline(args, model: Path, eager: bool) -> dict:
    """{batch: the decode step's numbers} of one bench/compute/roofline.py process."""
    out = args.work / f"roofline-{'eager' if eager else 'graphs'}.json"
    subprocess.run([sys.executable, str(ROOT / "bench/compute/roofline.py"), "--model-dir", str(model),
                    "--device", args.device, "--dtype", args.dtype, "--context", "320",
                    "--batch", *map(str, args.roofline_batches), "--count-kernels",
                    *(["--enforce-eager"] if eager else []),
                    "--kv-cache-gib", str(args.roofline_kv_gib), "--out", str(out)], check=True, cwd=ROOT)
    result = json.loads(out.read_text())
    return {str(d["batch"]): {"step_ms": d["step_ms"], "floor_ms": d["floor_ms"], "floor_ratio": d["ratio"],
                              "launched_ahead_step_ms": d["pipelined_step_ms"],
                              "launched_ahead_floor_ratio": d["pipelined_ratio"],
                              "bandwidth_utilisation": d["bandwidth_utilisation"], "bytes_per_step": d["bytes"],
                              "cuda_graph": d["cuda_graphs"], "kernels_per_step": d["kernels"]["count"],
                              "kernels_busy_ms": d["kernels"].get("busy_ms"),
                              "copy_GB_per_s": result["read_gbps"], "matmul_GFLOP_per_s": result["matmul_gflops"]}
            for d in result["decodes"]}


def mixed_step(args, model: Path) -> dict:
    """bench/compute/mixed_step.py's numbers: 64 decodes and a 512-token chunk in one step (at batch
    4 and a 64-token chunk on the CPU); eager (a mixed step is), so no graphs are captured."""
    out = args.work / "mixed-step.json"
    gpu = args.device.startswith("cuda")
    subprocess.run([sys.executable, str(ROOT / "bench/compute/mixed_step.py"), "--model-dir", str(model),
                    "--device", args.device, "--dtype", args.dtype, "--batch", "64" if gpu else "4",
                    "--chunk", "512" if gpu else "64", "--rounds", "5" if gpu else "2", "--enforce-eager",
                    "--kv-cache-gib", str(args.roofline_kv_gib), "--out", str(out)], check=True, cwd=ROOT)
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", default="1b")
    p.add_argument("--tokenizer", type=Path, required=True, help="a bundle's tokenizer folder")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    p.add_argument("--concurrency", type=int, nargs="*", default=[256, 64],
                   help="none: the decode steps only")
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds of each contender per concurrency")
    p.add_argument("--input-mean", type=int, default=256)
    p.add_argument("--output-mean", type=int, default=128)
    p.add_argument("--roofline-batches", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--roofline-kv-gib", type=float, default=None, help="default: 8 on a GPU, 1 on the CPU")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    p.add_argument("--work", type=Path, default=Path("/tmp/pagedserve-gpu-serving"))
    p.add_argument("--json", type=Path, required=True)
    args = p.parse_args(argv)
    gpu = args.device.startswith("cuda")
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    args.roofline_kv_gib = args.roofline_kv_gib or (8.0 if gpu else 1.0)
    args.work.mkdir(parents=True, exist_ok=True)
    result: dict = {"preset": args.preset, "arch": "llama", "device": args.device, "dtype": args.dtype,
                    "workload": {"input_mean": args.input_mean, "output_mean": args.output_mean,
                                 "requests": "2 x concurrency"},
                    "serving": {}, "decode_roofline": {}}

    def save() -> None:
        args.json.write_text(json.dumps(result, indent=1))

    t0 = time.monotonic()
    model = make_checkpoint(args)
    result["make_model_s"] = round(time.monotonic() - t0, 1)
    save()
    for mode, eager in (("graphs", False), ("eager", True)) if gpu else (("eager", True),):
        result["decode_roofline"][mode] = roofline(args, model, eager)
        save()
        for b, row in result["decode_roofline"][mode].items():
            print(f"decode batch {b} ({mode}): {row['step_ms']:.2f} ms = {row['floor_ratio']:.2f}x the floor, "
                  f"{row['bandwidth_utilisation']:.0%} of the copy bandwidth, {row['kernels_per_step']} kernels; "
                  f"launched ahead {row['launched_ahead_step_ms']:.2f} ms = "
                  f"{row['launched_ahead_floor_ratio']:.2f}x the floor", flush=True)
    for c in args.concurrency:
        result["serving"][str(c)] = compare(args, model, c)
        save()
        row = result["serving"][str(c)]
        print(f"concurrency {c}: stack {row['stack']['output_throughput_median']:.0f} tok/s, engine "
              f"{row['engine']['output_throughput_median']:.0f} tok/s, stack/engine {row['stack_over_engine']:.2f}",
              flush=True)
    result["mixed_step"] = mixed_step(args, model)  # last: the serving comparison goes first in the time box
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
