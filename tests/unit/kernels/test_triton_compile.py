"""The Triton kernels (kernels/triton_attention.py, kernels/triton_cache.py,
kernels/triton_layer_ops.py, kernels/triton_sampling.py) compiled ahead of time for sm_80/sm_90 on a machine without a
GPU, through Triton's own compiler and ptxas, specialised as the wrappers would launch them.
This catches what the interpreter runs of tests/unit/kernels/test_triton_kernels.py and
tests/unit/kernels/test_triton_layer_ops.py cannot: code the compiler rejects, tile sizes that spill
registers (a local-memory stack, read with cuobjdump where Triton ships one), and multiply-adds
fused where torch rounds the product."""

import os
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from kernels import triton_attention, triton_cache, triton_layer_ops, triton_sampling, triton_tiles  # noqa: E402  (after the importorskip)

INTERPRETER = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")

ATTN_POINTERS = ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr")


def compile_kernel(kernel, arch: int, pointer_types: dict, constexprs: dict, floats=(),
                   options=None):
    """Triton's ahead-of-time path: source -> TTIR -> PTX -> cubin for sm_`arch`, no GPU.
    Arguments are specialised as a launch with contiguous bf16 tensors would be: unit
    strides (`*_dim`) constant, pointers and other strides divisible by 16. Returns the
    compiled kernel (its `asm` holds the PTX and the cubin)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    constexprs = {**constexprs, **{n: 1 for n in names if n.startswith("stride") and n.endswith("_dim")}}
    signature = {n: "constexpr" if n in constexprs else pointer_types.get(n, "fp32" if n in floats else "i32")
                 for n in names}
    aligned = [n for n in names if n not in constexprs and n not in floats
               and (n in pointer_types or n.startswith("stride")) and n != "stride_bt_req"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    try:
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
        target = GPUTarget("cuda", arch, 32)
    except (TypeError, AttributeError, AssertionError) as exc:
        pytest.skip(f"this Triton's ahead-of-time API differs: {exc!r}")
    options = {"enable_fp_fusion": True, **(options or {})}  # the default, said explicitly
    return triton.compile(source, target=target, options=options)


def resource_usage(compiled) -> tuple[int, int] | None:
    """(registers, stack bytes) of a compiled kernel from cuobjdump when Triton ships one."""
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        return None
    cubin = Path(tempfile.mkdtemp()) / "kernel.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(cubin)],
                           capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return (int(found[1]), int(found[2])) if found else None


def compile_for_cuda(kernel, arch: int, pointer_types: dict, constexprs: dict, floats=(),
                     options=None):
    """compile_kernel's (registers, stack bytes), or None without cuobjdump."""
    return resource_usage(compile_kernel(kernel, arch, pointer_types, constexprs, floats, options))


COMPILE_CASES = {  # (dtype, decode_only, head_dim, group, window/soft-cap, arch, bidirectional spans)
    "bf16-decode-128-sm90": ("bf16", True, 128, 4, False, 90, False),
    "bf16-prefill-128-sm90": ("bf16", False, 128, 4, False, 90, False),
    "bf16-decode-128-sm80": ("bf16", True, 128, 4, False, 80, False),
    "bf16-prefill-128-sm80-options": ("bf16", False, 128, 4, True, 80, False),
    "fp16-prefill-80": ("fp16", False, 80, 4, True, 90, False),
    "bf16-decode-256": ("bf16", True, 256, 8, True, 90, False),
    "bf16-prefill-256": ("bf16", False, 256, 2, False, 90, False),
    "bf16-decode-64-group7": ("bf16", True, 64, 7, False, 90, False),
    "bf16-decode-128-group32": ("bf16", True, 128, 32, False, 90, False),
    "fp32-prefill-128": ("fp32", False, 128, 4, False, 90, False),
    "fp32-decode-256": ("fp32", True, 256, 4, True, 90, False),
    # Gemma 3 with images: head_dim 256 (4B/12B/27B) and 128, 2 query heads per kv head
    # (12B/27B: 16/8, 32/16), sliding layers (window, soft cap off as in Gemma 3) or global
    "bf16-prefill-256-spans-sliding": ("bf16", False, 256, 2, True, 90, True),
    "bf16-prefill-128-spans": ("bf16", False, 128, 2, False, 90, True),
    "bf16-prefill-128-spans-sm80": ("bf16", False, 128, 4, True, 80, True),
    "fp16-prefill-256-spans": ("fp16", False, 256, 2, False, 90, True),
    "fp32-prefill-256-spans": ("fp32", False, 256, 2, True, 90, True),
    "bf16-decode-256-spans": ("bf16", True, 256, 2, True, 90, True),
}
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@pytest.mark.skipif(INTERPRETER, reason="the interpreter run has no compiled kernels")
@pytest.mark.parametrize("case", sorted(COMPILE_CASES))
def test_attention_compiles_for_cuda_without_spills(case):
    """What the wrapper would launch compiles for Hopper/Ampere, and keeps its tiles in
    registers (no local-memory stack), on a machine without a GPU."""
    dtype, decode_only, head_dim, group, options, arch, spans = COMPILE_CASES[case]
    cfg = triton_tiles.launch_config(64 if decode_only else 300, 64, group, head_dim, TORCH_DTYPES[dtype],
                                     f"sm_{arch}")
    launch = {k: cfg.pop(k) for k in ("num_warps", "num_stages")}
    constexprs = dict(
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=16, USE_WINDOW=options, USE_SOFT_CAP=options, HAS_SPANS=spans,
        SKIP=not (decode_only or spans or options),  # a causal step with chunks on SDPA
        DOT_PRECISION="ieee" if dtype == "fp32" else None, UPCAST_DOT=False, **cfg)
    pointers = {n: "*" + dtype for n in ATTN_POINTERS}
    pointers.update({n: "*i32" for n in ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr",
                                         "bidir_spans_ptr", "skip_ptr")})
    usage = compile_for_cuda(triton_attention._paged_attention_kernel, arch, pointers, constexprs,
                             floats=("qk_scale", "cap_in", "cap_out"), options=launch)
    if usage is not None:
        assert usage[1] == 0, f"{case}: {usage[0]} registers and a {usage[1]}-byte stack (spills)"


TUNED_CASES = [(arch, phase, layout, spans) for (arch, phase, layout) in sorted(triton_tiles.TUNED)
               for spans in ((False, True) if phase == "prefill" else (False,))]


@pytest.mark.skipif(INTERPRETER, reason="the interpreter run has no compiled kernels")
@pytest.mark.skipif(not TUNED_CASES, reason="kernels/triton_tuned.json holds no entries")
@pytest.mark.parametrize("arch,phase,layout,spans", TUNED_CASES or [("", "", "", False)],
                         ids=[f"{a}-{p}-{k}" + ("-spans" if s else "") for a, p, k, s in TUNED_CASES] or ["none"])
def test_tuned_tiles_compile_without_spills(arch, phase, layout, spans):
    """Each tuned entry (kernels/triton_tuned.json), as its architecture launches it, in bf16,
    causal and with spans and a window, keeps its tiles in registers."""
    head_dim, group = (int(x[1:]) for x in layout.split("-"))
    block_m, tile_n, warps, stages = triton_tiles.TUNED[(arch, phase, layout)]
    constexprs = dict(GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
                      BLOCK_SIZE=16, USE_WINDOW=spans, USE_SOFT_CAP=False, HAS_SPANS=spans,
                      SKIP=phase == "prefill" and not spans, DOT_PRECISION=None,
                      UPCAST_DOT=False, BLOCK_M=block_m, BLOCK_Q=block_m // group, TILE_N=tile_n)
    pointers = {n: "*bf16" for n in ATTN_POINTERS}
    pointers.update({n: "*i32" for n in ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr",
                                         "bidir_spans_ptr", "skip_ptr")})
    usage = compile_for_cuda(triton_attention._paged_attention_kernel, int(arch.removeprefix("sm_")), pointers,
                             constexprs, floats=("qk_scale", "cap_in", "cap_out"),
                             options=dict(num_warps=warps, num_stages=stages))
    if usage is not None:
        assert usage[1] == 0, f"{arch} {phase} {layout}: {usage[0]} registers and a {usage[1]}-byte stack (spills)"


@pytest.mark.skipif(INTERPRETER, reason="the interpreter run has no compiled kernels")
def test_cache_kernels_compile_for_cuda():
    pointers = {"key_ptr": "*bf16", "value_ptr": "*bf16", "k_cache_ptr": "*bf16",
                "v_cache_ptr": "*bf16", "slot_mapping_ptr": "*i64"}
    usage = compile_for_cuda(triton_cache._write_kv_kernel, 90, pointers, dict(
        NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16, HEADS_PAD=8, DIM_PAD=128))
    assert usage is None or usage[1] == 0
    pointers = {n: "*bf16" for n in ("src_k_ptr", "src_v_ptr", "dst_k_ptr", "dst_v_ptr")}
    usage = compile_for_cuda(triton_cache._copy_blocks_kernel, 90, {**pointers, "pairs_ptr": "*i64"},
                             dict(BLOCK_NUMEL=16 * 8 * 128, CHUNK=4096))
    assert usage is None or usage[1] == 0


# -- the layer ops (kernels/triton_layer_ops.py) ---------------------------------------------

# (kernel, dtype, the size that shapes its tile, arch): Llama 3.2 1B's hidden 2048 and
# intermediate 8192, Gemma 3 12B's 3840 and 15360; head dims 128 (Qwen3's 32/8 heads, with
# q/k norms: the larger tile) and 256 (Gemma 3 12B's 16/8).
LAYER_OPS_CASES = [(kernel, dtype, size, arch)
                   for kernel, sizes in (("rms_norm", (2048, 3840)), ("add_rms_norm", (2048, 3840)),
                                         ("act_mul", (8192, 15360)), ("rope_write_kv", (128, 256)))
                   for dtype in ("bf16", "fp32") for size in sizes for arch in (80, 90)]


def _layer_op_compile_args(kernel: str, dtype: str, size: int) -> tuple:
    """(jit function, pointer types, constexprs, options) as the wrapper launches it: Gemma
    style (and Gemma 3's y_weight, q/k norms, GELU) at the Gemma sizes, Llama's at the others."""
    gemma = size in (3840, 15360, 256)
    options = {"enable_fp_fusion": False}
    ptr = "*" + dtype
    if kernel in ("rms_norm", "add_rms_norm"):
        cfg = triton_layer_ops.norm_config(size)
        options["num_warps"] = cfg.pop("num_warps")
        constexprs = dict(N=size, GEMMA=gemma, BF16_BY_BITS=False, **cfg)
        if kernel == "rms_norm":
            fn, pointers = triton_layer_ops._rms_norm_kernel, ("out_ptr", "x_ptr", "w_ptr")
        else:
            fn, pointers = triton_layer_ops._add_rms_norm_kernel, (
                "out_ptr", "res_out_ptr", "y_ptr", "res_ptr", "w_ptr", "y_w_ptr")
            constexprs["HAS_Y_WEIGHT"] = gemma
        return fn, {n: ptr for n in pointers}, constexprs, options
    if kernel == "act_mul":
        cfg = triton_layer_ops.act_mul_config(size)
        options["num_warps"] = cfg.pop("num_warps")
        return triton_layer_ops._act_mul_kernel, {"out_ptr": ptr, "gate_up_ptr": ptr}, dict(
            INTER=size, GELU=gemma, LIBDEVICE=True, BF16_BY_BITS=False, **cfg), options
    heads, kv_heads = (16, 8) if gemma else (32, 8)
    cfg = triton_layer_ops.rope_config(heads, kv_heads, size)
    options["num_warps"] = cfg.pop("num_warps")
    pointers = {n: ptr for n in ("q_ptr", "qkv_ptr", "cos_ptr", "sin_ptr", "k_cache_ptr",
                                 "v_cache_ptr", "q_norm_ptr", "k_norm_ptr")}
    pointers.update(positions_ptr="*i64", slot_mapping_ptr="*i32")
    return triton_layer_ops._rope_write_kv_kernel, pointers, dict(
        NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, HEAD_DIM=size, BLOCK_SIZE=16, HAS_NORM=True,
        GEMMA=gemma, BF16_BY_BITS=False, **cfg), options


@pytest.mark.skipif(INTERPRETER, reason="the interpreter run has no compiled kernels")
@pytest.mark.parametrize("kernel,dtype,size,arch", LAYER_OPS_CASES,
                         ids=[f"{k}-{d}-{n}-sm{a}" for k, d, n, a in LAYER_OPS_CASES])
def test_layer_ops_compile_for_cuda_without_spills(kernel, dtype, size, arch):
    """Each layer-op kernel as its wrapper launches it compiles for Ampere and Hopper with no
    local-memory stack. Launched with enable_fp_fusion=False, the norms' and RoPE's PTX has no
    fp32 fma: fp32 x*cos + xs*sin rounds both products, as torch's unfused ops do. (LLVM may
    turn bf16(f32(a) * f32(b)) of bf16 a, b into a bf16 fma with -0 on sm_80: the same
    single rounding of an exact product. act_mul's fmas are GELU's written one and
    libdevice's inside exp/tanh.)"""
    fn, pointers, constexprs, options = _layer_op_compile_args(kernel, dtype, size)
    compiled = compile_kernel(fn, arch, pointers, constexprs, floats=("eps",), options=options)
    if kernel != "act_mul":
        fused = re.search(r"fma\.rn(\.ftz)?\.f32", compiled.asm["ptx"])
        assert not fused, f"{kernel}: an fp32 multiply-add was fused"
    usage = resource_usage(compiled)
    print(f"{kernel} {dtype} {size} sm_{arch} warps={options['num_warps']}: registers, stack = {usage}")
    if usage is not None:
        assert usage[1] == 0, f"{kernel}: {usage[0]} registers and a {usage[1]}-byte stack (spills)"


# -- the sampler's race (kernels/triton_sampling.py) -----------------------------------------

@pytest.mark.skipif(INTERPRETER, reason="the interpreter run has no compiled kernels")
@pytest.mark.parametrize("arch", [80, 90])
def test_exponential_race_compiles_for_cuda_exactly(arch):
    """The race as its wrapper launches it: no spills, no fused fp32 multiply-add (the
    uniform's `(k + 0.5) * 2**-23` rounds as torch's two ops do), IEEE division, and logf
    from libdevice rather than the approximate lg2 alone."""
    compiled = compile_kernel(triton_sampling._exponential_race_kernel, arch,
                              {"probs_ptr": "*fp32", "seeds_ptr": "*i64", "out_ptr": "*i64"},
                              dict(BLOCK=triton_sampling.BLOCK, LIBDEVICE=True),
                              options={"enable_fp_fusion": False, "num_warps": 8})
    ptx = compiled.asm["ptx"]
    assert re.search(r"div\.rn\.f32", ptx), "the division is not IEEE"
    assert re.search(r"mul\.rn\.f32\s+%\w+, %\w+, 0f34000000;", ptx), "the uniform's product was fused"
    assert re.search(r"fma\.rn(\.ftz)?\.f32", ptx), "no libdevice logf (its polynomial's fmas) in the kernel"
    usage = resource_usage(compiled)
    if usage is not None:
        assert usage[1] == 0, f"{usage[0]} registers and a {usage[1]}-byte stack (spills)"
