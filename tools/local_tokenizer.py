"""The tokenizers `make-model` trains here: a byte-level BPE over the Python standard
library's own sources (files read in sorted order, capped per preset, so the result is the
same on every run on a given machine), wrapped as a `PreTrainedTokenizerFast` with a family's
special tokens, BOS and chat template (tools/model_presets.py's `ChatFlavour`).
tools/release_tokenizer.py lays one out at a real release's special-token ids."""

import sysconfig
from collections.abc import Iterator
from pathlib import Path

from tools.model_presets import ChatFlavour


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


def train_bpe(vocab_size: int, corpus_chars: int | None, specials: list[str]):
    """A byte-level BPE (`tokenizers.Tokenizer`) over stdlib sources, `specials` at ids 0.."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_stdlib_texts(corpus_chars), trainer)
    return tok


def wrap_tokenizer(tok, chat: ChatFlavour):
    """`tok` with the family's post-processor (a BOS opening every encoded text, where the
    family has one apart from its pad) as a `PreTrainedTokenizerFast` naming its special
    tokens, with the family's chat template."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    byte_level = processors.ByteLevel(trim_offsets=False)
    if chat.bos is not None and chat.bos != chat.pad:
        bos = (chat.bos, tok.token_to_id(chat.bos))
        tok.post_processor = processors.Sequence([
            byte_level, processors.TemplateProcessing(single=f"{chat.bos} $A", pair=f"{chat.bos} $A $B",
                                                      special_tokens=[bos])])
    else:
        tok.post_processor = byte_level
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=chat.bos, eos_token=chat.eos[0], pad_token=chat.pad,
        unk_token=chat.unk, extra_special_tokens=list(chat.extra), model_max_length=None,
        **dict(chat.named),
    )
    wrapped.chat_template = chat.template
    return wrapped


def train_tokenizer(vocab_size: int, corpus_chars: int | None, chat: ChatFlavour):
    """Byte-level BPE over stdlib sources, wrapped as a `PreTrainedTokenizerFast` with the
    family's special tokens (ids 0.. in `chat.specials` order), BOS and chat template."""
    tok = train_bpe(vocab_size, corpus_chars, list(chat.specials))
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_special_tokens([f"<|reserved_special_token_{i}|>" for i in range(missing)])
    return wrap_tokenizer(tok, chat)
