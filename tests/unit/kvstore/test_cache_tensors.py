"""The worker-side KV cache memory: sizing, layout, block copies."""

import torch

from kvstore.cache_tensors import KVCacheTensors, bytes_per_block, num_blocks_for_memory


def test_sizing():
    per_block = bytes_per_block(num_layers=3, block_size=16, num_kv_heads=2, head_dim=16,
                                dtype=torch.float32)
    assert per_block == 2 * 3 * 16 * 2 * 16 * 4
    assert num_blocks_for_memory(10 * per_block + per_block - 1, 3, 16, 2, 16, torch.float32) == 10
    assert num_blocks_for_memory(per_block, 3, 16, 2, 16, torch.bfloat16) == 2


def test_layout_and_copy_blocks():
    cache = KVCacheTensors(num_layers=2, num_blocks=5, block_size=4, num_kv_heads=2, head_dim=3,
                           dtype=torch.float32)
    assert cache.nbytes == bytes_per_block(2, 4, 2, 3, torch.float32) * 5
    k0, v0 = cache.layer(0)
    assert k0.shape == (5, 4, 2, 3) and k0.is_contiguous() and torch.all(k0 == 0)
    k0.view(-1, 2, 3)[4 * 2 + 1] = 1.0  # slot 9 = block 2, offset 1
    assert torch.all(cache.kv[0, 0, 2, 1] == 1.0) and cache.kv[0].sum() == 6
    cache.k_caches[1][2] = 2.0
    cache.v_caches[1][2] = 3.0
    cache.copy_blocks([(2, 4), (1, 0)])
    assert torch.equal(cache.kv[:, :, 4], cache.kv[:, :, 2])
    assert torch.all(cache.v_caches[1][4] == 3.0) and torch.all(cache.kv[:, :, 0] == 0)
