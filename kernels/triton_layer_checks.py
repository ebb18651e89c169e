"""What the Triton layer ops' wrappers (kernels/triton_layer_ops.py) accept, checked on the
host before any launch: dtypes, shapes, strides and devices (ValueError otherwise). A
check reads shapes, strides, dtypes and devices only, never a tensor's values, so a
checked call can still be captured in a CUDA graph; and it needs no Triton, so a wrong
call fails the same way in every process.
"""

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HIDDEN = 32768  # rms_norm keeps a row in registers
MAX_HEAD_DIM = 256


def check_rows(name: str, x: torch.Tensor) -> None:
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name}: dtype {x.dtype} not supported ({SUPPORTED_DTYPES})")
    if x.dim() < 1 or x.shape[-1] > MAX_HIDDEN:
        raise ValueError(f"{name}: want [..., N] with N <= {MAX_HIDDEN}, got {tuple(x.shape)}")


def check_weight(name: str, weight: torch.Tensor, x: torch.Tensor, gemma: bool) -> None:
    """A contiguous [N] weight on x's device; llama-style multiplies it in x's dtype (torch
    would promote a weight of another dtype), gemma-style takes any float weight."""
    if weight.shape != x.shape[-1:] or weight.stride(0) != 1 or weight.device != x.device:
        raise ValueError(f"{name}: want a contiguous [{x.shape[-1]}] weight on {x.device}, got "
                         f"{tuple(weight.shape)} (strides {weight.stride()}) on {weight.device}")
    if (not gemma and weight.dtype != x.dtype) or weight.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name}: weight dtype {weight.dtype} with input {x.dtype} (gemma={gemma})")


def check_rope(qkv, positions, cos, sin, num_heads, num_kv_heads, head_dim, k_cache, v_cache,
               slot_mapping, q_norm, k_norm, gemma):
    if qkv.dim() != 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv {tuple(qkv.shape)} is not [T, (H + 2 KV) D] for H={num_heads}, "
                         f"KV={num_kv_heads}, D={head_dim}")
    if num_kv_heads < 1 or num_heads % num_kv_heads or head_dim % 2 or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"H={num_heads} over KV={num_kv_heads} heads of D={head_dim}: want "
                         f"H a multiple of KV and D even, at most {MAX_HEAD_DIM}")
    if qkv.dtype not in SUPPORTED_DTYPES or cos.dtype != qkv.dtype or sin.dtype != qkv.dtype:
        raise ValueError(f"qkv {qkv.dtype} and tables {cos.dtype}/{sin.dtype}: want one dtype "
                         f"of {SUPPORTED_DTYPES}")
    if cos.dim() != 2 or cos.shape[1] != head_dim or sin.shape != cos.shape:
        raise ValueError(f"cos/sin {tuple(cos.shape)}/{tuple(sin.shape)}: want [max_pos, {head_dim}]")
    want = (k_cache.shape[0], k_cache.shape[1], num_kv_heads, head_dim)
    if k_cache.dim() != 4 or tuple(k_cache.shape) != want or v_cache.shape != k_cache.shape \
            or k_cache.dtype not in SUPPORTED_DTYPES or v_cache.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} "
                         f"{k_cache.dtype}/{v_cache.dtype}: want [blocks, block_size, "
                         f"{num_kv_heads}, {head_dim}] in {SUPPORTED_DTYPES}")
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        if t.shape != qkv.shape[:1] or t.dtype not in (torch.int32, torch.int64) \
                or (t.shape[0] > 1 and t.stride(0) != 1):
            raise ValueError(f"{name} must be contiguous int32/int64 [{qkv.shape[0]}], got "
                             f"{t.dtype} {tuple(t.shape)}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm come together")
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):  # llama-style: in qkv's dtype
        if w is not None and (w.shape != (head_dim,) or w.stride(0) != 1
                              or w.dtype not in SUPPORTED_DTYPES or (not gemma and w.dtype != qkv.dtype)):
            raise ValueError(f"{name} must be a contiguous [{head_dim}] weight (of qkv's dtype "
                             f"unless gemma), got {w.dtype} {tuple(w.shape)}")
    tensors = [t for t in (qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, q_norm,
                           k_norm) if t is not None]
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"tensors on several devices: {sorted({str(t.device) for t in tensors})}")
