"""The worker's KV cache memory: the one place its layout is defined.

Layout. One allocation `kv` of shape

    [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]

`kv[0, layer]` is that layer's K cache and `kv[1, layer]` its V cache, each a contiguous
`[num_blocks, block_size, num_kv_heads, head_dim]` view. A slot `block_id * block_size +
offset` addresses one token's K (or V) vector of `num_kv_heads * head_dim` values, so
`k_cache.view(-1, num_kv_heads, head_dim)[slot]` is that token. Block ids come from the
scheduler (kvstore's block pool); this class never decides which block holds what.

The memory is zero-filled: kernels that read padded positions (the torch backend gathers
whole blocks, then masks) rely on every slot being finite, and it only ever receives model
outputs afterwards.
"""

import torch


KV_CACHE_DTYPES = ("auto", "bfloat16")  # --kv-cache-dtype


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype,
                           device: torch.device) -> tuple[torch.dtype, str]:
    """(the KV cache's dtype, why). "auto": the model's. "bfloat16": half of fp32's bytes
    for an fp32 model (twice the blocks in the same memory, half the bytes a decode's
    attention reads), on the CPU backends, which compute attention in fp32 either way; on
    other devices the cache keeps the model's dtype (the Triton kernels take one dtype)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown KV cache dtype {name!r}; choose one of {list(KV_CACHE_DTYPES)}")
    if name == "auto" or model_dtype != torch.float32:  # bf16 and fp16 are 2 bytes already
        return model_dtype, f"{name}: the model's"
    if device.type != "cpu":
        raise ValueError(f"--kv-cache-dtype bfloat16 with a {str(model_dtype).removeprefix('torch.')} "
                         f"model runs on the CPU only; on {device.type} the cache keeps the model's dtype")
    return torch.bfloat16, "--kv-cache-dtype bfloat16"


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> int:
    """K and V of one block across all layers."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element


def num_blocks_for_memory(memory_bytes: int, num_layers: int, block_size: int,
                          num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """How many whole blocks fit in `memory_bytes` of K + V cache."""
    return memory_bytes // bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)


class KVCacheTensors:
    """Per-layer K and V caches carved out of one zero-filled tensor (layout above)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str | torch.device = "cpu"):
        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block, got num_blocks={num_blocks}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.kv = torch.zeros(2, num_layers, num_blocks, block_size, num_kv_heads, head_dim,
                              dtype=dtype, device=device)
        self.k_caches = self.kv[0].unbind(0)  # tuples of views: no copies
        self.v_caches = self.kv[1].unbind(0)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of one layer, each [num_blocks, block_size, kvh, head_dim]."""
        return self.k_caches[index], self.v_caches[index]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Block dst := block src in every layer's K and V, for each (src, dst) pair.
        Sources are read before any destination is written, so pairs must not chain."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.kv.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.kv.device)
        self.kv[:, :, dst] = self.kv[:, :, src]


def swap_blocks(src: KVCacheTensors, dst: KVCacheTensors, pairs: list[tuple[int, int]]) -> None:
    """Block d of `dst` := block s of `src` in every layer's K and V, for each (s, d) pair,
    across devices (GPU -> CPU swap space, or back): one gather on the source device, one
    transfer, one scatter on the destination device."""
    if not pairs:
        return
    src_ids = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=src.kv.device)
    dst_ids = torch.tensor([d for _, d in pairs], dtype=torch.long, device=dst.kv.device)
    blocks = src.kv.index_select(2, src_ids).to(dst.kv.device, non_blocking=False)
    dst.kv.index_copy_(2, dst_ids, blocks)
