"""The attention cases the GPU kernel benches share (bench/compute/kernels.py,
bench/compute/tune_attention.py): the head layouts, a paged batch with its blocks scattered,
the same K/V gathered contiguous for SDPA, a camera question's image spans, the error measure."""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F


class Layout(NamedTuple):
    """An attention layout: query heads over KV heads of head_dim."""

    heads: int
    kv_heads: int
    head_dim: int


LAYOUTS = {"llama3-8b": Layout(32, 8, 128), "gemma3-12b": Layout(16, 8, 256)}


def sdpa_gqa_kwargs(device) -> dict:
    """enable_gqa=True where this torch has it (2.5+); else K/V get expanded per head."""
    q = torch.zeros(1, 4, 1, 16, device=device)
    kv = torch.zeros(1, 2, 3, 16, device=device)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
        return {"enable_gqa": True}
    except (TypeError, RuntimeError):
        return {}


def paged_batch(seq_lens: list[int], q_lens: list[int], dtype, block_size: int, gen, layout: Layout):
    """Random K/V for each request in scattered blocks; query rows at the end of each."""
    dev = gen.device
    per_req = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(per_req)
    shape = (num_blocks, block_size, layout.kv_heads, layout.head_dim)
    k_cache = torch.randn(shape, device=dev, generator=gen).to(dtype)
    v_cache = torch.randn(shape, device=dev, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, device=dev, generator=gen).to(torch.int32)
    block_tables = torch.zeros(len(seq_lens), max(per_req), dtype=torch.int32, device=dev)
    start = 0
    for i, n in enumerate(per_req):
        block_tables[i, :n] = perm[start:start + n]
        start += n
    qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=dev)
    query = torch.randn(sum(q_lens), layout.heads, layout.head_dim, device=dev, generator=gen).to(dtype)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    return query, k_cache, v_cache, block_tables, seq, qsl


def contiguous_kv(k_cache, v_cache, block_tables, seq_lens: list[int]):
    """[B, kv_heads, max_len, d] K and V (padding zeroed) gathered from the paged cache."""
    b, max_len = len(seq_lens), max(seq_lens)
    blocks = block_tables[:, : math.ceil(max_len / k_cache.shape[1])].long()
    out = []
    for cache in (k_cache, v_cache):
        x = cache[blocks].reshape(b, -1, *k_cache.shape[2:])[:, :max_len].transpose(1, 2).contiguous()
        for i, n in enumerate(seq_lens):
            x[i, :, n:] = 0
        out.append(x)
    return out


def rel_error(out: torch.Tensor, expect: torch.Tensor) -> float:
    out, expect = out.float(), expect.float()
    return ((out - expect).abs().max() / expect.abs().max()).item()


def image_prompt(images: int, image_tokens: int = 256, text: int = 60) -> tuple[int, list[tuple[int, int]]]:
    """A camera question's layout: `images` frames of `image_tokens` soft tokens, each between
    two marker tokens after a line of text, then the question: (tokens, each image's [s, e))."""
    spans, pos = [], 20
    for _ in range(images):
        pos += 2  # a newline and <start_of_image>
        spans.append((pos, pos + image_tokens))
        pos += image_tokens + 1  # <end_of_image>
    return pos + text, spans
