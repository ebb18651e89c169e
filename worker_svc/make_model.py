"""Write a randomly initialised Hugging Face checkpoint folder, made entirely locally.

`make_model(out_dir, preset, seed, arch)` goes through the same save path a real
checkpoint uses: `LlamaConfig` + `LlamaForCausalLM(config)` (seeded random init),
`save_pretrained(safe_serialization=True)`, a tokenizer `save_pretrained`, and a
`generation_config.json`. The folder then loads with `AutoTokenizer` /
`AutoModelForCausalLM` and with our own worker.

Tokenizer: a byte-level BPE trained with `tokenizers` on the Python standard library's
own sources (files read in sorted order, capped per preset, so the result is the same on
every run on a given machine). Special tokens `<|endoftext|>` (bos, eos and pad),
`<|im_start|>`, `<|im_end|>` take ids 0, 1, 2; a ChatML `chat_template` supports
`add_generation_prompt`. If the corpus runs out of merges before the preset's vocab size
(the `1b` preset's 128,256 entries need more text than the stdlib holds: about 122k
merges), the rest is filled with `<|reserved_special_token_N|>` entries, as Llama 3 does
for its own tail, so `len(tokenizer) == config.vocab_size` and every id the model can emit
decodes.

Logit separation: with the usual 0.02 init a random model's logits are nearly flat, so
greedy argmax hits near-ties and "equals transformers token for token" becomes a coin
toss at float noise level. `tiny` and `small` draw their weights with a larger
`initializer_range` (sharper attention, more varied outputs), and every preset's LM head
is scaled so the logits have a standard deviation of ~3 (`tiny`, 2000 greedy steps:
median top-1/top-2 gap 0.61, 1st percentile 6e-3, under 1e-3 in 0.15% of steps;
tests/test_make_model.py keeps an eye on it).
"""

import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Preset:
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    dtype: torch.dtype
    corpus_chars: int | None  # None: the whole stdlib, recursively
    initializer_range: float = 0.02
    logit_std: float = 3.0  # the LM head is rescaled to give roughly this logit spread
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None


PRESETS = {
    "tiny": Preset(
        num_hidden_layers=3, hidden_size=64, intermediate_size=176, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1536, max_position_embeddings=1024,
        dtype=torch.float32, corpus_chars=600_000, initializer_range=0.1,
    ),
    "small": Preset(
        num_hidden_layers=8, hidden_size=512, intermediate_size=1376, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048,
        dtype=torch.float32, corpus_chars=5_000_000, initializer_range=0.04,
    ),
    # Llama-3.2-1B shapes (the real one has these exact sizes and rope scaling).
    "1b": Preset(
        num_hidden_layers=16, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
        dtype=torch.bfloat16, corpus_chars=None, initializer_range=0.02,
        tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ),
}


def _stdlib_texts(max_chars: int | None) -> Iterator[str]:
    """Sources of the stdlib in sorted path order; top-level modules only when capped."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if max_chars is None:
        files = sorted(f for f in root.rglob("*.py") if "site-packages" not in f.parts)
    else:
        files = sorted(root.glob("*.py"))
    used = 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if max_chars is not None:
            text = text[: max_chars - used]
            used += len(text)
        yield text
        if max_chars is not None and used >= max_chars:
            return


def train_tokenizer(vocab_size: int, corpus_chars: int | None):
    """Byte-level BPE over stdlib sources, wrapped as a `PreTrainedTokenizerFast`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_stdlib_texts(corpus_chars), trainer)
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_special_tokens([f"<|reserved_special_token_{i}|>" for i in range(missing)])
    eot, im_start, im_end = SPECIAL_TOKENS
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=eot, eos_token=eot, pad_token=eot,
        extra_special_tokens=[im_start, im_end], model_max_length=None,
    )
    wrapped.chat_template = CHATML_TEMPLATE
    return wrapped


def make_model(out_dir, preset: str = "tiny", seed: int = 0, arch: str = "llama") -> Path:
    """Write a random `preset` checkpoint (config, safetensors, tokenizer, generation
    config) into `out_dir` and return its path. Same preset + seed → same files.

    Presets: `tiny` (tests: 3 layers, hidden 64, 4 q / 2 kv heads, vocab 1536, fp32),
    `small` (CPU benchmarks: 8 layers, hidden 512, 8 q / 4 kv heads, vocab 32000, fp32),
    `1b` (Llama-3.2-1B shapes, bf16, tied embeddings, rope_theta 5e5 with llama3 scaling;
    its tokenizer has ~122k trained entries padded with reserved tokens to 128,256).
    """
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if arch != "llama":
        raise ValueError(f"arch {arch!r} is not supported yet (only 'llama')")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    p = PRESETS[preset]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = train_tokenizer(p.vocab_size, p.corpus_chars)
    eot_id, _, im_end_id = tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    rope = {"rope_type": "default", **(p.rope_scaling or {}), "rope_theta": p.rope_theta}
    config = LlamaConfig(
        vocab_size=p.vocab_size, hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size, num_hidden_layers=p.num_hidden_layers,
        num_attention_heads=p.num_attention_heads, num_key_value_heads=p.num_key_value_heads,
        head_dim=p.hidden_size // p.num_attention_heads,
        max_position_embeddings=p.max_position_embeddings, rms_norm_eps=1e-5,
        initializer_range=p.initializer_range, tie_word_embeddings=p.tie_word_embeddings,
        rope_parameters=rope, bos_token_id=eot_id, eos_token_id=[eot_id, im_end_id],
        pad_token_id=eot_id,
    )
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG alone
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Final-norm output has unit RMS, so logit std ~ std(W) * sqrt(hidden); aim at
        # `logit_std`. With tied embeddings this rescales the input embedding too, which
        # only changes how loud the embedding is in the residual stream of a random model.
        head = model.get_output_embeddings().weight
        head.mul_(p.logit_std / (head.std() * p.hidden_size**0.5))
    model = model.to(p.dtype)
    model.config.dtype = p.dtype
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    GenerationConfig(
        bos_token_id=eot_id, eos_token_id=[eot_id, im_end_id], pad_token_id=eot_id,
        do_sample=False,
    ).save_pretrained(out)
    return out
