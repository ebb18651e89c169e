"""Checkpoints as users have them: sharded safetensors with an index (and a second copy of
the weights in another layout beside it, as Mistral's repositories carry), bf16 and fp16
weights, and what the registry refuses, with the supported names in the message."""

import json

import pytest
import torch
from tests.support.runner_helpers import chunked_prefill_logits, make_runner, prompts
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from modeling.registry import read_config
from modeling.loader import INDEX_FILE, weight_files


def test_sharded_checkpoint_with_an_index_loads_and_a_stray_copy_is_ignored(tmp_path, family_model_dir):
    hf = AutoModelForCausalLM.from_pretrained(family_model_dir("qwen3"), dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path, max_shard_size="60KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (tmp_path / name).write_bytes((family_model_dir("qwen3") / name).read_bytes())
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3
    save_file({"layers.0.attention.wq.weight": torch.zeros(4, 4)}, tmp_path / "consolidated.safetensors")
    assert [f.name for f in weight_files(tmp_path)] == shards
    prompt = prompts(8, [60])[0]
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0]
    got = chunked_prefill_logits(make_runner(tmp_path, block_size=8, num_blocks=10), prompt, [60],
                                 list(range(8)))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_an_index_naming_a_missing_shard_is_refused(tmp_path):
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002"):
        weight_files(tmp_path)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoints_load_in_their_dtype(tmp_path, family_model_dir, dtype):
    """Served in the checkpoint's dtype when asked for it by name (what "auto" picks on a
    CPU depends on its instructions: tests/unit/modeling/test_dtype.py)."""
    source = family_model_dir("gemma3")
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).eval()
    hf.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
    runner = make_runner(tmp_path, block_size=8, num_blocks=10, dtype=str(dtype).removeprefix("torch."))
    assert runner.dtype == dtype and runner.kv_cache.k_caches[0].dtype == dtype
    prompt = prompts(9, [40])[0]
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].float()
    got = chunked_prefill_logits(runner, prompt, [40], list(range(5))).float()
    assert (got - expected).abs().max() < 0.25
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.95


BASE = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
        "num_attention_heads": 2}


@pytest.mark.parametrize("raw, message", [
    ({"architectures": ["Phi3ForCausalLM"]}, r"unsupported architecture 'Phi3ForCausalLM'; supported: "
                                             r"Gemma3ForCausalLM, Gemma3ForConditionalGeneration, "
                                             r"LlamaForCausalLM, MistralForCausalLM, "
                                             r"Qwen2ForCausalLM, Qwen3ForCausalLM"),
    ({"architectures": ["LlavaForConditionalGeneration"], "text_config": {}},
     "a vision-language checkpoint: of those only Gemma3ForConditionalGeneration is served"),
    ({"architectures": ["Qwen2ForCausalLM"], "rope_scaling": {"type": "yarn", "factor": 4.0}},
     "unsupported rope_type 'yarn'"),
    ({"architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": True}, "embedding model"),
    ({"architectures": ["Gemma3ForCausalLM"], "hidden_activation": "relu", "sliding_window": 4},
     "unsupported hidden activation"),
    ({"architectures": ["Gemma3ForCausalLM"], "layer_types": ["sliding_attention", "chunked_attention"],
      "sliding_window": 4}, "unsupported layer_types"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": None,
      "max_window_layers": 0}, "sliding_window is not set"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 0}, "sliding_window must be >= 1"),
])
def test_refused_at_load_with_what_is_supported(raw, message):
    with pytest.raises(ValueError, match=message):
        read_config({**BASE, **raw})


def test_qwen2_windows_only_with_use_sliding_window():
    """As transformers reads it: `sliding_window` alone (the released checkpoints carry one)
    changes nothing; with `use_sliding_window`, layers from `max_window_layers` on slide."""
    off = read_config({**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 4,
                                   "num_hidden_layers": 3})
    on = read_config({**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 4,
                                  "num_hidden_layers": 3, "use_sliding_window": True, "max_window_layers": 2})
    assert off.sliding_windows == (None, None, None)
    assert on.sliding_windows == (None, None, 4)


def test_gemma3_reads_the_older_rope_spelling():
    cfg = read_config({**BASE, "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 6,
                                   "rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window": 4,
                                   "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert [r.theta for r in cfg.rope] == [1e4] * 5 + [1e6]
    assert cfg.rope[5].scaling == {"rope_type": "linear", "factor": 8.0}
    assert cfg.sliding_windows == (4,) * 5 + (None,)
