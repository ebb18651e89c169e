"""The worker's model runner on a CUDA device (Triton kernels, the cache on the GPU) against
transformers on the same device, per family (`gpu` marker: skipped without CUDA; `make
gpu-check` runs them on a lent GPU).

fp32: greedy tokens equal `generate()` token for token under continuous batching with
chunked prefill, on prompts and generations that cross the tiny presets' 48-token sliding
windows. bf16: there is no token-for-token promise (the two sum in different orders, and
bf16 rounds every layer), so the prefill logits are compared against transformers in bf16
with a tolerance scaled to the logits, and their argmax must agree almost everywhere.
"""

import pytest
import torch
from tests.support.runner_helpers import MiniScheduler, chunked_prefill_logits, make_runner, prompts

# `gpu` comes from the folder (tests/conftest.py)
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3")


def hf_model(model_dir, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to("cuda").eval()


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", FAMILIES)
def test_fp32_greedy_equals_transformers(family_model_dir, arch):
    model_dir = family_model_dir(arch)
    runner = make_runner(model_dir, block_size=16, num_blocks=64, device="cuda", dtype="float32")
    assert runner.backend.name == "triton" and runner.device.type == "cuda"
    sched = MiniScheduler(runner, block_size=16, num_blocks=64, token_budget=40)
    ps = prompts(1, [7, 70, 3, 33, 52])
    max_tokens = [30, 20, 40, 12, 25]
    arrivals = {0: [0, 1], 2: [2], 3: [3], 5: [4]}
    for step in range(200):
        for i in arrivals.get(step, []):
            sched.add(f"r{i}", ps[i], max_tokens[i])
        sched.step()
        if step > 5 and all(r["done"] for r in sched.reqs.values()):
            break
    model = hf_model(model_dir, torch.float32)
    for i, p in enumerate(ps):
        assert sched.outputs(f"r{i}") == hf_greedy(model, p, max_tokens[i]), f"{arch} r{i}"


@pytest.mark.parametrize("arch", FAMILIES)
def test_bf16_prefill_logits_close_to_transformers(family_model_dir, arch):
    model_dir = family_model_dir(arch)
    runner = make_runner(model_dir, block_size=16, num_blocks=32, device="cuda", dtype="bfloat16")
    prompt = prompts(3, [90])[0]
    with torch.no_grad():
        expected = hf_model(model_dir, torch.bfloat16)(torch.tensor([prompt], device="cuda")).logits[0].float()
    got = chunked_prefill_logits(runner, prompt, [50, 1, 39], [30, 2, 17, 5, 9, 0, 11]).float()
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() < 0.05 * scale, arch
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean().item() >= 0.95, arch
