"""A local tokenizer with the special tokens of Google's Gemma 3 releases at their real ids,
for `make-model --preset gemma-3-*-it --config-only`: a prompt rendered and expanded by it
has the ids a real checkpoint's tokenizer gives every special token (the turns, BOS, the
three image tokens), so the soft tokens land where a real checkpoint's would and
`--load-format dummy` serves the release's real shapes without its files.

The ids (Gemma 3's tokenizer, 262,145 entries; the model's vocabulary is 262,208):

    0 <pad>   1 <eos>   2 <bos>   3 <unk>   4 <mask>   5 [multimodal]   6.. <unused0>..
    105 <start_of_turn>   106 <end_of_turn>
    255999 <start_of_image>   256000 <end_of_image>   262144 <image_soft_token>

Between them: a byte-level BPE trained on the standard library's sources
(tools/local_tokenizer.py's `train_bpe`) from id 107 up, then one unreachable
placeholder `<token_N>` for each id of the real vocabulary's words this tokenizer does not have
(no merge makes one, so text never encodes to them; an id the model emits decodes to its placeholder). Only the special
tokens' ids are the release's: ordinary text encodes to other ids than on a real checkpoint.
"""

import json

from tools.local_tokenizer import train_bpe, wrap_tokenizer
from tools.model_presets import ChatFlavour

LOW_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "[multimodal]",
                *(f"<unused{i}>" for i in range(99)), "<start_of_turn>", "<end_of_turn>")  # ids 0..106
HIGH_SPECIALS = {"<start_of_image>": 255999, "<end_of_image>": 256000, "<image_soft_token>": 262144}
TOKENIZER_SIZE = 262145
TRAINED_SIZE = 8192  # BPE entries (specials included) learned from text


def release_tokenizer(chat: ChatFlavour, corpus_chars: int):
    """A `PreTrainedTokenizerFast` of `TOKENIZER_SIZE` entries with Gemma 3's special tokens
    at their real ids, `chat`'s names, BOS and template (the `gemma3-vision` flavour)."""
    from tokenizers import AddedToken, Tokenizer

    tok = train_bpe(TRAINED_SIZE, corpus_chars, list(LOW_SPECIALS))
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    if sorted(vocab.values()) != list(range(len(vocab))):
        raise RuntimeError("the trained BPE's ids are not 0..n-1")
    for token, token_id in HIGH_SPECIALS.items():
        vocab[token] = token_id
    taken = set(vocab.values())
    vocab.update({f"<token_{i}>": i for i in range(TOKENIZER_SIZE) if i not in taken})
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in HIGH_SPECIALS])
    wrapped = wrap_tokenizer(tok, chat)
    misplaced = {t: wrapped.convert_tokens_to_ids(t) for t in (*LOW_SPECIALS, *HIGH_SPECIALS)}
    misplaced = {t: i for t, i in misplaced.items() if i != _real_id(t)}
    if misplaced or len(wrapped) != TOKENIZER_SIZE:
        raise RuntimeError(f"special tokens away from their real ids: {misplaced}; {len(wrapped)} entries")
    return wrapped


def _real_id(token: str) -> int:
    return HIGH_SPECIALS[token] if token in HIGH_SPECIALS else LOW_SPECIALS.index(token)
