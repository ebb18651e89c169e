"""The decoder's per-layer elementwise work in torch ops: the CPU path, and the contract the
fused Triton kernels (kernels/triton_layer_ops.py) meet in one launch each.

Every function computes in transformers' order and precision (fp32 where transformers
computes in fp32, each product and sum rounded to the model's dtype where transformers
rounds it), so greedy outputs agree with transformers token for token in fp32:

    rms_norm(x, w, eps, gemma)               x [T, N] -> [T, N]
        llama:  w * (x.f32 * rsqrt(mean(x.f32^2) + eps)).to(dtype)   (LlamaRMSNorm)
        gemma:  (x.f32 * rsqrt(mean(x.f32^2) + eps) * (1 + w.f32)).to(dtype)   (Gemma3RMSNorm)
    add_rms_norm(y, residual, w, eps, gemma, y_weight=None) -> (out, new_residual)
        y' = rms_norm(y, y_weight) if y_weight is given else y   (Gemma's norm on a sublayer's output)
        new_residual = residual + y'                             (one rounding to dtype)
        out = rms_norm(new_residual, w)
    act_mul(gate_up, act)                    gate_up [T, 2I] -> act(gate) * up [T, I]
        act: "silu" | "gelu_pytorch_tanh" (F.gelu(approximate="tanh")), each op rounded to dtype
    rope_write_kv(qkv, positions, cos, sin, H, KV, D, k_cache, v_cache, slot_mapping,
                  q_norm=None, k_norm=None, eps=0.0, gemma=False) -> q [T, H, D]
        qkv [T, (H + 2 KV) D]: the fused projection's output (q heads, k heads, v heads)
        q, k per head: rms_norm over D with q_norm / k_norm when given (Qwen3, Gemma 3)
        q, k rotated: x * cos[p] + (x2, x1) * sin[p], the tables full width and in dtype,
            cos = (cos, cos), sin = (-sin, sin) (modeling/layers.RotaryEmbedding)
        k (rotated) and v written to slot_mapping[t] of the caches (slot < 0: not written)
        returns the rotated q [T, H, D] (here rows may be spaced apart; Triton's: contiguous)
    rope_tables(cos, sin, positions) -> (cos, sin, positions)
        what the step's layers pass rope_write_kv, made once per step: here the tables' rows
        of the step's positions ([T, 1, D], positions None: rows already picked), for the
        Triton kernel the tables and positions as they are (it reads the rows itself)

`positions` and `slot_mapping` may be int32 or int64.
"""

import torch
import torch.nn.functional as F

from kernels.torch_attention import write_kv

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (h * (1.0 + weight.float())).to(dtype)
    return weight * h.to(dtype)


def add_rms_norm(y: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 gemma: bool, y_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if y_weight is not None:
        y = rms_norm(y, y_weight, eps, gemma)
    residual = residual + y
    return rms_norm(residual, weight, eps, gemma), residual


def act_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    if act == "silu":
        return F.silu(gate) * up
    if act == "gelu_pytorch_tanh":
        return F.gelu(gate, approximate="tanh") * up
    raise ValueError(f"unsupported activation {act!r}; supported: {list(ACTIVATIONS)}")


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] (any strides) by its tokens' table rows cos/sin [T, 1, D]; contiguous.
    x1*cos - x2*sin and x2*cos + x1*sin, transformers' two halves, are x*cos + (x2, x1)*sin
    with the signed tables: the same products and sums, bit for bit."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * sin


def rope_tables(cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    """The tables' rows of the step's positions, [T, 1, D] each, gathered once for every layer."""
    return cos.index_select(0, positions)[:, None, :], sin.index_select(0, positions)[:, None, :], None


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                  num_heads: int, num_kv_heads: int, head_dim: int, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, q_norm: torch.Tensor | None = None,
                  k_norm: torch.Tensor | None = None, eps: float = 0.0, gemma: bool = False) -> torch.Tensor:
    num_tokens = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qk, v = qkv.split([q_size + kv_size, kv_size], dim=-1)
    qk = qk.view(num_tokens, num_heads + num_kv_heads, head_dim)
    cos_t, sin_t, _ = rope_tables(cos, sin, positions) if positions is not None else (cos, sin, None)
    if q_norm is not None:
        q, k = qk.split([num_heads, num_kv_heads], dim=1)
        q = rotate(rms_norm(q, q_norm, eps, gemma), cos_t, sin_t)
        k = rotate(rms_norm(k, k_norm, eps, gemma), cos_t, sin_t)
    else:  # q and k heads rotated together: one set of elementwise ops for both
        q, k = rotate(qk, cos_t, sin_t).split([num_heads, num_kv_heads], dim=1)
    write_kv(k, v.view(num_tokens, num_kv_heads, head_dim), k_cache, v_cache, slot_mapping)
    return q

