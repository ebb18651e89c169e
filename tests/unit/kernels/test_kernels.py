"""Paged-cache kernels: the torch backend against the plain references, and the reference
paged attention against dense causal attention on contiguous K/V."""

import math
import os

import pytest
import torch
import torch.nn.functional as F

from kernels import torch_attention
from kernels.backend import get_attention_backend
from kernels.reference import (
    copy_blocks_reference,
    paged_attention_reference,
    write_kv_reference,
)

FP32 = dict(atol=2e-5, rtol=1e-5)


def make_case(seed, reqs, *, block_size=16, num_heads=8, num_kv_heads=2, head_dim=32,
              dtype=torch.float32, share_first_block=False):
    """Random caches and a flat batch. `reqs` is a list of (seq_len, q_len); physical
    blocks are a random permutation (scattered), optionally with every request reusing the
    first request's first block (repeated physical block, as a prefix-cache hit would)."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_req = [math.ceil(s / block_size) for s, _ in reqs]
    num_blocks = sum(blocks_per_req) + 5
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(blocks_per_req) + 2  # padding columns the kernels must ignore
    block_tables = torch.full((len(reqs), max_blocks), 0, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_req):
        block_tables[i, :n] = torch.tensor(perm[used : used + n], dtype=torch.int32)
        used += n
    if share_first_block:
        block_tables[:, 0] = block_tables[0, 0]
    q_lens = [q for _, q in reqs]
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)
    seq_lens = torch.tensor([s for s, _ in reqs], dtype=torch.int32)
    return query, k_cache, v_cache, block_tables, seq_lens, query_start_loc


MIXES = {
    "decode_only": [(1, 1), (17, 1), (64, 1), (100, 1), (33, 1)],
    "prefill_only": [(5, 5), (16, 16), (40, 40), (1, 1)],
    "chunked_with_context": [(48, 16), (70, 13), (33, 32)],
    "mixed": [(50, 1), (37, 37), (90, 25), (1, 1), (16, 1), (129, 64), (7, 7)],
    "single_long": [(300, 300)],
}


@pytest.mark.parametrize("name", sorted(MIXES))
@pytest.mark.parametrize("block_size", [16, 5])
def test_torch_paged_attention_matches_reference(name, block_size):
    for seed, share in [(1, False), (2, True)]:
        query, k_cache, v_cache, bt, seq_lens, qsl = make_case(
            seed + block_size, MIXES[name], block_size=block_size, share_first_block=share)
        scale = query.shape[-1] ** -0.5
        ref = paged_attention_reference(query, k_cache, v_cache, bt, seq_lens, qsl, scale)
        out = torch.full_like(query, float("nan"))
        torch_attention.paged_attention(query, k_cache, v_cache, bt, seq_lens, qsl, scale, out=out)
        torch.testing.assert_close(out, ref, **FP32)


@pytest.mark.parametrize("sliding_window,soft_cap", [(8, None), (None, 5.0), (20, 3.0)])
def test_torch_paged_attention_window_and_soft_cap(sliding_window, soft_cap):
    query, k_cache, v_cache, bt, seq_lens, qsl = make_case(7, MIXES["mixed"], block_size=8)
    scale = 0.2
    ref = paged_attention_reference(query, k_cache, v_cache, bt, seq_lens, qsl, scale,
                                    sliding_window=sliding_window, soft_cap=soft_cap)
    out = torch.full_like(query, float("nan"))
    torch_attention.paged_attention(query, k_cache, v_cache, bt, seq_lens, qsl, scale,
                                    sliding_window=sliding_window, soft_cap=soft_cap, out=out)
    torch.testing.assert_close(out, ref, **FP32)


def test_plan_is_reusable_across_layers():
    query, k_cache, v_cache, bt, seq_lens, qsl = make_case(11, MIXES["mixed"])
    plan = torch_attention.plan_attention(bt, seq_lens, qsl, k_cache.shape[1])
    for layer_seed in range(3):
        g = torch.Generator().manual_seed(100 + layer_seed)
        k2 = torch.randn(k_cache.shape, generator=g)
        v2 = torch.randn(v_cache.shape, generator=g)
        ref = paged_attention_reference(query, k2, v2, bt, seq_lens, qsl, 0.1)
        out = torch_attention.paged_attention(query, k2, v2, bt, seq_lens, qsl, 0.1, plan=plan)
        torch.testing.assert_close(out, ref, **FP32)


def test_one_workspace_serves_batches_of_any_size():
    """A long-lived workspace grows and shrinks its views as batches change."""
    workspace = torch_attention.GatherWorkspace()
    for seed, name in enumerate(["single_long", "decode_only", "mixed", "prefill_only", "single_long"]):
        query, k_cache, v_cache, bt, seq_lens, qsl = make_case(50 + seed, MIXES[name])
        plan = torch_attention.plan_attention(bt, seq_lens, qsl, k_cache.shape[1], workspace=workspace)
        ref = paged_attention_reference(query, k_cache, v_cache, bt, seq_lens, qsl, 0.2)
        out = torch_attention.paged_attention(query, k_cache, v_cache, bt, seq_lens, qsl, 0.2, plan=plan)
        torch.testing.assert_close(out, ref, **FP32)


def test_bf16_close_to_reference():
    query, k_cache, v_cache, bt, seq_lens, qsl = make_case(
        5, MIXES["mixed"], dtype=torch.bfloat16)
    ref = paged_attention_reference(query, k_cache, v_cache, bt, seq_lens, qsl, 0.15)
    out = torch_attention.paged_attention(query, k_cache, v_cache, bt, seq_lens, qsl, 0.15)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("q_len", [1, 9, 40])
@pytest.mark.parametrize("window", [None, 6])
def test_reference_matches_dense_causal_attention(q_len, window):
    """Blocks 0..n-1 in order make the cache one contiguous sequence: the paged reference
    must equal plain masked attention over it (last q_len rows of the full causal matrix)."""
    seq_len, block_size, num_heads, num_kv_heads, head_dim = 40, 8, 6, 3, 16
    g = torch.Generator().manual_seed(q_len * 10 + (window or 0))
    k = torch.randn(seq_len, num_kv_heads, head_dim, generator=g)
    v = torch.randn(seq_len, num_kv_heads, head_dim, generator=g)
    q = torch.randn(seq_len, num_heads, head_dim, generator=g)
    num_blocks = seq_len // block_size
    k_cache = k.view(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = v.view(num_blocks, block_size, num_kv_heads, head_dim)
    bt = torch.arange(num_blocks, dtype=torch.int32)[None]
    group = num_heads // num_kv_heads
    mask = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    if window is not None:
        mask &= ~torch.ones(seq_len, seq_len, dtype=torch.bool).tril(-window)
    dense = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(group, 1).transpose(0, 1),
        v.repeat_interleave(group, 1).transpose(0, 1), attn_mask=mask, scale=0.3,
    ).transpose(0, 1)[-q_len:]
    out = paged_attention_reference(
        q[-q_len:].contiguous(), k_cache, v_cache, bt, torch.tensor([seq_len], dtype=torch.int32),
        torch.tensor([0, q_len], dtype=torch.int32), 0.3, sliding_window=window)
    torch.testing.assert_close(out, dense, **FP32)


def test_write_kv_matches_reference_and_skips_padding():
    g = torch.Generator().manual_seed(3)
    num_blocks, block_size, kvh, d = 6, 4, 2, 8
    slots = torch.tensor([5, 0, 23, -1, 9, 10, 11, 12, -1, 3])
    key = torch.randn(len(slots), kvh, d, generator=g)
    value = torch.randn(len(slots), kvh, d, generator=g)
    caches = [torch.randn(num_blocks, block_size, kvh, d, generator=g) for _ in range(2)]
    ref_k, ref_v = caches[0].clone(), caches[1].clone()
    write_kv_reference(key, value, ref_k, ref_v, slots)
    k, v = caches[0].clone(), caches[1].clone()
    get_attention_backend("torch").write_kv(key, value, k, v, slots.to(torch.int32))
    torch.testing.assert_close(k, ref_k, atol=0, rtol=0)
    torch.testing.assert_close(v, ref_v, atol=0, rtol=0)
    assert torch.equal(ref_k[23 // block_size, 23 % block_size], key[2])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[[s for s in slots.tolist() if s >= 0]] = False
    assert torch.equal(k.view(-1, kvh, d)[untouched], caches[0].view(-1, kvh, d)[untouched])


def test_copy_blocks_matches_reference():
    g = torch.Generator().manual_seed(4)
    k = torch.randn(8, 4, 2, 8, generator=g)
    v = torch.randn(8, 4, 2, 8, generator=g)
    pairs = [(1, 5), (2, 0), (7, 3)]
    ref_k, ref_v = k.clone(), v.clone()
    copy_blocks_reference(ref_k, ref_v, pairs)
    torch_attention.copy_blocks(k, v, pairs)
    assert torch.equal(k, ref_k) and torch.equal(v, ref_v)
    assert torch.equal(k[5], k[1])


def test_backend_selector():
    assert get_attention_backend("auto", "cpu").name == "cpu"  # the C decode kernel (test_cpu_kernel.py)
    assert get_attention_backend("torch", "cpu").name == "torch"
    if os.environ.get("TRITON_INTERPRET", "0") == "0":  # compiled Triton needs CUDA
        pytest.importorskip("triton")
        with pytest.raises(ValueError, match="CUDA"):
            get_attention_backend("triton", "cpu")
    with pytest.raises(ValueError, match="unknown"):
        get_attention_backend("flash", "cpu")
