"""make_model writes a checkpoint transformers loads, with a working tokenizer and chat
template, deterministically, and with logits separated enough for greedy comparisons."""

import json

import pytest
import torch

from tools.make_model import make_model


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoTokenizer.from_pretrained(tiny_model_dir),
            AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval())


def test_loads_with_transformers(tiny_model_dir, hf):
    tokenizer, model = hf
    cfg = model.config
    assert cfg.num_attention_heads == 4 and cfg.num_key_value_heads == 2
    assert cfg.vocab_size == len(tokenizer) == 1536
    ids = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert ids == [0, 1, 2]
    assert tokenizer.eos_token_id == tokenizer.bos_token_id == 0
    generation = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [0, 2]
    text = "def main(argv):\n    return sorted(argv)  # ünïcode ✓\n"
    encoded = tokenizer(text)["input_ids"]
    assert tokenizer.decode(encoded) == text
    code = "    def __init__(self, name):\n        self.name = name\n        return None\n"
    assert len(tokenizer(code)["input_ids"]) < len(code) / 3  # merges learned from stdlib sources
    with torch.no_grad():
        logits = model(torch.tensor([encoded])).logits
    assert logits.shape == (1, len(encoded), 1536) and torch.isfinite(logits).all()


def test_chat_template_renders(hf):
    tokenizer, _ = hf
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
                    "<|im_start|>assistant\n")
    plain = tokenizer.apply_chat_template(messages, tokenize=False)
    assert not plain.endswith("assistant\n")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and ids.count(2) == 2  # markers are single special tokens


def test_deterministic_for_a_seed(tmp_path, tiny_model_dir):
    again = make_model(tmp_path / "again", preset="tiny", seed=0)
    other = make_model(tmp_path / "other", preset="tiny", seed=1)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json"):
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()


def test_unknown_preset_and_arch_are_refused(tmp_path):
    with pytest.raises(ValueError, match="preset"):
        make_model(tmp_path, preset="huge")
    with pytest.raises(ValueError, match="arch"):
        make_model(tmp_path, arch="mamba")


def test_greedy_logits_are_well_separated(hf):
    """Greedy top-1/top-2 gaps stay far above float noise, so token-for-token comparisons
    with transformers are not decided by rounding."""
    _, model = hf
    g = torch.Generator().manual_seed(0)
    gaps = []
    for length in (5, 23, 61):
        prompt = torch.randint(3, 1536, (1, length), generator=g)
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                 max_new_tokens=40, min_new_tokens=40, output_scores=True,
                                 return_dict_in_generate=True)
        for scores in out.scores:
            top2 = scores[0].topk(2).values
            gaps.append(float(top2[0] - top2[1]))
    gaps = torch.tensor(gaps)
    assert gaps.median() > 0.1
    assert (gaps < 1e-3).float().mean() < 0.01
