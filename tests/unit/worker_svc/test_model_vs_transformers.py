"""ModelRunner against transformers on the tiny random checkpoint: greedy tokens equal to
`generate()` under continuous batching, chunked prefill and preemption, and logits close."""

import pytest
import torch
from tests.support.runner_helpers import MiniScheduler, chunked_prefill_logits, hf_greedy, make_runner, prompts

from proto import worker_pb2
from worker_svc.config import RunnerConfig
from modeling.registry import read_config
from worker_svc.model_runner import ModelRunner, StepConsistencyError


def test_continuous_batching_matches_generate(tiny_model_dir, hf_model):
    """Five requests of different lengths arrive over time; a budget of 24 tokens a step
    chunks the long prompts across several steps while others decode."""
    runner = make_runner(tiny_model_dir)
    sched = MiniScheduler(runner, block_size=4, num_blocks=96, token_budget=24)
    ps = prompts(1, [7, 50, 3, 33, 16])
    max_tokens = [12, 9, 15, 6, 10]
    arrivals = {0: [0, 1], 2: [2], 3: [3], 6: [4]}
    for step in range(80):
        for i in arrivals.get(step, []):
            sched.add(f"r{i}", ps[i], max_tokens[i])
        sched.step()
        if step > 6 and all(r["done"] for r in sched.reqs.values()):
            break
    for i, p in enumerate(ps):
        assert sched.outputs(f"r{i}") == hf_greedy(hf_model, p, max_tokens[i]), f"r{i}"
        assert sched.reqs[f"r{i}"]["done"] in ("length", "stop")
    sched.step()  # forgets the finished ones
    assert runner.num_requests == 0


def test_preempted_request_resumes_with_its_tokens(tiny_model_dir, hf_model):
    """A request preempted mid-decode is re-added with prompt + generated tokens (fresh
    blocks, nothing cached) and continues exactly as generate() does."""
    runner = make_runner(tiny_model_dir)
    sched = MiniScheduler(runner, block_size=4, num_blocks=96, token_budget=64)
    ps = prompts(2, [21, 12])
    sched.add("r0", ps[0], 14)
    sched.add("r1", ps[1], 14)
    for _ in range(5):
        sched.step()
    assert 0 < len(sched.outputs("r0")) < 14
    sched.preempt("r0")
    for _ in range(3):  # r1 runs alone for a while
        sched.step()
    sched.resume("r0")
    for _ in range(30):
        sched.step()
        if all(r["done"] for r in sched.reqs.values()):
            break
    for i, p in enumerate(ps):
        assert sched.outputs(f"r{i}") == hf_greedy(hf_model, p, 14), f"r{i}"


def test_prefill_logits_match_transformers(tiny_model_dir, hf_model):
    """All-row logits of a two-chunk prefill (the second chunk reads the first from the
    paged cache) equal transformers' logits for the whole sequence."""
    runner = make_runner(tiny_model_dir, block_size=4, num_blocks=32)
    prompt = prompts(3, [37])[0]
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits[0]
    got = chunked_prefill_logits(runner, prompt, [20, 17], [30, 2, 17, 5, 9, 0, 11, 25, 3, 21])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


VARIANTS = {
    # Llama 3 rope scaling (a small original context, so positions here are affected),
    # tied embeddings, a head_dim that is not hidden / heads, biases, one kv head (MQA).
    "llama3_rope_tied_bias_mqa": dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=24,
        tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16}),
    "no_gqa_eps": dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=3,
                       rms_norm_eps=1e-3),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_config_variants_match_transformers(tmp_path, name):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=300, intermediate_size=96, num_hidden_layers=2,
                         max_position_embeddings=256, initializer_range=0.1, **VARIANTS[name])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        hf = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # biases and norms start at 0 and 1: make them matter
        for pname, param in hf.named_parameters():
            if pname.endswith("bias") or "norm" in pname:
                param.add_(torch.randn_like(param) * 0.1)
    hf.save_pretrained(tmp_path)
    prompt = prompts(4, [45])[0]
    prompt = [t % 300 for t in prompt]
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0]
    runner = ModelRunner(RunnerConfig(model=str(tmp_path), block_size=8, num_blocks=12))
    got = chunked_prefill_logits(runner, prompt, [30, 1, 14], [11, 3, 7, 0, 5, 9])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_reads_transformers_v4_config_spelling():
    cfg = read_config({
        "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
        "num_attention_heads": 2, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
        "rope_scaling": {"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "eos_token_id": 7,
    }, generation={"eos_token_id": [7, 9]})
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.rope[0].theta) == (2, 4, 500000.0)
    assert cfg.rope[0].scaling["rope_type"] == "llama3" and cfg.rope[0].scaling["factor"] == 32.0
    assert cfg.dtype == torch.bfloat16 and cfg.eos_token_ids == (7, 9)


@pytest.mark.parametrize("change, message", [
    ({"num_key_value_heads": 3}, "not a multiple"),
    ({"head_dim": 5}, "head_dim 5 is odd"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}},
     "partial_rotary_factor"),
    ({"dtype": "int8"}, "unsupported dtype"),
])
def test_refuses_configs_it_cannot_run(change, message):
    raw = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
           "num_attention_heads": 2, **change}
    with pytest.raises(ValueError, match=message):
        read_config(raw)


def test_describe_and_consistency_check(tiny_model_dir):
    runner = make_runner(tiny_model_dir, num_blocks=10)
    info = runner.describe()
    assert (info.block_size, info.num_blocks, info.max_model_len) == (4, 10, 1024)
    assert info.vocab_size == 1536 and list(info.eos_token_ids) == [0, 2]
    assert info.model == tiny_model_dir.name
    new = worker_pb2.NewRequestData(request_id="a", token_ids=[5, 6, 7], num_prompt_tokens=3,
                                    block_ids=[1], sampling=worker_pb2.SamplingParams(max_tokens=4))
    runner.step(worker_pb2.StepRequest(step_id=0, new_requests=[new],
                                       num_scheduled_tokens={"a": 3}))
    with pytest.raises(StepConsistencyError, match="num_computed_tokens"):
        runner.step(worker_pb2.StepRequest(
            step_id=1, cached_requests=[worker_pb2.CachedRequestData(request_id="a", num_computed_tokens=2)],
            num_scheduled_tokens={"a": 1}))
    with pytest.raises(StepConsistencyError, match="unknown"):
        runner.step(worker_pb2.StepRequest(step_id=2, num_scheduled_tokens={"zz": 1}))
