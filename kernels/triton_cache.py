"""Triton kernels that move K/V into and between cache blocks.

Cache layout as in kernels/reference.py: per layer a K and a V tensor `[num_blocks,
block_size, num_kv_heads, head_dim]`; slot `s` is block `s // block_size`, offset
`s % block_size`. Both references live in kernels/reference.py (`write_kv_reference`,
`copy_blocks_reference`).

write_kv (vLLM's reshape_and_cache), one program per new token:

    slot = slot_mapping[t]
    if slot < 0: exit                            # padding token: nothing to store
    k_cache[slot // block_size, slot % block_size, :, :] = key[t, :, :]   # int64 addresses
    v_cache[...same...] = value[t, :, :]         # cast to the cache dtype on store

copy_blocks (copy-on-write; swap between two caches on one device), one program per
(pair, CHUNK elements of a block):

    for (src, dst) in pairs, chunk c:
        dst_k[dst].flat[c*CHUNK : (c+1)*CHUNK] = src_k[src].flat[same]   # and V alike

Programs run in any order, so a block may not be both a source and a destination, nor a
destination twice (the wrapper checks). Swapping to or from host memory is a torch copy,
not a kernel.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_key_tok, stride_key_head, stride_key_dim,
    stride_value_tok, stride_value_head, stride_value_dim,
    stride_kc_block, stride_kc_slot, stride_kc_head, stride_kc_dim,
    stride_vc_block, stride_vc_slot, stride_vc_head, stride_vc_dim,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        heads = tl.arange(0, HEADS_PAD)[:, None]
        dims = tl.arange(0, DIM_PAD)[None, :]
        mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
        k = tl.load(key_ptr + tok * stride_key_tok + heads * stride_key_head
                    + dims * stride_key_dim, mask=mask)
        v = tl.load(value_ptr + tok * stride_value_tok + heads * stride_value_head
                    + dims * stride_value_dim, mask=mask)
        k_dst = k_cache_ptr + block * stride_kc_block + offset * stride_kc_slot
        v_dst = v_cache_ptr + block * stride_vc_block + offset * stride_vc_slot
        tl.store(k_dst + heads * stride_kc_head + dims * stride_kc_dim,
                 k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst + heads * stride_vc_head + dims * stride_vc_dim,
                 v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _copy_blocks_kernel(
    src_k_ptr, src_v_ptr, dst_k_ptr, dst_v_ptr, pairs_ptr,
    stride_src_k, stride_src_v, stride_dst_k, stride_dst_v,
    BLOCK_NUMEL: tl.constexpr, CHUNK: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < BLOCK_NUMEL
    src = tl.load(pairs_ptr + 2 * pair)  # int64 block ids
    dst = tl.load(pairs_ptr + 2 * pair + 1)
    k = tl.load(src_k_ptr + src * stride_src_k + offs, mask=mask)
    v = tl.load(src_v_ptr + src * stride_src_v + offs, mask=mask)
    tl.store(dst_k_ptr + dst * stride_dst_k + offs, k, mask=mask)
    tl.store(dst_v_ptr + dst * stride_dst_v + offs, v, mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store key[t] and value[t] ([tokens, kv_heads, head_dim], any strides) in slot
    slot_mapping[t] of the caches; slot -1 is skipped."""
    if key.dim() != 3 or key.shape != value.shape or k_cache.dim() != 4 \
            or k_cache.shape != v_cache.shape or key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"want key/value [tokens, kv_heads, head_dim] matching caches "
                         f"[blocks, block_size, kv_heads, head_dim]; got {tuple(key.shape)}, "
                         f"{tuple(value.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if slot_mapping.shape != key.shape[:1] or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32/int64 [{key.shape[0]}], got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if slot_mapping.stride(0) != 1 and key.shape[0] > 1:
        raise ValueError("slot_mapping must be contiguous")
    if len({t.device for t in (key, value, k_cache, v_cache, slot_mapping)}) != 1:
        raise ValueError("key, value, caches and slot_mapping must share one device")
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), DIM_PAD=triton.next_power_of_2(head_dim),
    )


def copy_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, pairs: list[tuple[int, int]],
                dst_k_cache: torch.Tensor | None = None,
                dst_v_cache: torch.Tensor | None = None) -> None:
    """Block dst := block src, K and V, for each (src, dst) pair; into the same caches, or
    into `dst_k_cache`/`dst_v_cache` (same device and block shape) when given."""
    dst_k = k_cache if dst_k_cache is None else dst_k_cache
    dst_v = v_cache if dst_v_cache is None else dst_v_cache
    caches = (k_cache, v_cache, dst_k, dst_v)
    if any(c.shape[1:] != k_cache.shape[1:] or c.dtype != k_cache.dtype for c in caches):
        raise ValueError("source and destination caches must share block shape and dtype")
    if len({c.device for c in caches}) != 1:
        raise ValueError("copy_blocks copies within one device; swap to host with torch")
    if not all(c[0].is_contiguous() for c in caches):
        raise ValueError("each cache block must be contiguous in memory")
    if not pairs:
        return
    srcs, dsts = [s for s, _ in pairs], [d for _, d in pairs]
    same_cache = dst_k.data_ptr() == k_cache.data_ptr() or dst_v.data_ptr() == v_cache.data_ptr()
    if len(set(dsts)) != len(dsts) or (same_cache and set(srcs) & set(dsts)):
        raise ValueError(f"pairs {pairs}: destinations must be distinct and not also sources")
    for ids, cache in ((srcs, k_cache), (dsts, dst_k)):
        if min(ids) < 0 or max(ids) >= cache.shape[0]:
            raise ValueError(f"block ids {ids} out of range for {cache.shape[0]} blocks")
    pairs_t = torch.tensor(pairs, dtype=torch.int64, device=k_cache.device)
    block_numel = k_cache[0].numel()
    chunk = min(4096, triton.next_power_of_2(block_numel))
    grid = (len(pairs), triton.cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](
        k_cache, v_cache, dst_k, dst_v, pairs_t,
        k_cache.stride(0), v_cache.stride(0), dst_k.stride(0), dst_v.stride(0),
        BLOCK_NUMEL=block_numel, CHUNK=chunk,
    )
