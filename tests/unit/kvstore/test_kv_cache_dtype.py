"""`--kv-cache-dtype bfloat16`: an fp32 model's K/V kept in bf16 (kvstore/cache_tensors.py).

Quality, stated: on every family's `tiny` checkpoint (logits' std ~3), a 120-token prompt
prefilled in chunks (one long chunk through the torch backend's gather, then short ones
through the C kernel, each reading the bf16 K/V the chunks before wrote), its logits against
the same model with an fp32 cache: mean |difference| at most MEAN_DIFF, max at most
MAX_DIFF, and the greedy (argmax) token the same on at least ARGMAX_AGREEMENT of the rows.
Measured on three prompts per family (an Intel Xeon, 2 cores): mean 0.003-0.007, max
0.023-0.088, agreement 0.983-1.0.
"""

import pytest
import torch
from tests.support.runner_helpers import chunked_prefill_logits, make_runner, prompts

from kvstore.cache_tensors import bytes_per_block, resolve_kv_cache_dtype

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3")
MEAN_DIFF, MAX_DIFF, ARGMAX_AGREEMENT = 0.02, 0.25, 0.95
CHUNKS = [96, 8, 8, 4, 2, 1, 1]  # 120 tokens: a gathered prefill, then C-kernel rows


def test_the_cache_dtype_is_resolved_against_the_model_and_the_device():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_kv_cache_dtype("auto", torch.float32, cpu)[0] == torch.float32
    assert resolve_kv_cache_dtype("auto", torch.float16, cuda)[0] == torch.float16
    assert resolve_kv_cache_dtype("bfloat16", torch.float32, cpu) == (torch.bfloat16, "--kv-cache-dtype bfloat16")
    assert resolve_kv_cache_dtype("bfloat16", torch.bfloat16, cuda)[0] == torch.bfloat16  # the model's already
    assert resolve_kv_cache_dtype("bfloat16", torch.float16, cpu)[0] == torch.float16  # as small: kept
    with pytest.raises(ValueError, match="runs on the CPU only"):
        resolve_kv_cache_dtype("bfloat16", torch.float32, cuda)
    with pytest.raises(ValueError, match="unknown KV cache dtype 'fp8'"):
        resolve_kv_cache_dtype("fp8", torch.float32, cpu)


def test_a_bf16_cache_holds_twice_the_blocks_in_the_same_memory(family_model_dir):
    model_dir = family_model_dir("llama")
    fp32 = make_runner(model_dir, block_size=8, num_blocks=None, kv_cache_memory_bytes=2**20,
                       swap_space_bytes=2**19)
    bf16 = make_runner(model_dir, block_size=8, num_blocks=None, kv_cache_memory_bytes=2**20,
                       swap_space_bytes=2**19, kv_cache_dtype="bfloat16")
    cfg = fp32.model_config
    per_block = bytes_per_block(cfg.num_layers, 8, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    assert bf16.kv_cache.num_blocks == 2**20 // per_block
    assert bf16.kv_cache.num_blocks in (2 * fp32.kv_cache.num_blocks, 2 * fp32.kv_cache.num_blocks + 1)
    assert bf16.cpu_cache.num_blocks in (2 * fp32.cpu_cache.num_blocks, 2 * fp32.cpu_cache.num_blocks + 1)
    assert bf16.dtype == torch.float32  # weights and activations stay fp32
    assert bf16.kv_cache.k_caches[0].dtype == bf16.cpu_cache.v_caches[0].dtype == torch.bfloat16
    assert bf16.describe().num_blocks == bf16.kv_cache.num_blocks  # what the scheduler sizes its pool by


@pytest.mark.parametrize("arch", FAMILIES)
def test_bf16_cache_logits_and_greedy_tokens_close_to_fp32(arch, family_model_dir):
    model_dir = family_model_dir(arch)
    prompt = prompts(13, [sum(CHUNKS)])[0]
    blocks = list(range(15))
    ref = chunked_prefill_logits(make_runner(model_dir, block_size=8, num_blocks=40), prompt, CHUNKS, blocks)
    runner = make_runner(model_dir, block_size=8, num_blocks=40, kv_cache_dtype="bfloat16")
    assert runner.backend.name == "cpu"  # the C kernel reads the bf16 cache for the short chunks
    got = chunked_prefill_logits(runner, prompt, CHUNKS, blocks)
    assert got.dtype == torch.float32
    diff = (got - ref).abs()
    agree = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    assert 0 < diff.mean() <= MEAN_DIFF and diff.max() <= MAX_DIFF, (arch, diff.mean(), diff.max())
    assert agree >= ARGMAX_AGREEMENT, (arch, agree)
