"""A decoder layer's elementwise work as fused Triton kernels, one launch per call: the
contract of kernels/torch_layer_ops.py (read its docstring), the same four functions.
Plain references: kernels/reference.py (`rms_norm_reference` and the three after it).

Numerics. Each kernel loads in the model's dtype, computes in fp32, and rounds to the
model's dtype (`rnd` below: to nearest, ties to even) exactly where torch's unfused ops
round, so an elementwise result is torch's bit for bit. Where torch's CUDA kernels call
expf / tanhf / rsqrtf these call the same functions (libdevice's; rsqrt.approx), and
divide with IEEE division (div_rn); GELU's `x + 0.044715 x^3` is one fma, as nvcc
contracts it in torch's kernel. Launched with enable_fp_fusion=False, so no other
multiply-add is fused: fp32 `x*cos + xs*sin` rounds both products, as torch's separate
kernels do. A norm's sum of squares adds in another order than torch's (and divides by N
where torch's CUDA mean multiplies by 1/N), so its rsqrt factor may differ in the last
bit, and a bf16 output then, rarely, by one ulp. Measured against torch_layer_ops on an
H200: act_mul and RoPE without norms equal on every element in bf16, fp16 and fp32; the
norms on all but ~5 in a million bf16 elements (tests/unit/kernels/test_triton_layer_ops.py).

rms_norm, one program per row, the row in registers (next_pow2(N) lanes):

    h = x[t].f32
    r = rsqrt(sum(h * h) / N + eps)
    out[t] = rnd(w * rnd(h * r))                       # llama (LlamaRMSNorm)
           = rnd(h * r * (1 + w))                      # gemma (Gemma3RMSNorm), w in fp32

add_rms_norm, one program per row (out of place: two new [T, N] tensors):

    y = rms_norm(y[t], y_weight) if y_weight else y[t]  # Gemma's post-sublayer norm, in dtype
    new_residual[t] = rnd(residual[t] + y)
    out[t] = rms_norm(new_residual[t], w)

act_mul, one program per (token, ACT_BLOCK columns of the I outputs):

    g, u = gate_up[t, c], gate_up[t, I + c]            # fp32
    a = g / (1 + exp(-g))                              # silu
      = (0.5 g) (1 + tanh(0.7978846 fma(0.044715, g g g, g)))   # gelu_pytorch_tanh
    out[t, c] = rnd(rnd(a) * u)

rope_write_kv, one program per (token t, KV head j): the G = H / KV query heads that read
head j, then key head j and value head j:

    p = positions[t];  c, s = cos[p], sin[p]           # [D] rows: (cos, cos), (-sin, sin)
    for the G query heads [G, D], then key head j [1, D]:
        x = the heads in qkv[t];  xs = the same heads loaded with halves swapped (x2, x1)
        if norms: r = rsqrt(sum(x * x) / D + eps) per head   # xs shares its head's r
                  x, xs = weigh(x * r, w), weigh(xs * r, w swapped)   # as rms_norm, in dtype
        rot = rnd(rnd(x * c) + rnd(xs * s))
    q[t, heads] = rot_q
    slot = slot_mapping[t]
    if slot >= 0:                                      # < 0: padding, nothing stored
        k_cache[slot // bs, slot % bs, j] = rot_k;  v_cache[...] = qkv[t, v head j]  # int64

No wrapper reads a tensor's values on the host: launch parameters come from shapes and
dtypes alone, so every call can be captured in a CUDA graph. Each wrapper first checks
its arguments (kernels/triton_layer_checks.py: the dtypes, shapes and sizes accepted).
This module holds the kernels, their launch configurations and the four wrappers.

Under Triton's CPU interpreter (tests) two things differ, switched by constexprs: its
fp32 -> bf16 conversion truncates (Triton 3.9), so `rnd` rounds to bf16 with integer
arithmetic there (BF16_BY_BITS); and it has no libdevice, so exp is numpy's and tanh is
made from it (LIBDEVICE=False). Compiled, both are the real instructions.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels.triton_layer_checks import SUPPORTED_DTYPES, check_rope, check_rows, check_weight

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
ACT_BLOCK = 1024  # act_mul's columns per program: 8 per thread with 4 warps
GELU_BETA = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi), torch's kBeta (an fp32 in the kernel)
GELU_KAPPA = tl.constexpr(0.044715)


@triton.jit
def _rnd(x, DTYPE: tl.constexpr, BF16_BY_BITS: tl.constexpr):
    """fp32 x rounded to DTYPE (to nearest, ties to even) and back to fp32."""
    if DTYPE == tl.float32:
        y = x
    elif BF16_BY_BITS and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        y = tl.where(x == x, bits.to(tl.float32, bitcast=True), x)  # NaN stays NaN
    else:
        y = x.to(DTYPE).to(tl.float32)
    return y


@triton.jit
def _weigh(xn, w, GEMMA: tl.constexpr, DTYPE: tl.constexpr, BF16_BY_BITS: tl.constexpr):
    """Normalised xn times the norm weight w (both fp32), rounded where torch rounds."""
    if GEMMA:
        y = _rnd(xn * (1.0 + w), DTYPE, BF16_BY_BITS)
    else:
        y = _rnd(w * _rnd(xn, DTYPE, BF16_BY_BITS), DTYPE, BF16_BY_BITS)
    return y


@triton.jit
def _rms_norm_row(h, w_ptr, cols, mask, eps, N: tl.constexpr, GEMMA: tl.constexpr,
                  DTYPE: tl.constexpr, BF16_BY_BITS: tl.constexpr):
    """One row h (fp32, zero past N) normalised and weighed, in DTYPE's values."""
    r = tl.math.rsqrt(tl.math.div_rn(tl.sum(h * h, axis=0), N) + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return _weigh(h * r, w, GEMMA, DTYPE, BF16_BY_BITS)


@triton.jit
def _rms_norm_kernel(
    out_ptr, x_ptr, w_ptr, eps, stride_x_tok, stride_x_dim, stride_out_tok,
    N: tl.constexpr, BLOCK_N: tl.constexpr, GEMMA: tl.constexpr, BF16_BY_BITS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    h = tl.load(x_ptr + row * stride_x_tok + cols * stride_x_dim, mask=mask, other=0.0)
    out = _rms_norm_row(h.to(tl.float32), w_ptr, cols, mask, eps, N, GEMMA,
                        out_ptr.dtype.element_ty, BF16_BY_BITS)
    tl.store(out_ptr + row * stride_out_tok + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_kernel(
    out_ptr, res_out_ptr, y_ptr, res_ptr, w_ptr, y_w_ptr, eps,
    stride_y_tok, stride_y_dim, stride_res_tok, stride_res_dim, stride_out_tok,
    N: tl.constexpr, BLOCK_N: tl.constexpr, GEMMA: tl.constexpr, HAS_Y_WEIGHT: tl.constexpr,
    BF16_BY_BITS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    dtype = out_ptr.dtype.element_ty
    y = tl.load(y_ptr + row * stride_y_tok + cols * stride_y_dim, mask=mask, other=0.0)
    y = y.to(tl.float32)
    if HAS_Y_WEIGHT:
        y = _rms_norm_row(y, y_w_ptr, cols, mask, eps, N, GEMMA, dtype, BF16_BY_BITS)
    res = tl.load(res_ptr + row * stride_res_tok + cols * stride_res_dim, mask=mask, other=0.0)
    h = _rnd(res.to(tl.float32) + y, dtype, BF16_BY_BITS)
    tl.store(res_out_ptr + row * stride_out_tok + cols, h.to(dtype), mask=mask)
    out = _rms_norm_row(h, w_ptr, cols, mask, eps, N, GEMMA, dtype, BF16_BY_BITS)
    tl.store(out_ptr + row * stride_out_tok + cols, out.to(dtype), mask=mask)


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        y = libdevice.exp(x)  # CUDA's expf, as torch's kernels call it
    else:
        y = tl.exp(x)
    return y


@triton.jit
def _tanh(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        y = libdevice.tanh(x)  # CUDA's tanhf
    else:
        e = tl.exp(-2.0 * tl.abs(x))  # in (0, 1]: no overflow for any x
        t = (1.0 - e) / (1.0 + e)
        y = tl.where(x >= 0, t, -t)
    return y


@triton.jit
def _act_mul_kernel(
    out_ptr, gate_up_ptr, stride_gu_tok, stride_gu_dim, stride_out_tok,
    INTER: tl.constexpr, BLOCK: tl.constexpr, GELU: tl.constexpr, LIBDEVICE: tl.constexpr,
    BF16_BY_BITS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    dtype = out_ptr.dtype.element_ty
    src = gate_up_ptr + row * stride_gu_tok
    g = tl.load(src + cols * stride_gu_dim, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(src + (cols + INTER) * stride_gu_dim, mask=mask, other=0.0).to(tl.float32)
    if GELU:  # torch's GeluCUDAKernelImpl (tanh): the kappa term an fma, as nvcc makes it
        inner = GELU_BETA * tl.math.fma(GELU_KAPPA, g * g * g, g)
        a = 0.5 * g * (1.0 + _tanh(inner, LIBDEVICE))
    else:
        a = tl.math.div_rn(g, 1.0 + _exp(-g, LIBDEVICE))
    out = _rnd(_rnd(a, dtype, BF16_BY_BITS) * u, dtype, BF16_BY_BITS)
    tl.store(out_ptr + row * stride_out_tok + cols, out.to(dtype), mask=mask)


@triton.jit
def _norm_rotate(x, xs, w, ws, cos, sin, eps, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr,
                 GEMMA: tl.constexpr, DTYPE: tl.constexpr, BF16_BY_BITS: tl.constexpr):
    """Heads x [R, DIM_PAD] (fp32, zero past HEAD_DIM) and xs, the same heads with their
    halves swapped: each normalised with w (xs with w swapped, ws) when HAS_NORM, then
    rotated by the table rows cos, sin [DIM_PAD]."""
    if HAS_NORM:
        r = tl.math.rsqrt(tl.math.div_rn(tl.sum(x * x, axis=1), HEAD_DIM) + eps)[:, None]
        x = _weigh(x * r, w[None, :], GEMMA, DTYPE, BF16_BY_BITS)
        xs = _weigh(xs * r, ws[None, :], GEMMA, DTYPE, BF16_BY_BITS)
    return _rnd(_rnd(x * cos[None, :], DTYPE, BF16_BY_BITS)
                + _rnd(xs * sin[None, :], DTYPE, BF16_BY_BITS), DTYPE, BF16_BY_BITS)


@triton.jit
def _rope_write_kv_kernel(
    q_ptr, qkv_ptr, positions_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr,
    slot_mapping_ptr, q_norm_ptr, k_norm_ptr, eps,
    stride_qkv_tok, stride_qkv_dim, stride_cos_pos, stride_cos_dim,
    stride_sin_pos, stride_sin_dim,
    stride_kc_block, stride_kc_slot, stride_kc_head, stride_kc_dim,
    stride_vc_block, stride_vc_slot, stride_vc_head, stride_vc_dim,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, GROUP_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
    HAS_NORM: tl.constexpr, GEMMA: tl.constexpr, BF16_BY_BITS: tl.constexpr,
):
    GROUP: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    HALF: tl.constexpr = HEAD_DIM // 2
    tok = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    dtype = q_ptr.dtype.element_ty
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    swapped = tl.where(dims < HALF, dims + HALF, dims - HALF)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_cos_pos + dims * stride_cos_dim, mask=dim_ok, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_sin_pos + dims * stride_sin_dim, mask=dim_ok, other=0.0)
    cos = cos.to(tl.float32)
    sin = sin.to(tl.float32)
    q_w, q_ws, k_w, k_ws = cos, cos, cos, cos  # read only with norms
    if HAS_NORM:
        q_w = tl.load(q_norm_ptr + dims, mask=dim_ok, other=0.0).to(tl.float32)
        q_ws = tl.load(q_norm_ptr + swapped, mask=dim_ok, other=0.0).to(tl.float32)
        k_w = tl.load(k_norm_ptr + dims, mask=dim_ok, other=0.0).to(tl.float32)
        k_ws = tl.load(k_norm_ptr + swapped, mask=dim_ok, other=0.0).to(tl.float32)
    row = qkv_ptr + tok * stride_qkv_tok

    # the query heads of this KV head's group -> q[t]
    member = tl.arange(0, GROUP_PAD)[:, None]
    head = kv_head * GROUP + member
    q_ok = (member < GROUP) & dim_ok[None, :]
    x = tl.load(row + (head * HEAD_DIM + dims[None, :]) * stride_qkv_dim, mask=q_ok, other=0.0)
    xs = tl.load(row + (head * HEAD_DIM + swapped[None, :]) * stride_qkv_dim, mask=q_ok, other=0.0)
    q = _norm_rotate(x.to(tl.float32), xs.to(tl.float32), q_w, q_ws, cos, sin, eps, HEAD_DIM,
                     HAS_NORM, GEMMA, dtype, BF16_BY_BITS)
    q_offs = tok * (NUM_HEADS * HEAD_DIM) + head * HEAD_DIM + dims[None, :]  # q: contiguous
    tl.store(q_ptr + q_offs, q.to(dtype), mask=q_ok)

    # key head (rotated) and value head -> their cache slot
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot >= 0:
        k_head = NUM_HEADS + kv_head
        kx = tl.load(row + (k_head * HEAD_DIM + dims) * stride_qkv_dim, mask=dim_ok, other=0.0)
        kxs = tl.load(row + (k_head * HEAD_DIM + swapped) * stride_qkv_dim, mask=dim_ok, other=0.0)
        k = _norm_rotate(kx.to(tl.float32)[None, :], kxs.to(tl.float32)[None, :], k_w, k_ws,
                         cos, sin, eps, HEAD_DIM, HAS_NORM, GEMMA, dtype, BF16_BY_BITS)
        v_head = NUM_HEADS + NUM_KV_HEADS + kv_head
        v = tl.load(row + (v_head * HEAD_DIM + dims) * stride_qkv_dim, mask=dim_ok, other=0.0)
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        k_dst = (k_cache_ptr + block * stride_kc_block + offset * stride_kc_slot
                 + kv_head * stride_kc_head + dims[None, :] * stride_kc_dim)
        v_dst = (v_cache_ptr + block * stride_vc_block + offset * stride_vc_slot
                 + kv_head * stride_vc_head + dims * stride_vc_dim)
        k_dtype = k_cache_ptr.dtype.element_ty
        v_dtype = v_cache_ptr.dtype.element_ty
        tl.store(k_dst, _rnd(k, k_dtype, BF16_BY_BITS).to(k_dtype), mask=dim_ok[None, :])
        tl.store(v_dst, _rnd(v.to(tl.float32), v_dtype, BF16_BY_BITS).to(v_dtype), mask=dim_ok)


# True when TRITON_INTERPRET=1 was set as this module was imported: its kernels then run
# on the CPU in Triton's numpy interpreter (tests only).
INTERPRETED = type(_rms_norm_kernel).__name__ == "InterpretedFunction"


def _empty(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """Every output is allocated here (the tests fill it with NaN instead, so an element a
    kernel leaves unwritten fails the comparison)."""
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def norm_config(hidden: int) -> dict:
    """rms_norm / add_rms_norm: the row in one tile, 8 fp32 values per thread up to 4096
    (4 warps for 2048, 8 for 4096), 16 per thread in 16 warps up to 16384, 32 warps above."""
    block = triton.next_power_of_2(hidden)
    return dict(BLOCK_N=block, num_warps=min(16, max(1, block // 512)) if block <= 16384 else 32)


def act_mul_config(inter: int) -> dict:
    """act_mul: ACT_BLOCK columns (8 per thread) per program."""
    return dict(BLOCK=min(ACT_BLOCK, triton.next_power_of_2(inter)), num_warps=4)


def rope_config(num_heads: int, num_kv_heads: int, head_dim: int) -> dict:
    """rope_write_kv: a [next_pow2(group), next_pow2(head_dim)] query tile, about 8 values
    per thread (1 to 8 warps)."""
    group_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    dim_pad = triton.next_power_of_2(head_dim)
    return dict(GROUP_PAD=group_pad, DIM_PAD=dim_pad,
                num_warps=min(8, max(1, group_pad * dim_pad // 256)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    """RMSNorm of each row of x [..., N] (any row stride): a new contiguous tensor."""
    check_rows("x", x)
    check_weight("weight", weight, x, gemma)
    n = x.shape[-1]
    rows = x.reshape(-1, n)  # a view for row-strided 2-D input
    out = _empty(rows.shape, x)
    if rows.shape[0] > 0:
        _rms_norm_kernel[(rows.shape[0],)](
            out, rows, weight, float(eps), *rows.stride(), out.stride(0),
            N=n, GEMMA=bool(gemma), BF16_BY_BITS=INTERPRETED, **norm_config(n),
            enable_fp_fusion=False,
        )
    return out.view(x.shape)


def add_rms_norm(y: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 gemma: bool, y_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, new_residual), two new contiguous tensors; y and residual are only read."""
    check_rows("y", y)
    if residual.shape != y.shape or residual.dtype != y.dtype or residual.device != y.device:
        raise ValueError(f"residual {residual.dtype} {tuple(residual.shape)} must match y "
                         f"{y.dtype} {tuple(y.shape)} on {y.device}")
    check_weight("weight", weight, y, gemma)
    if y_weight is not None:
        check_weight("y_weight", y_weight, y, gemma)
    n = y.shape[-1]
    y_rows, res_rows = y.reshape(-1, n), residual.reshape(-1, n)
    out, new_residual = _empty(y_rows.shape, y), _empty(y_rows.shape, y)
    if y_rows.shape[0] > 0:
        _add_rms_norm_kernel[(y_rows.shape[0],)](
            out, new_residual, y_rows, res_rows, weight,
            weight if y_weight is None else y_weight,  # not read without HAS_Y_WEIGHT
            float(eps), *y_rows.stride(), *res_rows.stride(), out.stride(0),
            N=n, GEMMA=bool(gemma), HAS_Y_WEIGHT=y_weight is not None,
            BF16_BY_BITS=INTERPRETED, **norm_config(n), enable_fp_fusion=False,
        )
    return out.view(y.shape), new_residual.view(y.shape)


def act_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up for gate_up [T, 2I] (any row stride): a new contiguous [T, I]."""
    if act not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {act!r}; supported: {list(ACTIVATIONS)}")
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"want gate_up [T, 2I] of {SUPPORTED_DTYPES}, got "
                         f"{gate_up.dtype} {tuple(gate_up.shape)}")
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = _empty((num_tokens, inter), gate_up)
    if num_tokens > 0 and inter > 0:
        cfg = act_mul_config(inter)
        _act_mul_kernel[(num_tokens, triton.cdiv(inter, cfg["BLOCK"]))](
            out, gate_up, *gate_up.stride(), out.stride(0),
            INTER=inter, GELU=act == "gelu_pytorch_tanh", LIBDEVICE=not INTERPRETED,
            BF16_BY_BITS=INTERPRETED, **cfg, enable_fp_fusion=False,
        )
    return out


def rope_tables(cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel reads the tables' rows itself: the tables and positions as they are."""
    return cos, sin, positions


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  num_heads: int, num_kv_heads: int, head_dim: int, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, q_norm: torch.Tensor | None = None,
                  k_norm: torch.Tensor | None = None, eps: float = 0.0, gemma: bool = False) -> torch.Tensor:
    """Rotated (and normed) q, a new contiguous [T, H, D]; rotated k and raw v stored in
    their slots of the caches (cast to the caches' dtype). qkv may have any row stride."""
    check_rope(qkv, positions, cos, sin, num_heads, num_kv_heads, head_dim, k_cache, v_cache,
               slot_mapping, q_norm, k_norm, gemma)
    num_tokens = qkv.shape[0]
    q = _empty((num_tokens, num_heads, head_dim), qkv)
    if num_tokens == 0:
        return q
    _rope_write_kv_kernel[(num_tokens, num_kv_heads)](
        q, qkv, positions, cos, sin, k_cache, v_cache, slot_mapping,
        qkv if q_norm is None else q_norm, qkv if k_norm is None else k_norm,  # read with norms only
        float(eps), *qkv.stride(), *cos.stride(), *sin.stride(), *k_cache.stride(), *v_cache.stride(),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1], HAS_NORM=q_norm is not None, GEMMA=bool(gemma),
        BF16_BY_BITS=INTERPRETED, **rope_config(num_heads, num_kv_heads, head_dim),
        enable_fp_fusion=False,
    )
    return q
