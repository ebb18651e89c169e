"""Every family through the whole stack (official openai client → gateway → Redis →
scheduler → gRPC → worker): 24 concurrent greedy requests, prompts longer than the
families' 48-token windows, chunked prefill, preemption and prefix-cache hits, equal to
transformers' generate() token for token in fp32; and chat through each family's own
template equal to apply_chat_template + generate()."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvstore.kv_cache_groups import blocks_per_request, group_layers
from tests.support.runner_helpers import hf_greedy
from tests.support.stack_helpers import greedy_completions, running_stack, wait_until_idle, worker_stats
from modeling.registry import load_config

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3")
NUM_BLOCKS = 40  # 640 token slots for 24 requests needing ~3,000: forces preemption
TOKEN_BUDGET = 64  # prompts over 64 tokens are prefilled in chunks
SHARED = 70  # tokens of prefix that a third of the prompts share: prefix-cache hits


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, family_model_dir, redis_url, tmp_path_factory):
    arch = request.param
    model_dir = family_model_dir(arch)
    with running_stack(model_dir, redis_url, tmp_path_factory.mktemp(f"run-{arch}"),
                       worker_args=("--num-blocks", str(NUM_BLOCKS)),
                       # stats every 50 ms, so that the window test sees its one request's blocks
                       # however fast its steps run
                       scheduler_args=("--max-num-batched-tokens", str(TOKEN_BUDGET),
                                       "--stats-interval", "0.05")) as stack:
        yield (arch, stack, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(),
               AutoTokenizer.from_pretrained(model_dir))



def test_greedy_equals_transformers_with_windows_chunks_preemption_and_prefix_hits(family):
    arch, stack, hf, tokenizer = family
    rng = random.Random(1)
    special = set(tokenizer.all_special_ids)

    def draw(n: int) -> list[int]:
        return [t for t in (rng.randrange(len(tokenizer)) for _ in range(n)) if t not in special]

    shared = draw(SHARED)
    cases = []
    for i in range(24):
        prompt = (shared + draw(rng.randint(5, 60))) if i % 3 == 0 else draw(rng.randint(10, 150))
        cases.append((prompt, rng.randint(1, 30)))

    choices = greedy_completions(stack, cases)
    assert sum(len(p) > 48 for p, _ in cases) >= 16  # most prompts outgrow the windows
    for i, ((prompt, max_tokens), choice) in enumerate(zip(cases, choices)):
        expected = hf_greedy(hf, prompt, max_tokens)
        assert choice.token_ids == expected, (arch, i, len(prompt))
        assert choice.finish_reason == ("length" if len(expected) == max_tokens else "stop")

    (stats,) = wait_until_idle(stack).values()
    assert stats.integrity_error is None
    assert stats.num_free_blocks == stats.num_blocks == NUM_BLOCKS
    assert stats.num_preemptions >= 1, "the pool was meant to be small enough to preempt"
    assert stats.prefix_cache_hits >= 16, "the shared prefix was meant to be found cached"


def test_chat_through_the_family_template_equals_transformers(family):
    arch, stack, hf, tokenizer = family
    messages = [{"role": "system", "content": "Answer in one line."},
                {"role": "user", "content": "What does the scheduler do between two steps?"}]
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)
    resp = client.chat.completions.create(model=stack.served_model_name, messages=messages,
                                          max_tokens=20, temperature=0,
                                          extra_body={"return_token_ids": True})
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
    expected = hf_greedy(hf, list(prompt), 20)
    choice = resp.choices[0]
    assert choice.model_extra["token_ids"] == expected, arch
    assert choice.message.content == tokenizer.decode(expected, skip_special_tokens=True)
    assert resp.usage.prompt_tokens == len(prompt)


def test_a_long_generation_holds_about_a_window_of_blocks(family):
    """A 400-token generation through the stack keeps, in each KV cache group with a window
    (48 tokens, blocks of 16), about window + one block, and every block in a global group:
    Mistral slides every layer (one group), Qwen2 and Gemma 3 some (a global group and two
    sliding ones) -- 27 blocks per group without the windows, 81 for three groups, in a pool
    of 40. It still equals transformers token for token."""
    arch, stack, hf, tokenizer = family
    layout = group_layers(load_config(Path(stack.config.model)).sliding_windows)
    if all(w is None for w in layout.windows):
        pytest.skip("no sliding window")
    per_group = blocks_per_request(layout, 420, 16)
    peak, done = [0], threading.Event()

    def sample():
        while not done.is_set():
            for stats in worker_stats(stack).values():
                if stats.num_running:
                    peak[0] = max(peak[0], stats.num_used_blocks)
            done.wait(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    prompt = list(range(10, 30))
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=300)
    try:
        resp = client.completions.create(model=stack.served_model_name, prompt=prompt, max_tokens=400,
                                         temperature=0,  # min_tokens bans EOS, as min_new_tokens does
                                         extra_body={"return_token_ids": True, "min_tokens": 400})
    finally:
        done.set()
        sampler.join()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=400, min_new_tokens=400, do_sample=False,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    assert resp.choices[0].token_ids == out[0, len(prompt):].tolist()
    # (one block more per group: the next step's may be taken before the step in flight drops one)
    assert 0 < peak[0] <= sum(per_group) + layout.num_groups, (
        f"peak {peak[0]} blocks in use, {per_group} expected; without the windows: {27 * layout.num_groups}")
