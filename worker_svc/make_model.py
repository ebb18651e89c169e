"""Write a randomly initialised Hugging Face checkpoint folder, made entirely locally.

`make_model(out_dir, preset, seed, arch)` goes through the same save path a real
checkpoint uses: the family's transformers config + `AutoModelForCausalLM.from_config`
(seeded random init), `save_pretrained(safe_serialization=True)`, a tokenizer
`save_pretrained`, and a `generation_config.json`. The folder then loads with
`AutoTokenizer` / `AutoModelForCausalLM` and with our own worker. Families (`arch`: llama,
qwen2, qwen3, mistral, gemma3, gemma3-vision), sizes and what each switches on:
worker_svc/model_presets.py. `gemma3-vision` is Gemma3ForConditionalGeneration (the gemma3
text part, a SigLIP tower, Gemma 3's projector) saved with its processor:
worker_svc/make_vision_model.py says what it writes and how a prompt's images expand.

Tokenizer: a byte-level BPE trained with `tokenizers` on the Python standard library's
own sources (files read in sorted order, capped per preset, so the result is the same on
every run on a given machine), with the family's special tokens at ids 0.. (llama:
`<|endoftext|>` (bos, eos and pad), `<|im_start|>`, `<|im_end|>`; qwen: the same, no BOS;
mistral: `<unk>`, `<s>`, `</s>`, `[INST]`, `[/INST]`; gemma3: `<pad>`, `<eos>`, `<bos>`,
`<unk>`, `<start_of_turn>`, `<end_of_turn>`; gemma3-vision: those, then `<start_of_image>`,
`<image_soft_token>`, `<end_of_image>`, named boi_token, image_token, eoi_token), its EOS
ids in `generation_config.json`, and a chat template in its own format. If the corpus runs
out of merges before the preset's vocab size (the `1b` presets' 128k-262k entries need more
text than the stdlib holds), the rest is filled with `<|reserved_special_token_N|>`
entries, as Llama 3 does for its own tail, so `len(tokenizer) == config.vocab_size` and
every id the model can emit decodes.

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
from pathlib import Path

import torch

from worker_svc.make_vision_model import (
    gemma3_vision_config,
    image_token_ids,
    perturb_vision_weights,
    save_gemma3_processor,
)
from worker_svc.model_presets import (
    ARCHS,
    VISION_ARCHS,
    ChatFlavour,
    family_config,
    flavour,
    shape,
    vision_shape,
)


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


def train_tokenizer(vocab_size: int, corpus_chars: int | None, chat: ChatFlavour):
    """Byte-level BPE over stdlib sources, wrapped as a `PreTrainedTokenizerFast` with the
    family's special tokens (ids 0.. in `chat.specials` order), BOS and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(chat.specials), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_stdlib_texts(corpus_chars), trainer)
    byte_level = processors.ByteLevel(trim_offsets=False)
    if chat.bos is not None and chat.bos != chat.pad:  # a BOS that opens every encoded text
        bos = (chat.bos, chat.specials.index(chat.bos))
        tok.post_processor = processors.Sequence([
            byte_level, processors.TemplateProcessing(single=f"{chat.bos} $A", pair=f"{chat.bos} $A $B",
                                                      special_tokens=[bos])])
    else:
        tok.post_processor = byte_level
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_special_tokens([f"<|reserved_special_token_{i}|>" for i in range(missing)])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=chat.bos, eos_token=chat.eos[0], pad_token=chat.pad,
        unk_token=chat.unk, extra_special_tokens=list(chat.extra), model_max_length=None,
        **dict(chat.named),
    )
    wrapped.chat_template = chat.template
    return wrapped


def make_model(out_dir, preset: str = "tiny", seed: int = 0, arch: str = "llama",
               tokenizer_dir=None) -> Path:
    """Write a random `preset` checkpoint of family `arch` (config, safetensors, tokenizer,
    generation config) into `out_dir` and return its path. Same arch + preset + seed → same
    files. Sizes and each family's switches: worker_svc/model_presets.py. `tokenizer_dir`:
    take the tokenizer this function trained earlier for the same arch and preset from
    that folder instead of training it again (the GPU check carries the `1b` one)."""
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoTokenizer,
        GenerationConfig,
    )

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {ARCHS}")
    s = shape(arch, preset)
    chat = flavour(arch)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    if tokenizer_dir is None:
        tokenizer = train_tokenizer(s.vocab_size, s.corpus_chars, chat)
    else:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        if len(tokenizer) != s.vocab_size or tokenizer.chat_template != chat.template:
            raise ValueError(f"{tokenizer_dir}: not the {arch} {preset} tokenizer "
                             f"({len(tokenizer)} entries, {s.vocab_size} expected)")
    special = dict(zip(chat.specials, tokenizer.convert_tokens_to_ids(list(chat.specials))))
    eos_ids = [special[t] for t in chat.eos]
    bos_id = special[chat.bos] if chat.bos else None
    config = _hf_config(arch, preset, s, bos_id=bos_id, eos_ids=eos_ids, pad_id=special[chat.pad])
    # Seeded, all of it (init and the perturbations below): same seed, same weights,
    # whatever the process drew from the global RNG before.
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG alone
        torch.manual_seed(seed)
        if arch in VISION_ARCHS:
            config = gemma3_vision_config(config, preset, image_token_ids(tokenizer))
            model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            # Final-norm output has unit RMS, so logit std ~ std(W) * sqrt(hidden); aim at
            # `logit_std`. With tied embeddings this rescales the input embedding too, which
            # only changes how loud the embedding is in the residual stream of a random model.
            head = model.get_output_embeddings().weight
            head.mul_(s.logit_std / (head.std() * s.hidden_size**0.5))
            if arch in ("gemma3", "gemma3-vision"):  # norms are offsets from 1 (init 0): make them matter
                for name, param in model.named_parameters():
                    if "norm" in name and "vision_tower" not in name:  # not SigLIP's LayerNorms
                        param.normal_(0.0, 0.1)
            if arch in VISION_ARCHS:
                perturb_vision_weights(model, vision_shape(preset))
    model = model.to(s.dtype)
    model.config.dtype = s.dtype
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    if arch in VISION_ARCHS:
        save_gemma3_processor(out, tokenizer, preset)
    GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_ids, pad_token_id=special[chat.pad],
                     do_sample=False).save_pretrained(out)
    return out


def _hf_config(arch: str, preset: str, s, *, bos_id: int | None, eos_ids: list[int], pad_id: int):
    from transformers import AutoConfig

    model_type = {"gemma3": "gemma3_text", "gemma3-vision": "gemma3_text"}.get(arch, arch)
    return AutoConfig.for_model(
        model_type, vocab_size=s.vocab_size, hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size, num_hidden_layers=s.num_hidden_layers,
        num_attention_heads=s.num_attention_heads, num_key_value_heads=s.num_key_value_heads,
        max_position_embeddings=s.max_position_embeddings, initializer_range=s.initializer_range,
        bos_token_id=bos_id, eos_token_id=eos_ids, pad_token_id=pad_id,
        **{"head_dim": s.hidden_size // s.num_attention_heads, **family_config(arch, preset, s)})
