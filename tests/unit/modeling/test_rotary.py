"""modeling/layers.RotaryEmbedding's tables, rotated by the layer ops
(kernels/torch_layer_ops.py rope_write_kv: query and key heads together, from the fused
projection's output, the keys straight into the cache) against transformers' Llama RoPE,
bit for bit."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from kernels import torch_layer_ops
from modeling.layers import RotaryEmbedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_rotate_equals_transformers(dtype, scaling):
    heads, kv_heads, head_dim, max_pos = 6, 2, 32, 512
    config = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=max_pos, rope_theta=10000.0, rope_scaling=scaling)
    gen = torch.Generator().manual_seed(0)
    positions = torch.randint(0, max_pos, (37,), generator=gen)
    # The fused projection's output: q heads, k heads, v heads side by side per token.
    qkv = torch.randn(37, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : heads * head_dim].view(37, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(37, kv_heads, head_dim)

    ref = LlamaRotaryEmbedding(config)
    cos, sin = ref(qkv, positions[None, :])  # [1, T, head_dim], in the input's dtype
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)

    ours = RotaryEmbedding(head_dim, max_pos, 10000.0, scaling, dtype, torch.device("cpu"))
    k_cache = torch.full((5, 8, kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    slots = torch.randperm(40, generator=gen)[:37]
    got_q = torch_layer_ops.rope_write_kv(qkv, positions, ours.cos, ours.sin, heads, kv_heads, head_dim,
                                          k_cache, v_cache, slots)
    assert torch.equal(got_q, want_q[0].transpose(0, 1))
    assert torch.equal(k_cache.view(-1, kv_heads, head_dim)[slots], want_k[0].transpose(0, 1))
    v = qkv[:, (heads + kv_heads) * head_dim:].view(37, kv_heads, head_dim)
    assert torch.equal(v_cache.view(-1, kv_heads, head_dim)[slots], v)
