"""Kernel benchmark on a CUDA GPU: the Triton paged attention against the device's own limits.

    python bench/compute/kernels.py                      # full sweep, markdown tables on stdout
    python bench/compute/kernels.py --quick --json out.json

1. Roofs, measured here: copy bandwidth (a device-to-device copy of 2 GiB, read + write
   bytes / time) and the matmul rate (bf16/fp16 8192^3 GEMM).
2. Decode, in each attention layout of `--layouts`: Llama-3-8B's (32 query heads over 8 KV
   heads of 128) and Gemma-3-12B's (16 over 8 of 256); one token per request,
   batch 64-256, context 512-8192, block size 16, blocks scattered at random:
   achieved bandwidth = bytes the kernel must read (each request's K and V up to its
   seq_len, plus Q and the output) / time, as a fraction of the copy bandwidth (target
   >= 80%); and the same attention on contiguous K/V with torch SDPA — equal lengths
   unmasked, mixed lengths (uniform in [ctx/8, ctx]) padded to the longest with a mask —
   (target: at most 10% slower on equal lengths, faster on mixed).
3. Prefill, each layout, one request of 1k-8k tokens, causal: TFLOP/s (4 * N^2/2 * heads * head_dim
   flops) against the matmul rate, and causal SDPA (flash) on contiguous K/V beside it (target:
   >= 0.7x its rate), in the Triton kernel alone and as the worker runs it (a long prompt on
   SDPA over K/V gathered from the paged cache: kernels/sdpa_prefill.py). Then a camera
   question: 8 frames of 256 bidirectional soft tokens and text (~2,100 tokens), causal, and
   on a sliding layer (window 1,024), checked against the fp32 reference (kernels/reference.py)
   and set against causal SDPA on as many tokens.
4. The sampler's exponential race (kernels/triton_sampling.py) against the torch ops it
   replaces, at batch 1-256 over Llama 3's and Gemma 3's vocabularies (bench/compute/sampling.py:
   the method, and its CPU run).
5. Gemma 3's vision encoder, SigLIP at 896 px with the projector: images/s and TFLOP/s
   per batch of frames and SDPA path, against the matmul rate (bench/compute/vision_tower.py).

Every case is first checked against SDPA, so a wrong kernel is never timed. Timings are
the median of CUDA-event intervals, each after overwriting a 256 MiB buffer to empty L2.
Nothing here is pinned: it runs with whatever torch and Triton the machine has.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the repository root on sys.path, this folder off it (bench/README.md)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent)]

from bench.compute.attention_cases import (  # noqa: E402
    LAYOUTS,
    Layout,
    contiguous_kv,
    image_prompt,
    paged_batch,
    rel_error,
    sdpa_gqa_kwargs,
)
from bench.compute.device_timing import copy_bandwidth, kernel_time, matmul_rate  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def decode_case(ta, seq_lens, dtype, args, copy_bw, flush, gqa, gen, layout: Layout) -> dict:
    heads, kv_heads, head_dim = layout
    batch, scale, group = len(seq_lens), head_dim**-0.5, heads // kv_heads
    query, k_cache, v_cache, bt, seq, qsl = paged_batch(seq_lens, [1] * batch, dtype, args.block_size, gen, layout)
    out = torch.empty_like(query)

    def triton_decode():
        ta.paged_attention(query, k_cache, v_cache, bt, seq, qsl, scale, out=out)

    k, v = contiguous_kv(k_cache, v_cache, bt, seq_lens)
    q4 = query.view(batch, heads, 1, head_dim)
    mask = None
    if len(set(seq_lens)) > 1:
        positions = torch.arange(k.shape[2], device=k.device)
        mask = (positions[None, :] < seq[:, None].long())[:, None, None, :]

    triton_decode()  # check the first requests against fp32 SDPA before timing anything
    n = min(batch, 16)
    expect = F.scaled_dot_product_attention(
        q4[:n].float(), k[:n].float().repeat_interleave(group, 1),
        v[:n].float().repeat_interleave(group, 1),
        attn_mask=None if mask is None else mask[:n], scale=scale)
    err = rel_error(out[:n], expect.view(n, heads, head_dim))
    if not err < 2e-2:
        raise AssertionError(f"decode batch {batch}: relative error {err:.2e} against SDPA")
    del expect

    seconds = kernel_time(triton_decode, args.iters, flush, args.graphs, "triton decode")
    baseline = baseline_time(args, lambda ta: ta.paged_attention(query, k_cache, v_cache, bt, seq, qsl, scale,
                                                                 out=out), flush)
    nbytes = (2 * sum(seq_lens) * kv_heads * head_dim + 2 * query.numel()) * query.element_size()
    best = (math.inf, "none")
    if gqa:
        best = min(best, (kernel_time(lambda: F.scaled_dot_product_attention(
            q4, k, v, attn_mask=mask, scale=scale, **gqa), args.iters, flush, args.graphs, "sdpa gqa"), "gqa"))
    try:  # K/V materialised per query head: 4x the memory, sometimes a faster SDPA kernel
        ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        best = min(best, (kernel_time(lambda ke=ke, ve=ve: F.scaled_dot_product_attention(
            q4, ke, ve, attn_mask=mask, scale=scale), args.iters, flush, args.graphs, "sdpa"), "expanded"))
        del ke, ve
    except torch.cuda.OutOfMemoryError:
        pass
    return {"triton_us": seconds * 1e6, "baseline_us": baseline, "GB_per_s": nbytes / seconds / 1e9,
            "frac_of_copy": nbytes / seconds / copy_bw, "sdpa_us": best[0] * 1e6,
            "sdpa_kind": best[1], "triton_vs_sdpa": seconds / best[0], "rel_err": err}


def bench_decode(args, ta, dtype, copy_bw, flush, gqa, gen, name: str) -> list[dict]:
    rows = []
    for batch in args.batches:
        for ctx in args.contexts:
            for lengths in ("equal", "mixed"):
                seq_lens = [ctx] * batch
                if lengths == "mixed":  # uniform in [ctx/8, ctx]
                    g = torch.Generator().manual_seed(batch * ctx)
                    seq_lens = torch.randint(max(ctx // 8, 1), ctx + 1, (batch,), generator=g).tolist()
                try:
                    row = decode_case(ta, seq_lens, dtype, args, copy_bw, flush, gqa, gen, LAYOUTS[name])
                except torch.cuda.OutOfMemoryError:
                    row = {"error": "out of memory"}
                except (AssertionError, RuntimeError) as exc:  # wrong, or no kernel: reported, the rest run
                    row = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                row.update(layout=name, batch=batch, context=ctx, lengths=lengths)
                rows.append(row)
                if flush.is_cuda:
                    torch.cuda.empty_cache()
                print_row(row, DECODE_COLUMNS)
    return rows


def prefill_case(kind: str, n: int, dtype, args, gen, layout: Layout):
    """(inputs, bidir_spans or None, window or None, tokens) of one prefill case: "causal" n
    tokens; "images" (8 frames of 256 soft tokens and text, n ignored); "images-window" the
    same on a sliding layer (Gemma 3's window of 1,024)."""
    spans, window = None, None
    if kind.startswith("images"):
        n, image_spans = image_prompt(2, 16, 8) if args.smoke else image_prompt(8)
        spans = torch.zeros(n, 2, dtype=torch.int32)
        for s, e in image_spans:
            spans[s:e] = torch.tensor([s, e], dtype=torch.int32)
        spans = spans.to(gen.device)
        window = (24 if args.smoke else 1024) if kind == "images-window" else None
    return paged_batch([n], [n], dtype, args.block_size, gen, layout), spans, window, n


def prefill_row(args, ta, kind: str, n: int, dtype, mm_rate, flush, gqa, gen, name: str) -> dict:
    """One prefill case's row (bench_prefill); AssertionError when the kernel is wrong."""
    from kernels.host_layout import HostLayout
    from kernels.reference import paged_attention_reference

    heads, kv_heads, head_dim = layout = LAYOUTS[name]
    scale, group = head_dim**-0.5, heads // kv_heads
    (query, k_cache, v_cache, bt, seq, qsl), spans, window, n = prefill_case(kind, n, dtype, args, gen, layout)
    out = torch.full_like(query, float("nan"))

    def triton_prefill():
        ta.paged_attention(query, k_cache, v_cache, bt, seq, qsl, scale, out=out, sliding_window=window,
                           bidir_spans=spans)

    k, v = contiguous_kv(k_cache, v_cache, bt, [n])
    if not gqa:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    q4 = query.transpose(0, 1)[None]

    def sdpa_prefill():
        return F.scaled_dot_product_attention(q4, k, v, is_causal=True, scale=scale, **gqa)

    triton_prefill()
    if kind == "causal":
        expect = sdpa_prefill()[0].transpose(0, 1)
    else:  # the rule as written, in fp32
        expect = paged_attention_reference(query.float(), k_cache.float(), v_cache.float(), bt, seq, qsl, scale,
                                           sliding_window=window, bidir_spans=spans)
    err = rel_error(out, expect)
    del expect
    if not err < 2e-2:
        raise AssertionError(f"prefill {kind} {n}: relative error {err:.2e} against the reference")
    flops = 4 * n * n / 2 * heads * head_dim
    t_triton = kernel_time(triton_prefill, args.iters, flush, args.graphs, "triton prefill")
    baseline = baseline_time(args, lambda ta: ta.paged_attention(
        query, k_cache, v_cache, bt, seq, qsl, scale, out=out, sliding_window=window, bidir_spans=spans), flush)
    t_sdpa = kernel_time(sdpa_prefill, args.iters, flush, args.graphs, "sdpa prefill")
    row = {"layout": name, "case": kind, "tokens": n, "triton_us": t_triton * 1e6, "baseline_us": baseline,
           "TFLOP_per_s": flops / t_triton / 1e12, "frac_of_matmul": flops / t_triton / mm_rate,
           "sdpa_us": t_sdpa * 1e6, "sdpa_TFLOP_per_s": flops / t_sdpa / 1e12,
           "triton_vs_sdpa_rate": t_sdpa / t_triton, "rel_err": err}
    if kind == "causal":  # as the worker plans it: the lengths on the host, the prompt on SDPA
        host = HostLayout(seq.cpu().numpy(), qsl.cpu().numpy(), n)
        plan = ta.plan_attention(bt, seq, qsl, k_cache.shape[1], host=host)
        routed = torch.full_like(query, float("nan"))

        def routed_prefill():
            ta.paged_attention(query, k_cache, v_cache, bt, seq, qsl, scale, out=routed, plan=plan)

        try:
            routed_prefill()
            row["routed_err"] = rel_error(routed, sdpa_prefill()[0].transpose(0, 1))
            if not row["routed_err"] < 2e-2:
                raise AssertionError(f"relative error {row['routed_err']:.2e} against SDPA")
            row["routed_us"] = 1e6 * kernel_time(routed_prefill, args.iters, flush, args.graphs, "routed prefill")
            row["routed_vs_sdpa_rate"] = t_sdpa * 1e6 / row["routed_us"]
        except (AssertionError, RuntimeError) as exc:  # the Triton numbers above stand
            row["routed_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return row


def bench_prefill(args, ta, dtype, mm_rate, flush, gqa, gen, name: str) -> list[dict]:
    """Each prefill case in the Triton kernel against causal flash SDPA on the same number of
    tokens (for the image cases too: FLOPs are counted as causal, 4 * N^2/2 * heads * head_dim,
    for both); plain causal prompts also as the worker runs them (`routed`: planned with
    the lengths on the host, so a long prompt goes to SDPA over its gathered K/V,
    kernels/sdpa_prefill.py)."""
    rows = []
    cases = [("causal", n) for n in args.prefill] + [(k, 0) for k in args.prefill_images if name in args.image_layouts]
    for kind, n in cases:
        try:
            row = prefill_row(args, ta, kind, n, dtype, mm_rate, flush, gqa, gen, name)
        except (AssertionError, RuntimeError) as exc:  # wrong, or no kernel here: reported, the rest still run
            row = {"layout": name, "case": kind, "tokens": n, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        rows.append(row)
        print_row(row, PREFILL_COLUMNS)
    return rows


def baseline_time(args, call, flush) -> float | None:
    """µs of `call(module)` with --baseline's kernel module (another revision's, checked by
    that revision's tests); None without --baseline."""
    if args.baseline is None:
        return None
    return kernel_time(lambda: call(args.baseline), args.iters, flush, args.graphs, "baseline") * 1e6


def load_baseline(path: Path):
    """Another kernels/triton_attention.py (an older revision's, say), imported as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("baseline_triton_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DECODE_COLUMNS = ("layout", "batch", "context", "lengths", "triton_us", "baseline_us", "GB_per_s", "frac_of_copy",
                  "sdpa_us", "sdpa_kind", "triton_vs_sdpa")
PREFILL_COLUMNS = ("layout", "case", "tokens", "triton_us", "baseline_us", "TFLOP_per_s", "frac_of_matmul", "sdpa_us",
                   "sdpa_TFLOP_per_s", "triton_vs_sdpa_rate", "routed_us", "routed_vs_sdpa_rate")


def print_row(row: dict, cols: tuple) -> None:
    """One markdown table row (rows that failed show their error)."""
    cells = [f"{row[c]:.3g}" if isinstance(row.get(c), float) else str(row.get(c, row.get("error", "")))
             for c in cols]
    print("| " + " | ".join(cells) + " |", flush=True)


def print_header(cols: tuple) -> None:
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols), flush=True)


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--batches", type=parse_ints, default=[64, 128, 256])
    ap.add_argument("--contexts", type=parse_ints, default=[512, 1024, 2048, 4096, 8192])
    ap.add_argument("--prefill", type=parse_ints, default=[1024, 2048, 4096, 8192])
    ap.add_argument("--prefill-images", type=lambda s: [x for x in s.split(",") if x],
                    default=["images", "images-window"],
                    help="image prefill cases (8 frames x 256 bidirectional tokens + text): images, images-window")
    ap.add_argument("--image-layouts", type=lambda s: s.split(","), default=list(LAYOUTS),
                    help="layouts that run the image cases")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layouts", type=lambda s: s.split(","), default=list(LAYOUTS),
                    help=f"attention layouts, of {', '.join(LAYOUTS)}")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-graphs", dest="graphs", action="store_false",
                    help="time launch by launch (the host's gaps included), not a CUDA graph's replay")
    ap.add_argument("--quick", action="store_true",
                    help="batches 64,256; contexts 512,8192; prefill 512,1024,8192")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes on the CPU under TRITON_INTERPRET=1: checks this script, "
                         "measures nothing")
    ap.add_argument("--json", type=Path, help="also write every row here")
    ap.add_argument("--baseline", type=Path, help="another triton_attention.py to time beside this tree's "
                                                  "(git show REV:kernels/triton_attention.py > FILE)")
    args = ap.parse_args()
    if unknown := set(args.layouts) - set(LAYOUTS):
        ap.error(f"unknown layouts {sorted(unknown)}: of {', '.join(LAYOUTS)}")
    if args.quick:
        args.batches, args.contexts, args.prefill = [64, 256], [512, 8192], [512, 1024, 8192]
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--smoke runs the kernels in Triton's CPU interpreter: set TRITON_INTERPRET=1")
        device, args.batches, args.contexts, args.prefill, args.iters = "cpu", [4], [40], [48], 2
    elif torch.cuda.is_available():
        device = "cuda"
    else:
        sys.exit("bench/compute/kernels.py needs a CUDA GPU (the Triton kernels run compiled only there); "
                 "--smoke checks the script on the CPU")
    import triton

    from kernels import triton_attention as ta

    args.baseline = load_baseline(args.baseline) if args.baseline else None

    dtype = DTYPES[args.dtype]
    gen = torch.Generator(device).manual_seed(0)
    flush = torch.empty(256 * 2**20 if device == "cuda" else 2**20, dtype=torch.uint8, device=device)
    env = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke test)",
           "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
           "python": platform.python_version(), "dtype": args.dtype, "block_size": args.block_size}
    copy_bw = copy_bandwidth(flush, args.iters, 2**30 if device == "cuda" else 2**20)
    mm = matmul_rate(dtype, flush, args.iters, 8192 if device == "cuda" else 256)
    env.update(copy_GB_per_s=copy_bw / 1e9, matmul_TFLOP_per_s=mm / 1e12)
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in env.items()))
    gqa = sdpa_gqa_kwargs(device)
    print_header(DECODE_COLUMNS)
    decode = [row for name in args.layouts for row in bench_decode(args, ta, dtype, copy_bw, flush, gqa, gen, name)]
    print_header(PREFILL_COLUMNS)
    prefill = [row for name in args.layouts for row in bench_prefill(args, ta, dtype, mm, flush, gqa, gen, name)]
    sampling = bench_sampling(device, args.smoke)
    result = {"env": env, "decode": decode, "prefill": prefill, "sampling": sampling}
    if args.json:  # kept if the vision tower fails below
        args.json.write_text(json.dumps(result, indent=1))
    try:
        result["vision"] = bench_vision(device, args.smoke, args.quick)
    except (Exception, SystemExit) as exc:  # its own error, reported beside the tables above
        result["vision"] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"vision tower: {result['vision']['error']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


def bench_sampling(device: str, smoke: bool) -> list[dict]:
    """bench/compute/sampling.py's cases for the Triton race (one tiny case in the smoke run)."""
    from bench.compute.sampling import DEFAULT_CASES, bench_case
    from kernels.triton_sampling import exponential_race as triton_race

    cases = "3x3000" if smoke else DEFAULT_CASES["cuda"]
    rows = [bench_case(*(int(n) for n in case.split("x")), device, triton_race, rounds=1 if smoke else 3,
                       iters=1 if smoke else 10) for case in cases.split(",")]
    print("\n| race: rows x vocab | torch ops | triton | triton / torch | triton reads |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rows']} x {r['vocab']} | {r['torch_ms']:.3f} ms | {r['fused_ms']:.3f} ms | "
              f"{r['fused_over_torch']:.3f} | {r['fused_read_gb_s']:.1f} GB/s |")
    return rows


def bench_vision(device: str, smoke: bool, quick: bool) -> dict:
    """bench/compute/vision_tower.py's table (a 2-layer tower at 224 px in the smoke run)."""
    from bench.compute import vision_tower

    result = vision_tower.bench(torch.device(device), torch.float32 if smoke else torch.bfloat16, smoke,
                                [2] if smoke else [1, 8] if quick else [1, 4, 8], 2 if smoke else 5)
    vision_tower.print_table(result)
    return result


if __name__ == "__main__":
    main()
