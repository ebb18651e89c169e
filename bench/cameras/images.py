"""Image requests: the stack against `transformers serve` and static `generate()`, on the same
camera frames and prompts, in interleaved rounds.

    pagedserve make-model models/gemma3-vision-small --arch gemma3-vision --preset small
    python bench/cameras/images.py --model-dir models/gemma3-vision-small --runs 3 --images 1 8 \
        --num-requests 16 --concurrency 8 --output-tokens 32 --out-dir bench/results/images

Each request is a chat completion: a short question and --images-per-request synthetic JPEG
camera frames (--image-width x --image-height, every frame of a run distinct: no encoder or
prefix cache hit between requests), `max_tokens` --output-tokens, greedy; all submitted at
once, at most --concurrency in flight (bench/stack/serve.py --images-per-request; the frames are
bench/common/workloads.py's ImageSpec, so every contender gets the same bytes). Contenders:
  stack      `pagedserve up` (Redis, one worker, the scheduler, the gateway)
  engine     `pagedserve engine` (the same in one process; not measured by default)
  hf-serve   `transformers serve --continuous-batching` (Hugging Face's server: it takes
             `image_url` parts, and runs a vision model one request at a time -- its
             continuous batching serves text-only models -- with EOS on, having no ignore_eos)
  hf-static  `Gemma3ForConditionalGeneration.generate()` with the processor on static
             left-padded batches of --concurrency requests, offline
             (bench/cameras/static_generate_images.py)
A round starts each server once, measures every --images count against it in turn (a
warm-up of two requests first, with frames of their own), and stops it before the next
contender starts. For the stack it reads the worker's own /metrics (its URL from the line
`pagedserve up` prints) before and after each measured run: the steps' time
(`pagedserve:step_duration_seconds`) and the encoder's (`pagedserve:encoder_seconds`:
fetching, decoding, preprocessing and encoding a step's new images, inside that step), so
the encoder's share of the steps is theirs over the run.

Writes every run's JSON and summary.json (medians over the rounds, per-round ratios of the
stack's requests/s to each contender's) to --out-dir and prints a Markdown table. With
--aiperf PATH (NVIDIA's `aiperf` command, e.g. from its own venv) it then starts the stack
once more and runs, per --images count, `aiperf profile` with synthetic JPEG images of the
same size, then bench/stack/serve.py on the same server, and puts the two side by side.
"""

from __future__ import annotations

import argparse
import json
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the repository root on sys.path, this folder off it (bench/README.md)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent)]

from bench.stack import compare  # noqa: E402  (starting, waiting for and stopping the servers)
from compose.launcher import free_port  # noqa: E402
from kernels.cpu_features import cpu_features  # noqa: E402
from proto.metrics_scrape import Samples, metric  # noqa: E402

CONTENDERS = ("stack", "engine", "hf-serve", "hf-static")
ENCODER = "pagedserve:encoder_seconds"
ENCODED = "pagedserve:mm_items_encoded_total"
WARMUP_SEED = 999_999  # the warm-up's frames are none of the measured ones


def run_seed(args, images: int) -> int:
    """Every --images count draws frames of its own, so a server measured with 1 image a
    request and then 8 never finds the second run's frames cached."""
    return args.seed + 1000 * images


def worker_metrics_url(log: Path, offset: int, timeout_s: float = 60.0) -> str:
    """The worker's own /metrics URL from the `metrics: ...` line `pagedserve up` prints
    once the stack is up (in its log after `offset`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(log, "rb") as f:
            f.seek(offset)
            for line in f.read().decode(errors="replace").splitlines():
                if line.startswith("metrics: "):
                    for item in line.removeprefix("metrics: ").split(", "):
                        name, _, url = item.partition(" ")
                        if name.startswith("worker"):
                            return url
        time.sleep(0.5)
    raise TimeoutError(f"`pagedserve up` printed no worker metrics URL; the end of its log:\n{compare.log_tail(log)}")


def encoder_split(before: Samples, after: Samples) -> dict:
    """Between two scrapes of the worker's /metrics: its steps, their time, the encoder's time
    inside them and the images it encoded, and the encoder's share of the steps' time."""
    def delta(name: str) -> float:
        return metric(after, name) - metric(before, name)

    step_s = delta(f"{compare.STEPS}_sum")
    split = {"steps": int(delta(f"{compare.STEPS}_count")), "step_s": step_s}
    if not any(name == f"{ENCODER}_sum" for name, _ in after):  # a server that does not export it (engine)
        return split
    encoder_s, encoded = delta(f"{ENCODER}_sum"), int(delta(ENCODED))
    return {**split, "encoder_steps": int(delta(f"{ENCODER}_count")), "encoder_s": encoder_s,
            "images_encoded": encoded, "encoder_share": encoder_s / step_s if step_s else None,
            "encoder_s_per_image": encoder_s / encoded if encoded else None}


def client_cmd(args, base_url: str, extra: list[str], images: int, num_requests: int, seed: int,
               output_tokens: int) -> list[str]:
    return [sys.executable, str(ROOT / "bench" / "stack" / "serve.py"), "--base-url", base_url, *extra,
            "--images-per-request", str(images), "--image-width", str(args.image_width),
            "--image-height", str(args.image_height), "--num-requests", str(num_requests),
            "--output-mean", str(output_tokens), "--seed", str(seed)]


def server_args(args) -> argparse.Namespace:
    """What bench/stack/compare.py's start_server reads."""
    return argparse.Namespace(model_dir=args.model_dir, device=args.device, dtype=args.dtype, quantization="none",
                              kv_cache_dtype="auto", threads=args.threads, gpu_memory_utilization=None)


def run_static(args, round_no: int, out_dir: Path) -> list[dict]:
    results = []
    for images in args.images:
        out = out_dir / f"hf-static-{images}-{round_no}.json"
        cmd = [sys.executable, str(HERE / "static_generate_images.py"), "--model-dir", args.model_dir,
               "--batch-size", str(args.concurrency), "--num-requests", str(args.num_requests),
               "--images-per-request", str(images), "--image-width", str(args.image_width),
               "--image-height", str(args.image_height), "--output-tokens", str(args.output_tokens),
               "--seed", str(run_seed(args, images)), "--warmup-seed", str(WARMUP_SEED),
               "--device", args.device, "--dtype", args.dtype, "--out", str(out)]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        subprocess.run(cmd, check=True)
        results.append(json.loads(out.read_text()))
    return results


def run_server(name: str, args, round_no: int, out_dir: Path) -> list[dict]:
    """Start `name`, measure every --images count against it, stop it."""
    log = out_dir / f"{name}.log"
    offset = log.stat().st_size if log.exists() else 0
    proc, base_url, extra = compare.start_server(name, server_args(args), free_port(), log)
    results = []
    try:
        server = base_url.removesuffix("/v1")
        worker = worker_metrics_url(log, offset).removesuffix("/metrics") if name == "stack" else None
        compare.run_client(client_cmd(args, base_url, extra, 1, 2, WARMUP_SEED, 4)
                           + ["--concurrency", "2", "--quiet"], proc, name, log, stdout=subprocess.DEVNULL)
        for images in args.images:
            out = out_dir / f"{name}-{images}-{round_no}.json"
            metrics_base = worker or (server if name == "engine" else None)
            before = compare.settled_samples(metrics_base) if metrics_base else None
            cpu_before = compare.cpu_by_process(proc.pid)
            compare.run_client(client_cmd(args, base_url, extra, images, args.num_requests, run_seed(args, images),
                                          args.output_tokens)
                               + ["--label", name, "--concurrency", str(args.concurrency), "--out", str(out)],
                               proc, name, log)
            result = json.loads(out.read_text())
            result["server_cpu_s"] = compare.cpu_used(cpu_before, compare.cpu_by_process(proc.pid))
            if before is not None:
                result["server_steps"] = encoder_split(before, compare.settled_samples(metrics_base))
            out.write_text(json.dumps(result, indent=2))
            results.append(result)
    finally:
        compare.stop(proc)
    return results


def median_of(results: list[dict], key: str, pct: str | None = None) -> float | None:
    vals = [(r.get(key) or {}).get(pct) if pct else r.get(key) for r in results]
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def summarize(runs: dict[tuple[str, int], list[dict]]) -> dict:
    rows = {}
    for (name, images), results in runs.items():
        rps = [r["request_throughput"] for r in results]
        row = {"contender": name, "images_per_request": images, "request_throughput_runs": rps,
               "request_throughput_median": statistics.median(rps),
               "image_throughput_median": median_of(results, "image_throughput"),
               "output_throughput_median": median_of(results, "output_throughput"),
               "ttft_s_p50_median": median_of(results, "ttft_s", "p50"),
               "ttft_s_p90_median": median_of(results, "ttft_s", "p90"),
               "failed": sum(r.get("failed", 0) for r in results)}
        splits = [r["server_steps"] for r in results if r.get("server_steps")]
        shares = [s["encoder_share"] for s in splits if s.get("encoder_share") is not None]
        if shares:
            per_image = [s["encoder_s_per_image"] for s in splits if s.get("encoder_s_per_image")]
            row.update(encoder_share_runs=shares, encoder_share_median=statistics.median(shares),
                       encoder_s_per_image_median=statistics.median(per_image) if per_image else None,
                       step_s_median=statistics.median(s["step_s"] for s in splits),
                       encoder_s_median=statistics.median(s["encoder_s"] for s in splits))
        rows[f"{name}/{images}"] = row
    for row in rows.values():  # round by round: the same drift on both sides
        base = rows.get(f"stack/{row['images_per_request']}")
        if base:
            row["stack_over_this_runs"] = [b / x if x else None for b, x in
                                           zip(base["request_throughput_runs"], row["request_throughput_runs"])]
    return rows


def ms(seconds: float | None) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds is not None else "—"


def table(rows: dict, images_counts: list[int], contenders: list[str]) -> str:
    lines = ["| contender | images / request | req/s (median; rounds) | images/s | TTFT p50 | TTFT p90 "
             "| output tok/s | stack ÷ this, req/s (per round) |", "|---|---|---|---|---|---|---|---|"]
    for images in images_counts:
        for name in contenders:
            row = rows.get(f"{name}/{images}")
            if row is None:
                continue
            runs = ", ".join(f"{x:.2f}" for x in row["request_throughput_runs"])
            ratios = [x for x in row.get("stack_over_this_runs", []) if x]
            ratio = (f"{statistics.median(ratios):.2f}× ({', '.join(f'{x:.2f}' for x in ratios)})"
                     if ratios and name != "stack" else ("1.00×" if name == "stack" else "—"))
            failed = f" ({row['failed']} failed)" if row["failed"] else ""
            lines.append(f"| {name} | {images} | **{row['request_throughput_median']:.2f}** ({runs}){failed} "
                         f"| {row['image_throughput_median']:.2f} | {ms(row['ttft_s_p50_median'])} "
                         f"| {ms(row['ttft_s_p90_median'])} | {row['output_throughput_median']:.1f} | {ratio} |")
    return "\n".join(lines)


def aiperf_command(args, aiperf: str, port: int, served: str, images: int, artifact_dir: Path) -> list[str]:
    """`aiperf profile` against the stack, unchanged: streaming chat, synthetic JPEG images
    of the benchmark's size, a short synthetic text, exactly --output-tokens out."""
    return [aiperf, "profile", "--model", served, "--tokenizer", str(Path(args.model_dir).resolve()),
            "--url", f"http://127.0.0.1:{port}", "--endpoint-type", "chat", "--streaming",
            "--image-width-mean", str(args.image_width), "--image-height-mean", str(args.image_height),
            "--image-format", "jpeg", "--image-batch-size", str(images),
            "--synthetic-input-tokens-mean", "16", "--output-tokens-mean", str(args.output_tokens),
            "--extra-inputs", "ignore_eos:true", "--concurrency", str(args.concurrency),
            "--request-count", str(args.aiperf_requests), "--warmup-request-count", "2",
            "--use-server-token-count", "--ui-type", "none", "--artifact-dir", str(artifact_dir)]


def aiperf_numbers(export: dict) -> dict:
    def get(key: str, stat: str = "avg") -> float | None:
        return (export.get(key) or {}).get(stat)

    ttft_unit = (export.get("time_to_first_token") or {}).get("unit", "ms")
    scale = 1000.0 if ttft_unit == "ms" else 1.0
    p50, p90 = get("time_to_first_token", "p50"), get("time_to_first_token", "p90")
    return {"request_throughput": get("request_throughput"), "output_throughput": get("output_token_throughput"),
            "ttft_s_p50": p50 / scale if p50 is not None else None,
            "ttft_s_p90": p90 / scale if p90 is not None else None,
            "requests": get("request_count"), "input_tokens_mean": get("input_sequence_length")}


def run_aiperf(args, out_dir: Path) -> list[dict]:
    """The stack once more: per --images count, `aiperf profile`, then bench/stack/serve.py with the
    same counts on the same server. A failing aiperf is recorded (its exit status and the end
    of its output), not fatal."""
    log = out_dir / "stack-aiperf.log"
    port = free_port()
    proc, base_url, extra = compare.start_server("stack", server_args(args), port, log)
    served = Path(args.model_dir).resolve().name
    found = []
    try:
        compare.run_client(client_cmd(args, base_url, extra, 1, 2, WARMUP_SEED, 4)
                           + ["--concurrency", "2", "--quiet"], proc, "stack", log, stdout=subprocess.DEVNULL)
        for images in args.images:
            artifacts = out_dir / f"aiperf-{images}"
            cmd = aiperf_command(args, args.aiperf, port, served, images, artifacts)
            print(f"== aiperf, {images} image(s) a request: {shlex.join(cmd)}", file=sys.stderr, flush=True)
            cpu_before = children_cpu_s()
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.aiperf_timeout)
            (out_dir / f"aiperf-{images}.out").write_text(done.stdout + done.stderr)
            entry = {"images_per_request": images, "command": shlex.join(cmd), "returncode": done.returncode,
                     "aiperf_cpu_s": children_cpu_s() - cpu_before}  # all its processes, start to end
            export = artifacts / "profile_export_aiperf.json"
            if done.returncode == 0 and export.exists():
                entry["aiperf"] = aiperf_numbers(json.loads(export.read_text()))
            else:
                entry["error"] = (done.stdout + done.stderr)[-2000:]
            ours = out_dir / f"stack-aiperf-ours-{images}.json"
            compare.run_client(client_cmd(args, base_url, extra, images, args.aiperf_requests,
                                          run_seed(args, images) + 1, args.output_tokens)
                               + ["--label", "stack (ours, beside aiperf)", "--concurrency", str(args.concurrency),
                                  "--out", str(ours)], proc, "stack", log)
            r = json.loads(ours.read_text())
            entry["ours"] = {"request_throughput": r["request_throughput"], "output_throughput": r["output_throughput"],
                             "ttft_s_p50": r["ttft_s"].get("p50"), "ttft_s_p90": r["ttft_s"].get("p90"),
                             "client_cpu_s": r["client_cpu_s"]}
            found.append(entry)
    finally:
        compare.stop(proc)
    return found


def children_cpu_s() -> float:
    """CPU seconds of this process's finished children (and theirs, when they waited for them)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def aiperf_table(entries: list[dict]) -> str:
    lines = ["| images / request | client | req/s | TTFT p50 | TTFT p90 | output tok/s | client CPU s |",
             "|---|---|---|---|---|---|---|"]
    for e in entries:
        a = e.get("aiperf")
        if a:
            lines.append(f"| {e['images_per_request']} | aiperf | {a['request_throughput']:.2f} "
                         f"| {ms(a['ttft_s_p50'])} | {ms(a['ttft_s_p90'])} | {a['output_throughput']:.1f} "
                         f"| {e['aiperf_cpu_s']:.1f} |")
        else:
            lines.append(f"| {e['images_per_request']} | aiperf | failed (exit {e['returncode']}) | | | | |")
        o = e["ours"]
        lines.append(f"| {e['images_per_request']} | bench/stack/serve.py | {o['request_throughput']:.2f} "
                     f"| {ms(o['ttft_s_p50'])} | {ms(o['ttft_s_p90'])} | {o['output_throughput']:.1f} "
                     f"| {o['client_cpu_s']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default="models/gemma3-vision-small")
    p.add_argument("--contenders", nargs="+", default=["stack", "hf-serve", "hf-static"], choices=CONTENDERS)
    p.add_argument("--images", type=int, nargs="+", default=[1, 8], help="images per request, one run each")
    p.add_argument("--runs", type=int, default=3, help="interleaved rounds")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight; hf-static's batch size")
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--image-width", type=int, default=640)
    p.add_argument("--image-height", type=int, default=480)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch threads of every contender")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"],
                   help="every contender's dtype")
    p.add_argument("--aiperf", help="the `aiperf` command: also run `aiperf profile` against the stack")
    p.add_argument("--aiperf-requests", type=int, default=16)
    p.add_argument("--aiperf-timeout", type=float, default=900)
    p.add_argument("--out-dir", default="bench/results/images")
    args = p.parse_args(argv)
    compare.check_contenders(args.contenders)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[tuple[str, int], list[dict]] = {(c, n): [] for n in args.images for c in args.contenders}
    for round_no in range(args.runs):
        for name in args.contenders:
            print(f"== round {round_no + 1}/{args.runs}: {name}", file=sys.stderr, flush=True)
            if name == "hf-static":
                found = run_static(args, round_no, out_dir)
            else:
                found = run_server(name, args, round_no, out_dir)
            for images, result in zip(args.images, found):
                runs[(name, images)].append(result)
    machine = cpu_features().describe()
    rows = summarize(runs)
    summary = {"args": vars(args), "machine": machine, "rows": rows}
    if args.aiperf:
        summary["aiperf"] = run_aiperf(args, out_dir)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\nmachine: {machine}; device {args.device}, dtype {args.dtype}")
    print(f"{args.num_requests} chat requests per run, concurrency {args.concurrency}, "
          f"{args.image_width}x{args.image_height} JPEG frames, {args.output_tokens} tokens out; "
          f"medians of {args.runs} rounds\n")
    print(table(rows, args.images, args.contenders))
    shares = [(n, rows[f"stack/{n}"]) for n in args.images if "encoder_share_median" in rows.get(f"stack/{n}", {})]
    if shares:
        print("\nThe stack's encoder (pagedserve:encoder_seconds) over its steps "
              "(pagedserve:step_duration_seconds), on the worker:\n")
        for n, row in shares:
            per_image = row.get("encoder_s_per_image_median")
            print(f"- {n} image(s) a request: {row['encoder_share_median'] * 100:.1f}% "
                  f"(rounds {', '.join(f'{x * 100:.1f}%' for x in row['encoder_share_runs'])}; "
                  f"encoder {row['encoder_s_median']:.2f} s of {row['step_s_median']:.2f} s of steps"
                  + (f", {per_image * 1000:.0f} ms an image" if per_image else "") + ")")
    if summary.get("aiperf"):
        print("\n`aiperf profile` against the stack, and bench/stack/serve.py on the same server after it:\n")
        print(aiperf_table(summary["aiperf"]))
        for e in summary["aiperf"]:
            print(f"\n{e['images_per_request']} image(s): {e['command']} -> exit {e['returncode']}")
    failed = sum(row["failed"] for row in rows.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
