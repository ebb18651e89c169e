"""Write a randomly initialised Hugging Face checkpoint folder, made entirely locally.

`make_model(out_dir, preset, seed, arch)` goes through the same save path a real
checkpoint uses: the family's transformers config + `AutoModelForCausalLM.from_config`
(seeded random init), `save_pretrained(safe_serialization=True)`, a tokenizer
`save_pretrained`, and a `generation_config.json`. The folder then loads with
`AutoTokenizer` / `AutoModelForCausalLM` and with our own worker. Families (`arch`: llama,
qwen2, qwen3, mistral, gemma3, gemma3-vision), sizes and what each switches on:
tools/model_presets.py. `gemma3-vision` is Gemma3ForConditionalGeneration (the gemma3
text part, a SigLIP tower, Gemma 3's projector) saved with its processor:
tools/make_vision_model.py says what it writes and how a prompt's images expand.

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
tests/unit/tools/test_make_model.py keeps an eye on it).
"""

from pathlib import Path

import torch

from tools.make_vision_model import (
    gemma3_vision_config,
    image_token_ids,
    perturb_vision_weights,
    save_gemma3_processor,
)
from tools.local_tokenizer import train_tokenizer
from tools.release_tokenizer import TOKENIZER_SIZE, release_tokenizer
from tools.model_presets import (
    ARCHS,
    RELEASES,
    VISION_ARCHS,
    family_config,
    flavour,
    shape,
    vision_shape,
)


def make_model(out_dir, preset: str = "tiny", seed: int = 0, arch: str = "llama",
               tokenizer_dir=None, config_only: bool = False) -> Path:
    """Write a random `preset` checkpoint of family `arch` (config, safetensors, tokenizer,
    generation config) into `out_dir` and return its path. Same arch + preset + seed → same
    files. Sizes and each family's switches: tools/model_presets.py. `tokenizer_dir`:
    take the tokenizer this function trained earlier for the same arch and preset from
    that folder instead of training it again (the GPU check carries the `1b` one).
    `config_only`: everything but the weights, for `--load-format dummy`; the Gemma 3
    releases' presets (`gemma-3-4b-it`, ...) are written that way only, with their published
    configs and a tokenizer whose special tokens sit at the real ids
    (tools/release_tokenizer.py)."""
    from transformers import AutoTokenizer, GenerationConfig

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {ARCHS}")
    s = shape(arch, preset)
    release = preset in RELEASES
    if release and not config_only:
        raise ValueError(f"preset {preset!r} is the configuration of Google's release: write it with "
                         "--config-only and serve it with --load-format dummy (or serve the real checkpoint)")
    chat = flavour(arch)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    if tokenizer_dir is None:
        tokenizer = (release_tokenizer(chat, s.corpus_chars) if release
                     else train_tokenizer(s.vocab_size, s.corpus_chars, chat))
    else:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        size = TOKENIZER_SIZE if release else s.vocab_size
        if len(tokenizer) != size or tokenizer.chat_template != chat.template:
            raise ValueError(f"{tokenizer_dir}: not the {arch} {preset} tokenizer "
                             f"({len(tokenizer)} entries, {size} expected)")
    special = dict(zip(chat.specials, tokenizer.convert_tokens_to_ids(list(chat.specials))))
    eos_ids = [special[t] for t in chat.eos]
    bos_id = special[chat.bos] if chat.bos else None
    config = _hf_config(arch, preset, s, bos_id=bos_id, eos_ids=eos_ids, pad_id=special[chat.pad])
    if arch in VISION_ARCHS:
        config = gemma3_vision_config(config, preset, image_token_ids(tokenizer))
    if config_only:
        config.architectures = [ARCHITECTURES[arch]]
        config.dtype = s.dtype
        config.save_pretrained(out)
    else:
        _save_random_weights(out, config, arch, preset, s, seed)
    tokenizer.save_pretrained(out)
    if arch in VISION_ARCHS:
        save_gemma3_processor(out, tokenizer, preset)
    sampling = RELEASE_SAMPLING if release else dict(do_sample=False)
    GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_ids, pad_token_id=special[chat.pad],
                     **sampling).save_pretrained(out)
    return out


ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM", "gemma3": "Gemma3ForCausalLM",
                 "gemma3-vision": "Gemma3ForConditionalGeneration"}
# generation_config.json of the Gemma 3 releases, beside their token ids
RELEASE_SAMPLING = dict(do_sample=True, top_k=64, top_p=0.95, cache_implementation="hybrid")


def _save_random_weights(out: Path, config, arch: str, preset: str, s, seed: int) -> None:
    """The model of `config` with seeded random weights made to matter, saved in safetensors."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    # Seeded, all of it (init and the perturbations below): same seed, same weights,
    # whatever the process drew from the global RNG before.
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG alone
        torch.manual_seed(seed)
        if arch in VISION_ARCHS:
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
