"""Long causal prefill chunks on torch's SDPA, beside the Triton paged kernel.

For a chunk of MIN_TOKENS or more new tokens in a step with no image and on a layer with no
window (kernels/triton_attention.py plans it), in fp16/bf16, the Triton backend gathers the
request's context K/V out of the paged cache into contiguous tensors and runs causal SDPA on
them, the mask aligned to the last key (a chunk after cached context sees all of it). SDPA
picks its fused kernel: cuDNN or flash for a whole prompt, flash for a chunk after context
(torch.nn.attention.bias.causal_lower_right). fp32 stays in the Triton kernel: SDPA's fused
kernels do not take it, and its math fallback would hold the whole score matrix.

    for each routed request i (query rows [q0, q0 + q_len), seq_len keys):
        blocks = block_tables[i, :ceil(seq_len / block_size)]                 # planned once a step
        K, V = cache[blocks] as [kv_heads, seq_len, head_dim]                  # the gather
        out[q0 : q0 + q_len] = SDPA(Q, K, V, causal lower-right, scale, GQA)

The gather reads the context once and writes it once; the Triton kernel skips these
requests (`skip`, int32 per request) and takes the rest of the step: decodes, shorter
chunks, and every request of a step with images or on a sliding layer. A soft cap (Gemma 2)
keeps the whole step in Triton. On an H200 (bench/compute/kernels.py, docs/benchmarks.md
"Kernels") this path is the faster from 1,024 tokens (0.9x the Triton kernel's time there,
0.55-0.6x at 8,192) and the slower at 512 (1.06-1.5x: the gather and the launches), hence
MIN_TOKENS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kernels.host_layout import HostLayout

DTYPES = (torch.float16, torch.bfloat16)
MIN_TOKENS = 1024  # a chunk's new tokens from which it runs on SDPA (H200: bench/compute/kernels.py)


@dataclass(frozen=True)
class SdpaRoute:
    """The requests a step sends to SDPA, (index, first query row, q_len, seq_len) each, their
    context's block ids (int64 on the device, once a step: every layer gathers by them), and
    `skip` (int32 [num_seqs] on the device: 1 for those) for the Triton kernel, computed on
    the device from query_start_loc (no copy from the host, so no wait for queued work)."""

    requests: tuple[tuple[int, int, int, int], ...]
    blocks: tuple[torch.Tensor, ...]
    skip: torch.Tensor


def plan_route(host: HostLayout | None, sliding_window: int | None, bidir_spans: torch.Tensor | None,
               query_start_loc: torch.Tensor, block_tables: torch.Tensor, block_size: int,
               min_tokens: int | None = None) -> SdpaRoute | None:
    """The step's SDPA requests (q_len >= min_tokens, default MIN_TOKENS) from the lengths on
    the host; None when there are none, or when the step has images or the layer a window,
    or the lengths are not on the host."""
    min_tokens = MIN_TOKENS if min_tokens is None else min_tokens
    if host is None or sliding_window is not None or bidir_spans is not None:
        return None
    qsl, seq_lens = host.query_start_loc, host.seq_lens
    q_lens = qsl[1:] - qsl[:-1]
    chosen = (q_lens >= min_tokens).nonzero()[0]
    if len(chosen) == 0:
        return None
    requests = tuple((int(i), int(qsl[i]), int(q_lens[i]), int(seq_lens[i])) for i in chosen)
    blocks = tuple(block_tables[i, : math.ceil(seq_len / block_size)].long() for i, _, _, seq_len in requests)
    skip = ((query_start_loc[1:] - query_start_loc[:-1]) >= min_tokens).to(torch.int32)
    return SdpaRoute(requests, blocks, skip)


def run_route(route: SdpaRoute, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              scale: float, out: torch.Tensor) -> None:
    """Each routed request's attention into its rows of `out` (the contract of
    kernels/reference.py's paged_attention_reference, without window, spans or soft cap)."""
    kv_heads, head_dim = k_cache.shape[2:]
    gqa = query.shape[1] != kv_heads
    by_head = (k_cache.permute(2, 0, 1, 3), v_cache.permute(2, 0, 1, 3))  # [kv_heads, blocks, block_size, d] views
    for (_, q0, q_len, seq_len), blocks in zip(route.requests, route.blocks):
        # one gather each, into [kv_heads, blocks * block_size, d]: every head's keys contiguous
        k, v = (c.index_select(1, blocks).view(kv_heads, -1, head_dim)[None, :, :seq_len] for c in by_head)
        q = query[q0:q0 + q_len].transpose(0, 1)[None]
        if q_len == seq_len:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q_len, seq_len), scale=scale,
                                               enable_gqa=gqa)
        out[q0:q0 + q_len] = o[0].transpose(0, 1)
